//! The agent's Prometheus endpoint, in-process: what an admin's Prometheus would scrape after the
//! agent staged a dataset, archived a checkpoint, failed to archive another and failed a job —
//! and, without `[metrics]`, no TCP listener at all.
//!
//! Needs root, like sluiced (staging writes files owned by the job user); run as root with
//! `--ignored`, as tests/harness/run-e2e.sh does.

use sluice_proto::client;
use sluice_proto::msg::{CkptState, Request, Response};
use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[macro_use]
#[path = "support/as_root.rs"]
mod as_root;
#[path = "support/ports.rs"]
mod ports;
#[path = "support/scrape.rs"]
mod scrape;
use as_root::{Running, TestDir, give_to_nobody, make_dataset, nobody_job, spawn_agent};
use ports::free_port;
use scrape::{get, scrape};

/// What [`make_dataset`] writes: 300,000 + 0 + 8 bytes in 3 files.
const DATASET_BYTES: f64 = 300_008.0;
/// What [`write_ckpt`] writes: 3,000,000 + 4,096 bytes.
const CKPT_BYTES: f64 = 3_004_096.0;

struct TestAgent {
    root: PathBuf,
    socket: PathBuf,
    agent: Running,
}

/// Starts an agent in a new directory `root` with `extra` appended to its configuration.
async fn start(root: &Path, extra: &str) -> TestAgent {
    std::fs::create_dir_all(root).unwrap();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = format!(
        "[agent]\nsocket = '{r}/%n.sock'\nstate_dir = '{r}/state/%n'\nsqueue = ''\n\
         [hot_tier]\nroot = '{r}/hot/%n'\n[stage]\ntimeout = '30s'\n\
         [ckpt]\nscan_interval = '200ms'\npart_size = '5MiB'\n\
         [[ckpt.allow]]\nprefix = 'file://{r}/'\n{extra}",
        r = root.display()
    );
    let agent = spawn_agent(&cfg);
    TestAgent {
        root: root.to_path_buf(),
        socket: agent.cfg.socket.clone(),
        agent,
    }
}

impl TestAgent {
    async fn call(&self, req: Request) -> Response {
        let socket = self.socket.clone();
        tokio::task::spawn_blocking(move || client::call(&socket, req, Duration::from_secs(30)))
            .await
            .unwrap()
            .unwrap_or_else(|e| match e {
                client::ClientError::Agent(e) => Response::Error(e),
                e => panic!("calling the agent: {e}"),
            })
    }

    async fn job(&self, job_id: u32, options: &[(&str, String)]) {
        let options = options
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let start = nobody_job(job_id, "metrics", options);
        assert_eq!(self.call(start).await, Response::Ok);
    }

    /// Waits for the job's set-up; returns what its tasks get.
    async fn wait(&self, job_id: u32) -> Response {
        self.call(Request::WaitStaged {
            job_id,
            timeout_ms: 20_000,
            step: None,
        })
        .await
    }

    async fn wait_for_ckpt(&self, job_id: u32, tag: &str, want: CkptState) {
        for _ in 0..200 {
            if let Response::Ckpts { ckpts } = self.call(Request::CkptList { job_id }).await
                && ckpts.iter().any(|c| c.tag == tag && c.state == want)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "checkpoint {tag} of job {job_id} never reached {want:?}: {:?}",
            self.call(Request::CkptList { job_id }).await
        );
    }

    /// Job `job_id` archiving to `archive`: its task writes checkpoint `step-1` and commits it;
    /// returns once the checkpoint is in state `want`.
    async fn commit_one(&self, job_id: u32, archive: String, want: CkptState) {
        self.job(job_id, &[("ckpt-archive", archive)]).await;
        let Response::Ready(dirs) = self.wait(job_id).await else {
            panic!("job {job_id} not ready")
        };
        write_ckpt(Path::new(&dirs.ckpt_dir), "step-1");
        let commit = Request::CkptCommit {
            job_id,
            tag: "step-1".into(),
        };
        assert_eq!(self.call(commit).await, Response::Ok);
        self.wait_for_ckpt(job_id, "step-1", want).await;
    }

    async fn stop(self) {
        self.agent.stop().await;
    }
}

/// A checkpoint directory as the job user writes it.
fn write_ckpt(dir: &Path, tag: &str) {
    let d = dir.join(tag);
    std::fs::create_dir_all(d.join("shards")).unwrap();
    let weights: Vec<u8> = (0..3_000_000u32).map(|i| (i >> 7) as u8).collect();
    std::fs::write(d.join("shards/rank0.bin"), weights).unwrap();
    std::fs::write(d.join("optim.pt"), vec![7u8; 4096]).unwrap();
    give_to_nobody(&d);
}

/// Inodes of the TCP sockets this process listens on (`/proc/net/tcp{,6}` state 0A, matched
/// against this process's descriptors).
fn tcp_listeners() -> HashSet<String> {
    let ours: HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| {
            t.lines()
                .skip(1)
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.get(3) == Some(&"0A")).then(|| f.get(9).map(|s| s.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .filter(|inode| ours.contains(inode))
        .collect()
}

fn value(series: &(BTreeMap<String, f64>, String), key: &str) -> f64 {
    *series
        .0
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in the scrape:\n{}", series.1))
}

root_test! {
    async fn prometheus_sees_what_the_agent_did_and_nothing_listens_without_metrics() {
        let tmp = TestDir::new();

        // Off by default: an agent without [metrics] listens on no TCP port.
        let off = start(&tmp.path().join("off"), "").await;
        make_dataset(&off.root.join("data"));
        off.job(11, &[("stage-in", format!("ds={}", off.root.join("data").display()))]).await;
        assert!(matches!(off.wait(11).await, Response::Ready(_)));
        assert_eq!(tcp_listeners(), HashSet::new(), "an agent without [metrics] listens on TCP");
        off.stop().await;

        let port = free_port();
        let t = start(
            &tmp.path().join("on"),
            &format!("[metrics]\nlisten = '127.0.0.1:{port}'\n"),
        )
        .await;
        // The listener is there once the agent answers its socket.
        assert!(matches!(t.call(Request::Status).await, Response::Status(_)));
        assert_eq!(tcp_listeners().len(), 1, "one listener: the metrics port");
        let s = scrape(port).await;
        assert_eq!(value(&s, "sluice_stage_bytes_total{source=\"posix\"}"), 0.0);
        assert_eq!(
            value(&s, &format!("sluice_build_info{{version=\"{}\",protocol=\"1\"}}", env!("CARGO_PKG_VERSION"))),
            1.0
        );
        assert!(value(&s, "sluice_hot_tier_capacity_bytes") > 0.0);
        assert!(value(&s, "sluice_hot_tier_used_bytes") > 0.0);
        assert_eq!(value(&s, "sluice_hot_tier_high_water_ratio"), 0.9);
        // No jobs yet: housekeeping is the one worker, and it is fine.
        assert_eq!(value(&s, "sluice_workers"), 1.0);
        assert_eq!(value(&s, "sluice_workers_failing"), 0.0);

        // A staged POSIX dataset: its bytes and files, read from its origin, in one duration.
        let data = t.root.join("data");
        make_dataset(&data);
        t.job(21, &[("stage-in", format!("ds={}", data.display()))]).await;
        assert!(matches!(t.wait(21).await, Response::Ready(_)));
        let s = scrape(port).await;
        assert_eq!(value(&s, "sluice_stage_bytes_total{source=\"posix\"}"), DATASET_BYTES);
        assert_eq!(value(&s, "sluice_stage_files_total{source=\"posix\"}"), 3.0);
        assert_eq!(value(&s, "sluice_origin_bytes_total{source=\"posix\"}"), DATASET_BYTES);
        assert_eq!(value(&s, "sluice_peer_bytes_total{source=\"posix\"}"), 0.0);
        assert_eq!(value(&s, "sluice_stage_bytes_total{source=\"s3\"}"), 0.0);
        assert_eq!(value(&s, "sluice_stage_duration_seconds_count{source=\"posix\"}"), 1.0);
        assert_eq!(value(&s, "sluice_jobs{state=\"ready\"}"), 1.0);

        // A dataset that is not there: the job fails, counted by its code.
        t.job(22, &[("stage-in", format!("ds={}/missing", t.root.display()))]).await;
        assert!(matches!(t.wait(22).await, Response::Error(_)));
        let s = scrape(port).await;
        assert_eq!(value(&s, "sluice_failures_total{operation=\"stage\",code=\"not_found\"}"), 1.0);
        assert_eq!(value(&s, "sluice_jobs{state=\"failed\"}"), 1.0);

        // A checkpoint archived: its bytes and one upload duration; nothing waits.
        let archive = format!("file://{}/archive", t.root.display());
        t.commit_one(23, archive, CkptState::Archived).await;
        let s = scrape(port).await;
        assert_eq!(value(&s, "sluice_archive_bytes_total"), CKPT_BYTES);
        let stored = value(&s, "sluice_archive_stored_bytes_total");
        assert!(stored > 0.0 && stored < CKPT_BYTES, "compressed: {stored}");
        assert_eq!(value(&s, "sluice_archive_duration_seconds_count"), 1.0);
        assert_eq!(value(&s, "sluice_archive_backlog_checkpoints"), 0.0);
        assert_eq!(value(&s, "sluice_archive_backlog_bytes"), 0.0);
        assert_eq!(value(&s, "sluice_workers_failing"), 0.0);

        // A checkpoint whose archive cannot be written (where its files go, the archive holds a
        // regular file): it waits, with its size, and each failed upload attempt is counted.
        let blocked = t.root.join("blocked");
        std::fs::create_dir_all(&blocked).unwrap();
        std::fs::write(blocked.join("step-1"), b"not a directory").unwrap();
        let blocked = format!("file://{}", blocked.display());
        t.commit_one(24, blocked, CkptState::Retrying).await;
        let s = scrape(port).await;
        assert_eq!(value(&s, "sluice_archive_backlog_checkpoints"), 1.0);
        assert_eq!(value(&s, "sluice_archive_backlog_bytes"), CKPT_BYTES);
        // A local file system's error is no classified store error: `store_other`. Attempts
        // repeat at the archive backoff (2 s, 4 s, ...), so there may be more than one by now.
        let failed = value(
            &s,
            "sluice_failures_total{operation=\"archive\",code=\"store_other\"}",
        );
        assert!(failed >= 1.0, "no failed archive attempt counted:\n{}", s.1);
        assert_eq!(value(&s, "sluice_archive_bytes_total"), CKPT_BYTES, "nothing more archived");
        // Its checkpoint worker is failing, and `sluice status` says which one and why. (The
        // worker records its turn just after the checkpoint's state changed: wait for it.)
        let mut s = s;
        for _ in 0..100 {
            if value(&s, "sluice_workers_failing") == 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            s = scrape(port).await;
        }
        assert_eq!(value(&s, "sluice_workers_failing"), 1.0, "{}", s.1);
        let Response::Status(status) = t.call(Request::Status).await else { panic!("no status") };
        let failing: Vec<_> = status.workers.iter().filter(|w| w.last_error.is_some()).collect();
        assert!(
            matches!(failing[..], [w] if w.name == "ckpt job 24" && w.job_id == Some(24)
                && w.last_error.as_deref().is_some_and(|e| e.contains("step-1"))),
            "{:?}",
            status.workers
        );

        // Anything but GET /metrics is refused.
        let (status, _, _) = tokio::task::spawn_blocking(move || get(port, "/")).await.unwrap();
        assert_eq!(status, "HTTP/1.1 404 Not Found");

        // The endpoint stops with the agent.
        t.stop().await;
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "the metrics port still answers after the agent stopped"
        );
    }
}
