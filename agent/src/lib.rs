//! sluice-agent: the engine of `sluiced`, the per-node agent.
//!
//! One module per job the agent does: [`server`] (the socket), [`agent`] (jobs and authorisation),
//! [`stage`] (origin → hot tier), [`posix_copy`] (the user-identity copy helper), [`journal`] (durable
//! state). The archive engine, the site config, store clients and root-safe file access live in
//! `sluice-archive`, shared with the CLI.
#![forbid(unsafe_code)]

pub mod agent;
pub mod ckpt;
mod ckpt_worker;
pub mod job;
pub mod journal;
pub mod posix_copy;
pub mod server;
pub mod stage;
