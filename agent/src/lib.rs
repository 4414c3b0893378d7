//! sluice-agent: the engine of `sluiced`, the per-node agent.
//!
//! [`run`] is the one entry point, used by `sluiced` and by the in-process tests alike: it prepares
//! the hot tier, recovers the journal, serves the socket until `shutdown` is cancelled, then drains.
//! The parts, each owning its state (docs/ARCHITECTURE.md draws them):
//!
//! - [`server`]: the socket — admission from peer credentials, framing, one task per request;
//! - [`agent`]: the request dispatch; a job's set-up (stage + restore) and end;
//! - [`job`]: one job's identity, options, state and lifecycle, and its checkpoints' state;
//! - [`job_table`]: the jobs on this node and their journal, which everything below the agent
//!   reads jobs from;
//! - [`hot_tier`]: the node-local tier's layout (`jobs/<id>/{stage,ckpt}`), usage and watermark;
//! - [`policy`]: who may stage what, and where a job's checkpoints are archived;
//! - [`ckpt`]: checkpoints — commit and signals, the per-job worker (archive, publish, retention,
//!   clean-up), restore;
//! - [`journal`]: durable per-job records;
//! - [`metrics`]: the Prometheus endpoint (`[metrics]`), its counters and scrape-time gauges.
//!
//! Stage-in (origin → hot tier: object stores, POSIX through a user-identity helper, the budget,
//! datasets shared with the job's other nodes, the node's cross-job cache) lives in
//! `sluice-stage`; the archive engine and store clients in `sluice-archive`, shared with the CLI;
//! the transfers between the agents of a job (ownership, per-job keys, server, client) and the HTTP
//! accept loop of the metrics and peer ports in `sluice-peer`; the site config, root-safe file
//! access, durable writes, the shape of background loops (`sluice_core::worker`) and the pause
//! before re-queued work is tried again (`sluice_core::backoff`) in `sluice-core`.
#![forbid(unsafe_code)]

pub mod agent;
mod archive_access;
pub mod ckpt;
pub mod hot_tier;
pub mod identity;
pub mod job;
pub mod job_table;
pub mod journal;
pub mod metrics;
pub mod policy;
pub mod ram_tier;
pub mod replica_area;
pub mod server;
mod topology;

pub use agent::AgentError;

use sluice_core::config::Config;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Runs the agent on `listener` until `shutdown` is cancelled, then waits up to the configured
/// `agent.drain_timeout` for requests, staging and workers to return (what they leave resumes
/// from the journal on the next start). POSIX staging runs the running executable's
/// `copy-as-user`.
pub async fn run(
    cfg: Arc<Config>,
    listener: UnixListener,
    shutdown: CancellationToken,
) -> Result<(), AgentError> {
    let helper = std::env::current_exe().map_err(AgentError::HelperExe)?;
    run_with_helper(cfg, listener, shutdown, helper).await
}

/// [`run`] with the `sluiced` binary for user-identity copies given explicitly (tests run the agent
/// inside the test binary).
pub async fn run_with_helper(
    cfg: Arc<Config>,
    listener: UnixListener,
    shutdown: CancellationToken,
    helper_exe: PathBuf,
) -> Result<(), AgentError> {
    let metrics_listener = match &cfg.metrics {
        Some(m) => Some(metrics::bind(m).await?),
        None => None,
    };
    // Without its secret or its port, a node stages on its own (logged); its peers route around it.
    let peers = sluice_stage::NodePeers::bind(&cfg).await;
    let tracker = TaskTracker::new();
    let agent = agent::Agent::new(cfg.clone(), helper_exe, shutdown.clone(), tracker.clone())?;
    if let Some((peers, service)) = peers {
        agent.start_peers(peers, service);
    }
    let recovered = agent.recover()?;
    if let Some(listener) = metrics_listener {
        let serve = metrics::serve(
            agent.metrics.clone(),
            agent.metrics_snapshot(),
            listener,
            shutdown.clone(),
        );
        drop(agent.spawn(serve));
    }
    tracing::info!(node = %cfg.node, socket = %cfg.socket.display(), recovered, "sluiced ready");
    server::run(agent, listener, shutdown).await;
    tracker.close();
    if tokio::time::timeout(cfg.drain_timeout, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "work still running after the drain deadline ({}); it resumes from the journal",
            humantime::format_duration(cfg.drain_timeout)
        );
    }
    Ok(())
}
