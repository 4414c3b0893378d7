//! Archive tiering (issue 14, item 7): with `data_class` in the agent's store profiles, a job's
//! checkpoint data goes to the store in that class while its MANIFEST stays in the default one, and
//! `sluice ckpt list URL` shows the class each checkpoint's data was written with.
//!
//! n1's agent is restarted for the test with the harness's config plus `data_class = "STANDARD_IA"`
//! on the `s3://` profile and `data_class = "Cool"` on the `az://` one (and put back as the harness
//! started it afterwards, pass or fail). A one-node job on n1 writes a checkpoint (one object above
//! the 5 MiB part size, so multipart, and a small one) and commits it; then the test reads what the
//! store says behind the agents' back: Azurite keeps the access tier it was given (Get Blob
//! Properties says `Cool` for the data, `Hot` for the MANIFEST); Garage takes
//! `x-amz-storage-class` and ignores it (a HEAD names no class, i.e. STANDARD), so there the test
//! can only show what sluice recorded and asked for (the request side is
//! `archive/tests/archive_conformance.rs`'s `tiering_garage_s3`, which records it).

use crate::common::*;
use serde_json::Value;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const NODE: &str = "n1";
const JOB_TIMEOUT: Duration = Duration::from_secs(120);
/// Until the committed checkpoint has its MANIFEST (the job's end waits `epilog_wait`, then the
/// agent goes on).
const ARCHIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// n1's agent running with the data classes; the harness's agent again when dropped.
struct TieredAgent<'a> {
    cluster: &'a Cluster,
    original: AgentProcess,
    /// The config the harness started the agents with.
    config: PathBuf,
    tiered: PathBuf,
}

impl<'a> TieredAgent<'a> {
    fn start(cluster: &'a Cluster) -> TieredAgent<'a> {
        let original = cluster.kill_agent(NODE);
        let at = original
            .argv
            .iter()
            .position(|a| a == "--config")
            .unwrap_or_else(|| panic!("n1's agent has no --config: {:?}", original.argv));
        let config = PathBuf::from(&original.argv[at + 1]);
        let text = fs::read_to_string(&config).unwrap();
        let mut tiered_text = String::new();
        let mut set = 0;
        for line in text.lines() {
            tiered_text.push_str(line);
            tiered_text.push('\n');
            // Lower case on purpose: the agent spells the class as the store does.
            let class = match line.trim() {
                "prefix = \"s3://\"" => "standard_ia",
                "prefix = \"az://\"" => "cool",
                _ => continue,
            };
            tiered_text.push_str(&format!("data_class = \"{class}\"\n"));
            set += 1;
        }
        assert_eq!(
            set, 2,
            "the harness's config has one s3:// and one az:// profile:\n{text}"
        );
        let tiered = run_dir().join(format!("sluice-tiering-{}.toml", unique()));
        write_atomically(&tiered, &tiered_text);
        fs::set_permissions(&tiered, fs::Permissions::from_mode(0o600)).unwrap();
        let mut agent = original.clone();
        agent.argv[at + 1] = tiered.display().to_string();
        cluster.start_agent(&agent);
        TieredAgent {
            cluster,
            original,
            config,
            tiered,
        }
    }
}

impl Drop for TieredAgent<'_> {
    fn drop(&mut self) {
        self.cluster.kill_agent(NODE);
        self.cluster.start_agent(&self.original);
        let _ = fs::remove_file(&self.tiered);
    }
}

/// What the store says the class of `key` below `archive` is, read behind the agents' back: the
/// `x-amz-storage-class` of a HEAD on Garage (signed by curl), the access tier of Get Blob
/// Properties (rclone's `Tier`) on Azurite. `None`: the store names none.
fn stored_class(cluster: &Cluster, url: &str, key: &str) -> Option<String> {
    if let Some(path) = url.strip_prefix("s3://") {
        sluice_e2e::storage_class::s3(
            &format!("{}/{path}/{key}", cluster.var("SLUICE_TEST_S3_ENDPOINT")),
            cluster.var("SLUICE_TEST_S3_REGION"),
            cluster.var("SLUICE_TEST_S3_KEY_ID"),
            cluster.var("SLUICE_TEST_S3_SECRET"),
        )
    } else {
        let path = url
            .strip_prefix("az://")
            .expect("an s3:// or az:// archive");
        let out = cluster.rclone(&["lsjson", "--stat", &format!("azurite:{path}/{key}")]);
        assert!(
            out.status.success(),
            "rclone lsjson --stat {path}/{key}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["Tier"]
            .as_str()
            .filter(|t| !t.is_empty())
            .map(String::from)
    }
}

/// A one-node job on n1 that writes checkpoint `step1` and commits it, archived to `archive`.
fn archive_one(cluster: &Cluster, archive: &Archive, test: &str) -> Job {
    let work = cluster.workdir(test);
    let script = format!(
        "#!/bin/bash\nset -eu\nc=\"$SLUICE_CKPT_DIR/step1\"\nmkdir -p \"$c\"\n\
         # 7 MiB of noise: stored above the 5 MiB part size, so a multipart upload\n\
         head -c 7340032 /dev/urandom > \"$c/model.bin\"\n\
         echo '{{\"lr\": 0.1}}' > \"$c/config.json\"\n\
         {} ckpt commit step1\n",
        cluster.user_cli().display()
    );
    let archive_opt = format!("--ckpt-archive={}", archive.url);
    let job = cluster.submit(
        &work,
        &["-N1", &format!("--nodelist={NODE}"), &archive_opt],
        &script,
    );
    cluster.assert_completes(&job, JOB_TIMEOUT, "the checkpointing job");
    cluster.wait_for(
        &format!("{}/step1/MANIFEST", archive.url),
        ARCHIVE_TIMEOUT,
        Some(&job),
        || archive.manifests(cluster).contains("step1"),
    );
    job
}

/// `sluice ckpt list URL` as an admin, with the harness's own config (no data classes in it: the
/// class comes from the MANIFEST): the table and `--json`.
fn ckpt_list(agent: &TieredAgent, url: &str) -> (String, Value) {
    let list = |json: bool| {
        let mut cmd = Command::new(built_cli());
        cmd.args(["ckpt", "list", url, "--config"])
            .arg(&agent.config);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "sluice ckpt list {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let text = list(false);
    let json = serde_json::from_str(&list(true)).unwrap();
    (text, json)
}

fn tiering(backend: Backend, name: &str, class: &str, honoured: bool) {
    let cluster = Cluster::for_sluice();
    let agent = TieredAgent::start(&cluster);
    let archive = Archive::new(&cluster, backend, name);
    let job = archive_one(&cluster, &archive, name);
    let evidence = || cluster.evidence(&job);

    // What the user sees: the class of the checkpoint's data, from its MANIFEST.
    let (text, json) = ckpt_list(&agent, &archive.url);
    let header = text
        .lines()
        .find(|l| l.starts_with("TAG "))
        .unwrap_or_else(|| panic!("{text}"));
    let row = text
        .lines()
        .find(|l| l.starts_with("step1 "))
        .unwrap_or_else(|| panic!("{text}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    let column = header
        .split_whitespace()
        .position(|h| h == "CLASS")
        .unwrap_or_else(|| panic!("no CLASS column:\n{text}"));
    // SIZE and STORED take two words each ("7.0 MiB").
    assert_eq!(cells[1], "complete", "{text}\n{}", evidence());
    assert_eq!(cells[column + 2], class, "{text}");
    assert_eq!(
        json["ckpts"][0]["data_classes"],
        serde_json::json!([class]),
        "{json}"
    );
    let manifest = archive
        .check_manifest(&cluster, "step1")
        .unwrap_or_else(|e| panic!("{e}\n{}", evidence()));
    for f in manifest["files"].as_array().unwrap() {
        assert_eq!(f["storage_class"], class, "{f}");
    }

    // What the store made of it.
    let data: Vec<(String, Option<String>)> = ["model.bin", "config.json"]
        .iter()
        .map(|f| {
            let key = format!("step1/data/{f}");
            let got = stored_class(&cluster, &archive.url, &key);
            (key, got)
        })
        .collect();
    let manifest_class = stored_class(&cluster, &archive.url, "step1/MANIFEST");
    let part_class = stored_class(&cluster, &archive.url, &format!("step1/parts/{NODE}.json"));
    eprintln!("{name}: data {data:?}, MANIFEST {manifest_class:?}, part {part_class:?}");
    if honoured {
        for (key, got) in &data {
            assert_eq!(got.as_deref(), Some(class), "{key}");
        }
        // Azure names the default tier: Hot.
        assert_eq!(manifest_class.as_deref(), Some("Hot"), "MANIFEST");
        assert_eq!(part_class.as_deref(), Some("Hot"), "part manifest");
    } else {
        // Garage: every object is STANDARD whatever was asked (no x-amz-storage-class at all).
        // Should it start keeping classes, docs/admin-guide.md's "Archive tiering" must say so.
        for (key, got) in data.iter().chain([
            &("MANIFEST".to_string(), manifest_class.clone()),
            &("part".to_string(), part_class.clone()),
        ]) {
            assert_eq!(got.as_deref(), None, "{key}: Garage now reports a class");
        }
    }
    drop(agent);
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn tiering_garage_records_the_class_it_asks_for() {
    tiering(Backend::Garage, "tiering-garage", "STANDARD_IA", false);
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn tiering_azurite_keeps_data_cool_and_manifests_hot() {
    tiering(Backend::Azurite, "tiering-azurite", "Cool", true);
}
