//! sluice-proto: what the SPANK plugin, the agent and the CLI must agree on.
//!
//! - [`options`]: the user-facing job options (`--stage-in`, `--ckpt-keep`, ...), parsed and validated
//!   in one place so that the submit-time check (plugin) and the root-side re-check (agent) can never
//!   disagree.
//! - [`msg`]: request and response types that cross the agent's Unix socket.
//! - [`wire`]: length-prefixed, versioned frames with hard size limits.
//! - [`hostlist`]: expansion of Slurm node lists (`n[1-3]`), capped.
//! - [`summary`]: what a job's user reads about sluice in the job output (and human byte sizes).
//! - [`client`]: a small blocking client with deadlines, usable from slurmstepd (no threads, no tokio).
//!
//! Feature `testing` gives the crates above example messages for their tests (`testing`).
// Unsafe code is refused outside tests (one test resets a signal disposition).
#![cfg_attr(not(test), forbid(unsafe_code))]
#![cfg_attr(test, deny(unsafe_code))]

pub mod client;
pub mod hostlist;
pub mod msg;
pub mod options;
pub mod summary;
#[cfg(feature = "testing")]
pub mod testing;
pub mod wire;

/// Version of the socket protocol. The agent refuses frames of any other version with a clear error,
/// so a plugin built for another sluice release fails the job instead of misbehaving.
pub const PROTO_VERSION: u32 = 1;
