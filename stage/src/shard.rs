//! `--stage-mode=shard`: each node of a job stages only the files it owns, and every node writes
//! the same manifest saying which node holds which file.
//!
//! A file's owner is rendezvous hashing ([`owner_of`]) of its path below `$SLUICE_STAGE_DIR`
//! (`NAME/dir/file`, or `NAME` for a dataset that is one object or one file) over the job's node
//! list, sorted. Every node lists the dataset itself and computes the same owners from nothing but
//! the listing and the node list, so the origin serves each file once per job, to its owner, with
//! no coordination. The unit is the file, not a range of it: a data loader reads whole files, and
//! a shard is where they are.
//!
//! The manifest is `$SLUICE_STAGE_DIR/NAME.shard.json` (no dataset may be named so, see
//! [`SHARD_MANIFEST_SUFFIX`]), owned by the job user, identical on every node:
//!
//! ```json
//! {"version": 1, "dataset": "ds", "source": "s3://bucket/ds", "nodes": ["n1", "n2", "n3"],
//!  "files": [{"path": "ds/a.bin", "node": "n2", "size": 1048576}, ...]}
//! ```
//!
//! `path` is relative to `$SLUICE_STAGE_DIR`, files are sorted by path, and `nodes` is in
//! `SLUICE_SHARD_INDEX` order: a task's node is `nodes[SLUICE_SHARD_INDEX]`, and there are
//! `SLUICE_SHARD_COUNT` of them. Directories are created on every node (a shard keeps the
//! dataset's layout); symbolic links of a POSIX dataset are copied on every node and not listed.

use serde::{Deserialize, Serialize};
use sluice_peer::owner_of;
use sluice_proto::options::SHARD_MANIFEST_SUFFIX;

/// The variables a shard job's tasks get: this node's place in the manifest's `nodes`, and their
/// number.
pub const INDEX_VAR: &str = "SLUICE_SHARD_INDEX";
pub const COUNT_VAR: &str = "SLUICE_SHARD_COUNT";

/// Which node of a job owns which file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// The job's nodes, sorted and without repeats.
    nodes: Vec<String>,
    /// This node's index in `nodes`.
    index: usize,
    /// A takeover on the shared tier ([`ShardPlan::takeover`]): only files that this node of the
    /// job's whole node list owned are this plan's, and `nodes` are the nodes that survived it.
    of: Option<Box<ShardPlan>>,
}

impl ShardPlan {
    /// The plan of a job on `nodes`, seen from `node`; `None` when `node` is not one of them.
    pub fn new(nodes: &[String], node: &str) -> Option<ShardPlan> {
        let mut nodes = nodes.to_vec();
        nodes.sort();
        nodes.dedup();
        let index = nodes.iter().position(|n| n == node)?;
        Some(ShardPlan {
            nodes,
            index,
            of: None,
        })
    }

    /// The plan of this node's part of a takeover on the shared tier: of the files the lost node
    /// `lost` owns in `self`, those this node owns among `survivors` (rendezvous hashing again,
    /// over the survivors), so each of the lost node's files gets exactly one new writer and every
    /// survivor computes the same answer. `None` when this node is not a survivor or `lost` is
    /// not a node of the job.
    pub fn takeover(&self, lost: &str, survivors: &[String]) -> Option<ShardPlan> {
        let of = ShardPlan::new(&self.nodes, lost)?;
        let mut plan = ShardPlan::new(survivors, self.node())?;
        if plan.nodes.iter().any(|n| n == lost) {
            return None;
        }
        plan.of = Some(Box::new(of));
        Some(plan)
    }

    /// The node this plan takes files over from, if it is a takeover.
    pub fn taken_over(&self) -> Option<(&str, &[String])> {
        self.of.as_deref().map(|of| (of.node(), of.nodes()))
    }

    /// The owner of the file at `path` (below `$SLUICE_STAGE_DIR`).
    pub fn owner(&self, path: &str) -> &str {
        &self.nodes[owner_of(path, &self.nodes)]
    }

    /// Whether this node owns the file at `path`.
    pub fn owns(&self, path: &str) -> bool {
        self.of.as_deref().is_none_or(|of| of.owns(path))
            && owner_of(path, &self.nodes) == self.index
    }

    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The node list as `copy-as-user --shard-nodes` takes it.
    pub fn nodes_arg(&self) -> String {
        self.nodes.join(",")
    }

    pub fn node(&self) -> &str {
        &self.nodes[self.index]
    }

    /// `SLUICE_SHARD_INDEX` and `SLUICE_SHARD_COUNT` for the job's tasks on this node.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (INDEX_VAR.to_string(), self.index.to_string()),
            (COUNT_VAR.to_string(), self.nodes.len().to_string()),
        ]
    }
}

/// One file of a sharded dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardFile {
    /// Below `$SLUICE_STAGE_DIR`: `NAME/dir/file`, or `NAME`.
    pub path: String,
    /// The node that holds it.
    pub node: String,
    pub size: u64,
}

/// `$SLUICE_STAGE_DIR/NAME.shard.json`; see the module header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardManifest {
    pub version: u32,
    pub dataset: String,
    pub source: String,
    pub nodes: Vec<String>,
    pub files: Vec<ShardFile>,
}

impl ShardManifest {
    pub fn new(plan: &ShardPlan, dataset: &str, source: &str) -> ShardManifest {
        ShardManifest {
            version: 1,
            dataset: dataset.to_string(),
            source: source.to_string(),
            nodes: plan.nodes.clone(),
            files: Vec::new(),
        }
    }

    /// Lists the file at `path` as held by its owner.
    pub fn add(&mut self, plan: &ShardPlan, path: String, size: u64) {
        let node = plan.owner(&path).to_string();
        self.files.push(ShardFile { path, node, size });
    }

    /// The manifest's bytes: files sorted by path, so every node writes the same bytes whatever
    /// order it listed them in.
    pub fn to_json(&mut self) -> Vec<u8> {
        self.files.sort_by(|a, b| a.path.cmp(&b.path));
        let mut bytes = serde_json::to_vec_pretty(self).expect("a manifest always serialises");
        bytes.push(b'\n');
        bytes
    }
}

/// The manifest's file name for dataset `name`, in `$SLUICE_STAGE_DIR`.
pub fn manifest_name(name: &str) -> String {
    format!("{name}{SHARD_MANIFEST_SUFFIX}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn every_file_has_exactly_one_owner_and_every_node_agrees() {
        let job = nodes(&["n3", "n1", "n2", "n1"]);
        let plans: Vec<ShardPlan> = ["n1", "n2", "n3"]
            .iter()
            .map(|n| ShardPlan::new(&job, n).unwrap())
            .collect();
        assert_eq!(plans[0].nodes(), nodes(&["n1", "n2", "n3"]));
        assert_eq!(
            plans.iter().map(|p| p.env()).collect::<Vec<_>>()[2],
            vec![
                (INDEX_VAR.to_string(), "2".to_string()),
                (COUNT_VAR.to_string(), "3".to_string())
            ]
        );
        let mut held = [0usize; 3];
        for i in 0..3000 {
            let path = format!("ds/shard-{i:05}.tar");
            let owners: Vec<usize> = (0..3).filter(|&k| plans[k].owns(&path)).collect();
            assert_eq!(owners.len(), 1, "{path}: owners {owners:?}");
            assert_eq!(plans[1].owner(&path), plans[owners[0]].node());
            held[owners[0]] += 1;
        }
        // Rendezvous hashing spreads files evenly: each node holds about a third.
        assert!(held.iter().all(|&h| (850..1150).contains(&h)), "{held:?}");
        assert_eq!(ShardPlan::new(&job, "n9"), None);
    }

    #[test]
    fn a_lost_nodes_files_each_get_one_new_owner_among_the_survivors() {
        let job = nodes(&["n1", "n2", "n3"]);
        let survivors = nodes(&["n1", "n3"]);
        let plans: Vec<ShardPlan> = ["n1", "n2", "n3"]
            .iter()
            .map(|n| ShardPlan::new(&job, n).unwrap())
            .collect();
        let takeovers: Vec<ShardPlan> = [&plans[0], &plans[2]]
            .iter()
            .map(|p| p.takeover("n2", &survivors).unwrap())
            .collect();
        assert_eq!(takeovers[0].taken_over(), Some(("n2", &job[..])));
        let (mut lost, mut by) = (0, [0usize; 2]);
        for i in 0..3000 {
            let path = format!("ds/shard-{i:05}.tar");
            let writers: Vec<usize> = (0..2).filter(|&k| takeovers[k].owns(&path)).collect();
            if plans[1].owns(&path) {
                // n2's file: written again by exactly one survivor.
                assert_eq!(writers.len(), 1, "{path}: writers {writers:?}");
                lost += 1;
                by[writers[0]] += 1;
            } else {
                // Not n2's: its owner wrote it; no takeover writes it a second time.
                assert!(writers.is_empty(), "{path}: rewritten by {writers:?}");
            }
        }
        assert!((850..1150).contains(&lost), "{lost}");
        // The lost node's share spreads over the survivors too.
        assert!(by.iter().all(|&b| b > lost / 3), "{by:?}");
        // A node that is not a survivor, or a lost node that is not the job's, plans nothing.
        assert_eq!(plans[1].takeover("n2", &survivors), None);
        assert_eq!(plans[0].takeover("n9", &survivors), None);
        assert_eq!(plans[0].takeover("n2", &job), None);
    }

    #[test]
    fn the_manifest_is_the_same_bytes_on_every_node() {
        let job = nodes(&["n1", "n2"]);
        let (a, b) = (
            ShardPlan::new(&job, "n1").unwrap(),
            ShardPlan::new(&job, "n2").unwrap(),
        );
        let mut ma = ShardManifest::new(&a, "ds", "s3://b/ds");
        let mut mb = ShardManifest::new(&b, "ds", "s3://b/ds");
        for (p, n) in [("ds/b", 2), ("ds/a", 1), ("ds/c/d", 3)] {
            ma.add(&a, p.into(), n);
        }
        for (p, n) in [("ds/c/d", 3), ("ds/a", 1), ("ds/b", 2)] {
            mb.add(&b, p.into(), n);
        }
        let bytes = ma.to_json();
        assert_eq!(bytes, mb.to_json());
        let back: ShardManifest = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back.files[0].path, "ds/a");
        assert_eq!(back.files[0].node, a.owner("ds/a"));
        assert_eq!(back.nodes, job);
        assert_eq!(manifest_name("ds"), "ds.shard.json");
    }
}
