use super::*;
use std::io::Error;

const CONFIG: &str = r#"
[agent]
socket = "/run/sluice/%n.sock"
state_dir = "/var/lib/sluice/%n/state"
[hot_tier]
root = "/var/lib/sluice/%n/hot"
[ckpt]
default_archive = "s3://ckpt/{user}/default"
[[ckpt.allow]]
prefix = "s3://ckpt/{user}/"
[[stage.allow]]
prefix = "s3://datasets/"
[[stage.allow]]
prefix = "az://data/team/{user}/x"
[[store]]
prefix = "s3://"
endpoint = "http://127.0.0.1:3900"
[[store]]
prefix = "s3://special"
[[store]]
prefix = "az://"
use_emulator = true
[[store]]
prefix = "gs://"
"#;

fn facts(uid: u32, mode: u32) -> io::Result<FileFacts> {
    Ok(FileFacts {
        uid,
        gid: uid,
        mode,
    })
}

fn config(meta: io::Result<FileFacts>, text: io::Result<String>, root: bool) -> (Finding, bool) {
    let (f, cfg) = judge_config(Path::new("/etc/sluice/sluice.toml"), meta, text, root, "n1");
    (f, cfg.is_some())
}

/// `f` is a failure whose detail says `detail` and whose fix is exactly `fix`.
#[track_caller]
fn assert_fails_with(f: &Finding, detail: &str, fix: &str) {
    assert_eq!(f.status, Status::Fail, "{f:?}");
    assert!(f.detail.contains(detail), "{f:?}");
    assert_eq!(f.fix.as_deref(), Some(fix), "{f:?}");
}

#[test]
fn config_root_owned_0600_and_valid_passes() {
    let (f, cfg) = config(facts(0, 0o600), Ok(CONFIG.into()), true);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert!(cfg);
    assert_eq!(
        f.detail,
        "/etc/sluice/sluice.toml: root-owned, mode 0600; valid for node n1"
    );
}

#[test]
fn config_readable_by_others_or_not_root_owned_fails_with_chmod_and_chown() {
    let (f, cfg) = config(facts(0, 0o644), Ok(CONFIG.into()), true);
    assert_fails_with(&f, "mode 0644", "chmod 600 /etc/sluice/sluice.toml");
    assert!(cfg, "the other checks still get the config");

    let (f, _) = config(facts(1000, 0o640), Ok(CONFIG.into()), true);
    assert_eq!(f.status, Status::Fail);
    let fix = f.fix.unwrap();
    assert!(
        fix.contains("chown root:root /etc/sluice/sluice.toml"),
        "{fix}"
    );
    assert!(fix.contains("chmod 600"), "{fix}");
    // Group bits alone count too.
    assert_eq!(
        config(facts(0, 0o620), Ok(CONFIG.into()), true).0.status,
        Status::Fail
    );
}

#[test]
fn config_that_does_not_parse_fails_with_the_agents_error() {
    let (f, cfg) = config(facts(0, 0o600), Ok("[agent]\nsocket = 1\n".into()), true);
    assert_eq!(f.status, Status::Fail);
    assert!(!cfg);
    assert!(f.detail.contains("invalid:"), "{f:?}");
    assert!(f.fix.unwrap().contains("sluice config check"));
    let relative = CONFIG.replace("/var/lib/sluice/%n/hot", "hot");
    let (f, _) = config(facts(0, 0o600), Ok(relative), true);
    assert!(
        f.detail.contains("hot_tier.root must be an absolute path"),
        "{f:?}"
    );
}

#[test]
fn config_missing_fails_and_unreadable_as_user_says_root_is_needed() {
    let gone = Err(Error::from(ErrorKind::NotFound));
    let (f, _) = config(gone, Err(Error::from(ErrorKind::NotFound)), true);
    assert_eq!(f.status, Status::Fail);
    assert!(f.detail.contains("does not exist"));
    assert!(f.fix.unwrap().contains("slurm-conf/sluice.toml"));

    fn denied<T>() -> io::Result<T> {
        Err(Error::from(ErrorKind::PermissionDenied))
    }
    let (f, _) = config(facts(0, 0o600), denied(), false);
    assert_eq!(f.status, Status::Warn, "{f:?}");
    assert!(f.detail.contains("doctor needs root"), "{f:?}");
    // Stat refused too (a 0700 directory).
    assert_eq!(config(denied(), denied(), false).0.status, Status::Warn);
    // A mode problem seen without reading it is still a failure.
    let (f, _) = config(facts(1000, 0o600), denied(), false);
    assert_eq!(f.status, Status::Fail);
}

#[test]
fn agent_refused_fails_with_start_sluiced() {
    let p = Path::new("/run/sluice/n1.sock");
    let refused = ClientError::Connect {
        path: p.into(),
        source: Error::from(ErrorKind::ConnectionRefused),
    };
    let f = judge_agent(p, Err(refused), Duration::from_secs(1));
    assert_fails_with(
        &f,
        "/run/sluice/n1.sock",
        "start sluiced (systemctl start sluiced)",
    );
    let missing = ClientError::Connect {
        path: p.into(),
        source: Error::from(ErrorKind::NotFound),
    };
    assert_eq!(
        judge_agent(p, Err(missing), Duration::from_secs(1))
            .fix
            .as_deref(),
        Some("start sluiced (systemctl start sluiced)")
    );
}

fn mode_probe(o_direct: io::Result<()>, total: u64, avail: u64) -> Finding {
    let facts = HotTierFacts {
        mount: Some(("ext4".into(), "/".into())),
        space: Some((total, avail)),
        o_direct,
    };
    judge_hot_tier(Path::new("/hot"), Ok(facts), 90, true)
}

#[test]
fn hot_tier_warns_above_high_water_and_without_o_direct() {
    let ok = mode_probe(Ok(()), 100 << 30, 50 << 30);
    assert_eq!(ok.status, Status::Pass, "{ok:?}");
    assert!(
        ok.detail.contains("on ext4")
            && ok.detail.contains("50% used")
            && ok.detail.contains("O_DIRECT works"),
        "{ok:?}"
    );
    let full = mode_probe(Ok(()), 100 << 30, 5 << 30);
    assert_eq!(full.status, Status::Warn);
    assert!(full.detail.contains("95% used, high water 90%"), "{full:?}");
    let einval = mode_probe(Err(Error::from_raw_os_error(22)), 100 << 30, 50 << 30);
    assert_eq!(einval.status, Status::Warn);
    assert!(
        einval.detail.contains("falls back to buffered writes"),
        "{einval:?}"
    );
    let gone = judge_hot_tier(
        Path::new("/hot"),
        Err(Error::from(ErrorKind::NotFound)),
        90,
        true,
    );
    assert_eq!(gone.status, Status::Fail);
    assert!(gone.fix.unwrap().contains("install -d"));
}

#[test]
fn mount_is_the_longest_mount_point_above() {
    let mounts = "/dev/vda / ext4 rw 0 0\ntmpfs /run tmpfs rw 0 0\n/dev/nvme0n1 /local\\040disk xfs rw 0 0\n";
    assert_eq!(
        mount_of(mounts, Path::new("/var/lib/x")),
        Some(("ext4".into(), "/".into()))
    );
    assert_eq!(
        mount_of(mounts, Path::new("/run/sluice")),
        Some(("tmpfs".into(), "/run".into()))
    );
    assert_eq!(
        mount_of(mounts, Path::new("/local disk/hot")),
        Some(("xfs".into(), "/local disk".into()))
    );
    // /running is not under /run.
    assert_eq!(mount_of(mounts, Path::new("/running")).unwrap().0, "ext4");
}

#[test]
fn stores_are_probed_through_the_buckets_they_serve() {
    let cfg = Config::parse(CONFIG, "n1", sluice_archive::upload_memory).unwrap();
    let t = targets(&cfg);
    let by: Vec<(&str, Vec<String>)> = t
        .iter()
        .map(|(p, ts)| (p.prefix.as_str(), ts.iter().map(Target::url).collect()))
        .collect();
    assert_eq!(
        by,
        vec![
            (
                "s3://",
                vec!["s3://datasets/".to_string(), "s3://ckpt/".to_string()]
            ),
            ("s3://special", vec!["s3://special/".to_string()]),
            ("az://", vec!["az://data/team/".to_string()]),
            ("gs://", vec![]),
        ]
    );
    assert_eq!(target_of("s3://{user}-bucket/"), None);
    assert_eq!(target_of("file:///x"), None);
}

#[test]
fn store_findings_name_the_profile_and_the_error_kind() {
    let profile = StoreProfile {
        prefix: "s3://".into(),
        endpoint: Some("http://127.0.0.1:3900".into()),
        ..Default::default()
    };
    let ok = judge_store(&profile, &[("s3://ckpt/".into(), Ok(()))]);
    assert_eq!(ok.status, Status::Pass);
    assert_eq!(ok.check, "store s3://");
    let not_found = object_store::Error::NotFound {
        path: "x".into(),
        source: "gone".into(),
    };
    let f = judge_store(
        &profile,
        &[
            ("s3://ckpt/".into(), Ok(())),
            ("s3://nope/".into(), Err(Probe::Store(not_found))),
        ],
    );
    assert_eq!(f.status, Status::Fail);
    assert!(
        f.detail.starts_with("listing s3://nope/: not found:"),
        "{f:?}"
    );
    assert!(f.fix.unwrap().contains("profile s3://"));
    let denied = object_store::Error::PermissionDenied {
        path: "x".into(),
        source: "no".into(),
    };
    let f = judge_store(
        &profile,
        &[("s3://ckpt/".into(), Err(Probe::Store(denied)))],
    );
    assert!(f.detail.contains(": denied:"), "{f:?}");
    assert!(f.fix.unwrap().contains("credentials of profile s3://"));
    let f = judge_store(
        &profile,
        &[(
            "s3://ckpt/".into(),
            Err(Probe::Timeout(Duration::from_secs(3))),
        )],
    );
    assert!(f.detail.contains("timed out: no answer within 3s"), "{f:?}");
    assert_eq!(judge_store(&profile, &[]).status, Status::Warn);
}

#[test]
fn squeue_invalid_job_id_means_slurmctld_answered() {
    let v = || Ok("slurm-wlm 22.05.8\n".to_string());
    assert_eq!(
        judge_squeue("squeue", v(), Ok(String::new())).status,
        Status::Pass
    );
    let invalid = Err("squeue failed: slurm_load_jobs error: Invalid job id specified".to_string());
    assert_eq!(judge_squeue("squeue", v(), invalid).status, Status::Pass);
    let down = Err(
        "slurm_load_jobs error: Unable to contact slurm controller (connect failure)".to_string(),
    );
    let f = judge_squeue("squeue", v(), down);
    assert_eq!(f.status, Status::Fail);
    assert!(f.fix.unwrap().contains("slurmctld"));
    let f = judge_squeue(
        "/opt/squeue",
        Err("cannot run /opt/squeue --version: No such file".into()),
        Ok(String::new()),
    );
    assert_eq!(f.status, Status::Fail);
    assert!(f.fix.unwrap().contains("agent.squeue"));
}

#[test]
fn rendering_puts_the_fix_under_a_warning_or_failure_and_json_has_every_field() {
    let findings = vec![
        Finding::new("config", Status::Pass, "fine".into(), None),
        Finding::new(
            "agent",
            Status::Fail,
            "nothing answers".into(),
            Some("start sluiced (systemctl start sluiced)".into()),
        ),
    ];
    assert_eq!(
        render(&findings),
        "PASS  config: fine\nFAIL  agent: nothing answers\n      fix: start sluiced (systemctl start sluiced)\n1 passed, 0 warnings, 1 failed\n"
    );
    assert!(!healthy(&findings));
    assert!(healthy(&findings[..1]));
    let json: serde_json::Value = serde_json::to_value(&findings).unwrap();
    assert_eq!(json[1]["status"], "fail");
    assert_eq!(json[1]["check"], "agent");
    assert_eq!(json[0]["fix"], serde_json::Value::Null);
}

#[test]
fn config_check_summarises_what_the_agent_would_use() {
    let cfg = Config::parse(CONFIG, "n1", sluice_archive::upload_memory).unwrap();
    let s = config_summary(&cfg);
    assert!(s.starts_with("OK (node n1)\n"), "{s}");
    assert!(s.contains("hot tier:   /var/lib/sluice/n1/hot"), "{s}");
    assert!(
        s.contains("stores:     s3://, s3://special, az://, gs://"),
        "{s}"
    );
    assert!(s.contains("2 stage allow, 1 archive allow"), "{s}");
    assert!(!s.contains("shared:"), "no shared tier configured: {s}");
    let with = Config::parse(
        &format!("{CONFIG}[shared_tier]\njob_dir='/lustre/sluice/%j'\n"),
        "n1",
        sluice_archive::upload_memory,
    )
    .unwrap();
    let s = config_summary(&with);
    assert!(
        s.contains("hot tier:   /var/lib/sluice/n1/hot\n  shared:     /lustre/sluice/%j (0 stripe class(es))\n"),
        "{s}"
    );
}

fn shared_tier(job_dir: &str, stripes: bool) -> SharedTierConfig {
    let classes = if stripes {
        "[[shared_tier.stripe]]\nmin_size='0'\ncount=1\nsize='1MiB'\n[[shared_tier.stripe]]\nmin_size='1GiB'\ncount=-1\nsize='4MiB'\n"
    } else {
        ""
    };
    let text = format!("{CONFIG}[shared_tier]\njob_dir='{job_dir}'\n{classes}");
    Config::parse(&text, "n1", sluice_archive::upload_memory)
        .unwrap()
        .shared_tier
        .unwrap()
}

fn on(fs: &str, lfs: Option<&str>) -> io::Result<SharedTierFacts> {
    Ok(SharedTierFacts {
        is_dir: true,
        owner: 0,
        mode: 0o755,
        mount: Some((fs.into(), "/lustre".into())),
        lfs: lfs.map(PathBuf::from),
    })
}

#[test]
fn shared_tier_on_lustre_passes_with_lfs_and_fails_without_it_when_classes_need_it() {
    let tier = shared_tier("/lustre/scratch/sluice/%j", true);
    let f = judge_shared_tier(&tier, on("lustre", Some("/usr/bin/lfs")), true);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert_eq!(
        f.detail,
        "/lustre/scratch/sluice on Lustre (mounted at /lustre), lfs at /usr/bin/lfs, 2 stripe class(es)"
    );
    let f = judge_shared_tier(&tier, on("lustre", None), true);
    assert_eq!(f.status, Status::Fail, "{f:?}");
    assert!(f.detail.contains("but lfs is not found"), "{f:?}");
    assert!(f.fix.unwrap().contains("set shared_tier.lfs"));
    // Without classes lfs is never run.
    let plain = shared_tier("/lustre/scratch/sluice/%j", false);
    let f = judge_shared_tier(&plain, on("lustre", None), true);
    assert_eq!(f.status, Status::Pass, "{f:?}");
    assert!(f.detail.contains("lfs not needed"), "{f:?}");
}

#[test]
fn shared_tier_off_lustre_warns_and_a_missing_root_fails_with_the_fix() {
    let tier = shared_tier("/beeond/sluice/%j", true);
    let f = judge_shared_tier(&tier, on("beegfs", None), true);
    assert_eq!(f.status, Status::Warn, "{f:?}");
    assert_eq!(
        f.detail,
        "/beeond/sluice on beegfs (mounted at /lustre), not Lustre: files keep the directory's default layout; the 2 stripe class(es) are not applied"
    );
    assert!(f.fix.unwrap().starts_with("fine for BeeOND or a stand-in"));

    let gone = judge_shared_tier(&tier, Err(Error::from(ErrorKind::NotFound)), true);
    assert_eq!(gone.status, Status::Fail);
    assert!(
        gone.detail
            .starts_with("/beeond/sluice (where each job's /beeond/sluice/%j is made): "),
        "{gone:?}"
    );
    assert_eq!(
        gone.fix.as_deref(),
        Some(
            "create it on the shared file system, the same path on every node (install -d -o root -g root -m 0755 /beeond/sluice), or correct shared_tier.job_dir (now \"/beeond/sluice/%j\")"
        )
    );
    let file = SharedTierFacts {
        is_dir: false,
        owner: 0,
        mode: 0o755,
        mount: None,
        lfs: None,
    };
    let f = judge_shared_tier(&tier, Ok(file), true);
    assert_eq!(f.status, Status::Fail);
    assert!(f.detail.ends_with("is not a directory"), "{f:?}");
    let denied = judge_shared_tier(&tier, Err(Error::from(ErrorKind::PermissionDenied)), false);
    assert_eq!(denied.status, Status::Warn);
    assert_eq!(denied.fix.as_deref(), Some("run doctor as root"));
}

/// Issue 24, finding 3: a shared-tier root a user may write (or that a user owns) lets them move
/// another job's directory aside; doctor fails it with the fix. A sticky world-writable one (like
/// /tmp) does not let them rename root's entries and passes this check.
#[test]
fn a_shared_tier_root_users_can_write_fails() {
    let tier = shared_tier("/beeond/sluice/%j", false);
    for (owner, mode) in [(0, 0o777), (0, 0o775), (1000, 0o755)] {
        let facts = SharedTierFacts {
            is_dir: true,
            owner,
            mode,
            mount: Some(("beegfs".into(), "/beeond".into())),
            lfs: None,
        };
        let f = judge_shared_tier(&tier, Ok(facts), true);
        assert_fails_with(
            &f,
            "must be root's and writable by root alone",
            "chown root:root /beeond/sluice && chmod 0755 /beeond/sluice",
        );
    }
    let sticky = SharedTierFacts {
        is_dir: true,
        owner: 0,
        mode: 0o1777,
        mount: Some(("beegfs".into(), "/beeond".into())),
        lfs: None,
    };
    assert_eq!(
        judge_shared_tier(&tier, Ok(sticky), true).status,
        Status::Warn
    );
}

#[test]
fn shared_tier_check_reads_the_directory_a_stand_in_is_not_lustre() {
    // This machine has no Lustre: a temporary directory is the stand-in, as in the test cluster.
    // What is read is the directory's own: its owner (the user running the test, who cannot give it
    // to root), its mode and its file system. Judged as if root owned it, a stand-in is a WARN.
    let tmp = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o750)).unwrap();
    let tier = shared_tier(&format!("{}/%j", tmp.path().display()), false);
    let facts = read_shared_tier(&tier).unwrap();
    assert!(facts.is_dir);
    assert_eq!(facts.owner, nix::unistd::geteuid().as_raw());
    assert_eq!(facts.mode, 0o750);
    let (fs, _) = facts
        .mount
        .as_ref()
        .expect("the mount of a temporary directory");
    assert_ne!(fs, "lustre");
    assert_eq!(facts.lfs, None);
    let as_roots = SharedTierFacts { owner: 0, ..facts };
    let f = judge_shared_tier(&tier, Ok(as_roots), true);
    assert_eq!(f.status, Status::Warn, "{f:?}");
    assert!(f.detail.contains("not Lustre"), "{f:?}");
    let gone = shared_tier(&format!("{}/missing/%j", tmp.path().display()), false);
    assert_eq!(check_shared_tier(&gone, true).status, Status::Fail);
}

#[test]
fn lfs_is_found_by_path_or_on_path_if_executable() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    std::fs::write(a.join("lfs"), "not executable").unwrap();
    std::fs::write(b.join("lfs"), "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(b.join("lfs"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = std::env::join_paths([&a, &b]).unwrap();
    assert_eq!(find_program(Path::new("lfs"), &path), Some(b.join("lfs")));
    assert_eq!(
        find_program(&b.join("lfs"), "".as_ref()),
        Some(b.join("lfs"))
    );
    assert_eq!(find_program(&a.join("lfs"), &path), None);
    assert_eq!(find_program(Path::new("lfs"), a.as_os_str()), None);
    assert_eq!(find_program(Path::new("lfs"), "".as_ref()), None);
}

#[test]
fn linked_cache_hits_want_protected_hardlinks() {
    assert_eq!(judge_cache_links(Ok("1\n".into())).status, Status::Pass);
    let off = judge_cache_links(Ok("0\n".into()));
    assert_eq!(off.status, Status::Warn);
    assert!(off.detail.contains("= 0"), "{}", off.detail);
    assert!(
        off.fix
            .unwrap()
            .contains("sysctl -w fs.protected_hardlinks=1")
    );
    let unknown = judge_cache_links(Err(Error::from(ErrorKind::NotFound)));
    assert_eq!(unknown.status, Status::Warn);
}
