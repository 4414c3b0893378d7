//! Replicas (`[fast_tier] replicas`, issue 26), two agents in this process as nodes n1 and n2 of
//! one job: real RAM tiers (tmpfs), real peer ports on 127.0.0.1, the real archive engine on a
//! `file://` archive. What the user and the admin would see: `sluice ckpt list` on n1 naming n2
//! as holding n1's part; n2 holding exactly the bytes n1's job saved, root-only; the replica
//! freed once archived; a holder without room leaving the checkpoint short of replicas, said; a
//! requeue after n2 was lost and replaced restoring both parts from n1 with the archive down, and
//! refusing to when a part is held nowhere or a copy changed.

use sluice_proto::client;
use sluice_proto::msg::{CkptState, CkptStatus, Request, Response};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

// Shared with agent.rs and metrics.rs, which use the rest of it.
#[allow(dead_code)]
#[macro_use]
#[path = "support/as_root.rs"]
mod as_root;
#[path = "support/ports.rs"]
mod ports;
#[path = "support/scrape.rs"]
mod scrape;
use as_root::{Running, TestDir, give_to_nobody, spawn_agent_on};
use ports::free_port;

/// The job's two nodes.
const NODES: [&str; 2] = ["n1", "n2"];

struct Nodes {
    tmp: TestDir,
    agents: Vec<Running>,
    /// Each node's configuration, to start its agent again.
    cfgs: Vec<String>,
    /// Each node's metrics port.
    metrics: [u16; 2],
}

/// n1 and n2, each with a RAM tier and `replicas = 1`; each gives replicas `room`.
fn two_nodes(room: &str) -> Nodes {
    two_nodes_with([room, room])
}

/// n1 and n2, each with a RAM tier and `replicas = 1`, giving replicas `rooms[0]` and `rooms[1]`.
fn two_nodes_with(rooms: [&str; 2]) -> Nodes {
    let tmp = TestDir::new();
    let r = tmp.path();
    std::fs::set_permissions(r, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = r.join("peer.key");
    std::fs::write(&secret, [7u8; 32]).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (p1, p2) = (free_port(), free_port());
    let metrics = [free_port(), free_port()];
    let cfgs: Vec<String> = rooms
        .iter()
        .zip(metrics)
        .map(|(room, m)| {
            format!(
                "[metrics]\nlisten = '127.0.0.1:{m}'\n[agent]\nsocket = '{r}/%n.sock'\nstate_dir = '{r}/state/%n'\nsqueue = ''\nhousekeeping_interval = '1s'\n\
                 [hot_tier]\nroot = '{r}/hot/%n'\n\
                 [ckpt]\nscan_interval = '200ms'\nepilog_wait = '1s'\npart_size = '5MiB'\n\
                 [[ckpt.allow]]\nprefix = 'file://{r}/'\n\
                 [peer]\nsecret_file = '{secret}'\naddr = '127.0.0.1:1'\n[peer.nodes]\nn1 = '127.0.0.1:{p1}'\nn2 = '127.0.0.1:{p2}'\n\
                 [fast_tier]\nroot = '{r}/ram/%n'\ncapacity = '64MiB'\njob_share = '16MiB'\nflush_block = '1MiB'\nreplicas = 1\nreplica_room = '{room}'\n",
                r = r.display(),
                secret = secret.display(),
            )
        })
        .collect();
    let agents = NODES
        .iter()
        .zip(&cfgs)
        .map(|(node, cfg)| spawn_agent_on(cfg, node))
        .collect();
    Nodes {
        tmp,
        agents,
        cfgs,
        metrics,
    }
}

impl Nodes {
    /// The series `key` of `node`'s metrics.
    async fn metric(&self, node: usize, key: &str) -> f64 {
        let (series, body) = scrape::scrape(self.metrics[node]).await;
        *series
            .get(key)
            .unwrap_or_else(|| panic!("{}: no {key} in\n{body}", NODES[node]))
    }

    /// The bytes of its own checkpoint parts `node` has copied to other nodes as replicas.
    async fn replica_bytes_sent(&self, node: usize) -> f64 {
        self.metric(node, "sluice_replica_bytes_total").await
    }

    async fn call(&self, node: usize, req: Request) -> Response {
        self.try_call(node, req)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", NODES[node]))
    }

    /// The agent's answer, or the error the client reports (a job that failed, for one).
    async fn try_call(&self, node: usize, req: Request) -> Result<Response, String> {
        let socket = self.agents[node].cfg.socket.clone();
        tokio::task::spawn_blocking(move || client::call(&socket, req, Duration::from_secs(30)))
            .await
            .unwrap()
            .map_err(|e| e.to_string())
    }

    /// A healthy `file://` archive in the test's directory.
    fn archive_up(&self) -> String {
        format!("file://{}/archive", self.tmp.path().display())
    }

    /// An archive that cannot be written (below a regular file): an archive in an outage, so
    /// that nothing of the job is archived while the test looks at its replicas.
    fn archive_down(&self) -> String {
        let blocked = self.tmp.path().join("down");
        std::fs::write(&blocked, b"not a directory").unwrap();
        format!("file://{}/archive", blocked.display())
    }

    /// Starts a RAM-tier job of user nobody on both nodes (each node's prolog), archiving to
    /// `archive`; returns each node's `$SLUICE_CKPT_DIR`.
    async fn start_job(&self, job_id: u32, archive: &str) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        for (node, ready) in self.start_run(job_id, archive, None).await {
            match ready {
                Ok(Response::Ready(d)) => dirs.push(PathBuf::from(d.ckpt_dir)),
                other => panic!("{node} not ready: {other:?}"),
            }
        }
        dirs
    }

    /// Starts a run of the job on both nodes (`restore`: its `--ckpt-restore`) and returns what
    /// each node answers when asked whether it is ready.
    async fn start_run(
        &self,
        job_id: u32,
        archive: &str,
        restore: Option<&str>,
    ) -> Vec<(&'static str, Result<Response, String>)> {
        let restore: Vec<(&str, &str)> = restore.map(|r| ("ckpt-restore", r)).into_iter().collect();
        self.start_run_with(job_id, archive, &restore).await
    }

    /// [`Nodes::start_run`] with the job options `extra` besides the archive (and the RAM tier,
    /// unless `extra` names a `ckpt-tier`).
    async fn start_run_with(
        &self,
        job_id: u32,
        archive: &str,
        extra: &[(&str, &str)],
    ) -> Vec<(&'static str, Result<Response, String>)> {
        for (i, node) in NODES.iter().enumerate() {
            let mut options = vec![("ckpt-archive".to_string(), archive.to_string())];
            if !extra.iter().any(|(k, _)| *k == "ckpt-tier") {
                options.push(("ckpt-tier".to_string(), "ram".to_string()));
            }
            options.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            let mut start = sluice_proto::testing::nobody_job(job_id, node, "train", options);
            start.nodes = NODES.iter().map(|n| n.to_string()).collect();
            assert_eq!(self.call(i, Request::JobStart(start)).await, Response::Ok);
        }
        let mut answers = Vec::new();
        for (i, node) in NODES.iter().enumerate() {
            let ready = Request::WaitStaged {
                job_id,
                timeout_ms: 25_000,
                step: None,
            };
            answers.push((*node, self.try_call(i, ready).await));
        }
        answers
    }

    /// n2 is lost and replaced: its agent stops, and its RAM tier (the job's share and the
    /// replica area), hot tier and state go, as on a new machine; then its agent starts again.
    async fn replace_n2(&mut self) {
        self.agents.remove(1).stop().await;
        let r = self.tmp.path();
        let ram = r.join("ram/n2");
        let mut mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mounts")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(1).map(PathBuf::from))
            .filter(|p| p.starts_with(&ram))
            .collect();
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
        for gone in ["ram/n2", "hot/n2", "state/n2"] {
            std::fs::remove_dir_all(r.join(gone)).unwrap();
        }
        self.agents.insert(1, spawn_agent_on(&self.cfgs[1], "n2"));
    }

    /// The job ends on n1 (n2's agent lost it with the node): the requeue's first half.
    async fn end_on_n1(&self, job_id: u32) {
        assert_eq!(self.call(0, Request::JobEnd { job_id }).await, Response::Ok);
    }

    async fn ckpts(&self, node: usize, job_id: u32) -> Vec<CkptStatus> {
        match self.call(node, Request::CkptList { job_id }).await {
            Response::Ckpts { ckpts } => ckpts,
            other => panic!("ckpt list: {other:?}"),
        }
    }

    /// Waits up to 20 s for `tag` on `node` to satisfy `done`.
    async fn wait_ckpt(
        &self,
        node: usize,
        job_id: u32,
        tag: &str,
        what: &str,
        done: impl Fn(&CkptStatus) -> bool,
    ) -> CkptStatus {
        for _ in 0..200 {
            if let Some(c) = self
                .ckpts(node, job_id)
                .await
                .into_iter()
                .find(|c| c.tag == tag)
                && done(&c)
            {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "{tag} on {} never {what}: {:?}",
            NODES[node],
            self.ckpts(node, job_id).await
        );
    }

    /// Waits until `tag` on `node` says `holder` had no room for its part.
    async fn wait_no_room(&self, node: usize, job_id: u32, tag: &str, holder: &str) -> CkptStatus {
        let said = format!("{holder} has no room for replicas");
        self.wait_ckpt(node, job_id, tag, &format!("said {said}"), |c| {
            c.replicas
                .as_ref()
                .and_then(|r| r.short.as_deref())
                .is_some_and(|s| s.contains(&said))
        })
        .await
    }

    /// Where n2 keeps n1's part of `tag` of `job_id`.
    fn replica_on_n2(&self, job_id: u32, tag: &str) -> PathBuf {
        self.tmp
            .path()
            .join(format!("ram/n2/replicas/{job_id}/n1/{tag}"))
    }

    async fn stop(self) {
        for a in self.agents {
            a.stop().await;
        }
    }
}

/// A checkpoint as the job user saves it: a 3 MB shard and a small file.
fn save(dir: &Path, tag: &str, seed: u8) -> Vec<u8> {
    let d = dir.join(tag);
    std::fs::create_dir_all(d.join("shards")).unwrap();
    let shard: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i as u8).wrapping_mul(seed) ^ (i >> 11) as u8)
        .collect();
    std::fs::write(d.join("shards/rank0.bin"), &shard).unwrap();
    std::fs::write(d.join("optim.pt"), vec![seed; 4096]).unwrap();
    give_to_nobody(&d);
    shard
}

/// Node `rank`'s part of a checkpoint, in files of its own: `shards/rankR.bin` (3 MB) and
/// `optimR.pt`. Returns both files' paths below the tag and their bytes.
fn save_part(dir: &Path, tag: &str, rank: u8) -> Vec<(String, Vec<u8>)> {
    let d = dir.join(tag);
    std::fs::create_dir_all(d.join("shards")).unwrap();
    let files = vec![
        (
            format!("shards/rank{rank}.bin"),
            (0..3_000_000u32)
                .map(|i| (i as u8).wrapping_mul(rank + 17) ^ (i >> 9) as u8)
                .collect::<Vec<u8>>(),
        ),
        (format!("optim{rank}.pt"), vec![rank; 5000]),
    ];
    for (path, bytes) in &files {
        std::fs::write(d.join(path), bytes).unwrap();
    }
    give_to_nobody(&d);
    files
}

async fn commit(nodes: &Nodes, node: usize, job_id: u32, tag: &str) {
    let req = Request::CkptCommit {
        job_id,
        tag: tag.into(),
    };
    assert_eq!(nodes.call(node, req).await, Response::Ok);
}

/// n1 and n2 (16 MiB of room each) run job `job_id` with the archive down; both save their part
/// of s1 (`save_part`), n1 commits it, and both say it is protected. Returns the nodes, the
/// archive's URL, each node's `$SLUICE_CKPT_DIR` and every file saved (n1's first).
async fn protected_s1(job_id: u32) -> (Nodes, String, Vec<PathBuf>, Vec<(String, Vec<u8>)>) {
    let nodes = two_nodes("16MiB");
    let archive = nodes.archive_down();
    let dirs = nodes.start_job(job_id, &archive).await;
    let files = save_protected(&nodes, job_id, &dirs, "s1", 0).await;
    (nodes, archive, dirs, files)
}

/// Both nodes save their part of `tag` into their `dirs` (`save_part`, as ranks `rank` and
/// `rank + 1`), n1 commits it, and both say it is protected. Returns every file saved (n1's first).
async fn save_protected(
    nodes: &Nodes,
    job_id: u32,
    dirs: &[PathBuf],
    tag: &str,
    rank: u8,
) -> Vec<(String, Vec<u8>)> {
    let mut files = save_part(&dirs[0], tag, rank);
    files.extend(save_part(&dirs[1], tag, rank + 1));
    commit(nodes, 0, job_id, tag).await;
    for node in [0, 1] {
        nodes
            .wait_ckpt(node, job_id, tag, "protected", |c| {
                c.replicas
                    .as_ref()
                    .is_some_and(|r| r.protected && r.held_by == [NODES[1 - node]])
            })
            .await;
    }
    files
}

root_test! {
    /// n1's part of a committed RAM-tier checkpoint is copied to n2 (the job's only other node):
    /// `sluice ckpt list` on n1 says where; n2 holds the same bytes, root-only, where no job and
    /// no other user can reach them. With the archive down, the replica stays.
    async fn a_committed_ram_checkpoint_is_replicated_to_the_jobs_other_node_root_only() {
        let nodes = two_nodes("16MiB");
        let dirs = nodes.start_job(301, &nodes.archive_down()).await;
        let shard = save(&dirs[0], "s1", 3);
        commit(&nodes, 0, 301, "s1").await;
        let s1 = nodes
            .wait_ckpt(0, 301, "s1", "replicated to n2", |c| {
                c.replicas.as_ref().is_some_and(|r| r.held_by == ["n2"])
            })
            .await;
        let r = s1.replicas.clone().unwrap();
        assert_eq!((r.wanted, r.short, r.freed), (1, None, false), "{s1:?}");
        let part = nodes.replica_on_n2(301, "s1");
        assert_eq!(std::fs::read(part.join("files/shards/rank0.bin")).unwrap(), shard);
        assert_eq!(std::fs::read(part.join("files/optim.pt")).unwrap(), vec![3u8; 4096]);
        // Root's, and closed to everyone else from the area's top down.
        let area = nodes.tmp.path().join("ram/n2/replicas");
        for (p, mode) in [(area.clone(), 0o700), (part.join("files/shards/rank0.bin"), 0o600)] {
            let m = std::fs::metadata(&p).unwrap();
            assert_eq!((m.uid(), m.mode() & 0o777), (0, mode), "{}", p.display());
        }
        // The job on n2 sees nothing of it in its own checkpoint directory.
        assert!(!dirs[1].join("s1").exists(), "n1's part leaked into n2's job directory");
        // n2 holds none of s1: told of the commit over the peer port, it seals an empty part on
        // n1, which makes s1 protected (no node's part is only on its own node).
        assert!(nodes.ckpts(1, 301).await.iter().all(|c| c.tag != "s1"));
        nodes
            .wait_ckpt(0, 301, "s1", "protected", |c| {
                c.replicas.as_ref().is_some_and(|r| r.protected)
            })
            .await;
        let empty = nodes.tmp.path().join("ram/n1/replicas/301/n2/s1");
        assert!(empty.join("SEALED").exists(), "no empty part of n2 on n1");
        nodes.stop().await;
    }
}

root_test! {
    /// Once the archive holds the checkpoint, its replica is freed on n2: the archive is the copy
    /// that survives, and n2's RAM goes back to the room for replicas.
    async fn an_archived_checkpoints_replica_is_freed() {
        let nodes = two_nodes("16MiB");
        let url = nodes.archive_up();
        let dirs = nodes.start_job(302, &url).await;
        save(&dirs[0], "s1", 5);
        commit(&nodes, 0, 302, "s1").await;
        let s1 = nodes
            .wait_ckpt(0, 302, "s1", "archived", |c| c.state == CkptState::Archived)
            .await;
        assert!(s1.replicas.is_some(), "{s1:?}");
        let s1 = nodes
            .wait_ckpt(0, 302, "s1", "freed its replicas", |c| {
                c.replicas.as_ref().is_some_and(|r| r.freed)
            })
            .await;
        let part = nodes.replica_on_n2(302, "s1");
        for _ in 0..100 {
            if !part.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!part.exists(), "n2 still holds the archived s1: {s1:?}");
        nodes.stop().await;
    }
}

root_test! {
    /// A holder without room for the part takes none of it: the checkpoint stays unreplicated,
    /// and `sluice ckpt list` says why.
    async fn a_holder_without_room_leaves_the_checkpoint_short_and_says_so() {
        let nodes = two_nodes("1MiB");
        let dirs = nodes.start_job(303, &nodes.archive_down()).await;
        save(&dirs[0], "s1", 7);
        commit(&nodes, 0, 303, "s1").await;
        let s1 = nodes.wait_no_room(0, 303, "s1", "n2").await;
        assert!(s1.replicas.unwrap().held_by.is_empty());
        assert!(
            !nodes.replica_on_n2(303, "s1").join("files/shards/rank0.bin").exists(),
            "n2 kept part of a replica it had no room for"
        );
        nodes.stop().await;
    }
}

root_test! {
    /// Rank 0 commits on n1 only, with the archive down: n2 learns of it over the peer port (the
    /// archive cannot tell it), commits its own part, and each node's part ends up on the other;
    /// both say s1 is protected.
    async fn a_commit_on_one_node_reaches_the_other_over_the_peer_port_and_both_parts_are_replicated() {
        let nodes = two_nodes("16MiB");
        let dirs = nodes.start_job(304, &nodes.archive_down()).await;
        save(&dirs[0], "s1", 11);
        let shard2 = save(&dirs[1], "s1", 13);
        commit(&nodes, 0, 304, "s1").await;
        for (node, holder) in [(0, "n2"), (1, "n1")] {
            let s1 = nodes
                .wait_ckpt(node, 304, "s1", "protected", |c| {
                    c.replicas.as_ref().is_some_and(|r| r.protected)
                })
                .await;
            assert_eq!(s1.replicas.unwrap().held_by, [holder]);
        }
        let on_n1 = nodes.tmp.path().join("ram/n1/replicas/304/n2/s1/files/shards/rank0.bin");
        assert_eq!(std::fs::read(on_n1).unwrap(), shard2);
        nodes.stop().await;
    }
}

root_test! {
    /// Issue 26's restore: both nodes save their part of s1 with the archive down, and s1 is
    /// protected; n2 is lost and replaced by an empty node; the job is requeued with
    /// `--ckpt-restore=latest`. Both nodes start from s1, each holding both parts byte for byte:
    /// n1 from its own copy and the replica of n2's part it holds, n2 from n1, and not a byte from
    /// the archive (which is down). The restored s1 is committed on the new n2, so that it still
    /// reaches the archive once the archive is back.
    async fn a_requeue_after_losing_a_node_restores_latest_from_the_replicas() {
        let (mut nodes, archive, _, files) = protected_s1(305).await;
        nodes.replace_n2().await;
        nodes.end_on_n1(305).await;
        let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
        let part: u64 = files[..2].iter().map(|(_, b)| b.len() as u64).sum();
        for (node, ready) in nodes.start_run(305, &archive, Some("latest")).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            assert_eq!(d.restored_tag.as_deref(), Some("s1"), "{node}: {d:?}");
            for (path, bytes) in &files {
                let got = std::fs::read(Path::new(&d.ckpt_dir).join("s1").join(path));
                assert!(got.as_ref().is_ok_and(|g| g == bytes), "{node}: s1/{path} is not the saved one");
                let m = std::fs::metadata(Path::new(&d.ckpt_dir).join("s1").join(path)).unwrap();
                assert_eq!(m.uid(), as_root::NOBODY, "{node}: s1/{path} is not the job user's");
            }
            // n1 had its own part and holds n2's; the new n2 had nothing.
            let (here, others) = if node == "n1" { (total, 0) } else { (0, total) };
            let want = format!(
                "checkpoint s1 restored from replicas: {} from this node, {} from the job's other nodes, 0 B from the archive",
                sluice_proto::summary::bytes(here),
                sluice_proto::summary::bytes(others)
            );
            assert!(d.notes.contains(&want), "{node}: {:?}, wanted {want}", d.notes);
        }
        assert!(part < total);
        // The new n2 holds s1 as a commit of its own: flushed and replicated like any. n1's part,
        // whose replica went with the old n2, is placed again on the new one (n1 learns its holders
        // from the indexes: they are not journaled): s1 is protected again on both.
        nodes
            .wait_ckpt(1, 305, "s1", "committed and replicated on the new n2", |c| {
                c.replicas.as_ref().is_some_and(|r| r.held_by == ["n1"])
            })
            .await;
        for node in [0, 1] {
            nodes
                .wait_ckpt(node, 305, "s1", "protected again", |c| {
                    c.replicas
                        .as_ref()
                        .is_some_and(|r| r.protected && r.held_by == [NODES[1 - node]])
                })
                .await;
        }
        // The new n2's part is its own part as it was (not the whole copy it restored), and n1
        // held that as it is: sealed again there without a byte sent (a push would have taken it
        // away from n1 for as long as it took, while n1 may have been restoring from it).
        assert_eq!(nodes.replica_bytes_sent(1).await, 0.0, "the new n2 sent its part again");
        // n1 sent its part twice: to the old n2, and to the new one.
        assert_eq!(nodes.replica_bytes_sent(0).await, 2.0 * part as f64);
        // What the admin's Prometheus sees of the restores and the protection.
        for (node, here, others) in [(0, total, 0), (1, 0, total)] {
            for (from, bytes) in [("this_node", here), ("other_nodes", others)] {
                let key = format!("sluice_replica_restore_bytes_total{{from=\"{from}\"}}");
                assert_eq!(nodes.metric(node, &key).await, bytes as f64, "{}: {key}", NODES[node]);
            }
            assert!(nodes.metric(node, "sluice_ckpt_protected_total").await >= 1.0);
        }
        nodes.stop().await;
    }
}

root_test! {
    /// A checkpoint of which some node's part is held nowhere is not restored from replicas: here
    /// neither node had room for the other's part, and n2 is lost. The restore falls back to the
    /// archive, which is down: the job fails on both nodes, its error saying why the archive and
    /// why the replicas did not give s1; n1's own unarchived copy of its part (on the hot tier
    /// since the job's end gave its RAM tier back) is left as it was.
    async fn a_checkpoint_missing_a_nodes_part_is_not_restored_from_replicas() {
        let mut nodes = two_nodes("1MiB");
        let archive = nodes.archive_down();
        let dirs = nodes.start_job(306, &archive).await;
        let files = save_part(&dirs[0], "s1", 0);
        save_part(&dirs[1], "s1", 1);
        commit(&nodes, 0, 306, "s1").await;
        for (node, holder) in [(0, "n2"), (1, "n1")] {
            nodes.wait_no_room(node, 306, "s1", holder).await;
        }
        nodes.replace_n2().await;
        nodes.end_on_n1(306).await;
        // n1 first: its own copy of its part must be there before and after.
        let n1_dir = nodes.tmp.path().join("hot/n1/jobs/306/ckpt/s1");
        for (node, ready) in nodes.start_run(306, &archive, Some("latest")).await {
            let Err(e) = ready else {
                panic!("{node} started: {ready:?}");
            };
            assert!(e.contains(&archive), "{node}: {e}");
            assert!(
                e.contains("the job's replicas did not give it either")
                    && e.contains("s1: no node holds the part of n2"),
                "{node}: {e}"
            );
        }
        for (path, bytes) in &files {
            let got = std::fs::read(n1_dir.join(path)).unwrap();
            assert_eq!(&got, bytes, "n1's own copy of s1/{path} changed");
        }
        nodes.stop().await;
    }
}

root_test! {
    /// A node's index lists its own parts too (for a restore), which are no replicas of them:
    /// n1's part is on n2, but n2's part is on n2 only (n1 has no room for it), so s1 is not
    /// protected on either node, whatever n2's own index lists.
    async fn a_nodes_own_part_does_not_count_as_its_replica() {
        let nodes = two_nodes_with(["1MiB", "16MiB"]);
        let dirs = nodes.start_job(307, &nodes.archive_down()).await;
        save_part(&dirs[0], "s1", 0);
        save_part(&dirs[1], "s1", 1);
        commit(&nodes, 0, 307, "s1").await;
        nodes
            .wait_ckpt(0, 307, "s1", "replicated to n2", |c| {
                c.replicas.as_ref().is_some_and(|r| r.held_by == ["n2"])
            })
            .await;
        nodes.wait_no_room(1, 307, "s1", "n1").await;
        // Several turns of n1's worker (each asks both indexes while s1 is not protected).
        tokio::time::sleep(Duration::from_secs(3)).await;
        for node in [0, 1] {
            let s1 = nodes.ckpts(node, 307).await.into_iter().find(|c| c.tag == "s1").unwrap();
            assert!(!s1.replicas.as_ref().unwrap().protected, "{}: {s1:?}", NODES[node]);
        }
        nodes.stop().await;
    }
}

root_test! {
    /// A node's own copy is served only as it was sealed: n2 (which held the replica of n1's
    /// part) is lost, the job ends on n1 (its RAM tier goes, its copy stays on the hot tier), and
    /// a byte of that copy changes (the job user, or the disk). Neither node takes the changed
    /// file (its hash is not the sealed one), so s1 is not restored from replicas; the archive is
    /// down, so the job fails, saying which file no holder gave; n1's file is left as it is.
    async fn a_changed_byte_in_a_nodes_own_copy_is_not_restored() {
        let (mut nodes, archive, dirs, _) = protected_s1(308).await;
        nodes.replace_n2().await;
        nodes.end_on_n1(308).await;
        for _ in 0..200 {
            if !dirs[0].exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(!dirs[0].exists(), "n1's RAM tier outlived the job's end");
        let shard = nodes
            .tmp
            .path()
            .join("hot/n1/jobs/308/ckpt/s1/shards/rank0.bin");
        let mut changed = std::fs::read(&shard).unwrap();
        changed[1000] ^= 0xff;
        std::fs::write(&shard, &changed).unwrap();
        for (node, ready) in nodes.start_run(308, &archive, Some("latest")).await {
            let Err(e) = ready else {
                panic!("{node} started: {ready:?}");
            };
            assert!(
                e.contains("s1/shards/rank0.bin: no holder gave it (")
                    && e.contains("(n1's part): "),
                "{node}: {e}"
            );
        }
        assert_eq!(std::fs::read(&shard).unwrap(), changed);
        nodes.stop().await;
    }
}

root_test! {
    /// A checkpoint the archive holds is the archive's: its replicas are freed, and the nodes
    /// say so in their indexes, so a requeue's `latest` takes it from the archive on both nodes
    /// (the same tag everywhere), saying why not from replicas.
    async fn an_archived_checkpoint_is_restored_from_the_archive_not_the_replicas() {
        let nodes = two_nodes("16MiB");
        let url = nodes.archive_up();
        let dirs = nodes.start_job(309, &url).await;
        let mut files = save_part(&dirs[0], "s1", 0);
        files.extend(save_part(&dirs[1], "s1", 1));
        commit(&nodes, 0, 309, "s1").await;
        for node in [0, 1] {
            nodes
                .wait_ckpt(node, 309, "s1", "archived", |c| c.state == CkptState::Archived)
                .await;
        }
        for node in [0, 1] {
            assert_eq!(nodes.call(node, Request::JobEnd { job_id: 309 }).await, Response::Ok);
        }
        for (node, ready) in nodes.start_run(309, &url, Some("latest")).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            assert_eq!(d.restored_tag.as_deref(), Some("s1"), "{node}: {d:?}");
            assert!(
                d.notes.iter().any(|n| n.contains("s1, committed as late or later, is archived")),
                "{node}: {:?}",
                d.notes
            );
            assert!(!d.notes.iter().any(|n| n.contains("restored from replicas")), "{node}");
            for (path, bytes) in &files {
                let got = std::fs::read(Path::new(&d.ckpt_dir).join("s1").join(path)).unwrap();
                assert_eq!(&got, bytes, "{node}: s1/{path}");
            }
        }
        nodes.stop().await;
    }
}

root_test! {
    /// `--ckpt-replicas` replaces the site's `replicas` for one job, within `max_replicas` (here
    /// the harness's default: the same 1). With 0 the job's checkpoint is not copied anywhere and
    /// `sluice ckpt list` shows no replicas; asking for 2 fails the job at its start on every
    /// node, saying the bound.
    async fn a_job_asks_for_its_own_number_of_replicas_within_the_sites_bound() {
        let nodes = two_nodes("16MiB");
        let archive = nodes.archive_down();
        let mut dirs = Vec::new();
        for (node, ready) in nodes.start_run_with(309, &archive, &[("ckpt-replicas", "0")]).await {
            match ready {
                Ok(Response::Ready(d)) => dirs.push(PathBuf::from(d.ckpt_dir)),
                other => panic!("{node} not ready: {other:?}"),
            }
        }
        save_part(&dirs[0], "s1", 0);
        save_part(&dirs[1], "s1", 1);
        // Without replicas no commit notice goes to the other node (and the archive is down):
        // each node commits its own.
        commit(&nodes, 0, 309, "s1").await;
        commit(&nodes, 1, 309, "s1").await;
        for node in [0, 1] {
            let s1 = nodes
                .wait_ckpt(node, 309, "s1", "flushed", |c| c.on_hot_tier)
                .await;
            assert_eq!(s1.replicas, None, "{}: {s1:?}", NODES[node]);
        }
        // A few worker turns later still nothing in either replica area.
        tokio::time::sleep(Duration::from_secs(1)).await;
        for node in ["n1", "n2"] {
            let area = nodes.tmp.path().join(format!("ram/{node}/replicas/309"));
            assert!(!area.exists(), "{} holds replicas of a job that asked for none", area.display());
        }
        for (node, ready) in nodes.start_run_with(310, &archive, &[("ckpt-replicas", "2")]).await {
            let Err(e) = ready else {
                panic!("{node} started a job asking for more replicas than allowed: {ready:?}");
            };
            assert!(
                e.contains("--ckpt-replicas=2: this cluster keeps at most 1 replica(s) of a checkpoint ([fast_tier] max_replicas); ask for 1 or fewer"),
                "{node}: {e}"
            );
        }
        nodes.stop().await;
    }
}

root_test! {
    /// Replicas of hot-tier checkpoints (`--ckpt-tier=local --ckpt-replicas=1`): with the archive
    /// down, each node's part of s1 on its NVMe hot tier is hashed and copied to the other node,
    /// and s1 is protected; n2 is lost and replaced by an empty node, and the requeued job
    /// restores s1 byte for byte into both nodes' hot tiers from the replicas alone. A hot-tier
    /// job that does not ask gets none (the site's `replicas` is of RAM-tier checkpoints).
    async fn a_hot_tier_checkpoint_asked_to_be_replicated_survives_losing_a_node() {
        let mut nodes = two_nodes("16MiB");
        let archive = nodes.archive_down();
        let hot = [("ckpt-tier", "local"), ("ckpt-replicas", "1")];
        let mut dirs = Vec::new();
        for (node, ready) in nodes.start_run_with(311, &archive, &hot).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            dirs.push(PathBuf::from(d.ckpt_dir));
        }
        let root = nodes.tmp.path().to_path_buf();
        for (dir, node) in dirs.iter().zip(NODES) {
            assert!(dir.starts_with(root.join("hot").join(node)), "{node}: {dir:?} is not on the hot tier");
        }
        let files = save_protected(&nodes, 311, &dirs, "s1", 0).await;
        // n2 holds n1's part as n1 saved it, root-only.
        let held = nodes.replica_on_n2(311, "s1").join("files");
        for (path, bytes) in &files[..2] {
            assert_eq!(&std::fs::read(held.join(path)).unwrap(), bytes, "n2's replica of s1/{path}");
            assert_eq!(std::fs::metadata(held.join(path)).unwrap().uid(), 0);
        }
        nodes.replace_n2().await;
        nodes.end_on_n1(311).await;
        let restore = [("ckpt-tier", "local"), ("ckpt-replicas", "1"), ("ckpt-restore", "latest")];
        for (node, ready) in nodes.start_run_with(311, &archive, &restore).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            assert_eq!(d.restored_tag.as_deref(), Some("s1"), "{node}: {d:?}");
            for (path, bytes) in &files {
                let got = std::fs::read(Path::new(&d.ckpt_dir).join("s1").join(path));
                assert!(got.as_ref().is_ok_and(|g| g == bytes), "{node}: s1/{path} is not the saved one");
            }
            assert!(
                d.notes.iter().any(|n| n.starts_with("checkpoint s1 restored from replicas:") && n.ends_with(", 0 B from the archive")),
                "{node}: {:?}",
                d.notes
            );
        }
        // The new n2 commits what it restored and replicates its own part again: protected again.
        for node in [0, 1] {
            nodes
                .wait_ckpt(node, 311, "s1", "protected again", |c| {
                    c.replicas.as_ref().is_some_and(|r| r.protected)
                })
                .await;
        }
        // Without --ckpt-replicas a hot-tier job's checkpoint is archived and has no replicas.
        let up = nodes.archive_up();
        let mut plain = Vec::new();
        for (node, ready) in nodes.start_run_with(312, &up, &[("ckpt-tier", "local")]).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            plain.push(PathBuf::from(d.ckpt_dir));
        }
        save(&plain[0], "p1", 3);
        commit(&nodes, 0, 312, "p1").await;
        let c = nodes
            .wait_ckpt(0, 312, "p1", "archived", |c| c.state == CkptState::Archived)
            .await;
        assert!(c.replicas.is_none(), "{c:?}");
        assert!(!root.join("ram/n2/replicas/312").exists());
        nodes.stop().await;
    }
}

root_test! {
    /// A replaced node gets back its part of the job's older unarchived checkpoints, not only of
    /// the one restored: s1 and s2 are saved and protected with the archive down, n2 is lost and
    /// replaced, and the job is requeued with `--ckpt-restore=latest` and the archive up. n2
    /// restores s2 from replicas and fetches its own part of s1 back from n1's replica of it,
    /// saying so; then both are archived whole (n2 does not give the archive an empty part of
    /// s1), and a third run restores s1 from the archive with every file of both nodes.
    async fn a_replaced_node_gets_back_its_part_of_older_checkpoints_for_the_archive() {
        let mut nodes = two_nodes("32MiB");
        let down = nodes.archive_down();
        let dirs = nodes.start_job(313, &down).await;
        let s1 = save_protected(&nodes, 313, &dirs, "s1", 0).await;
        save_protected(&nodes, 313, &dirs, "s2", 2).await;
        nodes.replace_n2().await;
        nodes.end_on_n1(313).await;
        let up = nodes.archive_up();
        for (node, ready) in nodes.start_run(313, &up, Some("latest")).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            assert_eq!(d.restored_tag.as_deref(), Some("s2"), "{node}: {d:?}");
            let back = d.notes.iter().any(|n| {
                n.starts_with("checkpoint s1: this node's part (") && n.contains("goes to the archive")
            });
            // n1 kept its own s1: only the new n2 fetches its part back.
            assert_eq!(back, node == "n2", "{node}: {:?}", d.notes);
            if node == "n2" {
                // In the RAM tier, or flushed from there to the hot tier already (s1 is not the
                // newest, so its RAM copy goes once the hot tier's verifies).
                let hot = nodes.tmp.path().join("hot/n2/jobs/313/ckpt/s1");
                for (path, bytes) in &s1[2..] {
                    let got = std::fs::read(Path::new(&d.ckpt_dir).join("s1").join(path))
                        .or_else(|_| std::fs::read(hot.join(path)));
                    assert!(got.is_ok_and(|g| &g == bytes), "n2: s1/{path} is not its saved part");
                }
            }
        }
        for node in [0, 1] {
            for tag in ["s1", "s2"] {
                nodes
                    .wait_ckpt(node, 313, tag, "archived", |c| c.state == CkptState::Archived)
                    .await;
            }
        }
        for node in [0, 1] {
            assert_eq!(nodes.call(node, Request::JobEnd { job_id: 313 }).await, Response::Ok);
        }
        // The archive's s1 is whole: restored from it (its replicas are freed), every file of
        // both nodes' parts is there on both nodes.
        for (node, ready) in nodes.start_run(313, &up, Some("s1")).await {
            let Ok(Response::Ready(d)) = ready else {
                panic!("{node} not ready: {ready:?}");
            };
            assert_eq!(d.restored_tag.as_deref(), Some("s1"), "{node}: {d:?}");
            for (path, bytes) in &s1 {
                let got = std::fs::read(Path::new(&d.ckpt_dir).join("s1").join(path));
                assert!(got.is_ok_and(|g| &g == bytes), "{node}: the archive's s1/{path} is not the saved one");
            }
        }
        nodes.stop().await;
    }
}
