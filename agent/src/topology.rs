//! Which leaf switch (or block) each node hangs off, from Slurm's `topology.conf`
//! (`[fast_tier] topology`): replicas of a node's checkpoint part go to nodes of other switches
//! first, so that losing one switch (its power, its uplink) does not lose a part and its replica
//! together.
//!
//! Read as Slurm's tree and block plugins write it: `SwitchName=NAME Nodes=HOSTLIST` for a leaf
//! switch (`Switches=` lines above the leaves are not needed here), `BlockName=NAME
//! Nodes=HOSTLIST` for a block; keys in any case, `#` to the end of a line a comment, a `\` at a
//! line's end continuing it. The file must be root's and writable by root alone, like slurm.conf;
//! one the agent cannot read, may not trust or cannot parse is said in its log and placement goes
//! by rendezvous hashing alone, as without one.

use sluice_proto::hostlist;
use std::collections::BTreeMap;
use std::path::Path;

/// Node → the leaf switch or block it is on.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Switches(BTreeMap<String, String>);

/// The most of a topology.conf read (Slurm's for 10,000 nodes is some hundred KiB).
const MAX_BYTES: u64 = 4 << 20;

/// The file's text, if the agent's user (root) owns it and no one else may write it: a file other
/// users could rewrite would let them steer where a job's replicas go.
fn read(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    let me = nix::unistd::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::other(format!(
            "not a file that only uid {me} may write (uid {}, mode {:o})",
            meta.uid(),
            meta.mode() & 0o7777
        )));
    }
    let mut text = String::new();
    file.take(MAX_BYTES + 1).read_to_string(&mut text)?;
    if text.len() as u64 > MAX_BYTES {
        return Err(std::io::Error::other(format!(
            "longer than {MAX_BYTES} bytes"
        )));
    }
    Ok(text)
}

impl Switches {
    /// The switches of `path`: none when it is absent or cannot be used (said in the log).
    pub(crate) fn load(path: Option<&Path>) -> Switches {
        let Some(path) = path else {
            return Switches::default();
        };
        let text = match read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Switches::default(),
            Err(e) => {
                tracing::warn!(
                    "reading {}: {e}; replicas are placed without it",
                    path.display()
                );
                return Switches::default();
            }
        };
        match Switches::parse(&text) {
            Ok(s) => {
                tracing::info!(
                    nodes = s.0.len(),
                    "replicas go to other switches first, as {} says",
                    path.display()
                );
                s
            }
            Err(e) => {
                tracing::warn!("{}: {e}; replicas are placed without it", path.display());
                Switches::default()
            }
        }
    }

    pub(crate) fn parse(text: &str) -> Result<Switches, String> {
        let mut nodes = BTreeMap::new();
        let joined = text.replace("\\\n", "");
        for (n, line) in joined.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default();
            let mut name = None;
            let mut members = None;
            for word in line.split_whitespace() {
                let Some((k, v)) = word.split_once('=') else {
                    continue;
                };
                match k.to_ascii_lowercase().as_str() {
                    "switchname" | "blockname" => name = Some(v),
                    "nodes" => members = Some(v),
                    _ => {}
                }
            }
            let (Some(name), Some(members)) = (name, members) else {
                continue;
            };
            let hosts = hostlist::expand(members).map_err(|e| format!("line {}: {e}", n + 1))?;
            for h in hosts {
                // A node listed twice keeps its first switch, as Slurm's tree plugin does.
                nodes.entry(h).or_insert_with(|| name.to_string());
            }
        }
        Ok(Switches(nodes))
    }

    /// `order` (indexes into `nodes`, the rendezvous ranking) with the nodes on another switch
    /// than `me` first, each group in its ranked order. Without a switch for `me`, as it is.
    pub(crate) fn apart_first(&self, me: &str, nodes: &[String], order: Vec<usize>) -> Vec<usize> {
        let Some(mine) = self.0.get(me) else {
            return order;
        };
        let (apart, near): (Vec<usize>, Vec<usize>) = order
            .into_iter()
            .partition(|&i| self.0.get(&nodes[i]).is_some_and(|s| s != mine));
        apart.into_iter().chain(near).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = "# two leaves under one spine\n\
        SwitchName=s1 Nodes=n[1-2]   # rack 1\n\
        switchname=s2 nodes=n3,\\\n\
        n4 LinkSpeed=100\n\
        SwitchName=spine Switches=s[1-2]\n";

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn leaf_switches_are_read_as_slurm_writes_them() {
        let s = Switches::parse(CONF).unwrap();
        let want: BTreeMap<String, String> =
            [("n1", "s1"), ("n2", "s1"), ("n3", "s2"), ("n4", "s2")]
                .into_iter()
                .map(|(n, s)| (n.to_string(), s.to_string()))
                .collect();
        assert_eq!(s.0, want);
        let blocks =
            Switches::parse("BlockName=b1 Nodes=g[01-02]\nBlockName=b2 Nodes=g03\n").unwrap();
        assert_eq!(blocks.0["g02"], "b1");
        let e = Switches::parse("SwitchName=s1 Nodes=n[1-\n").unwrap_err();
        assert!(e.starts_with("line 1: hostlist"), "{e}");
    }

    #[test]
    fn replicas_go_to_other_switches_first_in_their_ranked_order() {
        let s = Switches::parse(CONF).unwrap();
        // n1's other nodes, ranked n2, n4, n3 by rendezvous: n4 and n3 are on s2.
        let others = names(&["n2", "n3", "n4"]);
        assert_eq!(s.apart_first("n1", &others, vec![0, 2, 1]), [2, 1, 0]);
        // A node the file does not name is not apart from anyone: it keeps its place among the
        // near ones.
        let others = names(&["n2", "x9", "n3"]);
        assert_eq!(s.apart_first("n1", &others, vec![1, 0, 2]), [2, 1, 0]);
        // Without a switch for this node (or without a file), the ranking as it was.
        assert_eq!(s.apart_first("x9", &others, vec![1, 0, 2]), [1, 0, 2]);
        assert_eq!(
            Switches::default().apart_first("n1", &others, vec![1, 0, 2]),
            [1, 0, 2]
        );
    }

    #[test]
    fn a_file_others_may_write_is_not_read() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let conf = t.path().join("topology.conf");
        std::fs::write(&conf, CONF).unwrap();
        std::fs::set_permissions(&conf, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(Switches::load(Some(&conf)), Switches::parse(CONF).unwrap());
        // Another user who may write it (group or world) could steer a job's replicas onto the
        // sender's own switch: ignored, as if there were none.
        for mode in [0o664, 0o646] {
            std::fs::set_permissions(&conf, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(Switches::load(Some(&conf)), Switches::default(), "{mode:o}");
        }
    }

    #[test]
    fn no_file_is_no_topology() {
        let t = tempfile::tempdir().unwrap();
        assert_eq!(
            Switches::load(Some(&t.path().join("absent"))),
            Switches::default()
        );
        assert_eq!(Switches::load(None), Switches::default());
        let bad = t.path().join("topology.conf");
        std::fs::write(&bad, "SwitchName=s1 Nodes=n[2-1]\n").unwrap();
        assert_eq!(Switches::load(Some(&bad)), Switches::default());
    }
}
