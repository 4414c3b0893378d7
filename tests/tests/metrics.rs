//! Metrics as a site's monitoring sees them: the harness's real Prometheus (Debian's package,
//! started by `cluster.sh up` with a 1 s scrape interval) scrapes the three agents' `[metrics]`
//! endpoints, and a query to its HTTP API shows the bytes a job staged — on each node, and summed
//! over the agents.

use crate::common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// Scrapes come every second; an agent counts a job's bytes when its set-up ends, before its
/// tasks start. Generous for a loaded 2-core machine, but bounded.
const SCRAPE_WAIT: Duration = Duration::from_secs(60);

/// One series of a query's result: its labels and its value.
type Series = (BTreeMap<String, String>, f64);

/// `GET /api/v1/query?query=PROMQL` on the harness's Prometheus, as a dashboard asks it: the
/// instant vector's series.
fn query(cluster: &Cluster, promql: &str) -> Vec<Series> {
    let url = format!("{}/api/v1/query", cluster.var("SLUICE_TEST_PROMETHEUS_URL"));
    let out = run(Command::new("curl").args([
        "-fsS",
        "--max-time",
        "10",
        &url,
        "--data-urlencode",
        &format!("query={promql}"),
    ]));
    let v: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("Prometheus answered {promql:?} with no JSON ({e}): {out}"));
    assert_eq!(v["status"], "success", "query {promql:?}: {out}");
    assert_eq!(v["data"]["resultType"], "vector", "query {promql:?}: {out}");
    v["data"]["result"]
        .as_array()
        .expect("a result list")
        .iter()
        .map(|s| {
            let labels = s["metric"]
                .as_object()
                .expect("labels")
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect();
            let value = s["value"][1]
                .as_str()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("query {promql:?}: no value in {s}"));
            (labels, value)
        })
        .collect()
}

/// A query's value per `node` label (the harness labels each agent's target with its node).
fn per_node(cluster: &Cluster, promql: &str) -> BTreeMap<String, f64> {
    query(cluster, promql)
        .into_iter()
        .map(|(labels, v)| (labels.get("node").cloned().unwrap_or_default(), v))
        .collect()
}

/// `curl -sS URL`, its output or why there is none: for failure messages.
fn curl(url: &str) -> String {
    Command::new("curl")
        .args(["-sS", "--max-time", "10", url])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| e.to_string())
}

/// What a reader of a failed test needs: Prometheus's view of its targets and each agent's own
/// `/metrics` lines about staging.
fn metrics_evidence(cluster: &Cluster) -> String {
    let prometheus = cluster.var("SLUICE_TEST_PROMETHEUS_URL");
    let mut s = format!(
        "\n----- Prometheus targets -----\n{}\n",
        curl(&format!("{prometheus}/api/v1/targets"))
    );
    for entry in cluster.var("SLUICE_TEST_METRICS_ADDRS").split_whitespace() {
        let (node, addr) = entry.split_once('=').expect("node=addr");
        let scrape = curl(&format!("http://{addr}/metrics"));
        let staged: Vec<&str> = scrape
            .lines()
            .filter(|l| l.starts_with("sluice_stage_") && !l.contains("_bucket"))
            .collect();
        s += &format!(
            "\n----- {node}: http://{addr}/metrics (staging) -----\n{}\n",
            staged.join("\n")
        );
    }
    s
}

/// Bytes and files under `dir`, as `find -type f` counts them.
fn size_of_tree(dir: &Path) -> (f64, f64) {
    let out = run(Command::new("find")
        .arg(dir)
        .args(["-type", "f", "-printf", "%s\n"]));
    let sizes: Vec<u64> = out.lines().map(|l| l.parse().unwrap()).collect();
    (sizes.iter().sum::<u64>() as f64, sizes.len() as f64)
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn prometheus_scrapes_the_three_agents_and_sees_the_bytes_a_job_staged() {
    let cluster = Cluster::for_sluice();
    let nodes: Vec<String> = cluster.nodes.clone();

    // Prometheus scrapes every agent, and each says which sluice it is.
    let mut up = BTreeMap::new();
    cluster.wait_for(
        "Prometheus to scrape all three agents successfully",
        SCRAPE_WAIT,
        None,
        || {
            up = per_node(&cluster, "up{job=\"sluice\"}");
            up.keys().cloned().collect::<Vec<_>>() == nodes && up.values().all(|v| *v == 1.0)
        },
    );
    let built = per_node(&cluster, "sluice_build_info{protocol=\"1\"}");
    assert_eq!(
        built.keys().cloned().collect::<Vec<_>>(),
        nodes,
        "sluice_build_info per agent{}",
        metrics_evidence(&cluster)
    );

    // The README's hot-tier alert compares series of one target: one ratio per agent, a fraction.
    let ratio = "sluice_hot_tier_used_bytes / sluice_hot_tier_capacity_bytes";
    let fill = per_node(&cluster, ratio);
    assert!(
        fill.keys().cloned().collect::<Vec<_>>() == nodes
            && fill.values().all(|f| *f > 0.0 && *f <= 1.0),
        "{ratio}: {fill:?}{}",
        metrics_evidence(&cluster)
    );
    let above = format!("{ratio} > bool sluice_hot_tier_high_water_ratio");
    assert_eq!(per_node(&cluster, &above).len(), nodes.len(), "{above}");

    // Where the counters stand before the job (earlier tests staged on the same agents).
    let bytes = "sluice_stage_bytes_total{job=\"sluice\",source=\"posix\"}";
    let files = "sluice_stage_files_total{job=\"sluice\",source=\"posix\"}";
    let bytes_before = per_node(&cluster, bytes);
    let files_before = per_node(&cluster, files);
    assert_eq!(
        bytes_before.keys().cloned().collect::<Vec<_>>(),
        nodes,
        "every agent exports its posix staged bytes, 0 before anything was staged{}",
        metrics_evidence(&cluster)
    );

    // A 3-node job stages a POSIX dataset (replicated: every node gets all of it).
    let ds = cluster.dataset("metrics", false);
    let (ds_bytes, ds_files) = size_of_tree(&ds);
    let work = cluster.workdir("metrics");
    let script = "#!/bin/bash\nsrun --ntasks-per-node=1 test -f \"$SLUICE_STAGE_DIR/ds/nested/a/sibling.bin\"\n";
    let stage_in = format!("--stage-in=ds={}", ds.display());
    let job = cluster.submit(&work, &["-N3", &stage_in], script);
    cluster.assert_completes(&job, JOB_TIMEOUT, "the staging job");

    // Prometheus's sum over the agents grows by three copies of the dataset.
    let sum_before: f64 = bytes_before.values().sum();
    let want = sum_before + 3.0 * ds_bytes;
    let sum_query = format!("sum({bytes})");
    let mut sum = f64::NAN;
    let start = std::time::Instant::now();
    while start.elapsed() < SCRAPE_WAIT {
        sum = query(&cluster, &sum_query)
            .first()
            .map_or(f64::NAN, |(_, v)| *v);
        if sum == want {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        sum,
        want,
        "Prometheus's {sum_query} after job {} staged {ds_bytes} bytes on each of 3 nodes \
         (it was {sum_before} before){}{}",
        job.id,
        metrics_evidence(&cluster),
        cluster.evidence(&job)
    );
    println!(
        "job {}: {ds_bytes} bytes × 3 nodes; Prometheus: {sum_query} {sum_before} → {sum}",
        job.id
    );

    // Each node staged the whole dataset once: its bytes and its files.
    let bytes_after = per_node(&cluster, bytes);
    let files_after = per_node(&cluster, files);
    for node in &nodes {
        assert_eq!(
            bytes_after[node] - bytes_before[node],
            ds_bytes,
            "bytes staged on {node}{}",
            metrics_evidence(&cluster)
        );
        assert_eq!(
            files_after[node] - files_before[node],
            ds_files,
            "files staged on {node}{}",
            metrics_evidence(&cluster)
        );
    }
}
