//! Checkpoints of a job on this node: commit, archive scheduling, retention.
//!
//! A checkpoint is the directory `$SLUICE_CKPT_DIR/TAG`. It becomes *committed* by `sluice ckpt commit`
//! or by a framework's completion signal, found by rescanning (never by file-system events alone):
//! DeepSpeed's `latest` file, Megatron's `latest_checkpointed_iteration.txt`, and the `.metadata` file
//! that `torch.distributed.checkpoint` writes last. Only committed checkpoints are archived, restored
//! or counted by retention.
//!
//! Multi-node jobs: every node archives its own files of a checkpoint as one *part*; the archive's
//! MANIFEST is published when every node's part is there. A node learns about a commit made on another
//! node from the archive itself (a tag with parts but without this node's part), so one commit, or one
//! framework signal on one node, is enough.
//!
//! Retention keeps the newest `--ckpt-keep` archived checkpoints on the hot tier and deletes older
//! archived ones. It never deletes a checkpoint that is not archived, never the newest archived one
//! (keep >= 1), and never an uncommitted directory while the job runs.

use sluice_archive::safefs;
use sluice_proto::msg::{CkptState, CkptStatus};
use sluice_proto::options::validate_tag;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Largest completion-signal file read (`latest`, `latest_checkpointed_iteration.txt`).
const MAX_SIGNAL_FILE: usize = 256;

/// One committed checkpoint.
#[derive(Debug)]
pub struct CkptEntry {
    pub tag: String,
    pub committed_at: u64,
    state: Mutex<CkptState>,
    archived_at: Mutex<Option<u64>>,
    error: Mutex<Option<String>>,
    on_hot: AtomicBool,
    /// Bumped by every (re-)commit: an archive attempt of an older generation is discarded.
    generation: AtomicU64,
    pub files: AtomicU64,
    pub raw_bytes: AtomicU64,
    pub stored_bytes: AtomicU64,
    pub bytes_done: AtomicU64,
    /// Attempts since the last success, for backoff.
    pub failures: AtomicU64,
    /// Refused by the archive (a symlink, a hard link, a foreign file): not a checkpoint sluice will
    /// keep; deleted with the job's uncommitted directories when the job ends.
    pub refused: AtomicBool,
}

impl CkptEntry {
    pub fn new(tag: &str, committed_at: u64) -> CkptEntry {
        CkptEntry {
            tag: tag.to_string(),
            committed_at,
            state: Mutex::new(CkptState::Committed),
            archived_at: Mutex::new(None),
            error: Mutex::new(None),
            on_hot: AtomicBool::new(true),
            generation: AtomicU64::new(1),
            files: AtomicU64::new(0),
            raw_bytes: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
            bytes_done: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            refused: AtomicBool::new(false),
        }
    }

    pub fn state(&self) -> CkptState {
        *lock(&self.state)
    }

    pub fn set_state(&self, state: CkptState) {
        *lock(&self.state) = state;
        if matches!(
            state,
            CkptState::Archived | CkptState::WaitingForNodes | CkptState::Archiving
        ) {
            *lock(&self.error) = None;
        }
    }

    pub fn set_error(&self, state: CkptState, message: String) {
        *lock(&self.state) = state;
        *lock(&self.error) = Some(message);
    }

    pub fn set_archived(&self, at: u64) {
        *lock(&self.archived_at) = Some(at);
        self.failures.store(0, Ordering::Relaxed);
        self.set_state(CkptState::Archived);
    }

    pub fn archived_at(&self) -> Option<u64> {
        *lock(&self.archived_at)
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub fn on_hot(&self) -> bool {
        self.on_hot.load(Ordering::Relaxed)
    }

    pub fn set_on_hot(&self, v: bool) {
        self.on_hot.store(v, Ordering::Relaxed);
    }

    /// Needs (another) upload attempt from this node.
    pub fn needs_upload(&self) -> bool {
        matches!(
            self.state(),
            CkptState::Committed | CkptState::Archiving | CkptState::Retrying
        )
    }

    pub fn status(&self, archive_url: &str) -> CkptStatus {
        CkptStatus {
            tag: self.tag.clone(),
            state: self.state(),
            on_hot_tier: self.on_hot(),
            archive_url: archive_url.to_string(),
            files: self.files.load(Ordering::Relaxed),
            raw_bytes: self.raw_bytes.load(Ordering::Relaxed),
            stored_bytes: self.stored_bytes.load(Ordering::Relaxed),
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            committed_at: self.committed_at,
            archived_at: self.archived_at(),
            error: lock(&self.error).clone(),
        }
    }
}

/// A job's checkpoints on this node.
#[derive(Debug, Default)]
pub struct JobCkpts {
    entries: Mutex<BTreeMap<String, Arc<CkptEntry>>>,
    /// Wakes the job's checkpoint worker (a commit arrived, the job ended).
    pub wake: tokio::sync::Notify,
}

/// What a commit request did.
#[derive(Debug, PartialEq, Eq)]
pub enum CommitOutcome {
    New,
    /// Committed again after files changed during its archive: archived anew.
    Recommitted,
    /// Already committed and not yet archived: nothing to do.
    AlreadyPending,
}

impl JobCkpts {
    pub fn entries(&self) -> Vec<Arc<CkptEntry>> {
        let mut v: Vec<_> = lock(&self.entries).values().cloned().collect();
        v.sort_by(|a, b| (a.committed_at, &a.tag).cmp(&(b.committed_at, &b.tag)));
        v
    }

    pub fn get(&self, tag: &str) -> Option<Arc<CkptEntry>> {
        lock(&self.entries).get(tag).cloned()
    }

    pub fn insert(&self, entry: Arc<CkptEntry>) {
        lock(&self.entries).insert(entry.tag.clone(), entry);
    }

    /// Records a commit of `tag`. An already archived tag is refused: archives are immutable, so a
    /// changed checkpoint needs a new tag.
    pub fn commit(&self, tag: &str, now: u64) -> Result<CommitOutcome, String> {
        let mut entries = lock(&self.entries);
        match entries.get(tag) {
            None => {
                entries.insert(tag.to_string(), Arc::new(CkptEntry::new(tag, now)));
                Ok(CommitOutcome::New)
            }
            Some(e) => match e.state() {
                CkptState::Modified => {
                    e.generation.fetch_add(1, Ordering::Relaxed);
                    e.failures.store(0, Ordering::Relaxed);
                    e.refused.store(false, Ordering::Relaxed);
                    e.set_state(CkptState::Committed);
                    Ok(CommitOutcome::Recommitted)
                }
                CkptState::Archived | CkptState::WaitingForNodes => Err(format!(
                    "checkpoint {tag} is already archived (or waiting for the job's other nodes); archives are immutable — save the new state under a new tag"
                )),
                _ => Ok(CommitOutcome::AlreadyPending),
            },
        }
    }

    /// Any checkpoint that still needs work from this node (upload, or waiting for other nodes).
    pub fn pending(&self) -> bool {
        lock(&self.entries)
            .values()
            .any(|e| !matches!(e.state(), CkptState::Archived | CkptState::Modified))
    }

    /// Tags retention removes now: archived ones on the hot tier beyond the newest `keep`.
    pub fn to_trim(&self, keep: u32) -> Vec<Arc<CkptEntry>> {
        let archived: Vec<_> = self
            .entries()
            .into_iter()
            .filter(|e| e.state() == CkptState::Archived && e.on_hot())
            .collect();
        let excess = archived.len().saturating_sub(keep.max(1) as usize);
        archived.into_iter().take(excess).collect()
    }
}

/// Checks a commit's tag and that `ckpt/TAG` is a directory owned by the job user (no symlink).
pub fn check_commit_dir(ckpt_dir: &OwnedFd, tag: &str, uid: u32) -> Result<(), String> {
    validate_tag("sluice ckpt commit", tag).map_err(|e| e.message)?;
    let fd = safefs::open_dir(ckpt_dir, tag).map_err(|e| match e.errno() {
        Some(nix::errno::Errno::ENOENT) => {
            format!("there is no checkpoint directory $SLUICE_CKPT_DIR/{tag} on this node")
        }
        Some(nix::errno::Errno::ENOTDIR | nix::errno::Errno::ELOOP) => {
            format!("$SLUICE_CKPT_DIR/{tag} is not a directory (symlinks are not followed)")
        }
        _ => format!("$SLUICE_CKPT_DIR/{tag}: {e}"),
    })?;
    let st = nix::sys::stat::fstat(&fd).map_err(|e| format!("$SLUICE_CKPT_DIR/{tag}: {e}"))?;
    if st.st_uid != uid {
        return Err(format!(
            "$SLUICE_CKPT_DIR/{tag} is not owned by the job's user"
        ));
    }
    Ok(())
}

/// Reads a small completion-signal file without following links; `None` if absent or unusable.
fn read_signal(dir: impl AsFd, name: &str, uid: u32) -> Option<String> {
    use nix::fcntl::{OFlag, openat};
    use std::io::Read;
    let fd = openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    let st = nix::sys::stat::fstat(&fd).ok()?;
    let regular = nix::sys::stat::SFlag::from_bits_truncate(st.st_mode)
        & nix::sys::stat::SFlag::S_IFMT
        == nix::sys::stat::SFlag::S_IFREG;
    if !regular || st.st_uid != uid {
        return None;
    }
    let mut buf = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_SIGNAL_FILE as u64)
        .read_to_end(&mut buf)
        .ok()?;
    Some(String::from_utf8_lossy(&buf).trim().to_string())
}

fn is_dir_of(dir: impl AsFd, name: &str, uid: u32) -> bool {
    safefs::check_component(name).is_ok()
        && safefs::open_dir(dir, name)
            .ok()
            .and_then(|fd| nix::sys::stat::fstat(&fd).ok())
            .is_some_and(|st| st.st_uid == uid)
}

/// Finds the tags that frameworks marked complete in the job's checkpoint directory.
pub fn scan_signals(ckpt_dir: &OwnedFd, uid: u32) -> Vec<String> {
    let mut tags = Vec::new();
    // DeepSpeed: `latest` holds the tag of the last complete checkpoint.
    if let Some(tag) = read_signal(ckpt_dir, "latest", uid) {
        if validate_tag("latest", &tag).is_ok() && is_dir_of(ckpt_dir, &tag, uid) {
            tags.push(tag);
        }
    }
    // Megatron: `latest_checkpointed_iteration.txt` holds N; the checkpoint is `iter_%07d`.
    if let Some(n) = read_signal(ckpt_dir, "latest_checkpointed_iteration.txt", uid)
        .and_then(|s| s.parse::<u64>().ok())
    {
        let tag = format!("iter_{n:07}");
        if is_dir_of(ckpt_dir, &tag, uid) {
            tags.push(tag);
        }
    }
    // torch.distributed.checkpoint: `TAG/.metadata` is written last.
    if let Ok(dup) = ckpt_dir.try_clone() {
        if let Ok(mut d) = nix::dir::Dir::from_fd(dup) {
            let names: Vec<String> = d
                .iter()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type() == Some(nix::dir::Type::Directory))
                .filter_map(|e| e.file_name().to_str().ok().map(String::from))
                .filter(|n| validate_tag("scan", n).is_ok())
                .take(10_000)
                .collect();
            for name in names {
                if let Ok(sub) = safefs::open_dir(ckpt_dir, &name) {
                    if read_signal(&sub, ".metadata", uid).is_some() {
                        tags.push(name);
                    }
                }
            }
        }
    }
    tags.sort();
    tags.dedup();
    tags
}

/// Replaces `{user}`, `{job_id}`, `{job_name}` in an archive URL template.
pub fn expand(template: &str, user: &str, job_id: u32, job_name: &str) -> String {
    template
        .replace("{user}", user)
        .replace("{job_id}", &job_id.to_string())
        .replace("{job_name}", job_name)
}

/// Resolves the job's archive URL (its `--ckpt-archive`, else the admin default) and checks it
/// against the allow-list. `groups` are the names of the user's groups.
pub fn resolve_archive(
    cfg: &sluice_archive::config::CkptConfig,
    requested: Option<&str>,
    user: &str,
    groups: &[String],
    job_id: u32,
    job_name: &str,
) -> Result<Option<String>, String> {
    let url = match (requested, &cfg.default_archive) {
        (Some(u), _) => u.trim_end_matches('/').to_string(),
        (None, Some(t)) => expand(t, user, job_id, &sanitize_name(job_name))
            .trim_end_matches('/')
            .to_string(),
        (None, None) => return Ok(None),
    };
    if url.split('/').any(|seg| seg == "..") {
        return Err(format!("archive URL {url} may not hold '..'"));
    }
    if cfg.allow.is_empty() {
        return Ok(Some(url));
    }
    let with_slash = format!("{url}/");
    let allowed = cfg.allow.iter().any(|rule| {
        let applies = (rule.users.is_empty() && rule.groups.is_empty())
            || rule.users.iter().any(|u| u == user)
            || rule.groups.iter().any(|g| groups.contains(g));
        let prefix = expand(&rule.prefix, user, job_id, job_name);
        applies && with_slash.starts_with(&prefix)
    });
    if allowed {
        Ok(Some(url))
    } else {
        let yours: Vec<String> = cfg
            .allow
            .iter()
            .filter(|r| {
                (r.users.is_empty() && r.groups.is_empty())
                    || r.users.iter().any(|u| u == user)
                    || r.groups.iter().any(|g| groups.contains(g))
            })
            .map(|r| expand(&r.prefix, user, job_id, job_name))
            .collect();
        Err(format!(
            "--ckpt-archive={url} is not allowed by the site's policy; allowed for you: {}",
            if yours.is_empty() {
                "none (ask your admin)".to_string()
            } else {
                yours.join(", ")
            }
        ))
    }
}

/// Whether `url` lies under a rule of `rules` that applies to `user` (or one of `groups`).
pub fn allowed_by(
    rules: &[sluice_archive::config::AllowRule],
    url: &str,
    user: &str,
    groups: &[String],
    job_id: u32,
    job_name: &str,
) -> bool {
    let with_slash = format!("{}/", url.trim_end_matches('/'));
    rules.iter().any(|rule| {
        let applies = (rule.users.is_empty() && rule.groups.is_empty())
            || rule.users.iter().any(|u| u == user)
            || rule.groups.iter().any(|g| groups.contains(g));
        applies && with_slash.starts_with(&expand(&rule.prefix, user, job_id, job_name))
    })
}

/// Job names become one object-key segment.
fn sanitize_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(128)
        .collect();
    if s.is_empty() || s == "." || s == ".." {
        "job".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_archive::config::{AllowRule, Config};

    fn cfg(allow: Vec<AllowRule>) -> sluice_archive::config::CkptConfig {
        let mut c = Config::parse(
            "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n",
            "n1",
        )
        .unwrap()
        .ckpt;
        c.allow = allow;
        c.default_archive = Some("s3://ckpt/{user}/{job_name}".into());
        c
    }

    #[test]
    fn archive_policy() {
        let c = cfg(vec![
            AllowRule {
                prefix: "s3://ckpt/{user}/".into(),
                ..Default::default()
            },
            AllowRule {
                prefix: "s3://team/".into(),
                groups: vec!["ml".into()],
                ..Default::default()
            },
        ]);
        assert_eq!(
            resolve_archive(&c, None, "alice", &[], 7, "my run")
                .unwrap()
                .unwrap(),
            "s3://ckpt/alice/my_run"
        );
        assert!(resolve_archive(&c, Some("s3://ckpt/alice/x/"), "alice", &[], 7, "j").is_ok());
        let e = resolve_archive(&c, Some("s3://ckpt/bob/x"), "alice", &[], 7, "j").unwrap_err();
        assert!(
            e.contains("not allowed") && e.contains("s3://ckpt/alice/"),
            "{e}"
        );
        assert!(resolve_archive(&c, Some("s3://team/x"), "alice", &["ml".into()], 7, "j").is_ok());
        assert!(resolve_archive(&c, Some("s3://team/x"), "alice", &[], 7, "j").is_err());
        // "s3://ckpt/alice" must not admit "s3://ckpt/alice2".
        assert!(resolve_archive(&c, Some("s3://ckpt/alice2/x"), "alice", &[], 7, "j").is_err());
        assert!(resolve_archive(&c, Some("s3://ckpt/alice/../bob"), "alice", &[], 7, "j").is_err());
    }

    #[test]
    fn commit_and_retention_rules() {
        let c = JobCkpts::default();
        for (i, t) in ["a", "b", "c"].iter().enumerate() {
            assert_eq!(c.commit(t, i as u64).unwrap(), CommitOutcome::New);
        }
        assert_eq!(c.commit("a", 9).unwrap(), CommitOutcome::AlreadyPending);
        assert!(
            c.to_trim(1).is_empty(),
            "nothing is archived yet: nothing may be trimmed"
        );
        c.get("a").unwrap().set_archived(10);
        c.get("b").unwrap().set_archived(11);
        // c is not archived: with keep=1 only a goes (b is the newest archived).
        assert_eq!(
            c.to_trim(1)
                .iter()
                .map(|e| e.tag.clone())
                .collect::<Vec<_>>(),
            vec!["a"]
        );
        assert!(c.to_trim(2).is_empty());
        assert!(c.commit("b", 12).unwrap_err().contains("immutable"));
        c.get("c")
            .unwrap()
            .set_error(CkptState::Modified, "changed".into());
        assert_eq!(c.commit("c", 13).unwrap(), CommitOutcome::Recommitted);
        assert_eq!(c.get("c").unwrap().generation(), 2);
        assert!(c.pending());
    }

    #[test]
    fn framework_signals() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let d = tmp.path();
        std::fs::create_dir_all(d.join("global_step100")).unwrap();
        std::fs::write(d.join("latest"), "global_step100\n").unwrap();
        std::fs::create_dir_all(d.join("iter_0000200")).unwrap();
        std::fs::write(d.join("latest_checkpointed_iteration.txt"), "200").unwrap();
        std::fs::create_dir_all(d.join("dcp-300")).unwrap();
        std::fs::write(d.join("dcp-300/.metadata"), "x").unwrap();
        std::fs::create_dir_all(d.join("dcp-400")).unwrap(); // no .metadata yet: still being written
        let fd = safefs::open_root_dir(d).unwrap();
        assert_eq!(
            scan_signals(&fd, uid),
            vec!["dcp-300", "global_step100", "iter_0000200"]
        );
        // A `latest` that points outside, or is a symlink, commits nothing.
        std::fs::write(d.join("latest"), "../etc").unwrap();
        std::fs::remove_file(d.join("latest_checkpointed_iteration.txt")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join("latest_checkpointed_iteration.txt"))
            .unwrap();
        assert_eq!(scan_signals(&fd, uid), vec!["dcp-300"]);
    }
}
