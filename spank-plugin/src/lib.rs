//! `spank_sluice.so`: sluice's SPANK plugin, loaded by sbatch, srun, salloc, slurmd and slurmstepd.
//!
//! It is deliberately thin — it validates options at submit time and, during the job, tells the
//! node's agent what happens, over the agent's Unix socket. It starts no threads, keeps no state
//! between callbacks (job_prolog and job_epilog are fresh processes anyway) and never returns an error
//! from a callback whose failure would drain a node. Everything slow or stateful is in the agent.
//!
//! Layers, each seeing only the one below:
//! - `sys`: raw bindgen output of `<slurm/spank.h>` (private);
//! - [`handle`]: the safe [`handle::Spank`] handle and Slurm's log, errors as [`api::SpankError`];
//! - [`callbacks`]: the plugin's behaviour, written against the [`api::SpankApi`] trait and unit-tested
//!   with a fake handle;
//! - `entry`: the exported C symbols, each through one panic-catching trampoline.

mod entry;
mod sys;

pub mod api;
pub mod args;
pub mod callbacks;
pub mod handle;

/// The plugin's name: the `plugin_name` symbol, the log prefix, and part of the environment variable
/// names under which Slurm forwards the options (`_SLURM_SPANK_OPTION_sluice_stage_in`).
pub const PLUGIN_NAME: &str = "sluice";
