//! What every end-to-end test needs: the cluster that `tests/harness/cluster.sh up` started (read from
//! its env file), jobs submitted as the unprivileged test user, bounded waits on job and node state,
//! test datasets, and failure messages that carry the evidence (job output, Slurm and agent log tails).
//!
//! Everything here talks to the real cluster through the commands a user or admin would type
//! (`sbatch`, `scontrol`, `sinfo`), so a test sees exactly what a user sees. One module per concern;
//! a test reads `use common::*;` and sees them all.

mod agents;
mod cluster;
mod frameworks;
mod jobs;
#[path = "../../../agent/tests/support/ports.rs"]
mod ports;
mod stores;
mod trees;

pub use agents::*;
pub use cluster::*;
pub use frameworks::*;
pub use jobs::*;
pub use ports::free_port;
pub use stores::*;
pub use trees::*;

/// The job options of this tree that the previous release's plugin does not know. The end-to-end
/// core run with that plugin (`run-e2e-mixed.sh` sets `SLUICE_E2E_PREVIOUS_PLUGIN=1`) expects
/// sbatch to leave them out of `--help` and refuse them as unrecognized: what a user on a cluster
/// whose plugin is not upgraded yet sees.
pub const OPTIONS_SINCE_PREVIOUS: &[&str] = &[sluice_proto::options::names::CKPT_REPLICAS];

/// Whether the cluster's plugin is the previous release's ([`OPTIONS_SINCE_PREVIOUS`]).
pub fn plugin_is_previous() -> bool {
    std::env::var_os("SLUICE_E2E_PREVIOUS_PLUGIN").is_some_and(|v| v == "1")
}
