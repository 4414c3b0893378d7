//! Option values are user input all the way to root (docs/SECURITY.md, "Input limits"):
//!
//! - oversized, control-character and traversal values are refused by sbatch itself (the plugin's
//!   submit-time check), with a message naming the option, and no job is created;
//! - the submit-time check is only for friendliness: a user can bypass it. Here the user points
//!   sbatch at a slurm.conf copy of their own whose plugstack adds a tiny SPANK plugin that puts any
//!   value into `SPANK_SLUICE_STAGE_IN` (exactly what job_prolog, as root, forwards to the agent).
//!   The agent re-validates as root: the job fails with the agent's message, nothing is staged, and
//!   the node stays in service.

use crate::common::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const JOB_TIMEOUT: Duration = Duration::from_secs(180);

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_oversized_and_control_character_options_are_refused_at_submit() {
    let cluster = Cluster::for_sluice();
    let work = cluster.workdir("sec-options");
    let long = format!("--stage-in=/{}", "a".repeat(5000));
    let huge = format!("--stage-in=/{}", "b".repeat(100_000));
    let many = format!(
        "--stage-in={}",
        (0..65)
            .map(|i| format!("d{i}=/data/{i}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    let cases: Vec<(String, &str, &str)> = vec![
        (long, "--stage-in", "at most 4096"),
        (huge, "--stage-in", "at most 4096"),
        (many, "--stage-in", "more than 64 sources"),
        (
            "--stage-in=/data/a\nb".into(),
            "--stage-in",
            "control character",
        ),
        (
            "--stage-in=/data/\x1b[31mred".into(),
            "--stage-in",
            "control character",
        ),
        (
            "--stage-in=/data/../etc/shadow".into(),
            "--stage-in",
            "'..' is not allowed",
        ),
        (
            "--stage-in=s3://datasets/a/../../x".into(),
            "--stage-in",
            "'..' segments",
        ),
        (
            "--stage-in=..=/data/x".into(),
            "--stage-in",
            "is not allowed",
        ),
        (
            "--ckpt-archive=s3://ckpt/x/../y".into(),
            "--ckpt-archive",
            "'..' segments",
        ),
        (
            "--ckpt-archive=/lustre/a\rb".into(),
            "--ckpt-archive",
            "control character",
        ),
        (
            "--ckpt-restore=../../etc".into(),
            "--ckpt-restore",
            "not a valid checkpoint tag",
        ),
        (
            "--ckpt-restore=.hidden".into(),
            "--ckpt-restore",
            "not a valid checkpoint tag",
        ),
        ("--ckpt-keep=0".into(), "--ckpt-keep", "out of range"),
        (
            "--ckpt-keep=99999999999".into(),
            "--ckpt-keep",
            "not a number",
        ),
    ];
    let mut failures = Vec::new();
    for (i, (arg, option, needle)) in cases.iter().enumerate() {
        let name = format!("e2e-sec-opt-{}-{i}", unique());
        let job_name = format!("--job-name={name}");
        let sub = cluster.sbatch(
            &work,
            &["-N1", "--output=/dev/null", &job_name, arg],
            "#!/bin/bash\ntrue\n",
        );
        let shown: String = arg.chars().take(60).collect();
        let created = cluster.jobs_named(&name);
        if sub.success || created != 0 {
            failures.push(format!("{shown:?}: accepted (jobs created: {created})"));
        } else if !sub.stderr.contains(option) || !sub.stderr.contains(needle) {
            failures.push(format!(
                "{shown:?}: refused, but stderr does not say {option:?} and {needle:?}: {}",
                sub.stderr.chars().take(500).collect::<String>()
            ));
        } else if let Some(line) = sub
            .stderr
            .lines()
            .find(|l| l.contains(&format!("{option}: ")))
            .filter(|l| l.len() > 1000)
        {
            // Slurm itself repeats the whole value ("Invalid --stage-in argument: ..."); sluice's
            // own message must stay short whatever the value's size.
            failures.push(format!(
                "{shown:?}: sluice's refusal is {} bytes long: {}...",
                line.len(),
                line.chars().take(200).collect::<String>()
            ));
        } else {
            let line = sub
                .stderr
                .lines()
                .find(|l| l.contains(&format!("{option}: ")));
            eprintln!(
                "{shown:?}: refused: {}",
                line.unwrap_or("").chars().take(300).collect::<String>()
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A SPANK plugin of the user's own: in sbatch (the allocator context) it copies `$EVIL_STAGE_IN`
/// into the job-control environment as `SLUICE_STAGE_IN`, which Slurm hands to job_prolog as
/// `SPANK_SLUICE_STAGE_IN`, bypassing sluice's option callback entirely.
const EVIL_PLUGIN: &str = r#"
#include <stdlib.h>
#include <slurm/spank.h>
SPANK_PLUGIN(evil_sluice_test, 1);
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av) {
    const char *v = getenv("EVIL_STAGE_IN");
    if (spank_context() == S_CTX_ALLOCATOR && v)
        spank_job_control_setenv(sp, "SLUICE_STAGE_IN", v, 1);
    return 0;
}
"#;

/// Builds the plugin and a slurm.conf + plugstack.conf pair that loads sluice's plugin as usual plus
/// the user's. Returns the slurm.conf path (what the user sets SLURM_CONF to).
fn user_slurm_conf(cluster: &Cluster) -> PathBuf {
    let dir = PathBuf::from(cluster.var("SLUICE_TEST_ROOT")).join(format!("e2e-evil-{}", unique()));
    fs::create_dir_all(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(dir.join("evil.c"), EVIL_PLUGIN).unwrap();
    let so = dir.join("evil.so");
    let cc = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(dir.join("evil.c"))
        .output()
        .expect("cc");
    assert!(
        cc.status.success(),
        "cannot build the test SPANK plugin: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let conf_dir = Path::new("/etc/slurm");
    let plugstack = fs::read_to_string(conf_dir.join("plugstack.conf")).unwrap();
    fs::write(
        dir.join("plugstack.conf"),
        format!("{plugstack}\nrequired {}\n", so.display()),
    )
    .unwrap();
    let slurm_conf: String = fs::read_to_string(conf_dir.join("slurm.conf"))
        .unwrap()
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("PlugStackConfig=") {
                format!("PlugStackConfig={}", dir.join("plugstack.conf").display())
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    fs::write(dir.join("slurm.conf"), slurm_conf + "\n").unwrap();
    for f in ["evil.so", "plugstack.conf", "slurm.conf"] {
        fs::set_permissions(dir.join(f), fs::Permissions::from_mode(0o644)).unwrap();
    }
    dir.join("slurm.conf")
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn security_stage_in_smuggled_past_the_submit_check_is_refused_by_the_agent() {
    let cluster = Cluster::for_sluice();
    let conf = user_slurm_conf(&cluster);
    let work = cluster.workdir("sec-smuggle");
    // (value smuggled into SPANK_SLUICE_STAGE_IN, what the agent's refusal says)
    let cases = [
        ("x=/var/lib/../../root", "'..' is not allowed"),
        ("y=/etc/\x1b]0;pwned\x07", "control character"),
        (&*format!("z=/{}", "c".repeat(6000)), "at most 4096"),
    ]
    .map(|(v, n)| (v.to_string(), n));
    let mut failures = Vec::new();
    for (value, needle) in &cases {
        let shown: String = value.escape_debug().take(50).collect();
        let out_file = format!("{}/job-%j.out", work.display());
        let conf_var = format!("SLURM_CONF={}", conf.display());
        let evil_var = format!("EVIL_STAGE_IN={value}");
        let args = [
            conf_var.as_str(),
            evil_var.as_str(),
            "sbatch",
            "--parsable",
            "-N1",
            "--output",
            out_file.as_str(),
            // A valid sluice option, so that the tasks ask the agent before they run.
            "--ckpt-keep=2",
        ];
        let sub = cluster.as_user(&work, "env", &args, Some("#!/bin/bash\necho task ran\n"));
        let stdout = String::from_utf8_lossy(&sub.stdout);
        let Some(id) = stdout.trim().split(';').next().and_then(|s| s.parse().ok()) else {
            failures.push(format!(
                "{shown}: sbatch with the user's plugstack failed: {}",
                String::from_utf8_lossy(&sub.stderr)
            ));
            continue;
        };
        let job = Job {
            id,
            output: work.join(format!("job-{id}.out")),
            submit_stderr: String::from_utf8_lossy(&sub.stderr).into_owned(),
        };
        let end = cluster.wait_end(&job, JOB_TIMEOUT);
        let output = job.output_text();
        if end.state != "FAILED"
            || !output.contains("invalid sluice option: --stage-in")
            || !output.contains(needle)
            || output.contains("task ran")
        {
            failures.push(format!(
                "{shown}: the agent did not refuse the smuggled value as expected ({})\n{}",
                end.state,
                cluster.evidence(&job)
            ));
        }
        cluster.assert_job_left_nothing(&job, Duration::from_secs(60));
    }
    let _ = fs::remove_dir_all(conf.parent().unwrap());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
