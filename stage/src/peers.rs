//! Stage-in shared by the nodes of a job (`--stage-mode=replicate` with `[peer]`): each unit of a
//! dataset (object store or POSIX) is read from the origin once per job, by its owner, and every
//! other node of the job takes it from the owner as it arrives.
//!
//! [`NodePeers`] is the node's side, built once at agent start: the peer server (serving units to
//! the other agents), one client (fetching units from them) and `[peer]`. [`JobPeers`] is one job
//! on this node: the units of its datasets as this node lists them, which of them it holds (with
//! the BLAKE3 hash of what it read), the nodes it routed around, and the notes for the job output.
//! It is the [`UnitSource`] the peer server answers the job's other nodes from. `object` decides,
//! unit by unit, whether this node reads the origin or a peer; `posix` does the same with the
//! job user's copy helper reading the origin ([`JobPeers::next_after`] is where a failed fetch
//! goes next, for both).
//!
//! Rules, so that every node of the job ends with identical data and the origin is read once:
//!
//! - **Ownership** is rendezvous hashing of the unit (`NAME/key@offset`) over the job's node list,
//!   minus the nodes this node has routed around ([`JobPeers::route`]). A node that fails a fetch
//!   (unreachable, died mid-body, does not know the job, sent a corrupt unit twice) is lost for the
//!   job on this node: its units go to the survivors by the same hashing, so each lost unit is read
//!   from the origin by one survivor, which the others then ask, and never by every node at once.
//! - **Waiting is deadlock-free.** A node serves a unit once it holds it, from the origin or from a
//!   peer, and waits for any unit it will hold. A node asks X for a unit only when X has the highest
//!   weight among the nodes it still counts, itself included; so along any chain of waiting nodes
//!   the weights rise strictly, and no chain closes into a cycle.
//! - **Checked end to end.** A unit's hash is the owner's, taken from the bytes as they came from
//!   the origin; a fetched unit counts only when its bytes hash to it (the peer client checks), and
//!   the fetching node then serves it under that same hash. A node whose agent restarted serves
//!   what it kept with hashes read back from its staged copies ([`super::resume`]): those units
//!   are marked ([`HashFrom::ReadBack`]), kept out of every node's cross-job cache, and served on
//!   under the same mark. Bytes that fail the check are written
//!   over (from a second fetch or the origin) before the job's tasks may see the dataset.
//! - **Served from the staged copy**, reopened fd-relative without following links, and only if it
//!   is a regular file of the job user with one link: a user can make a node serve their own bytes
//!   (which the requester's hash check refuses), never a file they could not read themselves. It
//!   is read a 1 MiB slice at a time as the response goes out, so serving holds about a slice per
//!   response slot (`peer.concurrency`), not a unit. Serving takes nothing from the stage budget:
//!   a node's fetches hold budget buffers while their bytes arrive, and if the bytes they wait for
//!   needed the serving node's budget in turn, two nodes could each hold all of theirs.
//! - **Memory**: every byte this node writes, from the origin or a peer, goes through its stage
//!   [`Budget`](super::Budget) buffers; a fetch takes its buffer when its first bytes arrive, not
//!   while it waits for the owner.

use super::Owner;
use crate::cache::{Cache, Hit, Key};
use bytes::Bytes;
use nix::fcntl::{OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat};
use sluice_core::config::{Config, PeerConfig};
use sluice_core::rt::{blocking, lock};
use sluice_core::safefs;
use sluice_peer::listing::PageRequest;
use sluice_peer::{
    CachedObject, ClientConfig, ClusterSecret, HashFrom, JobKey, PeerClient, PeerError, PeerRebind,
    PeerServer, PeerService, PeerWorker, ServerConfig, Unit, UnitData, UnitError, UnitSink,
    UnitSource, UnitStream, owner_of, unit_path,
};
use sluice_proto::msg::JobId;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// This node's peer transfers: the server other agents fetch from, the client this node fetches
/// with, and `[peer]`.
pub struct NodePeers {
    node: String,
    cfg: PeerConfig,
    server: PeerServer,
    client: Arc<PeerClient>,
    /// The node's configuration, for the cache keys of what peers ask this node's cache for.
    config: Arc<Config>,
    /// The node's cross-job cache, which the jobs' peers may read their datasets' objects from.
    cache: Option<Arc<Cache>>,
}

impl std::fmt::Debug for NodePeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePeers")
            .field("node", &self.node)
            .field("listen", &self.cfg.listen)
            .finish()
    }
}

impl NodePeers {
    /// Loads the cluster secret and binds the peer port `[peer]` configures. `None` (with an error
    /// in the log) without a secret: this node then reads every dataset from the origin itself,
    /// and the job's other nodes route around it. A port that cannot be bound (another process,
    /// maybe a user's, holds it) does not turn peers off for the agent's life: the server binds it
    /// as soon as it is free ([`PeerRebind`]), saying so loudly until then, and this node fetches
    /// from its peers meanwhile.
    pub async fn bind(cfg: &Config) -> Option<(NodePeers, PeerWorker)> {
        let peer = cfg.peer.as_ref()?;
        let secret = match ClusterSecret::load(&peer.secret_file) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("peer transfers are off on this node: {e}");
                return None;
            }
        };
        match PeerServer::bind(peer, secret.clone()).await {
            Ok((server, listener)) => {
                let (peers, service) = NodePeers::with(cfg, peer, server, listener);
                Some((peers, PeerWorker::Serving(service)))
            }
            Err(error) => {
                let server = PeerServer::new(secret, ServerConfig::from_config(peer));
                let peers = NodePeers::assemble(cfg, peer, server.clone());
                let rebind = PeerRebind {
                    server,
                    listen: peer.listen.clone(),
                    error,
                    every: sluice_peer::server::REBIND_EVERY,
                };
                Some((peers, PeerWorker::Rebinding(rebind)))
            }
        }
    }

    /// The node's peers from a server and listener already in hand (tests bind port 0).
    pub fn with(
        cfg: &Config,
        peer: &PeerConfig,
        server: PeerServer,
        listener: TcpListener,
    ) -> (NodePeers, PeerService) {
        tracing::info!(
            node = %cfg.node,
            listen = %listener.local_addr().map_or_else(|_| peer.listen.clone(), |a| a.to_string()),
            "peer transfers on"
        );
        let service = PeerService {
            server: server.clone(),
            listener,
        };
        (NodePeers::assemble(cfg, peer, server), service)
    }

    fn assemble(cfg: &Config, peer: &PeerConfig, server: PeerServer) -> NodePeers {
        let client = PeerClient::new(
            cfg.node.clone(),
            ClientConfig::from_config(peer, cfg.stage.timeout),
        );
        NodePeers {
            node: cfg.node.clone(),
            cfg: peer.clone(),
            server,
            client: Arc::new(client),
            config: Arc::new(cfg.clone()),
            cache: None,
        }
    }

    /// Answers other agents' admin warm requests (`sluice cache warm --nodes` on another node)
    /// with `here`.
    pub fn serve_warm(&self, here: WarmHere) {
        self.server.serve_admin(Arc::new(here));
    }

    /// Asks `node`'s agent to warm its cache with `url` (an admin request under the cluster
    /// secret), waiting for its report.
    pub async fn warm_on(
        &self,
        node: &str,
        url: &str,
    ) -> Result<sluice_proto::msg::CacheWarmed, String> {
        let addr = self.cfg.addr_of(node);
        self.client
            .admin_warm(&addr, &self.server.admin_key(), url, WARM_WAIT)
            .await
            .map_err(|e| match e {
                PeerError::Failed { reason, .. } => reason,
                // What an agent that predates admin requests answers (no such resource).
                PeerError::Refused { status: 404, .. } => format!(
                    "the agent of {node} at {addr} takes no admin requests: update sluiced on {node}"
                ),
                PeerError::Refused { status, reason, .. } => format!(
                    "the agent of {node} at {addr} refused the request ({status}): {reason}"
                ),
                e => format!("the agent of {node}: {}", error_chain(&e)),
            })
    }

    /// Keeps the replicas the jobs' other nodes push to this node in `store` (answered `501`
    /// without one).
    pub fn serve_replicas(&self, store: Arc<dyn sluice_peer::ReplicaStore>) {
        self.server.serve_replicas(store);
    }

    /// Hands the commit notices of the jobs' other nodes to `events`.
    pub fn serve_events(&self, events: Arc<dyn sluice_peer::JobEvents>) {
        self.server.serve_events(events);
    }

    /// What the checkpoint side needs of the peer layer for replicas (`[fast_tier] replicas`):
    /// the client, the job keys and the nodes' addresses.
    pub fn replica_peers(&self) -> ReplicaPeers {
        ReplicaPeers {
            client: self.client.clone(),
            server: self.server.clone(),
            cfg: self.cfg.clone(),
        }
    }

    /// Lets the jobs' peers read this node's cross-job cache: a node that misses its own cache
    /// takes the units it owns of an object from a peer that holds it, before the origin.
    pub fn share_cache(&mut self, cache: Option<Arc<Cache>>) {
        self.cache = cache;
    }

    /// Starts sharing `job`'s work with the job's other nodes: registers the job's [`JobPeers`]
    /// with the peer server. `shared_work` counts the pieces of it (each dataset staged through
    /// the peers, the restore), each of which calls [`JobPeers::dataset_done`] once; a
    /// `--stage-tier=shared` job joins even when it shares no work through the peers
    /// (`shared_work` 0), so that its other nodes can tell this node's agent is alive
    /// ([`JobPeers::alive`]), which is what decides whether they take over a share it has not
    /// written (`stage::shared`). `datasets` are the URLs of the job's object-store datasets
    /// (`s3://bucket/prefix`) as this node's policy admitted them: the job's peers may read
    /// objects under them from this node's cache, nothing else. `None` when the job has one node
    /// or this node is not in its node list.
    pub fn join(
        &self,
        job: JobId,
        nodes: &[String],
        owner: Owner,
        shared_work: usize,
        datasets: &[String],
    ) -> Option<Arc<JobPeers>> {
        let mut nodes = nodes.to_vec();
        nodes.sort();
        nodes.dedup();
        if nodes.len() < 2 {
            return None;
        }
        if !nodes.contains(&self.node) {
            tracing::warn!(
                job_id = job,
                "this node ({}) is not in the job's node list {nodes:?}; it stages without peers",
                self.node
            );
            return None;
        }
        let (changed, _) = watch::channel(0);
        let fallback = fallback::Fallback::new(&self.cfg, nodes.len());
        let peers = Arc::new(JobPeers {
            job,
            node: self.node.clone(),
            key: self.server.job_key(job, &nodes),
            nodes,
            owner,
            cfg: self.cfg.clone(),
            client: self.client.clone(),
            cache: self.cache.clone().map(|cache| CacheShare {
                cache,
                config: self.config.clone(),
                datasets: datasets.to_vec(),
            }),
            state: Mutex::new(State {
                objects: HashMap::new(),
                versions: HashMap::new(),
                listing: shared_work,
                closed: None,
                lost: BTreeMap::new(),
                listings: HashMap::new(),
                no_cache: BTreeMap::new(),
                notes: BTreeMap::new(),
            }),
            changed,
            fallback,
        });
        self.server
            .register(job, &peers.nodes, peers.clone() as Arc<dyn UnitSource>);
        Some(peers)
    }

    /// The job ended here (or staged without peers after a restart): requests for its units are
    /// answered `gone` from now on, so its other nodes read them elsewhere at once.
    pub fn leave(&self, job: JobId) {
        self.server.unregister(job);
    }
}

/// The node's peer layer as a checkpoint's replicas use it (not staging: no units, no owners):
/// push this node's part of a checkpoint to another node of the job, seal it, free it.
#[derive(Clone)]
pub struct ReplicaPeers {
    client: Arc<PeerClient>,
    server: PeerServer,
    cfg: PeerConfig,
}

impl std::fmt::Debug for ReplicaPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaPeers")
            .field("listen", &self.cfg.listen)
            .finish_non_exhaustive()
    }
}

impl ReplicaPeers {
    pub fn client(&self) -> &PeerClient {
        &self.client
    }

    /// The key of `job` on `nodes` (in any order, as the job start lists them).
    pub fn job_key(&self, job: JobId, nodes: &[String]) -> sluice_peer::JobKey {
        let mut nodes = nodes.to_vec();
        nodes.sort();
        nodes.dedup();
        self.server.job_key(job, &nodes)
    }

    /// Where `node`'s agent takes peer requests.
    pub fn addr_of(&self, node: &str) -> String {
        self.cfg.addr_of(node)
    }
}

/// What `sluice cache warm` needs on this node: what an admin request from another agent, or this
/// node's own row of `sluice cache warm --nodes`, runs.
pub struct WarmHere {
    pub cfg: Arc<Config>,
    pub budget: Arc<super::Budget>,
    pub cache: Option<Arc<Cache>>,
    /// The agent's: a warm stops with it.
    pub cancel: tokio_util::sync::CancellationToken,
}

impl WarmHere {
    async fn warm(&self, url: &str) -> Result<sluice_proto::msg::CacheWarmed, String> {
        let Some(cache) = self.cache.clone() else {
            return Err(format!(
                "node {} has no cache: add a [cache] section to the agent's configuration",
                self.cfg.node
            ));
        };
        let (cfg, budget) = (self.cfg.clone(), self.budget.clone());
        super::warm(cfg, budget, cache, self.cancel.child_token(), url)
            .await
            .map_err(|e| e.to_string())
    }
}

#[async_trait::async_trait]
impl sluice_peer::AdminSource for WarmHere {
    async fn warm(&self, url: &str) -> Result<sluice_proto::msg::CacheWarmed, String> {
        WarmHere::warm(self, url).await
    }
}

/// How long another node's warm is awaited (as `sluice cache warm` awaits its own agent's).
const WARM_WAIT: Duration = Duration::from_secs(12 * 3600);
/// Nodes warmed at once by one `sluice cache warm --nodes`.
const WARM_FANOUT: usize = 16;

/// `sluice cache warm URL --nodes LIST`: warms `nodes`, this one with `here`, the others through
/// their agents over the peer port (`peers`; without it they cannot be reached), up to
/// [`WARM_FANOUT`] at once. One row per node, in the order given; a node that fails has its
/// error in its row and the others are warmed all the same.
pub async fn warm_nodes(
    here: &WarmHere,
    peers: Option<&NodePeers>,
    url: &str,
    nodes: &[String],
) -> Vec<sluice_proto::msg::NodeWarmed> {
    use futures::StreamExt;
    let one = |node: String| async move {
        let result = if node == here.cfg.node {
            here.warm(url).await
        } else {
            match peers {
                Some(p) => p.warm_on(&node, url).await,
                None => Err(format!(
                    "peer transfers are off on node {} ([peer] and its secret are needed to reach                      other nodes' agents); run sluice cache warm on {node} itself",
                    here.cfg.node
                )),
            }
        };
        let (warmed, error) = match result {
            Ok(w) => (Some(w), None),
            Err(e) => (None, Some(e)),
        };
        sluice_proto::msg::NodeWarmed {
            node,
            warmed,
            error,
        }
    };
    futures::stream::iter(nodes.iter().cloned().map(one))
        .buffered(WARM_FANOUT)
        .collect()
        .await
}

/// This node's cache as one job's peers may read it: only objects under the job's datasets.
struct CacheShare {
    cache: Arc<Cache>,
    config: Arc<Config>,
    /// `s3://bucket/prefix` of each of the job's object-store datasets.
    datasets: Vec<String>,
}

impl CacheShare {
    /// The cache key of `object` if it lies under one of the job's datasets: the object itself,
    /// or below it as a directory (`s3://b/ds` covers `s3://b/ds` and `s3://b/ds/x`, not
    /// `s3://b/dsx`).
    fn key(&self, object: &CachedObject) -> Option<Key> {
        let url = &object.url;
        let covered = self.datasets.iter().any(|d| {
            url.strip_prefix(d.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        });
        if !covered {
            return None;
        }
        // Through the one place that makes keys from a listing (the endpoint comes from this
        // node's own `[[store]]`); a URL that does not come back the same names no entry.
        let (scheme, rest) = url.split_once("://")?;
        let (bucket, location) = rest.split_once('/')?;
        let meta = object_store::ObjectMeta {
            // As listed: `parse` keeps the key as it is (`from` would percent-encode it).
            location: object_store::path::Path::parse(location).ok()?,
            last_modified: Default::default(),
            size: object.size,
            e_tag: object.etag.clone(),
            version: object.version.clone(),
        };
        Key::of(&self.config, &format!("{scheme}://{bucket}"), &meta).filter(|k| k.url == *url)
    }
}

/// How long a probe of a peer's cache waits for its answer (after connecting), and how long a
/// peer that does not know the job yet (its prolog runs a little later) is asked again. A peer
/// that misses either is not asked again for the job: a probe costs a staging at most this once
/// per peer.
const PROBE_WAIT: Duration = Duration::from_secs(3);
const PROBE_GRACE: Duration = Duration::from_secs(3);

/// Where a unit goes next after a failed fetch ([`JobPeers::next_after`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NextStep {
    /// Fetch it from this node.
    From(String),
    /// Read it from the origin, here.
    Origin,
    /// This node could not write it: why (the sink has the error the job should see).
    Fail(String),
}

/// `e` and its causes, `: `-separated ("unreachable: client error: connection refused"), for the
/// log and the job's notes.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.contains(&next) {
            text = format!("{text}: {next}");
        }
        cause = c.source();
    }
    text
}

/// Whether this node holds a unit.
#[derive(Debug, Clone)]
enum Held {
    /// Not yet: its owner reads it, or this node fetches it.
    Pending,
    /// Written to the staged copy; the hash of the bytes its owner read from the origin, or
    /// ([`HashFrom::ReadBack`]) read back from a staged copy after an agent restart.
    Yes(blake3::Hash, HashFrom),
    /// Never will: why.
    Failed(String),
}

/// One object of a dataset as this node stages it.
struct Object {
    /// The directory its path is relative to: the dataset's directory, or the stage directory for
    /// a dataset that is a single object.
    root: Arc<OwnedFd>,
    /// Where the path below `root` starts in the unit file name (`NAME/` is not part of it).
    rel_at: usize,
    /// Its units in order: unit `i` starts at `i × unit_size`.
    units: Vec<(u64, Held)>,
}

struct State {
    /// By unit file name (`NAME/key`, or `NAME` for a single-object dataset, then the version
    /// listed, if any: see [`versioned`](sluice_peer::versioned)).
    objects: HashMap<String, Object>,
    /// The unit file name of each path in `objects` (the version of it this node stages).
    versions: HashMap<String, String>,
    /// Object-store datasets of the job still being listed and staged here; while any is, a unit
    /// this node does not know yet may still come.
    listing: usize,
    /// Staging ended on this node: why units it never held will not come.
    closed: Option<String>,
    /// Nodes routed around, and why.
    lost: BTreeMap<String, String>,
    /// The job's object-store datasets as this node listed them or was passed their listing, by
    /// name: what it answers the job's other nodes' page requests from ([`listing`]).
    listings: HashMap<String, listing::Book>,
    /// Nodes whose cache is not asked any more (no answer in time, an old agent, a bad answer),
    /// and why; their units are still fetched from them.
    no_cache: BTreeMap<String, String>,
    /// Notes for the job output, one per node and kind of trouble.
    notes: BTreeMap<(String, &'static str), String>,
}

/// Records `why` for `node` in `reasons` (`lost`, `no_cache`) unless it holds one already: the
/// first reason stands. Whether this one was the first.
fn first_reason(reasons: &mut BTreeMap<String, String>, node: &str, why: &str) -> bool {
    if reasons.contains_key(node) {
        return false;
    }
    reasons.insert(node.to_string(), why.to_string());
    true
}

/// Which kind of trouble with a peer a note is about (one note per node and kind).
#[derive(Debug, Clone, Copy)]
pub enum Trouble {
    /// Unreachable, dead mid-transfer, did not know the job, ended it, or refused this node.
    Lost,
    /// Sent a unit that failed its check twice.
    Corrupt,
    /// Could not serve one unit (not its owner in its view, or its origin read failed).
    Unit,
}

/// One job's units on this node; see the module header.
pub struct JobPeers {
    job: JobId,
    node: String,
    /// The job's nodes, sorted.
    nodes: Vec<String>,
    key: JobKey,
    /// The job user: a staged copy served to peers must be theirs.
    owner: Owner,
    cfg: PeerConfig,
    client: Arc<PeerClient>,
    /// This node's cache, as the job's peers may read it.
    cache: Option<CacheShare>,
    state: Mutex<State>,
    /// Bumped on every change of `state` that a waiting request may care about.
    changed: watch::Sender<u64>,
    /// This node's share of the job's budget for origin reads of other nodes' units.
    fallback: fallback::Fallback,
}

impl std::fmt::Debug for JobPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobPeers")
            .field("job", &self.job)
            .field("node", &self.node)
            .field("nodes", &self.nodes)
            .finish()
    }
}

impl JobPeers {
    pub fn unit_size(&self) -> u64 {
        self.cfg.unit_size
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The node that owns `key` among all of the job's nodes (none routed around): for work one
    /// node does for all whatever the others' trouble, such as restoring a checkpoint's file.
    pub fn owner_among_all(&self, key: &str) -> &str {
        &self.nodes[owner_of(key, &self.nodes)]
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Records the units of one object this node stages (`units` from
    /// [`units_of`](sluice_peer::units_of) with [`unit_size`](Self::unit_size)); `root` and
    /// `rel_at` say where its staged copy is, for serving it.
    pub fn add_object(&self, root: Arc<OwnedFd>, rel_at: usize, units: &[Unit]) {
        let Some(first) = units.first() else { return };
        let object = Object {
            root,
            rel_at,
            units: units.iter().map(|u| (u.len, Held::Pending)).collect(),
        };
        let mut st = lock(&self.state);
        st.versions
            .insert(unit_path(&first.file).to_string(), first.file.clone());
        st.objects.insert(first.file.clone(), object);
        drop(st);
        self.bump();
    }

    /// One object-store dataset of the job is listed and staged here (or gave up).
    pub fn dataset_done(&self) {
        let mut st = lock(&self.state);
        st.listing = st.listing.saturating_sub(1);
        drop(st);
        self.bump();
    }

    /// Tells the job's peers that one of its datasets is staged here (or gave up) when dropped,
    /// however the staging ends: [`JobPeers::dataset_done`] as a guard.
    pub(super) fn dataset_guard(self: &Arc<Self>) -> DatasetDone {
        DatasetDone(self.clone())
    }

    /// The node to fetch `unit` from, or `None` when this node reads it from the origin: the
    /// unit's owner among the job's nodes this node has not routed around.
    pub(super) fn route(&self, unit: &Unit) -> Option<String> {
        let key = unit.key();
        let st = lock(&self.state);
        let owner = if st.lost.is_empty() {
            self.nodes[owner_of(&key, &self.nodes)].clone()
        } else {
            let alive: Vec<String> = self
                .nodes
                .iter()
                .filter(|n| !st.lost.contains_key(*n))
                .cloned()
                .collect();
            alive[owner_of(&key, &alive)].clone()
        };
        (owner != self.node).then_some(owner)
    }

    /// The job's nodes this node has not routed around (itself included), sorted.
    pub(crate) fn alive_nodes(&self) -> Vec<String> {
        let st = lock(&self.state);
        self.nodes
            .iter()
            .filter(|n| !st.lost.contains_key(*n))
            .cloned()
            .collect()
    }

    /// Where to take `unit` from after a fetch of it from `node` failed with `e`, the job's rules
    /// for every kind of failure (docs/SECURITY.md, "Peer transfers"):
    /// - the node cannot be used (unreachable or died mid-transfer, silent past the read timeout,
    ///   does not know the job after the join grace, ended it, refused this node, still reading
    ///   after the stage timeout): it is routed around for the rest of the job, and the unit goes
    ///   to its next owner among the rest: another node, or this one, which then reads the origin;
    /// - a corrupt unit (its hash or MAC does not verify), or a connection the node accepted and
    ///   closed without an answer (a pooled connection to an agent that restarted, one over its
    ///   limits): fetched again once from the same node (`retried` remembers it), then that node is
    ///   routed around like a lost one — a single reset no longer costs the job that node's share;
    /// - the node says it does not own the unit, or its own origin read failed: this node reads
    ///   the origin, with a note;
    /// - this node could not write the bytes ([`PeerError::Sink`]): [`NextStep::Fail`].
    ///
    /// `dataset` names the dataset in the log.
    pub(crate) fn next_after(
        &self,
        unit: &Unit,
        node: &str,
        e: &PeerError,
        retried: &mut Option<String>,
        dataset: &str,
    ) -> NextStep {
        let why = error_chain(e);
        match e {
            PeerError::Sink { .. } => return NextStep::Fail(why),
            PeerError::Corrupt { .. } | PeerError::Dropped { .. }
                if retried.as_deref() != Some(node) =>
            {
                tracing::warn!("{dataset}: {why}; fetching it again");
                *retried = Some(node.to_string());
                return NextStep::From(node.to_string());
            }
            PeerError::Corrupt { .. } => self.lose(node, Trouble::Corrupt, &why),
            PeerError::Unreachable { .. }
            | PeerError::Dropped { .. }
            | PeerError::Refused { .. }
            | PeerError::UnknownJob { .. }
            | PeerError::Gone { .. }
            | PeerError::TimedOut { .. } => self.lose(node, Trouble::Lost, &why),
            // The replica errors answer replica requests, never a unit's: read the origin.
            PeerError::NotOwner { .. }
            | PeerError::Failed { .. }
            | PeerError::TooLarge { .. }
            | PeerError::NoRoom { .. }
            | PeerError::ReplicaRefused { .. }
            | PeerError::NotHeld { .. }
            | PeerError::PushSource { .. } => {
                tracing::warn!("{dataset}: {why}; reading it from the origin");
                self.note(
                    node,
                    Trouble::Unit,
                    format!(
                        "peer transfers: {why}; this node read that data from the origin instead"
                    ),
                );
                return NextStep::Origin;
            }
        }
        match self.route(unit) {
            Some(next) => NextStep::From(next),
            None => NextStep::Origin,
        }
    }

    fn set(&self, unit: &Unit, held: Held) {
        let mut st = lock(&self.state);
        if let Some(slot) = slot_mut(&mut st, unit, self.cfg.unit_size) {
            slot.1 = held;
        }
        drop(st);
        self.bump();
    }

    /// This node wrote `unit` to its staged copy; `hash` is what its owner read from the origin.
    pub(crate) fn held(&self, unit: &Unit, hash: blake3::Hash) {
        self.held_from(unit, hash, HashFrom::Origin);
    }

    /// [`held`](Self::held), with `hash` computed `from` an origin read or a read-back: served on
    /// under that mark, so a read-back's bytes never reach any node's cross-job cache however many
    /// nodes pass them on.
    pub fn held_from(&self, unit: &Unit, hash: blake3::Hash, from: HashFrom) {
        self.set(unit, Held::Yes(hash, from));
    }

    /// This node will not hold `unit` (its origin read failed): peers asking for it are told why.
    pub fn failed(&self, unit: &Unit, why: String) {
        self.set(unit, Held::Failed(why));
    }

    /// Routes around `node` for the rest of the job: its units go to the other nodes.
    pub(super) fn lose(&self, node: &str, kind: Trouble, why: &str) {
        if node == self.node || !first_reason(&mut lock(&self.state).lost, node, why) {
            return;
        }
        self.reshare_fallback();
        tracing::warn!(
            job_id = self.job,
            "peer {node} is routed around for the rest of the job: {why}"
        );
        let text = match kind {
            Trouble::Corrupt => format!(
                "peer transfers: data from node {node} failed its checksum twice ({why}); this node took that data again from another node or the origin, and no more data from {node}"
            ),
            _ => format!(
                "peer transfers: node {node}'s agent could not be used ({why}); this node took {node}'s share of the datasets from the origin or the other nodes instead"
            ),
        };
        self.note(node, kind, text);
    }

    /// A note for the job output about `node`; the first of each kind per node is kept.
    pub(super) fn note(&self, node: &str, kind: Trouble, text: String) {
        let tag = match kind {
            Trouble::Lost => "lost",
            Trouble::Corrupt => "corrupt",
            Trouble::Unit => "unit",
        };
        lock(&self.state)
            .notes
            .entry((node.to_string(), tag))
            .or_insert(text);
    }

    /// The notes for the job's output so far.
    pub fn notes(&self) -> Vec<String> {
        lock(&self.state).notes.values().cloned().collect()
    }

    /// Whether this node may still ask `node`'s cache: not routed around, nor its cache given up.
    pub(crate) fn cache_usable(&self, node: &str) -> bool {
        let st = lock(&self.state);
        !st.lost.contains_key(node) && !st.no_cache.contains_key(node)
    }

    /// Stops asking `node`'s cache for the rest of the job (its units are still fetched from it).
    pub(crate) fn cache_off(&self, node: &str, why: &str) {
        if !first_reason(&mut lock(&self.state).no_cache, node, why) {
            return;
        }
        tracing::info!(
            job_id = self.job,
            "peer {node}'s cache is not asked again for this job: {why}"
        );
    }

    /// The peer whose cache holds `object`, asked of every node of the job this node still counts
    /// (at once, each within [`PROBE_WAIT`]), or `None`. Of several that do, the one the object's
    /// rendezvous hash picks among them, so that the job's readers of one object spread over them.
    pub(crate) async fn find_cached(&self, object: &CachedObject) -> Option<String> {
        let asked: Vec<String> = self
            .alive_nodes()
            .into_iter()
            .filter(|n| *n != self.node && self.cache_usable(n))
            .collect();
        let probes = asked.iter().map(|node| async move {
            let start = tokio::time::Instant::now();
            let mut pause = Duration::from_millis(100);
            loop {
                let addr = self.cfg.addr_of(node);
                match self
                    .client
                    .probe_cached(&addr, &self.key, object, PROBE_WAIT)
                    .await
                {
                    Ok(held) => return held.then(|| node.clone()),
                    Err(PeerError::UnknownJob { .. }) if start.elapsed() + pause < PROBE_GRACE => {
                        tokio::time::sleep(pause).await;
                        pause *= 2;
                    }
                    Err(e) => {
                        self.cache_off(node, &error_chain(&e));
                        return None;
                    }
                }
            }
        });
        let holders: Vec<String> = futures::future::join_all(probes)
            .await
            .into_iter()
            .flatten()
            .collect();
        (!holders.is_empty()).then(|| holders[owner_of(&object.url, &holders)].clone())
    }

    /// Takes `unit` (its offset and length) of `object` from `node`'s cache into `sink` (see
    /// [`PeerClient::fetch_cached_into`]): `Ok(false)` when the cache no longer holds it.
    pub(crate) async fn fetch_cached(
        &self,
        node: &str,
        object: &CachedObject,
        unit: &Unit,
        sink: &mut dyn UnitSink,
    ) -> Result<bool, PeerError> {
        self.client
            .fetch_cached_into(
                &self.cfg.addr_of(node),
                &self.key,
                object,
                unit.offset..unit.offset + unit.len,
                self.cfg.read_timeout,
                sink,
            )
            .await
    }

    /// Whether `node`'s agent is up and serving the job (see [`PeerClient::probe_alive`]): `Err`
    /// with why not, its answer awaited up to `[peer] read_timeout`.
    pub async fn alive(&self, node: &str) -> Result<(), PeerError> {
        self.client
            .probe_alive(&self.cfg.addr_of(node), &self.key, self.cfg.read_timeout)
            .await
    }

    /// Fetches `unit` from `node` into `sink` (see [`PeerClient::fetch_into`]); what the hash it
    /// was checked against was computed from.
    pub async fn fetch(
        &self,
        node: &str,
        unit: &Unit,
        sink: &mut dyn UnitSink,
    ) -> Result<HashFrom, PeerError> {
        self.client
            .fetch_into(&self.cfg.addr_of(node), &self.key, unit, sink)
            .await
    }

    /// Staging ended on this node (`why`: done, failed, cut short): the units it never held will
    /// not come, and peers waiting for them are told so. Units it holds are still served until
    /// the job ends ([`NodePeers::leave`]).
    pub fn close(&self, why: &str) {
        let mut st = lock(&self.state);
        st.listing = 0;
        if st.closed.is_none() {
            st.closed = Some(why.to_string());
        }
        for book in st.listings.values_mut() {
            book.close(why);
        }
        for object in st.objects.values_mut() {
            for slot in &mut object.units {
                if matches!(slot.1, Held::Pending) {
                    slot.1 = Held::Failed(format!("staging ended on this node: {why}"));
                }
            }
        }
        drop(st);
        self.bump();
    }

    /// What this node can say about `unit` now: `Some` is final, `None` means wait.
    fn answer(&self, unit: &Unit) -> Option<Result<blake3::Hash, UnitError>> {
        if unit.file == sluice_peer::client::ALIVE_PROBE {
            // A liveness probe: answered at once, whatever this node is still staging.
            return Some(Err(UnitError::NotOwner));
        }
        let mut st = lock(&self.state);
        let (listing, closed) = (st.listing, st.closed.is_some());
        // A path this node listed as another version of its object counts as known: the asking
        // node listed the object on the other side of an overwrite (see `stage::object`).
        let known_file =
            st.objects.contains_key(&unit.file) || st.versions.contains_key(unit_path(&unit.file));
        match slot_mut(&mut st, unit, self.cfg.unit_size) {
            Some((_, Held::Yes(h, _))) => Some(Ok(*h)),
            Some((_, Held::Failed(why))) => Some(Err(UnitError::Failed(why.clone()))),
            Some((_, Held::Pending)) => None,
            // A unit this node will never know: another listing, another unit size, or not one
            // of the job's units at all. A file not listed here yet may still come.
            None if known_file || listing == 0 || closed => Some(Err(UnitError::NotOwner)),
            None => None,
        }
    }
}

/// The slot of `unit` if it is exactly one of the recorded units (file, offset and length).
fn slot_mut<'a>(st: &'a mut State, unit: &Unit, unit_size: u64) -> Option<&'a mut (u64, Held)> {
    if !unit.offset.is_multiple_of(unit_size) {
        return None;
    }
    let object = st.objects.get_mut(&unit.file)?;
    let slot = object.units.get_mut((unit.offset / unit_size) as usize)?;
    (slot.0 == unit.len).then_some(slot)
}

#[async_trait::async_trait]
impl UnitSource for JobPeers {
    async fn ready(&self, unit: &Unit) -> Result<(), UnitError> {
        // Subscribed before looking, so no change between the look and the wait is missed; the
        // receiver is dropped with the future, which leaves this node's own staging untouched.
        let mut changes = self.changed.subscribe();
        loop {
            if let Some(answer) = self.answer(unit) {
                return answer.map(drop);
            }
            if changes.changed().await.is_err() {
                return Err(UnitError::Gone);
            }
        }
    }

    async fn unit(&self, unit: &Unit) -> Result<UnitData, UnitError> {
        let (hash, from, root, rel) = self.staged(unit)?;
        let (offset, len, owner) = (unit.offset, unit.len as usize, self.owner);
        let bytes = blocking(move || {
            let file = open_staged(&root, &rel, owner)?;
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, offset)?;
            Ok::<_, std::io::Error>(buf)
        })
        .await
        .map_err(|e| UnitError::Failed(format!("reading this node's staged copy: {e}")))?;
        Ok(UnitData {
            bytes: Bytes::from(bytes),
            hash,
            from,
        })
    }

    /// The unit read from the staged copy a slice at a time as the response goes out, so serving
    /// holds about one slice per response (the server's slots bound how many), never a unit.
    async fn unit_stream(&self, unit: &Unit) -> Result<UnitStream, UnitError> {
        let (hash, from, root, rel) = self.staged(unit)?;
        let owner = self.owner;
        let file = blocking(move || open_staged(&root, &rel, owner))
            .await
            .map_err(|e| UnitError::Failed(format!("reading this node's staged copy: {e}")))?;
        let (job, name) = (self.job, unit.key());
        let slices = read_slices(
            move |buf, at| file.read_exact_at(buf, at),
            unit.offset..unit.offset + unit.len,
            // Ending early cuts the response short: the requester reads it elsewhere.
            move |e| {
                tracing::warn!(
                    job_id = job,
                    "serving unit {name}: reading the staged copy: {e}"
                )
            },
        );
        Ok(UnitStream {
            len: unit.len,
            hash,
            from,
            body: slices,
        })
    }

    async fn listing_page(&self, asked: &PageRequest) -> Result<Bytes, UnitError> {
        self.wait_page(asked).await
    }

    fn has_cache(&self) -> bool {
        self.cache.is_some()
    }

    /// From this node's cache, only for an object under one of the job's datasets.
    async fn cached_range(
        &self,
        object: &CachedObject,
        offset: u64,
        len: u64,
    ) -> Option<UnitStream> {
        let share = self.cache.as_ref()?;
        let key = share.key(object)?;
        if len == 0 {
            return share.cache.contains(&key).then(|| UnitStream {
                len: 0,
                hash: blake3::hash(b""),
                from: HashFrom::Origin,
                body: Box::pin(futures::stream::empty()),
            });
        }
        let cache = share.cache.clone();
        let hit = blocking(move || cache.lookup_for_peer(&key)).await?;
        cached_stream(hit, offset, len).await
    }
}

/// The slices a served unit is read in.
const SERVE_SLICE: u64 = 1 << 20;

/// The bytes of `range`, read with `read` (which fills its buffer or fails, as `read_exact_at`
/// does) a [`SERVE_SLICE`] at a time on blocking threads as a response body takes them. A failed
/// read ends the body early, after `failed` says why: the requester, short of bytes, reads the
/// unit elsewhere.
fn read_slices(
    read: impl Fn(&mut [u8], u64) -> std::io::Result<()> + Send + Sync + 'static,
    range: std::ops::Range<u64>,
    failed: impl Fn(std::io::Error) + Send + Sync + 'static,
) -> futures::stream::BoxStream<'static, Bytes> {
    let (read, failed, end) = (Arc::new(read), Arc::new(failed), range.end);
    let slices = futures::stream::unfold(range.start, move |at| {
        let (read, failed) = (read.clone(), failed.clone());
        async move {
            if at >= end {
                return None;
            }
            let n = (end - at).min(SERVE_SLICE) as usize;
            let got = blocking(move || {
                let mut buf = vec![0u8; n];
                (*read)(&mut buf, at).map(|()| buf)
            })
            .await;
            match got {
                Ok(buf) => Some((Bytes::from(buf), at + n as u64)),
                Err(e) => {
                    (*failed)(e);
                    None
                }
            }
        }
    });
    Box::pin(slices)
}

/// Serving a range of an object from this node's cache: hashed first (the hash goes before the
/// body), then read again a slice at a time as the response goes out. An entry's file never
/// changes once committed (a new version is another entry, eviction only unlinks it), and the
/// [`Hit`] pins it and keeps it open until the body is sent, so both reads see the same bytes.
async fn cached_stream(hit: Hit, offset: u64, len: u64) -> Option<UnitStream> {
    let hit = Arc::new(hit);
    let reader = hit.clone();
    let hash = blocking(move || {
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; SERVE_SLICE as usize];
        let mut at = offset;
        while at < offset + len {
            let n = (offset + len - at).min(SERVE_SLICE) as usize;
            reader.read_at(&mut buf[..n], at)?;
            hasher.update(&buf[..n]);
            at += n as u64;
        }
        Ok::<_, std::io::Error>(hasher.finalize())
    })
    .await;
    let hash = match hash {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!("serving a peer from the cache: {e}");
            return None;
        }
    };
    let slices = read_slices(
        move |buf, at| hit.read_at(buf, at),
        offset..offset + len,
        |e| tracing::warn!("serving a peer from the cache: {e}"),
    );
    Some(UnitStream {
        len,
        hash,
        from: HashFrom::Origin,
        body: slices,
    })
}

impl JobPeers {
    /// Where the staged copy of `unit` is, once this node holds it: its hash and what that was
    /// computed from, the directory, the path below it.
    #[allow(clippy::type_complexity)]
    fn staged(
        &self,
        unit: &Unit,
    ) -> Result<(blake3::Hash, HashFrom, Arc<OwnedFd>, String), UnitError> {
        let mut st = lock(&self.state);
        let (hash, from) = match slot_mut(&mut st, unit, self.cfg.unit_size) {
            Some((_, Held::Yes(h, from))) => (*h, *from),
            Some((_, Held::Failed(why))) => return Err(UnitError::Failed(why.clone())),
            _ => return Err(UnitError::NotOwner),
        };
        let object = &st.objects[&unit.file];
        Ok((
            hash,
            from,
            object.root.clone(),
            unit_path(&unit.file)[object.rel_at..].to_string(),
        ))
    }
}

/// Opens the staged file `rel` below `root` for reading: every component opened without
/// following links, the file only if it is a regular file of `owner` with one link (a user cannot
/// have the agent read a hard link to someone else's file, or hang on a FIFO).
pub fn open_staged(root: &OwnedFd, rel: &str, owner: Owner) -> std::io::Result<File> {
    open_checked(root, rel, owner, OFlag::O_RDONLY)
}

/// [`open_staged`] for writing: how the agent, as root, writes the units it fetched into a file
/// the job user's copy helper made (never through a link, never a file of anyone else's, never
/// a second link to one).
pub(crate) fn open_staged_for_write(
    root: &OwnedFd,
    rel: &str,
    owner: Owner,
) -> std::io::Result<File> {
    open_checked(root, rel, owner, OFlag::O_WRONLY)
}

fn open_checked(root: &OwnedFd, rel: &str, owner: Owner, access: OFlag) -> std::io::Result<File> {
    let parts: Vec<&str> = rel.split('/').collect();
    let (name, dirs) = parts.split_last().expect("split yields one part");
    let mut dir = root.try_clone()?;
    for d in dirs {
        dir = safefs::open_dir(&dir, d).map_err(std::io::Error::other)?;
    }
    safefs::check_component(name).map_err(std::io::Error::other)?;
    let flags = access | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let fd = openat(&dir, *name, flags, Mode::empty()).map_err(std::io::Error::from)?;
    let st = fstat(&fd).map_err(std::io::Error::from)?;
    let regular = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG;
    if !regular || st.st_uid != owner.uid || st.st_nlink != 1 {
        return Err(std::io::Error::other(format!(
            "'{rel}' is no longer the file this node staged"
        )));
    }
    Ok(File::from(fd))
}

/// What [`JobPeers::dataset_guard`] returns.
pub(super) struct DatasetDone(Arc<JobPeers>);

impl Drop for DatasetDone {
    fn drop(&mut self) {
        self.0.dataset_done();
    }
}

mod fallback;
pub(crate) mod listing;
#[cfg(test)]
pub(crate) mod tests;
