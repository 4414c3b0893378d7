//! The replica area: where this node keeps the replicas of checkpoint parts that the other nodes
//! of a job push to it ([`sluice_peer::ReplicaStore`], issue 26), root-only and never visible to
//! any job:
//!
//! ```text
//! <dir>/                                   root's, 0700 (mount = true: its own tmpfs of `room` bytes, nosuid,nodev,noexec)
//! <dir>/<job>/<from>/<tag>/files/<path…>   the part's files, root's, 0600 (directories 0700)
//! <dir>/<job>/<from>/<tag>/tmp/<n>         a file being received
//! <dir>/<job>/<from>/<tag>/SEALED          JSON: the part's seal (ReplicaSeal: files, nodes, committed_at), written last
//! <dir>/.free-<n>                          a part or job being removed
//! ```
//!
//! The rules, in the order a request meets them:
//!
//! - Every name that comes off the network is checked before it names anything here: the node
//!   ([`check_node`]), the tag and each path ([`check_tag`], [`check_path`]), a seal's node list
//!   ([`check_seal`]: it is kept and served back, never used as a path). The tree is walked
//!   one component at a time from the area's descriptor, never following a link
//!   ([`sluice_core::safefs`]). Only root can write below `<dir>`, so the one path-based write (the
//!   `SEALED` list, through the durable-write helper) meets nothing the agent did not make.
//! - Room: the area holds `room` bytes of files in all. A push takes its announced size before it
//!   reads a byte ([`ReplicaRefusal::NoRoom`] when that does not fit, nothing written) and gives it
//!   back when it is refused, replaced or freed.
//! - A push is kept only if exactly its announced size came, hashing (BLAKE3) to its announced
//!   hash; it is written to `tmp/` and renamed into `files/` only then.
//! - A part is visible ([`ReplicaStore::index`], [`ReplicaStore::file`]) only while sealed: a push
//!   into a sealed part unseals it (its `SEALED` goes) until its sender seals it again.
//! - Freeing moves the part's directory out of the way (`.free-<n>`) under the lock and removes it
//!   after: a push that began before the free finds its part gone when it ends and keeps nothing,
//!   as does one whose part was sealed meanwhile.
//! - While the agent runs, the state in memory is the truth; at [`ReplicaArea::open`] the disk is:
//!   every sealed part whose files are all there with their sizes is indexed again, with the
//!   nodes and commit time it was sealed with, everything else goes.

use sluice_core::durable::write_durable;
use sluice_core::rt::{blocking, lock};
use sluice_core::safefs::{self, RemoveAs, SafeFsError};
use sluice_peer::replica::{MAX_FILES, check_node, check_path, check_seal, check_tag};
use sluice_peer::{
    HashFrom, PartKey, ReplicaFile, ReplicaPart, ReplicaRefusal, ReplicaSeal, ReplicaStore,
    UnitStream,
};
use sluice_proto::msg::JobId;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const FILES: &str = "files";
const TMP: &str = "tmp";
const SEALED: &str = "SEALED";
/// Prefix of what is being removed, in `<dir>` (no job id starts so).
const FREEING: &str = ".free-";
const DIR_MODE: u32 = 0o700;
const FILE_MODE: u32 = 0o600;
/// How much of a push is gathered before one write, and the slices a replica is served in.
const SLICE: usize = 1 << 20;

/// Why the replica area could not be opened; each says what the admin can do.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaAreaError {
    #[error("creating the replica area {path}: {source}; check that the agent runs as root")]
    Create {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the replica area {path} cannot be used: {source}; give replicas a directory of root's that is not a symbolic link"
    )]
    Dir {
        path: String,
        #[source]
        source: SafeFsError,
    },
    #[error(
        "the replica area {path} belongs to uid {uid}, not to the agent: give replicas a directory only root can change, or remove this one"
    )]
    NotOurs { path: String, uid: u32 },
    #[error(
        "mounting the replica area's tmpfs of {room} bytes at {path}: {errno}; check that the agent runs as root, or mount it yourself and set mount = false"
    )]
    Mount {
        path: String,
        room: u64,
        errno: nix::errno::Errno,
    },
}

/// This node's replica area (see the module's header). Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct ReplicaArea {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// `<dir>` (the mount point with a tmpfs of its own).
    path: PathBuf,
    /// `<dir>`, opened once it was checked (and mounted).
    root: OwnedFd,
    room: u64,
    state: Mutex<State>,
}

/// A part as the map holds it: job, sender, tag.
type Key = (JobId, String, String);

#[derive(Debug, Default)]
struct State {
    /// Bytes of the room taken: the files stored and the pushes under way.
    used: u64,
    parts: BTreeMap<Key, Part>,
    /// Numbers parts (a push is kept only in the part it began in), temporary names and the
    /// directories being removed.
    next: u64,
}

impl State {
    fn number(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

#[derive(Debug)]
struct Part {
    id: u64,
    /// Every file received whole, by path: size and hash.
    stored: BTreeMap<String, (u64, blake3::Hash)>,
    /// What it was sealed with, its files by path (hashes in lower-case hex).
    sealed: Option<ReplicaSeal>,
}

fn key_of(part: &PartKey) -> Key {
    (part.job, part.from.clone(), part.tag.clone())
}

fn check_part(part: &PartKey) -> Result<(), ReplicaRefusal> {
    check_node(&part.from)?;
    check_tag(&part.tag)
}

/// A file's path below its tag, checked, as the directories above it and its name.
fn split_path(path: &str) -> Result<(Vec<&str>, &str), ReplicaRefusal> {
    check_path(path)?;
    let mut parts: Vec<&str> = path.split('/').collect();
    if parts.len() > safefs::MAX_DEPTH {
        return Err(ReplicaRefusal::Invalid(format!(
            "'{path}' nests deeper than {} directories",
            safefs::MAX_DEPTH
        )));
    }
    let name = parts.pop().expect("split yields one part at least");
    Ok((parts, name))
}

fn parse_hash(file: &ReplicaFile) -> Result<blake3::Hash, ReplicaRefusal> {
    blake3::Hash::from_hex(&file.blake3).map_err(|_| {
        ReplicaRefusal::Invalid(format!(
            "{}: '{}' is not a BLAKE3 hash",
            file.path,
            file.blake3.escape_debug()
        ))
    })
}

/// A seal's list checked (paths, hashes, no path twice, at most [`MAX_FILES`]), in the order given,
/// with the hashes as lower-case hex.
fn check_list(files: &[ReplicaFile]) -> Result<Vec<ReplicaFile>, ReplicaRefusal> {
    if files.len() > MAX_FILES {
        return Err(ReplicaRefusal::Invalid(format!(
            "a part of {} files: at most {MAX_FILES} may be sealed",
            files.len()
        )));
    }
    let mut seen = BTreeSet::new();
    let mut list = Vec::with_capacity(files.len());
    for f in files {
        split_path(&f.path)?;
        if !seen.insert(f.path.as_str()) {
            return Err(ReplicaRefusal::Invalid(format!(
                "{} is listed twice",
                f.path
            )));
        }
        list.push(ReplicaFile {
            blake3: parse_hash(f)?.to_hex().to_string(),
            ..f.clone()
        });
    }
    Ok(list)
}

fn failed(what: impl std::fmt::Display) -> impl FnOnce(SafeFsError) -> ReplicaRefusal {
    move |e| ReplicaRefusal::Failed(format!("{what}: {e}"))
}

fn sys(op: &'static str, path: &str) -> impl FnOnce(nix::errno::Errno) -> SafeFsError {
    let path = path.to_string();
    move |errno| SafeFsError::Sys { op, path, errno }
}

/// Opens (`create`: makes, root's and 0700) the directories `names` one below the other from
/// `from`, never following a link.
fn walk<'a>(
    from: &OwnedFd,
    names: impl IntoIterator<Item = &'a str>,
    create: bool,
) -> Result<OwnedFd, SafeFsError> {
    let mut at: Option<OwnedFd> = None;
    for name in names {
        let dir = at.as_ref().unwrap_or(from);
        at = Some(if create {
            safefs::ensure_dir(dir, name, None, DIR_MODE)?
        } else {
            safefs::open_dir(dir, name)?
        });
    }
    match at {
        Some(dir) => Ok(dir),
        None => nix::unistd::dup(from).map_err(sys("dup", "")),
    }
}

/// Opens the regular file `name` in `dir` for reading, without following a link.
fn open_file(dir: &OwnedFd, name: &str) -> Result<File, SafeFsError> {
    use nix::fcntl::OFlag;
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    nix::fcntl::openat(dir, name, flags, nix::sys::stat::Mode::empty())
        .map(File::from)
        .map_err(sys("open", name))
}

fn is_file_of(st: &nix::sys::stat::FileStat, size: u64) -> bool {
    use nix::sys::stat::SFlag;
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG
        && st.st_size as u64 == size
}

fn unlink(dir: &OwnedFd, name: &str) -> Result<(), SafeFsError> {
    match nix::unistd::unlinkat(dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(nix::errno::Errno::ENOENT) => Ok(()),
        Err(errno) => Err(sys("unlink", name)(errno)),
    }
}

impl ReplicaArea {
    /// Opens the replica area at `dir` with `room` bytes for replicas, making it (root's, 0700)
    /// and, with `mount`, mounting its tmpfs of `room` bytes there unless one is mounted already;
    /// then recovers what it holds (see the module's header). Blocking: the agent calls it at start.
    pub fn open(dir: &Path, room: u64, mount: bool) -> Result<ReplicaArea, ReplicaAreaError> {
        let at = || dir.display().to_string();
        std::fs::create_dir_all(dir)
            .map_err(|source| ReplicaAreaError::Create { path: at(), source })?;
        let check = || -> Result<OwnedFd, ReplicaAreaError> {
            let fd = safefs::open_root_dir(dir)
                .map_err(|source| ReplicaAreaError::Dir { path: at(), source })?;
            let st = nix::sys::stat::fstat(&fd).map_err(|errno| ReplicaAreaError::Dir {
                path: at(),
                source: sys("stat", "")(errno),
            })?;
            if st.st_uid != nix::unistd::geteuid().as_raw() {
                return Err(ReplicaAreaError::NotOurs {
                    path: at(),
                    uid: st.st_uid,
                });
            }
            nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(DIR_MODE))
                .map_err(|errno| ReplicaAreaError::Dir {
                    path: at(),
                    source: sys("chmod", "")(errno),
                })?;
            Ok(fd)
        };
        // The directory under the mount is checked too: a link there would be mounted over.
        let mut root = check()?;
        let data = format!("size={room},mode=0700");
        if mount && crate::ram_tier::is_mount_point(dir) {
            // Mounted by the agent before this one, maybe with another `replica_room` (an admin
            // raised it and restarted the agent): resized to this one, its replicas kept. A tmpfs
            // cannot shrink below what it holds: it then keeps its size, said here.
            let remount = nix::mount::MsFlags::MS_REMOUNT | nix::mount::MsFlags::MS_NOEXEC;
            if let Err(errno) = crate::ram_tier::mount_tmpfs("sluice-replicas", dir, &data, remount)
            {
                tracing::warn!(
                    "resizing the replica area {} to {room} bytes: {errno}; it keeps the size it was mounted with",
                    dir.display()
                );
            }
        } else if mount {
            crate::ram_tier::mount_tmpfs(
                "sluice-replicas",
                dir,
                &data,
                nix::mount::MsFlags::MS_NOEXEC,
            )
            .map_err(|errno| ReplicaAreaError::Mount {
                path: at(),
                room,
                errno,
            })?;
            root = check()?;
        }
        let state = recover(&root);
        if state.used > room {
            tracing::warn!(
                "the replica area {} holds {} bytes of replicas, more than its room of {room}: it takes no more until parts are freed",
                dir.display(),
                state.used
            );
        }
        tracing::info!(
            "replica area {}: {} parts, {} of {room} bytes",
            dir.display(),
            state.parts.len(),
            state.used
        );
        Ok(ReplicaArea {
            inner: Arc::new(Inner {
                path: dir.to_path_buf(),
                root,
                room,
                state: Mutex::new(state),
            }),
        })
    }

    /// Frees every part of `job` held here, sealed or not (blocking): the job is over.
    pub fn free_job(&self, job: JobId) {
        self.inner.free(job, None);
    }

    /// The jobs of which this node holds parts, sealed or not.
    pub fn jobs(&self) -> Vec<JobId> {
        let st = lock(&self.inner.state);
        let jobs: BTreeSet<JobId> = st.parts.keys().map(|k| k.0).collect();
        jobs.into_iter().collect()
    }

    /// Bytes of the room taken (files stored and pushes under way).
    pub fn used(&self) -> u64 {
        lock(&self.inner.state).used
    }
}

/// A push under way: its room and its temporary file, given back and removed when it is dropped
/// before it was kept (refused, or its request cut off).
struct Pending {
    inner: Arc<Inner>,
    key: Key,
    /// The part it began in.
    id: u64,
    path: String,
    size: u64,
    hash: blake3::Hash,
    tag_dir: OwnedFd,
    tmp_dir: OwnedFd,
    tmp_name: String,
    kept: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.kept {
            // A small unlink on the area's file system (also on an executor thread, where a
            // cancelled request drops it).
            if let Err(e) = unlink(&self.tmp_dir, &self.tmp_name) {
                tracing::warn!("removing a refused replica of {}: {e}", self.path);
            }
            let mut st = lock(&self.inner.state);
            st.used = st.used.saturating_sub(self.size);
        }
    }
}

/// What a push writes with, moved to a blocking thread for each batch.
struct Writer {
    out: File,
    hasher: blake3::Hasher,
}

impl Writer {
    fn write(&mut self, batch: &[bytes::Bytes]) -> std::io::Result<()> {
        use std::io::Write;
        for b in batch {
            self.hasher.update(b);
            self.out.write_all(b)?;
        }
        Ok(())
    }
}

impl Inner {
    fn tag_names(key: &Key) -> [String; 3] {
        [key.0.to_string(), key.1.clone(), key.2.clone()]
    }

    /// Takes the room for `file`, unseals its part and opens its temporary file (blocking).
    fn begin(
        self: &Arc<Self>,
        part: &PartKey,
        file: &ReplicaFile,
        hash: blake3::Hash,
    ) -> Result<(Pending, File), ReplicaRefusal> {
        let key = key_of(part);
        let mut st = lock(&self.state);
        let free = self.room.saturating_sub(st.used);
        if file.size > free {
            return Err(ReplicaRefusal::NoRoom {
                need: file.size,
                free,
            });
        }
        let names = Self::tag_names(&key);
        let tag_dir = walk(&self.root, names.iter().map(String::as_str), true)
            .map_err(failed("making the part's directory"))?;
        let tmp_dir = safefs::ensure_dir(&tag_dir, TMP, None, DIR_MODE)
            .map_err(failed("making the part's directory"))?;
        let tmp_name = st.number().to_string();
        let out = safefs::create_file(&tmp_dir, &tmp_name, None, FILE_MODE)
            .map_err(failed(format!("receiving {}", file.path)))?;
        let id = match st.parts.get(&key) {
            Some(p) => p.id,
            None => {
                let id = st.number();
                st.parts.insert(
                    key.clone(),
                    Part {
                        id,
                        stored: BTreeMap::new(),
                        sealed: None,
                    },
                );
                id
            }
        };
        st.used += file.size;
        let pending = Pending {
            inner: self.clone(),
            key: key.clone(),
            id,
            path: file.path.clone(),
            size: file.size,
            hash,
            tag_dir,
            tmp_dir,
            tmp_name,
            kept: false,
        };
        let part = st.parts.get_mut(&key).expect("inserted above");
        if part.sealed.is_some() {
            // Changed from now on: not served until sealed again.
            if let Err(e) = unlink(&pending.tag_dir, SEALED) {
                drop(st);
                return Err(failed("unsealing the part")(e));
            }
            part.sealed = None;
        }
        Ok((pending, out))
    }

    /// Renames a push received whole into place, replacing the file it pushed before (blocking).
    fn keep(&self, p: &mut Pending) -> Result<(), ReplicaRefusal> {
        let mut st = lock(&self.state);
        let State { used, parts, .. } = &mut *st;
        let part = match parts.get_mut(&p.key) {
            Some(part) if part.id == p.id => part,
            _ => {
                return Err(ReplicaRefusal::Failed(format!(
                    "the part was freed while {} came: nothing kept",
                    p.path
                )));
            }
        };
        if part.sealed.is_some() {
            return Err(ReplicaRefusal::Invalid(format!(
                "the part was sealed while {} came: nothing kept",
                p.path
            )));
        }
        let (dirs, name) = split_path(&p.path)?;
        let dir = walk(&p.tag_dir, std::iter::once(FILES).chain(dirs), true)
            .map_err(failed(format!("storing {}", p.path)))?;
        nix::fcntl::renameat(&p.tmp_dir, p.tmp_name.as_str(), &dir, name)
            .map_err(sys("rename", &p.path))
            .map_err(failed(format!("storing {}", p.path)))?;
        p.kept = true;
        if let Some((old, _)) = part.stored.insert(p.path.clone(), (p.size, p.hash)) {
            *used = used.saturating_sub(old);
        }
        Ok(())
    }

    /// Seals the part `key` with `seal` (checked, its files in the sender's order) (blocking).
    fn seal(&self, key: &Key, mut seal: ReplicaSeal) -> Result<(), ReplicaRefusal> {
        let mut st = lock(&self.state);
        let State { used, parts, next } = &mut *st;
        let stored = parts.get(key).map(|p| &p.stored);
        for f in &seal.files {
            let (size, hash) = stored
                .and_then(|s| s.get(&f.path))
                .ok_or_else(|| ReplicaRefusal::Mismatch(format!("{} was not stored", f.path)))?;
            if *size != f.size || hash.to_hex().as_str() != f.blake3 {
                return Err(ReplicaRefusal::Mismatch(format!(
                    "{} was stored with {size} bytes hashing to {}, not {} bytes hashing to {}",
                    f.path,
                    hash.to_hex(),
                    f.size,
                    f.blake3
                )));
            }
        }
        seal.files.sort_by(|a, b| a.path.cmp(&b.path));
        if parts.get(key).and_then(|p| p.sealed.as_ref()) == Some(&seal) {
            return Ok(());
        }
        let names = Self::tag_names(key);
        let tag_dir = walk(&self.root, names.iter().map(String::as_str), true)
            .map_err(failed("making the part's directory"))?;
        let part = parts.entry(key.clone()).or_insert_with(|| {
            *next += 1;
            Part {
                id: *next,
                stored: BTreeMap::new(),
                sealed: None,
            }
        });
        let listed: BTreeSet<&str> = seal.files.iter().map(|f| f.path.as_str()).collect();
        let unlisted: Vec<String> = part
            .stored
            .keys()
            .filter(|p| !listed.contains(p.as_str()))
            .cloned()
            .collect();
        for path in unlisted {
            let (dirs, name) = split_path(&path)?;
            match walk(&tag_dir, std::iter::once(FILES).chain(dirs), false) {
                Ok(dir) => unlink(&dir, name),
                Err(e) if e.errno() == Some(nix::errno::Errno::ENOENT) => Ok(()),
                Err(e) => Err(e),
            }
            .map_err(failed(format!(
                "removing {path}, which the seal does not list"
            )))?;
            if let Some((size, _)) = part.stored.remove(&path) {
                *used = used.saturating_sub(size);
            }
        }
        let json = serde_json::to_vec(&seal).expect("a seal serializes");
        let sealed = names
            .iter()
            .fold(self.path.clone(), |p, n| p.join(n))
            .join(SEALED);
        write_durable(&sealed, &json)
            .map_err(|e| ReplicaRefusal::Failed(format!("writing the part's seal: {e}")))?;
        part.sealed = Some(seal);
        Ok(())
    }

    /// A file of a sealed part, opened, with its size and hash (blocking).
    fn open(&self, key: &Key, path: &str) -> Option<(File, u64, blake3::Hash)> {
        let (dirs, name) = split_path(path).ok()?;
        // Under the lock, so that no push replaces it between the list and the open.
        let st = lock(&self.state);
        let f = st
            .parts
            .get(key)?
            .sealed
            .as_ref()?
            .files
            .iter()
            .find(|f| f.path == path)?;
        let hash = blake3::Hash::from_hex(&f.blake3).ok()?;
        let names = Self::tag_names(key);
        let opened = walk(
            &self.root,
            names.iter().map(String::as_str).chain([FILES]).chain(dirs),
            false,
        )
        .and_then(|dir| open_file(&dir, name));
        let file = match opened {
            Ok(file) => file,
            Err(e) => {
                tracing::warn!("serving the replica of {path}: {e}");
                return None;
            }
        };
        match nix::sys::stat::fstat(file.as_fd()) {
            Ok(st) if is_file_of(&st, f.size) => Some((file, f.size, hash)),
            _ => {
                tracing::warn!("serving the replica of {path}: not the file that was sealed");
                None
            }
        }
    }

    /// Frees a part (`Some((from, tag))`) or every part of `job` (blocking).
    fn free(&self, job: JobId, part: Option<(&str, &str)>) {
        let job_name = job.to_string();
        let moved = {
            let mut st = lock(&self.state);
            let State { used, parts, next } = &mut *st;
            let gone: Vec<Key> = parts
                .keys()
                .filter(|k| k.0 == job && part.is_none_or(|(f, t)| k.1 == f && k.2 == t))
                .cloned()
                .collect();
            for k in gone {
                let p = parts.remove(&k).expect("listed above");
                *used = used.saturating_sub(p.stored.values().map(|(s, _)| s).sum());
            }
            // Out of the way under the lock: a push that begins now makes the part afresh.
            *next += 1;
            let trash = format!("{FREEING}{next}");
            let moved = match part {
                None => {
                    nix::fcntl::renameat(&self.root, job_name.as_str(), &self.root, trash.as_str())
                }
                Some((from, tag)) => match walk(&self.root, [job_name.as_str(), from], false) {
                    Ok(dir) => nix::fcntl::renameat(&dir, tag, &self.root, trash.as_str()),
                    Err(e) => Err(e.errno().unwrap_or(nix::errno::Errno::EIO)),
                },
            };
            match moved {
                Ok(()) => Some(trash),
                Err(nix::errno::Errno::ENOENT) => None,
                Err(e) => {
                    tracing::warn!("freeing replicas of job {job}: {e}");
                    None
                }
            }
        };
        if let Some(trash) = moved {
            remove(&self.root, &trash);
        }
    }
}

/// Removes `name` in `dir` and what is below it (the area is the agent's alone), saying what stayed.
fn remove(dir: &OwnedFd, name: &str) {
    match safefs::remove_tree(dir, name, RemoveAs::agent()) {
        Ok(r) if r.failed == 0 && r.skipped == 0 => {}
        Ok(r) => tracing::warn!(
            "replica area: {} entries below {name} could not be removed",
            r.failed + r.skipped
        ),
        Err(e) => tracing::warn!("replica area: removing {name}: {e}"),
    }
}

/// What the area holds at open: every sealed part whose files are all there, with their sizes;
/// everything else goes (blocking).
fn recover(root: &OwnedFd) -> State {
    let mut st = State::default();
    for job_name in crate::hot_tier::list_names(root).unwrap_or_default() {
        let job = job_name
            .parse::<JobId>()
            .ok()
            .filter(|j| j.to_string() == job_name);
        let job_dir = job.and_then(|_| safefs::open_dir(root, &job_name).ok());
        let (Some(job), Some(job_dir)) = (job, job_dir) else {
            remove(root, &job_name);
            continue;
        };
        for from in crate::hot_tier::list_names(&job_dir).unwrap_or_default() {
            let from_dir = check_node(&from)
                .ok()
                .and_then(|()| safefs::open_dir(&job_dir, &from).ok());
            let Some(from_dir) = from_dir else {
                remove(&job_dir, &from);
                continue;
            };
            for tag in crate::hot_tier::list_names(&from_dir).unwrap_or_default() {
                let seal = check_tag(&tag)
                    .ok()
                    .and_then(|()| safefs::open_dir(&from_dir, &tag).ok())
                    .and_then(|dir| recover_part(&dir, &from));
                let Some(seal) = seal else {
                    tracing::info!("replica area: removing {job}/{from}/{tag}: not sealed whole");
                    remove(&from_dir, &tag);
                    continue;
                };
                let stored = seal
                    .files
                    .iter()
                    .map(|f| {
                        let hash = blake3::Hash::from_hex(&f.blake3).expect("checked list");
                        (f.path.clone(), (f.size, hash))
                    })
                    .collect::<BTreeMap<_, _>>();
                st.used += stored.values().map(|(s, _)| s).sum::<u64>();
                let id = st.number();
                st.parts.insert(
                    (job, from.clone(), tag),
                    Part {
                        id,
                        stored,
                        sealed: Some(seal),
                    },
                );
            }
        }
    }
    st
}

/// The seal of `from`'s part sealed whole (every file there with its size), once what else is in
/// its directory is removed; `None` for a part to remove.
fn recover_part(tag_dir: &OwnedFd, from: &str) -> Option<ReplicaSeal> {
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut open_file(tag_dir, SEALED).ok()?, &mut json).ok()?;
    let seal: ReplicaSeal = serde_json::from_slice(&json).ok()?;
    check_seal(from, &seal.files, &seal.nodes).ok()?;
    let mut list = check_list(&seal.files).ok()?;
    list.sort_by(|a, b| a.path.cmp(&b.path));
    for f in &list {
        let (dirs, name) = split_path(&f.path).ok()?;
        let dir = walk(tag_dir, std::iter::once(FILES).chain(dirs), false).ok()?;
        let st = nix::sys::stat::fstatat(&dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
        if !st.is_ok_and(|st| is_file_of(&st, f.size)) {
            return None;
        }
    }
    for name in crate::hot_tier::list_names(tag_dir).unwrap_or_default() {
        if name != FILES && name != SEALED {
            remove(tag_dir, &name);
        }
    }
    Some(ReplicaSeal {
        files: list,
        ..seal
    })
}

/// [`ReplicaStore`]'s work, as plain async methods.
impl ReplicaArea {
    async fn put(
        &self,
        part: &PartKey,
        file: &ReplicaFile,
        mut body: sluice_peer::replica::Incoming,
    ) -> Result<(), ReplicaRefusal> {
        use futures::StreamExt;
        check_part(part)?;
        split_path(&file.path)?;
        let hash = parse_hash(file)?;
        let (inner, p, f) = (self.inner.clone(), part.clone(), file.clone());
        let (mut pending, out) = blocking(move || inner.begin(&p, &f, hash)).await?;
        let mut writer = Writer {
            out,
            hasher: blake3::Hasher::new(),
        };
        let (mut got, mut batch, mut batched) = (0u64, Vec::new(), 0usize);
        loop {
            let next = body.next().await;
            if let Some(chunk) = &next {
                let chunk = chunk
                    .as_ref()
                    .map_err(|e| ReplicaRefusal::Failed(format!("receiving {}: {e}", file.path)))?;
                got += chunk.len() as u64;
                if got > file.size {
                    return Err(ReplicaRefusal::Mismatch(format!(
                        "{}: more than the {} bytes announced came; nothing kept",
                        file.path, file.size
                    )));
                }
                batched += chunk.len();
                batch.push(chunk.clone());
                if batched < SLICE {
                    continue;
                }
            }
            if !batch.is_empty() {
                let full = std::mem::take(&mut batch);
                batched = 0;
                let (w, wrote) = blocking(move || {
                    let wrote = writer.write(&full);
                    (writer, wrote)
                })
                .await;
                writer = w;
                wrote.map_err(|e| ReplicaRefusal::Failed(format!("storing {}: {e}", file.path)))?;
            }
            if next.is_none() {
                break;
            }
        }
        if got != file.size {
            return Err(ReplicaRefusal::Mismatch(format!(
                "{}: {got} bytes came, {} were announced; nothing kept",
                file.path, file.size
            )));
        }
        let came = writer.hasher.finalize();
        if came != hash {
            return Err(ReplicaRefusal::Mismatch(format!(
                "{}: the bytes hash to {}, not to the {} announced; nothing kept",
                file.path,
                came.to_hex(),
                file.blake3
            )));
        }
        drop(writer);
        let inner = self.inner.clone();
        blocking(move || inner.keep(&mut pending)).await
    }

    async fn seal_with(&self, part: &PartKey, seal: &ReplicaSeal) -> Result<(), ReplicaRefusal> {
        check_part(part)?;
        check_seal(&part.from, &seal.files, &seal.nodes)?;
        let seal = ReplicaSeal {
            files: check_list(&seal.files)?,
            ..seal.clone()
        };
        let (inner, key) = (self.inner.clone(), key_of(part));
        blocking(move || inner.seal(&key, seal)).await
    }

    fn index_of(&self, job: JobId) -> Vec<ReplicaPart> {
        let st = lock(&self.inner.state);
        st.parts
            .iter()
            .filter(|(k, _)| k.0 == job)
            .filter_map(|((_, from, tag), p)| {
                let seal = p.sealed.as_ref()?;
                Some(ReplicaPart {
                    from: from.clone(),
                    tag: tag.clone(),
                    files: seal.files.clone(),
                    nodes: seal.nodes.clone(),
                    committed_at: seal.committed_at,
                    archived: false,
                })
            })
            .collect()
    }

    async fn serve(&self, part: &PartKey, path: &str) -> Option<UnitStream> {
        check_part(part).ok()?;
        let (inner, key, p) = (self.inner.clone(), key_of(part), path.to_string());
        let (file, len, hash) = blocking(move || inner.open(&key, &p)).await?;
        Some(UnitStream {
            len,
            hash,
            // Root's copy, checked against its sender's hash as it came: no user could change it.
            from: HashFrom::Origin,
            body: file_body(file, len, path.to_string()),
        })
    }

    async fn free_part(&self, part: &PartKey) {
        if check_part(part).is_err() {
            return;
        }
        let (inner, part) = (self.inner.clone(), part.clone());
        blocking(move || inner.free(part.job, Some((&part.from, &part.tag)))).await;
    }
}

/// The first `len` bytes of `file`, read on tokio's blocking threads a slice at a time, as a
/// replica's answer streams them (`what` names it in the log). A read that fails ends the stream
/// short: the requester then reads the part elsewhere.
pub(crate) fn file_body(
    file: File,
    len: u64,
    what: String,
) -> futures::stream::BoxStream<'static, bytes::Bytes> {
    use futures::StreamExt;
    use tokio::io::AsyncReadExt;
    let reader = tokio::fs::File::from_std(file).take(len);
    futures::stream::unfold(reader, move |mut reader| {
        let what = what.clone();
        async move {
            let mut buf = bytes::BytesMut::with_capacity(SLICE);
            match reader.read_buf(&mut buf).await {
                Ok(0) => None,
                Ok(_) => Some((buf.freeze(), reader)),
                Err(e) => {
                    tracing::warn!("serving the replica of {what}: {e}");
                    None
                }
            }
        }
    })
    .boxed()
}

#[async_trait::async_trait]
impl ReplicaStore for ReplicaArea {
    async fn put_file(
        &self,
        part: &PartKey,
        file: &ReplicaFile,
        body: sluice_peer::replica::Incoming,
    ) -> Result<(), ReplicaRefusal> {
        self.put(part, file, body).await
    }

    async fn seal(&self, part: &PartKey, seal: &ReplicaSeal) -> Result<(), ReplicaRefusal> {
        self.seal_with(part, seal).await
    }

    async fn index(&self, job: JobId) -> Vec<ReplicaPart> {
        self.index_of(job)
    }

    fn room(&self) -> (u64, u64) {
        let used = lock(&self.inner.state).used;
        (self.inner.room.saturating_sub(used), self.inner.room)
    }

    async fn file(&self, part: &PartKey, path: &str) -> Option<UnitStream> {
        self.serve(part, path).await
    }

    async fn free(&self, part: &PartKey) {
        self.free_part(part).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use sluice_peer::replica::MAX_NODE;
    use std::os::unix::fs::MetadataExt;

    const JOB: JobId = 7;

    fn key(from: &str, tag: &str) -> PartKey {
        PartKey {
            job: JOB,
            from: from.into(),
            tag: tag.into(),
        }
    }

    /// When the tests' checkpoints were committed.
    const COMMITTED_AT: u64 = 1_750_000_000;

    /// The seal of a part of `files` of the tests' job, run on n1, n2, n3.
    fn seal_of(files: &[ReplicaFile]) -> ReplicaSeal {
        ReplicaSeal {
            files: files.to_vec(),
            nodes: vec!["n1".into(), "n2".into(), "n3".into()],
            committed_at: COMMITTED_AT,
        }
    }

    fn announce(path: &str, bytes: &[u8]) -> ReplicaFile {
        ReplicaFile {
            path: path.into(),
            size: bytes.len() as u64,
            blake3: blake3::hash(bytes).to_hex().to_string(),
        }
    }

    /// A body that sends `chunks`, then ends.
    fn body(chunks: &[&[u8]]) -> sluice_peer::replica::Incoming {
        let chunks: Vec<_> = chunks
            .iter()
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        futures::stream::iter(chunks).boxed()
    }

    /// A body that must not be read.
    fn untouchable() -> sluice_peer::replica::Incoming {
        futures::stream::poll_fn(|_| -> std::task::Poll<Option<_>> { panic!("the body was read") })
            .boxed()
    }

    async fn put(area: &ReplicaArea, part: &PartKey, path: &str, bytes: &[u8]) {
        area.put_file(part, &announce(path, bytes), body(&[bytes]))
            .await
            .unwrap();
    }

    async fn read(area: &ReplicaArea, part: &PartKey, path: &str) -> Option<(Vec<u8>, UnitStream)> {
        let mut s = area.file(part, path).await?;
        let mut out = Vec::new();
        while let Some(b) = s.body.next().await {
            out.extend_from_slice(&b);
        }
        Some((out, s))
    }

    /// The regular files below `dir`, by path.
    fn files_below(dir: &Path) -> Vec<String> {
        fn walk(dir: &Path, top: &Path, out: &mut Vec<String>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(&p, top, out);
                } else {
                    out.push(p.strip_prefix(top).unwrap().display().to_string());
                }
            }
        }
        let mut out = Vec::new();
        if dir.exists() {
            walk(dir, dir, &mut out);
        }
        out.sort();
        out
    }

    fn area(t: &tempfile::TempDir, room: u64) -> ReplicaArea {
        ReplicaArea::open(&t.path().join("replicas"), room, false).unwrap()
    }

    #[tokio::test]
    async fn a_sealed_part_is_indexed_and_served_as_it_came() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 10 << 20);
        let part = key("n2", "s1");
        let big: Vec<u8> = (0..(5 << 19)).map(|i| (i % 251) as u8).collect();
        put(&a, &part, "model.pt", b"weights").await;
        // In slices of any size: 2.5 MiB sent 64 KiB at a time.
        let chunks: Vec<&[u8]> = big.chunks(64 << 10).collect();
        a.put_file(&part, &announce("sub/dir/optim.pt", &big), body(&chunks))
            .await
            .unwrap();
        assert!(a.index(JOB).await.is_empty(), "not sealed yet");
        assert!(a.file(&part, "model.pt").await.is_none());
        let list = vec![
            announce("sub/dir/optim.pt", &big),
            announce("model.pt", b"weights"),
        ];
        a.seal(&part, &seal_of(&list)).await.unwrap();
        let parts = a.index(JOB).await;
        assert_eq!(parts.len(), 1);
        assert_eq!(
            (parts[0].from.as_str(), parts[0].tag.as_str()),
            ("n2", "s1")
        );
        let mut sorted = list.clone();
        sorted.sort_by(|x, y| x.path.cmp(&y.path));
        assert_eq!(parts[0].files, sorted);
        assert!(a.index(JOB + 1).await.is_empty());
        for (path, bytes) in [("model.pt", &b"weights"[..]), ("sub/dir/optim.pt", &big)] {
            let (got, s) = read(&a, &part, path).await.unwrap();
            assert_eq!(got, bytes, "{path}");
            assert_eq!(s.len, bytes.len() as u64);
            assert_eq!(s.hash, blake3::hash(bytes));
        }
        assert!(a.file(&part, "other").await.is_none());
        assert!(a.file(&key("n3", "s1"), "model.pt").await.is_none());
        assert_eq!(a.used(), 7 + big.len() as u64);
        assert_eq!(a.jobs(), vec![JOB]);
        // Sealing again with the same list (in another order) changes nothing.
        a.seal(&part, &seal_of(&sorted)).await.unwrap();
        assert_eq!(a.index(JOB).await, parts);
        // A node that holds none of the tag seals an empty part.
        a.seal(&key("n3", "s1"), &seal_of(&[])).await.unwrap();
        assert_eq!(a.index(JOB).await.len(), 2);
    }

    /// Issue 26: what a restore reads of a part (the job's nodes, when it was committed) is what
    /// it was sealed with, last; a node list that could not be the job's is refused.
    #[tokio::test]
    async fn a_seal_keeps_the_jobs_nodes_and_commit_time_for_a_restore() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 1 << 20);
        let part = key("n2", "s1");
        put(&a, &part, "f", b"x").await;
        a.seal(&part, &seal_of(&[announce("f", b"x")]))
            .await
            .unwrap();
        let index = a.index(JOB).await;
        assert_eq!(
            (index[0].nodes.as_slice(), index[0].committed_at),
            (&["n1", "n2", "n3"].map(String::from)[..], COMMITTED_AT)
        );
        // Sealed again by a later commit of the same tag on two nodes: the seal is rewritten.
        let later = ReplicaSeal {
            nodes: vec!["n2".into(), "n4".into()],
            committed_at: COMMITTED_AT + 60,
            ..seal_of(&[announce("f", b"x")])
        };
        a.seal(&part, &later).await.unwrap();
        let index = a.index(JOB).await;
        assert_eq!(
            (index[0].nodes.clone(), index[0].committed_at),
            (later.nodes.clone(), later.committed_at)
        );
        let sealed = std::fs::read(t.path().join("replicas/7/n2/s1/SEALED")).unwrap();
        assert_eq!(
            serde_json::from_slice::<ReplicaSeal>(&sealed).unwrap(),
            later
        );
        for nodes in [
            vec!["n1", "n3"],
            vec!["n3", "n2"],
            vec!["n2", "n2"],
            vec!["n2", "../n1"],
            vec![],
        ] {
            let seal = ReplicaSeal {
                nodes: nodes.iter().map(|n| n.to_string()).collect(),
                ..later.clone()
            };
            let e = a.seal(&part, &seal).await.unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{nodes:?}: {e}");
        }
        assert_eq!(a.index(JOB).await, index, "a refused seal changes nothing");
        drop(a);
        let a = area(&t, 1 << 20);
        assert_eq!(a.index(JOB).await, index, "recovered as sealed");
    }

    #[tokio::test]
    async fn the_free_room_is_the_room_less_what_is_stored_and_under_way() {
        let t = tempfile::tempdir().unwrap();
        let a = Arc::new(area(&t, 1000));
        assert_eq!(a.room(), (1000, 1000));
        // A push under way holds its announced 5 bytes.
        let (tx, push) = push_under_way(&a, &key("n3", "s1")).await;
        assert_eq!(a.room(), (995, 1000));
        put(&a, &key("n2", "s1"), "f", &[1; 300]).await;
        assert_eq!(a.room(), (695, 1000));
        drop(tx);
        push.await.unwrap().unwrap_err();
        assert_eq!(a.room(), (700, 1000), "a refused push gives its room back");
        a.free(&key("n2", "s1")).await;
        assert_eq!(a.room(), (1000, 1000));
    }

    #[tokio::test]
    async fn a_body_that_lies_keeps_nothing_and_gives_the_room_back() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 100);
        let part = key("n2", "s1");
        let short = ReplicaFile {
            size: 10,
            ..announce("f", b"12345")
        };
        let long = ReplicaFile {
            size: 5,
            ..announce("f", b"1234567890")
        };
        let other = ReplicaFile {
            blake3: blake3::hash(b"abcde").to_hex().to_string(),
            ..announce("f", b"12345")
        };
        let cut = futures::stream::iter([
            Ok(bytes::Bytes::from_static(b"12")),
            Err("connection reset".into()),
        ])
        .boxed();
        let cases: Vec<(ReplicaFile, sluice_peer::replica::Incoming, &str)> = vec![
            (short, body(&[b"12345"]), "5 bytes came"),
            // Past the size it stops at once: the rest of the body is never read.
            (
                long,
                body(&[b"123", b"4567"]).chain(untouchable()).boxed(),
                "more than",
            ),
            (other, body(&[b"12345"]), "hash"),
            (announce("f", b"12345"), cut, "connection reset"),
        ];
        for (file, body, why) in cases {
            let e = a.put_file(&part, &file, body).await.unwrap_err();
            let cut_off = why == "connection reset";
            match &e {
                ReplicaRefusal::Mismatch(m) if !cut_off => assert!(m.contains(why), "{e}"),
                ReplicaRefusal::Failed(m) if cut_off => assert!(m.contains(why), "{e}"),
                _ => panic!("{e:?}"),
            }
        }
        assert_eq!(a.used(), 0);
        assert_eq!(
            files_below(&t.path().join("replicas")),
            Vec::<String>::new()
        );
        let e = a
            .seal(&part, &seal_of(&[announce("f", b"12345")]))
            .await
            .unwrap_err();
        assert!(matches!(e, ReplicaRefusal::Mismatch(_)), "{e}");
    }

    #[tokio::test]
    async fn a_file_larger_than_the_free_room_is_refused_before_a_byte_is_read() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 100);
        let part = key("n2", "s1");
        put(&a, &part, "a", &[1; 60]).await;
        let e = a
            .put_file(&part, &announce("b", &[2; 50]), untouchable())
            .await
            .unwrap_err();
        assert_eq!(e, ReplicaRefusal::NoRoom { need: 50, free: 40 });
        assert_eq!(a.used(), 60);
        assert_eq!(
            files_below(&t.path().join("replicas")),
            vec!["7/n2/s1/files/a"]
        );
        put(&a, &part, "b", &[2; 40]).await;
        assert_eq!(a.used(), 100);
    }

    #[tokio::test]
    async fn a_seal_holds_only_for_what_was_stored_and_drops_the_rest() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 1 << 20);
        let part = key("n2", "s1");
        put(&a, &part, "a", b"aaa").await;
        put(&a, &part, "dir/b", b"bbbb").await;
        put(&a, &part, "c", b"c").await;
        let changed = ReplicaFile {
            blake3: blake3::hash(b"xxx").to_hex().to_string(),
            ..announce("a", b"aaa")
        };
        let longer = ReplicaFile {
            size: 4,
            ..announce("a", b"aaa")
        };
        for (list, named) in [
            (vec![announce("c", b"c"), changed], "a"),
            (vec![longer, announce("c", b"c")], "a"),
            (
                vec![announce("a", b"aaa"), announce("missing", b"m")],
                "missing",
            ),
        ] {
            let e = a.seal(&part, &seal_of(&list)).await.unwrap_err();
            assert!(
                matches!(&e, ReplicaRefusal::Mismatch(m) if m.starts_with(named)),
                "{e}"
            );
        }
        for list in [
            vec![announce("a", b"aaa"), announce("a", b"aaa")],
            vec![announce("../a", b"aaa")],
            vec![ReplicaFile {
                blake3: "not hex".into(),
                ..announce("a", b"aaa")
            }],
        ] {
            let e = a.seal(&part, &seal_of(&list)).await.unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{e}");
        }
        assert!(a.index(JOB).await.is_empty());
        assert_eq!(a.used(), 8);
        // Sealed with a and c: b, stored but not listed, goes with its room.
        a.seal(
            &part,
            &seal_of(&[announce("a", b"aaa"), announce("c", b"c")]),
        )
        .await
        .unwrap();
        assert_eq!(a.used(), 4);
        assert_eq!(
            files_below(&t.path().join("replicas/7/n2/s1/files")),
            vec!["a", "c"]
        );
        assert!(a.file(&part, "dir/b").await.is_none());
        // A smaller list seals again; the file it leaves out goes.
        a.seal(&part, &seal_of(&[announce("c", b"c")]))
            .await
            .unwrap();
        assert_eq!(a.index(JOB).await[0].files, vec![announce("c", b"c")]);
        assert_eq!(a.used(), 1);
    }

    #[tokio::test]
    async fn a_file_pushed_again_replaces_the_first_and_unseals_its_part() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 150);
        let part = key("n2", "s1");
        put(&a, &part, "f", &[1; 100]).await;
        a.seal(&part, &seal_of(&[announce("f", &[1; 100])]))
            .await
            .unwrap();
        // 100 taken: a push of 50 fits beside it, and replaces it.
        put(&a, &part, "f", &[2; 50]).await;
        assert_eq!(a.used(), 50, "counted once");
        assert!(a.index(JOB).await.is_empty(), "changed since its seal");
        let e = a
            .seal(&part, &seal_of(&[announce("f", &[1; 100])]))
            .await
            .unwrap_err();
        assert!(matches!(e, ReplicaRefusal::Mismatch(_)), "{e}");
        a.seal(&part, &seal_of(&[announce("f", &[2; 50])]))
            .await
            .unwrap();
        assert_eq!(read(&a, &part, "f").await.unwrap().0, [2; 50]);
        assert_eq!(
            files_below(&t.path().join("replicas")).len(),
            2,
            "f and SEALED"
        );
    }

    #[tokio::test]
    async fn freeing_gives_the_room_back_and_removes_the_files() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 1 << 20);
        let top = t.path().join("replicas");
        put(&a, &key("n1", "s1"), "f", &[1; 10]).await;
        a.seal(&key("n1", "s1"), &seal_of(&[announce("f", &[1; 10])]))
            .await
            .unwrap();
        put(&a, &key("n2", "s1"), "f", &[2; 20]).await;
        let other = PartKey {
            job: 8,
            ..key("n1", "s1")
        };
        put(&a, &other, "f", &[3; 40]).await;
        assert_eq!(a.jobs(), vec![7, 8]);
        a.free(&key("n1", "s1")).await;
        assert_eq!(a.used(), 60);
        assert!(a.index(JOB).await.is_empty());
        assert!(!top.join("7/n1/s1").exists());
        // Freeing what is not held is no error.
        a.free(&key("n1", "s1")).await;
        a.free(&key("n9", "s9")).await;
        a.free_job(JOB);
        assert_eq!(a.used(), 40);
        assert_eq!(a.jobs(), vec![8]);
        assert_eq!(files_below(&top), vec!["8/n1/s1/files/f"]);
        assert_eq!(
            std::fs::read_dir(&top).unwrap().count(),
            1,
            "no job 7, nothing being freed"
        );
    }

    /// A push of `f` (5 bytes) under way: its room taken, 2 bytes sent and received; the sender
    /// to go on with. It waits for the receiving side to take the first bytes, not only for the
    /// room: the room is taken on a blocking thread before the push reads its body, and a push
    /// cancelled while that thread runs gives its room back only when the thread is done.
    async fn push_under_way(
        a: &Arc<ReplicaArea>,
        part: &PartKey,
    ) -> (
        futures::channel::mpsc::UnboundedSender<
            Result<bytes::Bytes, Box<dyn std::error::Error + Send + Sync>>,
        >,
        tokio::task::JoinHandle<Result<(), ReplicaRefusal>>,
    ) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let (a2, part) = (a.clone(), part.clone());
        let taken = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = taken.clone();
        let rx = rx.inspect(move |_| seen.store(true, std::sync::atomic::Ordering::SeqCst));
        let push = tokio::spawn(async move {
            a2.put_file(&part, &announce("f", b"12345"), rx.boxed())
                .await
        });
        tx.unbounded_send(Ok(bytes::Bytes::from_static(b"12")))
            .unwrap();
        while !taken.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::task::yield_now().await;
        }
        assert_eq!(a.used(), 5, "the push's room is taken");
        (tx, push)
    }

    #[tokio::test]
    async fn a_push_under_way_when_its_part_is_freed_keeps_nothing() {
        let t = tempfile::tempdir().unwrap();
        let a = Arc::new(area(&t, 1 << 20));
        let part = key("n2", "s1");
        for sealed in [false, true] {
            let (tx, push) = push_under_way(&a, &part).await;
            if sealed {
                a.seal(&part, &seal_of(&[])).await.unwrap();
            } else {
                a.free(&part).await;
            }
            tx.unbounded_send(Ok(bytes::Bytes::from_static(b"345")))
                .unwrap();
            drop(tx);
            let e = push.await.unwrap().unwrap_err();
            let why = if sealed { "sealed" } else { "freed" };
            assert!(e.to_string().contains(why), "{e}");
            assert_eq!(a.used(), 0);
            let held: &[&str] = if sealed { &["7/n2/s1/SEALED"] } else { &[] };
            assert_eq!(files_below(&t.path().join("replicas")), held);
            assert_eq!(a.index(JOB).await.len(), usize::from(sealed));
            a.free(&part).await;
        }
        assert!(a.jobs().is_empty());
        // A request cut off mid-body gives its room back too.
        let (_tx, push) = push_under_way(&a, &part).await;
        push.abort();
        assert!(push.await.unwrap_err().is_cancelled());
        assert_eq!(a.used(), 0);
        assert_eq!(
            files_below(&t.path().join("replicas")),
            Vec::<String>::new()
        );
    }

    #[tokio::test]
    async fn reopening_keeps_the_parts_sealed_whole_and_removes_the_rest() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("replicas");
        let a = area(&t, 1 << 20);
        let sealed = |tag| key("n2", tag);
        for tag in ["whole", "short", "missing"] {
            put(&a, &sealed(tag), "f", &[1; 10]).await;
            put(&a, &sealed(tag), "d/g", &[2; 20]).await;
            a.seal(
                &sealed(tag),
                &seal_of(&[announce("f", &[1; 10]), announce("d/g", &[2; 20])]),
            )
            .await
            .unwrap();
        }
        put(&a, &key("n3", "open"), "f", &[3; 5]).await;
        let index = a.index(JOB).await;
        drop(a);
        std::fs::write(top.join("7/n2/short/files/d/g"), [2; 19]).unwrap();
        std::fs::remove_file(top.join("7/n2/missing/files/f")).unwrap();
        std::fs::write(top.join("junk"), b"x").unwrap();
        std::fs::create_dir_all(top.join(".free-3/x")).unwrap();
        std::fs::create_dir_all(top.join("07/n2/s1")).unwrap();
        std::fs::create_dir_all(top.join("7/n..2")).unwrap();
        std::fs::create_dir_all(top.join("7/bad node/s1")).unwrap();
        std::fs::write(top.join("7/n2/whole/tmp-left"), b"x").unwrap();
        // A seal that is a bare file list, or whose node list does not name its sender.
        let files = [announce("f", &[1; 10]), announce("d/g", &[2; 20])];
        for (tag, seal) in [
            ("bare", serde_json::to_vec(&files).unwrap()),
            (
                "notmine",
                serde_json::to_vec(&ReplicaSeal {
                    nodes: vec!["n1".into(), "n3".into()],
                    ..seal_of(&files)
                })
                .unwrap(),
            ),
        ] {
            std::fs::create_dir_all(top.join(format!("7/n2/{tag}/files/d"))).unwrap();
            std::fs::write(top.join(format!("7/n2/{tag}/files/f")), [1; 10]).unwrap();
            std::fs::write(top.join(format!("7/n2/{tag}/files/d/g")), [2; 20]).unwrap();
            std::fs::write(top.join(format!("7/n2/{tag}/SEALED")), seal).unwrap();
        }

        let a = area(&t, 1 << 20);
        assert_eq!(a.used(), 30);
        assert_eq!(a.index(JOB).await, vec![index[2].clone()]);
        assert_eq!(index[2].tag, "whole");
        assert_eq!(read(&a, &sealed("whole"), "d/g").await.unwrap().0, [2; 20]);
        assert_eq!(
            files_below(&top),
            vec![
                "7/n2/whole/SEALED",
                "7/n2/whole/files/d/g",
                "7/n2/whole/files/f"
            ]
        );
        let mut left: Vec<_> = std::fs::read_dir(&top)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, vec!["7"]);
        // The recovered part is what it was: freed, its room comes back.
        a.free(&sealed("whole")).await;
        assert_eq!(a.used(), 0);
    }

    #[tokio::test]
    async fn names_that_could_leave_the_area_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let a = area(&t, 1 << 20);
        let top = t.path().join("replicas");
        for path in ["../x", "/etc/passwd", "a/../../b", "a//b", ""] {
            let e = a
                .put_file(&key("n2", "s1"), &announce(path, b"x"), untouchable())
                .await
                .unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{path:?}: {e}");
            assert!(a.file(&key("n2", "s1"), path).await.is_none());
        }
        let deep = vec!["d"; safefs::MAX_DEPTH + 1].join("/");
        let e = a
            .put_file(&key("n2", "s1"), &announce(&deep, b"x"), untouchable())
            .await
            .unwrap_err();
        assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{e}");
        let long = "n".repeat(MAX_NODE + 1);
        for from in ["", ".", "..", "a/b", "x y", "n\0", "nœud", long.as_str()] {
            assert!(check_node(from).is_err(), "{from:?}");
            let e = a
                .put_file(&key(from, "s1"), &announce("f", b"x"), untouchable())
                .await
                .unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{from:?}: {e}");
            let e = a.seal(&key(from, "s1"), &seal_of(&[])).await.unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{from:?}: {e}");
        }
        for tag in ["", "..", ".x", "a/b", "s\0"] {
            let e = a
                .put_file(&key("n2", tag), &announce("f", b"x"), untouchable())
                .await
                .unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{tag:?}: {e}");
            let e = a.seal(&key("n2", tag), &seal_of(&[])).await.unwrap_err();
            assert!(matches!(e, ReplicaRefusal::Invalid(_)), "{tag:?}: {e}");
            a.free(&key("n2", tag)).await;
        }
        assert_eq!(std::fs::read_dir(&top).unwrap().count(), 0, "nothing made");
        assert_eq!(a.used(), 0);
    }

    #[tokio::test]
    async fn the_area_is_the_agents_alone() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("replicas");
        std::fs::create_dir(&top).unwrap();
        std::fs::set_permissions(&top, std::fs::Permissions::from_mode(0o755)).unwrap();
        let a = area(&t, 1 << 20);
        put(&a, &key("n2", "s1"), "d/f", b"x").await;
        a.seal(&key("n2", "s1"), &seal_of(&[announce("d/f", b"x")]))
            .await
            .unwrap();
        let me = nix::unistd::geteuid().as_raw();
        for (path, mode) in [
            ("", 0o700),
            ("7", 0o700),
            ("7/n2", 0o700),
            ("7/n2/s1", 0o700),
            ("7/n2/s1/files", 0o700),
            ("7/n2/s1/files/d", 0o700),
            ("7/n2/s1/files/d/f", 0o600),
        ] {
            let st = std::fs::symlink_metadata(top.join(path)).unwrap();
            assert_eq!((st.uid(), st.mode() & 0o7777), (me, mode), "{path}");
        }
        // A link where the area should be is refused.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&top, &link).unwrap();
        let e = ReplicaArea::open(&link, 1 << 20, false).unwrap_err();
        assert!(matches!(e, ReplicaAreaError::Dir { .. }), "{e}");
        assert!(e.to_string().contains("not a symbolic link"), "{e}");
    }

    #[test]
    #[ignore = "needs root: chowns the area to another user"]
    fn an_area_of_another_user_is_refused() {
        sluice_core::testing::assert_root("chowns a directory to another user");
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("replicas");
        std::fs::create_dir(&top).unwrap();
        std::os::unix::fs::chown(&top, Some(65534), Some(65534)).unwrap();
        let e = ReplicaArea::open(&top, 1 << 20, false).unwrap_err();
        assert!(
            matches!(e, ReplicaAreaError::NotOurs { uid: 65534, .. }),
            "{e}"
        );
    }

    #[tokio::test]
    #[ignore = "needs root: mounts a tmpfs"]
    async fn replica_area_mounts_its_own_tmpfs_of_its_room() {
        sluice_core::testing::assert_root("mounts a tmpfs");
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("replicas");
        struct Unmount(PathBuf);
        impl Drop for Unmount {
            fn drop(&mut self) {
                crate::ram_tier::unmount(&self.0);
            }
        }
        let a = ReplicaArea::open(&top, 1 << 20, true).unwrap();
        let _unmount = Unmount(top.clone());
        assert!(crate::ram_tier::is_mount_point(&top));
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let line = mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(top.to_str().unwrap()))
            .expect("the area is mounted");
        assert!(line.starts_with("sluice-replicas "), "{line}");
        assert!(line.contains(" tmpfs "), "{line}");
        for opt in ["nosuid", "nodev", "noexec", "size=1024k", "mode=700"] {
            assert!(line.contains(opt), "{opt} in {line}");
        }
        let e = a
            .put_file(
                &key("n2", "s1"),
                &announce("big", &[0; (1 << 20) + 1]),
                untouchable(),
            )
            .await
            .unwrap_err();
        assert_eq!(
            e,
            ReplicaRefusal::NoRoom {
                need: (1 << 20) + 1,
                free: 1 << 20
            }
        );
        put(&a, &key("n2", "s1"), "f", &[1; 4096]).await;
        a.seal(&key("n2", "s1"), &seal_of(&[announce("f", &[1; 4096])]))
            .await
            .unwrap();
        drop(a);
        // Opened again (the agent restarting, its admin having doubled `replica_room`): the
        // tmpfs is there, with what it holds, at the new size.
        let a = ReplicaArea::open(&top, 2 << 20, true).unwrap();
        assert_eq!(a.used(), 4096);
        assert_eq!(a.index(JOB).await.len(), 1);
        let again = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let lines: Vec<&str> = again
            .lines()
            .filter(|l| l.split(' ').nth(1) == Some(top.to_str().unwrap()))
            .collect();
        assert_eq!(lines.len(), 1, "not mounted twice: {lines:?}");
        for opt in ["nosuid", "nodev", "noexec", "size=2048k", "mode=700"] {
            assert!(lines[0].contains(opt), "{opt} in {}", lines[0]);
        }
        put(&a, &key("n2", "s2"), "g", &[2; (1 << 20) + 4096]).await;
    }
}
