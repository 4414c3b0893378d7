//! `--ckpt-restore` from replicas (`[fast_tier] replicas`, issue 26): a requeued job with replicas
//! (of RAM-tier or hot-tier checkpoints) takes its checkpoint from the copies its nodes hold —
//! each node's own part, and the replicas of the other nodes' parts — before the archive, which
//! may not hold the checkpoint yet (or be down).
//!
//! 1. Every node of the job (this one too, over the peer port, as the others ask it) is asked for
//!    its replica index: the parts pushed to it, and its own parts of the job's unarchived
//!    checkpoints (`ckpt::NodeReplicas`). A node that does not know the job yet (its prolog has
//!    not run, or the run before ended there) is asked again for [`JOIN_WAIT`]; one that cannot be
//!    reached is passed over: it may be the node that was lost.
//! 2. A tag is *complete* when, for every node its seals name (the nodes of the run that committed
//!    it), some node holds that node's part, and no two parts give one path different content.
//!    `latest` is the complete tag committed last, unless a node says a checkpoint committed as
//!    late or later is archived (then the archive's is newer); a named tag must be complete and
//!    not archived (archived, its replicas are freed). Anything else is restored from the archive,
//!    as without replicas.
//! 3. Each file that `$SLUICE_CKPT_DIR/TAG` does not hold already with its sealed size and BLAKE3
//!    is fetched from this node's copy first, else from another holder, into a file created as the
//!    job user beside it (`safefs::ensure_dirs`, `create_file`, never through a link) and renamed
//!    over it only if its bytes hash to the sealed BLAKE3 (`fetch_replica_into`). A file no holder
//!    gives makes the whole restore fall back to the archive, and leaves what was there.
//! 4. The restored tag is committed on this node when it has no entry of it here (a node that
//!    lost everything, or a new one): the ordinary commit, as of the time the checkpoint was saved
//!    (so that the other nodes' indexes see the same checkpoint, not a newer one), so that it is flushed,
//!    replicated (its own part as it was sealed: the holders that kept it are sealed again) and
//!    archived from this node's whole copy once the archive is back — the data-safety
//!    rule: the replicas of a lost node's part are freed only once the archive holds the
//!    checkpoint, and nothing else of that part may be the last copy. (The archive takes the same
//!    path from several nodes when its content is the same, and every node's copy of each file is
//!    the sealed one.) A node that still has the tag's entry keeps it as it is.
//! 5. A node without an entry of the job's other unarchived tags whose own part only replicas
//!    hold (a replaced node) fetches that part of each back and commits it the same way
//!    (`recover_own_parts`), whether or not the restore above came from replicas: otherwise it
//!    would give the archive an empty part of each, and the archive would publish them without
//!    its files (and their replicas would be held for ever).
//!
//! Only replicas of this job id are asked for, under its job key: another job, or another user's,
//! never sees them. Poison marks live in the archive only, so `latest` from replicas cannot pass
//! over a poisoned checkpoint not archived yet (nor can a poison mark exist before it is archived).

use super::CkptCtx;
use crate::job::Job;
use sluice_core::rt::blocking;
use sluice_core::safefs::{self, Owner};
use sluice_peer::{JobKey, PartKey, PeerError, ReplicaFile, ReplicaPart};
use sluice_proto::options::Restore;
use sluice_stage::peers::open_staged;
use sluice_stage::sink::HashingSink;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

/// How long a node that does not know the job yet is asked again for its index (its prolog may
/// run after this node's).
const JOIN_WAIT: Duration = Duration::from_secs(60);

/// What became of a restore from replicas.
#[derive(Debug)]
pub(crate) enum FromReplicas {
    /// The checkpoint is in `$SLUICE_CKPT_DIR/TAG`; the note says where its bytes came from.
    Restored { tag: String, note: String },
    /// Not restored from replicas; why, for the job's output, when the job has replicas.
    Not(Option<String>),
}

/// Restores `which` into `ckpt_dir` from the job's replicas (see the module header), and fetches
/// back this node's own parts of the job's other unarchived checkpoints that only replicas hold
/// now ([`recover_own_parts`]; notes for the job's output, second).
pub(crate) async fn restore(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    which: &Restore,
    ckpt_dir: Arc<OwnedFd>,
) -> (FromReplicas, Vec<String>) {
    let (Some(peers), true) = (ctx.peers.get(), job.replicas_wanted() > 0) else {
        return (FromReplicas::Not(None), Vec::new());
    };
    let key = peers.job_key(job.start.job_id, &job.start.nodes);
    let mut held: Vec<(String, Vec<ReplicaPart>)> = Vec::new();
    // This node first: of two seals of one part made at the same time (a node's own part and a
    // node's re-commit of the checkpoint it restored), the one held here is read.
    let me = &job.start.node;
    let asked = std::iter::once(me).chain(job.start.nodes.iter().filter(|n| *n != me));
    for node in asked {
        let addr = peers.addr_of(node);
        match index_of(peers.client(), &addr, &key).await {
            Ok(parts) => held.push((node.clone(), parts)),
            Err(e) => tracing::info!(
                job_id = job.start.job_id,
                "{node}'s replica index: {}",
                sluice_stage::error_chain(&e)
            ),
        }
    }
    let tags = Tags::of(&held);
    if tags.held.is_empty() && tags.archived.is_empty() && *which == Restore::Latest {
        // No node has anything of the job yet (its first run): the archive's answer says all.
        return (FromReplicas::Not(None), Vec::new());
    }
    let owner = Owner {
        uid: job.start.uid,
        gid: job.start.gid,
    };
    let restored = from_tags(ctx, job, which, &key, &held, &tags, &ckpt_dir, owner).await;
    let skip = match &restored {
        FromReplicas::Restored { tag, .. } => Some(tag.as_str()),
        FromReplicas::Not(_) => None,
    };
    let recovered = recover_own_parts(ctx, job, &key, &tags, skip, &ckpt_dir, owner).await;
    (restored, recovered)
}

/// [`restore`] of `which` from the parts the job's nodes hold (`held`, `tags`).
#[allow(clippy::too_many_arguments)]
async fn from_tags(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    which: &Restore,
    key: &JobKey,
    held: &[(String, Vec<ReplicaPart>)],
    tags: &Tags,
    ckpt_dir: &Arc<OwnedFd>,
    owner: Owner,
) -> FromReplicas {
    let me = &job.start.node;
    let chosen = match which {
        Restore::Latest => tags.latest(),
        Restore::Tag(t) | Restore::Forced(t) => tags.complete(t).then(|| t.clone()),
    };
    let Some(tag) = chosen else {
        let what = match which {
            Restore::Latest => "no checkpoint".to_string(),
            Restore::Tag(t) | Restore::Forced(t) => format!("checkpoint {t} is not"),
        };
        return FromReplicas::Not(Some(format!(
            "{what} complete in the replicas of the job's nodes ({}); restoring from the archive",
            tags.why_not(which)
        )));
    };
    let me = me.clone();
    let held_tag = &tags.held[&tag];
    let parts = held_tag.parts.clone();
    // A node that re-commits the checkpoint (below) does so as of its own part's commit, with its
    // own part's files: the seal it makes then is the one the replicas of that part carry (nodes
    // commit one tag at slightly different times).
    let committed_at = parts
        .get(&me)
        .map_or_else(|| held_tag.committed_at(), |(p, _)| p.committed_at);
    // Each path once, from any node whose index gives it with the same content in any part of
    // the tag (the parts chosen above and every other seal: two parts give one path the same
    // content, `Held::missing`), this node first: this node may hold the file as the replica of
    // another part.
    let mut sources: BTreeMap<&str, (&ReplicaFile, Vec<Source>)> = BTreeMap::new();
    for (part, _) in parts.values() {
        for file in &part.files {
            sources.entry(&file.path).or_insert((file, Vec::new()));
        }
    }
    for (holder, listed) in held {
        for p in listed.iter().filter(|p| p.tag == tag && !p.archived) {
            let pk = PartKey {
                job: job.start.job_id,
                from: p.from.clone(),
                tag: tag.clone(),
            };
            for f in &p.files {
                if let Some((want, at)) = sources.get_mut(f.path.as_str())
                    && want.blake3 == f.blake3
                    && want.size == f.size
                    && !at.iter().any(|(h, k)| *h == holder && k.from == pk.from)
                {
                    at.push((holder, pk.clone()));
                }
            }
        }
    }
    let mut from = Sources::default();
    for (file, mut holders) in sources.into_values() {
        holders.sort_by_key(|(h, _)| **h != me); // stable: then the job's order
        let fetched = fetch_file(ctx, key, file, &holders, &me, ckpt_dir, owner).await;
        match fetched {
            Ok(Some(node)) if node == me => from.here += file.size,
            Ok(Some(_)) => from.others += file.size,
            Ok(None) => from.here += file.size,
            Err(why) => {
                tracing::warn!(job_id = job.start.job_id, tag, "{why}");
                return FromReplicas::Not(Some(format!(
                    "checkpoint {tag} could not be restored from replicas ({why}); restoring from the archive"
                )));
            }
        }
    }
    // Its replicas are of this node's own part alone, as they were before the loss: the holders
    // that kept them are sealed again, not sent the whole copy (which would also take their
    // part away from a restore reading it at that moment).
    let own_part = parts
        .get(&me)
        .map(|(p, _)| Arc::new(p.files.iter().map(|f| f.path.clone()).collect()));
    if job.ckpts.get(&tag).is_none()
        && let Err(e) = super::commit_as_of(ctx, job, &tag, committed_at, own_part).await
    {
        tracing::warn!(
            job_id = job.start.job_id,
            tag,
            "the checkpoint restored from replicas is not committed here: {e}"
        );
    }
    ctx.metrics.restored_from_replicas(from.here, from.others);
    tracing::info!(
        job_id = job.start.job_id,
        tag,
        here = from.here,
        others = from.others,
        "checkpoint restored from replicas"
    );
    let note = format!(
        "checkpoint {tag} restored from replicas: {} from this node, {} from the job's other nodes, 0 B from the archive",
        sluice_proto::summary::bytes(from.here),
        sluice_proto::summary::bytes(from.others)
    );
    FromReplicas::Restored { tag, note }
}

/// This node's own parts of the job's other unarchived checkpoints (not `skip`, the one just
/// restored) of which it has no entry — it was lost and replaced, and its part of each is left
/// only in the replicas other nodes hold: fetched back into `$SLUICE_CKPT_DIR/TAG` and committed
/// as of the time they were saved, with those files as this node's part. So each still reaches
/// the archive whole once the archive is back (else this node, holding none of a tag another node
/// committed, would give the archive an empty part of it, and the archive would publish the
/// checkpoint without this node's files), and its replicas are freed then, not held for ever.
/// A part that cannot be fetched back (no room in the job's share, a holder gone) is left to its
/// replicas, which stay. Returns notes for the job's output.
async fn recover_own_parts(
    ctx: &CkptCtx,
    job: &Arc<Job>,
    key: &JobKey,
    tags: &Tags,
    skip: Option<&str>,
    ckpt_dir: &Arc<OwnedFd>,
    owner: Owner,
) -> Vec<String> {
    let me = &job.start.node;
    let mut notes = Vec::new();
    for (tag, held) in &tags.held {
        if skip == Some(tag.as_str())
            || tags.archived.contains_key(tag)
            || job.ckpts.get(tag).is_some()
        {
            continue;
        }
        let Some((part, holders)) = held.parts.get(me) else {
            continue;
        };
        if part.files.is_empty() {
            continue; // this node held none of it: its empty part is what the archive gets
        }
        let pk = PartKey {
            job: job.start.job_id,
            from: me.clone(),
            tag: tag.clone(),
        };
        let mut sources: Vec<Source> = holders.iter().map(|h| (h, pk.clone())).collect();
        sources.sort_by_key(|(h, _)| *h != me);
        let mut failed = None;
        for file in &part.files {
            if let Err(why) = fetch_file(ctx, key, file, &sources, me, ckpt_dir, owner).await {
                failed = Some(why);
                break;
            }
        }
        let paths = Arc::new(part.files.iter().map(|f| f.path.clone()).collect());
        let committed = match failed {
            Some(why) => Err(why),
            None => super::commit_as_of(ctx, job, tag, part.committed_at, Some(paths))
                .await
                .map_err(|e| e.to_string()),
        };
        let note = match committed {
            Ok(_) => format!(
                "checkpoint {tag}: this node's part ({}), held only by its replicas since the node was replaced, is back in $SLUICE_CKPT_DIR/{tag} and goes to the archive",
                sluice_proto::summary::bytes(bytes(part))
            ),
            Err(why) => format!(
                "checkpoint {tag}: this node's part could not be fetched back from its replicas ({why}); the replicas are kept, and the archive does not get {tag} until it is committed again"
            ),
        };
        tracing::info!(job_id = job.start.job_id, tag, "{note}");
        notes.push(note);
    }
    notes
}

/// A node that holds a file, and the part it holds it as.
type Source<'a> = (&'a String, PartKey);

/// Bytes of a restore from this node's copies and from the job's other nodes.
#[derive(Debug, Default)]
struct Sources {
    here: u64,
    others: u64,
}

/// The replica index of the agent at `addr`, asked again while it does not know the job yet (or
/// only the run before, which ended there).
async fn index_of(
    client: &sluice_peer::PeerClient,
    addr: &str,
    key: &JobKey,
) -> Result<Vec<ReplicaPart>, PeerError> {
    let start = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        match client.replica_index(addr, key).await {
            Err(PeerError::UnknownJob { .. } | PeerError::Gone { .. })
                if start.elapsed() + pause <= JOIN_WAIT =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            r => return r,
        }
    }
}

/// One tag as the job's nodes hold it.
#[derive(Debug, Default)]
struct Held {
    /// The nodes its seals name: those whose parts it needs.
    nodes: BTreeSet<String>,
    /// Each sender's part (the newest seal of it any node holds), and the nodes that hold that.
    parts: BTreeMap<String, (ReplicaPart, Vec<String>)>,
}

impl Held {
    fn committed_at(&self) -> u64 {
        self.parts
            .values()
            .map(|(p, _)| p.committed_at)
            .max()
            .unwrap_or(0)
    }

    /// Why it cannot be restored from replicas, if it cannot.
    fn missing(&self) -> Option<String> {
        let absent: Vec<&str> = self
            .nodes
            .iter()
            .filter(|n| !self.parts.contains_key(*n))
            .map(String::as_str)
            .collect();
        if !absent.is_empty() {
            return Some(format!("no node holds the part of {}", absent.join(", ")));
        }
        let mut content: BTreeMap<&str, &str> = BTreeMap::new();
        for (p, _) in self.parts.values() {
            for f in &p.files {
                if content
                    .insert(&f.path, &f.blake3)
                    .is_some_and(|h| h != f.blake3)
                {
                    return Some(format!("two nodes' parts differ in {}", f.path));
                }
            }
        }
        None
    }
}

/// The bytes of a part's files.
fn bytes(p: &ReplicaPart) -> u64 {
    p.files.iter().map(|f| f.size).sum()
}

/// Every tag the job's nodes hold a part of, and those some node knows archived.
#[derive(Debug, Default)]
struct Tags {
    held: BTreeMap<String, Held>,
    /// Tags a node of the job says are archived, with their commit times.
    archived: BTreeMap<String, u64>,
}

impl Tags {
    /// From each node's index (`held`: node, its parts). Of two seals of one sender's part, the
    /// later one counts; of two made as of the same commit, the one of fewer bytes (a replaced
    /// node's re-commit of the checkpoint it restored holds every file, the replicas of its
    /// original part only that part: those are read, where they are), then the first node's.
    fn of(held: &[(String, Vec<ReplicaPart>)]) -> Tags {
        let mut tags = Tags::default();
        for (holder, parts) in held {
            for p in parts {
                if p.archived {
                    let at = tags.archived.entry(p.tag.clone()).or_default();
                    *at = (*at).max(p.committed_at);
                    continue;
                }
                let t = tags.held.entry(p.tag.clone()).or_default();
                t.nodes.extend(p.nodes.iter().cloned());
                match t.parts.get_mut(&p.from) {
                    None => {
                        t.parts
                            .insert(p.from.clone(), (p.clone(), vec![holder.clone()]));
                    }
                    Some((best, holders)) if best == p => holders.push(holder.clone()),
                    Some(slot)
                        if (p.committed_at, Reverse(bytes(p)))
                            > (slot.0.committed_at, Reverse(bytes(&slot.0))) =>
                    {
                        *slot = (p.clone(), vec![holder.clone()]);
                    }
                    Some(_) => {}
                }
            }
        }
        tags
    }

    /// Why `tag` cannot be restored from replicas, if it cannot.
    fn missing(&self, tag: &str) -> Option<String> {
        if self.archived.contains_key(tag) {
            return Some("archived, its replicas freed".into());
        }
        match self.held.get(tag) {
            Some(t) => t.missing(),
            None => Some("no node holds any part of it".into()),
        }
    }

    fn complete(&self, tag: &str) -> bool {
        self.missing(tag).is_none()
    }

    /// The complete tag committed last, unless a node knows a checkpoint committed after it
    /// archived (the archive's `latest` is then newer than anything the replicas give).
    fn latest(&self) -> Option<String> {
        let (tag, t) = self
            .held
            .iter()
            .filter(|(tag, _)| self.complete(tag))
            .max_by_key(|(tag, t)| (t.committed_at(), (*tag).clone()))?;
        let newer_archived = self.archived.values().any(|at| *at >= t.committed_at());
        (!newer_archived).then(|| tag.clone())
    }

    /// Why `which` is not restored from replicas, for the job's output.
    fn why_not(&self, which: &Restore) -> String {
        let one = |tag: &str| format!("{tag}: {}", self.missing(tag).unwrap_or_default());
        match which {
            Restore::Tag(tag) | Restore::Forced(tag) => one(tag),
            Restore::Latest => {
                let mut why: Vec<String> = self
                    .held
                    .keys()
                    .filter(|tag| !self.complete(tag))
                    .map(|tag| one(tag))
                    .collect();
                if let Some((tag, _)) = self.archived.iter().max_by_key(|(tag, at)| (**at, *tag)) {
                    why.push(format!("{tag}, committed as late or later, is archived"));
                }
                why.join("; ")
            }
        }
    }
}

/// Makes `$SLUICE_CKPT_DIR/TAG/file` the sealed file: `Ok(None)` when it is that already, else
/// fetched from the first of `holders` that gives it whole (`Ok(Some(holder))`). A fetch is
/// written beside the file (`.NAME.sluice-replica`, the job user's) and renamed over it only once
/// it hashed to the sealed BLAKE3: a copy that no holder gives leaves the file as it was.
#[allow(clippy::too_many_arguments)]
async fn fetch_file(
    ctx: &CkptCtx,
    key: &JobKey,
    file: &ReplicaFile,
    holders: &[Source<'_>],
    me: &str,
    ckpt_dir: &Arc<OwnedFd>,
    owner: Owner,
) -> Result<Option<String>, String> {
    let peers = ctx.peers.get().expect("asked only with peers");
    let tag = &holders
        .first()
        .expect("a file comes with its holders")
        .1
        .tag;
    let rel = format!("{tag}/{}", file.path);
    let want = blake3::Hash::from_hex(&file.blake3).map_err(|e| format!("{rel}: {e}"))?;
    let (d, r, size) = (ckpt_dir.clone(), rel.clone(), file.size);
    let here = blocking(move || {
        let f = open_staged(&d, &r, owner).ok()?;
        (f.metadata().ok()?.len() == size).then_some(())?;
        let mut h = blake3::Hasher::new();
        h.update_reader(&f).ok()?;
        Some(h.finalize())
    })
    .await;
    if here == Some(want) {
        return Ok(None);
    }
    let (d, r) = (ckpt_dir.clone(), rel.clone());
    let (dir, name) = blocking(move || {
        let parts: Vec<&str> = r.split('/').collect();
        let (name, dirs) = parts.split_last().expect("split yields one part");
        let dir = safefs::ensure_dirs(&d, dirs, Some(owner))?;
        Ok::<_, safefs::SafeFsError>((Arc::new(dir), name.to_string()))
    })
    .await
    .map_err(|e| format!("creating $SLUICE_CKPT_DIR/{rel}: {e}"))?;
    let tmp = format!(".{name}.sluice-replica");
    let mut tried = Vec::new();
    for (node, part) in holders {
        let (d, t) = (dir.clone(), tmp.clone());
        let created = blocking(move || {
            safefs::remove_tree(&*d, &t, owner.into())?.all_gone(&t)?;
            safefs::create_file(&*d, &t, Some(owner), 0o644)
        })
        .await
        .map_err(|e| format!("creating $SLUICE_CKPT_DIR/{rel}: {e}"))?;
        let mut sink = HashingSink::direct(Arc::new(created), 0, ());
        let fetched = peers
            .client()
            .fetch_replica_into(&peers.addr_of(node), key, part, file, &mut sink)
            .await;
        match fetched {
            Ok(_) => {
                let (d, t, n) = (dir.clone(), tmp.clone(), name.clone());
                blocking(move || nix::fcntl::renameat(&*d, t.as_str(), &*d, n.as_str()))
                    .await
                    .map_err(|e| format!("renaming its copy to $SLUICE_CKPT_DIR/{rel}: {e}"))?;
                return Ok(Some(node.to_string()));
            }
            Err(e) => {
                let at = if *node == me {
                    "this node"
                } else {
                    node.as_str()
                };
                tried.push(format!(
                    "{at} ({}'s part): {}",
                    part.from,
                    sluice_stage::error_chain(&e)
                ));
            }
        }
    }
    let (d, t) = (dir.clone(), tmp.clone());
    let _ = blocking(move || safefs::remove_tree(&*d, &t, owner.into())).await;
    Err(format!("{rel}: no holder gave it ({})", tried.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(from: &str, tag: &str, files: &[(&str, &[u8])], at: u64) -> ReplicaPart {
        ReplicaPart {
            from: from.into(),
            tag: tag.into(),
            files: files
                .iter()
                .map(|(p, b)| ReplicaFile {
                    path: p.to_string(),
                    size: b.len() as u64,
                    blake3: blake3::hash(b).to_hex().to_string(),
                })
                .collect(),
            nodes: vec!["n1".into(), "n2".into(), "n3".into()],
            committed_at: at,
            archived: false,
        }
    }

    fn held(rows: &[(&str, Vec<ReplicaPart>)]) -> Tags {
        let rows: Vec<(String, Vec<ReplicaPart>)> = rows
            .iter()
            .map(|(n, p)| (n.to_string(), p.clone()))
            .collect();
        Tags::of(&rows)
    }

    #[test]
    fn a_tag_is_complete_only_when_every_nodes_part_is_held_somewhere() {
        // n2 was lost: its own copies are gone, n3 holds its part of s1 but not of s2.
        let tags = held(&[
            (
                "n1",
                vec![
                    part("n1", "s1", &[("a", b"1")], 100),
                    part("n1", "s2", &[("a", b"1b")], 200),
                    part("n3", "s1", &[("c", b"3")], 100),
                    part("n3", "s2", &[("c", b"3b")], 200),
                ],
            ),
            (
                "n3",
                vec![
                    part("n3", "s1", &[("c", b"3")], 100),
                    part("n3", "s2", &[("c", b"3b")], 200),
                    part("n2", "s1", &[("b", b"2")], 100),
                    part("n1", "s2", &[("a", b"1b")], 200),
                ],
            ),
        ]);
        assert!(tags.complete("s1"));
        assert!(!tags.complete("s2"), "{tags:?}");
        // s2 is newer, but n2's part of it is nowhere: latest is s1.
        assert_eq!(tags.latest().as_deref(), Some("s1"));
        let why = tags.why_not(&Restore::Tag("s2".into()));
        assert!(why.contains("no node holds the part of n2"), "{why}");
        assert_eq!(tags.held["s1"].parts["n3"].1, ["n1", "n3"]);
        assert_eq!(held(&[]).latest(), None);
    }

    #[test]
    fn parts_that_give_one_path_two_contents_are_not_a_checkpoint() {
        let tags = held(&[(
            "n1",
            vec![
                part("n1", "s1", &[("same", b"x")], 100),
                part("n2", "s1", &[("same", b"y")], 100),
                part("n3", "s1", &[], 100),
            ],
        )]);
        assert!(!tags.complete("s1"));
        assert!(tags.why_not(&Restore::Latest).contains("differ in same"));
        // The same content from two nodes is one checkpoint (as the archive's merge takes it).
        let tags = held(&[(
            "n1",
            vec![
                part("n1", "s1", &[("same", b"x")], 100),
                part("n2", "s1", &[("same", b"x")], 100),
                part("n3", "s1", &[], 100),
            ],
        )]);
        assert!(tags.complete("s1"));
    }

    #[test]
    fn an_older_seal_of_a_part_is_not_used_beside_a_newer_one() {
        let tags = held(&[
            ("n1", vec![part("n2", "s1", &[("b", b"old")], 100)]),
            ("n3", vec![part("n2", "s1", &[("b", b"new")], 150)]),
        ]);
        let (best, holders) = &tags.held["s1"].parts["n2"];
        assert_eq!(
            (best.committed_at, holders.as_slice()),
            (150, &["n3".to_string()][..])
        );
    }

    #[test]
    fn of_two_seals_of_one_commit_the_smaller_part_is_used() {
        // n2 was replaced and restored s1 before n3 asked: it re-committed s1 as of its part's
        // commit, as a part of its own holding every file. n3 reads n2's part from the replica
        // n1 holds, not the new n2's whole copy, whichever index it reads first.
        let whole = &[("a", &b"1"[..]), ("b", &b"2"[..])];
        let replica = (
            "n1",
            vec![
                part("n1", "s1", &[("a", b"1")], 100),
                part("n2", "s1", &[("b", b"2")], 100),
                part("n3", "s1", &[], 100),
            ],
        );
        let recommit = ("n2", vec![part("n2", "s1", whole, 100)]);
        for rows in [
            [replica.clone(), recommit.clone()],
            [recommit.clone(), replica.clone()],
        ] {
            let tags = held(&rows);
            let (best, holders) = &tags.held["s1"].parts["n2"];
            assert_eq!(
                (best.files.len(), holders.as_slice()),
                (1, &["n1".to_string()][..])
            );
            assert!(tags.complete("s1"));
        }
    }

    #[test]
    fn latest_is_not_taken_from_replicas_when_a_newer_checkpoint_is_archived() {
        // s1 is stuck unarchived but whole in replicas; s2, committed later, is archived.
        let archived = |tag: &str, at: u64| ReplicaPart {
            archived: true,
            ..part("n1", tag, &[], at)
        };
        let tags = held(&[(
            "n1",
            vec![
                part("n1", "s1", &[("a", b"1")], 100),
                part("n2", "s1", &[("b", b"2")], 100),
                part("n3", "s1", &[], 100),
                archived("s2", 200),
            ],
        )]);
        assert!(tags.complete("s1"));
        assert_eq!(tags.latest(), None);
        let why = tags.why_not(&Restore::Latest);
        assert!(
            why.contains("s2, committed as late or later, is archived"),
            "{why}"
        );
        // Named, s1 is still restored from replicas; s2 is the archive's.
        assert!(!tags.complete("s2"));
        assert!(
            tags.why_not(&Restore::Tag("s2".into()))
                .contains("archived")
        );
        // An archived older one does not stand in the way.
        let tags = held(&[(
            "n1",
            vec![
                archived("s0", 50),
                part("n1", "s1", &[("a", b"1")], 100),
                part("n2", "s1", &[("b", b"2")], 100),
                part("n3", "s1", &[], 100),
            ],
        )]);
        assert_eq!(tags.latest().as_deref(), Some("s1"));
    }
}
