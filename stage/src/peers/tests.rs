//! Three nodes of one job in one process: the real stager, peer servers on 127.0.0.1 ports and
//! the real client, staging from one in-memory object store that counts the bytes it serves. What
//! a job would see: every node's copy identical to the origin, and the origin read once.

use super::*;
use crate::{Budget, Progress, StageCtx};
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use sluice_core::config::Config;
use sluice_peer::{PeerServer, PeerService, ServerConfig};
use sluice_proto::options::{StageSpec, parse_stage_entry};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const JOB: u32 = 77;

/// The origin: an in-memory store that counts the object bytes its GETs return. GETs after the
/// first `stall_after` never answer (an origin a killed agent was reading when it died).
#[derive(Debug)]
pub(crate) struct CountingStore {
    pub(crate) inner: object_store::memory::InMemory,
    pub(crate) served: AtomicU64,
    pub(crate) gets: AtomicU64,
    pub(crate) stall_after: AtomicU64,
    /// Listings and `HEAD`s asked of it (the listing's metadata requests).
    pub(crate) lists: AtomicU64,
    pub(crate) heads: AtomicU64,
    /// How long each GET of an object's bytes takes.
    pub(crate) delay: std::sync::Mutex<Duration>,
    /// GETs of these locations in flight now, and the most there were at once.
    pub(crate) watched: std::sync::Mutex<std::collections::HashSet<String>>,
    pub(crate) watched_now: AtomicU64,
    pub(crate) watched_max: AtomicU64,
}

impl CountingStore {
    pub(crate) fn new() -> CountingStore {
        CountingStore {
            inner: object_store::memory::InMemory::new(),
            served: AtomicU64::new(0),
            gets: AtomicU64::new(0),
            stall_after: AtomicU64::new(u64::MAX),
            lists: AtomicU64::new(0),
            heads: AtomicU64::new(0),
            delay: std::sync::Mutex::new(Duration::ZERO),
            watched: Default::default(),
            watched_now: AtomicU64::new(0),
            watched_max: AtomicU64::new(0),
        }
    }

    /// A store holding the dataset `ds/`: each of `files` (path below it, bytes).
    pub(crate) async fn holding(files: &BTreeMap<String, Vec<u8>>) -> Arc<CountingStore> {
        let store = Arc::new(CountingStore::new());
        for (k, v) in files {
            store
                .inner
                .put(&ObjPath::from(format!("ds/{k}")), v.clone().into())
                .await
                .unwrap();
        }
        store
    }
}

impl std::fmt::Display for CountingStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CountingStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for CountingStore {
    async fn put_opts(
        &self,
        location: &ObjPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let head = options.head;
        if head {
            self.heads.fetch_add(1, Ordering::SeqCst);
        }
        if !head
            && self.gets.fetch_add(1, Ordering::SeqCst) >= self.stall_after.load(Ordering::SeqCst)
        {
            std::future::pending::<()>().await;
        }
        let watched = !head && sluice_core::rt::lock(&self.watched).contains(location.as_ref());
        if watched {
            let now = self.watched_now.fetch_add(1, Ordering::SeqCst) + 1;
            self.watched_max.fetch_max(now, Ordering::SeqCst);
        }
        let delay = *sluice_core::rt::lock(&self.delay);
        if !head && !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if watched {
            self.watched_now.fetch_sub(1, Ordering::SeqCst);
        }
        let r = self.inner.get_opts(location, options).await?;
        if !head {
            self.served
                .fetch_add(r.range.end - r.range.start, Ordering::SeqCst);
        }
        Ok(r)
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// The dataset `ds/`: one object of several units (and a short last one), small objects, an
/// empty one, a nested one. Returns the store and the dataset's files and their bytes.
async fn origin() -> (Arc<CountingStore>, BTreeMap<String, Vec<u8>>) {
    let mut files = BTreeMap::new();
    let big: Vec<u8> = (0..(5 << 20) + 12_345u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    files.insert("big.bin".to_string(), big);
    for i in 0..40u32 {
        let n = 1000 + i as usize * 997;
        files.insert(
            format!("small/part-{i:03}.bin"),
            (0..n).map(|j| (j as u32 ^ i) as u8).collect(),
        );
    }
    files.insert("empty".to_string(), Vec::new());
    files.insert("a/b/c/deep.txt".to_string(), b"deep".to_vec());
    (CountingStore::holding(&files).await, files)
}

fn dataset_bytes(files: &BTreeMap<String, Vec<u8>>) -> u64 {
    files.values().map(|v| v.len() as u64).sum()
}

fn spec() -> StageSpec {
    parse_stage_entry("ds=s3://b/ds").unwrap()
}

// The job's nodes, set up as the agent's `agent/tests/posix_peers.rs` sets up its own (see that file's header).
#[path = "../../tests/support/peer_nodes.rs"]
mod peer_nodes;
use peer_nodes::{
    Node, Setup, assert_each_read_some_and_took_the_rest, job_nodes, listeners, me, stop,
};

/// Starts node `name`'s peer server on `listener`; `addrs` is how this node reaches every node
/// (a test may route one peer through a relay). Units of 2 MiB; the object stager copies no
/// files as the user, so there is no helper.
async fn node(name: &str, listener: TcpListener, addrs: &BTreeMap<String, String>) -> Node {
    node_with(name, listener, addrs, "").await
}

/// [`node`] with more `[peer]` settings.
async fn node_with(
    name: &str,
    listener: TcpListener,
    addrs: &BTreeMap<String, String>,
    peer_more: &'static str,
) -> Node {
    let setup = Setup {
        unit_size: "2MiB",
        owner: me(),
        user: "me".into(),
        helper_exe: "/bin/false".into(),
        spec: spec(),
        peer_more,
    };
    peer_nodes::node(name, listener, addrs, &setup).await
}

/// The job's three nodes, each reaching the others directly.
async fn three_nodes() -> Vec<Node> {
    let (ls, addrs) = listeners().await;
    start_nodes(ls, |_| &addrs).await
}

/// A [`node`] on each of `ls` (the job's nodes in order), node `name` reaching the others at
/// `addrs_of(name)`.
async fn start_nodes<'a>(
    ls: Vec<TcpListener>,
    addrs_of: impl Fn(&str) -> &'a BTreeMap<String, String>,
) -> Vec<Node> {
    let mut nodes = Vec::new();
    for (name, l) in job_nodes().iter().zip(ls) {
        nodes.push(node(name, l, addrs_of(name)).await);
    }
    nodes
}

/// [`start_nodes`] with [`node_with_cache`]; the hot tiers live as long as the directories.
async fn start_nodes_with_cache<'a>(
    ls: Vec<TcpListener>,
    addrs_of: impl Fn(&str) -> &'a BTreeMap<String, String>,
) -> (Vec<Node>, Vec<tempfile::TempDir>) {
    let (mut nodes, mut hots) = (Vec::new(), Vec::new());
    for (name, l) in job_nodes().iter().zip(ls) {
        let (n, hot) = node_with_cache(name, l, addrs_of(name)).await;
        nodes.push(n);
        hots.push(hot);
    }
    (nodes, hots)
}

/// How the nodes reach each other in the tests of a relay that changes bytes: one node reaches
/// another through a [`tampering_relay`], every other route is direct.
struct RelayedRoutes {
    direct: BTreeMap<String, String>,
    /// The node whose route is relayed, and its routes: `direct` with one node behind the relay.
    from: String,
    relayed: BTreeMap<String, String>,
}

impl RelayedRoutes {
    /// The job's listeners, and their routes with n1 reaching n2 through the relay.
    async fn start() -> (Vec<TcpListener>, RelayedRoutes) {
        RelayedRoutes::between("n1", "n2").await
    }

    /// The job's listeners, and their routes with `from` reaching `to` through the relay.
    async fn between(from: &str, to: &str) -> (Vec<TcpListener>, RelayedRoutes) {
        let (ls, direct) = listeners().await;
        let mut relayed = direct.clone();
        relayed.insert(to.into(), tampering_relay(direct[to].clone()).await);
        let from = from.to_string();
        (
            ls,
            RelayedRoutes {
                direct,
                from,
                relayed,
            },
        )
    }

    /// How node `name` reaches the others.
    fn of(&self, name: &str) -> &BTreeMap<String, String> {
        if name == self.from {
            &self.relayed
        } else {
            &self.direct
        }
    }
}

/// `n` joins the test's job: its three nodes, one piece of shared work (the dataset) and the
/// dataset's URL.
fn join_job(n: &Node) -> Arc<JobPeers> {
    n.peers
        .join(JOB, &job_nodes(), me(), 1, &datasets())
        .unwrap()
}

/// Stages the dataset on `nodes` at once, each sharing it with the job's three nodes, the way
/// the agent's set-up does (join, stage, close); fails unless every node staged it, and returns
/// each node's job peers. The stager is handed the test's counting store directly (the agent
/// opens it from the config).
async fn stage_all(nodes: &[&Node], store: &Arc<CountingStore>) -> Vec<Arc<JobPeers>> {
    stage_each(nodes, &vec![store; nodes.len()]).await
}

/// [`stage_all`], node `i` listing and reading `stores[i]`.
async fn stage_each(nodes: &[&Node], stores: &[&Arc<CountingStore>]) -> Vec<Arc<JobPeers>> {
    stage_each_from(nodes, stores, &vec![spec(); nodes.len()]).await
}

/// [`stage_each`], node `i` staging `specs[i]` (a node that names another source for the dataset
/// than the job's lister is not passed its listing: it lists `stores[i]` itself).
async fn stage_each_from(
    nodes: &[&Node],
    stores: &[&Arc<CountingStore>],
    specs: &[StageSpec],
) -> Vec<Arc<JobPeers>> {
    let runs = nodes
        .iter()
        .zip(stores)
        .zip(specs)
        .map(|((n, store), spec)| {
            let store = (*store).clone() as Arc<dyn ObjectStore>;
            async move {
                let peers = join_job(n);
                let spec = spec.clone();
                let sluice_proto::options::Source::Object { prefix, .. } = &spec.source else {
                    panic!("an object-store dataset")
                };
                let run = crate::object::stage(
                    &n.ctx,
                    &spec,
                    store,
                    prefix,
                    n.progress.clone(),
                    Some(peers.clone()),
                    None,
                );
                let r = tokio::time::timeout(Duration::from_secs(60), run)
                    .await
                    .unwrap_or_else(|_| panic!("{} did not finish staging", n.name));
                peers.close("done");
                r.unwrap_or_else(|e| panic!("{} could not stage: {e:?}", n.name));
                peers
            }
        });
    futures::future::join_all(runs).await
}

/// Every file of `dir/ds`, relative, with its bytes.
fn read_tree(dir: &std::path::Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let root = dir.join("ds");
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if e.file_type().unwrap().is_dir() {
                stack.push(p);
            } else {
                let rel = p
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Checks each node's copy against the origin; returns the nodes' origin and peer byte counts.
fn assert_identical(nodes: &[&Node], files: &BTreeMap<String, Vec<u8>>) -> Vec<(u64, u64)> {
    nodes
        .iter()
        .map(|n| {
            let got = read_tree(n.dir.path());
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                files.keys().collect::<Vec<_>>(),
                "the files staged on {}",
                n.name
            );
            for (k, v) in files {
                assert!(got[k] == *v, "{k} on {} differs from the origin", n.name);
            }
            let p = n.progress.snapshot();
            assert_eq!(
                (p.bytes_done, p.files_done),
                (dataset_bytes(files), files.len() as u64),
                "{}'s progress",
                n.name
            );
            assert_eq!(
                p.origin_bytes + p.peer_bytes,
                p.bytes_done,
                "{}: every byte came from the origin or a peer",
                n.name
            );
            (p.origin_bytes, p.peer_bytes)
        })
        .collect()
}

/// A node routed around (or a cache given up) keeps the reason it was first given: a later
/// failure of the same node neither replaces it nor counts as new.
#[test]
fn the_first_reason_for_a_node_stands() {
    let mut reasons = BTreeMap::new();
    assert!(first_reason(&mut reasons, "n2", "unreachable"));
    assert!(!first_reason(&mut reasons, "n2", "corrupt twice"));
    assert!(first_reason(&mut reasons, "n3", "corrupt twice"));
    assert_eq!(reasons["n2"], "unreachable");
    assert_eq!(reasons.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_read_the_origin_once_and_each_ends_with_the_whole_dataset() {
    let (store, files) = origin().await;
    let nodes = three_nodes().await;
    let all: Vec<&Node> = nodes.iter().collect();
    for peers in stage_all(&all, &store).await {
        assert!(peers.notes().is_empty(), "{:?}", peers.notes());
    }
    let counts = assert_identical(&all, &files);
    let total = dataset_bytes(&files);
    assert_eq!(
        store.served.load(Ordering::SeqCst),
        total,
        "the origin served each byte of the dataset exactly once"
    );
    // Each node read its own share and took the rest from the others.
    assert_eq!(counts.iter().map(|c| c.0).sum::<u64>(), total);
    assert_each_read_some_and_took_the_rest(&nodes, &counts);
    assert_eq!(
        (
            store.heads.load(Ordering::SeqCst),
            store.lists.load(Ordering::SeqCst)
        ),
        (1, 1),
        "one node asked whether the dataset is one object, and listed it; the others took its listing"
    );
    stop(&nodes);
}

/// The node the dataset's listing is taken from.
fn lister() -> String {
    let nodes = job_nodes();
    nodes[sluice_peer::owner_of("\0listing/ds", &nodes)].clone()
}

/// A dataset of more objects than a listing page holds: one listing pass in all, and the pages
/// the other nodes take hold every object once (each node ends with the whole dataset).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dataset_of_many_pages_is_listed_once_per_job() {
    let files: BTreeMap<String, Vec<u8>> = (0..super::listing::PAGE_OBJECTS as u32 * 2 + 17)
        .map(|i| (format!("f/{i:05}"), i.to_le_bytes().to_vec()))
        .collect();
    let store = CountingStore::holding(&files).await;
    let nodes = three_nodes().await;
    let all: Vec<&Node> = nodes.iter().collect();
    stage_all(&all, &store).await;
    assert_identical(&all, &files);
    assert_eq!(store.lists.load(Ordering::SeqCst), 1);
    assert_eq!(store.served.load(Ordering::SeqCst), dataset_bytes(&files));
    stop(&nodes);
}

/// The node that would list the dataset has no agent: the others route around it, the next node
/// of the hash lists the origin, once, and passes its listing on; every node still ends with the
/// whole dataset and the job's output says which node was routed around.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lister_without_an_agent_is_routed_around_and_the_origin_still_listed_once() {
    let (store, files) = origin().await;
    let (ls, addrs) = listeners().await;
    let dead = lister();
    let mut nodes = Vec::new();
    for (name, l) in job_nodes().into_iter().zip(ls) {
        if name != dead {
            nodes.push(node(&name, l, &addrs).await);
        }
    }
    let two: Vec<&Node> = nodes.iter().collect();
    for peers in stage_all(&two, &store).await {
        let notes = peers.notes();
        assert!(
            notes.len() == 1
                && notes[0].contains(&format!("node {dead}'s agent could not be used")),
            "{notes:?}"
        );
    }
    assert_identical(&two, &files);
    assert_eq!(
        (
            store.heads.load(Ordering::SeqCst),
            store.lists.load(Ordering::SeqCst)
        ),
        (1, 1)
    );
    assert_eq!(store.served.load(Ordering::SeqCst), dataset_bytes(&files));
}

/// A dataset named by one object's key: one `HEAD` per job and no listing; every node stages that
/// object under the dataset's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_one_object_dataset_is_looked_up_once_per_job() {
    let (store, files) = origin().await;
    let nodes = three_nodes().await;
    let all: Vec<&Node> = nodes.iter().collect();
    let one = parse_stage_entry("ds=s3://b/ds/big.bin").unwrap();
    stage_each_from(&all, &[&store; 3], &[one.clone(), one.clone(), one]).await;
    for n in &nodes {
        assert!(
            std::fs::read(n.dir.path().join("ds")).unwrap() == files["big.bin"],
            "{}'s copy of big.bin",
            n.name
        );
    }
    assert_eq!(
        (
            store.heads.load(Ordering::SeqCst),
            store.lists.load(Ordering::SeqCst)
        ),
        (1, 0)
    );
    assert_eq!(
        store.served.load(Ordering::SeqCst),
        files["big.bin"].len() as u64
    );
    stop(&nodes);
}

/// An object overwritten while the job's nodes listed the dataset each for itself (as nodes do
/// when the job's lister cannot pass its listing on, see [`listing`](super::listing); here n1
/// names the dataset's source otherwise, so the lister does not answer it, nor it the others): n1
/// listed the old version, n2 and n3 the new one (same size, other bytes, another ETag; both
/// versions still readable, as in a versioned bucket or while the overwrite settles). The nodes
/// never exchange that object's units: every node ends with the version it listed, whole — no
/// file mixes ranges of both — and the rest of the dataset is still read from the origin once in
/// all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_that_listed_two_versions_of_an_object_never_mix_them() {
    let (old, files) = origin().await;
    let (new, mut new_files) = origin().await;
    let changed: Vec<u8> = files["big.bin"].iter().map(|b| b ^ 0x5a).collect();
    new.inner
        .put(&ObjPath::from("ds/big.bin"), changed.clone().into())
        .await
        .unwrap();
    new_files.insert("big.bin".to_string(), changed);
    let etag = |s: &Arc<CountingStore>| {
        let s = s.clone();
        async move { s.head(&ObjPath::from("ds/big.bin")).await.unwrap().e_tag }
    };
    assert_ne!(
        etag(&old).await,
        etag(&new).await,
        "the overwrite has a new ETag"
    );

    let nodes = three_nodes().await;
    let all: Vec<&Node> = nodes.iter().collect();
    let elsewhere = parse_stage_entry("ds=s3://b-old/ds").unwrap();
    stage_each_from(&all, &[&old, &new, &new], &[elsewhere, spec(), spec()]).await;
    assert_eq!(old.lists.load(Ordering::SeqCst), 1, "n1 listed its origin");
    assert_identical(&all[..1], &files);
    assert_identical(&all[1..], &new_files);
    // Every other object's bytes crossed the origin once. Of the object of two versions, n1 read
    // the old one whole, and n2 and n3 the new one: each unit of it once, but those whose owner
    // by hashing is n1 (which knows no such version) by each of them.
    let big = files["big.bin"].len() as u64;
    let rest = dataset_bytes(&files) - big;
    let served = (
        old.served.load(Ordering::SeqCst),
        new.served.load(Ordering::SeqCst),
    );
    let total = served.0 + served.1;
    assert!(
        (rest + 2 * big..=rest + 3 * big).contains(&total),
        "{served:?}: the dataset's bytes once, plus the two versions of big.bin"
    );
    assert!(
        served.0 >= big,
        "n1 read the old version itself: {served:?}"
    );
    stop(&nodes);
}

/// `--stage-mode=shard` on three nodes: each holds exactly the files it owns, together they hold
/// the dataset once, the origin served it once, and every node wrote the same manifest (which
/// names the holder of each file).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_shard_nodes_hold_the_dataset_once_and_write_the_same_manifest() {
    use crate::shard::{ShardManifest, ShardPlan};
    let (store, files) = origin().await;
    let nodes = three_nodes().await;
    let runs = nodes.iter().map(|n| {
        let store = store.clone() as Arc<dyn ObjectStore>;
        async move {
            let plan = ShardPlan::new(&job_nodes(), &n.name).unwrap();
            let spec = spec();
            crate::object::stage(
                &n.ctx,
                &spec,
                store,
                "ds",
                n.progress.clone(),
                None,
                Some(&plan),
            )
            .await
        }
    });
    for r in futures::future::join_all(runs).await {
        r.unwrap();
    }
    assert_eq!(
        store.served.load(Ordering::SeqCst),
        dataset_bytes(&files),
        "the origin served each byte of the dataset exactly once"
    );
    let manifests: Vec<Vec<u8>> = nodes
        .iter()
        .map(|n| std::fs::read(n.dir.path().join("ds.shard.json")).unwrap())
        .collect();
    assert!(
        manifests.iter().all(|m| *m == manifests[0]),
        "manifests differ"
    );
    let manifest: ShardManifest = serde_json::from_slice(&manifests[0]).unwrap();
    assert_eq!(manifest.nodes, job_nodes());
    assert_eq!(manifest.source, "s3://b/ds");
    let listed: BTreeMap<String, (String, u64)> = manifest
        .files
        .iter()
        .map(|f| (f.path.clone(), (f.node.clone(), f.size)))
        .collect();
    assert_eq!(listed.len(), files.len());
    let mut union = BTreeMap::new();
    for n in &nodes {
        let held = read_tree(n.dir.path());
        assert!(!held.is_empty(), "{} holds no file", n.name);
        let p = n.progress.snapshot();
        assert_eq!(p.files_done, held.len() as u64, "{}'s progress", n.name);
        assert_eq!(p.files_total, Some(held.len() as u64));
        for (k, v) in held {
            let (holder, size) = &listed[&format!("ds/{k}")];
            assert_eq!((holder, *size), (&n.name, v.len() as u64), "{k}");
            assert!(union.insert(k.clone(), v).is_none(), "{k} is on two nodes");
        }
    }
    assert_eq!(
        union, files,
        "the nodes together hold the dataset, byte for byte"
    );
    stop(&nodes);
}

/// n3's agent is not there (nothing listens on its port): n1 and n2 route around it and split its
/// share, so the job still gets identical data, the origin still serves each byte once, and the
/// job output gets a note.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_without_an_agent_is_routed_around_and_the_origin_still_read_once() {
    let (store, files) = origin().await;
    let (mut ls, addrs) = listeners().await;
    drop(ls.pop()); // n3's port: closed
    let nodes = start_nodes(ls, |_| &addrs).await;
    let two: Vec<&Node> = nodes.iter().collect();
    for peers in stage_all(&two, &store).await {
        let notes = peers.notes();
        assert!(
            notes.len() == 1 && notes[0].contains("node n3's agent could not be used"),
            "{notes:?}"
        );
    }
    assert_identical(&two, &files);
    assert_eq!(store.served.load(Ordering::SeqCst), dataset_bytes(&files));
}

/// n3's agent is not there and the job's fallback budget is 2 origin requests
/// (`peer.fallback_concurrency`): n1 and n2 read n3's share of the dataset one request at a time
/// each, never more than 2 at once at the origin however many slots their own stage budgets have,
/// and still end with the whole dataset, the origin serving each byte once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_nodes_share_reaches_the_origin_within_the_jobs_fallback_budget() {
    let files: BTreeMap<String, Vec<u8>> = (0..48u32)
        .map(|i| (format!("f/{i:03}"), vec![i as u8; 100_000]))
        .collect();
    let store = CountingStore::holding(&files).await;
    *sluice_core::rt::lock(&store.delay) = Duration::from_millis(40);
    let nodes3 = job_nodes();
    for rel in files.keys() {
        let at = ObjPath::from(format!("ds/{rel}"));
        let etag = store.inner.head(&at).await.unwrap().e_tag;
        let unit = sluice_peer::Unit::new(
            sluice_peer::versioned(&format!("ds/{rel}"), etag.as_deref()),
            0,
            100_000,
        );
        if nodes3[sluice_peer::owner_of(&unit.key(), &nodes3)] == "n3" {
            sluice_core::rt::lock(&store.watched).insert(at.to_string());
        }
    }
    let n3s = sluice_core::rt::lock(&store.watched).len();
    assert!(n3s >= 8, "n3 owns {n3s} of the 48 files");
    let (mut ls, addrs) = listeners().await;
    drop(ls.pop()); // n3's port: closed
    let mut nodes = Vec::new();
    for (name, l) in job_nodes().into_iter().zip(ls) {
        nodes.push(node_with(&name, l, &addrs, "fallback_concurrency = 2").await);
    }
    let two: Vec<&Node> = nodes.iter().collect();
    stage_all(&two, &store).await;
    assert_identical(&two, &files);
    assert_eq!(store.served.load(Ordering::SeqCst), dataset_bytes(&files));
    let most = store.watched_max.load(Ordering::SeqCst);
    assert!(
        (1..=2).contains(&most),
        "{most} GETs of n3's files at once at the origin; the job's budget is 2"
    );
    stop(&nodes);
}

/// n1 staged the dataset whole before its agent restarted; one of its files was truncated
/// since. Restarted, it keeps the rest and serves those units to n2 and n3 with hashes of the
/// files as it reads them back now: n2 and n3 check every unit they take from n1 against them (a
/// hash from before the restart would fail the truncated file's), and every node ends with the
/// dataset whole. The origin serves less than the dataset: n1's units come from its kept files.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_node_serves_the_units_it_kept_with_hashes_of_its_files_now() {
    let (store, files) = origin().await;
    let mut nodes = three_nodes().await;
    let state = tempfile::tempdir().unwrap();
    let log = |resuming| Some(job_resume(&state, resuming));
    // Before the restart: n1 alone staged it all.
    nodes[0].ctx.resume = log(false);
    stage_alone(&nodes[0], &store, Arc::new(Progress::new(&spec())))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let cut = nodes[0].dir.path().join("ds/small/part-007.bin");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(3)
        .unwrap();
    let cut_len = files["small/part-007.bin"].len() as u64;
    nodes[0].ctx.resume = log(true);
    let served = store.served.load(Ordering::SeqCst);

    let all: Vec<&Node> = nodes.iter().collect();
    for peers in stage_all(&all, &store).await {
        assert!(peers.notes().is_empty(), "{:?}", peers.notes());
    }
    let total = dataset_bytes(&files);
    for n in &nodes {
        assert_eq!(read_tree(n.dir.path()), files, "{}'s copy", n.name);
        let p = n.progress.snapshot();
        assert_eq!(
            p.origin_bytes + p.peer_bytes + p.resumed_bytes,
            total,
            "{}: {p:?}",
            n.name
        );
    }
    let p1 = nodes[0].progress.snapshot();
    assert_eq!(
        p1.resumed_bytes,
        total - cut_len,
        "n1 kept all but the cut file"
    );
    assert_eq!(p1.origin_bytes + p1.peer_bytes, cut_len);
    let served = store.served.load(Ordering::SeqCst) - served;
    let others: u64 = nodes[1..]
        .iter()
        .map(|n| n.progress.snapshot().origin_bytes)
        .sum();
    assert_eq!(served, p1.origin_bytes + others);
    assert!(
        served < total
            && nodes[1..]
                .iter()
                .all(|n| n.progress.snapshot().peer_bytes > 0),
        "n1's units came from n1: the origin served {served} of {total} bytes"
    );
    stop(&nodes);
}

/// Issue 11 item 6: n1 had staged the whole dataset, then its agent restarted, while n2 and n3
/// were still to stage. The restarted n1 serves them the units it owns of every file its staging
/// log names and that is still as staged, with hashes read back now — not the file its user changed
/// since, whose units n2 and n3 read from the origin themselves. Before, a restarted agent served
/// none: n2 and n3 routed around n1 and read all of its share from the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_staged_before_its_agent_restarted_serves_its_files_to_the_others() {
    let (store, files) = origin().await;
    let mut nodes = three_nodes().await;
    let state = tempfile::tempdir().unwrap();
    let resume = |resuming| job_resume(&state, resuming);
    // Before the restart: n1 staged it all (its log names every file).
    nodes[0].ctx.resume = Some(resume(false));
    stage_alone(&nodes[0], &store, Arc::new(Progress::new(&spec())))
        .await
        .unwrap();
    // The job's user rewrote one file in place since (same bytes: only its ctime tells).
    let changed = "big.bin";
    let path = nodes[0].dir.path().join("ds").join(changed);
    std::fs::write(&path, std::fs::read(&path).unwrap()).unwrap();

    // The restarted agent: the job is staged here; it joins and serves what the log names.
    let (peers, (offered, bytes)) = serve_after_restart(&nodes[0], resume(true)).await;
    let non_empty = files.values().filter(|v| !v.is_empty()).count() as u64;
    let total = dataset_bytes(&files);
    let changed_len = files[changed].len() as u64;
    assert_eq!((offered, bytes), (non_empty - 1, total - changed_len));

    // n2 and n3 stage now.
    let served = store.served.load(Ordering::SeqCst);
    let rest: Vec<&Node> = nodes[1..].iter().collect();
    stage_all(&rest, &store).await;
    for n in &rest {
        assert_eq!(read_tree(n.dir.path()), files, "{}'s copy", n.name);
    }
    // What the origin served: each unit n2 or n3 owns once; of n1's units, those of the file
    // changed on n1 twice (both read it themselves), the rest never.
    let listed: Vec<ObjectMeta> = store
        .inner
        .list(Some(&ObjPath::from("ds")))
        .map(|m| m.unwrap())
        .collect()
        .await;
    let mut expected = 0;
    for meta in &listed {
        let rel = &meta.location.as_ref()["ds/".len()..];
        let version = meta.e_tag.as_deref().or(meta.version.as_deref());
        let unit_file = sluice_peer::versioned(&format!("ds/{rel}"), version);
        for u in sluice_peer::units_of(&unit_file, meta.size, peers.unit_size()) {
            expected += match job_nodes()[sluice_peer::owner_of(&u.key(), &job_nodes())].as_str() {
                "n1" if rel == changed => 2 * u.len,
                "n1" => 0,
                _ => u.len,
            };
        }
    }
    let served = store.served.load(Ordering::SeqCst) - served;
    assert!(
        expected < total,
        "n1 owns some units: {expected} of {total}"
    );
    assert_eq!(
        served, expected,
        "the origin served n1's units only of the file changed on n1"
    );
    stop(&nodes);
}

/// A relay between n1 and n2 that changes bytes: n1 detects it (the owner's hash), fetches again
/// once, then routes around n2; its copy is still identical to the origin, with a note. n3, which
/// reaches n2 directly, is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tampering_relay_is_detected_and_its_units_fetched_elsewhere() {
    let (store, files) = origin().await;
    let (ls, routes) = RelayedRoutes::start().await;
    let nodes = start_nodes(ls, |name| routes.of(name)).await;
    let all: Vec<&Node> = nodes.iter().collect();
    for (i, peers) in stage_all(&all, &store).await.iter().enumerate() {
        let notes = peers.notes();
        if i == 0 {
            assert!(
                notes.len() == 1
                    && notes[0].contains("data from node n2 failed its checksum twice"),
                "{notes:?}"
            );
        } else {
            assert!(notes.is_empty(), "{}: {notes:?}", all[i].name);
        }
    }
    assert_identical(&all, &files);
    // n2's units that n1 now owns were read twice (by n2, then n1): never more than the dataset
    // plus n2's share.
    let served = store.served.load(Ordering::SeqCst);
    let n2_share = nodes[1].progress.snapshot().origin_bytes;
    assert!(
        served <= dataset_bytes(&files) + n2_share,
        "{served} > {} + {n2_share}",
        dataset_bytes(&files)
    );
}

/// A relay that changes bytes between a node and the node it takes the dataset's listing from:
/// the node finds the listing's pages corrupt, asks once more, then routes around that node (its
/// note says that node's data failed its checksum twice, as for units) and takes the listing
/// elsewhere. Every node ends with the whole dataset, and the origin is listed at most twice (once
/// more if the relayed node is now first in the listing's ranking).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listing_that_fails_its_checksum_is_taken_elsewhere() {
    // Long keys: pages of some hundreds of KiB, so every connection carries bytes the relay changes
    // (one in 64 KiB), however the pages are cut.
    let long = format!("{}/{}", "x".repeat(200), "y".repeat(200));
    let files: BTreeMap<String, Vec<u8>> = (0..super::listing::PAGE_OBJECTS as u32 * 2 + 17)
        .map(|i| (format!("f/{long}/{i:05}"), i.to_le_bytes().to_vec()))
        .collect();
    let store = CountingStore::holding(&files).await;
    let root = lister();
    let from = job_nodes().into_iter().find(|n| *n != root).unwrap();
    let (ls, routes) = RelayedRoutes::between(&from, &root).await;
    let nodes = start_nodes(ls, |name| routes.of(name)).await;
    let all: Vec<&Node> = nodes.iter().collect();
    for (n, peers) in all.iter().zip(stage_all(&all, &store).await) {
        let notes = peers.notes();
        if n.name == from {
            assert!(
                notes.len() == 1
                    && notes[0]
                        .contains(&format!("data from node {root} failed its checksum twice")),
                "{notes:?}"
            );
        } else {
            assert!(notes.is_empty(), "{}: {notes:?}", n.name);
        }
    }
    assert_identical(&all, &files);
    let lists = store.lists.load(Ordering::SeqCst);
    assert!((1..=2).contains(&lists), "{lists} listings");
    stop(&nodes);
}

/// A peer asking for a unit this node has not listed yet waits for it; once every dataset is
/// listed, a unit this node does not know is refused as not its own; a closed staging fails the
/// units it never got.
#[tokio::test]
async fn the_source_waits_for_units_it_will_hold_and_refuses_others() {
    let (ls, addrs) = listeners().await;
    let mut ls = ls.into_iter();
    let n = node("n1", ls.next().unwrap(), &addrs).await;
    let peers = n.peers.join(JOB, &job_nodes(), me(), 1, &[]).unwrap();
    let pending = |u: Unit| {
        let p = peers.clone();
        async move { p.ready(&u).await }
    };
    // Not listed yet: waits.
    let early = tokio::spawn(pending(Unit::new("ds/x", 0, 10)));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!early.is_finished());
    let root = n.ctx.stage_fd.clone();
    std::fs::write(n.dir.path().join("x"), b"0123456789").unwrap();
    peers.add_object(root, 3, &[Unit::new("ds/x", 0, 10)]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!early.is_finished(), "listed but not held: still waits");
    peers.held(&Unit::new("ds/x", 0, 10), blake3::hash(b"0123456789"));
    assert_eq!(early.await.unwrap(), Ok(()));
    let data = peers.unit(&Unit::new("ds/x", 0, 10)).await.unwrap();
    assert_eq!(&data.bytes[..], b"0123456789");
    let streamed = peers.unit_stream(&Unit::new("ds/x", 0, 10)).await.unwrap();
    assert_eq!((streamed.len, streamed.hash), (10, data.hash));
    let slices: Vec<Bytes> = streamed.body.collect().await;
    assert_eq!(slices.concat(), b"0123456789");
    // Another length or offset of a known file is not one of the job's units.
    assert_eq!(
        peers.unit(&Unit::new("ds/x", 0, 9)).await.unwrap_err(),
        UnitError::NotOwner
    );
    assert_eq!(
        peers.ready(&Unit::new("ds/x", 5, 5)).await.unwrap_err(),
        UnitError::NotOwner
    );
    // A path that walks out of the dataset is never opened: it is not a recorded unit.
    assert_eq!(
        peers
            .unit(&Unit::new("ds/../../etc/passwd", 0, 10))
            .await
            .unwrap_err(),
        UnitError::NotOwner
    );
    let late = tokio::spawn(pending(Unit::new("ds/y", 0, 4)));
    peers.add_object(n.ctx.stage_fd.clone(), 3, &[Unit::new("ds/y", 0, 4)]);
    peers.close("node n1 failed");
    let e = late.await.unwrap().unwrap_err();
    assert!(
        matches!(&e, UnitError::Failed(why) if why.contains("node n1 failed")),
        "{e:?}"
    );
    // Listed everything (closed): an unknown unit is refused at once.
    assert_eq!(
        peers.ready(&Unit::new("ds/z", 0, 4)).await.unwrap_err(),
        UnitError::NotOwner
    );
    // The staged copy replaced by something else (here a symlink) is not served.
    std::fs::remove_file(n.dir.path().join("x")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", n.dir.path().join("x")).unwrap();
    let e = peers.unit(&Unit::new("ds/x", 0, 10)).await.unwrap_err();
    assert!(matches!(e, UnitError::Failed(_)), "{e:?}");
}

/// Relays TCP to `upstream`, changing one byte in every 64 KiB its answers carry.
async fn tampering_relay(upstream: String) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = l.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut cr, mut cw) = client.split();
                let (mut sr, mut sw) = server.split();
                let up = tokio::io::copy(&mut cr, &mut sw);
                let down = async {
                    let mut buf = vec![0u8; 16 << 10];
                    let mut seen = 0u64;
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        for (i, b) in buf[..n].iter_mut().enumerate() {
                            if (seen + i as u64) % (64 << 10) == (64 << 10) - 1 {
                                *b ^= 0x5a;
                            }
                        }
                        seen += n as u64;
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                };
                let _ = tokio::join!(up, down);
            });
        }
    });
    addr
}

/// Where a failed fetch goes next, for both stagers: a corrupt unit, or a connection closed
/// without an answer, is fetched once more from the same node, then that node is routed around
/// (with the job's note) and the unit goes to its next owner; an unreachable node is routed around
/// at once; a node that does not own the unit sends
/// this node to the origin, with a note; a write this node could not do fails the unit.
#[tokio::test]
async fn a_failed_fetch_goes_where_the_rules_say() {
    let (mut ls, addrs) = listeners().await;
    let n1 = node("n1", ls.remove(0), &addrs).await;
    let peers = n1.peers.join(JOB, &job_nodes(), me(), 1, &[]).unwrap();
    // A unit n2 owns among all three, whose next owner among n1 and n3 is n3.
    let unit = (0..1000)
        .map(|i| Unit::new(format!("ds/f{i}"), 0, 10))
        .find(|u| {
            let k = u.key();
            let all = job_nodes();
            let rest = vec!["n1".to_string(), "n3".to_string()];
            all[owner_of(&k, &all)] == "n2" && rest[owner_of(&k, &rest)] == "n3"
        })
        .expect("such a unit among a thousand");
    assert_eq!(peers.route(&unit).as_deref(), Some("n2"));
    let corrupt = PeerError::Corrupt {
        addr: "a".into(),
        unit: unit.key(),
        what: "hash".into(),
    };
    let next = |e: &PeerError, from: &str, once: &mut Option<String>| {
        peers.next_after(&unit, from, e, once, "s3://b/ds")
    };
    // A reset connection (e.g. pooled to an agent that restarted): once more from n2, and a
    // second one of the same unit routes n2 around.
    let dropped = PeerError::Dropped {
        addr: "a".into(),
        source: "connection closed before message completed".into(),
    };
    let mut once = None;
    assert_eq!(next(&dropped, "n2", &mut once), NextStep::From("n2".into()));
    assert_eq!(
        peers.alive_nodes(),
        ["n1", "n2", "n3"],
        "n2 is not routed around for one"
    );
    let mut once = None;
    assert_eq!(next(&corrupt, "n2", &mut once), NextStep::From("n2".into()));
    assert_eq!(next(&corrupt, "n2", &mut once), NextStep::From("n3".into()));
    assert_eq!(peers.alive_nodes(), ["n1", "n3"]);
    assert!(
        peers
            .notes()
            .iter()
            .any(|n| n.contains("data from node n2 failed its checksum twice")),
        "{:?}",
        peers.notes()
    );
    let unreachable = PeerError::Unreachable {
        addr: "a".into(),
        source: "connection refused".into(),
    };
    assert_eq!(next(&unreachable, "n3", &mut once), NextStep::Origin);
    assert_eq!(peers.alive_nodes(), ["n1"], "n3 routed around too");
    let not_owner = PeerError::NotOwner {
        addr: "a".into(),
        job: JOB,
        unit: unit.key(),
    };
    assert_eq!(next(&not_owner, "n3", &mut once), NextStep::Origin);
    let sink = PeerError::Sink {
        unit: unit.key(),
        source: "No space left on device".into(),
    };
    assert!(
        matches!(next(&sink, "n3", &mut once), NextStep::Fail(why) if why.contains("No space"))
    );
    n1.stop.cancel();
}

/// The job's object-store datasets, as the agent gives them to `join`.
fn datasets() -> Vec<String> {
    vec![spec().source.to_string()]
}

/// [`node`], with a cross-job cache (`[cache]`) on a hot tier of its own, shared with the job's
/// peers as the agent shares it; the hot tier lives as long as the returned directory.
async fn node_with_cache(
    name: &str,
    listener: TcpListener,
    addrs: &BTreeMap<String, String>,
) -> (Node, tempfile::TempDir) {
    let mut n = node(name, listener, addrs).await;
    let hot = tempfile::tempdir().unwrap();
    let text = format!(
        "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='{}'\n\
         [cache]\nsize = '64MiB'\nmin_free = 0\n",
        hot.path().display()
    );
    let cfg = Config::parse(&text, name, sluice_archive::upload_memory).unwrap();
    let cache = crate::cache::Cache::open(&cfg).unwrap();
    n.peers.share_cache(cache.clone());
    n.ctx.cache = cache;
    (n, hot)
}

/// Warms `n`'s cache with the dataset, the way a one-node job on it would (staged without peers,
/// each object filled into the cache as it is written), then empties its stage directory and
/// progress for the job to come.
async fn warm_alone(n: &mut Node, store: &Arc<CountingStore>) {
    stage_alone(n, store, n.progress.clone()).await.unwrap();
    std::fs::remove_dir_all(n.dir.path().join("ds")).unwrap();
    n.progress = Arc::new(Progress::new(&spec()));
}

/// Three nodes with caches, only n2's warm: n2 copies the dataset from its cache, n1 and n3 miss,
/// and take the units they own from n2's cache rather than the origin — the origin serves no byte
/// of the dataset, every node ends with identical data, and n1 and n3 have cached it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_misses_takes_its_units_from_a_peers_cache_before_the_origin() {
    let (store, mut files) = origin().await;
    // Keys whose names a path type would percent-encode (several, so that nodes that miss own
    // some): the cache key must be the listed one.
    for i in 0..8 {
        let odd = format!("odd name %4{i} #{i}.bin");
        let bytes = format!("an odd one, {i}").into_bytes();
        store
            .inner
            .put(
                &ObjPath::parse(format!("ds/{odd}")).unwrap(),
                bytes.clone().into(),
            )
            .await
            .unwrap();
        files.insert(odd, bytes);
    }
    let (ls, addrs) = listeners().await;
    let (mut nodes, _hots) = start_nodes_with_cache(ls, |_| &addrs).await;
    warm_alone(&mut nodes[1], &store).await;
    assert_eq!(store.served.load(Ordering::SeqCst), dataset_bytes(&files));
    store.served.store(0, Ordering::SeqCst);

    let all: Vec<&Node> = nodes.iter().collect();
    for peers in stage_all(&all, &store).await {
        assert!(peers.notes().is_empty(), "{:?}", peers.notes());
    }
    assert_eq!(
        store.served.load(Ordering::SeqCst),
        0,
        "the origin served nothing of a dataset one of the job's nodes had cached"
    );
    let total = dataset_bytes(&files);
    for n in &all {
        let got = read_tree(n.dir.path());
        assert_eq!(got, files, "{}'s copy", n.name);
        let p = n.progress.snapshot();
        assert_eq!(p.bytes_done, total, "{}'s progress", n.name);
        assert_eq!(p.origin_bytes, 0, "{}", n.name);
    }
    assert_eq!(nodes[1].progress.snapshot().cache_bytes, total);
    let cached = |n: &Node| n.ctx.cache.as_ref().unwrap().stats().entries;
    for n in [&nodes[0], &nodes[2]] {
        assert_eq!(n.progress.snapshot().peer_bytes, total, "{}", n.name);
        assert_eq!(cached(n), cached(&nodes[1]), "{} cached it too", n.name);
    }
    stop(&nodes);
}

/// n1 reaches n2 (the only warm cache) through a relay that changes bytes: the ranges n1 takes
/// from n2's cache fail their hash, n1 stops asking that cache and reads its own units from the
/// origin instead — nothing wrong lands in any copy, and the origin serves no more than n1's
/// share of the dataset and what n1 later owns of n2's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peers_cache_that_answers_wrong_bytes_is_left_for_the_origin() {
    let (store, files) = origin().await;
    let (ls, routes) = RelayedRoutes::start().await;
    let (mut nodes, _hots) = start_nodes_with_cache(ls, |name| routes.of(name)).await;
    warm_alone(&mut nodes[1], &store).await;
    store.served.store(0, Ordering::SeqCst);
    let all: Vec<&Node> = nodes.iter().collect();
    stage_all(&all, &store).await;
    for n in &all {
        assert_eq!(read_tree(n.dir.path()), files, "{}'s copy", n.name);
    }
    let served = store.served.load(Ordering::SeqCst);
    let n1_origin = nodes[0].progress.snapshot().origin_bytes;
    assert!(n1_origin > 0, "n1 read its units from the origin");
    assert_eq!(served, n1_origin, "only n1 read the origin");
    assert!(served < dataset_bytes(&files), "{served}");
    // n1 cached what it staged: the good bytes.
    let n1_cache = nodes[0].ctx.cache.as_ref().unwrap();
    assert_eq!(
        n1_cache.stats().entries,
        nodes[1].ctx.cache.as_ref().unwrap().stats().entries
    );
    stop(&nodes);
}

/// A node serves from its cache only objects under the job's own datasets, and answers at once
/// for one it does not hold.
#[tokio::test]
async fn a_cache_serves_the_jobs_datasets_only() {
    let (store, files) = origin().await;
    let (mut ls, addrs) = listeners().await;
    let (mut n, _hot) = node_with_cache("n1", ls.remove(0), &addrs).await;
    warm_alone(&mut n, &store).await;
    let peers = join_job(&n);
    let meta = store
        .inner
        .head(&ObjPath::from("ds/big.bin"))
        .await
        .unwrap();
    let object = |url: &str| CachedObject {
        url: url.into(),
        etag: meta.e_tag.clone(),
        version: meta.version.clone(),
        size: meta.size,
    };
    let mine = object("s3://b/ds/big.bin");
    let probe = peers.cached_range(&mine, 0, 0).await.unwrap();
    assert_eq!(probe.len, 0);
    let got = peers.cached_range(&mine, 100, 5000).await.unwrap();
    let body: Vec<u8> = got.body.collect::<Vec<_>>().await.concat();
    assert_eq!(body, files["big.bin"][100..5100]);
    assert_eq!(got.hash, blake3::hash(&body));
    // Another ETag is another object; a URL outside the job's datasets is not served, cached
    // or not (the join gives this job `s3://b/ds` only).
    let changed = CachedObject {
        etag: Some("other".into()),
        ..mine.clone()
    };
    assert!(peers.cached_range(&changed, 0, 0).await.is_none());
    let other = n
        .peers
        .join(JOB + 1, &job_nodes(), me(), 1, &["s3://b/d".into()]);
    let other = other.unwrap();
    assert!(other.cached_range(&mine, 0, 0).await.is_none());
    assert!(other.cached_range(&mine, 0, 10).await.is_none());
    n.stop.cancel();
}

/// A node asks a peer's cache at most until it learns the peer has none (or no agent): after one
/// probe, neither is asked again for the job, and nothing is found.
#[tokio::test]
async fn a_peer_without_a_cache_or_an_agent_is_not_asked_again() {
    let (mut ls, addrs) = listeners().await;
    let (n1, _hot) = node_with_cache("n1", ls.remove(0), &addrs).await;
    let n2 = node("n2", ls.remove(0), &addrs).await;
    drop(ls); // n3: no agent
    let p1 = join_job(&n1);
    let _p2 = join_job(&n2);
    let object = CachedObject {
        url: "s3://b/ds/x".into(),
        etag: Some("e".into()),
        version: None,
        size: 10,
    };
    assert!(p1.cache_usable("n2") && p1.cache_usable("n3"));
    assert_eq!(p1.find_cached(&object).await, None);
    assert!(!p1.cache_usable("n2"), "n2 has no cache");
    assert!(!p1.cache_usable("n3"), "n3 has no agent");
    n1.stop.cancel();
    n2.stop.cancel();
}

/// Every regular file below `dir`, relative, for the tests that play a user writing into them.
fn files_below(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Finding 4 of issue 24: n1 staged the dataset, then its agent restarted; its user had
/// rewritten every file in place where no check of n1's can see it (in the moment between the
/// agent's last write and the fstat its staging log notes, or between the restarted agent's
/// identity check and its read: played here by noting the rewritten files in the log). The
/// restarted n1 serves those bytes with hashes read back from them, marked as read back; n2 and
/// n3 write them into the job's copies (the user's own job), but never into their caches: a
/// later job on n2, of any user, gets the origin's bytes. Before, n2 and n3 cached the planted
/// bytes under the objects' ETags and served them to every later job.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_nodes_read_back_units_never_reach_another_nodes_cache() {
    let (store, files) = origin().await;
    let (mut ls, addrs) = listeners().await;
    let mut n1 = node("n1", ls.remove(0), &addrs).await;
    let (mut n2, _hot2) = node_with_cache("n2", ls.remove(0), &addrs).await;
    let (n3, _hot3) = node_with_cache("n3", ls.remove(0), &addrs).await;
    let state = tempfile::tempdir().unwrap();
    let resume = |resuming| job_resume(&state, resuming);
    n1.ctx.resume = Some(resume(false));
    stage_alone(&n1, &store, Arc::new(Progress::new(&spec())))
        .await
        .unwrap();
    // The user's bytes, in place, in every file; the log notes the files as they are now.
    for path in files_below(&n1.dir.path().join("ds")) {
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.iter_mut().for_each(|b| *b ^= 0xff);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &bytes, 0).unwrap();
    }
    let logs = crate::resume::job_dir(state.path(), JOB);
    for log in std::fs::read_dir(&logs).unwrap() {
        let log = log.unwrap().path();
        let text = std::fs::read_to_string(&log).unwrap();
        let mut out = String::new();
        for (i, line) in text.lines().enumerate() {
            let mut v: serde_json::Value = serde_json::from_str(line).unwrap();
            if i > 0 {
                let rel = v["path"].as_str().unwrap().to_string();
                let f = std::fs::File::open(n1.dir.path().join(rel)).unwrap();
                let now = crate::resume::Identity::of(&f).unwrap();
                v["file"] = serde_json::to_value(now).unwrap();
            }
            out.push_str(&format!("{v}\n"));
        }
        std::fs::write(&log, out).unwrap();
    }

    let (_peers, (offered, _)) = serve_after_restart(&n1, resume(true)).await;
    assert!(offered > 0, "n1 serves what it kept");
    stage_all(&[&n2, &n3], &store).await;
    assert!(
        [&n2, &n3]
            .iter()
            .any(|n| read_tree(n.dir.path()) != files && n.progress.snapshot().peer_bytes > 0),
        "n1 served its user's bytes to the job's other nodes"
    );

    // A later job on n2, alone: from its cache what it holds, the rest from the origin.
    std::fs::remove_dir_all(n2.dir.path().join("ds")).unwrap();
    n2.progress = Arc::new(Progress::new(&spec()));
    crate::object::stage(
        &n2.ctx,
        &spec(),
        store.clone() as Arc<dyn ObjectStore>,
        "ds",
        n2.progress.clone(),
        None,
        None,
    )
    .await
    .unwrap();
    let got = read_tree(n2.dir.path());
    for (k, v) in &files {
        assert!(got[k] == *v, "the later job's {k} is not the origin's");
    }
    for n in [&n1, &n2, &n3] {
        n.stop.cancel();
    }
}

/// A committed cache entry whose bytes changed on disk (a byte flipped by root) is not served:
/// the next job gets the origin's bytes, the entry is dropped and filled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupted_cache_entry_is_not_served() {
    let (store, files) = origin().await;
    let (mut ls, addrs) = listeners().await;
    let (mut n, hot) = node_with_cache("n1", ls.remove(0), &addrs).await;
    warm_alone(&mut n, &store).await;
    let cache = n.ctx.cache.clone().unwrap();
    let entries = cache.stats().entries;
    // In a later clock tick than the entries' last change, as any write after a fill is.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let mut flipped = 0;
    for path in files_below(&hot.path().join("cache/data")) {
        if path.extension().is_some_and(|e| e == "meta") {
            continue;
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut b = [0u8; 1];
        if std::os::unix::fs::FileExt::read_at(&f, &mut b, 0).unwrap() == 1 {
            std::os::unix::fs::FileExt::write_all_at(&f, &[b[0] ^ 1], 0).unwrap();
            flipped += 1;
        }
    }
    assert!(flipped > 0);
    store.served.store(0, Ordering::SeqCst);
    warm_alone_keeping(&mut n, &store).await;
    assert_eq!(
        read_tree(n.dir.path()),
        files,
        "the job's copy is the origin's"
    );
    assert_eq!(
        store.served.load(Ordering::SeqCst),
        dataset_bytes(&files),
        "every corrupted entry was read from the origin again"
    );
    assert_eq!(cache.stats().entries, entries, "and filled again");
    n.stop.cancel();
}

/// [`warm_alone`] without emptying the stage directory after.
async fn warm_alone_keeping(n: &mut Node, store: &Arc<CountingStore>) {
    n.progress = Arc::new(Progress::new(&spec()));
    stage_alone(n, store, n.progress.clone()).await.unwrap();
}

/// Stages the dataset on `n` alone (no peers, no shard), counting in `progress`.
async fn stage_alone(
    n: &Node,
    store: &Arc<CountingStore>,
    progress: Arc<Progress>,
) -> Result<(), crate::StageError> {
    let store = store.clone() as Arc<dyn ObjectStore>;
    crate::object::stage(&n.ctx, &spec(), store, "ds", progress, None, None).await
}

/// `n`'s restarted agent, the job staged there before the restart (`resume`: its staging log, as
/// reopened): it joins the job, serves the files the log names ([`crate::resume::serve_staged`])
/// and closes its staging. Its job peers (held while the others stage), and the files and bytes
/// it offers.
async fn serve_after_restart(
    n: &Node,
    resume: Arc<crate::resume::JobResume>,
) -> (Arc<JobPeers>, (u64, u64)) {
    let peers = join_job(n);
    let offered =
        crate::resume::serve_staged(&peers, resume, vec![spec()], n.ctx.stage_fd.clone(), me())
            .await;
    peers.close("staged before the agent restarted");
    (peers, offered)
}

/// The staging log of the job in `state`, as an agent that is `resuming` opens it.
fn job_resume(state: &tempfile::TempDir, resuming: bool) -> Arc<crate::resume::JobResume> {
    Arc::new(crate::resume::JobResume::open(state.path(), JOB, resuming))
}
