//! A POSIX dataset staged by three nodes of one job through their peers, in one process: the real
//! stager, the real `sluiced copy-as-user` helper of this build, peer servers on 127.0.0.1 ports
//! and the real client. What a job would see: every node's copy identical to the source (bytes,
//! modes, links), each byte read from the source by one node's helper, the rest taken from peers;
//! and with one node's agent missing, the others copy its share from the source themselves.

use sluice_peer::{ClusterSecret, PeerServer, PeerService, ServerConfig};
use sluice_proto::options::{StageSpec, parse_stage_entry};
use sluice_stage::cache::Cache;
use sluice_stage::{self as stage, Budget, NodePeers, Progress, Sharing, StageCtx};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const JOB: u32 = 78;

fn user_name() -> String {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .expect("the test's user has a name")
        .name
}

/// The source: a file of several 1 MiB units with a short last one (read-only, as datasets often
/// are), small files, an empty one, a nested one, a file of mode 0600, a symbolic link.
fn source(dir: &Path) -> u64 {
    let bytes = big_file(dir, (3 << 20) + 12_345) + small_files(dir, 30);
    chmod(dir, "small/part-007.bin", 0o600);
    std::fs::write(dir.join("empty"), b"").unwrap();
    std::fs::create_dir_all(dir.join("a/b")).unwrap();
    std::fs::write(dir.join("a/b/deep.txt"), b"deep").unwrap();
    std::os::unix::fs::symlink("../big.bin", dir.join("a/link")).unwrap();
    bytes + 4
}

#[path = "support/small_files.rs"]
mod small_files;
use small_files::{big_file, chmod, small_file, small_files};
// The job's nodes, set up as the peer unit tests (`stage/src/peers/tests.rs`) set up theirs.
#[path = "../../stage/tests/support/peer_nodes.rs"]
mod peer_nodes;
use peer_nodes::{
    Node, Setup, assert_each_read_some_and_took_the_rest, job_nodes, listeners, me, stop,
};

#[path = "support/tree.rs"]
mod tree;
use tree::tree;

fn spec(src: &Path) -> StageSpec {
    parse_stage_entry(&format!("ds={}", src.display())).unwrap()
}

/// Peer servers for `running` of n1..n3 (units of 1 MiB, copying as the test's user with this
/// build's `sluiced`); the others get an address where nothing listens.
async fn nodes(running: &[&str], src: &Path) -> Vec<Node> {
    let (ls, addrs) = listeners().await;
    let setup = Setup {
        unit_size: "1MiB",
        owner: me(),
        user: user_name(),
        helper_exe: env!("CARGO_BIN_EXE_sluiced").into(),
        spec: spec(src),
        peer_more: "",
    };
    let mut out = Vec::new();
    for (name, l) in job_nodes().iter().zip(ls) {
        if running.contains(&name.as_str()) {
            out.push(peer_nodes::node(name, l, &addrs, &setup).await);
        } // dropped: the port closes, as an agent that died
    }
    out
}

/// Stages the dataset on every node at once, shared with the job's three nodes, the way the
/// agent's set-up does (join, stage, close).
async fn stage_all(nodes: &[Node], src: &Path) -> Vec<Vec<String>> {
    let runs = nodes.iter().map(|n| async move {
        let peers = n.peers.join(JOB, &job_nodes(), me(), 1, &[]).unwrap();
        let spec = spec(src);
        let run = stage::stage_with(&n.ctx, &spec, n.progress.clone(), Sharing::Peers(&peers));
        let r = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .unwrap_or_else(|_| panic!("{} did not finish staging", n.name));
        peers.close("done");
        r.unwrap_or_else(|e| panic!("{}: {e}", n.name));
        peers.notes()
    });
    futures::future::join_all(runs).await
}

/// Each node's copy is the source's tree; returns each node's (origin, peer) bytes.
fn assert_identical(nodes: &[Node], src: &Path, bytes: u64) -> Vec<(u64, u64)> {
    assert_trees(nodes, src, bytes);
    nodes
        .iter()
        .map(|n| {
            let p = n.progress.snapshot();
            assert_eq!(
                p.origin_bytes + p.peer_bytes,
                bytes,
                "{}: every byte came from the source or a peer",
                n.name
            );
            (p.origin_bytes, p.peer_bytes)
        })
        .collect()
}

/// Each node's copy is the source's tree (bytes, modes, links), and its progress says so.
fn assert_trees(nodes: &[Node], src: &Path, bytes: u64) {
    let want = tree(src, 0);
    for n in nodes {
        {
            let got = tree(&n.dir.path().join("ds"), 0);
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>(),
                "the entries staged on {}",
                n.name
            );
            for (k, (data, mode)) in &want {
                assert!(
                    got[k].0 == *data,
                    "{k} on {} differs from the source",
                    n.name
                );
                // Directories are made owner-writable, as a POSIX stage always made them.
                let mode = if data == b"dir" { mode | 0o700 } else { *mode };
                assert_eq!(got[k].1, mode, "the mode of {k} on {}", n.name);
            }
            let p = n.progress.snapshot();
            assert_eq!(
                (p.bytes_done, p.files_done, p.files_total),
                (bytes, 33, Some(33)),
                "{}'s progress",
                n.name
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_read_a_posix_source_once_and_each_ends_with_the_whole_tree() {
    let src = tempfile::tempdir().unwrap();
    let bytes = source(src.path());
    let nodes = nodes(&["n1", "n2", "n3"], src.path()).await;
    for notes in stage_all(&nodes, src.path()).await {
        assert!(notes.is_empty(), "{notes:?}");
    }
    let counts = assert_identical(&nodes, src.path(), bytes);
    assert_eq!(
        counts.iter().map(|c| c.0).sum::<u64>(),
        bytes,
        "the helpers read each byte of the source once in all: {counts:?}"
    );
    assert_each_read_some_and_took_the_rest(&nodes, &counts);
    stop(&nodes);
}

/// A dataset that is one file (`ds=/path/big.bin`): `$SLUICE_STAGE_DIR/ds` is that file on every
/// node, read-only like its source, its units read once in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_single_file_is_shared_unit_by_unit() {
    let dir = tempfile::tempdir().unwrap();
    source(dir.path());
    let src = dir.path().join("big.bin");
    let size = std::fs::metadata(&src).unwrap().len();
    let nodes = nodes(&["n1", "n2", "n3"], &src).await;
    for notes in stage_all(&nodes, &src).await {
        assert!(notes.is_empty(), "{notes:?}");
    }
    let want = std::fs::read(&src).unwrap();
    let mut origin = 0;
    for n in &nodes {
        let copy = n.dir.path().join("ds");
        assert!(std::fs::read(&copy).unwrap() == want, "ds on {}", n.name);
        let mode = std::fs::metadata(&copy).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o444, "the mode of ds on {}", n.name);
        let p = n.progress.snapshot();
        assert_eq!((p.bytes_done, p.files_done), (size, 1), "{}", n.name);
        assert_eq!(p.origin_bytes + p.peer_bytes, size, "{}", n.name);
        origin += p.origin_bytes;
    }
    assert_eq!(origin, size, "each unit read once");
    stop(&nodes);
}

/// n3's agent is not there: n1 and n2 route around it, copy its share of the units from the
/// source themselves (one of them each, by the same hashing), end with the whole tree, and note it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_peer_is_routed_around_and_its_share_copied_from_the_source() {
    let src = tempfile::tempdir().unwrap();
    let bytes = source(src.path());
    let nodes = nodes(&["n1", "n2"], src.path()).await;
    for notes in stage_all(&nodes, src.path()).await {
        assert!(
            notes
                .iter()
                .any(|n| n.contains("node n3's agent could not be used")),
            "{notes:?}"
        );
    }
    let counts = assert_identical(&nodes, src.path(), bytes);
    assert_eq!(
        counts.iter().map(|c| c.0).sum::<u64>(),
        bytes,
        "n3's share read once, by one of the others: {counts:?}"
    );
    stop(&nodes);
}

/// [`nodes`] n1..n3, each with a cross-job cache (`caches`, one per node, kept between jobs).
async fn nodes_with_caches(src: &Path, caches: &[Arc<Cache>]) -> Vec<Node> {
    let mut nodes = nodes(&["n1", "n2", "n3"], src).await;
    for (n, c) in nodes.iter_mut().zip(caches) {
        n.ctx.cache = Some(c.clone());
    }
    nodes
}

/// A cache of node `name` on a hot tier of its own (in `dir`).
fn cache_of(name: &str, dir: &Path) -> Arc<Cache> {
    let text = format!(
        "[agent]\nsocket='{d}/s'\nstate_dir='{d}/st'\n[hot_tier]\nroot='{d}'\n\
         [cache]\nsize='64MiB'\nmin_free=0\n",
        d = dir.display()
    );
    let cfg =
        sluice_core::config::Config::parse(&text, name, sluice_archive::upload_memory).unwrap();
    Cache::open(&cfg).unwrap().expect("a [cache] section")
}

/// Two jobs on the same three nodes, each node with its own cache: the first reads the source
/// once in all and every node keeps every file it staged (the units it copied and those it
/// fetched, checked against their owners' hashes); the second job's nodes each write the whole
/// tree from their own cache — no byte from the source or a peer — and end with identical copies.
/// A file changed before a third job is read from the source again (once in all), the rest still
/// from the caches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_job_on_the_same_nodes_stages_a_posix_tree_from_each_nodes_cache() {
    let src = tempfile::tempdir().unwrap();
    let bytes = source(src.path());
    let hot: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let caches: Vec<Arc<Cache>> = job_nodes()
        .iter()
        .zip(&hot)
        .map(|(name, d)| cache_of(name, d.path()))
        .collect();
    // Non-empty files: what a cache keeps.
    let files = 32;

    let first = nodes_with_caches(src.path(), &caches).await;
    for notes in stage_all(&first, src.path()).await {
        assert!(notes.is_empty(), "{notes:?}");
    }
    let counts = assert_identical(&first, src.path(), bytes);
    assert_eq!(counts.iter().map(|c| c.0).sum::<u64>(), bytes, "{counts:?}");
    for (n, c) in first.iter().zip(&caches) {
        assert_eq!(
            n.progress.snapshot().cache_bytes,
            0,
            "{}: a cold cache",
            n.name
        );
        let s = c.stats();
        assert_eq!(s.entries, files, "{} keeps every file it staged", n.name);
        n.stop.cancel();
    }

    let second = nodes_with_caches(src.path(), &caches).await;
    for notes in stage_all(&second, src.path()).await {
        assert!(notes.is_empty(), "{notes:?}");
    }
    assert_trees(&second, src.path(), bytes);
    for n in &second {
        let p = n.progress.snapshot();
        assert_eq!(
            (p.cache_bytes, p.origin_bytes, p.peer_bytes),
            (bytes, 0, 0),
            "{}: the whole tree from its own cache, nothing from the source or a peer",
            n.name
        );
        n.stop.cancel();
    }

    // A file rewritten (new bytes, new size, new mtime) is a miss on every node.
    let changed: Vec<u8> = (0..5_555u32).map(|i| (i * 7) as u8).collect();
    std::fs::write(src.path().join(small_file(3)), &changed).unwrap();
    let bytes = bytes - (500 + 3 * 1013) + changed.len() as u64;
    let third = nodes_with_caches(src.path(), &caches).await;
    for notes in stage_all(&third, src.path()).await {
        assert!(notes.is_empty(), "{notes:?}");
    }
    assert_trees(&third, src.path(), bytes);
    let mut origin = 0;
    for n in &third {
        let p = n.progress.snapshot();
        assert_eq!(
            p.cache_bytes,
            bytes - changed.len() as u64,
            "{}: all but the changed file from its cache",
            n.name
        );
        assert_eq!(
            p.origin_bytes + p.peer_bytes,
            changed.len() as u64,
            "{}",
            n.name
        );
        origin += p.origin_bytes;
        n.stop.cancel();
    }
    assert_eq!(
        origin,
        changed.len() as u64,
        "the changed file read once, by its owner"
    );
    for (n, c) in third.iter().zip(&caches) {
        assert_eq!(
            c.stats().entries,
            files + 1,
            "{} keeps the new version",
            n.name
        );
    }
}
