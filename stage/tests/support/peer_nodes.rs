//! The nodes of one job in one process, for the peer tests: the agent's `agent/tests/posix_peers.rs`
//! (a POSIX source, the real copy helper, which is the agent's `sluiced` binary) and the unit tests
//! in `stage/src/peers/tests.rs` (an in-memory object store handed to the private object stager).
//! Each node gets a config with a `[peer]` section naming every node, a peer server on its own
//! 127.0.0.1 port and a fresh stage directory.
//!
//! A file both include with `#[path]` rather than a module of the library: an integration test
//! sees only the crate's public API, the unit tests need its private one, and test set-up has no
//! place in what the stager ships. The stager's and peer layer's types come from the includer
//! (`use super::…`), which imports them as `sluice_stage::…`/`sluice_peer::…` or `crate::…`.

use super::StageCtx;
use super::{Budget, ClusterSecret, NodePeers, PeerServer, PeerService, Progress, ServerConfig};
use sluice_core::config::Config;
use sluice_core::safefs::{self, Owner};
use sluice_proto::options::StageSpec;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One node of the job: its config, peers, stage directory and progress; `stop` ends its peer
/// server.
pub struct Node {
    pub name: String,
    pub ctx: StageCtx,
    pub peers: NodePeers,
    pub dir: tempfile::TempDir,
    pub progress: Arc<Progress>,
    pub stop: CancellationToken,
}

/// What differs between the suites' nodes.
pub struct Setup {
    /// `[peer] unit_size`.
    pub unit_size: &'static str,
    /// The job's user.
    pub owner: Owner,
    pub user: String,
    /// The `sluiced` that runs `copy-as-user` (a POSIX stage needs the real one).
    pub helper_exe: PathBuf,
    /// The dataset every node stages.
    pub spec: StageSpec,
    /// More `[peer]` settings, TOML lines (`""`: none).
    pub peer_more: &'static str,
}

/// The test process's own uid and gid: the job's user.
pub use sluice_core::testing::me;

pub fn job_nodes() -> Vec<String> {
    ["n1", "n2", "n3"].map(String::from).to_vec()
}

/// Binds a port for each of n1..n3.
pub async fn listeners() -> (Vec<TcpListener>, BTreeMap<String, String>) {
    let mut ls = Vec::new();
    let mut addrs = BTreeMap::new();
    for n in job_nodes() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.insert(n, l.local_addr().unwrap().to_string());
        ls.push(l);
    }
    (ls, addrs)
}

/// Starts node `name`'s peer server on `listener`; `addrs` is how this node reaches every node
/// (a test may route one peer through a relay).
pub async fn node(
    name: &str,
    listener: TcpListener,
    addrs: &BTreeMap<String, String>,
    setup: &Setup,
) -> Node {
    let mut text = format!(
        "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n\
         [stage]\nconcurrency = 4\nmemory = '1MiB'\ntimeout = '60s'\n\
         [peer]\nsecret_file = '/nonexistent/peer.key'\nunit_size = '{}'\n\
         concurrency = 4\nconnect_timeout = '1s'\nread_timeout = '3s'\n{}\n[peer.nodes]\n",
        setup.unit_size, setup.peer_more
    );
    for (n, a) in addrs {
        text.push_str(&format!("{n} = '{a}'\n"));
    }
    let cfg = Arc::new(Config::parse(&text, name, sluice_archive::upload_memory).unwrap());
    let peer_cfg = cfg.peer.clone().unwrap();
    let server = PeerServer::new(
        ClusterSecret::from_bytes(*b"an in-process test secret, 32 b!"),
        ServerConfig::from_config(&peer_cfg),
    );
    let (peers, PeerService { server, listener }) =
        NodePeers::with(&cfg, &peer_cfg, server, listener);
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { server.serve(listener, s).await });
    let dir = tempfile::tempdir().unwrap();
    let ctx = StageCtx {
        cfg: cfg.clone(),
        owner: setup.owner,
        user: setup.user.clone(),
        stage_path: dir.path().into(),
        stage_fd: Arc::new(safefs::open_root_dir(dir.path()).unwrap()),
        helper_exe: setup.helper_exe.clone(),
        cancel: CancellationToken::new(),
        budget: Budget::new(&cfg.stage),
        shared_tier: None,
        cache: None,
        resume: None,
    };
    Node {
        name: name.into(),
        ctx,
        peers,
        dir,
        progress: Arc::new(Progress::new(&setup.spec)),
        stop,
    }
}

/// Each of `nodes` read part of the dataset itself and took the rest from the others: `counts`
/// are their bytes from the origin and from peers, in the same order.
pub fn assert_each_read_some_and_took_the_rest(nodes: &[Node], counts: &[(u64, u64)]) {
    for (n, (origin, peer)) in nodes.iter().zip(counts) {
        assert!(*origin > 0 && *peer > 0, "{}: {origin} + {peer}", n.name);
    }
}

/// Stops the nodes' peer servers.
pub fn stop(nodes: &[Node]) {
    for n in nodes {
        n.stop.cancel();
    }
}
