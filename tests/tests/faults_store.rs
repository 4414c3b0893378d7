//! An object store that throttles (503 SlowDown, 429), stops answering, or goes away entirely, in
//! front of a job that archives checkpoints or stages data (issue 4, "Fault behaviour"): the archive
//! becomes late, never the job; a stage-in from a store that cannot be reached fails the job with a
//! clear message within the stage timeout, and no node is drained.
//!
//! The faults come from `tests/harness/faultproxy.py`, which sits in front of Garage on the endpoint
//! of the agents' `s3://ckpt-faulty` profile. What the tests check is read from Garage directly.

use crate::common::*;
use std::path::Path;
use std::time::{Duration, Instant};

/// The agent retries a failing archive with a backoff capped at 120 s (agent backoff.rs ARCHIVE),
/// and one attempt may itself spend a while in the client's request retries.
const ARCHIVE_AFTER_RECOVERY: Duration = Duration::from_secs(180);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);
const TAG: &str = "step-1";

/// A one-node training job: writes checkpoint TAG in `$SLUICE_CKPT_DIR` (a 6.2 MB file, so it is a
/// multipart upload, a 1 MB file, a nested one) and commits it the way torch.distributed.checkpoint
/// does (`TAG/.metadata` written last); then "trains" for `steps` seconds, one progress line per
/// second. Records the checkpoint's checksums and the commit time in `work`.
fn training_script(work: &Path, steps: u32) -> String {
    format!(
        r#"#!/bin/bash
srun --ntasks=1 /bin/bash -c '
set -eu
w="{work}"
ck="$SLUICE_CKPT_DIR/{TAG}"
mkdir -p "$ck/extra"
head -c 6500000 /dev/urandom > "$ck/model.bin"
head -c 1000000 /dev/urandom > "$ck/optim.bin"
echo "rng state" > "$ck/extra/rng.txt"
echo "{{\"tag\": \"{TAG}\"}}" > "$ck/.metadata"
(cd "$ck" && {SUMS_CMD}) > "$w/ckpt.sums"
echo "$SLUICE_CKPT_DIR" > "$w/ckpt_dir"
date +%s.%N > "$w/committed"
for i in $(seq 1 {steps}); do
  date +%s.%N >> "$w/progress"
  sleep 1
done
touch "$w/done"
'
"#,
        work = work.display()
    )
}

/// Seconds between consecutive progress lines, and the span from the first to the last.
fn progress_gaps(text: &str) -> (Vec<f64>, f64) {
    let t: Vec<f64> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    let gaps = t.windows(2).map(|w| w[1] - w[0]).collect();
    let span = t.last().zip(t.first()).map_or(0.0, |(l, f)| l - f);
    (gaps, span)
}

fn ckpt_state(cluster: &Cluster, node: &str, job: &Job) -> String {
    match cluster.agent_job(node, job) {
        Ok(s) => s
            .ckpts
            .iter()
            .find(|c| c.tag == TAG)
            .map(|c| {
                format!(
                    "{} (on hot tier: {}, error: {})",
                    c.state.as_str(),
                    c.on_hot_tier,
                    c.error.as_deref().unwrap_or("-")
                )
            })
            .unwrap_or_else(|| "not committed yet".into()),
        Err(e) => format!("(agent: {e})"),
    }
}

/// One fault phase: the proxy's mode, how long at least, and whether the agent must have met the
/// fault (a made-up reply of that status) before the phase ends.
struct Phase {
    mode: &'static str,
    at_least: Duration,
    must_meet: Option<&'static str>,
}

/// Runs the training job with archive `s3://ckpt-faulty/<user>/<test>-<unique>` while the proxy goes
/// through `phases` (from the commit on), then passes again; checks the job is untouched, the
/// checkpoint stays on the hot tier while unarchived, the MANIFEST appears after recovery, and a
/// restore from the archive gives back the bytes the job wrote.
fn archive_survives(test: &str, phases: &[Phase]) {
    let cluster = Cluster::for_sluice();
    let proxy = FaultProxy::start(&cluster);
    let prefix = format!("{}/{test}-{}", cluster.user, unique());
    let archive = format!("s3://ckpt-faulty/{prefix}");
    let faults: Duration = phases.iter().map(|p| p.at_least).sum();
    // One step a second: the job commits within a few seconds and runs on for about 10 s after the
    // faults (the store's recovery takes under a second), so that it trains all through them.
    let steps = (faults.as_secs() + 12) as u32;

    proxy.set(phases[0].mode);
    let work = cluster.workdir(test);
    let submitted = Instant::now();
    let job = cluster.submit(
        &work,
        &["-N1", &format!("--ckpt-archive={archive}")],
        &training_script(&work, steps),
    );
    let committed = work.join("committed");
    cluster.wait_for(
        "the job to commit its checkpoint",
        Duration::from_secs(90),
        Some(&job),
        || committed.exists(),
    );
    let node = cluster
        .job_field(&job, "BatchHost")
        .expect("a running job has a batch host");
    let ckpt_on_hot = cluster.job_dir(&node, &job).join("ckpt").join(TAG);
    let manifest_key = format!("{TAG}/MANIFEST");
    let in_bucket = || cluster.list_objects("garage", &format!("ckpt-faulty/{prefix}"));
    eprintln!(
        "[{test}] job {} on {node}: checkpoint committed {:.1} s after submission",
        job.id,
        submitted.elapsed().as_secs_f64()
    );

    for phase in phases {
        proxy.set(phase.mode);
        let start = Instant::now();
        let met_before = phase.must_meet.map_or(0, |s| proxy.injected(s));
        let mut states = Vec::new();
        loop {
            let s = ckpt_state(&cluster, &node, &job);
            if states.last() != Some(&s) {
                states.push(s);
            }
            let met = phase
                .must_meet
                .is_none_or(|s| proxy.injected(s) > met_before);
            if start.elapsed() >= phase.at_least && met {
                break;
            }
            assert!(
                start.elapsed() < phase.at_least + Duration::from_secs(60),
                "in mode {}, the agent made no request for {:?} that the proxy could answer {:?}\n{}{}",
                phase.mode,
                start.elapsed(),
                phase.must_meet,
                proxy.log_tail(),
                cluster.evidence(&job)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        // While the store fails, nothing may be published and the checkpoint must stay on the node.
        let keys = in_bucket();
        assert!(
            !keys.contains(&manifest_key),
            "a MANIFEST was published while the store answered {}: {keys:?}\n{}",
            phase.mode,
            proxy.log_tail()
        );
        assert!(
            ckpt_on_hot.join("model.bin").exists() && ckpt_on_hot.join(".metadata").exists(),
            "checkpoint {TAG} left the hot tier of {node} ({}) before it was archived\n{}",
            ckpt_on_hot.display(),
            cluster.evidence(&job)
        );
        eprintln!(
            "[{test}] mode {} for {:.1} s: agent's checkpoint states {states:?}; proxy {}",
            phase.mode,
            start.elapsed().as_secs_f64(),
            proxy.stats()
        );
    }

    proxy.set("pass");
    let recovered = Instant::now();
    let mut keys = Vec::new();
    cluster.wait_for(
        &format!("the MANIFEST of {TAG} in {archive} after the store recovered"),
        ARCHIVE_AFTER_RECOVERY,
        Some(&job),
        || {
            keys = in_bucket();
            keys.contains(&manifest_key)
        },
    );
    eprintln!(
        "[{test}] MANIFEST in Garage {:.1} s after the store recovered; agent: {}; objects: {keys:?}",
        recovered.elapsed().as_secs_f64(),
        ckpt_state(&cluster, &node, &job)
    );

    // The job itself never noticed: it ran to the end, on time, its loop never stalled.
    let end = cluster.assert_completes(
        &job,
        Duration::from_secs(u64::from(steps) + 120),
        "the job, which must not suffer from the store's faults,",
    );
    let progress = std::fs::read_to_string(work.join("progress")).unwrap_or_default();
    let (gaps, span) = progress_gaps(&progress);
    let worst = gaps.iter().cloned().fold(0.0, f64::max);
    assert!(
        work.join("done").exists() && gaps.len() + 1 == steps as usize,
        "the training loop did not run to its end: {} of {steps} steps\n{}",
        gaps.len() + 1,
        cluster.evidence(&job)
    );
    assert!(
        worst < 3.0 && span < f64::from(steps) + 5.0,
        "the training loop stalled while the store failed: longest pause {worst:.1} s, \
         {steps} steps took {span:.1} s"
    );
    eprintln!(
        "[{test}] job {} {} after {:.1} s; {steps} steps in {span:.1} s, longest pause {worst:.2} s",
        job.id,
        end.state,
        submitted.elapsed().as_secs_f64()
    );
    cluster.assert_nodes_return_idle(&job, CLEANUP_TIMEOUT);

    // The bytes in the bucket are the bytes the job wrote: restore them in a new job and compare.
    let written = std::fs::read_to_string(work.join("ckpt.sums")).expect("the job's checksums");
    let rwork = cluster.workdir(&format!("{test}-restore"));
    let restore = cluster.submit(
        &rwork,
        &[
            "-N1",
            &format!("--ckpt-archive={archive}"),
            &format!("--ckpt-restore={TAG}"),
        ],
        &format!(
            "#!/bin/bash\nsrun --ntasks=1 /bin/bash -c 'cd \"$SLUICE_CKPT_DIR/{TAG}\" && {SUMS_CMD} > \"{}/restored.sums\"'\n",
            rwork.display()
        ),
    );
    let rend = cluster.wait_end(&restore, Duration::from_secs(180));
    let restored = std::fs::read_to_string(rwork.join("restored.sums")).unwrap_or_default();
    assert!(
        rend.state == "COMPLETED" && restored == written,
        "restoring {TAG} from {archive} must give back what the job wrote: {}\n{}",
        diff_listings(&written, &restored),
        cluster.evidence(&restore)
    );
    cluster.assert_nodes_return_idle(&restore, CLEANUP_TIMEOUT);
    drop(proxy);
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn faults_throttled_then_unreachable_store_delays_the_archive_not_the_job() {
    // One job through three faults in a row: throttled (503 SlowDown, then 429), then gone
    // altogether (connections refused, open ones reset). One job rather than one per fault: each
    // costs a training job, a restore job and the retries' backoff (about 45 s of the suite).
    // ckpt.rs's ckpt_object_store_outage_delays_archive_not_training has the store go away for
    // longer, across the job's end.
    archive_survives(
        "faults-throttle-outage",
        &[
            Phase {
                mode: "503",
                at_least: Duration::from_secs(8),
                must_meet: Some("503"),
            },
            Phase {
                mode: "429",
                at_least: Duration::from_secs(7),
                must_meet: Some("429"),
            },
            Phase {
                mode: "refuse",
                at_least: Duration::from_secs(8),
                must_meet: None,
            },
        ],
    );
}

/// Stages a small dataset (`files` files) from `s3://ckpt-faulty` with a job on `nodes` nodes while
/// the fault proxy answers in `mode`, and checks what every such failure must be: the job FAILED
/// (`why` it must have), before its script ran, within the stage timeout, and left no node out of
/// service and nothing on a hot tier. Returns the job's output and the dataset's URL, for the test's
/// own checks.
fn stage_in_fails(test: &str, mode: &str, nodes: usize, files: u8, why: &str) -> (String, String) {
    let cluster = Cluster::for_sluice();
    let proxy = FaultProxy::start(&cluster);
    // The dataset exists: what fails is reaching the store, not the user's path.
    let data = cluster.data_dir(test).join("ds");
    std::fs::create_dir_all(&data).unwrap();
    for i in 0..files {
        std::fs::write(data.join(format!("part-{i}.bin")), vec![i; 10_000]).unwrap();
    }
    let prefix = format!("{}/{test}-{}/ds", cluster.user, unique());
    cluster.upload(&data, "garage", &format!("ckpt-faulty/{prefix}"));
    let source = format!("s3://ckpt-faulty/{prefix}");

    proxy.set(mode);
    let work = cluster.workdir(test);
    let (script, ran) = marker_script(&work);
    let started = Instant::now();
    let job = cluster.submit(
        &work,
        &[&format!("-N{nodes}"), &format!("--stage-in=ds={source}")],
        &script,
    );
    let (end, output) = cluster.wait_end_and_report(
        test,
        &job,
        Duration::from_secs(240),
        ("its submission", started),
    );
    let took = started.elapsed();
    eprintln!("[{test}] fault proxy: {}", proxy.stats());
    cluster.assert_ended(&job, &end, "FAILED", why);
    cluster.assert_script_did_not_run(&job, &ran, "stage-in failed");
    // The plugin's stage_timeout is 120 s; a few seconds for Slurm to start and end the job.
    assert!(
        took < Duration::from_secs(135),
        "the job took {took:?} to fail; the stage timeout is 120 s\n{}",
        cluster.evidence(&job)
    );
    cluster.assert_nodes_return_idle(&job, CLEANUP_TIMEOUT);
    cluster.assert_hot_tier_cleaned(&job, CLEANUP_TIMEOUT);
    (output, source)
}

/// Staging from a store that refuses every connection must fail the job — with a message that says
/// which dataset could not be read — before the plugin's stage_timeout (120 s), without running the
/// job script, draining a node or leaving anything on a hot tier.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn faults_stage_in_from_an_unreachable_store_fails_the_job_in_time() {
    let (output, source) = stage_in_fails(
        "faults-nostore",
        "refuse",
        3,
        5,
        "staging from an unreachable store cannot succeed",
    );
    assert!(
        output.contains(&source),
        "the job output must name the dataset that could not be staged ({source}):\n{output}"
    );
    let lower = output.to_lowercase();
    // What the user must learn: the store could not be reached (not that a request failed after
    // some retries, which is the client library's view).
    assert!(
        [
            "refused",
            "unreachable",
            "not reachable",
            "cannot reach",
            "could not reach",
            "cannot connect",
            "could not connect",
        ]
        .iter()
        .any(|w| lower.contains(w)),
        "the job output must say that the store could not be reached:\n{output}"
    );
    assert!(
        !output.contains("<?xml") && !output.contains("<Error>"),
        "the job output passes on a raw store reply:\n{output}"
    );
}

/// Staging from a store that accepts connections but never answers (every response held back for
/// ten minutes) must end at the admin's stage timeout with a message saying so — not hang the job,
/// not drain a node. The agents run with `[stage] timeout = "20s"` here (the harness's 110 s, under
/// the plugin's 120 s, would make this test wait two minutes for the same answer).
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn faults_stage_in_from_a_hung_store_fails_at_the_stage_timeout() {
    let harness_timeout = "timeout = \"110s\"\n";
    let _agents = Cluster::for_sluice().reconfigure_agents("stage-timeout", |text| {
        assert!(
            text.contains(harness_timeout),
            "no {harness_timeout:?} in the agents' config: the harness changed"
        );
        text.replace(harness_timeout, "timeout = \"20s\"\n")
    });
    let started = Instant::now();
    let (output, _) = stage_in_fails(
        "faults-hung",
        "slow=600",
        2,
        1,
        "staging from a store that never answers cannot succeed",
    );
    let lower = output.to_lowercase();
    let cluster = Cluster::get();
    assert!(
        (lower.contains("did not finish") || lower.contains("timed out"))
            && cluster
                .nodes
                .iter()
                .any(|n| output.contains(&format!("node {n}"))),
        "the job output must say that stage-in on a node ran out of time:\n{output}"
    );
    // The agent's timeout ended it, not the plugin's 120 s.
    assert!(
        started.elapsed() < Duration::from_secs(100),
        "the job took {:?} to fail; the agents' stage timeout is 20 s:\n{output}",
        started.elapsed()
    );
}
