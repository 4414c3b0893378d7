//! A malformed sluice option is refused when the user types it — by sbatch and by srun — with a
//! message that says what is wrong, and no job is created. (The plugin validates in the allocator
//! and local contexts: the table in spank-plugin/src/callbacks.rs.)

use crate::common::*;

/// (arguments, what stderr must say). Each case also has to name the option it complains about.
fn bad_cases() -> Vec<(Vec<&'static str>, &'static str, &'static str)> {
    vec![
        (
            vec!["--stage-in=ftp://host/data"],
            "--stage-in",
            "unknown URL scheme 'ftp://'",
        ),
        (vec!["--stage-in=data/train"], "--stage-in", "relative path"),
        (
            vec!["--stage-in==s3://datasets/train"],
            "--stage-in",
            "empty dataset NAME",
        ),
        (
            vec!["--stage-in=a=/srv/one,a=/srv/two"],
            "--stage-in",
            "used twice",
        ),
        // The same default NAME from two separate --stage-in options.
        (
            vec![
                "--stage-in=/srv/one/train",
                "--stage-in=s3://datasets/train",
            ],
            "--stage-in",
            "used twice",
        ),
        (vec!["--ckpt-keep=two"], "--ckpt-keep", "not a number"),
        (
            vec!["--ckpt-tier=ram", "--ckpt-replicas=4"],
            "--ckpt-replicas",
            "not a number from 0 to 3",
        ),
        (
            vec!["--stage-tier=nvme"],
            "--stage-tier",
            "unknown tier 'nvme'",
        ),
        (
            vec!["--stage-mode=stripe"],
            "--stage-mode",
            "unknown mode 'stripe'",
        ),
        (
            vec!["--stage-in=ds.shard.json=s3://datasets/train"],
            "--stage-in",
            "kept for shard manifests",
        ),
    ]
}

#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn sbatch_refuses_bad_options_with_a_helpful_message() {
    let cluster = Cluster::for_sluice();
    let work = cluster.workdir("bad-options");
    let mut failures = Vec::new();
    for (i, (args, option, mut needle)) in bad_cases().into_iter().enumerate() {
        // A plugin of the previous release knows nothing of this tree's newer options: sbatch
        // itself refuses them.
        if plugin_is_previous()
            && OPTIONS_SINCE_PREVIOUS
                .iter()
                .any(|o| option == format!("--{o}"))
        {
            needle = "unrecognized option";
        }
        let name = format!("e2e-bad-{}-{i}", unique());
        let job_name = format!("--job-name={name}");
        let mut all = vec!["-N1", "--output=/dev/null", job_name.as_str()];
        all.extend(args.iter().copied());
        let sub = cluster.sbatch(&work, &all, "#!/bin/bash\ntrue\n");
        let created = cluster.jobs_named(&name);
        if sub.success || !sub.stdout.trim().is_empty() || created != 0 {
            failures.push(format!(
                "{args:?}: accepted (exit ok: {}, stdout {:?}, jobs created: {created})",
                sub.success, sub.stdout
            ));
        } else if !sub.stderr.contains(needle) || !sub.stderr.contains(option) {
            failures.push(format!(
                "{args:?}: refused, but stderr does not say {option:?} and {needle:?}:\n{}",
                sub.stderr
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "bad options not refused as they should be:\n{}",
        failures.join("\n")
    );
}

/// srun runs the plugin in the local context: the same mistake typed at srun is refused the same way.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn srun_refuses_bad_options_with_a_helpful_message() {
    let cluster = Cluster::for_sluice();
    let work = cluster.workdir("bad-srun");
    let name = format!("e2e-bad-srun-{}", unique());
    let job_name = format!("--job-name={name}");
    let out = cluster.as_user(
        &work,
        "srun",
        &["-N1", &job_name, "--stage-in=ftp://host/data", "true"],
        None,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "srun accepted --stage-in=ftp://host/data; stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("unknown URL scheme 'ftp://'") && stderr.contains("--stage-in"),
        "srun refused --stage-in=ftp://host/data without saying why:\n{stderr}"
    );
    assert_eq!(
        cluster.jobs_named(&name),
        0,
        "srun created a job although it refused the option"
    );
}

/// The options are documented in `--help`, so users can find them.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn sbatch_help_lists_the_sluice_options() {
    let cluster = Cluster::for_sluice();
    let out = cluster.as_user(&cluster.user_home(), "sbatch", &["--help"], None);
    let help = String::from_utf8_lossy(&out.stdout);
    let newer = |o: &&&str| plugin_is_previous() && OPTIONS_SINCE_PREVIOUS.contains(o);
    let missing: Vec<_> = sluice_proto::options::names::ALL
        .iter()
        .filter(|o| !newer(o) && !help.contains(&format!("--{o}")))
        .collect();
    assert!(
        missing.is_empty(),
        "sbatch --help does not list {missing:?}:\n{help}"
    );
    let listed: Vec<_> = sluice_proto::options::names::ALL
        .iter()
        .filter(|o| newer(o) && help.contains(&format!("--{o}")))
        .collect();
    assert!(
        listed.is_empty(),
        "the previous release's plugin lists {listed:?}, which it does not know:\n{help}"
    );
}
