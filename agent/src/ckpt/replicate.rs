//! Replicas (`[fast_tier] replicas`): this node's part of each committed RAM-tier checkpoint (or
//! hot-tier one, `--ckpt-replicas` with `--ckpt-tier=local`), copied to other nodes of the job, so
//! that losing this node before the archive holds the checkpoint loses no file of it.
//!
//! - **When**: after the flush to the hot tier (whose hashes are what the replicas are checked
//!   against; a hot-tier checkpoint is hashed instead), in the background of the checkpoint
//!   worker; never on the save's path.
//! - **Where**: the job's other nodes in the rendezvous order of `replica/JOB/TAG/NODE`
//!   ([`sluice_peer::ranked`]): the same order on every node, and a lost node moves only what it
//!   held. A node without room for it (or not reached) is passed over for the next one; the
//!   checkpoint shows why it has fewer than asked (`sluice ckpt list`) while it does.
//! - **How**: each file is pushed over the peer port with its size and the BLAKE3 its flush read,
//!   which the holder checks as it writes; then the part is sealed with the list of its files.
//!   The holder keeps it root-only in its replica area (`crate::replica_area`).
//! - **Until**: the archive holds the checkpoint: then the holders are told to free it.

use super::CkptCtx;
use crate::job::Job;
use crate::job::ckpts::{CkptEntry, Replication};
use bytes::Bytes;
use futures::StreamExt;
use sluice_archive::flush::FlushHashes;
use sluice_archive::walk;
use sluice_core::backoff::{Backoff, Schedule};
use sluice_core::rt::{blocking, now_secs};
use sluice_core::safefs;
use sluice_peer::{PeerError, ReplicaFile, ReplicaPart, ReplicaSeal};
use sluice_stage::ReplicaPeers;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use tokio::time::Instant;

/// What the job's checkpoint worker keeps for its replicas between turns.
#[derive(Debug)]
pub(crate) struct Replicas {
    /// Tags another node of the job committed that this node holds none of: when the notice
    /// came, and the nodes that hold this node's empty part of each, so that the holders'
    /// indexes name every node's part (the archive's empty part, for replicas).
    empty: BTreeMap<String, (u64, Vec<String>)>,
    /// Tags whose last placement fell short wait before the next (`failures` in a row each).
    retries: Schedule<String>,
    failures: HashMap<String, u64>,
}

impl Default for Replicas {
    fn default() -> Replicas {
        Replicas {
            empty: BTreeMap::new(),
            retries: Schedule::new(Backoff::new(
                std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(60),
            )),
            failures: HashMap::new(),
        }
    }
}

impl Replicas {
    /// Another node committed `tag`, of which this node holds nothing.
    pub(crate) fn hold_empty(&mut self, tag: String) {
        self.empty
            .entry(tag)
            .or_insert_with(|| (now_secs(), Vec::new()));
    }

    pub(crate) fn holds_empty(&self, tag: &str) -> bool {
        self.empty.contains_key(tag)
    }

    fn ready(&self, tag: &str) -> bool {
        self.retries.ready(tag, Instant::now())
    }

    /// After a placement of `tag`: short or not.
    fn placed(&mut self, tag: &str, short: bool) {
        let failures = self.failures.entry(tag.to_string()).or_default();
        *failures = if short { *failures + 1 } else { 0 };
        self.retries
            .update(tag.to_string(), *failures, Instant::now());
    }
}

/// Pushes this node's part of every flushed checkpoint that fewer nodes hold than the job asks
/// for (and the empty parts of tags it holds none of), frees the replicas of archived ones, and
/// finds which checkpoints are protected. One pass; what falls short is tried again at a later
/// turn, after a pause that grows with each shortfall. A job that ended places nothing more (its
/// nodes took it off their peer ports): its replicas are for a requeue, until it is archived.
pub(crate) async fn replicate_pending(ctx: &CkptCtx, job: &Arc<Job>, state: &mut Replicas) {
    let wanted = usize::from(job.replicas_wanted());
    if wanted == 0 {
        return;
    }
    let Some(peers) = ctx.peers.get() else {
        for entry in job.ckpts.entries() {
            let mut r = entry.replication();
            if r.source.is_some() && r.holders.len() < wanted {
                r.short = Some("peer transfers are off on this node ([peer], its secret)".into());
            }
        }
        return;
    };
    let link = Link::new(peers, job);
    free_archived(&link).await;
    if job.has_ended() {
        return;
    }
    // A part sealed for the first time is journaled: this node serves it to a restore from
    // replicas, after a restart of its agent too.
    let mut changed = false;
    for entry in job.ckpts.entries() {
        if entry.archived_at().is_some() || !state.ready(&entry.tag) {
            continue;
        }
        let (source, generation, held) = {
            let r = entry.replication();
            match &r.source {
                Some(s) if r.holders.len() < wanted => (s.clone(), r.generation, r.holders.clone()),
                _ => continue,
            }
        };
        if entry.generation() != generation {
            continue; // committed again: the next flush brings the new part
        }
        let (placed, part) = match part_files(ctx, job, &entry, &source).await {
            Ok(files) => {
                let seal = link.seal(files, entry.committed_at);
                let part = Part {
                    tag: &entry.tag,
                    seal: &seal,
                    entry: Some(&entry),
                };
                let placed = place(ctx, &link, &part, held, wanted).await;
                (placed, Some(Arc::new(seal)))
            }
            Err(why) => ((held, Some(why)), None),
        };
        let (holders, short) = placed;
        state.placed(&entry.tag, holders.len() < wanted);
        let mut r = entry.replication();
        if r.generation != generation {
            continue;
        }
        if part.is_some() && r.part != part {
            r.part = part;
            changed = true;
        }
        if holders.len() >= wanted {
            r.source = None;
            r.short = None;
            tracing::info!(
                job_id = job.start.job_id,
                tag = entry.tag,
                holders = holders.join(","),
                "checkpoint part replicated"
            );
        } else {
            r.short = short;
        }
        r.holders = holders;
    }
    if changed {
        ctx.jobs.persist(job).await;
    }
    let empty: Vec<(String, u64, Vec<String>)> = state
        .empty
        .iter()
        .filter(|(tag, (_, holders))| holders.len() < wanted && state.ready(tag))
        .map(|(tag, (at, holders))| (tag.clone(), *at, holders.clone()))
        .collect();
    for (tag, committed_at, held) in empty {
        let seal = link.seal(Vec::new(), committed_at);
        let part = Part {
            tag: &tag,
            seal: &seal,
            entry: None,
        };
        let (holders, _) = place(ctx, &link, &part, held, wanted).await;
        state.placed(&tag, holders.len() < wanted);
        if let Some(slot) = state.empty.get_mut(&tag) {
            slot.1 = holders;
        }
    }
    find_protected(ctx, &link, job, wanted).await;
}

/// The job's peer layer as this node's replicas use it: the client, the job's key, the other
/// nodes.
struct Link<'a> {
    peers: &'a ReplicaPeers,
    key: sluice_peer::JobKey,
    job: &'a Arc<Job>,
    /// The job's other nodes.
    others: Vec<String>,
}

impl<'a> Link<'a> {
    fn new(peers: &'a ReplicaPeers, job: &'a Arc<Job>) -> Link<'a> {
        let me = &job.start.node;
        Link {
            peers,
            key: peers.job_key(job.start.job_id, &job.start.nodes),
            job,
            others: job
                .start
                .nodes
                .iter()
                .filter(|n| *n != me)
                .cloned()
                .collect(),
        }
    }

    /// The seal of this node's part with `files`: the job's nodes, the commit's time.
    fn seal(&self, files: Vec<ReplicaFile>, committed_at: u64) -> ReplicaSeal {
        let mut nodes = self.job.start.nodes.clone();
        nodes.sort();
        nodes.dedup();
        ReplicaSeal {
            files,
            nodes,
            committed_at,
        }
    }

    fn addr_of(&self, node: &str) -> String {
        self.peers.addr_of(node)
    }
}

/// This node's part of one checkpoint, as it is pushed.
struct Part<'a> {
    tag: &'a str,
    seal: &'a ReplicaSeal,
    /// The checkpoint whose files are pushed; `None`: an empty part (the seal has no files).
    entry: Option<&'a Arc<CkptEntry>>,
}

/// Pushes `part` to the job's other nodes in placement order until `wanted` hold it. Returns who
/// holds it, and why fewer do if they do.
async fn place(
    ctx: &CkptCtx,
    link: &Link<'_>,
    part: &Part<'_>,
    mut holders: Vec<String>,
    wanted: usize,
) -> (Vec<String>, Option<String>) {
    let (job, tag, seal) = (link.job, part.tag, part.seal);
    let key = format!("replica/{}/{tag}/{}", job.start.job_id, job.start.node);
    let need: u64 = seal.files.iter().map(|f| f.size).sum();
    let mut short = Vec::new();
    let me = &job.start.node;
    let order = sluice_peer::ranked(&key, &link.others);
    for i in ctx.switches.apart_first(me, &link.others, order) {
        if holders.len() >= wanted {
            break;
        }
        let node = &link.others[i];
        if holders.contains(node) {
            continue;
        }
        match push_part(ctx, link, part, node, need).await {
            Ok(bytes) => {
                ctx.metrics.replica_sent(bytes);
                holders.push(node.clone());
            }
            Err(NotPlaced::Here(why)) => {
                short.push(why);
                break; // this node's copy, not the holder: no other node would fare better
            }
            Err(NotPlaced::There(e)) => {
                let why = match &e {
                    PeerError::NoRoom { need, free, .. } => format!(
                        "{node} has no room for replicas: {} asked, {} free",
                        sluice_proto::summary::bytes(*need),
                        sluice_proto::summary::bytes(*free)
                    ),
                    e => format!("{node}: {}", sluice_stage::error_chain(e)),
                };
                tracing::warn!(job_id = job.start.job_id, tag, "replica not placed: {why}");
                ctx.metrics.replica_refused();
                short.push(why);
            }
        }
    }
    let short = (holders.len() < wanted).then(|| {
        if short.is_empty() {
            "the job has too few other nodes".to_string()
        } else {
            short.join("; ")
        }
    });
    (holders, short)
}

/// Which of the job's checkpoints are protected now: this node's part held by `wanted` other
/// nodes, and every other node's part too, as the job's other nodes' replica indexes show it (an
/// empty part counts: that node holds none of the checkpoint). Asked only while some checkpoint
/// whose part here is placed is not protected yet, or was placed by the run before a requeue or
/// an agent restart: its holders are not journaled, so they are read back from the indexes (the
/// nodes that hold this node's part as it was sealed), and a part fewer nodes hold than the job
/// asks (a holder lost with its node) is placed again.
async fn find_protected(ctx: &CkptCtx, link: &Link<'_>, job: &Arc<Job>, wanted: usize) {
    let inherited = |r: &Replication| {
        r.holders.is_empty()
            && r.source.is_none()
            && r.part.is_some()
            && !r.freed
            && r.short.is_none()
    };
    let waiting: Vec<Arc<CkptEntry>> = job
        .ckpts
        .entries()
        .into_iter()
        .filter(|e| e.archived_at().is_none())
        .filter(|e| {
            let r = e.replication();
            !r.protected && (r.holders.len() >= wanted || inherited(&r))
        })
        .collect();
    if waiting.is_empty() {
        return;
    }
    // Who holds this node's parts as they were sealed: tag → nodes.
    let me = &job.start.node;
    let mut mine: BTreeMap<String, Vec<(String, ReplicaPart)>> = BTreeMap::new();
    // (from, tag) → how many nodes hold it (this node's own area too, asked the same way).
    let mut held: BTreeMap<(String, String), usize> = BTreeMap::new();
    for node in &job.start.nodes {
        match link
            .peers
            .client()
            .replica_index(&link.addr_of(node), &link.key)
            .await
        {
            Ok(parts) => {
                // A node's index lists its own parts too (its own copy, for a restore): those
                // are no replica.
                for p in parts.into_iter().filter(|p| p.from != *node) {
                    if p.from == *me {
                        let at = mine.entry(p.tag.clone()).or_default();
                        at.push((node.clone(), p.clone()));
                    }
                    *held.entry((p.from, p.tag)).or_default() += 1;
                }
            }
            Err(e) => tracing::debug!(
                job_id = job.start.job_id,
                "{node}'s replica index: {}",
                sluice_stage::error_chain(&e)
            ),
        }
    }
    for entry in waiting {
        {
            let mut r = entry.replication();
            if inherited(&r) {
                let sealed = r.part.clone().expect("inherited parts are sealed");
                let same = |p: &ReplicaPart| {
                    p.files == sealed.files && p.committed_at == sealed.committed_at
                };
                r.holders = mine
                    .remove(&entry.tag)
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(node, p)| same(&p).then_some(node))
                    .collect();
                if r.holders.len() < wanted {
                    // Placed again at the next turn (a holder was lost with its node): from the
                    // job's copy, which must still hash as it was sealed.
                    let hashes: Option<FlushHashes> = sealed
                        .files
                        .iter()
                        .map(|f| Some((f.path.clone(), blake3::Hash::from_hex(&f.blake3).ok()?)))
                        .collect();
                    r.source = hashes.map(Arc::new);
                    r.generation = entry.generation();
                    r.from_seal = true;
                    if r.source.is_none() {
                        r.short = Some("its seal cannot be read back".into());
                    }
                    continue;
                }
            }
        }
        let all = link.others.iter().all(|n| {
            held.get(&(n.clone(), entry.tag.clone()))
                .is_some_and(|c| *c >= wanted)
        });
        if all {
            entry.replication().protected = true;
            ctx.metrics.ckpt_protected();
            tracing::info!(
                job_id = job.start.job_id,
                tag = entry.tag,
                "checkpoint protected: every node's part is on {wanted} other node(s)"
            );
        }
    }
}

/// The part's files as the worker will push them: path, size now, and the hash its flush read
/// (a file the flush did not read, or that is gone, means the checkpoint changed since: refused).
async fn part_files(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    entry: &Arc<CkptEntry>,
    source: &Arc<FlushHashes>,
) -> Result<Vec<ReplicaFile>, String> {
    let (dirs, tag, uid) = (ctx.dirs(job), entry.tag.clone(), job.start.uid);
    let (source, in_ram) = (source.clone(), entry.in_ram());
    let from_seal = entry.replication().from_seal;
    blocking(move || {
        let dir = open_part(&dirs, in_ram, &tag).map_err(|e| e.to_string())?;
        let mut tree = walk::walk(&dir, uid).map_err(|e| e.to_string())?;
        if from_seal {
            tree.files.retain(|f| source.contains_key(&f.rel));
        }
        if tree.files.len() != source.len() {
            return Err(format!(
                "{tag} holds {} files, its flush read {}: it changed since its commit",
                tree.files.len(),
                source.len()
            ));
        }
        tree.files
            .iter()
            .map(|f| match source.get(&f.rel) {
                Some(h) => Ok(ReplicaFile {
                    path: f.rel.clone(),
                    size: f.size,
                    blake3: h.to_hex().to_string(),
                }),
                None => Err(format!("{tag}/{}: not read by its flush", f.rel)),
            })
            .collect()
    })
    .await
}

/// The part's directory: its RAM-tier copy while it has one (`in_ram`), else the hot tier's
/// flushed copy (blocking).
fn open_part(
    dirs: &super::CkptDirs,
    in_ram: bool,
    tag: &str,
) -> Result<std::os::fd::OwnedFd, safefs::SafeFsError> {
    let root = if in_ram && dirs.ram().is_some() {
        dirs.user()?
    } else {
        dirs.hot()?
    };
    safefs::open_dir(&root, tag)
}

/// Why a part was not placed on a node.
enum NotPlaced {
    /// This node's copy could not be read as listed (it changed since its commit).
    Here(String),
    /// The node did not take it.
    There(PeerError),
}

/// Pushes every file of the part to `node` (once its free room takes `need` bytes), then seals
/// it there. Returns the bytes sent.
async fn push_part(
    ctx: &CkptCtx,
    link: &Link<'_>,
    part: &Part<'_>,
    node: &str,
    need: u64,
) -> Result<u64, NotPlaced> {
    let (tag, seal) = (part.tag, part.seal);
    let addr = link.addr_of(node);
    let client = link.peers.client();
    // A holder that stores the part's files as they are (a requeued job's node commits again what
    // it restored from replicas, and the holder served it from) is sealed again without a byte
    // sent: it checks each file's size and hash. A push would unseal the part there until its
    // seal, and a restore reading the part at that moment would find it gone.
    if !seal.files.is_empty()
        && client
            .seal_replica(&addr, &link.key, tag, seal)
            .await
            .is_ok()
    {
        return Ok(0);
    }
    if need > 0 {
        // A holder without room refuses a push only after reading some of it, which a large
        // file's sender sees as a dropped connection: ask first.
        let (free, _) = client
            .replica_room(&addr, &link.key)
            .await
            .map_err(NotPlaced::There)?;
        if free < need {
            return Err(NotPlaced::There(PeerError::NoRoom {
                addr,
                what: format!("replica part {tag}"),
                need,
                free,
            }));
        }
    }
    let mut sent = 0;
    for file in &seal.files {
        let entry = part.entry.expect("only a checkpoint's part has files");
        let (dirs, in_ram, uid) = (ctx.dirs(link.job), entry.in_ram(), link.job.start.uid);
        let (t, f) = (tag.to_string(), file.clone());
        let opened = blocking(move || open_file(&dirs, in_ram, &t, uid, &f)).await;
        let body = file_stream(opened.map_err(NotPlaced::Here)?);
        client
            .push_replica(&addr, &link.key, tag, file, body)
            .await
            .map_err(NotPlaced::There)?;
        sent += file.size;
    }
    client
        .seal_replica(&addr, &link.key, tag, seal)
        .await
        .map_err(NotPlaced::There)?;
    Ok(sent)
}

/// Opens one file of the part as root inside the user's tree, checking it is the size listed.
pub(super) fn open_file(
    dirs: &super::CkptDirs,
    in_ram: bool,
    tag: &str,
    uid: u32,
    file: &ReplicaFile,
) -> Result<std::fs::File, String> {
    let dir = open_part(dirs, in_ram, tag).map_err(|e| e.to_string())?;
    let tree_file = walk::TreeFile {
        rel: file.path.clone(),
        size: file.size,
        mode: 0,
        ino: 0,
        mtime_ns: 0,
        ctime_ns: 0,
    };
    let (f, snap) = walk::open_file(&dir, &tree_file, uid).map_err(|e| e.to_string())?;
    if snap.size != file.size {
        return Err(format!(
            "{tag}/{}: {} bytes now, {} when listed: it changed since its commit",
            file.path, snap.size, file.size
        ));
    }
    Ok(f)
}

/// A file's bytes as a stream of slices read in the blocking pool.
fn file_stream(
    file: std::fs::File,
) -> futures::stream::BoxStream<'static, Result<Bytes, std::io::Error>> {
    tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 1 << 20).boxed()
}

/// Frees the replicas of the job's archived checkpoints (after each turn's uploads, so that a
/// job's last turn frees what it archived).
pub(crate) async fn free_replicas_of_archived(ctx: &CkptCtx, job: &Arc<Job>) {
    if let Some(peers) = ctx.peers.get()
        && job.replicas_wanted() > 0
    {
        free_archived(&Link::new(peers, job)).await;
    }
}

/// Tells the holders of the archived checkpoints' replicas to free them (once; a holder not
/// reached frees them when the job is over there). Every other node of the job is told, not only
/// the holders this node knows of: after a requeue or an agent restart it no longer knows them
/// (the journal does not keep them), and freeing what a node does not hold is no error.
async fn free_archived(link: &Link<'_>) {
    for entry in link.job.ckpts.entries() {
        if entry.archived_at().is_some() {
            free_one(link, &entry).await;
        }
    }
}

async fn free_one(link: &Link<'_>, entry: &Arc<CkptEntry>) {
    let holders: BTreeSet<String> = {
        let mut r = entry.replication();
        r.source = None;
        if r.freed {
            return;
        }
        r.freed = true;
        let me = &link.job.start.node;
        let others = link.job.start.nodes.iter().filter(|n| *n != me);
        r.holders.iter().chain(others).cloned().collect()
    };
    for node in holders {
        if let Err(e) = link
            .peers
            .client()
            .free_replica(&link.addr_of(&node), &link.key, &entry.tag)
            .await
        {
            tracing::info!(
                job_id = link.job.start.job_id,
                tag = entry.tag,
                "{node} was not told to free its replica ({e}); it frees it when the job is over there"
            );
        }
    }
}
