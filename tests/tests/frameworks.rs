//! Real training frameworks save and restore through sluice (issue 10): PyTorch from PyPI (CPU,
//! gloo), 3-node jobs with one task per node (`srun -N3 -n3`; 2 nodes for the data-parallel
//! trainers, see `DATA_PARALLEL_NODES`), as the unprivileged test user.
//!
//! Each test runs two jobs. The first trains a tiny model and saves a checkpoint the way its
//! framework does, into the node-local `$SLUICE_CKPT_DIR`, committed the way that framework commits
//! (or with `sluice ckpt commit`), and ends. The archive (`file://`, below the user's prefix) must
//! then hold the checkpoint with its MANIFEST, naming every file the job wrote. The second job runs
//! with `--ckpt-restore=latest` and, on every rank, loads the checkpoint with the framework's own
//! loader into a freshly initialised model and compares tensor by tensor with what the first job
//! saved (dtype, shape, every value). The comparison is made in Python, by the scripts of
//! `tests/harness/frameworks/` (see `fwcheck.py`); each rank leaves a JSON report in the work
//! directory, which the tests read.
//!
//! - `torch.distributed.checkpoint` (DCP) on all ranks, sharded DTensors, committed by DCP's own
//!   `.metadata` (written by rank 0 alone, so only one node sees the signal);
//! - the DDP pattern: `torch.save` from rank 0 only, `sluice ckpt commit`; the other nodes never
//!   have the tag;
//! - DeepSpeed ZeRO-1: `latest` + `global_stepN/` with per-rank files, written by the real
//!   `deepspeed` package when install.sh could install it, else by a stand-in script that writes
//!   the same layout (the test says which);
//! - Megatron's `latest_checkpointed_iteration.txt` signal and `iter_NNNNNNN/mp_rank_XX/` layout of
//!   a tensor-parallel run (a stand-in: Megatron's trainer is not installed).
//!
//! Without PyTorch installed (`tests/harness/install.sh`, unless `SLUICE_NO_TORCH=1`) every test
//! here fails saying so.

use crate::common::*;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// One job: start, three ranks importing torch (DeepSpeed: ~15 s more) on two cores, a few
/// training steps, the save or the load.
const JOB_TIMEOUT: Duration = Duration::from_secs(180);
/// Until a checkpoint committed before the job ended has its MANIFEST, counted from the job's end
/// (the epilog already waited up to the agents' `epilog_wait` of 20 s for it).
const ARCHIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// path (relative to the tag) → sha256.
type Files = BTreeMap<String, String>;

/// One framework's test: the cluster, a fresh `file://` archive of the test user, the work
/// directory with the job scripts, the venv's python, the name its jobs carry.
struct Framework {
    cluster: Cluster,
    archive: Archive,
    work: PathBuf,
    python: PathBuf,
    name: String,
    /// Nodes of its jobs, one task each.
    nodes: u64,
}

/// The nodes of the Lightning and Hugging Face jobs. Data-parallel training sums every gradient
/// over the ranks, and DDP re-lays its gradient buckets after a process's first step, which
/// changes the order of that sum: with three ranks a resumed run differs from an uninterrupted one
/// in the last bits of a few weights, without sluice in between (measured with Lightning: 1 to 5
/// elements after the first step past the resume). A sum of two is the same in any order, so on
/// two nodes the resumed run must end exactly where the uninterrupted one did.
const DATA_PARALLEL_NODES: u64 = 2;

/// What the ranks of one job reported (`out/PHASE/NODE.json`), by node, in rank order.
struct Reports {
    by_node: Vec<(String, Value)>,
}

impl Reports {
    /// The files each rank wrote (save) or found (load) below the tag, by rank.
    fn files_by_rank(&self) -> BTreeMap<u64, Files> {
        self.by_node
            .iter()
            .map(|(_, r)| (r["rank"].as_u64().unwrap(), files_of(r)))
            .collect()
    }

    /// Every file of the checkpoint: the union of what the ranks wrote.
    fn union(&self) -> Files {
        self.by_node.iter().flat_map(|(_, r)| files_of(r)).collect()
    }

    /// The reports' notes (what a rank noticed that is no failure), one line each.
    fn notes(&self) -> Vec<String> {
        self.by_node
            .iter()
            .flat_map(|(n, r)| {
                r["notes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(move |x| format!("{n}: {}", x.as_str().unwrap_or_default()))
            })
            .collect()
    }
}

fn files_of(report: &Value) -> Files {
    report["files"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// One framework's save, archive and restore: what [`Framework::round_trip`] runs and checks.
struct RoundTrip<'a> {
    /// The job script, run with `args` by the save job and by the load job alike.
    script: &'a str,
    args: &'a [&'a str],
    /// The files each rank writes below the tag on its node, by rank; a rank not listed writes none.
    writes: &'a [(u64, &'a [&'a str])],
    /// The save job, as failure messages name it.
    save_job: &'a str,
    tag: &'a str,
    /// What the load job asks for with `--ckpt-restore=`.
    restore: &'a str,
    /// How many tensors each rank of the load job must find equal, at least.
    min_tensors: u64,
}

impl Framework {
    fn start(name: &str) -> Framework {
        Framework::start_on(name, 3)
    }

    fn start_on(name: &str, nodes: u64) -> Framework {
        let cluster = Cluster::for_sluice();
        let python = cluster.torch_python();
        let archive = Archive::new(&cluster, Backend::File, &format!("fw-{name}"));
        let work = cluster.workdir(&format!("fw-{name}"));
        write_framework_scripts(&work);
        install_sluice_ckpt(&work);
        Framework {
            cluster,
            archive,
            work,
            python,
            name: name.to_string(),
            nodes,
        }
    }

    /// Submits a job of `self.nodes` nodes whose one task per node runs `SCRIPT PHASE WORK PORT ARGS...`.
    fn submit(&self, phase: &str, script: &str, args: &[&str], restore: Option<&str>) -> Job {
        let step = format!(
            "srun -N{n} -n{n} --ntasks-per-node=1 {py} {w}/{script} {phase} {w} {port} {args}",
            n = self.nodes,
            py = self.python.display(),
            w = self.work.display(),
            port = free_port(),
            args = args.join(" "),
        );
        // One thread per rank: three ranks share the machine's two cores.
        let script = format!(
            "#!/bin/bash\nexport OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo DS_ACCELERATOR=cpu PYTHONUNBUFFERED=1 \
             PYTHONDONTWRITEBYTECODE=1 {env}\n{step}\n",
            env = sluice_ckpt_env(&self.work, &self.cluster.user_cli()),
        );
        let archive = format!("--ckpt-archive={}", self.archive.url);
        let name = format!("--job-name=fw-{}-{phase}", self.name);
        let nodes = format!("-N{}", self.nodes);
        let mut opts = vec![nodes.as_str(), archive.as_str(), name.as_str()];
        let restore = restore.map(|r| format!("--ckpt-restore={r}"));
        opts.extend(restore.as_deref());
        self.cluster.submit(&self.work, &opts, &script)
    }

    /// Waits for the job to end and reads every rank's report; panics unless the job COMPLETED
    /// and every node of it reported, with the ranks' errors and the evidence.
    fn finish(&self, job: &Job, phase: &str, what: &str) -> Reports {
        let end = self.cluster.wait_end(job, JOB_TIMEOUT);
        let nodes = self.cluster.job_nodes(job);
        let mut by_node = Vec::new();
        let mut missing = Vec::new();
        for n in &nodes {
            let path = self.work.join("out").join(phase).join(format!("{n}.json"));
            match fs::read(&path) {
                Ok(bytes) => by_node.push((
                    n.clone(),
                    serde_json::from_slice::<Value>(&bytes)
                        .unwrap_or_else(|e| panic!("{}: {e}", path.display())),
                )),
                Err(e) => missing.push(format!("{n}: {e}")),
            }
        }
        let errors: Vec<String> = by_node
            .iter()
            .flat_map(|(n, r)| {
                r["errors"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(move |e| format!("{n}: {}", e.as_str().unwrap_or_default()))
            })
            .collect();
        assert!(
            (end.state.as_str(), end.exit_code.as_str()) == ("COMPLETED", "0:0")
                && missing.is_empty()
                && errors.is_empty()
                && nodes.len() as u64 == self.nodes,
            "{what} (job {}) ended {} ({}) on {nodes:?}; ranks' errors: {errors:#?}; no report from: \
             {missing:?}\n{}",
            job.id,
            end.state,
            end.exit_code,
            self.cluster.evidence(job)
        );
        by_node.sort_by_key(|(_, r)| r["rank"].as_u64());
        Reports { by_node }
    }

    /// Runs the save job, checks that `t.tag` is archived whole, then that a load job restores it
    /// on every rank: [`Framework::save`], [`Framework::assert_archived`] and
    /// [`Framework::assert_restores`] in turn.
    fn round_trip(&self, t: RoundTrip) {
        let (job, saved) = self.save(t.script, t.args, t.writes, t.save_job);
        self.assert_archived(t.tag, &job, &saved);
        self.assert_restores(t.script, t.args, t.restore, t.tag, &saved, t.min_tensors);
    }

    /// Runs the save job and checks that each rank wrote exactly the files `expected` gives it.
    fn save(
        &self,
        script: &str,
        args: &[&str],
        expected: &[(u64, &[&str])],
        what: &str,
    ) -> (Job, Reports) {
        let job = self.submit("save", script, args, None);
        let saved = self.finish(&job, "save", what);
        let wrote: BTreeMap<u64, BTreeSet<String>> = saved
            .files_by_rank()
            .into_iter()
            .map(|(r, f)| (r, f.into_keys().collect()))
            .collect();
        let want: BTreeMap<u64, BTreeSet<String>> = (0..self.nodes)
            .map(|r| {
                let files = expected.iter().find(|(er, _)| *er == r).map(|(_, f)| *f);
                (
                    r,
                    files
                        .unwrap_or_default()
                        .iter()
                        .map(|f| f.to_string())
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            wrote,
            want,
            "{what}: the files each rank wrote below the tag on its node (by rank)\n{}",
            self.cluster.evidence(&job)
        );
        (job, saved)
    }

    /// Waits (bounded) for the MANIFEST of `tag` after the save job ended and checks it names
    /// every file the job wrote, each stored whole. On a timeout the message says which nodes
    /// wrote the tag, which never had it, and what each node's agent says of it.
    fn assert_archived(&self, tag: &str, job: &Job, saved: &Reports) -> Value {
        let start = Instant::now();
        while !self.archive.manifests(&self.cluster).contains(tag) {
            if start.elapsed() > ARCHIVE_TIMEOUT {
                let nodes = |wrote: bool| -> Vec<&str> {
                    saved
                        .by_node
                        .iter()
                        .filter(|(_, r)| files_of(r).is_empty() != wrote)
                        .map(|(n, _)| n.as_str())
                        .collect()
                };
                let agents: Vec<String> = saved
                    .by_node
                    .iter()
                    .map(|(n, _)| match self.cluster.agent_ckpts(n, job) {
                        Ok(c) => format!("{n}: {:?}", c.iter().find(|c| c.tag == tag)),
                        Err(e) => format!("{n}: {e}"),
                    })
                    .collect();
                panic!(
                    "{tag} was committed, but {} holds no MANIFEST for it {:?} after job {} ended: the \
                     checkpoint is not archived, and a --ckpt-restore=latest job would not find it.\n\
                     Nodes that wrote files of {tag}: {:?}; nodes of the job that never had {tag}: {:?}.\n\
                     What each node's agent says of {tag}:\n  {}\nObjects in the archive: {:?}\n{}",
                    self.archive.url,
                    ARCHIVE_TIMEOUT,
                    job.id,
                    nodes(true),
                    nodes(false),
                    agents.join("\n  "),
                    self.archive
                        .objects(&self.cluster)
                        .keys()
                        .collect::<Vec<_>>(),
                    self.cluster.evidence(job)
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let manifest = self
            .archive
            .check_manifest(&self.cluster, tag)
            .unwrap_or_else(|e| panic!("{e}\n{}", self.cluster.evidence(job)));
        let listed: BTreeSet<&str> = manifest["files"]
            .as_array()
            .unwrap_or_else(|| panic!("{tag}/MANIFEST has no files: {manifest}"))
            .iter()
            .filter_map(|f| f["path"].as_str())
            .collect();
        let union = saved.union();
        assert_eq!(
            listed,
            union.keys().map(String::as_str).collect(),
            "{tag}/MANIFEST in {} does not name exactly the files the job wrote",
            self.archive.url
        );
        manifest
    }

    /// Runs a `--ckpt-restore=RESTORE` job whose every rank loads `tag` with the framework's loader
    /// and compares it with what was saved; checks what each rank saw: `SLUICE_RESTORED_TAG`, only
    /// `tag` (and its framework's signal file) in `$SLUICE_CKPT_DIR`, every file of the checkpoint with the bytes written, at least
    /// `min_tensors` tensors compared equal.
    fn assert_restores(
        &self,
        script: &str,
        args: &[&str],
        restore: &str,
        tag: &str,
        saved: &Reports,
        min_tensors: u64,
    ) -> Reports {
        let job = self.submit("load", script, args, Some(restore));
        let what = format!("the --ckpt-restore={restore} job loading {tag}");
        let loaded = self.finish(&job, "load", &what);
        let union = saved.union();
        for (node, r) in &loaded.by_node {
            let ev = || self.cluster.evidence(&job);
            assert_eq!(
                r["restored_tag"].as_str(),
                Some(tag),
                "SLUICE_RESTORED_TAG on {node}\n{}",
                ev()
            );
            // The tag, and the completion signal its framework leaves beside it (restored so that
            // loading "the latest checkpoint of the directory" finds it).
            let mut entries = vec![tag.to_string()];
            if tag.starts_with("global_step") {
                entries.push("latest".into());
            } else if tag.starts_with("iter_") {
                entries.push("latest_checkpointed_iteration.txt".into());
            }
            entries.sort();
            assert_eq!(
                r["ckpt_dir_entries"],
                serde_json::json!(entries),
                "$SLUICE_CKPT_DIR on {node} before the first step\n{}",
                ev()
            );
            let found = files_of(r);
            assert!(
                found == union,
                "{tag} restored on {node} is not what the save job wrote: {}\n{}",
                diff_trees(&union, &found),
                ev()
            );
            let compared = r["compared"].as_u64().unwrap_or(0);
            assert!(
                compared >= min_tensors,
                "{node} compared only {compared} tensors of {tag} (expected at least {min_tensors})\n{}",
                ev()
            );
        }
        let notes = loaded.notes();
        if !notes.is_empty() {
            eprintln!("notes of the load job:\n  {}", notes.join("\n  "));
        }
        loaded
    }
}

// ------------------------------------------------------------------------------------ the tests

/// `torch.distributed.checkpoint` on every rank: DTensor-sharded model and Adam state saved with
/// `dcp.save` into `$SLUICE_CKPT_DIR/dcp-1`, committed only by DCP's `.metadata` (rank 0's node is
/// the only one that has it; the others hold their shard files); restored with `dcp.load` on every
/// rank, every local shard equal to what that rank saved.
#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn frameworks_dcp_save_on_all_ranks_restores_with_dcp_load() {
    Framework::start("dcp").round_trip(RoundTrip {
        script: "dcp.py",
        args: &[],
        writes: &[
            (0, &[".metadata", "__0_0.distcp"]),
            (1, &["__1_0.distcp"]),
            (2, &["__2_0.distcp"]),
        ],
        save_job: "the DCP save job",
        tag: "dcp-1",
        restore: "latest",
        // Per rank: 4 parameter shards, the bf16 buffer, 3 × 3 Adam tensors (step, exp_avg,
        // exp_avg_sq).
        min_tensors: 14,
    });
}

/// The DDP pattern: rank 0 alone `torch.save`s `step-1/model.pt` and runs `sluice ckpt commit
/// step-1`; the job's two other nodes never have the tag. The checkpoint must still be archived,
/// and after `--ckpt-restore=latest` every rank `torch.load`s it into its own model and optimizer.
#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn frameworks_torch_save_from_rank_0_only_restores_on_every_rank() {
    let fw = Framework::start("ddp");
    let cli = fw.cluster.user_cli();
    let cli = cli.to_string_lossy();
    fw.round_trip(RoundTrip {
        script: "ddp.py",
        args: &[&cli],
        writes: &[(0, &["model.pt"])],
        save_job: "the DDP job saving from rank 0",
        tag: "step-1",
        restore: "latest",
        // The model's 4 tensors and AdamW's 3 per parameter, loaded into the model and the
        // optimizer, then read from the file once more: (4 + 12) × 2.
        min_tensors: 32,
    });
}

/// DeepSpeed ZeRO stage 1: `latest` names `global_step10`, rank 0 writes
/// `global_step10/mp_rank_00_model_states.pt`, each rank R its own
/// `zero_pp_rank_R_mp_rank_00_optim_states.pt` on its node; `latest` is the only commit. Restored,
/// every rank loads it (`engine.load_checkpoint` with the restored tag) and `torch.load`s every
/// file. With the real `deepspeed` package when install.sh installed it; else a STAND-IN: the same
/// layout written by `deepspeed_ckpt.py` itself with torch.save (the test prints which ran).
#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn frameworks_deepspeed_checkpoint_restores_with_every_rank_file() {
    let fw = Framework::start("deepspeed");
    let mode = if fw.cluster.has_deepspeed(&fw.python) {
        "real"
    } else {
        "stand-in"
    };
    eprintln!(
        "DeepSpeed: {}",
        if mode == "real" {
            "the real deepspeed package"
        } else {
            "STAND-IN: deepspeed is not installed; the script writes DeepSpeed's layout itself"
        }
    );
    fw.round_trip(RoundTrip {
        script: "deepspeed_ckpt.py",
        args: &[mode],
        writes: &[
            (
                0,
                &[
                    "mp_rank_00_model_states.pt",
                    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                ],
            ),
            (1, &["zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
            (2, &["zero_pp_rank_2_mp_rank_00_optim_states.pt"]),
        ],
        save_job: "the DeepSpeed save job",
        tag: "global_step10",
        restore: "latest",
        min_tensors: 12,
    });
}

/// Megatron's signal: rank R of a tensor-parallel (TP=3) run saves
/// `iter_0000200/mp_rank_0R/model_optim_rng.pt`, then rank 0 writes
/// `latest_checkpointed_iteration.txt` holding `200`, the only commit. Restored, every rank
/// `torch.load`s its shard into a fresh model and optimizer, and every rank's file. A STAND-IN for
/// Megatron's trainer (not installed): `megatron.py` writes its layout with torch.save.
#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn frameworks_megatron_iteration_signal_restores_every_tensor_parallel_shard() {
    Framework::start("megatron").round_trip(RoundTrip {
        script: "megatron.py",
        args: &[],
        writes: &[
            (0, &["mp_rank_00/model_optim_rng.pt"]),
            (1, &["mp_rank_01/model_optim_rng.pt"]),
            (2, &["mp_rank_02/model_optim_rng.pt"]),
        ],
        save_job: "the Megatron-layout save job",
        tag: "iter_0000200",
        restore: "latest",
        min_tensors: 20,
    });
}

/// PyTorch Lightning, adopted in one line (`Trainer(plugins=[SluiceCheckpointIO()])`), in a 2-node
/// DDP job that Lightning sets up from Slurm's variables itself: rank 0 alone writes `step-8.ckpt`
/// through the sluice writer into the tag `step-8` and commits it, while training goes on to step
/// 12. Restored (`latest`) on every node, each rank resumes with `fit(ckpt_path=
/// restored_checkpoint())` and ends with exactly the weights and SGD momentum of the uninterrupted
/// run (`tests/harness/frameworks/lightning_ddp.py`, with Lightning from PyPI).
#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn frameworks_lightning_ddp_resumes_to_the_state_of_an_uninterrupted_run() {
    Framework::start_on("lightning", DATA_PARALLEL_NODES).round_trip(RoundTrip {
        script: "lightning_ddp.py",
        args: &[],
        writes: &[(0, &["step-8.ckpt"])],
        save_job: "the Lightning DDP job",
        tag: "step-8",
        restore: "latest",
        // The checkpoint file (read twice: the model's 4 tensors, the momentum buffers,
        // Lightning's loop state) and the 4 weights and 4 momentum buffers after step 12.
        min_tensors: 16,
    });
}

/// The Hugging Face Trainer, adopted in one line (`callbacks=[SluiceCallback()]`, `output_dir=
/// $SLUICE_CKPT_DIR`), data-parallel over 2 nodes: `checkpoint-8` is rank 0's model, optimizer and
/// trainer state plus every rank's own `rng_state_R.pth` on its own node, committed once every
/// rank wrote its part. Restored by name on every node (the run also saved `checkpoint-12`), each
/// rank resumes with `train(resume_from_checkpoint=restored_checkpoint())` and ends at step 12
/// with exactly the weights and AdamW state of the uninterrupted run, dropout included
/// (`tests/harness/frameworks/hf_trainer.py`, with transformers and accelerate from PyPI).
#[test]
#[ignore = "needs the test cluster (tests/harness/run-e2e.sh)"]
fn frameworks_hugging_face_trainer_resumes_to_the_state_of_an_uninterrupted_run() {
    Framework::start_on("hf", DATA_PARALLEL_NODES).round_trip(RoundTrip {
        script: "hf_trainer.py",
        args: &[],
        writes: &[
            (
                0,
                &[
                    "config.json",
                    "model.safetensors",
                    "optimizer.pt",
                    "rng_state_0.pth",
                    "scheduler.pt",
                    "trainer_state.json",
                    "training_args.bin",
                ],
            ),
            (1, &["rng_state_1.pth"]),
        ],
        save_job: "the Hugging Face Trainer job",
        tag: "checkpoint-8",
        restore: "checkpoint-8",
        min_tensors: 40,
    });
}
