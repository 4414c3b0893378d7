//! The helper's command line beyond the identity and the paths: a shard, a replica through the
//! job's peers, and the Lustre stripe classes of a shared tier, as the agent passes them.

use crate::shard::ShardPlan;
use sluice_core::config::StripeClass;
use std::path::PathBuf;
use std::sync::Arc;

/// `--stage-mode=shard` for the helper: copy only the files this node owns, and write the
/// manifest of the whole dataset next to it (see [`crate::shard`]).
#[derive(Debug, Clone)]
pub struct Shard {
    pub plan: ShardPlan,
    /// The dataset's NAME (the first component of every manifest path).
    pub dataset: String,
    /// The source as the job gave it, for the manifest.
    pub source: String,
    /// Into the job's directory on the shared tier, which the job's other nodes write into too:
    /// directories may exist, a file left by an earlier run is replaced, and no manifest is
    /// written (every node sees every file).
    pub shared_tier: bool,
    /// On a Lustre shared tier: `lfs`, and the stripe classes files are created with.
    pub stripes: Option<(Arc<PathBuf>, Vec<StripeClass>)>,
    /// `Some`: not a shard but `--stage-mode=replicate` through the job's peers (see
    /// [`super::modes`]): every file is made here, and of its bytes this node copies the
    /// `peer.unit_size` units it owns among `plan`'s nodes.
    pub peers: Option<PeerCopy>,
}

/// How the helper takes part in a dataset the job's nodes share through their peers.
#[derive(Debug, Clone, Copy)]
pub struct PeerCopy {
    pub unit_size: u64,
    /// Copy the units the agent names on stdin into the files an earlier run made (the units of
    /// a peer that was routed around), rather than the dataset.
    pub repair: bool,
    /// The node has a cache: report every file's identity and take the agent's answers on stdin
    /// first (see [`super::modes`]).
    pub cached: bool,
}

/// The stripe layout a copied file of `size` bytes is created with, if any.
pub(super) fn stripe_for(shard: Option<&Shard>, size: u64) -> Option<(Arc<PathBuf>, StripeClass)> {
    let (lfs, classes) = shard?.stripes.as_ref()?;
    StripeClass::for_size(classes, size).map(|c| (lfs.clone(), *c))
}

/// The helper's `--shard-nodes`/`--shard-node`/`--dataset`/`--source`, as the agent passes them.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ShardArgs {
    /// The job's nodes, comma-separated: copy only this node's share.
    #[arg(long, requires_all = ["shard_node", "dataset", "source"])]
    pub shard_nodes: Option<String>,
    #[arg(long)]
    pub shard_node: Option<String>,
    #[arg(long)]
    pub dataset: Option<String>,
    #[arg(long)]
    pub source: Option<String>,
    /// `--dst` is on the shared tier (with the shard arguments).
    #[arg(long, requires = "shard_nodes")]
    pub shared_tier: bool,
    /// `lfs`, for `--stripe` (a Lustre shared tier).
    #[arg(long, requires = "shared_tier")]
    pub lfs: Option<PathBuf>,
    /// A stripe class, `MIN_SIZE:COUNT:SIZE` in bytes: files of at least MIN_SIZE bytes (and below
    /// the next class's) are created with `lfs setstripe -c COUNT -S SIZE`.
    #[arg(long, requires = "lfs")]
    pub stripe: Vec<String>,
    /// Not a shard: every file of the dataset is made here, and of its bytes only the units of
    /// this many bytes that this node owns among `--shard-nodes` are copied (replicate through
    /// the job's peers; the agent fetches the rest from their owners).
    #[arg(long, requires = "shard_nodes", conflicts_with = "shared_tier")]
    pub peer_unit_size: Option<u64>,
    /// With `--peer-unit-size`: copy the units named on stdin (`IDX OFFSET LEN "PATH"` lines)
    /// into the files an earlier run made.
    #[arg(long, requires = "peer_unit_size")]
    pub peer_repair: bool,
    /// With `--peer-unit-size`, on a node with a cache: report each file's identity, then read
    /// the agent's `hit IDX` answers on stdin; hits are only made, for the agent to write.
    #[arg(long, requires = "peer_unit_size", conflicts_with = "peer_repair")]
    pub peer_cached: bool,
    /// A takeover on the shared tier: of the files this node of `--takeover-nodes` (the job's
    /// whole node list) owned, copy those this node owns among `--shard-nodes` (the survivors).
    #[arg(long, requires_all = ["shared_tier", "takeover_nodes"])]
    pub takeover_of: Option<String>,
    #[arg(long, requires = "takeover_of")]
    pub takeover_nodes: Option<String>,
}

impl ShardArgs {
    /// The shard to copy, `None` for the whole dataset; an error when this node is not one of the
    /// nodes given.
    pub fn shard(self) -> Result<Option<Shard>, String> {
        let (Some(nodes), Some(node), Some(dataset), Some(source)) =
            (self.shard_nodes, self.shard_node, self.dataset, self.source)
        else {
            return Ok(None);
        };
        let nodes: Vec<String> = nodes.split(',').map(String::from).collect();
        let mut plan = ShardPlan::new(&nodes, &node)
            .ok_or_else(|| format!("node {node} is not one of the job's nodes {nodes:?}"))?;
        if let (Some(lost), Some(all)) = (&self.takeover_of, &self.takeover_nodes) {
            let all: Vec<String> = all.split(',').map(String::from).collect();
            plan = ShardPlan::new(&all, &node)
                .and_then(|p| p.takeover(lost, &nodes))
                .ok_or_else(|| {
                    format!("no takeover of node {lost} of {all:?} by {node} among {nodes:?}")
                })?;
        }
        let mut classes = Vec::new();
        for c in &self.stripe {
            let bad = || format!("--stripe {c}: expected MIN_SIZE:COUNT:SIZE in bytes");
            let mut it = c.split(':');
            let (Some(min), Some(count), Some(size), None) =
                (it.next(), it.next(), it.next(), it.next())
            else {
                return Err(bad());
            };
            classes.push(StripeClass {
                min_size: min.parse().map_err(|_| bad())?,
                count: count.parse().map_err(|_| bad())?,
                size: size.parse().map_err(|_| bad())?,
            });
        }
        let stripes = self
            .lfs
            .filter(|_| !classes.is_empty())
            .map(|lfs| (Arc::new(lfs), classes));
        if self.peer_unit_size == Some(0) {
            return Err("--peer-unit-size must be at least 1".into());
        }
        let peers = self.peer_unit_size.map(|unit_size| PeerCopy {
            unit_size,
            repair: self.peer_repair,
            cached: self.peer_cached,
        });
        Ok(Some(Shard {
            plan,
            dataset,
            source,
            shared_tier: self.shared_tier,
            stripes,
            peers,
        }))
    }
}
