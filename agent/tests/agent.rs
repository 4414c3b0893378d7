//! The agent in-process on a temp socket: the real server, framing, authorisation, staging from a
//! POSIX directory through the real `sluiced copy-as-user` helper, and cleanup.
//!
//! Needs root (the agent's identity in production): it creates files owned by another user. Object
//! stores are covered by the end-to-end tests against Garage and Azurite.

use sluice_proto::client::{self, ClientError};
use sluice_proto::msg::{ErrorCode, JobState, Request, Response};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[macro_use]
#[path = "support/as_root.rs"]
mod as_root;
use as_root::{NOBODY, Running, TestDir, give_to_nobody, make_dataset, nobody_job, spawn_agent};

struct TestAgent {
    _tmp: TestDir,
    socket: PathBuf,
    hot: PathBuf,
    data: PathBuf,
    agent: Running,
}

/// A fresh agent with the test dataset in place, and the path of its temp directory (for a test
/// that starts another agent on the same state).
async fn agent_with_dataset() -> (TestAgent, PathBuf) {
    let tmp = TestDir::new();
    let path = tmp.path().to_path_buf();
    let t = start(tmp).await;
    make_dataset(&t.data);
    (t, path)
}

/// Waits up to 15 s for `path` to be removed; panics with `what` if it stays.
async fn wait_gone(path: &Path, what: &str) {
    for _ in 0..150 {
        if !path.exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: {} is still there", path.display());
}

/// A fresh agent on a new temp directory.
async fn root_agent() -> TestAgent {
    start(TestDir::new()).await
}

/// Asserts that one of the notes the job's tasks get matches.
fn assert_note(dirs: &sluice_proto::msg::JobDirs, matches: impl Fn(&str) -> bool) {
    assert!(dirs.notes.iter().any(|n| matches(n)), "{:?}", dirs.notes);
}

async fn start(tmp: TestDir) -> TestAgent {
    start_with_squeue(tmp, "").await
}

/// `squeue`: the program asked after a restart whether journaled jobs still run ("" = never ask).
async fn start_with_squeue(tmp: TestDir, squeue: &str) -> TestAgent {
    start_with(tmp, squeue, "").await
}

/// `ckpt`: more `[ckpt]` settings.
async fn start_with(tmp: TestDir, squeue: &str, ckpt: &str) -> TestAgent {
    start_scanning(tmp, squeue, ckpt, "200ms").await
}

/// [`start_with`], the checkpoint workers rescanning every `scan_interval` (and when woken). The
/// epilog waits 20 s for archives unless `ckpt` says otherwise.
async fn start_scanning(tmp: TestDir, squeue: &str, ckpt: &str, scan_interval: &str) -> TestAgent {
    let root = tmp.path().to_path_buf();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let epilog_wait = if ckpt.contains("epilog_wait") {
        ""
    } else {
        "epilog_wait = '20s'\n"
    };
    let cfg = format!(
        "[agent]\nsocket = '{r}/%n.sock'\nstate_dir = '{r}/state/%n'\nsqueue = '{squeue}'\ndrain_timeout = '60s'\nhousekeeping_interval = '2s'\n[hot_tier]\nroot = '{r}/hot/%n'\n[stage]\ntimeout = '30s'\n\
         [ckpt]\nscan_interval = '{scan_interval}'\n{epilog_wait}part_size = '5MiB'\n{ckpt}\n\
         [[ckpt.allow]]\nprefix = 'file://{r}/'\n",
        r = root.display()
    );
    let agent = spawn_agent(&cfg);
    TestAgent {
        socket: agent.cfg.socket.clone(),
        hot: agent.cfg.hot_root.clone(),
        data: root.join("data"),
        _tmp: tmp,
        agent,
    }
}

impl TestAgent {
    async fn call(&self, req: Request) -> Result<Response, ClientError> {
        let socket = self.socket.clone();
        tokio::task::spawn_blocking(move || client::call(&socket, req, Duration::from_secs(30)))
            .await
            .unwrap()
    }

    /// Calls as another uid, like a job's task would (a forked child that drops to `uid`).
    fn call_as(&self, uid: u32, req: Request) -> Result<Response, String> {
        let socket = self.socket.clone();
        // Credentials are per thread in Linux: never change them inside the test process. A child
        // process speaks the wire format instead (4-byte length + JSON), as any local user could.
        let payload = serde_json::to_string(&req).unwrap();
        let script = format!(
            "import socket,struct,json,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect({sock:?})\nb=json.dumps({{'version':1,'request':json.loads(sys.argv[1])}}).encode()\ns.sendall(struct.pack('>I',len(b))+b)\nh=s.recv(4)\nn=struct.unpack('>I',h)[0]\nd=b''\nwhile len(d)<n: d+=s.recv(n-len(d))\nprint(d.decode())",
            sock = socket.display().to_string()
        );
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(payload)
            .uid(uid)
            .gid(uid)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
    }

    /// Waits for the job's staging (and restore) on this node; panics unless it is ready.
    async fn ready(&self, job_id: u32) -> sluice_proto::msg::JobDirs {
        match self
            .call(Request::WaitStaged {
                job_id,
                timeout_ms: 20_000,
                step: None,
            })
            .await
        {
            Ok(Response::Ready(dirs)) => dirs,
            other => panic!("job {job_id} is not ready: {other:?}"),
        }
    }

    /// Waits for a job whose set-up must fail; returns the error its tasks get.
    async fn set_up_fails(&self, job_id: u32) -> sluice_proto::msg::ErrorReply {
        self.refused(Request::WaitStaged {
            job_id,
            timeout_ms: 20_000,
            step: None,
        })
        .await
    }

    /// Starts a job whose set-up must fail; returns why it failed, as its tasks see it.
    async fn fails_to_set_up(&self, start: Request) -> String {
        let job_id = job_id(&start);
        self.job(start).await;
        self.set_up_fails(job_id).await.message
    }

    /// Starts a job ([`Self::job`]) and waits for it ([`Self::ready`]): its directories.
    async fn started(&self, start: Request) -> sluice_proto::msg::JobDirs {
        let job_id = job_id(&start);
        self.job(start).await;
        self.ready(job_id).await
    }

    /// The checkpoint directory of a job [`Self::started`].
    async fn ckpt_dir_of(&self, start: Request) -> PathBuf {
        PathBuf::from(self.started(start).await.ckpt_dir)
    }

    /// `sluice ckpt commit TAG` of job `job_id`; panics unless the agent takes it.
    async fn commit(&self, job_id: u32, tag: &str) {
        let commit = Request::CkptCommit {
            job_id,
            tag: tag.into(),
        };
        assert_eq!(self.call(commit).await.unwrap(), Response::Ok);
    }

    /// Starts a job (as the prolog does); panics unless the agent takes it.
    async fn job(&self, start: Request) {
        assert_eq!(self.call(start).await.unwrap(), Response::Ok);
    }

    /// Sends a request the agent must refuse; returns its error.
    async fn refused(&self, req: Request) -> sluice_proto::msg::ErrorReply {
        match self.call(req.clone()).await {
            Err(ClientError::Agent(e)) => e,
            other => panic!("{req:?} was not refused: {other:?}"),
        }
    }

    /// The directory of the tests' `file://` archive, beside the agent's data.
    fn archive_dir(&self) -> PathBuf {
        self.data.parent().unwrap().join("archive")
    }

    /// The URL of [`Self::archive_dir`].
    fn archive_url(&self) -> String {
        format!("file://{}", self.archive_dir().display())
    }

    /// The agent's journal directory (`state_dir`).
    fn keep_state(&self) -> PathBuf {
        self._tmp.path().join("state/n1")
    }

    /// Stops like sluiced on SIGTERM; returns the temp dir holding its state.
    async fn stop(self) -> TestDir {
        self.agent.stop().await;
        self._tmp
    }
}

fn job_start(job_id: u32, stage_in: &str) -> Request {
    nobody_job(job_id, "test", vec![("stage-in".into(), stage_in.into())])
}

root_test! {
    async fn stages_a_posix_dataset_as_the_job_user_and_cleans_up() {
        let t = root_agent().await;
        make_dataset(&t.data);
        assert_eq!(
            t.call(job_start(11, &format!("ds={}", t.data.display())))
                .await
                .unwrap(),
            Response::Ok
        );

        let Response::Ready(dirs) = t
            .call(Request::WaitStaged {
                job_id: 11,
                timeout_ms: 20_000,
            step: None,
            })
            .await
            .unwrap()
        else {
            panic!("not ready")
        };
        let staged = Path::new(&dirs.stage_dir).join("ds");
        assert_eq!(
            std::fs::read(staged.join("train/shard-0/a.bin")).unwrap(),
            vec![1u8; 300_000]
        );
        assert_eq!(std::fs::read(staged.join("train/empty")).unwrap(), b"");
        assert_eq!(
            std::fs::read(staged.join("labels.txt")).unwrap(),
            b"cat\ndog\n"
        );
        for p in [
            staged.join("labels.txt"),
            staged.clone(),
            PathBuf::from(&dirs.stage_dir),
            PathBuf::from(&dirs.ckpt_dir),
        ] {
            assert_eq!(
                std::fs::metadata(&p).unwrap().uid(),
                NOBODY,
                "{}",
                p.display()
            );
        }
        let job_dir = t.hot.join("jobs/11");
        assert_eq!(std::fs::metadata(&job_dir).unwrap().mode() & 0o777, 0o700);

        // Progress is visible to the owner and to root.
        let Response::Job(status) = t.call(Request::Job { job_id: 11 }).await.unwrap() else {
            panic!()
        };
        assert_eq!(status.state, JobState::Ready);
        assert_eq!(status.stages[0].files_done, 3);
        assert_eq!(status.stages[0].bytes_total, Some(300_008));

        // Another user may neither look at nor wait for the job, nor announce or end jobs.
        let other = 65533;
        for req in [
            Request::Job { job_id: 11 },
            Request::WaitStaged {
                job_id: 11,
                timeout_ms: 10,
            step: None,
            },
            Request::JobEnd { job_id: 11 },
            job_start(12, "/x"),
        ] {
            match t.call_as(other, req.clone()).unwrap() {
                Response::Error(e) => assert_eq!(e.code, ErrorCode::Forbidden, "{req:?}: {e:?}"),
                r => panic!("{req:?} was allowed: {r:?}"),
            }
        }
        // The owner may wait for it; a user's status shows only their own jobs.
        assert!(matches!(
            t.call_as(
                NOBODY,
                Request::WaitStaged {
                    job_id: 11,
                    timeout_ms: 1000,
                    step: None,
                }
            )
            .unwrap(),
            Response::Ready(_)
        ));
        let Response::Status(s) = t.call_as(other, Request::Status).unwrap() else {
            panic!()
        };
        assert!(s.jobs.is_empty());
        // Workers too: root and the job's user see the job's checkpoint worker, another user only
        // the node's own (an error of the job's worker may name the job's archive).
        let names = |s: &sluice_proto::msg::NodeStatus| {
            s.workers.iter().map(|w| w.name.clone()).collect::<Vec<_>>()
        };
        assert_eq!(names(&s), ["housekeeping"]);
        let Response::Status(s) = t.call(Request::Status).await.unwrap() else { panic!() };
        assert_eq!(names(&s), ["housekeeping", "ckpt job 11"]);
        assert!(s.workers.iter().all(|w| w.last_error.is_none()), "{:?}", s.workers);
        let Response::Status(s) = t.call_as(NOBODY, Request::Status).unwrap() else { panic!() };
        assert_eq!(names(&s), ["housekeeping", "ckpt job 11"]);

        assert_eq!(
            t.call(Request::JobEnd { job_id: 11 }).await.unwrap(),
            Response::Ok
        );
        assert!(!job_dir.exists(), "job directory left behind");
        t.stop().await;
    }
}

root_test! {
    async fn a_missing_or_unreadable_dataset_fails_the_job_with_a_clear_message() {
        let t = root_agent().await;
        t.job(job_start(21, "/nonexistent/imagenet")).await;
        let e = t.set_up_fails(21).await;
        assert_eq!(e.code, ErrorCode::StageFailed);
        assert!(
            e.message.contains("/nonexistent/imagenet not found"),
            "{}",
            e.message
        );

        // Root-only files are not readable by the job user, so they cannot be staged through sluice.
        let secret = t.data.join("secret");
        std::fs::create_dir_all(&secret).unwrap();
        std::fs::set_permissions(&t.data, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(secret.join("key"), b"root only").unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o700)).unwrap();
        t.job(job_start(22, &secret.display().to_string())).await;
        let e = t.set_up_fails(22).await;
        assert!(e.message.contains("denied"), "{}", e.message);
        assert!(!t.hot.join("jobs/22/stage/secret/key").exists());

        // Options are re-validated on the root side.
        t.job(job_start(23, "relative/path")).await;
        let e = t
            .refused(Request::WaitStaged {
                job_id: 23,
                timeout_ms: 5_000,
            step: None,
            })
            .await;
        assert!(e.message.contains("relative path"), "{}", e.message);
        t.stop().await;
    }
}

root_test! {
    async fn a_restarted_agent_resumes_staging_from_its_journal() {
        let (t, keep) = agent_with_dataset().await;
        t.job(job_start(31, &t.data.display().to_string())).await;
        // Stop the agent at once (staging may or may not have finished) and start a new one on the same
        // state: the job must come back and be (or become) ready.
        let t2 = start(t.stop().await).await;
        let dirs = t2.ready(31).await;
        assert_eq!(
            std::fs::read(Path::new(&dirs.stage_dir).join("data/labels.txt")).unwrap(),
            b"cat\ndog\n"
        );
        t2.call(Request::JobEnd { job_id: 31 }).await.unwrap();
        assert!(
            std::fs::read_dir(keep.join("state/n1/jobs"))
                .unwrap()
                .next()
                .is_none(),
            "journal record left behind"
        );
        t2.stop().await;
    }
}

/// The `file://` URL of an archive at `dir` that the agent cannot write to for now: `dir` is made
/// another user's (nobody's) directory.
fn unwritable_archive(dir: &Path) -> String {
    std::fs::create_dir_all(dir).unwrap();
    std::os::unix::fs::chown(dir, Some(NOBODY), Some(NOBODY)).unwrap();
    format!("file://{}", dir.display())
}

/// The job a job start starts.
fn job_id(start: &Request) -> u32 {
    let Request::JobStart(js) = start else {
        panic!("not a job start: {start:?}")
    };
    js.job_id
}

fn ckpt_job(job_id: u32, archive: &str, extra: &[(&str, &str)]) -> Request {
    let mut options = vec![("ckpt-archive".to_string(), archive.to_string())];
    options.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    nobody_job(job_id, "train", options)
}

/// Writes a checkpoint directory as the job user would (owned by the user).
fn write_ckpt(dir: &Path, tag: &str, seed: u8, dcp: bool) {
    let d = dir.join(tag);
    std::fs::create_dir_all(d.join("shards")).unwrap();
    let weights: Vec<u8> = (0..3_000_000u32)
        .map(|i| ((i as u8).wrapping_mul(seed) & 0x3f) ^ (i >> 12) as u8)
        .collect();
    std::fs::write(d.join("shards/rank0.bin"), &weights).unwrap();
    std::fs::write(d.join("optim.pt"), vec![seed; 4096]).unwrap();
    if dcp {
        std::fs::write(d.join(".metadata"), b"dcp").unwrap();
    }
    give_to_nobody(&d);
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut v = vec![p.to_path_buf()];
    if p.is_dir() {
        for e in std::fs::read_dir(p).unwrap() {
            v.extend(walk(&e.unwrap().path()));
        }
    }
    v
}

async fn wait_for_state(
    t: &TestAgent,
    job_id: u32,
    tag: &str,
    want: sluice_proto::msg::CkptState,
) -> sluice_proto::msg::CkptStatus {
    for _ in 0..200 {
        if let Ok(Response::Ckpts { ckpts: list }) = t.call(Request::CkptList { job_id }).await
            && let Some(c) = list.iter().find(|c| c.tag == tag && c.state == want)
        {
            return c.clone();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "checkpoint {tag} of job {job_id} never reached {want:?}: {:?}",
        t.call(Request::CkptList { job_id }).await
    );
}

root_test! {
    async fn checkpoints_are_committed_archived_trimmed_and_restored() {
        use sluice_proto::msg::CkptState;
        let t = root_agent().await;
        let (archive_dir, url) = (t.archive_dir(), t.archive_url());
        let dirs = t.started(ckpt_job(41, &url, &[("ckpt-keep", "1")])).await;
        let ckpt = PathBuf::from(&dirs.ckpt_dir);

        // Explicit commit.
        write_ckpt(&ckpt, "step-1", 3, false);
        t.commit(41, "step-1").await;
        let c1 = wait_for_state(&t, 41, "step-1", CkptState::Archived).await;
        assert!(c1.stored_bytes < c1.raw_bytes, "{c1:?}");
        // A framework signal commits without any call (DCP's .metadata), and retention (keep=1) then
        // trims the older archived checkpoint from the hot tier.
        write_ckpt(&ckpt, "step-2", 5, true);
        wait_for_state(&t, 41, "step-2", CkptState::Archived).await;
        wait_gone(&ckpt.join("step-1"), "older archived checkpoint not trimmed").await;
        assert!(
            ckpt.join("step-2/shards/rank0.bin").exists(),
            "newest archived checkpoint trimmed"
        );
        // Errors a user can act on.
        let e = t
            .refused(Request::CkptCommit {
                job_id: 41,
                tag: "nope".into(),
            })
            .await;
        assert!(
            e.message.contains("no checkpoint directory"),
            "{}",
            e.message
        );
        let e = t
            .refused(Request::CkptCommit {
                job_id: 41,
                tag: "step-2".into(),
            })
            .await;
        assert!(e.message.contains("immutable"), "{}", e.message);

        // An uncommitted (torn) checkpoint is never archived and goes at job end; the newest archived
        // one stays on the hot tier.
        std::fs::create_dir_all(ckpt.join("step-3")).unwrap();
        assert_eq!(
            t.call(Request::JobEnd { job_id: 41 }).await.unwrap(),
            Response::Ok
        );
        assert!(!ckpt.join("step-3").exists());
        assert!(ckpt.join("step-2/optim.pt").exists());
        assert!(!PathBuf::from(&dirs.stage_dir).exists());

        // A second job restores the newest checkpoint before its tasks start: from this node's hot tier,
        // where job 41 left it, after verifying it against the archive's MANIFEST.
        let optim = std::fs::read(ckpt.join("step-2/optim.pt")).unwrap();
        let rank0 = std::fs::read(ckpt.join("step-2/shards/rank0.bin")).unwrap();
        let dirs2 = t.started(ckpt_job(42, &url, &[("ckpt-restore", "latest")])).await;
        assert_eq!(dirs2.restored_tag.as_deref(), Some("step-2"));
        assert!(
            dirs2.notes.iter().any(|n| n.contains("hot tier")),
            "{:?}",
            dirs2.notes
        );
        let restored = PathBuf::from(&dirs2.ckpt_dir).join("step-2");
        assert_eq!(std::fs::read(restored.join("optim.pt")).unwrap(), optim);
        assert_eq!(
            std::fs::read(restored.join("shards/rank0.bin")).unwrap(),
            rank0
        );
        assert_eq!(
            std::fs::metadata(restored.join("optim.pt")).unwrap().uid(),
            NOBODY
        );
        assert!(
            !ckpt.join("step-2").exists(),
            "the hot-tier copy is moved, not duplicated"
        );
        // Job 42 ends keeping step-2 (restored = archived). A copy tampered with afterwards is not
        // trusted: the next restore comes from the archive.
        assert_eq!(
            t.call(Request::JobEnd { job_id: 42 }).await.unwrap(),
            Response::Ok
        );
        std::fs::write(restored.join("optim.pt"), b"tampered").unwrap();
        std::os::unix::fs::lchown(restored.join("optim.pt"), Some(NOBODY), Some(NOBODY)).unwrap();
        let d = t.started(ckpt_job(45, &url, &[("ckpt-restore", "step-2")])).await;
        assert!(
            !d.notes.iter().any(|n| n.contains("hot tier")),
            "{:?}",
            d.notes
        );
        assert_eq!(
            std::fs::read(PathBuf::from(&d.ckpt_dir).join("step-2/optim.pt")).unwrap(),
            optim
        );

        // Corrupt the newest archived object: `latest` falls back to step-1 and says so.
        let victim = archive_dir.join("step-2/data/optim.pt");
        let mut bytes = std::fs::read(&victim).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&victim, bytes).unwrap();
        let dirs3 = t.started(ckpt_job(43, &url, &[("ckpt-restore", "latest")])).await;
        assert_eq!(dirs3.restored_tag.as_deref(), Some("step-1"));
        assert_note(&dirs3, |n| {
            n.contains("step-2") && n.contains("falling back")
        });
        // Asking for the corrupted tag by name fails the job with the reason.
        let m = t.fails_to_set_up(ckpt_job(44, &url, &[("ckpt-restore", "step-2")])).await;

        assert!(m.contains("step-2"), "{m}");
        t.stop().await;
    }
}

root_test! {
    async fn a_client_that_hangs_up_mid_request_harms_nothing() {
        use std::io::Write;
        let t = start(TestDir::new()).await;
        make_dataset(&t.data);
        t.job(job_start(51, &t.data.display().to_string())).await;
        // A task that gives up while waiting (killed, timed out), and a client that sends half a frame.
        for bytes in [
            sluice_proto::wire::encode(&sluice_proto::wire::Envelope::new(Request::WaitStaged {
                job_id: 51,
                timeout_ms: 60_000,
            step: None,
            }))
            .unwrap(),
            vec![0, 0, 0, 200, b'{'],
        ] {
            let mut s = std::os::unix::net::UnixStream::connect(&t.socket).unwrap();
            s.write_all(&bytes).unwrap();
            drop(s);
        }
        // The agent goes on serving, and the job's staging is unaffected.
        let dirs = t.ready(51).await;
        assert_eq!(
            std::fs::read(Path::new(&dirs.stage_dir).join("data/labels.txt")).unwrap(),
            b"cat\ndog\n"
        );
        assert!(matches!(
            t.call(Request::Status).await.unwrap(),
            Response::Status(_)
        ));
        t.stop().await;
    }
}

root_test! {
    async fn a_job_that_ended_while_the_agent_was_down_is_cleaned_up_after_restart() {
        let t = root_agent().await;
        make_dataset(&t.data);
        t.job(job_start(61, &t.data.display().to_string())).await;
        t.ready(61).await;
        let hot = t.hot.clone();
        let tmp = t.stop().await;
        assert!(hot.join("jobs/61/stage/data").exists());
        // The epilog found no agent; Slurm no longer knows the job (what squeue says for a purged job).
        let squeue = tmp.path().join("squeue");
        std::fs::write(
            &squeue,
            "#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&squeue, std::fs::Permissions::from_mode(0o755)).unwrap();
        let t = start_with_squeue(tmp, &squeue.display().to_string()).await;
        wait_gone(&hot.join("jobs/61"), "staged data of an ended job left behind").await;
        t.stop().await;
    }
}

/// A second local user for the checkpoint-ownership test (F2 in docs/SECURITY.md).
const OTHER: u32 = 4242;

fn ckpt_job_as(
    job_id: u32,
    uid: u32,
    user: &str,
    archive: &str,
    extra: &[(&str, &str)],
) -> Request {
    let Request::JobStart(mut start) = ckpt_job(job_id, archive, extra) else {
        unreachable!()
    };
    (start.uid, start.gid, start.user) = (uid, uid, user.into());
    Request::JobStart(start)
}

root_test! {
    /// F2 in docs/SECURITY.md: under an allow rule without `{user}` two users archive into one prefix.
    /// B neither restores A's checkpoint (by `latest` or by its tag) nor overwrites it by committing
    /// the same tag, and A's `latest` passes over the newer checkpoint B published there.
    async fn restore_gives_only_the_users_own_checkpoints_from_a_shared_prefix() {
        use sluice_proto::msg::CkptState;
        let t = root_agent().await;
        let (archive_dir, url) = (t.archive_dir(), t.archive_url());
        let chown_tree = |dir: &Path, uid: u32| {
            for e in walk(dir) {
                std::os::unix::fs::lchown(&e, Some(uid), Some(uid)).unwrap();
            }
        };

        // A (nobody) archives step-1.
        let a_ckpt = t.ckpt_dir_of(ckpt_job(61, &url, &[])).await;
        write_ckpt(&a_ckpt, "step-1", 3, false);
        let a_optim = std::fs::read(a_ckpt.join("step-1/optim.pt")).unwrap();
        t.commit(61, "step-1").await;
        wait_for_state(&t, 61, "step-1", CkptState::Archived).await;
        t.call(Request::JobEnd { job_id: 61 }).await.unwrap();

        // B asks for the newest checkpoint of the shared prefix: there is none of B's.
        let b_restores = |job_id, which| {
            ckpt_job_as(job_id, OTHER, "other", &url, &[("ckpt-restore", which)])
        };
        let m = t.fails_to_set_up(b_restores(62, "latest")).await;
        assert!(
            m.contains("no checkpoint of yours") && m.contains("archived by other users (step-1)"),
            "{m}"
        );
        // B names A's tag: refused, saying whose it is and what to do.
        let m = t.fails_to_set_up(b_restores(63, "step-1")).await;
        assert!(
            m.contains("was archived by user nobody, not by other; sluice restores only your own")
                && m.contains("{user}"),
            "{m}"
        );
        // None of A's bytes reached B's job directories.
        for id in [62, 63] {
            let leaked: Vec<PathBuf> = walk(&t.hot.join(format!("jobs/{id}")))
                .into_iter()
                .filter(|p| p.is_file() && std::fs::read(p).is_ok_and(|b| b == a_optim))
                .collect();
            assert!(leaked.is_empty(), "job {id} got A's file: {leaked:?}");
        }

        // B archives into the same prefix: its own step-2 is published, but its step-1 would overwrite
        // A's and is refused.
        let b_ckpt = t.ckpt_dir_of(ckpt_job_as(64, OTHER, "other", &url, &[])).await;
        write_ckpt(&b_ckpt, "step-1", 7, false);
        write_ckpt(&b_ckpt, "step-2", 9, false);
        chown_tree(&b_ckpt.join("step-1"), OTHER);
        chown_tree(&b_ckpt.join("step-2"), OTHER);
        for tag in ["step-1", "step-2"] {
            t.call(Request::CkptCommit {
                job_id: 64,
                tag: tag.into(),
            })
            .await
            .unwrap();
        }
        wait_for_state(&t, 64, "step-2", CkptState::Archived).await;
        let refused = wait_for_state(&t, 64, "step-1", CkptState::Modified).await;
        let why = refused.error.unwrap_or_default();
        assert!(
            why.contains("was archived by user nobody; sluice does not overwrite"),
            "{why}"
        );
        t.call(Request::JobEnd { job_id: 64 }).await.unwrap();
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(archive_dir.join("step-1/MANIFEST")).unwrap())
                .unwrap();
        assert_eq!(
            manifest["job"]["user"], "nobody",
            "A's step-1 was overwritten"
        );

        // A's `latest` restores A's step-1, whole, not B's newer step-2, and says it skipped it.
        let d = t.started(ckpt_job(65, &url, &[("ckpt-restore", "latest")])).await;
        assert_eq!(d.restored_tag.as_deref(), Some("step-1"));
        assert_note(&d, |n| {
            n.contains("skipped 1 checkpoint(s)") && n.contains("(step-2)")
        });
        assert_eq!(
            std::fs::read(PathBuf::from(&d.ckpt_dir).join("step-1/optim.pt")).unwrap(),
            a_optim
        );
        t.stop().await;
    }
}

root_test! {
    async fn a_requeued_run_is_never_cleaned_up_by_the_run_it_replaced() {
        let (t, keep) = agent_with_dataset().await;
        let src = t.data.display().to_string();
        t.job(job_start(91, &src)).await;
        t.ready(91).await;
        // Slurm requeues the job and its new run's prolog arrives (with other options): the old run is
        // over, and its checkpoint worker has every reason to clean up `jobs/91` — which is the new
        // run's directory now.
        let dirs = t.started(job_start(91, &format!("again={src}"))).await;
        let staged = Path::new(&dirs.stage_dir).join("again/labels.txt");
        let journal = keep.join("state/n1/jobs");
        for _ in 0..30 {
            assert_eq!(
                std::fs::read(&staged).ok().as_deref(),
                Some(&b"cat\ndog\n"[..]),
                "the replaced run removed the new run's staged data"
            );
            assert!(
                journal.join("91.json").exists(),
                "the replaced run removed the new run's journal record"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        t.call(Request::JobEnd { job_id: 91 }).await.unwrap();
        t.stop().await;
    }
}

root_test! {
    /// Issue 10: `--ckpt-restore=latest` on an archive that holds nothing yet starts the job fresh and
    /// says so (the first run of a `--requeue` job); a named tag that is not there still fails the job.
    async fn restore_latest_from_an_empty_archive_starts_fresh_with_a_note() {
        let t = root_agent().await;
        let url = t.archive_url();
        let dirs = t.started(ckpt_job(61, &url, &[("ckpt-restore", "latest")])).await;
        assert_eq!(dirs.restored_tag, None);
        assert_note(&dirs, |n| {
            n.contains("holds no checkpoint yet; the job starts fresh")
        });
        let m = t.fails_to_set_up(ckpt_job(62, &url, &[("ckpt-restore", "step-9")])).await;

        assert!(m.contains("--ckpt-restore=step-9"), "{m}");
        t.stop().await;
    }
}

root_test! {
    /// Issue 10, defect 5: the end of a job the agent has no record of (its journal record was lost)
    /// removes its staged data but never its checkpoints, which may not be archived.
    async fn the_end_of_an_unknown_job_keeps_its_checkpoints() {
        let t = root_agent().await;
        let job = t.hot.join("jobs/77");
        std::fs::create_dir_all(job.join("stage/ds")).unwrap();
        std::fs::create_dir_all(job.join("ckpt/step-3")).unwrap();
        std::fs::write(job.join("ckpt/step-3/model.pt"), b"weights").unwrap();
        assert_eq!(
            t.call(Request::JobEnd { job_id: 77 }).await.unwrap(),
            Response::Ok
        );
        assert!(!job.join("stage").exists(), "staged data is removed");
        assert_eq!(
            std::fs::read(job.join("ckpt/step-3/model.pt")).unwrap(),
            b"weights",
            "an unknown job's checkpoint is kept"
        );
        t.stop().await;
    }
}

root_test! {
    /// Issue 10, defect 2: a later job that reuses an archived tag under the same archive (the
    /// default `{job_name}` prefix of a rerun) is refused unless its content is identical, and its
    /// copy stays on the hot tier, unarchived and never trimmed; identical content is archived.
    async fn a_reused_tag_with_other_content_is_refused_and_kept() {
        use sluice_proto::msg::CkptState;
        let t = root_agent().await;
        let url = t.archive_url();
        let commit = |job_id: u32| Request::CkptCommit {
            job_id,
            tag: "s1".into(),
        };
        // Job 71 archives s1.
        t.job(ckpt_job(71, &url, &[])).await;
        write_ckpt(Path::new(&t.ready(71).await.ckpt_dir), "s1", 3, false);
        assert_eq!(t.call(commit(71)).await.unwrap(), Response::Ok);
        wait_for_state(&t, 71, "s1", CkptState::Archived).await;
        t.call(Request::JobEnd { job_id: 71 }).await.unwrap();
        // Job 72 commits other bytes under the same tag.
        let ckpt72 = t.ckpt_dir_of(ckpt_job(72, &url, &[("ckpt-keep", "1")])).await;
        write_ckpt(&ckpt72, "s1", 4, false);
        assert_eq!(t.call(commit(72)).await.unwrap(), Response::Ok);
        let refused = wait_for_state(&t, 72, "s1", CkptState::Refused).await;
        let why = refused.error.unwrap_or_default();
        assert!(
            why.contains("already archived") && why.contains("by job 71") && why.contains("new tag"),
            "{why}"
        );
        let manifest: serde_json::Value = serde_json::from_slice(
            &std::fs::read(t.data.parent().unwrap().join("archive/s1/MANIFEST")).unwrap(),
        )
        .unwrap();
        assert_eq!(manifest["job"]["job_id"], 71, "the archive keeps job 71's s1");
        // The job's output says so: the next step's tasks get it as a note (issue 10: final errors
        // reach the job's output while it runs; the batch step's end prints it again).
        assert!(refused.action_needed, "s1 is refused but not marked for the user");
        assert_note(&t.ready(72).await, |n| {
            n.starts_with("checkpoint s1 is NOT archived: ") && n.contains("by job 71")
        });
        t.call(Request::JobEnd { job_id: 72 }).await.unwrap();
        assert!(
            ckpt72.join("s1/shards/rank0.bin").exists(),
            "the refused copy is the only one of its bytes: it must stay"
        );
        // Job 73 commits the very bytes job 71 archived: nothing to refuse.
        t.job(ckpt_job(73, &url, &[])).await;
        write_ckpt(Path::new(&t.ready(73).await.ckpt_dir), "s1", 3, false);
        assert_eq!(t.call(commit(73)).await.unwrap(), Response::Ok);
        let archived = wait_for_state(&t, 73, "s1", CkptState::Archived).await;
        assert!(!archived.action_needed, "{archived:?}");
        assert!(t.ready(73).await.notes.is_empty());
        t.stop().await;
    }
}

root_test! {
    /// Issue 10, defect 3: a requeued run (same job id, same node) inherits the committed
    /// checkpoints the run it replaces had not archived yet, instead of removing them as stale
    /// data, and archives them; torn, uncommitted directories still go.
    async fn a_requeued_run_keeps_and_archives_the_unarchived_checkpoints_of_the_run_before() {
        use sluice_proto::msg::CkptState;
        let t = root_agent().await;
        // An archive the agent refuses to open for now (a user owns its directory): commits pile up.
        let archive_dir = t.archive_dir();
        std::fs::create_dir_all(&archive_dir).unwrap();
        std::os::unix::fs::chown(&archive_dir, Some(NOBODY), Some(NOBODY)).unwrap();
        let url = format!("file://{}", archive_dir.display());
        let ckpt = t.ckpt_dir_of(ckpt_job(95, &url, &[])).await;
        write_ckpt(&ckpt, "s1", 5, false);
        std::fs::create_dir_all(ckpt.join("torn")).unwrap();
        std::os::unix::fs::chown(ckpt.join("torn"), Some(NOBODY), Some(NOBODY)).unwrap();
        t.commit(95, "s1").await;
        wait_for_state(&t, 95, "s1", CkptState::Retrying).await;
        // Slurm requeues the job onto this node: the new run's prolog comes.
        t.job(ckpt_job(95, &url, &[("ckpt-keep", "2")])).await;
        t.ready(95).await;
        assert!(
            ckpt.join("s1/shards/rank0.bin").exists(),
            "the new run removed a committed checkpoint that was not archived"
        );
        assert!(!ckpt.join("torn").exists(), "a torn save of the old run stays");
        // The archive becomes usable: the new run archives what it inherited.
        std::os::unix::fs::chown(&archive_dir, Some(0), Some(0)).unwrap();
        wait_for_state(&t, 95, "s1", CkptState::Archived).await;
        assert!(archive_dir.join("s1/MANIFEST").exists());
        t.stop().await;
    }
}

root_test! {
    /// Issue 10, defect 6: an error retrying cannot fix (here an unreadable MANIFEST already under
    /// the tag) ends the checkpoint's attempts with a `refused` state that says so, and the copy
    /// stays on the hot tier; before, it was retried forever.
    async fn a_permanent_archive_error_is_final_and_keeps_the_copy() {
        use sluice_proto::msg::CkptState;
        let t = root_agent().await;
        let archive_dir = t.archive_dir();
        std::fs::create_dir_all(archive_dir.join("s1")).unwrap();
        std::fs::write(archive_dir.join("s1/MANIFEST"), b"not a manifest").unwrap();
        let url = format!("file://{}", archive_dir.display());
        let ckpt = t.ckpt_dir_of(ckpt_job(96, &url, &[])).await;
        write_ckpt(&ckpt, "s1", 6, false);
        let commit = Request::CkptCommit {
            job_id: 96,
            tag: "s1".into(),
        };
        assert_eq!(t.call(commit.clone()).await.unwrap(), Response::Ok);
        let refused = wait_for_state(&t, 96, "s1", CkptState::Refused).await;
        let why = refused.error.unwrap_or_default();
        assert!(why.contains("retrying cannot help"), "{why}");
        assert!(
            t.refused(commit).await.message.contains("immutable"),
            "a refused tag is not committed again"
        );
        t.call(Request::JobEnd { job_id: 96 }).await.unwrap();
        assert!(ckpt.join("s1/shards/rank0.bin").exists(), "the only copy was removed");
        t.stop().await;
    }
}

root_test! {
    /// Issue 10, defect 4: above the high-water mark, the archived checkpoints that finished jobs
    /// keep on the hot tier are removed (they are safe in the archive), the job's directory and
    /// journal record with them; before, a job past the 64 the agent remembers kept them forever.
    async fn above_the_high_water_mark_finished_jobs_give_back_their_archived_copies() {
        use sluice_proto::msg::CkptState;
        // Any file system is more than 1 % full: always above the mark.
        let t = start_with(TestDir::new(), "", "high_water = 1").await;
        let (archive_dir, url) = (t.archive_dir(), t.archive_url());
        let ckpt = t.ckpt_dir_of(ckpt_job(81, &url, &[])).await;
        write_ckpt(&ckpt, "s1", 8, false);
        t.commit(81, "s1").await;
        wait_for_state(&t, 81, "s1", CkptState::Archived).await;
        assert!(ckpt.join("s1").exists(), "a running job keeps its newest archived checkpoint");
        t.call(Request::JobEnd { job_id: 81 }).await.unwrap();
        // Housekeeping runs every 2 s here (`agent.housekeeping_interval`).
        wait_gone(&t.hot.join("jobs/81"), "the finished job's directory").await;
        assert!(archive_dir.join("s1/MANIFEST").exists(), "the archive keeps s1");
        wait_gone(&t.keep_state().join("jobs/81.json"), "its journal record").await;
        t.stop().await;
    }
}

root_test! {
    /// Issue 10, "how long publishing waits for a node that does [hold files] — bounded, and visible
    /// in `sluice ckpt list`": a node whose part is archived waits `ckpt.publish_wait` for a node
    /// that never answers (its agent is gone), says how long in the listing, then gives the
    /// checkpoint up as incomplete — kept on the hot tier after the job, named in the job's notes —
    /// and a new commit of the tag tries again.
    async fn a_part_that_never_comes_makes_the_checkpoint_incomplete_and_kept() {
        use sluice_proto::msg::CkptState;
        let tmp = TestDir::new();
        let t = start_with(tmp, "", "publish_wait = '3s'").await;
        let url = t.archive_url();
        let Request::JobStart(mut start) = ckpt_job(81, &url, &[]) else {
            unreachable!()
        };
        start.nodes = vec!["n1".into(), "ghost".into()]; // ghost's agent never answers
        let ckpt = t.ckpt_dir_of(Request::JobStart(start)).await;
        write_ckpt(&ckpt, "s1", 3, false);
        t.commit(81, "s1").await;
        let waiting = wait_for_state(&t, 81, "s1", CkptState::WaitingForNodes).await;
        let why = waiting.error.unwrap_or_default();
        assert!(why.contains("ghost") && why.contains("at most"), "{why}");
        assert!(!waiting.action_needed);
        let gave_up = wait_for_state(&t, 81, "s1", CkptState::Incomplete).await;
        let why = gave_up.error.clone().unwrap_or_default();
        assert!(
            gave_up.action_needed && why.contains("ghost") && why.contains("never sent their part"),
            "{gave_up:?}"
        );
        assert_note(&t.ready(81).await, |n| {
            n.starts_with("checkpoint s1 is NOT archived: node(s) ghost")
        });
        assert!(
            !t.data.parent().unwrap().join("archive/s1/MANIFEST").exists(),
            "an incomplete checkpoint must not be published"
        );
        // Committed again (the user brought the node back, or just tries again): it waits anew.
        t.commit(81, "s1").await;
        wait_for_state(&t, 81, "s1", CkptState::WaitingForNodes).await;
        wait_for_state(&t, 81, "s1", CkptState::Incomplete).await;
        // The job ends: the only copy of s1's bytes stays on the hot tier.
        t.call(Request::JobEnd { job_id: 81 }).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            ckpt.join("s1/shards/rank0.bin").exists(),
            "an unarchived checkpoint was removed at job end"
        );
        t.stop().await;
    }
}

/// An agent with a RAM tier of `share` bytes per job (a tmpfs the agent mounts for each job).
async fn ram_agent(share: &str) -> (TestAgent, PathBuf) {
    let tmp = TestDir::new();
    let ram = tmp.path().join("ram");
    let fast = fast_tier(&ram, share);
    (start_with(tmp, "", &fast).await, ram.join("n1"))
}

/// A checkpointing job on the RAM tier (`--ckpt-tier=ram`), archiving to `url`.
fn ram_job(job_id: u32, url: &str) -> Request {
    ckpt_job(job_id, url, &[("ckpt-tier", "ram")])
}

/// Starts [`ram_job`] `job_id` and writes checkpoint `s1` (from `seed`) into its checkpoint
/// directory, the job's tmpfs, which it returns.
async fn ram_job_with_s1(t: &TestAgent, job_id: u32, url: &str, seed: u8) -> PathBuf {
    let ckpt = t.ckpt_dir_of(ram_job(job_id, url)).await;
    write_ckpt(&ckpt, "s1", seed, false);
    ckpt
}

/// The `[fast_tier]` of [`ram_agent`], below `ram`.
fn fast_tier(ram: &Path, share: &str) -> String {
    format!(
        "\n[fast_tier]\nroot = '{}/%n'\ncapacity = '64MiB'\njob_share = '{share}'\nflush_block = '1MiB'\n",
        ram.display()
    )
}

/// Changes one byte of `path` (a copy damaged on its disk after it was written).
fn damage(path: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_at(&mut b, 1 << 20).unwrap_or_default();
    f.write_all_at(&[!b[0]], 1 << 20).unwrap();
    f.sync_all().unwrap();
}

fn ckpt_status(list: &[sluice_proto::msg::CkptStatus], tag: &str) -> sluice_proto::msg::CkptStatus {
    list.iter()
        .find(|c| c.tag == tag)
        .cloned()
        .unwrap_or_else(|| panic!("no {tag} in {list:?}"))
}

root_test! {
    /// Issue 13: `--ckpt-tier=ram` puts `$SLUICE_CKPT_DIR` on a tmpfs of the job's share; each
    /// committed checkpoint is flushed to the NVMe hot tier (byte-identical), archived from there,
    /// and its RAM copy freed once a newer one is safe; a save past the share fails in the writer
    /// with ENOSPC and costs the committed checkpoints nothing; the job's end flushes what is only
    /// in RAM before the tmpfs goes.
    async fn a_ram_tier_checkpoint_is_flushed_to_nvme_archived_and_freed() {
        use sluice_proto::msg::CkptState;
        let (t, ram) = ram_agent("16MiB").await;
        let url = t.archive_url();
        let dirs = t.started(ram_job(81, &url)).await;
        let ckpt = PathBuf::from(&dirs.ckpt_dir);
        assert_eq!(ckpt, ram.join("jobs/81/ckpt"), "$SLUICE_CKPT_DIR is not on the RAM tier");
        let fs = nix::sys::statfs::statfs(&ckpt).unwrap();
        assert_eq!(fs.filesystem_type(), nix::sys::statfs::TMPFS_MAGIC);
        assert_eq!(std::fs::metadata(&ckpt).unwrap().uid(), NOBODY);
        write_ckpt(&ckpt, "s1", 3, false);
        t.commit(81, "s1").await;
        let s1 = wait_for_state(&t, 81, "s1", CkptState::Archived).await;
        assert!(s1.on_hot_tier && s1.in_ram, "{s1:?}");
        let nvme = t.hot.join("jobs/81/ckpt");
        for f in ["shards/rank0.bin", "optim.pt"] {
            assert_eq!(
                std::fs::read(nvme.join("s1").join(f)).unwrap(),
                std::fs::read(ckpt.join("s1").join(f)).unwrap(),
                "{f} on the hot tier differs from the RAM copy"
            );
        }
        assert_eq!(std::fs::metadata(nvme.join("s1/optim.pt")).unwrap().uid(), NOBODY);
        // A newer checkpoint: once it is safe, s1 leaves RAM (it stays on NVMe and in the archive).
        write_ckpt(&ckpt, "s2", 4, false);
        t.commit(81, "s2").await;
        wait_for_state(&t, 81, "s2", CkptState::Archived).await;
        wait_gone(&ckpt.join("s1"), "the flushed s1 in RAM").await;
        let Response::Ckpts { ckpts } = t.call(Request::CkptList { job_id: 81 }).await.unwrap() else {
            panic!()
        };
        let (s1, s2) = (ckpt_status(&ckpts, "s1"), ckpt_status(&ckpts, "s2"));
        assert!(!s1.in_ram && s1.on_hot_tier, "{s1:?}");
        assert!(s2.in_ram && s2.on_hot_tier, "{s2:?}");
        // Past the share, the writer sees ENOSPC — the node's memory is not at stake.
        let e = std::fs::write(ckpt.join("too-big"), vec![1u8; 16 << 20]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::libc::ENOSPC), "{e}");
        std::fs::remove_file(ckpt.join("too-big")).unwrap();
        // s3, committed just before the job ends, is only in RAM: the end flushes it first.
        write_ckpt(&ckpt, "s3", 5, false);
        t.commit(81, "s3").await;
        t.call(Request::JobEnd { job_id: 81 }).await.unwrap();
        wait_gone(&ram.join("jobs/81"), "the job's RAM tier after its end").await;
        assert!(nvme.join("s3/shards/rank0.bin").exists(), "s3 was lost with the RAM tier");
        assert!(t.data.parent().unwrap().join("archive/s3/MANIFEST").exists());
        t.stop().await;
    }
}

root_test! {
    /// Issue 13: a RAM-tier job whose agent stops before its checkpoint is flushed loses nothing:
    /// the tmpfs outlives the agent, and the next agent flushes and archives the checkpoint; a
    /// flush cut short (`.flush-TAG` on the hot tier) is never taken for the checkpoint.
    async fn an_agent_restart_before_the_flush_loses_nothing() {
        use sluice_proto::msg::CkptState;
        let (t, ram) = ram_agent("16MiB").await;
        let (archive, nvme) = (
            t.archive_dir(),
            t.hot.join("jobs/82/ckpt"),
        );
        // No archive yet (its directory is another user's): the agent keeps retrying.
        let url = unwritable_archive(&archive);
        let ckpt = ram_job_with_s1(&t, 82, &url, 7).await;
        let tmp = t.stop().await;
        // What a kill mid-flush leaves: a partial copy under the flush's name, and the commit in
        // the journal (here the commit reaches the journal through a second agent, stopped at once).
        std::fs::create_dir_all(nvme.join(".flush-s1/shards")).unwrap();
        std::fs::write(nvme.join(".flush-s1/shards/rank0.bin"), b"torn").unwrap();
        let t = start_with(tmp, "", &format!(
            "\n[fast_tier]\nroot = '{}/%n'\ncapacity = '64MiB'\njob_share = '16MiB'\n",
            ram.parent().unwrap().display()
        )).await;
        t.commit(82, "s1").await;
        std::os::unix::fs::chown(&archive, Some(0), Some(0)).unwrap();
        let s1 = wait_for_state(&t, 82, "s1", CkptState::Archived).await;
        assert!(s1.on_hot_tier, "{s1:?}");
        assert!(!nvme.join(".flush-s1").exists(), "the torn flush is still there");
        assert_eq!(
            std::fs::read(nvme.join("s1/shards/rank0.bin")).unwrap(),
            std::fs::read(ckpt.join("s1/shards/rank0.bin")).unwrap()
        );
        t.stop().await;
    }
}

root_test! {
    /// An ended RAM-tier job gives its share of the RAM tier back once its checkpoints are on
    /// NVMe, not once the archive holds them (here the archive is down): new jobs get the RAM
    /// tier, and so they do after an agent restart, which recovers the ended jobs from its journal
    /// (found by the bench: after the e2e suite, ended jobs waiting for an archive sent a RAM job
    /// to NVMe).
    async fn ended_ram_jobs_give_their_share_back_before_the_archive_has_them() {
        use sluice_proto::msg::CkptState;
        // Capacity 64 MiB, shares of 32 MiB: two jobs fill it. The epilog waits 1 s for the
        // archive, which is down throughout.
        let tmp = TestDir::new();
        let ram = tmp.path().join("ram");
        let config = format!("epilog_wait = '1s'\n{}", fast_tier(&ram, "32MiB"));
        let ram = ram.join("n1");
        let t = start_with(tmp, "", &config).await;
        let url = unwritable_archive(&t.archive_dir());
        for id in [87, 88] {
            ram_job_with_s1(&t, id, &url, 9).await;
            t.commit(id, "s1").await;
            t.call(Request::JobEnd { job_id: id }).await.unwrap();
            wait_gone(&ram.join(format!("jobs/{id}")), "the ended job's RAM tier").await;
            let Response::Ckpts { ckpts } = t.call(Request::CkptList { job_id: id }).await.unwrap()
            else {
                panic!()
            };
            let s1 = ckpt_status(&ckpts, "s1");
            assert!(
                s1.state != CkptState::Archived && s1.on_hot_tier && !s1.in_ram,
                "{s1:?}"
            );
        }
        let dirs = t.started(ram_job(89, &url)).await;
        assert!(dirs.ckpt_dir.starts_with(ram.to_str().unwrap()), "{dirs:?}");
        // A restarted agent recovers the three from its journal; 87 and 88, ended and waiting for
        // the archive, take no share: a new job gets the RAM tier's other half.
        let tmp = t.stop().await;
        let t = start_with(tmp, "", &config).await;
        let dirs = t.started(ram_job(90, &url)).await;
        assert!(
            dirs.ckpt_dir.starts_with(ram.to_str().unwrap()),
            "job 90 was not given the RAM tier: {dirs:?}"
        );
        t.stop().await;
    }
}

root_test! {
    /// Issue 13: `--ckpt-tier=ram` on a node without `[fast_tier]` fails the job with what to do,
    /// and so does `--ckpt-replicas` (issue 26: the replicas are held in RAM tiers); with the node's RAM tier full, a job gets the hot tier and a note saying so.
    async fn without_room_on_the_ram_tier_a_job_is_told() {
        let t = root_agent().await;
        let url = t.archive_url();
        t.job(ram_job(83, &url)).await;
        let e = t
            .refused(Request::WaitStaged { job_id: 83, timeout_ms: 20_000, step: None })
            .await;
        assert!(e.message.contains("no RAM tier is configured") && e.message.contains("--ckpt-tier=local"), "{e:?}");
        // Replicas of hot-tier checkpoints are held in the other nodes' RAM tier: none here.
        t.job(ckpt_job(91, &url, &[("ckpt-replicas", "1")])).await;
        let e = t
            .refused(Request::WaitStaged { job_id: 91, timeout_ms: 20_000, step: None })
            .await;
        assert!(e.message.contains("--ckpt-replicas: this cluster has no RAM tier") && e.message.contains("drop --ckpt-replicas"), "{e:?}");
        t.stop().await;
        // Capacity 64 MiB, shares of 32 MiB: the third job finds none free.
        let (t, ram) = ram_agent("32MiB").await;
        let url = t.archive_url();
        for id in [84, 85] {
            t.job(ram_job(id, &url)).await;
            assert!(t.ready(id).await.ckpt_dir.starts_with(ram.to_str().unwrap()));
        }
        let dirs = t.started(ram_job(86, &url)).await;
        assert_eq!(PathBuf::from(&dirs.ckpt_dir), t.hot.join("jobs/86/ckpt"));
        assert_note(&dirs, |n| n.contains("RAM tier of node n1 is full") && n.contains("NVMe hot tier"));
        t.stop().await;
    }
}

root_test! {
    /// Issue 13: the flush hashes each file as it reads it from RAM and reads nothing back; the hot
    /// tier's copy is verified by its upload, which hashes it for the MANIFEST anyway, against the
    /// flush's hashes — kept in the journal, so an agent restarted in between still verifies. A copy
    /// damaged on the hot tier after its flush is flushed again from RAM (kept until then), and the
    /// archive gets what the job saved, never the damaged copy.
    async fn a_hot_copy_that_is_not_as_flushed_is_flushed_again_from_ram() {
        use sluice_proto::msg::CkptState;
        let tmp = TestDir::new();
        let ram = tmp.path().join("ram");
        let fast = fast_tier(&ram, "16MiB");
        // Turns only when woken (by the commit): nothing reads the copy before the test damages it.
        let t = start_scanning(tmp, "", &fast, "1h").await;
        let (archive, nvme) = (
            t.archive_dir(),
            t.hot.join("jobs/87/ckpt"),
        );
        let state = t.data.parent().unwrap().join("state/n1/jobs/87.json");
        // The archive is another user's directory for now: the first upload fails.
        let url = unwritable_archive(&archive);
        let ckpt = ram_job_with_s1(&t, 87, &url, 9).await;
        t.commit(87, "s1").await;
        let s1 = wait_for_state(&t, 87, "s1", CkptState::Retrying).await;
        assert!(s1.on_hot_tier && s1.in_ram, "{s1:?}");
        let record = std::fs::read_to_string(&state).unwrap();
        assert!(record.contains("flush_blake3"), "the flush's hashes are not in the journal: {record}");
        damage(&nvme.join("s1/shards/rank0.bin"));
        let tmp = t.stop().await;
        std::os::unix::fs::chown(&archive, Some(0), Some(0)).unwrap();
        let t = start_with(tmp, "", &fast).await;
        let s1 = wait_for_state(&t, 87, "s1", CkptState::Archived).await;
        assert!(s1.on_hot_tier && s1.in_ram, "{s1:?}");
        let saved = std::fs::read(ckpt.join("s1/shards/rank0.bin")).unwrap();
        assert_eq!(
            std::fs::read(nvme.join("s1/shards/rank0.bin")).unwrap(),
            saved,
            "the damaged copy is still on the hot tier"
        );
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(archive.join("s1/MANIFEST")).unwrap()).unwrap();
        let archived = manifest["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == "shards/rank0.bin")
            .unwrap()["blake3"]
            .clone();
        assert_eq!(
            archived.as_str(),
            Some(blake3::hash(&saved).to_hex().as_str()),
            "the archive holds another rank0.bin than the job saved"
        );
        let record = std::fs::read_to_string(&state).unwrap();
        assert!(!record.contains("flush_blake3"), "verified, yet the hashes are kept: {record}");
        t.stop().await;
    }
}

root_test! {
    /// Issue 13: without `--ckpt-archive` nothing reads the flushed copy, so the agent reads it back
    /// once in the background; only then does the RAM copy of an older checkpoint go.
    async fn without_an_archive_a_flushed_copy_is_read_back_before_its_ram_copy_goes() {
        use sluice_proto::msg::CkptState;
        let (t, ram) = ram_agent("16MiB").await;
        let state = t.data.parent().unwrap().join("state/n1/jobs/88.json");
        let ckpt = t.ckpt_dir_of(nobody_job(88, "train", vec![("ckpt-tier".into(), "ram".into())])).await;
        let nvme = t.hot.join("jobs/88/ckpt");
        // Committed, with a warning that nothing will archive it.
        let commit = |tag: &str| Request::CkptCommit { job_id: 88, tag: tag.into() };
        write_ckpt(&ckpt, "s1", 3, false);
        let e = t.refused(commit("s1")).await;
        assert!(e.message.contains("is committed but will not be archived"), "{e:?}");
        write_ckpt(&ckpt, "s2", 4, false);
        t.refused(commit("s2")).await;
        wait_gone(&ckpt.join("s1"), "the verified s1 in RAM").await;
        for _ in 0..100 {
            if !std::fs::read_to_string(&state).unwrap().contains("flush_blake3") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let record = std::fs::read_to_string(&state).unwrap();
        assert!(!record.contains("flush_blake3"), "s1 and s2 were never read back: {record}");
        let Response::Ckpts { ckpts } = t.call(Request::CkptList { job_id: 88 }).await.unwrap() else {
            panic!()
        };
        let (s1, s2) = (ckpt_status(&ckpts, "s1"), ckpt_status(&ckpts, "s2"));
        assert!(!s1.in_ram && s1.on_hot_tier && s1.state == CkptState::Committed, "{s1:?}");
        assert!(s2.in_ram && s2.on_hot_tier, "{s2:?}");
        assert_eq!(
            std::fs::read(nvme.join("s2/shards/rank0.bin")).unwrap(),
            std::fs::read(ckpt.join("s2/shards/rank0.bin")).unwrap()
        );
        t.call(Request::JobEnd { job_id: 88 }).await.unwrap();
        wait_gone(&ram.join("jobs/88"), "the job's RAM tier after its end").await;
        assert!(nvme.join("s1/optim.pt").exists() && nvme.join("s2/optim.pt").exists());
        t.stop().await;
    }
}

root_test! {
    /// Issue 13: an agent restarted with a config that no longer has the `[fast_tier]` of a RAM
    /// job still flushes its checkpoints from the tmpfs its record names; where that tmpfs is gone
    /// (a reboot), a checkpoint that was only in RAM is reported lost — in `sluice ckpt list`, with
    /// the reason, for the user to act — instead of staying pending forever.
    async fn a_ram_job_recovered_without_its_fast_tier_is_flushed_or_reported_lost() {
        use sluice_proto::msg::CkptState;
        let (t, ram) = ram_agent("16MiB").await;
        let url = t.archive_url();
        let ckpt89 = ram_job_with_s1(&t, 89, &url, 5).await;
        // Job 90 commits s1, but its flush cannot run (the hot tier's directory is not usable).
        ram_job_with_s1(&t, 90, &url, 6).await;
        let hot90 = t.hot.join("jobs/90/ckpt");
        std::fs::rename(&hot90, t.hot.join("jobs/90/aside")).unwrap();
        std::fs::write(&hot90, b"not a directory").unwrap();
        t.commit(90, "s1").await;
        let s = wait_for_state(&t, 90, "s1", CkptState::Retrying).await;
        assert!(s.in_ram && !s.on_hot_tier, "{s:?}");
        let tmp = t.stop().await;
        std::fs::remove_file(&hot90).unwrap();
        std::fs::rename(t_hot(&tmp).join("jobs/90/aside"), &hot90).unwrap();
        // Job 90's tmpfs is gone (the node rebooted); job 89's is still there.
        let tmpfs90 = ram.join("jobs/90");
        nix::mount::umount2(&tmpfs90, nix::mount::MntFlags::MNT_DETACH).unwrap();
        std::fs::remove_dir_all(&tmpfs90).unwrap();
        // The agent comes back without [fast_tier].
        let t = start_with(tmp, "", "").await;
        t.commit(89, "s1").await;
        let s1 = wait_for_state(&t, 89, "s1", CkptState::Archived).await;
        assert!(s1.in_ram && s1.on_hot_tier, "{s1:?}");
        assert_eq!(
            std::fs::read(t.hot.join("jobs/89/ckpt/s1/shards/rank0.bin")).unwrap(),
            std::fs::read(ckpt89.join("s1/shards/rank0.bin")).unwrap()
        );
        let lost = wait_for_state(&t, 90, "s1", CkptState::Refused).await;
        let why = lost.error.clone().unwrap_or_default();
        assert!(
            lost.action_needed && why.contains("LOST") && why.contains("never flushed") && why.contains("jobs/90"),
            "{lost:?}"
        );
        assert!(!lost.in_ram && !lost.on_hot_tier, "{lost:?}");
        assert!(
            lost.problem().is_some_and(|p| p.contains("s1 is NOT archived") && p.contains("LOST")),
            "the job's end summary would not say s1 was lost: {lost:?}"
        );
        let Response::Status(status) = t.call(Request::Status).await.unwrap() else { panic!() };
        let job90 = status.jobs.iter().find(|j| j.job_id == 90).expect("job 90 in sluice status");
        assert!(
            job90.error.as_deref().is_some_and(|e| e.contains("s1") && e.contains("LOST")),
            "sluice status does not say s1 was lost: {:?}",
            job90.error
        );
        // Both jobs end: 89's tmpfs goes after its flush; 90 is done, not pending forever.
        for id in [89, 90] {
            t.call(Request::JobEnd { job_id: id }).await.unwrap();
        }
        wait_gone(&ram.join("jobs/89"), "job 89's RAM tier after its end").await;
        assert!(t.hot.join("jobs/89/ckpt/s1/optim.pt").exists());
        let record90 = t.data.parent().unwrap().join("state/n1/jobs/90.json");
        wait_gone(&record90, "job 90's journal record (nothing of it is left to do)").await;
        t.stop().await;
    }
}

/// The hot tier of the agents started on `tmp`.
fn t_hot(tmp: &TestDir) -> PathBuf {
    tmp.path().join("hot/n1")
}

root_test! {
    /// Issue 13: a RAM copy stays until its flushed copy is verified, but an archive that is down
    /// does not hold RAM: a checkpoint whose upload fails is read back instead, and its RAM copy
    /// goes once a newer one is flushed, so the job's next save finds the room it found before.
    async fn with_the_archive_down_older_checkpoints_still_leave_ram() {
        use sluice_proto::msg::CkptState;
        let (t, _ram) = ram_agent("16MiB").await;
        let archive = t.archive_dir();
        let url = unwritable_archive(&archive);
        let ckpt = ram_job_with_s1(&t, 91, &url, 3).await;
        t.commit(91, "s1").await;
        write_ckpt(&ckpt, "s2", 4, false);
        t.commit(91, "s2").await;
        wait_gone(&ckpt.join("s1"), "s1 in RAM, with its upload failing").await;
        let s1 = wait_for_state(&t, 91, "s1", CkptState::Retrying).await;
        assert!(!s1.in_ram && s1.on_hot_tier, "{s1:?}");
        // 12 MiB did not fit beside s1 and s2 (about 3 MB each) in the 16 MiB share; beside s2 it does.
        std::fs::write(ckpt.join("next"), vec![7u8; 12 << 20]).unwrap();
        std::fs::remove_file(ckpt.join("next")).unwrap();
        std::os::unix::fs::chown(&archive, Some(0), Some(0)).unwrap();
        for tag in ["s1", "s2"] {
            wait_for_state(&t, 91, tag, CkptState::Archived).await;
        }
        t.stop().await;
    }
}

/// Runs `args` as user `uid` (its group the same number, no other groups): what another local
/// user, or the job's own tasks, could do.
fn run_as(uid: u32, args: &[&std::ffi::OsStr]) -> std::process::Output {
    std::process::Command::new(args[0])
        .args(&args[1..])
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap()
}

root_test! {
    /// Issue 24, finding 2: the RAM tier is private by construction, like the hot tier: its `jobs`
    /// directory lets users through to their own job and lists nothing, and the job's tmpfs is
    /// the job user's, 0700. Another user on the node can neither list nor read anything of it,
    /// whatever modes the job's files have (the writer's 0644), while the job's tasks read and
    /// write there and the agent flushes it to NVMe and archives it.
    async fn a_ram_tier_checkpoint_is_private_to_the_job_user() {
        use sluice_proto::msg::CkptState;
        let (t, ram) = ram_agent("16MiB").await;
        let url = t.archive_url();
        let ckpt = ram_job_with_s1(&t, 92, &url, 3).await;
        let file = ckpt.join("s1/optim.pt");
        assert_eq!(std::fs::metadata(&file).unwrap().mode() & 0o777, 0o644);
        t.commit(92, "s1").await;
        wait_for_state(&t, 92, "s1", CkptState::Archived).await;
        assert_eq!(
            std::fs::read(t.hot.join("jobs/92/ckpt/s1/optim.pt")).unwrap(),
            std::fs::read(&file).unwrap(),
            "the flush to NVMe"
        );
        let owner_mode = |p: &Path| {
            let m = std::fs::symlink_metadata(p).unwrap();
            (m.uid(), m.mode() & 0o7777)
        };
        assert_eq!(owner_mode(&ram.join("jobs")), (0, 0o711), "the RAM tier's jobs directory");
        assert_eq!(owner_mode(&ram.join("jobs/92")), (NOBODY, 0o700), "the job's tmpfs");
        let (jobs, tmpfs) = (ram.join("jobs"), ram.join("jobs/92"));
        for (what, args) in [
            ("list the RAM tier's jobs", ["ls", jobs.to_str().unwrap()]),
            ("list the job's tmpfs", ["ls", tmpfs.to_str().unwrap()]),
            ("list $SLUICE_CKPT_DIR", ["ls", ckpt.to_str().unwrap()]),
            ("read a committed checkpoint", ["cat", file.to_str().unwrap()]),
        ] {
            let out = run_as(OTHER, &args.map(std::ffi::OsStr::new));
            assert!(
                !out.status.success(),
                "user {OTHER} could {what}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        // The job's own tasks still read and save there.
        let next = ckpt.join("s2");
        for args in [["cat", file.to_str().unwrap()], ["mkdir", next.to_str().unwrap()]] {
            let out = run_as(NOBODY, &args.map(std::ffi::OsStr::new));
            assert!(out.status.success(), "the job user cannot {args:?}: {out:?}");
        }
        // A tmpfs an older agent left open (root's, 0755) is closed by the agent that recovers
        // the job.
        let tmp = t.stop().await;
        std::os::unix::fs::chown(&tmpfs, Some(0), Some(0)).unwrap();
        for dir in [&jobs, &tmpfs] {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let t = start_with(tmp, "", &fast_tier(ram.parent().unwrap(), "16MiB")).await;
        t.ready(92).await;
        for _ in 0..100 {
            if owner_mode(&tmpfs) == (NOBODY, 0o700) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(owner_mode(&tmpfs), (NOBODY, 0o700), "the recovered job's tmpfs");
        assert_eq!(owner_mode(&jobs), (0, 0o711), "the RAM tier's jobs directory, recovered");
        t.call(Request::JobEnd { job_id: 92 }).await.unwrap();
        wait_gone(&tmpfs, "the job's RAM tier after its end").await;
        t.stop().await;
    }
}

/// A file system mounted by a test, unmounted when the test is done (or fails).
struct Mounted(PathBuf);

impl Mounted {
    fn tmpfs(at: &Path, options: &str) -> Mounted {
        std::fs::create_dir_all(at).unwrap();
        nix::mount::mount(
            Some("sluice-test"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(options),
        )
        .unwrap();
        Mounted(at.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// An agent with a RAM tier of 16 MiB shares and a hot tier of only 8 MiB (its own tmpfs), which
/// `filler` fills (the file is removed to make room): a flush from RAM then fails with ENOSPC and
/// is retried.
async fn ram_agent_with_a_full_hot_tier() -> (TestAgent, PathBuf, Mounted, PathBuf) {
    let tmp = TestDir::new();
    let hot = t_hot(&tmp);
    let hot_fs = Mounted::tmpfs(&hot, "size=8m,mode=0755");
    let filler = hot.join("filler");
    std::fs::write(&filler, vec![0u8; 7 << 20]).unwrap();
    let ram = tmp.path().join("ram");
    let fast = fast_tier(&ram, "16MiB");
    (
        start_with(tmp, "", &fast).await,
        ram.join("n1"),
        hot_fs,
        filler,
    )
}

root_test! {
    /// Issue 24, finding 5: a job requeued onto the same node while a committed checkpoint is only
    /// in RAM (its flush retrying: the hot tier is full) keeps it. The new run takes the job's
    /// tmpfs over instead of preparing it fresh, flushes the checkpoint once the hot tier has room,
    /// and archives it; the run before's torn saves still go.
    async fn a_requeue_keeps_the_ram_checkpoints_the_run_before_did_not_flush() {
        use sluice_proto::msg::CkptState;
        let (t, ram, hot_fs, filler) = ram_agent_with_a_full_hot_tier().await;
        let (archive, url) = (t.archive_dir(), t.archive_url());
        let start = ram_job(93, &url);
        let ckpt = t.ckpt_dir_of(start.clone()).await;
        write_ckpt(&ckpt, "s1", 5, false);
        let saved = std::fs::read(ckpt.join("s1/shards/rank0.bin")).unwrap();
        std::fs::create_dir_all(ckpt.join("torn")).unwrap();
        std::os::unix::fs::chown(ckpt.join("torn"), Some(NOBODY), Some(NOBODY)).unwrap();
        t.commit(93, "s1").await;
        let s1 = wait_for_state(&t, 93, "s1", CkptState::Retrying).await;
        assert!(
            s1.in_ram && !s1.on_hot_tier && s1.error.as_deref().is_some_and(|e| e.contains("hot tier is full")),
            "{s1:?}"
        );
        // The run ends (its epilog) and Slurm requeues the job onto this node: the new run's prolog.
        t.call(Request::JobEnd { job_id: 93 }).await.unwrap();
        t.job(start).await;
        let again = t
            .call(Request::WaitStaged { job_id: 93, timeout_ms: 20_000, step: None })
            .await;
        assert!(
            std::fs::read(ckpt.join("s1/shards/rank0.bin")).ok() == Some(saved.clone()),
            "the requeue destroyed s1, committed and not flushed yet"
        );
        let Ok(Response::Ready(dirs)) = again else {
            panic!("the new run is not ready: {again:?}")
        };
        assert_eq!(PathBuf::from(&dirs.ckpt_dir), ckpt);
        assert!(!ckpt.join("torn").exists(), "a torn save of the run before stays");
        // The hot tier has room again: the new run flushes s1 and archives it.
        std::fs::remove_file(&filler).unwrap();
        let s1 = wait_for_state(&t, 93, "s1", CkptState::Archived).await;
        assert!(s1.on_hot_tier && !s1.action_needed, "{s1:?}");
        assert!(
            std::fs::read(t.hot.join("jobs/93/ckpt/s1/shards/rank0.bin")).unwrap() == saved,
            "the hot tier's s1 is not what the job saved"
        );
        assert!(archive.join("s1/MANIFEST").exists());
        assert!(t.ready(93).await.notes.iter().all(|n| !n.contains("LOST")));
        t.call(Request::JobEnd { job_id: 93 }).await.unwrap();
        wait_gone(&ram.join("jobs/93"), "the job's RAM tier after its end").await;
        let tmp = t.stop().await;
        drop(hot_fs);
        drop(tmp);
    }
}

root_test! {
    /// Issue 24, finding 5: what a requeue cannot keep is said in the new run's output. Here the
    /// job's tmpfs went (an admin removed it) while its committed checkpoint waited for room on
    /// the hot tier: the new run's tasks are told the checkpoint is LOST, and may save it again
    /// under the same tag.
    async fn a_ram_checkpoint_a_requeue_cannot_keep_is_reported_lost_to_the_new_run() {
        use sluice_proto::msg::CkptState;
        let (t, ram, hot_fs, filler) = ram_agent_with_a_full_hot_tier().await;
        let url = t.archive_url();
        let start = ram_job(94, &url);
        let ckpt = t.ckpt_dir_of(start.clone()).await;
        write_ckpt(&ckpt, "s1", 6, false);
        t.commit(94, "s1").await;
        wait_for_state(&t, 94, "s1", CkptState::Retrying).await;
        let tmpfs = ram.join("jobs/94");
        nix::mount::umount2(&tmpfs, nix::mount::MntFlags::MNT_DETACH).unwrap();
        t.call(Request::JobEnd { job_id: 94 }).await.unwrap();
        t.job(start).await;
        let mut notes = Vec::new();
        for _ in 0..100 {
            notes = t.ready(94).await.notes;
            if notes.iter().any(|n| n.contains("s1 is NOT archived") && n.contains("LOST")) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            notes.iter().any(|n| n.contains("s1 is NOT archived") && n.contains("LOST")),
            "the new run's output does not say s1 was lost: {notes:?}"
        );
        // The tag takes a new save, which is flushed and archived once there is room.
        std::fs::remove_file(&filler).unwrap();
        write_ckpt(&ckpt, "s1", 7, false);
        t.commit(94, "s1").await;
        wait_for_state(&t, 94, "s1", CkptState::Archived).await;
        t.call(Request::JobEnd { job_id: 94 }).await.unwrap();
        wait_gone(&tmpfs, "the job's RAM tier after its end").await;
        let tmp = t.stop().await;
        drop(hot_fs);
        drop(tmp);
    }
}

root_test! {
    /// A framework's signal written in the job's last moments — DCP's `.metadata`, the processes
    /// exiting right after, before the agent's next scan — still commits the checkpoint: it is
    /// archived, not deleted with the uncommitted directories at job end. (The scan interval is an
    /// hour here: only the look after the job's end can find it.)
    async fn a_framework_signal_written_just_before_the_job_ends_is_archived() {
        use sluice_proto::msg::CkptState;
        let tmp = TestDir::new();
        let t = start_scanning(tmp, "", "", "1h").await;
        let (archive, url) = (t.archive_dir(), t.archive_url());
        let ckpt = t.ckpt_dir_of(ckpt_job(91, &url, &[])).await;
        write_ckpt(&ckpt, "dcp-1", 4, true);
        assert_eq!(
            t.call(Request::JobEnd { job_id: 91 }).await.unwrap(),
            Response::Ok
        );
        let c = wait_for_state(&t, 91, "dcp-1", CkptState::Archived).await;
        assert!(c.raw_bytes > 0, "{c:?}");
        assert!(archive.join("dcp-1/MANIFEST").exists(), "no MANIFEST for dcp-1");
        assert!(ckpt.join("dcp-1/.metadata").exists(), "the committed checkpoint was deleted");
    }
}

/// A fake `squeue` that reports one job as `uid|gid|STATE|nodes|name` (what the agent asks with
/// `--format %U|%G|%T|%N|%j`; a single field, `%U` or `%T`, alone): a stand-in for Slurm's
/// controller in these in-process tests; the end-to-end tests ask the real one.
fn fake_squeue(dir: &Path, line: &str) -> String {
    let path = dir.join(format!("squeue-{}", line.replace(['|', '/'], "_")));
    let f: Vec<&str> = line.split('|').collect();
    let script = format!(
        "#!/bin/sh\ncase \"$6\" in\n'%U') echo '{}';;\n'%T') echo '{}';;\n*) echo '{line}';;\nesac\n",
        f[0], f[2]
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.display().to_string()
}

/// A step's `WaitStaged` for job `job_id` whose frame claims `(uid, gid, user)` and stages `src`.
fn step_claiming(job_id: u32, (uid, gid, user): (u32, u32, &str), src: &str) -> Request {
    let Request::JobStart(mut start) = job_start(job_id, &format!("ds={src}")) else {
        unreachable!()
    };
    (start.uid, start.gid, start.user) = (uid, gid, user.into());
    start.job_name = "forged".into();
    Request::WaitStaged {
        job_id,
        timeout_ms: 20_000,
        step: Some(Box::new(sluice_proto::msg::StepStart { step_id: 0, start })),
    }
}

root_test! {
    /// Issue 24, finding 1: user B (`nobody`) runs a job without sluice options; a step of it
    /// claims in its frame to be user `daemon` with daemon's group, to stage a directory only
    /// daemon's group may read. The agent stages as B (Slurm's uid and gid, NSS's name), so B gets
    /// a permission error and none of the group's data. Before, the copy helper took the frame's
    /// user and gid for `initgroups`/`setresgid` and staged the secret into B's job.
    async fn a_step_cannot_claim_another_users_identity() {
        let tmp = TestDir::new();
        let squeue = fake_squeue(tmp.path(), &format!("{NOBODY}|{NOBODY}|RUNNING|n1|job"));
        let t = start_with_squeue(tmp, &squeue).await;
        let private = t.data.join("daemon-only");
        std::fs::create_dir_all(&private).unwrap();
        let marker = b"DAEMON-GROUP-SECRET";
        std::fs::write(private.join("secret"), marker).unwrap();
        std::os::unix::fs::chown(&private, Some(0), Some(1)).unwrap();
        std::os::unix::fs::chown(private.join("secret"), Some(0), Some(1)).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o750)).unwrap();
        std::fs::set_permissions(private.join("secret"), std::fs::Permissions::from_mode(0o640))
            .unwrap();
        std::fs::set_permissions(&t.data, std::fs::Permissions::from_mode(0o755)).unwrap();
        let reply = t
            .call_as(NOBODY, step_claiming(81, (NOBODY, 1, "daemon"), &private.display().to_string()))
            .unwrap();
        let staged = t.hot.join("jobs/81");
        let leaked = walk_files(&staged)
            .into_iter()
            .filter(|f| std::fs::read(f).is_ok_and(|b| b == marker))
            .collect::<Vec<_>>();
        assert!(leaked.is_empty(), "daemon's group data staged into nobody's job: {leaked:?}");
        match reply {
            Response::Error(e) => assert!(
                e.message.contains("ermission denied"),
                "the step's error does not say why: {e:?}"
            ),
            other => panic!("the forged step was answered {other:?}"),
        }
        // What the agent recorded is Slurm's and NSS's identity, not the frame's.
        match t.call(Request::Job { job_id: 81 }).await.unwrap() {
            Response::Job(j) => assert_eq!((j.uid, j.user.as_str()), (NOBODY, "nobody")),
            other => panic!("job 81: {other:?}"),
        }
        t.stop().await;
    }
}

root_test! {
    /// Issue 24, finding 8: a step stages only for a job Slurm runs on this node as the asking
    /// user — not for the user's pending (or held) job, nor for one that runs elsewhere, so no
    /// tier space is pinned by jobs that do not run here.
    async fn a_step_of_a_pending_or_elsewhere_job_stages_nothing() {
        for (line, why) in [
            (format!("{NOBODY}|{NOBODY}|PENDING|(null)|job"), "is PENDING"),
            (format!("{NOBODY}|{NOBODY}|RUNNING|n[2-3]|job"), "does not run on node n1"),
            ("4242|4242|RUNNING|n1|job".to_string(), "does not run job 82 as uid"),
        ] {
            let tmp = TestDir::new();
            let squeue = fake_squeue(tmp.path(), &line);
            let t = start_with_squeue(tmp, &squeue).await;
            make_dataset(&t.data);
            let src = t.data.display().to_string();
            match t.call_as(NOBODY, step_claiming(82, (NOBODY, NOBODY, "nobody"), &src)).unwrap() {
                Response::Error(e) => {
                    assert_eq!(e.code, ErrorCode::Forbidden, "{line}: {e:?}");
                    assert!(e.message.contains(why), "{line}: {e:?}");
                }
                other => panic!("{line}: the step was answered {other:?}"),
            }
            assert!(!t.hot.join("jobs/82").exists(), "{line}: a job directory was made");
            t.stop().await;
        }
    }
}

/// Every regular file below `dir`.
fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => out.extend(walk_files(&p)),
            Ok(m) if m.is_file() => out.push(p),
            _ => {}
        }
    }
    out
}

/// A second user with a name (the agent looks the caller's name up; uid 4242 has none here).
const DAEMON: u32 = 1;

root_test! {
    /// `sluice ckpt poison`: only the checkpoint's owner marks it (another user, by the job or by
    /// the archive URL, is refused and nothing is written); the mark is written once; a tag
    /// poisoned as soon as it is committed stays poisoned once archived; `latest` passes over
    /// poisoned checkpoints and the job's output says who marked them and why; a named restore of
    /// one fails the job unless forced with `TAG!`.
    async fn a_poisoned_checkpoint_is_never_latest_and_only_its_owner_poisons_it() {
        use sluice_proto::msg::CkptState;
        let t = root_agent().await;
        let (archive_dir, url) = (t.archive_dir(), t.archive_url());
        let ckpt = t.ckpt_dir_of(ckpt_job(71, &url, &[])).await;
        for (tag, seed) in [("step-1", 3), ("step-2", 5)] {
            write_ckpt(&ckpt, tag, seed, false);
            t.commit(71, tag).await;
            wait_for_state(&t, 71, tag, CkptState::Archived).await;
        }
        let step1 = std::fs::read(ckpt.join("step-1/optim.pt")).unwrap();
        let poison_job = |tag: &str, reason: &str| Request::CkptPoison {
            job_id: 71,
            tag: tag.into(),
            reason: reason.into(),
        };
        let marks = || {
            ["step-1", "step-2", "step-3"]
                .into_iter()
                .filter(|t| archive_dir.join(t).join("POISON").exists())
                .collect::<Vec<_>>()
        };

        // Another user: not through the job (not theirs), not by URL (not their checkpoint).
        let refused = t.call_as(OTHER, poison_job("step-2", "theirs")).unwrap();
        assert!(
            matches!(&refused, Response::Error(e) if e.code == ErrorCode::Forbidden
                && e.message.contains("belongs to another user")),
            "{refused:?}"
        );
        let by_url = Request::ArchivePoison {
            url: url.clone(),
            tag: "step-2".into(),
            reason: "theirs".into(),
        };
        let refused = t.call_as(DAEMON, by_url).unwrap();
        assert!(
            matches!(&refused, Response::Error(e) if e.code == ErrorCode::NotFound
                && e.message.ends_with("no archived checkpoint step-2 of yours")),
            "{refused:?}"
        );
        assert!(marks().is_empty(), "another user's poison wrote {:?}", marks());

        // The owner, from the job: written once, the first reason stands.
        let Response::Poisoned(p) = t.call_as(NOBODY, poison_job("step-2", "loss is NaN")).unwrap()
        else {
            panic!("the owner's poison was refused");
        };
        assert_eq!((p.mark.user.as_str(), p.mark.uid, p.already), ("nobody", NOBODY, false));
        let Response::Poisoned(again) = t.call_as(NOBODY, poison_job("step-2", "other")).unwrap()
        else {
            panic!("a second poison was refused");
        };
        assert!(again.already && again.mark.reason == "loss is NaN", "{again:?}");
        // A tag poisoned right as it is committed, archived or not yet: poisoned for good.
        write_ckpt(&ckpt, "step-3", 7, false);
        t.commit(71, "step-3").await;
        let Response::Poisoned(p3) = t.call_as(NOBODY, poison_job("step-3", "diverged")).unwrap()
        else {
            panic!("poisoning a just-committed tag was refused");
        };
        assert!(!p3.already);
        wait_for_state(&t, 71, "step-3", CkptState::Archived).await;
        assert_eq!(marks(), ["step-2", "step-3"]);
        // Uncommitted, unarchived: nothing to poison.
        let e = t.refused(poison_job("step-9", "x")).await;
        assert!(e.message.contains("no archived checkpoint step-9 of yours"), "{e:?}");
        t.call(Request::JobEnd { job_id: 71 }).await.unwrap();

        // `latest`: step-1, with a note naming each poisoned one and its reason.
        let d = t.started(ckpt_job(72, &url, &[("ckpt-restore", "latest")])).await;
        assert_eq!(d.restored_tag.as_deref(), Some("step-1"));
        assert_note(&d, |n| {
            n.starts_with("checkpoint step-2 in ")
                && n.contains("is poisoned (marked bad by nobody (uid 65534) at ")
                && n.ends_with(": loss is NaN); skipped it for the next newest")
        });
        assert_note(&d, |n| n.contains("checkpoint step-3 in ") && n.contains(": diverged)"));
        assert_eq!(
            std::fs::read(PathBuf::from(&d.ckpt_dir).join("step-1/optim.pt")).unwrap(),
            step1
        );
        // Named: the job fails, saying how to force it; forced, it is restored, and said so.
        let m = t
            .fails_to_set_up(ckpt_job(73, &url, &[("ckpt-restore", "step-2")]))
            .await;
        assert!(
            m.contains("checkpoint step-2 in") && m.contains("is poisoned (marked bad by nobody")
                && m.ends_with("or force this one with --ckpt-restore=step-2!"),
            "{m}"
        );
        let d = t.started(ckpt_job(74, &url, &[("ckpt-restore", "step-2!")])).await;
        assert_eq!(d.restored_tag.as_deref(), Some("step-2"));
        assert_note(&d, |n| n.ends_with("loss is NaN); restored anyway, as forced"));
        t.stop().await;
    }
}
