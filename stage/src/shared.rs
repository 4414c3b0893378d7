//! `--stage-tier=shared`: a job's datasets staged once into a directory every node of the job sees
//! (`[shared_tier] job_dir`, on Lustre or BeeOND), each file written by its owner node alone.
//!
//! The job's directory, `job_dir` with `%j` replaced, is made by whichever node comes first in the
//! admin's directory, which must exist (root's, writable by root alone). Only the job user reads
//! the staged data, from any node; other users of the cluster know the path but cannot enter it:
//!
//! ```text
//! <job_dir>/                       root's, 0711: the job's tasks pass through, nobody lists it;
//!                                  a node joins it only if it is root's (never a user's)
//! <job_dir>/stage/                 $SLUICE_STAGE_DIR on every node: the datasets, the job user's,
//!                                  0700 (a node joins it only if it is the job user's)
//! <job_dir>/.sluice/               root's, 0700: the nodes' marks, which the user cannot forge
//!                                  (they own neither `<job_dir>` nor `.sluice`, so they can
//!                                  neither write, rename nor replace them)
//! <job_dir>/.sluice/NODE           root's, 0700: NODE finished its share ("ok") or why it could not
//! <job_dir>/.sluice/NODE+takeover  NODE was found dead: who found it, why, and the survivors
//! <job_dir>/.sluice/NODE+by+S      survivor S's part of NODE's share: "ok" or why not
//! ```
//!
//! Which node writes which file is `--stage-mode=shard`'s ownership ([`ShardPlan`]) whatever the
//! mode: a file is written once, by its owner, and every node sees all of them, so no manifest is
//! written. A node that wrote its share marks it; a node's tasks start only once every node of the
//! job marked its share "ok" (else the job fails with the node's reason, or at the stage timeout
//! with the names of the nodes still writing). A restarted agent finds its own "ok" mark and does
//! not write its share again under the feet of tasks already reading it. At job end every node
//! removes the job's directory; the first one to get there does the work. Only the job user's and
//! root's entries are removed: another user's files that the job's user moved into `stage` stay.
//!
//! **A dead node is routed around.** While a node waits for the others' marks, it probes each node
//! that has not marked its share through the peers layer: one request for the job on the node's
//! peer port, MAC'd under the job's key ([`super::JobPeers::alive`]; the shared-tier job is
//! registered with the peer server for this alone). Only evidence no process without the job key
//! can fake counts ([`sluice_peer::PeerError::proves_gone`]): no connection, no answer within
//! `[peer] read_timeout`, or an answer MAC'd under the job's key that the job ended there; and
//! only [`DEAD_AFTER`] times in a row, [`PROBE_EVERY`] apart. An unsigned answer of any kind (a
//! user's process can send one) and a connection accepted then closed unanswered (what an agent
//! over its per-source or total connection limit does, so a user's flood of the peer port) are an
//! agent still there. An agent that answers is alive and may be writing, however slowly, and
//! such a node still fails the job at the stage timeout, named. The first node to find one dead
//! makes its takeover mark ([`SharedJob::claim`]: written under a temporary name, then
//! hard-linked into place, which fails if another node was first — so there is one takeover per
//! lost node, naming the survivors, and every survivor follows it whoever found it). Each of the lost node's files then gets a new owner by rendezvous hashing over the
//! survivors ([`ShardPlan::takeover`]): each is still written once, and read from the origin once
//! more at most, through the same staging code and budget (bounded concurrency) as a node's own
//! share. A survivor writes its part and marks it; a lost node counts as written once every
//! survivor marked its part "ok", and its takeover takes precedence over a mark of its own (it may
//! have marked in the moment it was found dead, and the survivors may be rewriting its files). The
//! job's output gets a `note:` naming the node and why, on every node.
//!
//! **Files are created new (`O_EXCL`), and only a file's owner replaces one** ([`create_file`]):
//! something already at a name (a file an earlier run of the job id left, the half-written file of
//! an agent before its restart, or of a lost node) is moved aside into `.sluice/` and removed by
//! the node that owns the name by the plan — a survivor for its part of a takeover, a node for its
//! own share only while no takeover of it is marked. The node looks for its takeover mark before
//! it moves the thing aside and again after, and puts it back (linked, so that a newer file at the
//! name stays) if the mark appeared in between; a takeover is marked before any survivor creates a
//! file, so a node found dead never removes a file a survivor wrote, and the tasks never read one
//! of its half-written files in a job marked written. Bytes a lost agent still writes through a
//! descriptor it holds go to the file the survivor replaced, never to the one the tasks read.
//! **A lost agent that comes back** (restarted from its journal, or a hung one that wakes)
//! honours the takeover: a restarted one finds the mark when it opens the job's directory
//! and does not write its share, even on a fresh start of the job; one still writing checks for
//! the mark every second and stops, and a file it creates meanwhile is refused at a name the
//! survivors wrote; neither marks its share then. It waits for the survivors' parts like any
//! node.
//!
//! Limits, said where they apply: a survivor that dies while writing its part of a takeover is not
//! routed around in turn (the job fails at the stage timeout, naming it); nodes are only found dead
//! with `[peer]` configured on them (without it a dead node fails the job at the stage timeout);
//! an agent that is alive but cannot be reached on its peer port (a network fault, or a process
//! that took the port before the agent and holds connections unanswered: use a port below 1024)
//! is taken for dead — its files stay the survivors', as above, but a POSIX dataset's copy helper
//! (running as the job user, who cannot read the marks) removes the names of its share when it
//! starts, so a helper started in the moment of a takeover can still remove a survivor's file
//! before the agent stops it (within a second); a requeued job whose previous run's job end ran
//! on no node at all may find that run's marks of the other nodes.

use super::{ShardPlan, StageError};
use sluice_core::config::{SharedTierConfig, StripeClass};
use sluice_core::safefs::{self, Owner, SafeFsError};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const STAGE: &str = "stage";
const MARKS: &str = ".sluice";
/// `<job_dir>`: root's; the job's tasks on every node pass through it to `stage`, other users
/// cannot list it.
const JOB_DIR_MODE: u32 = 0o711;
/// `<job_dir>/stage`: the job user's alone.
const STAGE_MODE: u32 = 0o700;
const OK: &str = "ok";
/// `<marks>/NODE+takeover`: NODE's share is written by the survivors (`+` is in no node name).
const TAKEOVER: &str = "+takeover";
/// `<marks>/NODE+by+SURVIVOR`: SURVIVOR's part of the takeover of NODE's share ("ok" or why not).
const BY: &str = "+by+";
/// How often a node whose share is not marked is probed, and how many probes in a row must find
/// its agent unreachable before its share is taken over: a restart or a moment's overload of its
/// agent is not a death.
const PROBE_EVERY: Duration = Duration::from_secs(2);
const DEAD_AFTER: u32 = 3;

/// Whether another node of the job is alive: its agent answering for the job on the peer port
/// ([`super::JobPeers`], under the job's key). Tests fake it.
#[async_trait::async_trait]
pub trait Liveness: Send + Sync {
    /// `Err(why)` only when `node`'s agent cannot be reached for the job (down, hung, or the job
    /// ended there, MAC'd). An agent that answers, even to refuse or because it does not know the
    /// job yet, or whose port takes the connection and closes it, is alive: it may be writing its
    /// share.
    async fn check(&self, node: &str) -> Result<(), String>;
}

#[async_trait::async_trait]
impl Liveness for super::JobPeers {
    async fn check(&self, node: &str) -> Result<(), String> {
        match self.alive(node).await {
            Err(e) if e.proves_gone() => Err(super::peers::error_chain(&e)),
            Err(e) => {
                tracing::debug!("liveness of {node}: {e} (counted as alive)");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }
}

/// Writes this node's part of a takeover: every dataset of the job, the files `plan` owns
/// ([`ShardPlan::takeover`]), read from the origin as the node's own share is.
pub type TakeShare<'a> =
    dyn Fn(ShardPlan) -> futures::future::BoxFuture<'a, Result<(), StageError>> + Send + Sync + 'a;

/// The takeover of a lost node's share, as its mark in `.sluice/` says. The first survivor to
/// find the node dead writes it (atomically, once: see [`SharedJob::claim`]); every survivor
/// then writes its part by the same rule, whoever found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Takeover {
    pub lost: String,
    /// The nodes that write the lost node's files, sorted: each file goes to one of them by
    /// rendezvous hashing.
    pub survivors: Vec<String>,
    /// The node that found it dead, and why.
    pub by: String,
    pub why: String,
}

impl Takeover {
    fn to_text(&self) -> String {
        format!(
            "by {}\nsurvivors {}\nwhy {}\n",
            self.by,
            self.survivors.join(","),
            self.why.replace('\n', " ")
        )
    }

    fn parse(lost: &str, text: &str) -> Option<Takeover> {
        let mut t = Takeover {
            lost: lost.to_string(),
            survivors: Vec::new(),
            by: String::new(),
            why: String::new(),
        };
        for line in text.lines() {
            let (k, v) = line.split_once(' ').unwrap_or((line, ""));
            match k {
                "by" => t.by = v.to_string(),
                "survivors" => t.survivors = v.split(',').map(String::from).collect(),
                "why" => t.why = v.to_string(),
                _ => {}
            }
        }
        (!t.survivors.is_empty() && !t.survivors[0].is_empty()).then_some(t)
    }

    /// The note for the job output.
    pub fn note(&self) -> String {
        format!(
            "shared tier: node {}'s agent could not be reached before it marked its share of the datasets written ({}); nodes {} wrote {}'s files from the origin instead (found by {})",
            self.lost,
            self.why,
            self.survivors.join(", "),
            self.lost,
            self.by
        )
    }
}

#[cfg(test)]
impl Takeover {
    /// `by` takes `lost`'s share over, the only survivor.
    pub(crate) fn alone(lost: &str, by: &str, why: &str) -> Takeover {
        Takeover {
            lost: lost.into(),
            survivors: vec![by.into()],
            by: by.into(),
            why: why.into(),
        }
    }
}

/// `$SLUICE_STAGE_DIR` of a shared-tier job.
pub fn stage_dir(cfg: &SharedTierConfig, job_id: u32) -> PathBuf {
    cfg.job_dir_for(job_id).join(STAGE)
}

/// How staged files are laid out in the job's shared directory: on Lustre, the stripe layout of
/// each file's size class (`[[shared_tier.stripe]]`, set with `lfs setstripe` as the job user
/// before the file's bytes are written); elsewhere the directory's default.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    pub lfs: PathBuf,
    /// Empty off Lustre, or when no class is configured.
    pub stripes: Vec<StripeClass>,
    /// Who writes with this layout, which decides whether a file already at a name may be
    /// replaced ([`create_file`]); `None` replaces nothing.
    pub writer: Option<Writer>,
}

/// A node writing into the job's shared directory, and for whom: the node's own share, or its
/// part of a lost node's ([`ShardPlan::takeover`]). See [`create_file`].
#[derive(Debug, Clone)]
pub struct Writer {
    marks: Arc<OwnedFd>,
    node: String,
    own_share: bool,
}

impl Layout {
    /// This layout for writing the files of `plan` (this node's own share, or with
    /// [`ShardPlan::taken_over`] its part of a lost node's).
    pub fn for_plan(&self, plan: Option<&ShardPlan>) -> Layout {
        let mut l = self.clone();
        if let Some(w) = &mut l.writer {
            w.own_share = plan.is_none_or(|p| p.taken_over().is_none());
        }
        l
    }

    /// The stripe class of a file of `size` bytes, if it gets one.
    pub fn for_size(&self, size: u64) -> Option<&StripeClass> {
        StripeClass::for_size(&self.stripes, size)
    }

    /// The helper's `--lfs`/`--stripe MIN:COUNT:SIZE` arguments for a POSIX copy.
    pub fn helper_args(&self) -> Vec<String> {
        if self.stripes.is_empty() {
            return Vec::new();
        }
        let mut args = vec!["--lfs".to_string(), self.lfs.display().to_string()];
        for c in &self.stripes {
            args.push("--stripe".into());
            args.push(format!("{}:{}:{}", c.min_size, c.count, c.size));
        }
        args
    }
}

/// Creates the staged file `name` in the job user's directory `dir` on the shared tier, as a new
/// file (`O_EXCL`): with the stripe layout of its size class (`lfs` as the job user, see
/// [`super::lustre`]), then opened without following links and only if it is a regular file of
/// the user with one link; else plainly, as on the hot tier. Blocking.
///
/// Something already at the name (a file an earlier run of the job id left, the half-written file
/// of a lost node or of this agent before a restart) is replaced only by the file's owner now,
/// and never under a takeover: see [`Writer::clear`]. Nothing is replaced without a
/// [`Layout::writer`].
pub fn create_file(
    dir: &OwnedFd,
    name: &str,
    size: u64,
    owner: Owner,
    layout: &Layout,
) -> Result<std::fs::File, String> {
    let Some(writer) = &layout.writer else {
        return create_new(dir, name, size, owner, layout).map_err(|e| e.1);
    };
    // Another writer may create the name between the clear and the create (a lost agent that has
    // not seen its takeover yet): clear again, which it does not survive a second time.
    let mut tries = 0;
    loop {
        writer.clear(dir, name, owner)?;
        match create_new(dir, name, size, owner, layout) {
            Err((Some(nix::errno::Errno::EEXIST), _)) if tries < 2 => tries += 1,
            r => return r.map_err(|e| e.1),
        }
    }
}

/// A name set aside by [`Writer::clear`] gets a name of its own in `.sluice/`.
static SET_ASIDE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Writer {
    /// This node's share was taken over: it writes none of it. Blocking.
    fn taken_over(&self) -> bool {
        self.own_share && read_mark(&self.marks, &format!("{}{TAKEOVER}", self.node)).is_some()
    }

    fn refused(&self, name: &str) -> String {
        format!(
            "'{name}' is not replaced: this node's ({}) share on the shared tier was taken over by the job's other nodes, which write it now",
            self.node
        )
    }

    /// Frees `name` in `dir` for this writer, which owns it by the job's plan: its own share only
    /// while no takeover of it is marked, its part of a takeover always (each of a lost node's
    /// files has one new owner). What is there is moved into `.sluice/` (root's) under a name of
    /// its own, and then, for the own share, the takeover mark is looked for once more: a
    /// takeover marked in between means the thing moved may be a survivor's file, and it is put
    /// back (linked, so that a newer file at the name stays) rather than removed. A takeover is
    /// marked before any survivor creates a file, so a file this writer removes is never one a
    /// survivor wrote. Blocking.
    fn clear(&self, dir: &OwnedFd, name: &str, owner: Owner) -> Result<(), String> {
        use nix::errno::Errno;
        use nix::sys::stat::fstatat;
        safefs::check_component(name).map_err(|e| e.to_string())?;
        match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(format!("stat '{name}': {e}")),
            Ok(_) => {}
        }
        if self.taken_over() {
            return Err(self.refused(name));
        }
        let aside = format!(
            ".aside.{}.{}.{}",
            self.node,
            std::process::id(),
            SET_ASIDE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        match nix::fcntl::renameat(dir, name, &*self.marks, aside.as_str()) {
            Ok(()) => {}
            // Gone meanwhile: the name is free.
            Err(Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(format!("setting '{name}' aside to replace it: {e}")),
        }
        if self.taken_over() {
            let back = nix::unistd::linkat(
                &*self.marks,
                aside.as_str(),
                dir,
                name,
                nix::fcntl::AtFlags::empty(),
            );
            match back {
                Ok(()) | Err(Errno::EEXIST) => {
                    let _ = nix::unistd::unlinkat(
                        &*self.marks,
                        aside.as_str(),
                        nix::unistd::UnlinkatFlags::NoRemoveDir,
                    );
                }
                // A directory cannot be linked back: it stays set aside, removed with the job.
                Err(e) => tracing::error!("putting '{name}' back after a takeover: {e}"),
            }
            return Err(self.refused(name));
        }
        safefs::remove_tree(&*self.marks, &aside, owner.into())
            .and_then(|r| r.all_gone(name))
            .map(drop)
            .map_err(|e| format!("removing the earlier '{name}': {e}"))
    }
}

/// [`create_file`] without replacing anything: `Err` with the errno (`EEXIST` for a name that is
/// taken) where one is known.
fn create_new(
    dir: &OwnedFd,
    name: &str,
    size: u64,
    owner: Owner,
    layout: &Layout,
) -> Result<std::fs::File, (Option<nix::errno::Errno>, String)> {
    let Some(class) = layout.for_size(size) else {
        return safefs::create_file(dir, name, Some(owner), 0o644)
            .map_err(|e| (e.errno(), e.to_string()));
    };
    super::lustre::create_striped(&layout.lfs, dir, name, class, owner.uid, owner.gid)
        .map_err(|e| (None, e.to_string()))?;
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::{Mode, SFlag, fstat};
    let flags = OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
    let fd = openat(dir, name, flags, Mode::empty())
        .map_err(|e| (None, format!("open '{name}': {e}")))?;
    let st = fstat(&fd).map_err(|e| (None, format!("stat '{name}': {e}")))?;
    let regular = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFREG;
    if !regular || st.st_uid != owner.uid || st.st_nlink != 1 {
        return Err((
            None,
            format!("'{name}' is not the file lfs setstripe created (replaced while staging?)"),
        ));
    }
    Ok(std::fs::File::from(fd))
}

/// One job's directory on the shared tier, as this node holds it open.
pub struct SharedJob {
    pub stage: OwnedFd,
    marks: Arc<OwnedFd>,
    /// This node's share is already written (a restarted agent found its "ok" mark).
    pub done: bool,
    /// The job's other nodes took this node's share over (they found its agent dead): it must
    /// not write it, and waits for theirs like any node.
    pub taken_over: bool,
    pub layout: Layout,
}

impl SharedJob {
    /// Creates or joins the job's directory (see the module header). `fresh` (a job starting, not
    /// a recovered one) drops this node's mark of an earlier run of the job id. Blocking.
    pub fn open(
        cfg: &SharedTierConfig,
        job_id: u32,
        node: &str,
        owner: Owner,
        fresh: bool,
    ) -> Result<SharedJob, SafeFsError> {
        let root = safefs::open_root_dir(cfg.root())?;
        // Root's (a user's directory is refused), which the job's tasks pass through; only the
        // job user can enter `stage`. The modes are set on every join, so a directory an earlier
        // run left with other modes is private too.
        let job = safefs::ensure_dir(&root, &cfg.job_dir_name(job_id), None, JOB_DIR_MODE)?;
        set_mode(&job, &cfg.job_dir_name(job_id), JOB_DIR_MODE)?;
        let stage = safefs::ensure_dir(&job, STAGE, Some(owner), STAGE_MODE)?;
        set_mode(&stage, STAGE, STAGE_MODE)?;
        let marks = safefs::ensure_dir(&job, MARKS, None, 0o700)?;
        if fresh {
            safefs::remove_tree(&marks, node, safefs::RemoveAs::agent())?;
        }
        let done = read_mark(&marks, node).as_deref() == Some(OK);
        // A takeover is never dropped, not even by a fresh start of the job here: the survivors
        // may be writing this node's files right now.
        let taken_over = read_mark(&marks, &format!("{node}{TAKEOVER}")).is_some();
        let lustre = super::lustre::is_lustre(&stage).unwrap_or(false);
        if !lustre && !cfg.stripes.is_empty() {
            tracing::info!(
                job_id,
                "the shared tier is not Lustre here: [[shared_tier.stripe]] layouts are not applied"
            );
        }
        let layout = Layout {
            lfs: cfg.lfs.clone(),
            stripes: if lustre {
                cfg.stripes.clone()
            } else {
                Vec::new()
            },
            writer: None,
        };
        Ok(SharedJob {
            stage,
            marks: Arc::new(marks),
            done,
            taken_over,
            layout,
        })
    }

    /// The layout `node` (this node) writes its files with: [`Layout::for_plan`] then says
    /// whose share they are.
    pub fn layout_for(&self, node: &str) -> Layout {
        Layout {
            writer: Some(Writer {
                marks: self.marks.clone(),
                node: node.to_string(),
                own_share: true,
            }),
            ..self.layout.clone()
        }
    }

    /// Marks this node's share written (`Ok`) or failed, for the job's other nodes. Blocking.
    pub fn mark(&self, node: &str, result: Result<(), &StageError>) -> Result<(), SafeFsError> {
        self.write_mark(node, result)
    }

    /// Marks this node's (`by`'s) part of the takeover of `lost`'s share. Blocking.
    fn mark_part(
        &self,
        lost: &str,
        by: &str,
        result: Result<(), &StageError>,
    ) -> Result<(), SafeFsError> {
        self.write_mark(&format!("{lost}{BY}{by}"), result)
    }

    fn write_mark(&self, name: &str, result: Result<(), &StageError>) -> Result<(), SafeFsError> {
        let text = match result {
            Ok(()) => OK.to_string(),
            Err(e) => e.to_string(),
        };
        let tmp = format!(".{name}.tmp");
        self.write_tmp(&tmp, &text)?;
        nix::fcntl::renameat(&self.marks, tmp.as_str(), &self.marks, name).map_err(|errno| {
            SafeFsError::Sys {
                op: "rename",
                path: name.to_string(),
                errno,
            }
        })
    }

    fn write_tmp(&self, tmp: &str, text: &str) -> Result<(), SafeFsError> {
        safefs::remove_tree(&self.marks, tmp, safefs::RemoveAs::agent())?;
        let mut f = safefs::create_file(&self.marks, tmp, None, 0o600)?;
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(|e| SafeFsError::Sys {
            op: "write",
            path: tmp.to_string(),
            errno: nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc_eio())),
        })
    }

    /// Whether `node`'s share was taken over. Blocking.
    pub fn is_taken_over(&self, node: &str) -> bool {
        self.takeover(node).is_some()
    }

    fn takeover(&self, node: &str) -> Option<Takeover> {
        let text = read_mark(&self.marks, &format!("{node}{TAKEOVER}"))?;
        Takeover::parse(node, &text)
    }

    /// Takes `want.lost`'s share over, unless another node did first: the mark is made under a
    /// temporary name and hard-linked to its final one, which fails if it exists (on Lustre and
    /// NFS as locally), so there is one takeover per lost node and every survivor follows the
    /// same one. Returns the takeover in force. Blocking.
    pub fn claim(&self, want: &Takeover) -> Result<Takeover, SafeFsError> {
        let name = format!("{}{TAKEOVER}", want.lost);
        let tmp = format!(".{name}.{}.tmp", want.by);
        self.write_tmp(&tmp, &want.to_text())?;
        let linked = nix::unistd::linkat(
            &self.marks,
            tmp.as_str(),
            &self.marks,
            name.as_str(),
            nix::fcntl::AtFlags::empty(),
        );
        let _ = nix::unistd::unlinkat(
            &self.marks,
            tmp.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        match linked {
            Ok(()) => Ok(want.clone()),
            Err(nix::errno::Errno::EEXIST) => {
                self.takeover(&want.lost).ok_or_else(|| SafeFsError::Sys {
                    op: "read",
                    path: name.clone(),
                    errno: nix::errno::Errno::EIO,
                })
            }
            Err(errno) => Err(SafeFsError::Sys {
                op: "link",
                path: name,
                errno,
            }),
        }
    }

    /// Waits until every node of `plan` marked its share, or its share was taken over and every
    /// survivor marked its part: `Ok` with the notes for the job output (one per node taken
    /// over) when all are written, the first failure's reason otherwise. Polls the marks (a
    /// shared file system has no portable change notification across nodes); the caller's stage
    /// timeout bounds the wait.
    ///
    /// With `liveness`, a node that has not marked its share is probed every [`PROBE_EVERY`];
    /// found unreachable [`DEAD_AFTER`] times in a row, its share is taken over ([`claim`]), and
    /// this node, if a survivor, writes its part with `take`. A node whose agent answers is
    /// never taken over, however slow: the stage timeout then names it.
    ///
    /// [`claim`]: Self::claim
    pub async fn wait_for_all(
        self: &std::sync::Arc<Self>,
        plan: &ShardPlan,
        cancel: &CancellationToken,
        liveness: Option<&dyn Liveness>,
        take: &TakeShare<'_>,
    ) -> Result<Vec<String>, StageError> {
        let me = plan.node().to_string();
        let mut pause = Duration::from_millis(100);
        let mut unreachable: HashMap<String, u32> = HashMap::new();
        let mut last_probe: Option<tokio::time::Instant> = None;
        let mut parts_done: Vec<String> = Vec::new();
        let mut notes: BTreeMap<String, String> = BTreeMap::new();
        loop {
            let this = self.clone();
            let nodes = plan.nodes().to_vec();
            let seen = sluice_core::rt::blocking(move || {
                nodes.into_iter().map(|n| this.look(&n)).collect::<Vec<_>>()
            })
            .await;
            let mut waiting: Vec<String> = Vec::new();
            let mut suspects: Vec<String> = Vec::new();
            let mut my_part: Option<Takeover> = None;
            for s in &seen {
                if let Some(t) = &s.takeover {
                    notes.insert(t.lost.clone(), t.note());
                    let mine_unmarked = s.parts.iter().any(|(by, m)| *by == me && m.is_none());
                    if mine_unmarked && !parts_done.contains(&t.lost) {
                        my_part.get_or_insert(t.clone());
                    }
                    for (by, m) in &s.parts {
                        match m.as_deref() {
                            Some(OK) => {}
                            Some(why) => {
                                return Err(StageError::SharedPeer {
                                    node: by.clone(),
                                    detail: format!("taking over node {}'s share: {why}", t.lost),
                                });
                            }
                            None => waiting.push(format!("{} (taken over by {by})", t.lost)),
                        }
                    }
                    continue;
                }
                match s.mark.as_deref() {
                    Some(OK) => {}
                    Some(why) => {
                        return Err(StageError::SharedPeer {
                            node: s.node.clone(),
                            detail: why.to_string(),
                        });
                    }
                    None => {
                        waiting.push(s.node.clone());
                        if s.node != me {
                            suspects.push(s.node.clone());
                        }
                    }
                }
            }
            if let Some(t) = my_part {
                let result = match plan.takeover(&t.lost, &t.survivors) {
                    Some(sub) => {
                        tracing::warn!(
                            "writing this node's part of node {}'s share on the shared tier: {}",
                            t.lost,
                            t.why
                        );
                        take(sub).await
                    }
                    None => Err(StageError::SharedPeer {
                        node: t.lost.clone(),
                        detail: format!("its takeover names survivors {:?}", t.survivors),
                    }),
                };
                let (this, lost, by, r) =
                    (self.clone(), t.lost.clone(), me.clone(), result.clone());
                let marked = sluice_core::rt::blocking(move || {
                    this.mark_part(&lost, &by, r.as_ref().map(|_| ()))
                })
                .await;
                if let Err(e) = marked {
                    tracing::error!("marking this node's part of {}'s share: {e}", t.lost);
                }
                result?;
                parts_done.push(t.lost);
                continue;
            }
            if waiting.is_empty() {
                return Ok(notes.into_values().collect());
            }
            let due = last_probe.is_none_or(|t| t.elapsed() >= PROBE_EVERY);
            if let (Some(liveness), true) = (liveness, due) {
                last_probe = Some(tokio::time::Instant::now());
                for node in &suspects {
                    let why = match liveness.check(node).await {
                        Ok(()) => {
                            unreachable.remove(node);
                            continue;
                        }
                        Err(why) => why,
                    };
                    let count = unreachable.entry(node.clone()).or_default();
                    *count += 1;
                    if *count < DEAD_AFTER {
                        continue;
                    }
                    // The survivors: the job's nodes, less this one and those already lost.
                    let lost: Vec<&String> = seen
                        .iter()
                        .filter(|s| s.takeover.is_some())
                        .map(|s| &s.node)
                        .collect();
                    let survivors: Vec<String> = plan
                        .nodes()
                        .iter()
                        .filter(|n| *n != node && !lost.contains(n))
                        .cloned()
                        .collect();
                    let want = Takeover {
                        lost: node.clone(),
                        survivors,
                        by: me.clone(),
                        why,
                    };
                    let this = self.clone();
                    match sluice_core::rt::blocking(move || {
                        // It may have marked its share since: then nothing is taken over.
                        if read_mark(&this.marks, &want.lost).is_some() {
                            return Ok(None);
                        }
                        this.claim(&want).map(Some)
                    })
                    .await
                    {
                        Ok(Some(t)) => tracing::warn!(
                            "node {}'s share on the shared tier is taken over by {:?}: {}",
                            t.lost,
                            t.survivors,
                            t.why
                        ),
                        Ok(None) => {}
                        Err(e) => tracing::error!("taking over node {node}'s share: {e}"),
                    }
                }
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = cancel.cancelled() => return Err(StageError::Cancelled {
                    dataset: format!("the shared tier's share of node(s) {}", waiting.join(", ")),
                }),
            }
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// What the marks say about `node`. Blocking.
    fn look(&self, node: &str) -> Seen {
        let takeover = self.takeover(node);
        let parts = takeover.as_ref().map_or_else(Vec::new, |t| {
            t.survivors
                .iter()
                .map(|s| (s.clone(), read_mark(&self.marks, &format!("{node}{BY}{s}"))))
                .collect()
        });
        Seen {
            node: node.to_string(),
            mark: read_mark(&self.marks, node),
            takeover,
            parts,
        }
    }
}

/// One node's marks, as [`SharedJob::wait_for_all`] reads them.
struct Seen {
    node: String,
    mark: Option<String>,
    /// Takes precedence over `mark`: a node found dead may have marked its share in the moment
    /// it was taken over, and then the survivors may be rewriting its files.
    takeover: Option<Takeover>,
    /// Each survivor's mark of its part.
    parts: Vec<(String, Option<String>)>,
}

fn libc_eio() -> i32 {
    nix::errno::Errno::EIO as i32
}

fn set_mode(dir: &OwnedFd, name: &str, mode: u32) -> Result<(), SafeFsError> {
    use nix::sys::stat::{Mode, fchmod};
    fchmod(dir, Mode::from_bits_truncate(mode)).map_err(|errno| SafeFsError::Sys {
        op: "chmod",
        path: name.to_string(),
        errno,
    })
}

/// What node `node` marked, if it did.
fn read_mark(marks: &OwnedFd, node: &str) -> Option<String> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::Mode;
    safefs::check_component(node).ok()?;
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(marks, node, flags, Mode::empty()).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut std::io::Read::take(std::fs::File::from(fd), 4096),
        &mut text,
    )
    .ok()?;
    Some(text)
}

/// Removes the job's directory from the shared tier (every node of the job calls it at job end;
/// what another node removed meanwhile counts as removed). Only the job user's and root's entries
/// go ([`safefs::remove_tree`]). Blocking.
pub fn remove(
    cfg: &SharedTierConfig,
    job_id: u32,
    who: safefs::RemoveAs,
) -> Result<safefs::Removed, SafeFsError> {
    let root = safefs::open_root_dir(cfg.root())?;
    let name = cfg.job_dir_name(job_id);
    let mut last = None;
    for _ in 0..3 {
        match safefs::remove_tree(&root, &name, who) {
            Ok(r) => return Ok(r),
            // Another node removed entries while this one walked: walk again.
            Err(e)
                if matches!(
                    e.errno(),
                    Some(nix::errno::Errno::ENOENT | nix::errno::Errno::ENOTEMPTY)
                ) =>
            {
                last = Some(e)
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("three attempts failed"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::testing::me;
    use std::sync::Arc;

    fn cfg(root: &std::path::Path) -> SharedTierConfig {
        SharedTierConfig {
            job_dir: format!("{}/job-%j", root.display()),
            lfs: "lfs".into(),
            stripes: Vec::new(),
        }
    }

    /// The real `lfs` and Lustre are not exercised here: a fake `lfs` records its arguments and
    /// creates the file, as `lfs setstripe` does.
    #[test]
    fn files_of_a_striped_class_are_created_by_lfs_then_opened_checked() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let (lfs, record) = (tmp.path().join("lfs"), tmp.path().join("args"));
        std::fs::write(
            &lfs,
            format!(
                "#!/bin/sh\nprintf '%s ' \"$@\" > '{}'\nfor a; do last=$a; done\n: > \"$last\"\n",
                record.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&lfs, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir_path = tmp.path().join("d");
        std::fs::create_dir(&dir_path).unwrap();
        let dir = safefs::open_root_dir(&dir_path).unwrap();
        let layout = Layout {
            lfs: lfs.clone(),
            stripes: vec![StripeClass {
                min_size: 1 << 20,
                count: -1,
                size: 4 << 20,
            }],
            writer: None,
        };
        // Below every class: a plain file, lfs not run.
        create_file(&dir, "small", 10, me(), &layout).unwrap();
        assert!(!record.exists());
        // In the class: lfs makes it, then it is written through the checked open.
        let mut f = while_busy(|| create_file(&dir, "big", 2 << 20, me(), &layout)).unwrap();
        std::io::Write::write_all(&mut f, b"bytes").unwrap();
        assert_eq!(std::fs::read(dir_path.join("big")).unwrap(), b"bytes");
        assert_eq!(
            std::fs::read_to_string(&record).unwrap(),
            "setstripe -c -1 -S 4194304 /proc/self/fd/0/big "
        );
        assert_eq!(
            layout.helper_args(),
            [
                "--lfs",
                &lfs.display().to_string(),
                "--stripe",
                "1048576:-1:4194304"
            ]
        );
        // A name lfs did not leave as a plain file of the user is refused, not written through.
        std::os::unix::fs::symlink("/etc/passwd", dir_path.join("link")).unwrap();
        let lying = tmp.path().join("lying-lfs");
        std::fs::write(&lying, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(&lying, std::fs::Permissions::from_mode(0o755)).unwrap();
        let liar = Layout {
            lfs: lying,
            ..layout
        };
        let e = while_busy(|| create_file(&dir, "link", 2 << 20, me(), &liar)).unwrap_err();
        assert!(e.contains("open 'link'"), "{e}");
    }

    /// `create`, again while the fake `lfs` it runs is still being written ("Text file busy": a
    /// script just made executable by another test's thread).
    fn while_busy<T>(mut create: impl FnMut() -> Result<T, String>) -> Result<T, String> {
        (0..50)
            .find_map(|_| match create() {
                Err(e) if e.contains("Text file busy") => {
                    std::thread::sleep(Duration::from_millis(20));
                    None
                }
                other => Some(other),
            })
            .expect("lfs could be run within a second")
    }

    fn no_take(_: ShardPlan) -> futures::future::BoxFuture<'static, Result<(), StageError>> {
        panic!("no takeover expected")
    }

    #[tokio::test]
    async fn nodes_wait_for_every_share_and_learn_why_one_failed() {
        let root = tempfile::tempdir().unwrap();
        let cfg = cfg(root.path());
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).into();
        let plan = ShardPlan::new(&nodes, "n1").unwrap();
        let n1 = Arc::new(SharedJob::open(&cfg, 5, "n1", me(), true).unwrap());
        let n2 = Arc::new(SharedJob::open(&cfg, 5, "n2", me(), true).unwrap());
        assert_eq!(stage_dir(&cfg, 5), root.path().join("job-5/stage"));
        assert!(root.path().join("job-5/stage").is_dir());
        n1.mark("n1", Ok(())).unwrap();
        let cancel = CancellationToken::new();
        // n2 has not marked: n1 waits.
        let wait = tokio::time::timeout(
            Duration::from_millis(400),
            n1.wait_for_all(&plan, &cancel, None, &no_take),
        );
        assert!(wait.await.is_err(), "n1 went on before n2 wrote its share");
        n2.mark("n2", Ok(())).unwrap();
        n1.wait_for_all(&plan, &cancel, None, &no_take)
            .await
            .unwrap();

        // A restarted agent finds its share written; a fresh run of the job id does not.
        assert!(SharedJob::open(&cfg, 5, "n2", me(), false).unwrap().done);
        let again = SharedJob::open(&cfg, 5, "n2", me(), true).unwrap();
        assert!(!again.done);
        let e = StageError::NotFound {
            dataset: "s3://b/x".into(),
        };
        again.mark("n2", Err(&e)).unwrap();
        let e = n1
            .wait_for_all(&plan, &cancel, None, &no_take)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("node n2") && e.to_string().contains("s3://b/x not found"),
            "{e}"
        );

        // Job end on both nodes: the directory goes, the second removal finds nothing.
        remove(&cfg, 5, me().into()).unwrap();
        remove(&cfg, 5, me().into()).unwrap();
        assert!(!root.path().join("job-5").exists());
    }

    /// Runs `cmd` as `uid` (and its gid, no other groups: what a task of that user could do).
    fn as_user(uid: u32, cmd: &str, arg: &std::path::Path) -> std::process::Output {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(cmd)
            .arg(arg)
            .uid(uid)
            .gid(uid)
            .output()
            .unwrap()
    }

    #[test]
    #[ignore = "needs root, like sluiced (the staged files belong to another user); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn staged_data_is_the_job_users_alone() {
        use std::os::unix::fs::PermissionsExt;
        sluice_core::testing::assert_root("the job's files belong to another user");
        let root = tempfile::tempdir().unwrap();
        // The admin's directory, as docs/admin-guide.md makes it: root's, everyone may pass
        // through.
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let cfg = cfg(root.path());
        let (user, other) = (4301, 4302);
        let owner = Owner {
            uid: user,
            gid: user,
        };
        let n1 = SharedJob::open(&cfg, 11, "n1", owner, true).unwrap();
        // The job's second node joins what the first made.
        let n2 = SharedJob::open(&cfg, 11, "n2", owner, true).unwrap();
        let mut f = create_file(&n2.stage, "train.bin", 4, owner, &Layout::default()).unwrap();
        std::io::Write::write_all(&mut f, b"data").unwrap();
        drop(f);
        n1.mark("n1", Ok(())).unwrap();
        let stage = stage_dir(&cfg, 11);
        let staged = stage.join("train.bin");

        // The job's tasks, on any node, read it at $SLUICE_STAGE_DIR.
        let mine = as_user(user, "cat", &staged);
        assert!(mine.status.success(), "{mine:?}");
        assert_eq!(mine.stdout, b"data");
        // Another user of the cluster knows the path, and reads, lists and finds nothing.
        for (cmd, path) in [
            ("cat", staged.as_path()),
            ("ls", stage.as_path()),
            ("ls", &root.path().join("job-11")),
            ("cat", &root.path().join("job-11/.sluice/n1")),
        ] {
            let theirs = as_user(other, cmd, path);
            assert!(
                !theirs.status.success(),
                "{cmd} {}: {theirs:?}",
                path.display()
            );
            assert!(
                String::from_utf8_lossy(&theirs.stderr).contains("Permission denied"),
                "{cmd} {}: {theirs:?}",
                path.display()
            );
        }

        // A user who makes a job's directory before its first node does (the next job id is no
        // secret) is refused, and so is another user's `stage` in root's directory.
        let early = root.path().join("job-12");
        std::fs::create_dir(&early).unwrap();
        std::os::unix::fs::chown(&early, Some(other), Some(other)).unwrap();
        let e = SharedJob::open(&cfg, 12, "n1", owner, true).err().unwrap();
        assert_eq!(e.errno(), Some(nix::errno::Errno::EPERM), "{e}");
        std::fs::create_dir_all(root.path().join("job-13/stage")).unwrap();
        std::os::unix::fs::chown(root.path().join("job-13/stage"), Some(other), None).unwrap();
        let e = SharedJob::open(&cfg, 13, "n1", owner, true).err().unwrap();
        assert_eq!(e.errno(), Some(nix::errno::Errno::EPERM), "{e}");
    }

    /// Liveness as the peers layer would see it: the nodes named are unreachable.
    struct Dead(&'static [&'static str]);

    #[async_trait::async_trait]
    impl Liveness for Dead {
        async fn check(&self, node: &str) -> Result<(), String> {
            if self.0.contains(&node) {
                Err(format!(
                    "peer {node}:7000 is unreachable: connection refused"
                ))
            } else {
                Ok(())
            }
        }
    }

    #[tokio::test]
    async fn a_dead_nodes_share_is_written_once_by_the_survivors_and_its_agent_leaves_it_to_them() {
        let root = tempfile::tempdir().unwrap();
        let cfg = cfg(root.path());
        let nodes: Vec<String> = ["n1", "n2", "n3"].map(String::from).into();
        let open = |n: &str| Arc::new(SharedJob::open(&cfg, 7, n, me(), true).unwrap());
        let (n1, n2) = (open("n1"), open("n2"));
        n1.mark("n1", Ok(())).unwrap();
        n2.mark("n2", Ok(())).unwrap();
        // n3 never marks: its agent died while writing its share.
        let taken: Arc<std::sync::Mutex<Vec<ShardPlan>>> = Default::default();
        let record = taken.clone();
        let take = move |sub: ShardPlan| -> futures::future::BoxFuture<'static, _> {
            record.lock().unwrap().push(sub);
            Box::pin(async { Ok(()) })
        };
        let cancel = CancellationToken::new();
        let dead = Dead(&["n3"]);
        let (p1, p2) = (
            ShardPlan::new(&nodes, "n1").unwrap(),
            ShardPlan::new(&nodes, "n2").unwrap(),
        );
        let (r1, r2) = tokio::time::timeout(
            Duration::from_secs(30),
            futures::future::join(
                n1.wait_for_all(&p1, &cancel, Some(&dead), &take),
                n2.wait_for_all(&p2, &cancel, Some(&dead), &take),
            ),
        )
        .await
        .expect("the survivors took n3's share over instead of waiting for the stage timeout");
        // Both go on, each with the note for the job output.
        for notes in [r1.unwrap(), r2.unwrap()] {
            assert_eq!(notes.len(), 1, "{notes:?}");
            assert!(
                notes[0].contains("node n3's agent could not be reached")
                    && notes[0].contains("connection refused")
                    && notes[0].contains("nodes n1, n2 wrote n3's files"),
                "{}",
                notes[0]
            );
        }
        // Each survivor wrote its part once, and each of n3's files has exactly one new writer.
        let taken = taken.lock().unwrap().clone();
        assert_eq!(taken.len(), 2, "{taken:?}");
        let p3 = ShardPlan::new(&nodes, "n3").unwrap();
        for i in 0..300 {
            let path = format!("ds/f{i}");
            let writers = taken.iter().filter(|t| t.owns(&path)).count();
            assert_eq!(writers, usize::from(p3.owns(&path)), "{path}");
        }
        // n3's agent comes back (a restart, or a fresh start of the job there): it finds the
        // takeover and does not write its share, and the job's wait counts the survivors' parts.
        let n3 = open("n3");
        assert!(n3.taken_over && !n3.done);
        assert!(n3.is_taken_over("n3"));
        let notes = n3.wait_for_all(&p3, &cancel, None, &no_take).await.unwrap();
        assert_eq!(notes.len(), 1);
        // A second claim (another survivor that found n3 dead a moment later) follows the first.
        let again = n2.claim(&Takeover::alone("n3", "n2", "late")).unwrap();
        assert_eq!(again.survivors, ["n1", "n2"]);
        assert_ne!(again.why, "late");
    }

    /// Job `job` of nodes n1 and n2 on the shared tier, as n1 sees it once it wrote its part; and
    /// n1's plan.
    fn n1_wrote_its_part(cfg: &SharedTierConfig, job: u32) -> (Arc<SharedJob>, ShardPlan) {
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).into();
        let n1 = Arc::new(SharedJob::open(cfg, job, "n1", me(), true).unwrap());
        n1.mark("n1", Ok(())).unwrap();
        (n1, ShardPlan::new(&nodes, "n1").unwrap())
    }

    #[tokio::test]
    async fn a_node_that_answers_is_never_taken_over_however_slow() {
        let root = tempfile::tempdir().unwrap();
        let cfg = cfg(root.path());
        let (n1, plan) = n1_wrote_its_part(&cfg, 8);
        let cancel = CancellationToken::new();
        let alive = Dead(&[]);
        // Longer than the probes take to find a dead node (DEAD_AFTER × PROBE_EVERY).
        let wait = tokio::time::timeout(
            PROBE_EVERY * (DEAD_AFTER + 1),
            n1.wait_for_all(&plan, &cancel, Some(&alive), &no_take),
        );
        assert!(wait.await.is_err(), "n1 went on without n2's share");
        assert!(!n1.is_taken_over("n2"));
        // The stage timeout (the token here) names the slow node.
        cancel.cancel();
        let e = n1
            .wait_for_all(&plan, &cancel, Some(&alive), &no_take)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("node(s) n2"), "{e}");
    }

    #[tokio::test]
    async fn a_survivor_that_fails_its_part_fails_the_job_naming_it() {
        let root = tempfile::tempdir().unwrap();
        let cfg = cfg(root.path());
        let (n1, plan) = n1_wrote_its_part(&cfg, 9);
        let take = |_: ShardPlan| -> futures::future::BoxFuture<'static, _> {
            Box::pin(async {
                Err(StageError::NotFound {
                    dataset: "s3://b/x".into(),
                })
            })
        };
        let e = n1
            .wait_for_all(
                &plan,
                &CancellationToken::new(),
                Some(&Dead(&["n2"])),
                &take,
            )
            .await
            .unwrap_err();
        assert!(e.to_string().contains("s3://b/x not found"), "{e}");
        // Its part is marked failed: another node of the job learns why.
        let n2 = Arc::new(SharedJob::open(&cfg, 9, "n2", me(), false).unwrap());
        let e = n2
            .wait_for_all(&plan, &CancellationToken::new(), None, &no_take)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("node n1")
                && e.to_string().contains("taking over node n2's share"),
            "{e}"
        );
    }
}
