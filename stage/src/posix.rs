//! Stage-in from POSIX sources (Lustre, NFS, GPFS, local paths): the agent's side of
//! `sluiced copy-as-user` — it starts the helper as the job user, turns the helper's messages
//! ([`super::copy_as_user::protocol`]) into [`Progress`], and its exit ([`Failure`]) and last
//! error line into the [`StageError`] the job shows.
//!
//! Shared with the job's other nodes (`--stage-mode=replicate` with `[peer]`, [`Sharing::Peers`]),
//! a POSIX dataset is read from its origin once per job, like an object-store one: every node's
//! helper makes the whole tree as the job user (every directory, link and file, each source file
//! opened for reading first) and copies the `peer.unit_size` units of it that this node owns,
//! hashing each; the agent offers those units to the job's other nodes as the helper reports them,
//! and fetches every other unit from its owner into the file the helper made (through the node's
//! [`Budget`] buffers, into a regular one-link file of the job user, opened without following
//! links), then gives it the source's mode. A unit whose owner is routed around and falls to this
//! node is copied by a second helper run, as the job user again ([`replicate`]).
//!
//! So the user's own read permission still gates every byte: a node fetches only units of files
//! its own helper listed and opened as the user, every unit a peer serves was read from the origin
//! by that job's helper, as the same user, on the node that owns it, and a user who makes their
//! helper lie (it runs as them) can change only their own job's copies.
//!
//! On the node's hot tier, a dataset the helper copies whole (alone on a node without a cache, or
//! a shard) can be resumed by a restarted agent ([`resumable_copy`], [`super::resume`]): the
//! helper reports each file it copied whole with its source's identity, the agent notes it in the
//! job's staging log with the staged file's identity, and after a restart the files whose staged
//! copy and source are both unchanged are kept.
//!
//! With `[cache]`, a dataset this node stages whole goes through the node's cache ([`copy_cached`]):
//! entries of POSIX files are keyed by path, device, inode, size, mtime, ctime and the job user's
//! uid, and the job user's helper opens every file and reports its `fstat` identity on every job,
//! so a hit is placed only for a file that user can read now and that is the version the entry
//! holds (a rewrite whose mtime was set back still changed its ctime). A
//! replicate shared with peers goes through each node's own cache the same way (`--peer-cached`):
//! the agent writes a hit whole from the cache and serves its units from that copy, and keeps a
//! miss once every unit is in, each checked against the hash of what was read from the source (by
//! this node's helper, or by the unit's owner). Shard stages read their source as without a cache.

use super::copy_as_user::protocol::{AgentMsg, Failure, HelperMsg};
use super::copy_as_user::{Event, FileIdent, copies_unit, peer_unit_file, piece_hashes_hash};
use super::peers::{NextStep, open_staged_for_write};
use super::resume::{self, DatasetLog};
use super::sink::{HashingSink, PeerUnit};
use super::{
    Budget, JobPeers, Progress, ShardPlan, Sharing, StageCtx, StageError, hot_tier_error,
    is_no_space,
};
use crate::cache::{Cache, Hit, Key, PosixFile};
use sluice_core::rt::blocking;
use sluice_core::safefs::{self, Owner};
use sluice_peer::{Unit, units_of};
use sluice_proto::msg::StageState;
use sluice_proto::options::StageSpec;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

/// Copies a POSIX source with the job user's identity, through `sluiced copy-as-user`; with a
/// shard, only this node's share of its files, and the manifest; shared with the job's peers,
/// this node's units of it, and the rest from its peers.
pub(super) async fn stage(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Arc<Progress>,
    sharing: Sharing<'_>,
) -> Result<(), StageError> {
    match sharing {
        Sharing::Peers(peers) => replicate(ctx, spec, path, progress, peers).await,
        Sharing::Shard(plan) => copy(ctx, spec, path, progress, Some(plan)).await,
        Sharing::Alone => match &ctx.cache {
            Some(cache) => copy_cached(ctx, spec, path, progress, cache).await,
            None => copy(ctx, spec, path, progress, None).await,
        },
    }
}

/// The whole dataset, or with `shard` this node's share of it, all of it read by the helper. On
/// the node's hot tier, a copy a restarted agent resumes ([`resumable_copy`]).
async fn copy(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Progress,
    shard: Option<&ShardPlan>,
) -> Result<(), StageError> {
    let mut args: Vec<OsString> = Vec::new();
    if let Some(plan) = shard {
        args.extend(shard_args(plan, spec));
        if let Some(layout) = &ctx.shared_tier {
            args.push("--shared-tier".into());
            args.extend(layout.helper_args().into_iter().map(OsString::from));
        }
    }
    let resume = ctx.resume.clone().filter(|_| ctx.shared_tier.is_none());
    if let Some(resume) = resume {
        let spec_owned = spec.clone();
        if let Some(log) = blocking(move || resume.dataset(&spec_owned)).await {
            let log = Arc::new(log);
            log.tick();
            return resumable_copy(ctx, spec, path, progress, args, &log).await;
        }
    }
    let mut helper = HelperCmd::new(ctx, spec, path).start(args, false)?;
    while let Some(line) = helper.line().await {
        match HelperMsg::decode(&line).ok().and_then(|m| m.event()) {
            Some(total @ Event::Total { .. }) => copying(progress, total),
            Some(event) => progress.apply(event),
            None => {}
        }
    }
    helper.finish().await
}

/// [`copy`] through the dataset's staging log ([`super::resume`]): the helper (`--resume`,
/// [`super::copy_as_user::copy_tree_resumable`]) is offered the files the log names whose staged
/// copy is still the file noted — the agent checks that as root, without following links — and
/// keeps those whose source it finds, as the job user, still at the version noted; it copies the
/// rest, and each file it reports copied whole is noted with the identity of the staged file as
/// the agent finds it then.
async fn resumable_copy(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Progress,
    mut args: Vec<OsString>,
    log: &Arc<DatasetLog>,
) -> Result<(), StageError> {
    args.push("--resume".into());
    let mut helper = HelperCmd::new(ctx, spec, path).start(args, true)?;
    let (stage, owner, name) = (ctx.stage_fd.clone(), ctx.owner, spec.name.clone());
    let earlier = log.leftovers();
    let offers: String = blocking(move || {
        earlier
            .into_iter()
            .filter_map(|e| {
                let source = e.posix_source()?;
                let rel = below_dataset(&name, e.path())?;
                resume::resumable(&stage, e.path(), owner, &e)?;
                let offer = AgentMsg::Keep {
                    file: source,
                    path: rel.to_string(),
                };
                Some(offer.encode())
            })
            .collect()
    })
    .await;
    let mut stdin = helper.stdin.take().expect("stdin is piped");
    // The helper reads every offer before it writes a line; if it went away, its exit says why.
    let _ = stdin.write_all(offers.as_bytes()).await;
    drop(stdin);
    let (mut kept_files, mut kept_bytes) = (0, 0);
    while let Some(line) = helper.line().await {
        let Ok(msg) = HelperMsg::decode(&line) else {
            continue;
        };
        if let Some(event) = msg.event() {
            match event {
                Event::Total { .. } => copying(progress, event),
                Event::Progress { files, bytes } => {
                    progress.apply(Event::Progress {
                        files: files + kept_files,
                        bytes: bytes + kept_bytes,
                    });
                    progress.origin_bytes.store(bytes, Ordering::Relaxed);
                }
            }
            continue;
        }
        match msg {
            HelperMsg::Kept { files, bytes } => {
                (kept_files, kept_bytes) = (files, bytes);
                progress.resumed_bytes.store(bytes, Ordering::Relaxed);
                progress.files_done.store(files, Ordering::Relaxed);
                progress.bytes_done.store(bytes, Ordering::Relaxed);
            }
            HelperMsg::Whole { file, path: rel } => {
                let staged = peer_unit_file(&spec.name, &rel);
                let (stage, owner) = (ctx.stage_fd.clone(), ctx.owner);
                let s = staged.clone();
                let id = blocking(move || {
                    let f = super::peers::open_staged(&stage, &s, owner).ok()?;
                    resume::Identity::of(&f).ok()
                })
                .await;
                if let Some(id) = id.filter(|id| id.size == file.size) {
                    log.done(resume::Entry::posix(staged, file, id)).await;
                }
            }
            _ => {}
        }
    }
    log.finish().await;
    helper.finish().await
}

/// Takes in the helper's `total` (what it copies): the dataset is copying now.
fn copying(progress: &Progress, total: Event) {
    progress.apply(total);
    progress.set_state(StageState::Copying);
}

/// The path below the dataset `name` of `path` below the stage directory (`""` for the dataset
/// itself, a dataset that is one file).
fn below_dataset<'a>(name: &str, path: &'a str) -> Option<&'a str> {
    match path.strip_prefix(name)? {
        "" => Some(""),
        rest => rest.strip_prefix('/'),
    }
}

// ------------------------------------------------------------------------ through the node's cache

/// A file the helper identified (`ident`): its key, where it lands and its mode.
struct Identified {
    key: Key,
    /// Below the dataset's directory, or the dataset's own name below the stage directory for a
    /// dataset that is one file.
    rel: String,
    mode: u32,
    one_file: bool,
}

/// The whole dataset on a node with a cache, which keeps POSIX files per user: the helper
/// (`--cached`, [`super::copy_as_user::copy_tree_cached`]) opens every file as the job user and
/// reports what `fstat` on that descriptor says; each file whose (path, device, inode, size,
/// mtime, ctime) this user's entry holds is a hit, and the helper only makes it, for the agent to write
/// from the cache. A user who cannot open a file fails here as without a cache, before any hit
/// is placed. Every other file the helper copies and hashes; when its identity held through the
/// copy, the agent keeps the staged copy in a new entry if it hashes to what the helper read.
async fn copy_cached(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Arc<Progress>,
    cache: &Arc<Cache>,
) -> Result<(), StageError> {
    let cmd = HelperCmd::new(ctx, spec, path);
    let mut helper = cmd.start(vec!["--cached".into()], true)?;
    // Keys name files by the path the job gave, below which the helper reports each one.
    let mut idents: HashMap<usize, Arc<Identified>> = HashMap::new();
    let mut hits: HashMap<usize, Hit> = HashMap::new();
    let mut answered = false;
    let mut dataset_dir: Option<Arc<OwnedFd>> = None;
    let mut tasks: JoinSet<Result<(), StageError>> = JoinSet::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(
        ctx.cfg.stage.concurrency.max(1),
    ));
    let (mut helper_files, mut helper_bytes) = (0u64, 0u64);
    let garbage = |line: &str| helper_garbage(&cmd.source, line);
    loop {
        tokio::select! {
            line = helper.line() => {
                let Some(line) = line else { break };
                let msg = HelperMsg::decode(&line);
                if let Some(event) = msg.as_ref().ok().and_then(HelperMsg::event) {
                    match event {
                        total @ Event::Total { .. } => copying(progress, total),
                        // The helper's own counts; what the cache placed is added by its tasks.
                        Event::Progress { files, bytes } => {
                            let (df, db) = (files.saturating_sub(helper_files), bytes.saturating_sub(helper_bytes));
                            (helper_files, helper_bytes) = (helper_files.max(files), helper_bytes.max(bytes));
                            progress.files_done.fetch_add(df, Ordering::Relaxed);
                            progress.bytes_done.fetch_add(db, Ordering::Relaxed);
                            progress.origin_bytes.fetch_add(db, Ordering::Relaxed);
                        }
                    }
                    continue;
                }
                match msg {
                    Ok(HelperMsg::Ident { idx, file, mode, path: rel }) if !answered && idx == idents.len() => {
                        let Some(key_path) = source_path(path, &rel) else {
                            return Err(garbage(&line));
                        };
                        let one_file = rel.is_empty();
                        let rel = if one_file { spec.name.clone() } else { rel };
                        let key = posix_key(&key_path, file, ctx.owner.uid);
                        idents.insert(idx, Arc::new(Identified { key, rel, mode, one_file }));
                    }
                    Ok(HelperMsg::Idents { count }) if !answered && count == idents.len() => {
                        answered = true;
                        let keys = idents.iter().map(|(i, f)| (*i, f.key.clone())).collect();
                        let stdin = helper.stdin.take().expect("stdin is piped");
                        hits = answer_idents(cache.clone(), keys, stdin).await;
                    }
                    Ok(HelperMsg::Cached { idx }) if answered => {
                        let (Some(hit), Some(file)) = (hits.remove(&idx), idents.get(&idx).cloned()) else {
                            return Err(garbage(&line));
                        };
                        let root = cached_root(ctx, spec, &file, &mut dataset_dir).await?;
                        let (progress, slots, owner) = (progress.clone(), slots.clone(), ctx.owner);
                        let (node, source) = (cmd.node.clone(), cmd.source.clone());
                        tasks.spawn(async move {
                            let _slot = slots.acquire_owned().await;
                            let f = file.clone();
                            blocking(move || {
                                let dst = open_staged_for_write(&root, &f.rel, owner)?;
                                hit.copy_to(&dst, None)?;
                                dst.set_permissions(std::fs::Permissions::from_mode(f.mode))
                            })
                            .await
                            .map_err(|e| hot_error(&node, &source, &file.rel, e))?;
                            progress.file_from_cache(file.key.size);
                            Ok(())
                        });
                    }
                    Ok(HelperMsg::Copied { idx, piece, hash }) if answered && piece >= 4096 => {
                        let Some(file) = idents.get(&idx).cloned() else {
                            return Err(garbage(&line));
                        };
                        let root = cached_root(ctx, spec, &file, &mut dataset_dir).await?;
                        let (cache, slots, owner) = (cache.clone(), slots.clone(), ctx.owner);
                        tasks.spawn(async move {
                            let _slot = slots.acquire_owned().await;
                            blocking(move || keep(&cache, &root, &file, owner, piece, hash)).await;
                            Ok(())
                        });
                    }
                    _ => return Err(garbage(&line)),
                }
            }
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                done.expect("a staging task panicked")?;
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a staging task panicked")?;
    }
    // Hits the helper never made (it failed first) are given back here, unused.
    drop(hits);
    helper.finish().await
}

/// The path of the file the helper identified at `rel` below the dataset (`""`: the dataset is that
/// file) below the source `path` as the job gave it, which cache keys name files by; `None` for a
/// `rel` that is not a plain relative path (the helper runs as the user, who may make it say so).
fn source_path(path: &str, rel: &str) -> Option<String> {
    if rel.is_empty() {
        return Some(path.to_string());
    }
    if !rel
        .split('/')
        .all(|c| !c.is_empty() && c != "." && c != "..")
    {
        return None;
    }
    Some(match path.trim_end_matches('/') {
        "" => format!("/{rel}"),
        dir => format!("{dir}/{rel}"),
    })
}

/// The key of a POSIX file as the helper identified it, for `uid` alone.
fn posix_key(path: &str, file: FileIdent, uid: u32) -> Key {
    let id = PosixFile {
        uid,
        dev: file.dev,
        ino: file.ino,
        mtime: file.mtime,
        mtime_ns: file.mtime_ns,
        ctime: file.ctime,
        ctime_ns: file.ctime_ns,
    };
    Key::posix(path, file.size, id)
}

/// The directory `file.rel` is below: the dataset's (opened once), or the stage directory.
async fn cached_root(
    ctx: &StageCtx,
    spec: &StageSpec,
    file: &Identified,
    dataset_dir: &mut Option<Arc<OwnedFd>>,
) -> Result<Arc<OwnedFd>, StageError> {
    if file.one_file {
        return Ok(ctx.stage_fd.clone());
    }
    if let Some(d) = dataset_dir {
        return Ok(d.clone());
    }
    let (fd, name) = (ctx.stage_fd.clone(), spec.name.clone());
    let d = blocking(move || safefs::open_dir(&fd, &name))
        .await
        .map(Arc::new)
        .map_err(|e| {
            let errno = e.errno().map(|e| e as i32);
            hot_tier_error(
                &ctx.cfg.node,
                &spec.source.to_string(),
                &spec.name,
                errno,
                e.to_string(),
            )
        })?;
    *dataset_dir = Some(d.clone());
    Ok(d)
}

/// Keeps the staged copy of `file` (below `root`) in a new entry of the cache, if it still is the
/// job user's one-link regular file of the key's size and hashes, in `piece`-byte pieces, to what
/// the helper read from the source; otherwise, or without room, it is not cached. Blocking.
fn keep(
    cache: &Arc<Cache>,
    root: &OwnedFd,
    file: &Identified,
    owner: Owner,
    piece: u64,
    want: blake3::Hash,
) {
    let same = |pieces: &[blake3::Hash]| piece_hashes_hash(pieces) == want;
    keep_checked(cache, root, &file.key, &file.rel, owner, piece, same);
}

/// [`keep`], the staged copy at `rel` below `root` kept under `key` if the hashes of its
/// `piece`-byte pieces pass `check`. Blocking.
fn keep_checked(
    cache: &Arc<Cache>,
    root: &OwnedFd,
    key: &Key,
    rel: &str,
    owner: Owner,
    piece: u64,
    check: impl FnOnce(&[blake3::Hash]) -> bool,
) {
    let fill = match cache.begin_fill(key.clone()) {
        Ok(f) => f,
        Err(why) => {
            tracing::info!("cache: {} is not cached: {why}", key.url);
            return;
        }
    };
    let copied = (|| -> std::io::Result<Vec<blake3::Hash>> {
        let staged = super::peers::open_staged(root, rel, owner)?;
        let size = key.size;
        if staged.metadata()?.len() != size {
            return Err(std::io::Error::other("its size changed"));
        }
        let mut buf = vec![0u8; 4 << 20];
        let (mut at, mut pieces) = (0u64, Vec::new());
        while at < size {
            let end = (at + piece).min(size);
            let mut h = blake3::Hasher::new();
            while at < end {
                let n = ((end - at) as usize).min(buf.len());
                staged.read_exact_at(&mut buf[..n], at)?;
                h.update(&buf[..n]);
                fill.write_at(&buf[..n], at);
                at += n as u64;
            }
            pieces.push(h.finalize());
        }
        Ok(pieces)
    })();
    match copied {
        Ok(pieces) if check(&pieces) => {
            fill.commit();
        }
        Ok(_) => fill.taint("the staged copy is not what was read from the source"),
        Err(e) => fill.taint(&format!("reading the staged copy: {e}")),
    }
}

fn hot_error(node: &str, source: &str, path: &str, e: std::io::Error) -> StageError {
    hot_tier_error(node, source, path, e.raw_os_error(), e.to_string())
}

/// The helper's `--shard-nodes --shard-node --dataset --source` (and a takeover's
/// `--takeover-of --takeover-nodes`).
fn shard_args(plan: &ShardPlan, spec: &StageSpec) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "--shard-nodes",
        &plan.nodes_arg(),
        "--shard-node",
        plan.node(),
        "--dataset",
        &spec.name,
        "--source",
        &spec.source.to_string(),
    ]
    .map(OsString::from)
    .into();
    if let Some((lost, all)) = plan.taken_over() {
        args.extend(
            ["--takeover-of", lost, "--takeover-nodes", &all.join(",")].map(OsString::from),
        );
    }
    args
}

/// How to start `copy-as-user` for one dataset of a job.
#[derive(Clone)]
struct HelperCmd {
    exe: PathBuf,
    owner: Owner,
    user: String,
    src: String,
    dst: PathBuf,
    /// The source as the job gave it, and this node, for errors.
    source: String,
    node: String,
}

impl HelperCmd {
    fn new(ctx: &StageCtx, spec: &StageSpec, path: &str) -> HelperCmd {
        HelperCmd {
            exe: ctx.helper_exe.clone(),
            owner: ctx.owner,
            user: ctx.user.clone(),
            src: path.to_string(),
            dst: ctx.stage_path.join(&spec.name),
            source: spec.source.to_string(),
            node: ctx.cfg.node.clone(),
        }
    }

    /// Starts the helper with `args` besides the identity and the paths; with `stdin`, piped.
    fn start(&self, args: Vec<OsString>, stdin: bool) -> Result<Helper, StageError> {
        let mut child = tokio::process::Command::new(&self.exe)
            .arg("copy-as-user")
            .args(args)
            .arg("--uid")
            .arg(self.owner.uid.to_string())
            .arg("--gid")
            .arg(self.owner.gid.to_string())
            .arg("--user")
            .arg(&self.user)
            .arg("--src")
            .arg(&self.src)
            .arg("--dst")
            .arg(&self.dst)
            .env_clear()
            .stdin(if stdin {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| StageError::Origin {
                dataset: self.source.clone(),
                detail: format!("cannot start the copy helper: {e}"),
            })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        Ok(Helper {
            stdin: child.stdin.take(),
            child,
            lines: tokio::io::BufReader::new(stdout).lines(),
            stderr,
            cmd: self.clone(),
        })
    }
}

/// A running `copy-as-user`.
struct Helper {
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    stderr: tokio::process::ChildStderr,
    cmd: HelperCmd,
}

impl Helper {
    /// The helper's next line on stdout; `None` once it closed it. Cancel-safe.
    async fn line(&mut self) -> Option<String> {
        self.lines.next_line().await.ok().flatten()
    }

    /// Waits for the helper's exit: its failure as the job will show it.
    async fn finish(mut self) -> Result<(), StageError> {
        drop(self.stdin.take());
        let mut err_text = String::new();
        let _ = (&mut self.stderr)
            .take(64 * 1024)
            .read_to_string(&mut err_text)
            .await;
        let status = self.child.wait().await.map_err(|e| StageError::Origin {
            dataset: self.cmd.source.clone(),
            detail: e.to_string(),
        })?;
        if status.success() {
            return Ok(());
        }
        Err(classify(
            &self.cmd.source,
            &self.cmd.node,
            Failure::from_exit(status.code()),
            Failure::message(&err_text).to_string(),
        ))
    }
}

/// Turns the helper's exit into the error the job will show.
fn classify(source: &str, node: &str, failure: Failure, message: String) -> StageError {
    match failure {
        Failure::NotFound => StageError::NotFound {
            dataset: source.to_string(),
        },
        Failure::Denied => StageError::Denied {
            dataset: source.to_string(),
            detail: message,
        },
        Failure::NoSpace => StageError::NoSpace {
            node: node.to_string(),
            dataset: source.to_string(),
        },
        Failure::Other => StageError::Origin {
            dataset: source.to_string(),
            detail: message,
        },
    }
}

// ------------------------------------------------------------------- replicate through peers

/// What the tasks of one shared POSIX dataset share.
struct Shared {
    peers: Arc<JobPeers>,
    budget: Arc<Budget>,
    progress: Arc<Progress>,
    owner: Owner,
    helper: HelperCmd,
    /// The node's cache, for the files its helper identified.
    cache: Option<Arc<Cache>>,
    /// Cache copies and fills at once, at most.
    slots: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    fn hot_error(&self, path: &str, errno: Option<i32>, detail: String) -> StageError {
        hot_tier_error(&self.helper.node, &self.helper.source, path, errno, detail)
    }

    /// Counts `n` bytes written as staged, and from the origin or a peer.
    fn count(&self, n: u64, from_peer: bool) {
        let p = &self.progress;
        p.bytes_done.fetch_add(n, Ordering::Relaxed);
        let from = if from_peer {
            &p.peer_bytes
        } else {
            &p.origin_bytes
        };
        from.fetch_add(n, Ordering::Relaxed);
    }

    fn uncount(&self, n: u64) {
        let p = &self.progress;
        p.bytes_done.fetch_sub(n, Ordering::Relaxed);
        p.peer_bytes.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A file of the dataset, as the helper listed it.
struct ListedFile {
    /// The directory `rel` is below: the dataset's, or the stage directory for a dataset that is
    /// one file.
    root: Arc<OwnedFd>,
    rel: String,
    /// Below the dataset, as the helper names it (`""` for a dataset that is one file).
    path: String,
    unit_file: String,
    size: u64,
    mode: u32,
    /// Units not in yet, when the agent writes some of them (`None`: the helper copies it all).
    left: Option<usize>,
    /// Written whole from this node's cache (its helper only made it).
    hit: bool,
    /// A miss this node's cache may keep, once every unit is in.
    fill: Option<ToKeep>,
}

/// An identified file that missed this node's cache: its key (this node's identity of it) and
/// each unit's hash as it came in, from this node's helper or checked against its owner's.
struct ToKeep {
    key: Key,
    hashes: Vec<Option<blake3::Hash>>,
    missing: usize,
}

impl ListedFile {
    /// Notes the hash of the unit at `offset`; once every unit is in, what to keep.
    fn unit_hash(&mut self, unit_size: u64, offset: u64, hash: blake3::Hash) -> Option<ToKeep> {
        let fill = self.fill.as_mut()?;
        let slot = fill.hashes.get_mut((offset / unit_size) as usize)?;
        if slot.replace(hash).is_none() {
            fill.missing -= 1;
        }
        if fill.missing == 0 {
            return self.fill.take();
        }
        None
    }
}

/// What a task of the dataset did.
enum Done {
    /// A unit of file `idx` fetched from a peer and checked against its owner's hash.
    Fetched {
        idx: usize,
        unit: Unit,
        hash: blake3::Hash,
    },
    /// No peer can give this unit: this node copies it from the origin.
    ToOrigin { idx: usize, unit: Unit },
    /// A repair run copied these units (of these files) from the origin.
    Repaired(Vec<usize>),
    /// File `idx` is written whole from this node's cache.
    Cached { idx: usize },
    /// A file is complete, with its mode.
    Finished,
}

/// Units at most in one repair run, and the bytes it aims at.
const REPAIR_UNITS: usize = 256;
const REPAIR_UNIT_SHARE: u64 = 8;

/// `--stage-mode=replicate` of a POSIX dataset shared with the job's peers; see the module header.
/// One loop reads the helper's lines (never blocked by fetches: a peer may be waiting for this
/// node's units, and the helper's pipe must not fill), registers each file's units with the job's
/// peers, marks this node's as held when the helper reports them, and runs the fetches of the
/// other units, at most `4 × stage.concurrency` at once, each waiting for its owner without a
/// budget buffer. Units no peer can give are copied by repair runs of the helper, one at a time.
async fn replicate(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Arc<Progress>,
    peers: &Arc<JobPeers>,
) -> Result<(), StageError> {
    let _done = peers.dataset_guard();
    let nodes = peers.alive_nodes();
    let plan = ShardPlan::new(&nodes, peers.node()).expect("a node never routes around itself");
    let unit_size = peers.unit_size();
    let shared = Arc::new(Shared {
        peers: peers.clone(),
        budget: ctx.budget.clone(),
        progress: progress.clone(),
        owner: ctx.owner,
        helper: HelperCmd::new(ctx, spec, path),
        cache: ctx.cache.clone(),
        slots: Arc::new(tokio::sync::Semaphore::new(
            ctx.cfg.stage.concurrency.max(1),
        )),
    });
    let mut args = shard_args(&plan, spec);
    args.extend(["--peer-unit-size".into(), unit_size.to_string().into()]);
    if shared.cache.is_some() {
        args.push("--peer-cached".into());
    }
    let mut helper = Some(shared.helper.start(args, shared.cache.is_some())?);
    // With a cache: the keys of the files the helper identified, the hits among them.
    let mut idents: HashMap<usize, Key> = HashMap::new();
    let mut hits: HashMap<usize, Hit> = HashMap::new();
    let mut answered = shared.cache.is_none();
    let mut last_ident: Option<usize> = None;
    let mut files: Vec<ListedFile> = Vec::new();
    let mut dataset_dir: Option<Arc<OwnedFd>> = None;
    // Units this node fetches, in the order the helper listed their files; units for the origin.
    let mut queue: VecDeque<(usize, Unit)> = VecDeque::new();
    let mut to_origin: VecDeque<(usize, Unit)> = VecDeque::new();
    let mut tasks: JoinSet<Result<Done, StageError>> = JoinSet::new();
    let (mut fetching, mut repairing) = (0usize, false);
    let max_fetches = ctx.cfg.stage.concurrency.max(1) * 4;
    // The helper's own counts so far: files it wrote whole, bytes it copied.
    let (mut whole_files, mut partial_done, mut helper_bytes) = (0u64, 0u64, 0u64);
    loop {
        while fetching < max_fetches {
            let Some((idx, unit)) = queue.pop_front() else {
                break;
            };
            match peers.route(&unit) {
                Some(node) => {
                    let f = &files[idx];
                    let (root, rel) = (f.root.clone(), f.rel.clone());
                    tasks.spawn(fetch_unit(shared.clone(), root, rel, idx, unit, node));
                    fetching += 1;
                }
                None => to_origin.push_back((idx, unit)),
            }
        }
        if !repairing && !to_origin.is_empty() {
            let mut batch = Vec::new();
            let mut bytes = 0;
            while let Some((idx, unit)) = to_origin.pop_front() {
                bytes += unit.len;
                batch.push((idx, unit, files[idx].path.clone()));
                if batch.len() >= REPAIR_UNITS || bytes >= REPAIR_UNIT_SHARE * unit_size {
                    break;
                }
            }
            tasks.spawn(repair(shared.clone(), plan.clone(), spec.clone(), batch));
            repairing = true;
        }
        if helper.is_none() && tasks.is_empty() && queue.is_empty() && to_origin.is_empty() {
            break;
        }
        // Each completed unit of a file the agent writes into; the last one finishes the file.
        let mut unit_in = |files: &mut Vec<ListedFile>, idx: usize, tasks: &mut JoinSet<_>| {
            let f = &mut files[idx];
            let Some(left) = f.left.as_mut() else { return };
            *left -= 1;
            if *left > 0 {
                return;
            }
            partial_done += 1;
            progress
                .files_done
                .store(whole_files + partial_done, Ordering::Relaxed);
            // Made owner-writable for the writes; a mode without that bit comes now.
            if f.mode & 0o200 == 0 {
                let (root, rel, mode, s) = (f.root.clone(), f.rel.clone(), f.mode, shared.clone());
                tasks.spawn(async move {
                    let (r, p, owner) = (rel.clone(), rel.clone(), s.owner);
                    blocking(move || {
                        open_staged_for_write(&root, &r, owner)?
                            .set_permissions(std::fs::Permissions::from_mode(mode))
                    })
                    .await
                    .map_err(|e| s.hot_error(&p, e.raw_os_error(), e.to_string()))?;
                    Ok(Done::Finished)
                });
            }
        };
        tokio::select! {
            line = async { helper.as_mut().expect("read while running").line().await }, if helper.is_some() => {
                let Some(line) = line else {
                    helper.take().expect("running").finish().await?;
                    continue;
                };
                let msg = HelperMsg::decode(&line);
                if let Some(event) = msg.as_ref().ok().and_then(HelperMsg::event) {
                    match event {
                        total @ Event::Total { .. } => copying(progress, total),
                        Event::Progress { files, bytes } => {
                            whole_files = files;
                            progress
                                .files_done
                                .store(whole_files + partial_done, Ordering::Relaxed);
                            shared.count(bytes.saturating_sub(helper_bytes), false);
                            helper_bytes = helper_bytes.max(bytes);
                        }
                    }
                    continue;
                }
                match msg {
                    Ok(HelperMsg::File { idx, size, mode, path }) if idx == files.len() && answered => {
                        let (root, rel, rel_at) = if path.is_empty() {
                            (ctx.stage_fd.clone(), spec.name.clone(), 0)
                        } else {
                            let dir = match &dataset_dir {
                                Some(d) => d.clone(),
                                None => {
                                    let (fd, name) = (ctx.stage_fd.clone(), spec.name.clone());
                                    let d = blocking(move || safefs::open_dir(&fd, &name))
                                        .await
                                        .map(Arc::new)
                                        .map_err(|e| {
                                            let errno = e.errno().map(|e| e as i32);
                                            shared.hot_error(&spec.name, errno, e.to_string())
                                        })?;
                                    dataset_dir = Some(d.clone());
                                    d
                                }
                            };
                            (dir, path.clone(), spec.name.len() + 1)
                        };
                        let unit_file = peer_unit_file(&spec.name, &path);
                        let units = units_of(&unit_file, size, unit_size);
                        let key = idents.remove(&idx);
                        if key.as_ref().is_some_and(|k| k.size != size) {
                            return Err(helper_garbage(&shared.helper.source, &line));
                        }
                        peers.add_object(root.clone(), rel_at, &units);
                        if let Some(hit) = hits.remove(&idx) {
                            // Every unit from this node's cache, none from the origin or a peer.
                            let (r, l) = (root.clone(), rel.clone());
                            tasks.spawn(from_cache(shared.clone(), r, l, idx, hit, units, size));
                            let (left, hit, fill) = (Some(1), true, None);
                            files.push(ListedFile { root, rel, path, unit_file, size, mode, left, hit, fill });
                            continue;
                        }
                        let fill = key.map(|key| ToKeep {
                            key,
                            hashes: vec![None; units.len()],
                            missing: units.len(),
                        });
                        let theirs: Vec<Unit> =
                            units.iter().filter(|u| !copies_unit(&plan, u)).cloned().collect();
                        let left = (!theirs.is_empty()).then_some(units.len());
                        queue.extend(theirs.into_iter().map(|u| (idx, u)));
                        let hit = false;
                        files.push(ListedFile { root, rel, path, unit_file, size, mode, left, hit, fill });
                    }
                    Ok(HelperMsg::Unit { idx, offset, hash }) => {
                        let unit = files.get(idx).and_then(|f| {
                            let u = Unit::new(f.unit_file.clone(), offset, unit_size.min(f.size.saturating_sub(offset)));
                            let at_a_unit = offset % unit_size == 0;
                            (at_a_unit && (offset < f.size || f.size == 0)).then_some(u)
                        });
                        let Some(unit) = unit else {
                            return Err(helper_garbage(&shared.helper.source, &line));
                        };
                        if files[idx].hit {
                            return Err(helper_garbage(&shared.helper.source, &line));
                        }
                        peers.held(&unit, hash);
                        if let Some(k) = files[idx].unit_hash(unit_size, offset, hash) {
                            tasks.spawn(keep_replica(shared.clone(), &files[idx], k));
                        }
                        unit_in(&mut files, idx, &mut tasks);
                    }
                    Ok(HelperMsg::Changed { idx }) if idx < files.len() => {
                        files[idx].fill = None;
                    }
                    Ok(HelperMsg::Ident { idx, file, path: rel, .. })
                        if !answered && files.is_empty() && last_ident.is_none_or(|i| i < idx) =>
                    {
                        let Some(key_path) = source_path(path, &rel) else {
                            return Err(helper_garbage(&shared.helper.source, &line));
                        };
                        idents.insert(idx, posix_key(&key_path, file, ctx.owner.uid));
                        last_ident = Some(idx);
                    }
                    Ok(HelperMsg::Idents { count }) if !answered && count == idents.len() => {
                        answered = true;
                        let cache = shared.cache.clone().expect("asked with a cache");
                        let keys = idents.iter().map(|(i, k)| (*i, k.clone())).collect();
                        let h = helper.as_mut().expect("read while running");
                        let stdin = h.stdin.take().expect("stdin is piped");
                        hits = answer_idents(cache, keys, stdin).await;
                    }
                    _ => return Err(helper_garbage(&shared.helper.source, &line)),
                }
            }
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                match done.expect("a staging task panicked")? {
                    Done::Fetched { idx, unit, hash } => {
                        fetching -= 1;
                        peers.held(&unit, hash);
                        if let Some(k) = files[idx].unit_hash(unit_size, unit.offset, hash) {
                            tasks.spawn(keep_replica(shared.clone(), &files[idx], k));
                        }
                        unit_in(&mut files, idx, &mut tasks);
                    }
                    Done::Cached { idx } => unit_in(&mut files, idx, &mut tasks),
                    Done::ToOrigin { idx, unit } => {
                        fetching -= 1;
                        to_origin.push_back((idx, unit));
                    }
                    Done::Repaired(done) => {
                        repairing = false;
                        for idx in done {
                            // Read by a run that identified nothing: not kept.
                            files[idx].fill = None;
                            unit_in(&mut files, idx, &mut tasks);
                        }
                    }
                    Done::Finished => {}
                }
            }
        }
    }
    if let Some(f) = files.iter().find(|f| f.left.is_some_and(|n| n > 0)) {
        return Err(StageError::Origin {
            dataset: shared.helper.source.clone(),
            detail: format!("'{}' was not staged whole", f.path),
        });
    }
    Ok(())
}

/// Writes file `idx` (`rel` below `root`, `size` bytes) whole from this node's cache, hashing
/// each of its `units` as it copies them: from then on they are this node's to serve to the job's
/// peers, as units its helper copied from the origin would be.
async fn from_cache(
    shared: Arc<Shared>,
    root: Arc<OwnedFd>,
    rel: String,
    idx: usize,
    hit: Hit,
    units: Vec<Unit>,
    size: u64,
) -> Result<Done, StageError> {
    let _slot = shared.slots.clone().acquire_owned().await;
    let (r, owner, unit_size) = (rel.clone(), shared.owner, shared.peers.unit_size());
    let cache = shared.cache.clone();
    let copied = blocking(move || {
        let dst = open_staged_for_write(&root, &r, owner)?;
        let mut done = hit.copy_to(&dst, Some(unit_size));
        // A full hot tier takes room from the cache's other entries, then tries again.
        while done.as_ref().is_err_and(|e| is_no_space(e.raw_os_error()))
            && cache.as_ref().is_some_and(|c| c.yield_space(size) > 0)
        {
            done = dst
                .set_len(0)
                .and_then(|()| hit.copy_to(&dst, Some(unit_size)));
        }
        done
    })
    .await
    .map_err(|e| shared.hot_error(&rel, e.raw_os_error(), e.to_string()))
    .and_then(|hashes| match hashes.len() == units.len() {
        true => Ok(hashes),
        false => Err(StageError::HotTier {
            path: rel.clone(),
            detail: "the node's cache entry is not the size of the file".into(),
        }),
    });
    let hashes = match copied {
        Ok(h) => h,
        Err(e) => {
            for unit in &units {
                shared.peers.failed(unit, e.to_string());
            }
            return Err(e);
        }
    };
    for (unit, hash) in units.iter().zip(hashes) {
        shared.peers.held(unit, hash);
    }
    let p = &shared.progress;
    p.bytes_done.fetch_add(size, Ordering::Relaxed);
    p.cache_bytes.fetch_add(size, Ordering::Relaxed);
    Ok(Done::Cached { idx })
}

/// Keeps a whole, verified miss in this node's cache: the staged copy, if it hashes unit by unit
/// to what came in (see [`keep`]).
fn keep_replica(
    shared: Arc<Shared>,
    file: &ListedFile,
    k: ToKeep,
) -> impl std::future::Future<Output = Result<Done, StageError>> + use<> {
    let (root, rel) = (file.root.clone(), file.rel.clone());
    async move {
        let Some(cache) = shared.cache.clone() else {
            return Ok(Done::Finished);
        };
        let _slot = shared.slots.clone().acquire_owned().await;
        let (owner, unit_size) = (shared.owner, shared.peers.unit_size());
        blocking(move || {
            let want: Vec<blake3::Hash> = k.hashes.into_iter().flatten().collect();
            let same = |pieces: &[blake3::Hash]| pieces == want.as_slice();
            keep_checked(&cache, &root, &k.key, &rel, owner, unit_size, same);
        })
        .await;
        Ok(Done::Finished)
    }
}

/// Answers a helper's identified files (`keys`: each file's number and key): looks each up in
/// `cache` and writes `hit IDX` for every hit on the helper's `stdin`, then closes it. Returns the
/// hits, pinned until they are copied out.
async fn answer_idents(
    cache: Arc<Cache>,
    keys: Vec<(usize, Key)>,
    mut stdin: tokio::process::ChildStdin,
) -> HashMap<usize, Hit> {
    let hits: HashMap<usize, Hit> = blocking(move || {
        keys.into_iter()
            .filter_map(|(i, k)| cache.lookup(&k).map(|h| (i, h)))
            .collect()
    })
    .await;
    let answer: String = hits
        .keys()
        .map(|&idx| AgentMsg::Hit { idx }.encode())
        .collect();
    // The helper reads every answer before it writes again; if it went away, its exit says why.
    let _ = stdin.write_all(answer.as_bytes()).await;
    hits
}

/// A line of the helper that does not belong to the run (the helper runs as the job user, who
/// may have had it print anything): the dataset fails.
fn helper_garbage(source: &str, line: &str) -> StageError {
    StageError::Origin {
        dataset: source.to_string(),
        detail: format!(
            "the copy helper printed {:?}, which is no part of this dataset",
            line.chars().take(200).collect::<String>()
        ),
    }
}

/// Fetches `unit` of file `idx` (`rel` below `root`) from `node` into the file, checked against
/// its owner's hash; on a failure [`JobPeers::next_after`] says where from next, down to the
/// origin ([`Done::ToOrigin`]).
async fn fetch_unit(
    shared: Arc<Shared>,
    root: Arc<OwnedFd>,
    rel: String,
    idx: usize,
    unit: Unit,
    mut node: String,
) -> Result<Done, StageError> {
    let (r, d, owner) = (rel.clone(), root.clone(), shared.owner);
    let file = blocking(move || open_staged_for_write(&d, &r, owner))
        .await
        .map(Arc::new)
        .map_err(|e| shared.hot_error(&rel, e.raw_os_error(), e.to_string()))?;
    let mut retried = None;
    loop {
        let target = PeerUnit {
            progress: &shared.progress,
            node: &shared.helper.node,
            dataset: &shared.helper.source,
            rel: &rel,
        };
        let budget = shared.budget.clone();
        let mut sink = HashingSink::buffered(file.clone(), unit.offset, budget, target);
        let fetched = shared.peers.fetch(&node, &unit, &mut sink).await;
        let (written, hash, sink_error) = sink.close();
        let e = match fetched {
            // POSIX units are never read back (a restarted agent serves object-store datasets
            // only, `resume::serve_staged`), and a POSIX cache entry is the job user's alone.
            Ok(_) => {
                let hash = hash.expect("a finished sink has a hash");
                return Ok(Done::Fetched { idx, unit, hash });
            }
            Err(e) => e,
        };
        shared.uncount(written);
        let dataset = &shared.helper.source;
        match shared
            .peers
            .next_after(&unit, &node, &e, &mut retried, dataset)
        {
            NextStep::From(next) => node = next,
            NextStep::Origin => return Ok(Done::ToOrigin { idx, unit }),
            NextStep::Fail(why) => {
                let e = sink_error.unwrap_or_else(|| StageError::HotTier {
                    path: rel.clone(),
                    detail: why,
                });
                shared.peers.failed(&unit, e.to_string());
                return Err(e);
            }
        }
    }
}

/// Copies `batch` (units of the listed files, with their paths below the dataset) from the origin
/// with a repair run of the helper, as the job user; each unit is offered to the peers as the
/// helper reports it.
async fn repair(
    shared: Arc<Shared>,
    plan: ShardPlan,
    spec: StageSpec,
    batch: Vec<(usize, Unit, String)>,
) -> Result<Done, StageError> {
    let mut args = shard_args(&plan, &spec);
    args.extend([
        "--peer-unit-size".into(),
        shared.peers.unit_size().to_string().into(),
        "--peer-repair".into(),
    ]);
    let mut helper = shared.helper.start(args, true)?;
    let requests: String = batch
        .iter()
        .enumerate()
        .map(|(idx, (_, u, path))| {
            let request = AgentMsg::Repair {
                idx,
                offset: u.offset,
                len: u.len,
                path: path.clone(),
            };
            request.encode()
        })
        .collect();
    let mut stdin = helper.stdin.take().expect("stdin is piped");
    // The helper reads every request before it writes a line; a write it refuses ends in its exit.
    let _ = stdin.write_all(requests.as_bytes()).await;
    drop(stdin);
    let mut done = Vec::with_capacity(batch.len());
    let mut seen = vec![false; batch.len()];
    while let Some(line) = helper.line().await {
        let Ok(HelperMsg::Unit { idx, offset, hash }) = HelperMsg::decode(&line) else {
            continue;
        };
        match batch.get(idx) {
            Some((file, unit, _)) if unit.offset == offset && !seen[idx] => {
                seen[idx] = true;
                shared.count(unit.len, false);
                shared.peers.held(unit, hash);
                done.push(*file);
            }
            _ => return Err(helper_garbage(&shared.helper.source, &line)),
        }
    }
    helper.finish().await?;
    if done.len() != batch.len() {
        return Err(StageError::Origin {
            dataset: shared.helper.source.clone(),
            detail: format!(
                "the copy helper copied {} of the {} pieces asked of it",
                done.len(),
                batch.len()
            ),
        });
    }
    Ok(Done::Repaired(done))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identified_files_are_named_below_the_source_as_the_job_gave_it() {
        assert_eq!(
            source_path("/data/ds/", "a/b").as_deref(),
            Some("/data/ds/a/b")
        );
        assert_eq!(source_path("/", "a").as_deref(), Some("/a"));
        assert_eq!(source_path("/data/f", "").as_deref(), Some("/data/f"));
        for bad in ["../x", "a//b", "./a", "a/..", "/a"] {
            assert_eq!(source_path("/data/ds", bad), None, "{bad}");
        }
    }

    #[test]
    fn helper_exits_become_the_errors_a_job_shows() {
        let e = classify("/data/x", "n1", Failure::Denied, "no".into());
        assert!(matches!(e, StageError::Denied { .. }), "{e}");
        let e = classify("/data/x", "n1", Failure::NoSpace, String::new());
        assert!(e.to_string().contains("node n1 is full"), "{e}");
        let e = classify("/data/x", "n1", Failure::from_exit(Some(9)), "odd".into());
        assert!(e.to_string().contains("odd"), "{e}");
    }

    /// A node's cache of 8 MiB in a fresh directory (its hot tier `hot`), with that directory.
    fn node_cache() -> (tempfile::TempDir, Arc<Cache>) {
        let t = tempfile::tempdir().unwrap();
        let d = t.path();
        std::fs::create_dir_all(d.join("hot")).unwrap();
        let text = format!(
            "[agent]\nsocket='{d}/s'\nstate_dir='{d}/st'\n[hot_tier]\nroot='{d}/hot'\n\
             [cache]\nsize='8MiB'\nmin_free=0\n",
            d = d.display()
        );
        let cfg =
            sluice_core::config::Config::parse(&text, "n1", sluice_archive::upload_memory).unwrap();
        let cache = Cache::open(&cfg).unwrap().unwrap();
        (t, cache)
    }

    /// A miss is kept only if the job's staged copy hashes, piece by piece, to what the helper
    /// reported reading; a copy that differs (the user wrote into it, or the source changed
    /// under the helper) leaves no entry, and a link where the file was is not followed.
    #[test]
    fn a_staged_copy_is_kept_only_if_it_hashes_to_what_the_helper_read() {
        let (t, cache) = node_cache();
        let d = t.path();
        let stage = d.join("stage");
        std::fs::create_dir(&stage).unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
        std::fs::write(stage.join("f"), &data).unwrap();
        std::os::unix::fs::symlink("f", stage.join("link")).unwrap();
        let root = safefs::open_root_dir(&stage).unwrap();
        let owner = Owner {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let file = |rel: &str, ino: u64| Identified {
            key: posix_key(
                &format!("/src/{rel}"),
                FileIdent {
                    dev: 1,
                    ino,
                    size: data.len() as u64,
                    mtime: 5,
                    mtime_ns: 6,
                    ctime: 7,
                    ctime_ns: 8,
                },
                owner.uid,
            ),
            rel: rel.to_string(),
            mode: 0o644,
            one_file: false,
        };
        let read: Vec<blake3::Hash> = data.chunks(4096).map(blake3::hash).collect();
        let right = piece_hashes_hash(&read);
        let wrong = piece_hashes_hash(&read[..2]);
        keep(&cache, &root, &file("f", 1), owner, 4096, wrong);
        keep(&cache, &root, &file("link", 2), owner, 4096, right);
        keep(&cache, &root, &file("f", 3), owner, 8192, right);
        assert_eq!(cache.stats().entries, 0, "none of those is kept");
        keep(&cache, &root, &file("f", 4), owner, 4096, right);
        let hit = cache.lookup(&file("f", 4).key).expect("kept");
        let out = std::fs::File::create(d.join("out")).unwrap();
        hit.copy_to(&out, None).unwrap();
        assert_eq!(std::fs::read(d.join("out")).unwrap(), data);
        // Another uid's key for the same file names no entry.
        let mut other = file("f", 4).key;
        other.posix.as_mut().unwrap().uid += 1;
        assert!(cache.lookup(&other).is_none());
    }

    /// Finding 9 of issue 24: a source its user rewrote with the same size and then set its mtime
    /// back (`touch -d`, `utimensat`) is a miss, so the job gets the new bytes: the helper's
    /// fstat finds another ctime, which nobody can set back. Before, the key held the mtime only,
    /// and the entry of the old bytes was placed.
    #[test]
    fn a_source_rewritten_with_its_mtime_set_back_is_a_cache_miss() {
        let (t, cache) = node_cache();
        let d = t.path();
        let src = d.join("f");
        let old = vec![1u8; 10_000];
        std::fs::write(&src, &old).unwrap();
        let ident = || {
            FileIdent::of(&std::fs::File::open(&src).unwrap())
                .unwrap()
                .unwrap()
        };
        let uid = nix::unistd::geteuid().as_raw();
        let path = src.to_str().unwrap();
        let before = ident();
        let fill = cache.begin_fill(posix_key(path, before, uid)).unwrap();
        fill.write_at(&old, 0);
        assert!(fill.commit());
        assert!(cache.lookup(&posix_key(path, ident(), uid)).is_some());

        // Later (another clock tick), the user rewrites it and sets its mtime back.
        std::thread::sleep(std::time::Duration::from_millis(30));
        let mtime = std::fs::metadata(&src).unwrap().modified().unwrap();
        std::fs::write(&src, vec![2u8; old.len()]).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&src)
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(mtime))
            .unwrap();
        let after = ident();
        assert_eq!(
            (
                after.dev,
                after.ino,
                after.size,
                after.mtime,
                after.mtime_ns
            ),
            (
                before.dev,
                before.ino,
                before.size,
                before.mtime,
                before.mtime_ns
            ),
            "all the key held before is as it was"
        );
        assert!(
            cache.lookup(&posix_key(path, after, uid)).is_none(),
            "the rewritten source is a miss"
        );
    }
}
