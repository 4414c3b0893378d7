//! Replicas of RAM-tier (and hot-tier) checkpoints (issue 26) in a real Slurm job, as the unprivileged test user.
//! The harness's `[fast_tier]` asks for one replica of each node's part, in 64 MiB of room per
//! node. The job runs on three nodes with `--ckpt-tier=ram`, archiving through the fault proxy,
//! which refuses every connection: an archive outage, so that only the replicas protect its
//! checkpoints. Every task writes its node's part of a checkpoint; rank 0 commits it once all are
//! written; the other nodes learn of the commit over the peer port (the archive cannot tell them).
//!
//! - `s1`, 8 MiB parts: every node's `sluice ckpt list` says protected; each part is on one other
//!   node, byte for byte, where the job user cannot even list; n1's and n2's on n3, the other
//!   switch of the harness's `topology.conf`.
//! - `s2`, 80 MiB parts, more than any node's room: no node takes another's; the job's output says
//!   `s2` is not protected, and why (and says nothing of the kind for `s1`).
//! - The archive comes back: both are archived and every replica freed.
//!
//! One job for both checkpoints: each job ending with the archive down waits out the epilog's
//! 20 s for it.
//!
//! A node lost right after the save (issue 26's restore): a 3-node RAM-tier job saves `dcp-1`
//! through `dcp.save(..., SluiceWriter)` on every rank (real PyTorch) while the archive is down,
//! and waits until it is protected; then n2's agent is SIGKILLed, its RAM tier, its hot-tier job
//! directory and its state are removed as if the machine were replaced, and its agent starts
//! again empty. `scontrol requeue` runs the job again on n1-n3 with `--ckpt-restore=latest`: every
//! rank `dcp.load`s `dcp-1` tensor-equal, the output says where each node's bytes came from, and
//! the fault proxy in front of the archive forwarded nothing meanwhile. When the archive is back,
//! `dcp-1` is archived and its replicas are freed. The same with the checkpoints on the NVMe hot
//! tier (`--ckpt-tier=local --ckpt-replicas=1`), whose replicas are held in the other nodes' RAM
//! tier all the same.

use crate::common::*;
use serde_json::Value;
use sluice_proto::msg::ReplicaStatus;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(180);

/// The job: for `s1` (8 MiB) then `s2` (80 MiB, once the test wrote `go-2`), each task writes its
/// part `TAG/part-NODE.bin` and rank 0 commits the tag once every task wrote; then every task
/// waits for the test's `go-on` (each wait two minutes at most).
fn script(cluster: &Cluster, work: &Path) -> String {
    let task = TASK
        .replace("@WORK@", &work.display().to_string())
        .replace("@CLI@", &cluster.user_cli().display().to_string());
    fs::write(work.join("task.sh"), task).unwrap();
    format!(
        "#!/bin/bash\nsrun -N3 -n3 --ntasks-per-node=1 bash {}/task.sh\n",
        work.display()
    )
}

/// Each task of [`script`] (`@WORK@` and `@CLI@` replaced).
const TASK: &str = r#"set -e
w=@WORK@
wait_for() { for i in $(seq 600); do [ -e "$w/$1" ] && return; sleep 0.2; done; }
save() {
  mkdir -p "$SLUICE_CKPT_DIR/$1"
  head -c "$2M" /dev/urandom > "$SLUICE_CKPT_DIR/$1/part-$SLURMD_NODENAME.bin"
  touch "$w/$1-$SLURMD_NODENAME"
  if [ "$SLURM_PROCID" = 0 ]; then
    for i in $(seq 600); do [ "$(ls "$w" | grep -c "^$1-")" -ge 3 ] && break; sleep 0.2; done
    @CLI@ ckpt commit "$1"
  fi
}
save s1 8
wait_for go-2
save s2 80
wait_for go-on
"#;

fn replicas_of(cluster: &Cluster, node: &str, job: &Job, tag: &str) -> Option<ReplicaStatus> {
    cluster.agent_ckpt(node, job, tag)?.replicas
}

/// `node`'s RAM tier.
fn ram_root(cluster: &Cluster, node: &str) -> PathBuf {
    Path::new(cluster.var("SLUICE_TEST_RAM_TIER_ROOT")).join(node)
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn replicas_protect_ram_checkpoints_while_the_archive_is_down_or_say_why_not() {
    let cluster = Cluster::for_s3();
    let proxy = FaultProxy::start(&cluster);
    proxy.set("refuse");
    let work = cluster.workdir("replicas");
    let url = format!("s3://ckpt-faulty/{}/replicas-{}", cluster.user, unique());
    let args = [
        "-N3".to_string(),
        "--ckpt-tier=ram".to_string(),
        format!("--ckpt-archive={url}"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let job = cluster.submit(&work, &args, &script(&cluster, &work));
    cluster.wait_running(&job, Duration::from_secs(60));
    let nodes = cluster.job_nodes(&job);
    assert_eq!(nodes.len(), 3, "{nodes:?}");

    // s1: protected.
    cluster.wait_for(
        "s1 protected on every node",
        Duration::from_secs(90),
        Some(&job),
        || {
            nodes
                .iter()
                .all(|n| replicas_of(&cluster, n, &job, "s1").is_some_and(|r| r.protected))
        },
    );
    for n in &nodes {
        let r = replicas_of(&cluster, n, &job, "s1").unwrap();
        assert!(
            r.held_by.len() == 1 && r.held_by[0] != *n && nodes.contains(&r.held_by[0]),
            "{n}'s part of s1 is held by {:?}\n{}",
            r.held_by,
            cluster.evidence(&job)
        );
        // The harness's topology.conf puts n1 and n2 on switch s1, n3 on s2: their parts go to
        // the other switch, whatever rendezvous hashing ranks first.
        if n != "n3" {
            assert_eq!(
                r.held_by,
                ["n3"],
                "{n}'s part of s1 is not on the other switch\n{}",
                cluster.evidence(&job)
            );
        }
        // The holder has exactly the bytes the job wrote on n, in its root-only replica area.
        let file = format!("part-{n}.bin");
        let saved = fs::read(ram_root(&cluster, n).join(format!("jobs/{}/ckpt/s1/{file}", job.id)))
            .unwrap();
        let area = ram_root(&cluster, &r.held_by[0]).join("replicas");
        let replica = area.join(format!("{}/{n}/s1/files/{file}", job.id));
        assert!(
            fs::read(&replica).ok() == Some(saved),
            "{} is not what the job saved on {n}",
            replica.display()
        );
        // The job's user cannot even list the area.
        let out = cluster.as_user(
            Path::new("/tmp"),
            "/bin/ls",
            &[area.to_str().unwrap()],
            None,
        );
        assert!(
            !out.status.success() && printed(&out).contains("Permission denied"),
            "the job user listed {}: {}",
            area.display(),
            printed(&out)
        );
    }

    // s2: no node has room for another's part.
    fs::write(work.join("go-2"), "").unwrap();
    cluster.wait_for(
        "every node to find no room for its part of s2",
        Duration::from_secs(90),
        Some(&job),
        || {
            nodes.iter().all(|n| {
                replicas_of(&cluster, n, &job, "s2")
                    .and_then(|r| r.short)
                    .is_some_and(|s| s.contains("has no room for replicas"))
            })
        },
    );
    for n in &nodes {
        let r = replicas_of(&cluster, n, &job, "s2").unwrap();
        assert!(r.held_by.is_empty() && !r.protected, "{n}: {r:?}");
    }
    // The job ends while the archive is still down: its output says s2 is not protected.
    fs::write(work.join("go-on"), "").unwrap();
    cluster.assert_completes(
        &job,
        JOB_TIMEOUT,
        "the job whose checkpoints are replicated",
    );
    let output = job.output_text();
    assert!(
        output.lines().any(
            |l| l.contains("checkpoint s2 is NOT protected by replicas (")
                && l.contains("has no room for replicas")
        ),
        "the job's output does not say s2 is unprotected:\n{output}"
    );
    assert!(
        !output.contains("checkpoint s1 is NOT protected"),
        "the job's output calls the protected s1 unprotected:\n{output}"
    );

    // The archive comes back: both are archived, and no node holds a replica of either.
    proxy.set("pass");
    cluster.wait_for(
        "s1 and s2 archived, and their replicas freed, on every node",
        Duration::from_secs(120),
        None,
        || {
            nodes.iter().all(|n| {
                let archived = |tag| {
                    cluster
                        .agent_ckpt(n, &job, tag)
                        .is_some_and(|c| c.archived_at.is_some())
                };
                let holds = ram_root(&cluster, n)
                    .join(format!("replicas/{}", job.id))
                    .read_dir()
                    .is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.path().join("s1").exists())));
                archived("s1") && archived("s2") && !holds
            })
        },
    );
    cluster.assert_nodes_return_idle(&job, Duration::from_secs(60));
}

/// The lost-node job: run 1 (waiting for the test's `go`) saves `dcp-1` with `dcp.py save ...
/// sluice` on every node, then waits to be requeued; run 2 loads what `--ckpt-restore=latest`
/// restored with `dcp.py load ... sluice`.
fn lost_node_script(cluster: &Cluster, work: &Path) -> String {
    format!(
        "#!/bin/bash\n\
         export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 {env}\n\
         w={w}\n\
         echo \"run $((${{SLURM_RESTART_COUNT:-0}} + 1)) of job $SLURM_JOB_ID: start\"\n\
         if [ \"${{SLURM_RESTART_COUNT:-0}}\" = 0 ]; then\n\
           touch \"$w/run1-started\"\n\
           for i in $(seq 600); do [ -e \"$w/go\" ] && break; sleep 0.2; done\n\
           srun -N3 -n3 --ntasks-per-node=1 {py} \"$w/dcp.py\" save \"$w\" {save_port} sluice\n\
           touch \"$w/saved\"\n\
           sleep 600\n\
         else\n\
           srun -N3 -n3 --ntasks-per-node=1 {py} \"$w/dcp.py\" load \"$w\" {load_port} sluice\n\
         fi\n",
        env = sluice_ckpt_env(work, &cluster.user_cli()),
        w = work.display(),
        py = cluster.torch_python().display(),
        save_port = free_port(),
        load_port = free_port(),
    )
}

/// The reports of `dcp.py PHASE` (`WORK/out/PHASE/NODE.json`), by node; each must have no errors.
fn rank_reports(cluster: &Cluster, job: &Job, work: &Path, phase: &str) -> BTreeMap<String, Value> {
    let mut by_node = BTreeMap::new();
    for n in cluster.job_nodes(job) {
        let path = work.join("out").join(phase).join(format!("{n}.json"));
        let report: Value = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_else(|| panic!("no report {}\n{}", path.display(), cluster.evidence(job)));
        assert!(
            report["errors"].as_array().is_some_and(|e| e.is_empty()),
            "{phase} on {n}: {report:#}\n{}",
            cluster.evidence(job)
        );
        by_node.insert(n, report);
    }
    by_node
}

/// `node` is lost and replaced: its agent SIGKILLed; its RAM tier (the job's tmpfs and the replica
/// area), its hot-tier directory of `job` and its agent's state removed; its agent started again.
fn replace_node(cluster: &Cluster, node: &str, job: &Job) {
    let agent = cluster.kill_agent_and_its_ports(node);
    let ram = ram_root(cluster, node);
    for m in &sluice_e2e::mounts_below(&ram) {
        nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH)
            .unwrap_or_else(|e| panic!("umount {}: {e}", m.display()));
    }
    let state = cluster.hot_root(node).parent().unwrap().join("state");
    for dir in [&ram, &state] {
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            fs::remove_dir_all(e.path())
                .or_else(|_| fs::remove_file(e.path()))
                .unwrap_or_else(|err| panic!("removing {}: {err}", e.path().display()));
        }
    }
    let job_dir = cluster.job_dir(node, job);
    if job_dir.exists() {
        fs::remove_dir_all(&job_dir).unwrap();
    }
    cluster.start_agent(&agent);
    assert!(
        cluster.agent_ckpts(node, job).is_err(),
        "the new agent of {node} knows job {}",
        job.id
    );
}

#[test]
#[ignore = "needs the Slurm test cluster and PyTorch: tests/harness/run-e2e.sh"]
fn replicas_a_requeue_after_losing_a_node_restores_every_rank_with_nothing_from_the_archive() {
    lost_node_restores_from_replicas(Tier::Ram);
}

/// The same with the checkpoints on the NVMe hot tier (`--ckpt-tier=local`), which the job asks
/// to have replicated (`--ckpt-replicas=1`; the site's `replicas` is of RAM-tier checkpoints).
#[test]
#[ignore = "needs the Slurm test cluster and PyTorch: tests/harness/run-e2e.sh"]
fn replicas_of_hot_tier_checkpoints_restore_every_rank_after_losing_a_node() {
    lost_node_restores_from_replicas(Tier::Hot);
}

/// Where the lost-node job keeps its checkpoints.
#[derive(Clone, Copy, PartialEq)]
enum Tier {
    Ram,
    Hot,
}

fn lost_node_restores_from_replicas(tier: Tier) {
    const TAG: &str = "dcp-1";
    const LOST: &str = "n2";
    let cluster = Cluster::for_s3();
    let proxy = FaultProxy::start(&cluster);
    proxy.set("pass");
    let name = match tier {
        Tier::Ram => "replicas-lost",
        Tier::Hot => "replicas-lost-hot",
    };
    let work = cluster.workdir(name);
    write_framework_scripts(&work);
    install_sluice_ckpt(&work);
    let prefix = format!("{}/{name}-{}", cluster.user, unique());
    let tier_args: &[&str] = match tier {
        Tier::Ram => &["--ckpt-tier=ram"],
        Tier::Hot => &["--ckpt-tier=local", "--ckpt-replicas=1"],
    };
    let args = [
        "-N3".to_string(),
        tier_args.join(" "),
        format!("--ckpt-archive=s3://ckpt-faulty/{prefix}"),
        "--ckpt-restore=latest".to_string(),
        "--requeue".to_string(),
        "--open-mode=append".to_string(),
    ];
    let args: Vec<&str> = args.iter().flat_map(|a| a.split(' ')).collect();
    let job = cluster.submit(&work, &args, &lost_node_script(&cluster, &work));
    cluster.wait_for(
        "run 1 to start",
        Duration::from_secs(90),
        Some(&job),
        || work.join("run1-started").exists(),
    );
    let nodes = cluster.job_nodes(&job);
    assert_eq!(nodes, ["n1", "n2", "n3"]);

    // The archive goes down; every rank saves its shard of dcp-1, rank 0 commits it.
    proxy.set("refuse");
    let forwarded = proxy.stats()["forwarded"].as_u64();
    fs::write(work.join("go"), "").unwrap();
    cluster.wait_for("run 1 to save dcp-1", JOB_TIMEOUT, Some(&job), || {
        work.join("saved").exists()
    });
    let saved = rank_reports(&cluster, &job, &work, "save");
    cluster.wait_for(
        "dcp-1 protected on every node",
        Duration::from_secs(90),
        Some(&job),
        || {
            nodes
                .iter()
                .all(|n| replicas_of(&cluster, n, &job, TAG).is_some_and(|r| r.protected))
        },
    );
    let holders: BTreeMap<String, Vec<String>> = nodes
        .iter()
        .map(|n| {
            (
                n.clone(),
                replicas_of(&cluster, n, &job, TAG).unwrap().held_by,
            )
        })
        .collect();
    // The bytes of each node's part, as its ranks wrote them into its RAM tier (or hot tier).
    let part_bytes: BTreeMap<String, u64> = nodes
        .iter()
        .map(|n| {
            let dir = match tier {
                Tier::Ram => ram_root(&cluster, n).join(format!("jobs/{}/ckpt/{TAG}", job.id)),
                Tier::Hot => cluster.job_dir(n, &job).join(format!("ckpt/{TAG}")),
            };
            let size = fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|e| e.unwrap().metadata().unwrap().len())
                .sum();
            (n.clone(), size)
        })
        .collect();

    // n2 is lost and replaced by an empty node; the job runs again.
    replace_node(&cluster, LOST, &job);
    let requeued = cluster.requeue_and_release(&job, Duration::from_secs(200));
    cluster.assert_completes(
        &job,
        JOB_TIMEOUT,
        &format!(
            "run 2 (started in state {}, released by {:?})",
            requeued.started_in, requeued.released
        ),
    );
    let loaded = rank_reports(&cluster, &job, &work, "load");
    let all: BTreeMap<String, Value> = saved
        .values()
        .flat_map(|r| r["files"].as_object().cloned().unwrap_or_default())
        .collect();
    for (n, r) in &loaded {
        let found: BTreeMap<String, Value> = r["files"]
            .as_object()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .collect();
        assert!(
            r["restored_tag"] == TAG && found == all && r["compared"].as_u64() >= Some(14),
            "{n} did not load dcp-1 whole and tensor-equal: {r:#}\nsaved: {all:?}\n{}",
            cluster.evidence(&job)
        );
    }
    // Each node says where its bytes came from: its own part and the replicas it held from this
    // node, the rest from the others (the new n2: everything), nothing from the archive.
    let output = job.output_text();
    let notes: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("checkpoint dcp-1 restored from replicas: "))
        .collect();
    let total: u64 = part_bytes.values().sum();
    for n in &nodes {
        // The bytes the agent counted, as its log gives them exactly.
        let log = fs::read_to_string(cluster.agent_log(n)).unwrap_or_default();
        let said = format!(
            "checkpoint restored from replicas job_id={} tag=\"{TAG}\"",
            job.id
        );
        let count = |line: &str, key: &str| -> Option<u64> {
            let v = line.split(&format!(" {key}=")).nth(1)?;
            v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        };
        let (here, others) = log
            .lines()
            .rfind(|l| l.contains(&said))
            .and_then(|l| Some((count(l, "here")?, count(l, "others")?)))
            .unwrap_or_else(|| {
                panic!("{n}'s agent log does not say it restored {TAG} from replicas")
            });
        // At least its own part and the replicas it held in run 1 came from this node (the new
        // n2 had none); it may hold more by now (parts placed again after the restore), and
        // nothing came twice.
        let held_in_run1: u64 = holders
            .iter()
            .filter(|(from, by)| *from != n && by.contains(n))
            .map(|(from, _)| part_bytes[from])
            .sum();
        let at_least = if n == LOST {
            0
        } else {
            part_bytes[n] + held_in_run1
        };
        assert!(
            here + others == total && here >= at_least && (n != LOST || here == 0),
            "{n} restored {here} bytes from itself and {others} from the others: {TAG} has {total}, \
             and it held {at_least} (holders in run 1: {holders:?}, parts: {part_bytes:?})"
        );
        let want = format!(
            "slurmstepd-{n}: error: sluice: note: checkpoint {TAG} restored from replicas: {} from \
             this node, {} from the job's other nodes, 0 B from the archive",
            sluice_proto::summary::bytes(here),
            sluice_proto::summary::bytes(others)
        );
        assert!(
            notes.iter().any(|l| l.trim_end() == want),
            "run 2's output must say where {n}'s bytes of {TAG} came from ({want:?}):\n{output}"
        );
    }
    assert_eq!(
        proxy.stats()["forwarded"].as_u64(),
        forwarded,
        "the archive's store was asked for something while it was down: {}",
        proxy.log_tail()
    );
    eprintln!(
        "[{name}] holders in run 1: {holders:?}; run 2's notes: {notes:?}; requeue: pending \
         [{}], released by {:?}",
        requeued.pending, requeued.released
    );

    // The archive is back: dcp-1 is archived, and no node holds a replica of it.
    proxy.set("pass");
    let manifest = format!("{TAG}/MANIFEST");
    cluster.wait_for(
        "dcp-1 archived and its replicas freed on every node",
        Duration::from_secs(150),
        None,
        || {
            let archived = cluster
                .list_objects("garage", &format!("ckpt-faulty/{prefix}"))
                .contains(&manifest);
            let held = nodes.iter().any(|n| {
                ram_root(&cluster, n)
                    .join(format!("replicas/{}", job.id))
                    .read_dir()
                    .is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.path().join(TAG).exists())))
            });
            archived && !held
        },
    );
    cluster.assert_nodes_return_idle(&job, Duration::from_secs(60));
}
