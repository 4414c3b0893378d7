//! sluice-agent: the engine of `sluiced`, the per-node agent.
//!
//! One module per job the agent does: [`config`] (TOML → validated config), [`server`] (the socket),
//! [`agent`] (jobs and authorisation), [`stage`] (origin → hot tier), [`posix_copy`] (the user-identity
//! copy helper), [`safefs`] (root-safe file operations), [`journal`] (durable state), [`store`]
//! (object-store clients).
#![forbid(unsafe_code)]

pub mod agent;
pub mod archive;
pub mod ckpt;
mod ckpt_worker;
pub mod config;
pub mod job;
pub mod journal;
pub mod posix_copy;
pub mod safefs;
pub mod server;
pub mod stage;
pub mod store;
