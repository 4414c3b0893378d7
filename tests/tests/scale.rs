//! Staging at more nodes than the test cluster has (issue 29): a 16-node job, on a fleet of
//! `sluiced` agents on this machine driven through the plugin's own job protocol without Slurm
//! (`sluice_e2e::fleet`: each node's `JobStart`, `WaitStaged` and `JobEnd` on its socket, as
//! root, as the prolog, `task_init` and the epilog send them). The fleet's origin is the test
//! cluster's Garage, through the fleet's own counting relay.

use crate::common::*;
use sluice_e2e::fleet::{Fleet, FleetSpec, Garage, compare_trees};
use sluice_proto::msg::StageState;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const NODES: usize = 16;
/// A third of them.
const KILLED: [&str; 5] = ["s03", "s06", "s09", "s12", "s15"];
/// The origin's pace, for every node together while the agents are killed: about 17 s to read
/// the dataset (its 64 MiB file and 300 small ones) once.
const PACE: u64 = 4_000_000;

/// A third of a 16-node job's agents are SIGKILLed mid-staging (the origin paced so staging lasts
/// a while). The survivors route around them — the killed nodes' share of the dataset is read
/// from the origin or the other survivors instead — and each ends with the whole dataset, byte for
/// byte, its stage done; what a survivor tells the job's tasks (the notes the plugin prints in the
/// job output) names the nodes it routed around, and those are killed nodes only. The fallback is
/// bounded: the origin serves the dataset once plus at most the killed nodes' share again (each of
/// their units is read again by one survivor, never by every survivor), and is listed once, or
/// twice when the node that listed it for the job is among the killed before every node had it.
#[test]
#[ignore = "needs root and the test cluster's Garage: tests/harness/run-e2e.sh scale::"]
fn scale_survivors_of_a_third_killed_mid_staging_stage_the_whole_dataset() {
    let cluster = Cluster::for_s3();
    let ds = Dataset::of(cluster.dataset("scale-kill", true));
    let prefix = format!("e2e/{}/train", unique());
    cluster.upload(&ds.dir, "garage", &format!("datasets-relayed/{prefix}"));
    let spec = FleetSpec {
        nodes: NODES,
        root: PathBuf::from(cluster.var("SLUICE_TEST_ROOT"))
            .join("e2e")
            .join(format!("fleet-{}", unique())),
        // The binary the harness runs the cluster's agents with.
        sluiced: PathBuf::from(&cluster.agent_process("n1").argv[0]),
        hot_tier_size: NODES as u64 * ds.bytes * 5 / 4 + (256 << 20),
        user: cluster.user.clone(),
        garage: Garage::from_env(|v| cluster.var(v).to_string()),
        log_filter: "info".into(),
    };
    let mut fleet = Fleet::start(&spec).unwrap_or_else(|e| panic!("the fleet: {e}"));
    fleet.relay().set_pace(PACE);
    let nodes = fleet.nodes();
    let options = [
        ("stage-in", format!("train=s3://datasets-relayed/{prefix}")),
        ("stage-mode", "replicate".into()),
    ]
    .map(|(k, v)| (k.to_string(), v));
    let mut job = fleet
        .start_job(&nodes, &options)
        .unwrap_or_else(|e| panic!("{e}"));

    // Mid-staging: the first victim has some of the dataset, far from all of it.
    let mid = |b: u64| b > ds.bytes / 10 && b < ds.bytes / 2;
    let t = Instant::now();
    loop {
        let status = fleet.job_status(KILLED[0], &job);
        if status.is_ok_and(|s| s.stages.first().is_some_and(|p| mid(p.bytes_done))) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{} is not a tenth into the dataset after 120 s:\n{}",
            KILLED[0],
            fleet.log_tail(KILLED[0])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let killed: Vec<String> = KILLED.iter().map(|n| n.to_string()).collect();
    fleet.kill(&killed).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "[scale] killed {killed:?} {:.1} s into the job",
        job.started.elapsed().as_secs_f64()
    );
    // Long enough for the survivors to find the killed nodes gone under the paced origin; the
    // rest of the dataset then comes at full speed.
    std::thread::sleep(Duration::from_secs(3));
    fleet.relay().set_pace(0);

    let staged = job.wait_staged();
    let mut routed_around = BTreeSet::new();
    for s in staged.iter().filter(|s| !killed.contains(&s.node)) {
        let dirs = s.dirs.as_ref().unwrap_or_else(|e| {
            panic!(
                "survivor {} did not stage: {e}\n{}",
                s.node,
                fleet.log_tail(&s.node)
            )
        });
        let copy = Path::new(&dirs.stage_dir).join("train");
        let bytes = compare_trees(&ds.dir, &copy).unwrap_or_else(|e| panic!("{}: {e}", s.node));
        assert_eq!(bytes, ds.bytes, "{}: the bytes compared", s.node);
        let status = fleet
            .job_status(&s.node, &job)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            status.stages.iter().all(|p| p.state == StageState::Done),
            "{}: {:?}",
            s.node,
            status.stages
        );
        let named: BTreeSet<String> = dirs.notes.iter().filter_map(|n| routed(n)).collect();
        assert!(
            named.iter().all(|n| killed.contains(n)),
            "{} routed around a node that was not killed: {:#?}",
            s.node,
            dirs.notes
        );
        eprintln!(
            "[scale] {} staged after {:.1} s, routed around {named:?}",
            s.node,
            s.after.as_secs_f64()
        );
        routed_around.extend(named);
    }
    assert_eq!(
        routed_around,
        killed.iter().cloned().collect::<BTreeSet<_>>(),
        "the killed nodes the survivors' job output names"
    );
    let (served, asked) = (fleet.relay().served(), fleet.relay().requests());
    eprintln!(
        "[scale] with {} of {NODES} agents killed, the origin served {served} bytes ({:.2}x the dataset), {asked:?}",
        killed.len(),
        served as f64 / ds.bytes as f64,
    );
    // Listings, headers and the units a killed node was halfway through: 2 % of the dataset.
    let bound = 1.0 + KILLED.len() as f64 / NODES as f64 + 0.02;
    assert!(
        served as f64 <= ds.bytes as f64 * bound,
        "the origin served {:.3}x the dataset with {} of {NODES} nodes killed (at most {bound:.3}x: \
         each lost unit read again once)",
        served as f64 / ds.bytes as f64,
        KILLED.len()
    );
    let mut sorted = nodes.clone();
    sorted.sort();
    let lister = &sorted[sluice_peer::owner_of("\0listing/train", &sorted)];
    let passes = if killed.contains(lister) {
        1..=2
    } else {
        1..=1
    };
    assert!(
        passes.contains(&asked.lists) && passes.contains(&asked.heads),
        "the origin was listed {} times and asked {} HEADs; the job's lister {lister} {} killed",
        asked.lists,
        asked.heads,
        if killed.contains(lister) {
            "was"
        } else {
            "was not"
        }
    );
    fleet.end_job(&job).unwrap_or_else(|e| panic!("{e}"));
}

/// The node a job-output note says this node routed around (`peer transfers: node sNN's agent
/// could not be used (...)`), if it says so.
fn routed(note: &str) -> Option<String> {
    let rest = note.strip_prefix("peer transfers: node ")?;
    let (node, _) = rest.split_once("'s agent could not be used")?;
    Some(node.to_string())
}
