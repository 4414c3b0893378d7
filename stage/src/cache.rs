//! The cross-job cache (`[cache]`): complete copies of the objects jobs staged on this node, in
//! `<hot_tier.root>/cache`, so that the next job on the same data reads nothing from the origin.
//!
//! - **Keys.** An entry is one object as the origin listed it: its URL, the store's endpoint, its
//!   ETag and version, its size ([`Key`]). A changed object lists another ETag (or version, or
//!   size) and misses; an object listed with neither ETag nor version is never cached. Staging
//!   GETs every range with `If-Match` on the listed ETag, so the bytes of an entry are the bytes
//!   of the version its key names. A POSIX file's entry is keyed by its path, device, inode,
//!   size, mtime and ctime, and the job user's uid ([`Key::posix`]): it is served only to that
//!   user, and only when that user's copy helper opened the file again and found that identity
//!   (`stage/posix.rs`). The ctime is what tells a rewrite whose mtime was set back (`touch -d`):
//!   any change to a file sets it to now, and nobody can set it back.
//! - **Filled only from the origin.** An entry is filled in `fill/`, from the same buffers that
//!   write the job's copy (the job's file is the user's, the cache's never is: a user who changes
//!   their copy changes nothing here). Those bytes come from the origin, from a verified entry
//!   (this node's or a job peer's), or from a job peer's unit checked against the hash its owner
//!   took of what it read from the origin. A unit a peer serves with a hash it read back from a
//!   staged copy (a node whose agent restarted serves what it kept so, `stage::resume`) is marked
//!   as such on the wire, and a fill that took one is never committed (`stage::object`): the job
//!   user could have written that copy, and the cache serves every user. (A POSIX file's entry is
//!   kept from the job's staged copy, checked against what the job user's helper read, and is
//!   served to that user alone: see Keys.)
//! - **Never served torn.** A fill is fsynced, hashed (BLAKE3 of the whole entry, read back from
//!   the page cache: one read of what was just written, on a miss only), its key and hash written
//!   next to it (`<id>.meta`), and only then renamed into `data/`. At start every file left in
//!   `fill/` is removed and every entry in `data/` is checked against its key (name = hash of the
//!   key, size = the key's, a hash present): an agent killed mid-fill leaves nothing that is ever
//!   served, and an entry of an agent that kept no hash is removed.
//! - **Verified before it is served** ([`Cache::lookup`], [`Cache::lookup_for_peer`]): an entry's
//!   bytes are hashed and compared with its fill's hash at its first use in each run of the agent,
//!   and again whenever its file is not the one last verified (inode, size, mtime: any write to
//!   it through the file system, even root's, or its replacement changes them; not its ctime,
//!   which a hard link to it changes, see Linked hits); an entry
//!   that fails is dropped and the job reads the origin. Not on every hit: a hit on XFS or btrfs
//!   is a reflink that reads nothing, and hashing the entry each time would make every hit cost a
//!   full read of the object from the hot tier, for a file only root can write. What this leaves
//!   unchecked between two uses is corruption below the file system (XFS keeps no data
//!   checksums), which the first use after an agent restart catches.
//! - **Authorisation** is the staging's: the cache is consulted only for a dataset the job's user
//!   is allowed now (`[[stage.allow]]`, checked at job start), for the objects the origin lists
//!   under it now. Entries are root's, mode 0600, in a root-only directory.
//! - **Eviction.** Least recently used first. A fill that would take the cache past its high
//!   watermark first evicts down to the low one; entries a job is copying out right now are
//!   never evicted; a fill that cannot be made room for is simply not cached (the job is staged
//!   as without a cache). The cache keeps `min_free` of the hot tier free, and gives way to jobs:
//!   a staging write that finds the hot tier full evicts entries and tries again, and
//!   housekeeping evicts before it trims checkpoints.
//! - **Linked hits** (`[cache] link_hits`, off by default). A copy costs a hit the object's bytes
//!   written again, at disk speed, except on XFS and btrfs where it is a reflink. With
//!   `link_hits`, a hit of a job that stages alone on this node's hot tier (no peers: they are
//!   served units from the job's own copy, with hashes a copy takes; not the shared tier, another
//!   file system) is a hard link to the entry instead ([`Hit::link_into`]), made at metadata
//!   speed on any file system. The entry is then root's with mode 0444: the job user reads it
//!   through their link, and may rename or delete their name, but cannot write, truncate or chmod
//!   it (not the owner), so no job ever changes what the cache serves the next one. The entry's
//!   directory stays root's 0700: no other user reaches it except through a job's own private
//!   directory. Evicting it unlinks the cache's name only; the job's copy lives until the job
//!   ends and its directory is removed. A job that writes into its staged dataset in place gets
//!   `EACCES` on such a file, which is why the site turns it on.
//! - **Last use** is the entry's mtime, so the order survives restarts. (The agent sets it on a
//!   hit, right after verifying, and notes the file as verified as it is then.)

use serde::{Deserialize, Serialize};
use sluice_core::config::{CacheConfig, Config};
use sluice_core::rt::{lock, now_secs};
use sluice_core::safefs;
use sluice_proto::msg::{CacheEntry, CacheEvicted, CacheStats};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: safefs::SafeFsError,
    },
}

/// What an entry is a copy of.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Key {
    /// `s3://bucket/key`, `az://container/blob`, `gs://bucket/key`.
    pub url: String,
    /// The store's endpoint (`[[store]] endpoint`), so that two stores with a bucket of the same
    /// name never share entries.
    pub endpoint: Option<String>,
    pub etag: Option<String>,
    pub version: Option<String>,
    pub size: u64,
    /// A POSIX source's file (`url` is then its path): which file it is and whose entry.
    /// Absent for objects, and left out of their JSON, so object entries keep their names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub posix: Option<PosixFile>,
}

/// What names one version of a POSIX file, as the job user's copy helper found it by `fstat` on
/// the descriptor it opened for reading ([`crate::copy_as_user`]), and the user it is
/// cached for: an entry of a POSIX source is only ever served to the same user, and only after
/// that user's helper opened the source again and found the same identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PosixFile {
    pub uid: u32,
    pub dev: u64,
    pub ino: u64,
    /// `st_mtime` and `st_mtime_nsec`.
    pub mtime: i64,
    pub mtime_ns: i64,
    /// `st_ctime` and `st_ctime_nsec`: a user can rewrite a file and set its mtime back, never
    /// its ctime.
    pub ctime: i64,
    pub ctime_ns: i64,
}

impl Key {
    /// The key of `meta`, listed in `bucket_url` (`s3://bucket`); `None` if the listing gave
    /// neither an ETag nor a version (nothing would tell a changed object from this one).
    pub fn of(cfg: &Config, bucket_url: &str, meta: &object_store::ObjectMeta) -> Option<Key> {
        if meta.e_tag.is_none() && meta.version.is_none() {
            return None;
        }
        let url = format!("{bucket_url}/{}", meta.location);
        Some(Key {
            endpoint: cfg.store_for(&url).and_then(|p| p.endpoint.clone()),
            url,
            etag: meta.e_tag.clone(),
            version: meta.version.clone(),
            size: meta.size,
            posix: None,
        })
    }

    /// The key of the POSIX file at `path` (its identity and size as the helper's `fstat` gave
    /// them), cached for the user `file.uid`.
    pub fn posix(path: &str, size: u64, file: PosixFile) -> Key {
        Key {
            url: path.to_string(),
            endpoint: None,
            etag: None,
            version: None,
            size,
            posix: Some(file),
        }
    }

    /// The entry's file name: the BLAKE3 of the key's JSON, in hex.
    fn id(&self) -> String {
        let json = serde_json::to_vec(self).expect("a key serialises");
        blake3::hash(&json).to_hex().to_string()
    }
}

#[derive(Debug)]
struct Entry {
    key: Key,
    /// The BLAKE3 of its bytes, taken by its fill (from `.meta`).
    hash: blake3::Hash,
    /// Its file as it was when its bytes were last found to hash to `hash` (this run of the
    /// agent): while the file is still that (inode, size, mtime, ctime), it is served without
    /// reading it again.
    verified: Option<Seen>,
    /// Seconds since the epoch.
    last_use: u64,
    /// Jobs copying it out right now.
    pins: u32,
}

/// What `<id>.meta` holds: the key, and the BLAKE3 of the entry's bytes as its fill wrote them.
/// (An entry of an agent that kept no hash does not parse, and is removed at start.)
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    key: Key,
    blake3: String,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<String, Entry>,
    /// Bytes of the complete entries, and reserved by fills in progress.
    used: u64,
    reserved: u64,
    filling: HashSet<String>,
    hits: u64,
    misses: u64,
    hit_bytes: u64,
    filled_bytes: u64,
    evictions: u64,
    evicted_bytes: u64,
}

/// The cache of this node.
#[derive(Debug)]
pub struct Cache {
    cfg: CacheConfig,
    node: String,
    path: PathBuf,
    hot_root: PathBuf,
    data: OwnedFd,
    fill: OwnedFd,
    /// The size limit, from the hot tier's size when it is a percent of it.
    capacity: u64,
    state: Mutex<State>,
    fills: AtomicU64,
}

const DATA: &str = "data";
const FILL: &str = "fill";
const META: &str = ".meta";

impl Cache {
    /// Opens (or creates) the cache of `cfg`, checking every entry; `None` without `[cache]`.
    pub fn open(cfg: &Config) -> Result<Option<Arc<Cache>>, CacheError> {
        let Some(cache_cfg) = cfg.cache else {
            return Ok(None);
        };
        let path = cfg.hot_root.join("cache");
        let err = |what: &Path| {
            let path = what.display().to_string();
            move |source| CacheError::Open { path, source }
        };
        let hot = safefs::open_root_dir(&cfg.hot_root).map_err(err(&cfg.hot_root))?;
        let root = safefs::ensure_dir(&hot, "cache", None, 0o700).map_err(err(&path))?;
        let data = safefs::ensure_dir(&root, DATA, None, 0o700).map_err(err(&path))?;
        // What a fill left when the agent stopped is never an entry.
        safefs::remove_tree(&root, FILL, safefs::RemoveAs::agent()).map_err(err(&path))?;
        let fill = safefs::ensure_dir(&root, FILL, None, 0o700).map_err(err(&path))?;
        let total = nix::sys::statvfs::statvfs(&cfg.hot_root)
            .map(|s| s.blocks() * s.fragment_size())
            .unwrap_or(0);
        let cache = Cache {
            cfg: cache_cfg,
            node: cfg.node.clone(),
            path,
            hot_root: cfg.hot_root.clone(),
            capacity: cache_cfg.capacity(total),
            data,
            fill,
            state: Mutex::new(State::default()),
            fills: AtomicU64::new(0),
        };
        let (kept, dropped) = cache.load();
        tracing::info!(
            entries = kept,
            removed = dropped,
            capacity = cache.capacity,
            "cache at {} checked",
            cache.path.display()
        );
        Ok(Some(Arc::new(cache)))
    }

    /// Reads the entries of `data/`: an entry whose key is missing, unreadable, not its name's or
    /// not its size is removed. Returns (kept, removed).
    fn load(&self) -> (u64, u64) {
        let names: Vec<String> = match nix::dir::Dir::openat(
            &self.data,
            ".",
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
            nix::sys::stat::Mode::empty(),
        ) {
            Ok(mut dir) => dir
                .iter()
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str().ok().map(String::from))
                .filter(|n| n != "." && n != "..")
                .collect(),
            Err(e) => {
                tracing::warn!("cache: listing {}: {e}", self.path.display());
                Vec::new()
            }
        };
        let mut st = lock(&self.state);
        let (mut kept, mut dropped) = (0, 0);
        for name in &names {
            if name.ends_with(META) {
                if !names.contains(&name[..name.len() - META.len()].to_string()) {
                    self.unlink(name);
                    dropped += 1;
                }
                continue;
            }
            match self.check_entry(name) {
                Some((key, hash, last_use)) => {
                    st.used += key.size;
                    st.entries.insert(
                        name.clone(),
                        Entry {
                            key,
                            hash,
                            // Read whole at its first use.
                            verified: None,
                            last_use,
                            pins: 0,
                        },
                    );
                    kept += 1;
                }
                None => {
                    self.unlink(name);
                    self.unlink(&format!("{name}{META}"));
                    dropped += 1;
                }
            }
        }
        (kept, dropped)
    }

    fn check_entry(&self, id: &str) -> Option<(Key, blake3::Hash, u64)> {
        let mut text = String::new();
        open_in(&self.data, &format!("{id}{META}"))
            .ok()?
            .read_to_string(&mut text)
            .ok()?;
        let meta: Meta = serde_json::from_str(&text).ok()?;
        let hash = blake3::Hash::from_hex(&meta.blake3).ok()?;
        let st = nix::sys::stat::fstat(open_in(&self.data, id).ok()?.as_fd()).ok()?;
        (meta.key.id() == id && st.st_size as u64 == meta.key.size).then_some((
            meta.key,
            hash,
            st.st_mtime as u64,
        ))
    }

    fn unlink(&self, name: &str) {
        let _ = nix::unistd::unlinkat(&self.data, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }

    fn high(&self) -> u64 {
        self.capacity / 100 * u64::from(self.cfg.high_water)
    }

    fn low(&self) -> u64 {
        self.capacity / 100 * u64::from(self.cfg.low_water)
    }

    /// Whether a hit of a job staging alone here is a link to the entry rather than a copy.
    pub fn links_hits(&self) -> bool {
        self.cfg.link_hits
    }

    /// Whether a complete entry for `key` is here (not counted as a lookup).
    pub fn contains(&self, key: &Key) -> bool {
        lock(&self.state).entries.contains_key(&key.id())
    }

    /// The entry for `key`, pinned until the [`Hit`] is dropped (blocking: opens the file, and
    /// reads it whole unless it is verified already, see [`Cache::open_verified`]).
    pub fn lookup(self: &Arc<Self>, key: &Key) -> Option<Hit> {
        let hit = self.open_verified(key, true);
        let mut st = lock(&self.state);
        if hit.is_some() {
            st.hits += 1;
            st.hit_bytes += key.size;
        } else {
            st.misses += 1;
        }
        hit
    }

    /// The entry for `key`, opened and pinned, once its bytes are known to be those its fill
    /// hashed: its file is the one last found so (same inode, size, mtime and ctime: any write to
    /// it, or a replacement, changes them), or it is read whole now and hashes right. An entry
    /// that is gone, of another size, or whose bytes are not its fill's is dropped (`None`: the
    /// caller reads the origin). `touch` sets its mtime to now (its last use, across restarts).
    fn open_verified(self: &Arc<Self>, key: &Key, touch: bool) -> Option<Hit> {
        let id = key.id();
        let (file, hash, verified) = {
            let mut st = lock(&self.state);
            let entry = st.entries.get(&id)?;
            let (hash, verified) = (entry.hash, entry.verified);
            match open_in(&self.data, &id) {
                Ok(f) if f.metadata().is_ok_and(|m| m.len() == key.size) => {
                    let entry = st.entries.get_mut(&id).expect("looked up above");
                    entry.pins += 1;
                    entry.last_use = now_secs();
                    (f, hash, verified)
                }
                other => {
                    tracing::warn!(
                        "cache: entry {id} of {} is gone or changed ({:?}); dropped",
                        key.url,
                        other.err()
                    );
                    self.drop_entry(&mut st, &id);
                    return None;
                }
            }
        };
        // Pinned from here until `hit` is dropped.
        let hit = Hit {
            cache: self.clone(),
            id: id.clone(),
            file,
        };
        let mut now = match check_bytes(&hit.file, &hash, verified) {
            Ok(now) => now,
            Err(why) => {
                tracing::warn!(
                    "cache: entry {id} of {} is not what its fill wrote ({why}); dropped, the object is read from the origin",
                    key.url
                );
                drop(hit);
                self.drop_entry(&mut lock(&self.state), &id);
                return None;
            }
        };
        if touch {
            let t = nix::sys::time::TimeSpec::from(std::time::Duration::from_secs(now_secs()));
            let _ = nix::sys::stat::futimens(hit.file.as_fd(), &t, &t);
            // The agent's own change: the file is still the one just verified.
            now = now.and_then(|_| Seen::of(&hit.file).ok());
        }
        if let Some(e) = lock(&self.state).entries.get_mut(&id) {
            e.verified = now;
        }
        Some(hit)
    }

    /// Forgets the entry `id` and removes its files.
    fn drop_entry(&self, st: &mut State, id: &str) {
        if let Some(e) = st.entries.remove(id) {
            st.used -= e.key.size;
        }
        self.unlink(&format!("{id}{META}"));
        self.unlink(id);
    }

    /// Starts a new entry for `key` (blocking), making room for it first; `Err` says why it will
    /// not be cached (an entry for it exists or is being filled, it is larger than the cache, or no
    /// room can be made: entries in use, or the hot tier is full).
    pub fn begin_fill(self: &Arc<Self>, key: Key) -> Result<Fill, String> {
        let id = key.id();
        let size = key.size;
        {
            let mut st = lock(&self.state);
            if st.entries.contains_key(&id) || st.filling.contains(&id) {
                return Err(format!("{} is cached already (or being cached)", key.url));
            }
            if size > self.high() {
                return Err(format!(
                    "{} ({} bytes) is larger than the cache's high watermark ({} bytes)",
                    key.url,
                    size,
                    self.high()
                ));
            }
            if st.used + st.reserved + size > self.high() {
                let goal = self.low().saturating_sub(size);
                self.evict_lru(&mut st, |st| st.used + st.reserved <= goal);
                if st.used + st.reserved + size > self.high() {
                    return Err(format!(
                        "no room in the cache for {}: its entries are in use",
                        key.url
                    ));
                }
            }
            // The hot tier keeps min_free for jobs, whatever the cache's own limit.
            let usage = nix::sys::statvfs::statvfs(&self.hot_root).ok();
            if let Some(s) = usage {
                let frag = s.fragment_size();
                let (total, free) = (s.blocks() * frag, s.blocks_available() * frag);
                let keep = total / 100 * u64::from(self.cfg.min_free);
                let need = (keep + size + st.reserved).saturating_sub(free);
                if need > 0 {
                    let start = st.evicted_bytes;
                    self.evict_lru(&mut st, |st| st.evicted_bytes - start >= need);
                    if st.evicted_bytes - start < need {
                        return Err(format!(
                            "no room on the hot tier to cache {} (the cache leaves {}% of it free)",
                            key.url, self.cfg.min_free
                        ));
                    }
                }
            }
            st.reserved += size;
            st.filling.insert(id.clone());
        }
        let name = format!(
            "{id}.{}.{}",
            std::process::id(),
            self.fills.fetch_add(1, Ordering::Relaxed)
        );
        match safefs::create_file(&self.fill, &name, None, 0o600) {
            Ok(f) => Ok(Fill {
                cache: self.clone(),
                id,
                key,
                name,
                file: Arc::new(f),
                tainted: AtomicBool::new(false),
                committed: false,
            }),
            Err(e) => {
                let mut st = lock(&self.state);
                st.reserved -= size;
                st.filling.remove(&id);
                Err(format!("cannot create a cache entry: {e}"))
            }
        }
    }

    /// Evicts least recently used entries not in use until `enough` says so (or none is left).
    fn evict_lru(&self, st: &mut State, enough: impl Fn(&State) -> bool) {
        let mut order: Vec<(u64, String)> = st
            .entries
            .iter()
            .filter(|(_, e)| e.pins == 0)
            .map(|(id, e)| (e.last_use, id.clone()))
            .collect();
        order.sort();
        for (_, id) in order {
            if enough(st) {
                return;
            }
            self.remove(st, &id);
        }
    }

    fn remove(&self, st: &mut State, id: &str) {
        if let Some(e) = st.entries.remove(id) {
            // The key first: an entry without its key is removed at the next start anyway.
            self.unlink(&format!("{id}{META}"));
            self.unlink(id);
            st.used -= e.key.size;
            st.evictions += 1;
            st.evicted_bytes += e.key.size;
            tracing::info!(url = e.key.url, bytes = e.key.size, "cache entry evicted");
        }
    }

    /// Gives up to `bytes` of the hot tier back to jobs (blocking): evicts least recently used
    /// entries not in use. Returns the bytes freed.
    pub fn yield_space(&self, bytes: u64) -> u64 {
        let mut st = lock(&self.state);
        let start = st.evicted_bytes;
        self.evict_lru(&mut st, |st| st.evicted_bytes - start >= bytes);
        st.evicted_bytes - start
    }

    /// Removes the entries whose URL starts with `prefix`, unless a job is using them.
    pub fn evict_prefix(&self, prefix: &str, dry_run: bool) -> CacheEvicted {
        let mut st = lock(&self.state);
        let matching: Vec<(String, u64, bool)> = st
            .entries
            .iter()
            .filter(|(_, e)| e.key.url.starts_with(prefix))
            .map(|(id, e)| (id.clone(), e.key.size, e.pins > 0))
            .collect();
        let mut out = CacheEvicted {
            node: self.node.clone(),
            entries: 0,
            bytes: 0,
            in_use: 0,
            dry_run,
        };
        for (id, size, in_use) in matching {
            if in_use {
                out.in_use += 1;
                continue;
            }
            out.entries += 1;
            out.bytes += size;
            if !dry_run {
                self.remove(&mut st, &id);
            }
        }
        out
    }

    pub fn stats(&self) -> CacheStats {
        let st = lock(&self.state);
        CacheStats {
            root: self.path.display().to_string(),
            capacity_bytes: self.capacity,
            high_water_bytes: self.high(),
            low_water_bytes: self.low(),
            used_bytes: st.used,
            entries: st.entries.len() as u64,
            hits: st.hits,
            misses: st.misses,
            hit_bytes: st.hit_bytes,
            filled_bytes: st.filled_bytes,
            evictions: st.evictions,
            evicted_bytes: st.evicted_bytes,
        }
    }

    /// The entries whose URL starts with `prefix`, least recently used first.
    pub fn entries(&self, prefix: Option<&str>) -> Vec<CacheEntry> {
        let st = lock(&self.state);
        let mut out: Vec<CacheEntry> = st
            .entries
            .values()
            .filter(|e| prefix.is_none_or(|p| e.key.url.starts_with(p)))
            .map(|e| CacheEntry {
                url: e.key.url.clone(),
                etag: e.key.etag.clone(),
                version: e.key.version.clone(),
                size: e.key.size,
                last_use: e.last_use,
                in_use: e.pins > 0,
            })
            .collect();
        out.sort_by(|a, b| (a.last_use, &a.url).cmp(&(b.last_use, &b.url)));
        out
    }
}

fn open_in(dir: &OwnedFd, name: &str) -> io::Result<File> {
    use nix::fcntl::OFlag;
    let fd = nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    Ok(File::from(fd))
}

/// A complete entry, kept from eviction while held.
#[derive(Debug)]
pub struct Hit {
    cache: Arc<Cache>,
    id: String,
    file: File,
}

impl Hit {
    /// Copies the entry into `dst` (blocking): a reflink where the file system has them, else an
    /// in-kernel copy, else read and write; with `unit_size`, read and write, returning the
    /// BLAKE3 of each `unit_size` range (what the job's peers check the units against).
    pub fn copy_to(&self, dst: &File, unit_size: Option<u64>) -> io::Result<Vec<blake3::Hash>> {
        let size = self.file.metadata()?.len();
        if let Some(unit) = unit_size {
            return copy_hashing(&self.file, dst, size, unit);
        }
        // std copies file to file with copy_file_range, which clones the extents where the file
        // system can (XFS, btrfs: a reflink, no data written) and copies in the kernel where it
        // cannot, falling back to read and write. It goes from both files' offsets: from the
        // start, also when a caller tries again after a failed copy.
        use std::io::Seek;
        (&self.file).seek(io::SeekFrom::Start(0))?;
        (&*dst).seek(io::SeekFrom::Start(0))?;
        let copied = io::copy(&mut &self.file, &mut &*dst)?;
        if copied != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the cache entry is shorter than its key says",
            ));
        }
        Ok(Vec::new())
    }
}

impl Hit {
    /// Blocking. Links the entry as `name` in `dir` (the job's copy of it, see the module header,
    /// Linked hits), making it read-only first: `EEXIST` if the name is taken, `EXDEV` on another
    /// file system.
    pub fn link_into(&self, dir: &OwnedFd, name: &str) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        if self.file.metadata()?.permissions().mode() & 0o7777 != 0o444 {
            nix::sys::stat::fchmod(&self.file, nix::sys::stat::Mode::from_bits_truncate(0o444))?;
        }
        nix::unistd::linkat(
            &self.cache.data,
            self.id.as_str(),
            dir,
            name,
            nix::fcntl::AtFlags::empty(),
        )?;
        Ok(())
    }
}

/// Copies `size` bytes of `src` to `dst` through one buffer, hashing each `unit` range.
fn copy_hashing(src: &File, dst: &File, size: u64, unit: u64) -> io::Result<Vec<blake3::Hash>> {
    let mut buf = vec![0u8; 4 << 20];
    let mut hashes = Vec::new();
    let mut hasher = blake3::Hasher::new();
    let (mut at, mut in_unit) = (0u64, 0u64);
    while at < size {
        let n = (buf.len() as u64).min(size - at).min(unit - in_unit) as usize;
        src.read_exact_at(&mut buf[..n], at)?;
        sluice_core::pagecache::write_all_at(dst, &buf[..n], at)?;
        hasher.update(&buf[..n]);
        at += n as u64;
        in_unit += n as u64;
        if in_unit == unit || at == size {
            hashes.push(hasher.finalize());
            hasher = blake3::Hasher::new();
            in_unit = 0;
        }
    }
    Ok(hashes)
}

/// Which version of an entry's file was last read whole and found right: its inode, size and
/// mtime. Not its ctime, which a hard link made or removed changes (a job's copy of a linked hit,
/// made at the hit and removed at the job's end): only root can change an entry's bytes or set its
/// mtime (the file is root's, read-only or private, in a root-only directory), and a write sets
/// its mtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    ino: u64,
    size: u64,
    mtime_ns: i64,
}

impl Seen {
    /// Blocking. The file open as `file`, now (`fstat`).
    fn of(file: &File) -> io::Result<Seen> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata()?;
        Ok(Seen {
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
        })
    }
}

/// Blocking. The BLAKE3 of the first `size` bytes of `file`, read with `pread` (the file's offset
/// is left where it is, for [`Hit::copy_to`]).
fn hash_file(file: &File, size: u64) -> io::Result<blake3::Hash> {
    let mut buf = vec![0u8; (1 << 20).min(size.max(1)) as usize];
    let mut hasher = blake3::Hasher::new();
    let mut at = 0u64;
    while at < size {
        let n = (buf.len() as u64).min(size - at) as usize;
        file.read_exact_at(&mut buf[..n], at)?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    Ok(hasher.finalize())
}

/// Blocking. Whether the entry open as `file` holds the bytes its fill hashed to `hash`: at once
/// when it is still the file `verified` names, else by reading it whole. `Ok` with its identity
/// now (`None` if it changed while it was read: verified, but read whole again next time).
fn check_bytes(
    file: &File,
    hash: &blake3::Hash,
    verified: Option<Seen>,
) -> Result<Option<Seen>, String> {
    let before = Seen::of(file).map_err(|e| e.to_string())?;
    if verified == Some(before) {
        return Ok(Some(before));
    }
    let got = hash_file(file, before.size).map_err(|e| format!("reading it: {e}"))?;
    if got != *hash {
        return Err(format!("its BLAKE3 is {got}, its fill's was {hash}"));
    }
    Ok(Seen::of(file).ok().filter(|now| *now == before))
}

impl Drop for Hit {
    fn drop(&mut self) {
        let mut st = lock(&self.cache.state);
        if let Some(e) = st.entries.get_mut(&self.id) {
            e.pins = e.pins.saturating_sub(1);
        }
    }
}

/// An entry being filled: written by staging alongside the job's copy, an entry once committed.
#[derive(Debug)]
pub struct Fill {
    cache: Arc<Cache>,
    id: String,
    key: Key,
    /// Its name in `fill/`.
    name: String,
    file: Arc<File>,
    tainted: AtomicBool,
    committed: bool,
}

impl Fill {
    /// The entry's file, for a fill with no job copy beside it (`sluice cache warm`).
    pub fn file(&self) -> Arc<File> {
        self.file.clone()
    }

    /// Writes `buf` at `offset` (blocking); a failure only means the object is not cached.
    pub fn write_at(&self, buf: &[u8], offset: u64) {
        if self.tainted.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = sluice_core::pagecache::write_all_at(&self.file, buf, offset) {
            self.taint(&format!("writing it failed: {e}"));
        }
    }

    /// The entry will not be committed (its bytes are not known to be the object's).
    pub fn taint(&self, why: &str) {
        if !self.tainted.swap(true, Ordering::Relaxed) {
            tracing::info!("cache: {} is not cached: {why}", self.key.url);
        }
    }

    /// Makes the entry servable (blocking), once every byte of the object is written: fsynced,
    /// its key beside it, renamed into `data/`. Returns whether it is now an entry.
    pub fn commit(mut self) -> bool {
        if self.tainted.load(Ordering::Relaxed) {
            return false;
        }
        match self.publish() {
            Ok((hash, verified)) => {
                self.committed = true;
                let mut st = lock(&self.cache.state);
                st.reserved -= self.key.size;
                st.filling.remove(&self.id);
                st.used += self.key.size;
                st.filled_bytes += self.key.size;
                st.entries.insert(
                    self.id.clone(),
                    Entry {
                        key: self.key.clone(),
                        hash,
                        verified,
                        last_use: now_secs(),
                        pins: 0,
                    },
                );
                true
            }
            Err(e) => {
                tracing::warn!("cache: {} is not cached: {e}", self.key.url);
                false
            }
        }
    }

    /// Returns the BLAKE3 of the entry's bytes and its file's identity once in `data/`.
    fn publish(&self) -> io::Result<(blake3::Hash, Option<Seen>)> {
        let file = self.file();
        if file.metadata()?.len() != self.key.size {
            return Err(io::Error::other("not every byte of the object was written"));
        }
        file.sync_all()?;
        // Read back from the page cache: the fill is root's, in a root-only directory, and holds
        // exactly what staging wrote into it (bytes from the origin, a verified entry, or units
        // the job's peers read from the origin; never a read-back of a user's file).
        let c = &self.cache;
        // (Opened again: the fill's own descriptor is write-only.)
        let hash = hash_file(&open_in(&c.fill, &self.name)?, self.key.size)?;
        let meta_tmp = format!("{}{META}", self.name);
        {
            let mut f = safefs::create_file(&c.fill, &meta_tmp, None, 0o600)
                .map_err(|e| io::Error::other(e.to_string()))?;
            let meta = Meta {
                key: self.key.clone(),
                blake3: hash.to_hex().to_string(),
            };
            std::io::Write::write_all(&mut f, &serde_json::to_vec(&meta)?)?;
            f.sync_all()?;
        }
        nix::fcntl::renameat(
            &c.fill,
            meta_tmp.as_str(),
            &c.data,
            format!("{}{META}", self.id).as_str(),
        )?;
        nix::fcntl::renameat(&c.fill, self.name.as_str(), &c.data, self.id.as_str())?;
        nix::unistd::fsync(&c.data)?;
        // After the rename, which may set its ctime.
        Ok((hash, Seen::of(&file).ok()))
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let _ = nix::unistd::unlinkat(
            &self.cache.fill,
            self.name.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        let mut st = lock(&self.cache.state);
        st.reserved -= self.key.size;
        st.filling.remove(&self.id);
    }
}

#[cfg(test)]
mod tests;

/// Serving the job peers of a node that missed (`stage::peers`): a peer's read of an entry pins it
/// like a job's, and counts as a use for eviction, not as this node's hit or miss.
impl Cache {
    /// The entry for `key`, pinned until the [`Hit`] is dropped (blocking: opens the file, and
    /// verifies it as [`Cache::lookup`] does).
    pub fn lookup_for_peer(self: &Arc<Self>, key: &Key) -> Option<Hit> {
        self.open_verified(key, false)
    }
}

impl Hit {
    /// Reads `buf.len()` bytes of the entry at `offset` (blocking).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
}
