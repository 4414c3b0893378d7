//! `sluice cache list|stats|warm|evict`: this node's cross-job cache (`[cache]`), for admins.
//!
//! The cache holds every user's datasets, so its entries and its control are root's: the agent
//! answers these requests for root only, and this command says so before it asks (a user reads the
//! cache's counters in `sluice status`). Each command is one request to the node's agent; `warm
//! --nodes LIST` asks this node's agent, which asks each listed node's agent over the peer port
//! (with the cluster secret's admin key: the CLI holds no key and reaches no other node itself).
//! To list or clear the cache of several nodes, run the command on each (`pdsh -w gpu[01-08]
//! sluice cache list`).

use crate::agent::Agent;
use anyhow::{anyhow, bail};
use serde::Serialize;
use sluice_proto::msg::{
    CacheEvicted, CacheListing, CacheStats, CacheWarmed, NodeWarmed, Request, Response,
    WARM_NODES_LIMIT,
};
use std::time::Duration;

/// How long a warm's answer is awaited: the agent answers once the whole dataset is in the cache
/// (or skipped), which for a large one takes as long as staging it.
const WARM_WAIT: Duration = Duration::from_secs(12 * 3600 + 60);
/// How long an evict's answer is awaited: removing many entries takes a while on a busy disk.
const EVICT_WAIT: Duration = Duration::from_secs(10 * 60);

/// Refuses a caller other than root, before anything is asked of the agent.
pub fn require_admin(is_root: bool) -> anyhow::Result<()> {
    if !is_root {
        bail!(
            "sluice cache commands are for admins: the cache holds every user's data, so only root \
             may list, warm or evict it (sudo sluice cache ...); `sluice status` shows its hit \
             ratio and size to everyone"
        );
    }
    Ok(())
}

/// `sluice cache stats --json`: the agent's counters, with the hit ratio worked out.
#[derive(Debug, Serialize)]
pub struct StatsReport {
    pub node: String,
    pub stats: CacheStats,
    /// Hits over lookups, 0..=1; null before the first lookup.
    pub hit_ratio: Option<f64>,
}

impl From<CacheListing> for StatsReport {
    fn from(l: CacheListing) -> StatsReport {
        StatsReport {
            node: l.node,
            hit_ratio: l.stats.hit_ratio(),
            stats: l.stats,
        }
    }
}

/// Sends one cache request, waiting `wait` for its answer, and names an agent that predates the
/// cache as such.
fn call(agent: &Agent, request: Request, wait: Duration) -> anyhow::Result<Response> {
    agent.call_with(request, None, wait).map_err(|e| {
        if crate::remote::too_old(&e) {
            anyhow!(
                "the sluice agent at {} is older than this CLI and has no cache; update sluiced on \
                 this node",
                agent.socket
            )
        } else {
            e
        }
    })
}

/// The cache's counters and, with `entries`, the entries under `prefix` (all without one), least
/// recently used first.
pub fn list(agent: &Agent, prefix: Option<String>, entries: bool) -> anyhow::Result<CacheListing> {
    let asked = if entries { "cache list" } else { "cache stats" };
    match call(agent, Request::CacheList { prefix, entries }, agent.timeout)? {
        Response::Cache(listing) => Ok(listing),
        other => Err(agent.unexpected(asked, &other)),
    }
}

/// Fills this node's cache with the dataset at `url`; returns once the agent is done.
pub fn warm(agent: &Agent, url: String) -> anyhow::Result<CacheWarmed> {
    match call(agent, Request::CacheWarm { url }, WARM_WAIT)? {
        Response::CacheWarmed(w) => Ok(w),
        other => Err(agent.unexpected("cache warm", &other)),
    }
}

/// The nodes of a Slurm hostlist (`gpu[01-08],login1`), expanded as Slurm does (the plugin's
/// expansion of `SLURM_NODELIST`), duplicates dropped, in the order written.
pub fn expand_nodes(hostlist: &str) -> anyhow::Result<Vec<String>> {
    let mut nodes = sluice_proto::hostlist::expand(hostlist)?;
    let mut seen = std::collections::HashSet::new();
    nodes.retain(|n| seen.insert(n.clone()));
    if nodes.is_empty() {
        bail!("--nodes '{hostlist}' names no node");
    }
    if nodes.len() > WARM_NODES_LIMIT {
        bail!(
            "--nodes '{hostlist}' names {} nodes; warm at most {WARM_NODES_LIMIT} at once",
            nodes.len()
        );
    }
    Ok(nodes)
}

/// Fills the caches of `nodes` with the dataset at `url`, through this node's agent; returns once
/// every node is done, one row each.
pub fn warm_nodes(
    agent: &Agent,
    url: String,
    nodes: Vec<String>,
) -> anyhow::Result<Vec<NodeWarmed>> {
    let asked = Request::CacheWarmNodes { url, nodes };
    let answer = agent.call_with(asked, None, WARM_WAIT).map_err(|e| {
        if crate::remote::too_old(&e) {
            anyhow!(
                "the sluice agent at {} is older than this CLI and cannot warm other nodes \
                 (--nodes); update sluiced on this node, or run sluice cache warm on each node",
                agent.socket
            )
        } else {
            e
        }
    })?;
    match answer {
        Response::CacheWarmedNodes { nodes } => Ok(nodes),
        other => Err(agent.unexpected("cache warm --nodes", &other)),
    }
}

/// `sluice cache warm --nodes --json`: the agent's rows.
#[derive(Debug, Serialize)]
pub struct WarmedNodes {
    pub url: String,
    pub nodes: Vec<NodeWarmed>,
}

/// Removes (with `dry_run`, counts) the entries under `prefix`; `""` is every entry.
pub fn evict(agent: &Agent, prefix: String, dry_run: bool) -> anyhow::Result<CacheEvicted> {
    match call(agent, Request::CacheEvict { prefix, dry_run }, EVICT_WAIT)? {
        Response::CacheEvicted(e) => Ok(e),
        other => Err(agent.unexpected("cache evict", &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_root_may_use_the_cache_commands() {
        assert!(require_admin(true).is_ok());
        let e = require_admin(false).unwrap_err().to_string();
        assert!(
            e.starts_with("sluice cache commands are for admins") && e.contains("sudo"),
            "{e}"
        );
    }

    #[test]
    fn node_lists_expand_as_slurm_does_once_each() {
        assert_eq!(
            expand_nodes("n[1-3],n2,login").unwrap(),
            ["n1", "n2", "n3", "login"]
        );
        assert_eq!(
            expand_nodes("gpu[08-10]").unwrap(),
            ["gpu08", "gpu09", "gpu10"]
        );
        assert!(expand_nodes("n[1-").is_err());
        let e = expand_nodes("").unwrap_err().to_string();
        assert!(e.contains("names no node"), "{e}");
        let e = expand_nodes("n[1-5000]").unwrap_err().to_string();
        assert!(e.contains("at most 4096"), "{e}");
    }

    #[test]
    fn the_stats_report_carries_the_hit_ratio() {
        let listing = CacheListing {
            node: "n1".into(),
            stats: CacheStats {
                hits: 3,
                misses: 1,
                ..CacheStats::default()
            },
            entries: Vec::new(),
            left_out: 0,
        };
        let v = serde_json::to_value(StatsReport::from(listing)).unwrap();
        assert_eq!(v["hit_ratio"], 0.75);
        assert_eq!(v["stats"]["hits"], 3);
        assert_eq!(v["node"], "n1");
        let none = StatsReport::from(CacheListing {
            node: "n1".into(),
            stats: CacheStats::default(),
            entries: Vec::new(),
            left_out: 0,
        });
        assert!(serde_json::to_value(none).unwrap()["hit_ratio"].is_null());
    }
}
