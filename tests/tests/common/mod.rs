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

/// How many listing passes the origin gets for dataset `name` of a job on every node of
/// `cluster`: one, the lister's. In a rolling upgrade (`run-e2e-mixed.sh`) each agent of the
/// previous release lists for itself, and this tree's agents list once between them, or each for
/// itself when the node that lists for the job runs the previous release (it answers them "no such
/// resource").
pub fn listing_passes(cluster: &Cluster, name: &str) -> u64 {
    let previous: Vec<&str> = cluster
        .var("SLUICE_TEST_PREVIOUS_NODES")
        .split_whitespace()
        .collect();
    let mut nodes = cluster.nodes.clone();
    nodes.sort();
    let lister = &nodes[sluice_peer::owner_of(&format!("\0listing/{name}"), &nodes)];
    let (old, new) = (previous.len() as u64, (nodes.len() - previous.len()) as u64);
    match (old, previous.contains(&lister.as_str())) {
        (0, _) => 1,
        (_, true) => old + new,
        (_, false) => old + 1,
    }
}

/// Whether the cluster's plugin is the previous release's ([`OPTIONS_SINCE_PREVIOUS`]).
pub fn plugin_is_previous() -> bool {
    std::env::var_os("SLUICE_E2E_PREVIOUS_PLUGIN").is_some_and(|v| v == "1")
}
