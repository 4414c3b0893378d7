//! The cross-job cache (issue 12) as users and admins see it. For these tests the three agents run
//! with the cluster's configuration plus a `[cache]` section (restarted with it, and restored
//! afterwards, so every other test keeps a cold origin), and the datasets live in Garage behind the
//! tests' byte-counting relay (the agents' `s3://datasets-relayed` profile), so what the origin
//! served is counted on the origin's side, not by the agents.
//!
//! Jobs run on one node ([`NODE`]): the cache is per node. A second job of a user, or of another
//! user allowed the source, gets its dataset from the node's cache — byte-identical, owned by the
//! job user, the origin serving no more than the listing — and the job output says so. A user not
//! allowed the source is refused as without a cache. A changed object (new ETag) is read again.
//! Under pressure, least-recently-used entries go while a running job's own copy stays intact and
//! usage stays below the high watermark plus one object. An entry whose fill an agent kill tore is
//! never served. `sluice cache list|stats|warm|evict` show and change what they say.
//!
//! The cache's own files are root's and closed to users (checked on disk and as the user).

use crate::common::*;
use serde_json::Value;
use sluice_e2e::relay::CountingRelay;
use sluice_proto::msg::{CacheListing, Request, Response, StageProgress};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The node every job of these tests runs on: the cache is per node.
const NODE: &str = "n1";
/// A one-node job staging a few tens of MiB (slower when the origin is paced).
const JOB_TIMEOUT: Duration = Duration::from_secs(240);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);
/// What a hit may still cost the origin, as a share of the dataset: the listing that gives each
/// object's ETag and size, and response headers — never the objects' bytes.
const HIT_ORIGIN_SHARE: f64 = 0.01;
/// The shared prefix every user may stage from while the cache config is on; below
/// `s3://datasets-relayed/{user}/` only that user may.
const SHARED: &str = "cache-e2e";
const MIB: u64 = 1 << 20;

// ------------------------------------------------------------------------------ the agents

/// The three agents running with the cluster's configuration plus `[cache]` (written next to the
/// harness's files), each started on an empty cache; when dropped (also when the test fails) each
/// is killed, its cache directory removed and the agent started again as the harness started it.
///
/// The configuration also narrows who may stage from the relayed bucket: everyone below
/// `s3://datasets-relayed/cache-e2e/`, each user below `s3://datasets-relayed/{user}/`.
struct CachedAgents {
    cluster: Cluster,
    originals: Vec<AgentProcess>,
    config: PathBuf,
}

impl CachedAgents {
    /// `cache` is the body of the `[cache]` section, e.g. `size = "256MiB"`.
    fn start(cluster: &Cluster, cache: &str) -> CachedAgents {
        let originals: Vec<AgentProcess> = cluster
            .nodes
            .iter()
            .map(|n| cluster.agent_process(n))
            .collect();
        let at = originals[0].config_arg();
        let original_config = PathBuf::from(&originals[0].argv[at]);
        let text = fs::read_to_string(&original_config)
            .unwrap_or_else(|e| panic!("{}: {e}", original_config.display()));
        let open = "[[stage.allow]]\nprefix = \"s3://datasets-relayed/\"\n";
        assert!(
            text.contains(open),
            "no {open:?} in {}: the harness config changed",
            original_config.display()
        );
        // min_free 1 %: the test machine's disk is shared with builds and benchmarks, and 5 % of it
        // free is not always there; the datasets here are tens of MiB.
        let text = format!(
            "{}\n[cache]\n{cache}\nhigh_water = 90\nlow_water = 75\nmin_free = 1\n",
            text.replace(
                open,
                &format!(
                    "[[stage.allow]]\nprefix = \"s3://datasets-relayed/{SHARED}/\"\n\n\
                     [[stage.allow]]\nprefix = \"s3://datasets-relayed/{{user}}/\"\n"
                ),
            )
        );
        let config = PathBuf::from(cluster.var("SLUICE_TEST_ROOT"))
            .join(format!("e2e-cache-{}.toml", unique()));
        fs::write(&config, text).unwrap();
        fs::set_permissions(&config, fs::Permissions::from_mode(0o600)).unwrap();
        for agent in &originals {
            cluster.kill_agent_and_its_ports(&agent.node);
            remove_cache_dir(cluster, &agent.node);
            cluster.start_agent(&agent.with_config(&config));
        }
        CachedAgents {
            cluster: cluster.clone(),
            originals,
            config,
        }
    }
}

/// The start of a test on S3 datasets: the cluster, which has S3; its agents running with
/// `[cache]` `cache` (see [`CachedAgents::start`]); the relay counting what the origin serves from
/// here on. Bound in this order, they are dropped in the reverse: the relay first.
fn s3_cache(cache: &str) -> (Cluster, CachedAgents, CountingRelay) {
    let cluster = Cluster::for_s3();
    let agents = CachedAgents::start(&cluster, cache);
    let relay = cluster.origin_relay();
    (cluster, agents, relay)
}

impl Drop for CachedAgents {
    fn drop(&mut self) {
        for agent in &self.originals {
            self.cluster.kill_agent_and_its_ports(&agent.node);
            remove_cache_dir(&self.cluster, &agent.node);
            self.cluster.start_agent(agent);
        }
        let _ = fs::remove_file(&self.config);
    }
}

fn cache_dir(cluster: &Cluster, node: &str) -> PathBuf {
    cluster.hot_root(node).join("cache")
}

fn remove_cache_dir(cluster: &Cluster, node: &str) {
    let dir = cache_dir(cluster, node);
    match fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("removing {}: {e}", dir.display()),
    }
}

// ------------------------------------------------------------------------------ datasets

/// A dataset on local disk and in Garage (uploaded straight, not through the relay).
struct Ds {
    dir: PathBuf,
    /// Its key prefix in the relayed bucket, and `s3://datasets-relayed/<prefix>`.
    prefix: String,
    url: String,
    sums: String,
    bytes: u64,
}

impl Ds {
    /// The harness's test dataset (a few hundred small files, nested directories, an empty file,
    /// odd names) plus `big/weights.bin` of `big` random bytes, below `under` in the relayed
    /// bucket (`cache-e2e` or a user's prefix).
    fn standard(cluster: &Cluster, test: &str, big: u64, under: &str) -> Ds {
        let dir = cluster.dataset(test, false);
        if big > 0 {
            random_file(&dir.join("big/weights.bin"), big);
        }
        Ds::upload(cluster, dir, under)
    }

    /// `count` files `obj-NN.bin` of `size` random bytes each: objects of one known size, for the
    /// eviction and fill tests.
    fn objects(cluster: &Cluster, test: &str, count: usize, size: u64) -> Ds {
        let dir = cluster.data_dir(test).join("train");
        for i in 0..count {
            random_file(&dir.join(format!("obj-{i:02}.bin")), size);
        }
        Ds::upload(cluster, dir, SHARED)
    }

    fn upload(cluster: &Cluster, dir: PathBuf, under: &str) -> Ds {
        run(Command::new("chmod").args(["-R", "u=rwX,go=rX"]).arg(&dir));
        let prefix = format!("{under}/{}/train", unique());
        cluster.upload(&dir, "garage", &format!("datasets-relayed/{prefix}"));
        Ds::at(dir, format!("s3://datasets-relayed/{prefix}"), prefix)
    }

    /// The harness's test dataset plus `big/weights.bin` of `big` random bytes as a POSIX tree
    /// every user may read; its URL is its path.
    fn posix(cluster: &Cluster, test: &str, big: u64) -> Ds {
        let dir = cluster.dataset(test, false);
        random_file(&dir.join("big/weights.bin"), big);
        run(Command::new("chmod").args(["-R", "u=rwX,go=rX"]).arg(&dir));
        Ds::at(dir.clone(), dir.display().to_string(), String::new())
    }

    fn at(dir: PathBuf, url: String, prefix: String) -> Ds {
        let mut ds = Ds {
            url,
            prefix,
            sums: String::new(),
            bytes: 0,
            dir,
        };
        ds.refresh();
        ds
    }

    /// Re-reads the local copy's checksums and size (after a test changed a file).
    fn refresh(&mut self) {
        self.sums = checksums(&self.dir);
        self.bytes = tree_bytes(&self.dir);
    }

    /// The objects of the dataset: URL → size.
    fn objects_by_url(&self) -> std::collections::BTreeMap<String, u64> {
        file_sizes(&self.dir)
            .into_iter()
            .map(|(rel, n)| (format!("{}/{rel}", self.url), n))
            .collect()
    }
}

// ------------------------------------------------------------------------------ jobs

/// One finished job that staged a dataset as `ds` on [`NODE`]: what its task listed in
/// `out/<node>/`, what the origin served meanwhile (the relay's count), and the agent's progress
/// record of the stage.
struct Staged {
    job: Job,
    user: String,
    out: PathBuf,
    served: u64,
    progress: StageProgress,
}

impl Staged {
    fn output(&self) -> String {
        self.job.output_text()
    }

    fn file(&self, name: &str) -> String {
        task_file(&self.out, NODE, name)
    }

    /// The job's task found `ds` byte-identical to its source.
    fn assert_same_bytes(&self, cluster: &Cluster, ds: &Ds, what: &str) {
        let sums = self.file("sums-ds");
        let differs = format!(
            "{what}: the dataset job {} of {} staged differs from its source",
            self.job.id, self.user
        );
        cluster.assert_same_listing(&self.job, &ds.sums, &sums, &differs);
    }

    /// The job's task found `ds` byte-identical to its source, every entry under
    /// `$SLUICE_STAGE_DIR` owned by the job user.
    fn assert_got(&self, cluster: &Cluster, ds: &Ds, what: &str) {
        self.assert_same_bytes(cluster, ds, what);
        let owners = self.file("owners");
        let mine = format!("{} ", self.user);
        let foreign: Vec<&str> = owners
            .lines()
            .filter(|l| !l.starts_with(&mine))
            .take(10)
            .collect();
        assert!(
            !owners.is_empty() && foreign.is_empty(),
            "{what}: entries under SLUICE_STAGE_DIR not owned by {}: {foreign:?}",
            self.user
        );
    }

    /// The origin served at most [`HIT_ORIGIN_SHARE`] of the dataset during the job, and the agent
    /// placed all of it from its cache.
    fn assert_hit(&self, cluster: &Cluster, ds: &Ds, what: &str) {
        let share = self.served as f64 / ds.bytes as f64;
        assert!(
            share <= HIT_ORIGIN_SHARE,
            "{what}: the origin served {} bytes during job {} ({:.2} % of the {}-byte dataset, at \
             most {:.0} % allowed for a cached dataset)\n{}",
            self.served,
            self.job.id,
            share * 100.0,
            ds.bytes,
            HIT_ORIGIN_SHARE * 100.0,
            cluster.evidence(&self.job)
        );
        assert_eq!(
            (self.progress.cache_bytes, self.progress.origin_bytes),
            (ds.bytes, 0),
            "{what}: job {}'s stage, as the agent reports it, should be all from the cache: {:?}",
            self.job.id,
            self.progress
        );
    }

    /// The origin served the whole dataset during the job, and the agent placed nothing of it from
    /// its cache.
    fn assert_miss(&self, cluster: &Cluster, ds: &Ds, what: &str) {
        assert!(
            self.served >= ds.bytes,
            "{what}: the origin served {} bytes during job {}, less than the {}-byte dataset: \
             something came from elsewhere\n{}",
            self.served,
            self.job.id,
            ds.bytes,
            cluster.evidence(&self.job)
        );
        assert_eq!(
            (self.progress.cache_bytes, self.progress.origin_bytes),
            (0, ds.bytes),
            "{what}: job {}'s stage, as the agent reports it: {:?}",
            self.job.id,
            self.progress
        );
        assert!(
            !self.output().contains("from this node's cache"),
            "{what}: nothing came from the cache, yet job {}'s output says:\n{}",
            self.job.id,
            self.output()
        );
    }
}

/// A batch script on one node whose task lists what it sees of `$SLUICE_STAGE_DIR/ds` (see
/// `listing_script`), then runs `then` (shell, in the task) before it writes `done`.
fn script(out: &Path, then: &str) -> String {
    let lines = format!("{}\ntouch \"$o/done\"", then.replace('\'', "'\\''"));
    listing_script(out, &["ds"]).replacen("touch \"$o/done\"", &lines, 1)
}

/// Where `user`'s job writes what its task saw: in the test user's work directory, or for the
/// other user (who has none) a fresh directory of theirs in /tmp.
fn out_dir(cluster: &Cluster, user: &str, test: &str) -> PathBuf {
    if user == cluster.user {
        return cluster.workdir(test).join("out");
    }
    let dir = PathBuf::from(format!("/tmp/sluice-e2e-{test}-{}", unique()));
    fs::create_dir_all(&dir).unwrap();
    let (uid, gid) = cluster.ids_of(user);
    std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
    dir.join("out")
}

/// Submits `user`'s job on [`NODE`] staging `url` as `ds` with `script` (see [`script`]).
fn submit(cluster: &Cluster, user: &str, test: &str, url: &str, out: &Path, script: &str) -> Job {
    let stage_in = format!("--stage-in=ds={url}");
    // Less than the node's memory, so that two jobs can share the node (the eviction test).
    let args = ["-N1", "-w", NODE, "--mem=512M", &stage_in];
    if user == cluster.user {
        cluster.submit(out.parent().unwrap(), &args, script)
    } else {
        cluster.submit_as(user, test, &args, script)
    }
}

/// `user`'s job on [`NODE`] stages `url` as `ds`, lists it, runs `then`; it must complete. The
/// relay counts what the origin served from submission to the job's end.
fn stage_job(
    cluster: &Cluster,
    relay: &CountingRelay,
    user: &str,
    test: &str,
    url: &str,
    then: &str,
) -> Staged {
    let out = out_dir(cluster, user, test);
    let before = relay.served();
    let job = submit(cluster, user, test, url, &out, &script(&out, then));
    cluster.assert_completes(&job, JOB_TIMEOUT, &format!("{test}: {user}'s job"));
    let served = relay.served() - before;
    let progress = stage_progress(cluster, &job);
    eprintln!(
        "[cache] {test}: job {} of {user}: origin served {served} bytes; agent: {} from the cache, \
         {} from the origin",
        job.id, progress.cache_bytes, progress.origin_bytes
    );
    Staged {
        job,
        user: user.to_string(),
        out,
        served,
        progress,
    }
}

/// The agent's record of the job's one stage on [`NODE`].
fn stage_progress(cluster: &Cluster, job: &Job) -> StageProgress {
    let status = cluster
        .agent_job(NODE, job)
        .unwrap_or_else(|e| panic!("the agent of {NODE} on job {}: {e}", job.id));
    assert_eq!(
        status.stages.len(),
        1,
        "job {}'s stages on {NODE}: {status:?}",
        job.id
    );
    status.stages[0].clone()
}

// ------------------------------------------------------------------------------ the cache

/// The node's cache as its agent lists it (what `sluice cache list --json` prints).
fn listing(cluster: &Cluster, node: &str) -> CacheListing {
    match cluster.agent_request(
        node,
        Request::CacheList {
            prefix: None,
            entries: true,
        },
    ) {
        Ok(Response::Cache(l)) => l,
        other => panic!("cache list on {node}: {other:?}"),
    }
}

/// Bytes the files below the node's cache directory take on disk (allocated blocks: a fill that
/// writes at offsets is counted for what it wrote), whatever the agent says.
fn disk_usage(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(md) = fs::symlink_metadata(e.path()) else {
                continue; // evicted meanwhile
            };
            if md.is_dir() {
                stack.push(e.path());
            } else {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

/// The cache directory is root's, mode 0700, and every file in it root's and closed to group and
/// others; the job user cannot list it.
fn assert_cache_private(cluster: &Cluster, node: &str) {
    let dir = cache_dir(cluster, node);
    let md = fs::metadata(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(
        (md.uid(), md.mode() & 0o7777),
        (0, 0o700),
        "owner and mode of {} (uid, mode)",
        dir.display()
    );
    let mut stack = vec![dir.clone()];
    let mut files = 0;
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let Ok(md) = fs::symlink_metadata(e.path()) else {
                continue;
            };
            assert!(
                md.uid() == 0 && md.mode() & 0o077 == 0,
                "{} in the cache is uid {} mode {:o}: cache files must be root's, 0600/0700",
                e.path().display(),
                md.uid(),
                md.mode() & 0o7777
            );
            if md.is_dir() {
                stack.push(e.path());
            } else {
                files += 1;
            }
        }
    }
    assert!(files > 0, "{} holds no file", dir.display());
    let ls = cluster.as_user(
        Path::new("/tmp"),
        "ls",
        &["-R", dir.to_str().unwrap()],
        None,
    );
    assert!(
        !ls.status.success() && ls.stdout.is_empty(),
        "{} listed {}: {}",
        cluster.user,
        dir.display(),
        String::from_utf8_lossy(&ls.stdout)
    );
}

/// `sluice --socket <NODE's> ARGS` as root; (exit status, stdout, stderr).
fn sluice_cli(cluster: &Cluster, args: &[&str]) -> (bool, String, String) {
    sluice_cli_on(cluster, NODE, args)
}

/// `sluice cache ARGS --json` as root, which must succeed; its JSON.
fn cache_json(cluster: &Cluster, args: &[&str]) -> Value {
    let mut all = vec!["cache"];
    all.extend_from_slice(args);
    all.push("--json");
    let (ok, stdout, stderr) = sluice_cli(cluster, &all);
    assert!(ok, "sluice {all:?} failed:\n{stdout}{stderr}");
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("sluice {all:?} printed no JSON ({e}):\n{stdout}"))
}

/// The entries of `sluice cache list --json`: URL → size.
fn listed_entries(listed: &Value) -> std::collections::BTreeMap<String, u64> {
    listed["entries"]
        .as_array()
        .unwrap_or_else(|| panic!("no entries in sluice cache list --json:\n{listed:#}"))
        .iter()
        .map(|e| {
            (
                e["url"].as_str().unwrap().to_string(),
                e["size"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `job` (of `who`, its stage-in refused: `why`) stopped before its script: the script wrote no
/// `done` below `out`, the cache counted no hit since `hits_before`, and the job left nothing
/// behind on the node.
fn assert_refused_job_left_no_trace(
    cluster: &Cluster,
    job: &Job,
    out: &Path,
    hits_before: u64,
    who: &str,
    why: &str,
) {
    assert!(
        !out.join(NODE).join("done").exists(),
        "{who}'s job script ran although {why}"
    );
    assert_eq!(
        listing(cluster, NODE).stats.hits,
        hits_before,
        "the cache counted a hit for a job whose stage-in was refused ({who}: {why})"
    );
    cluster.assert_job_left_nothing(job, CLEANUP_TIMEOUT);
}

// ------------------------------------------------------------------------------ tests

/// A user's second and third job on a node stage the same S3 dataset (a 32 MiB object and a few
/// hundred small ones) from the node's cache: the origin serves at most 1 % of it (the listing),
/// the files are byte-identical and the user's, the agent counts every byte as from the cache and
/// the job output says "100 % from this node's cache". The first job read the origin fully. The
/// second job writes into its copy in place; the third still gets the original bytes (a job can
/// never change the cache's copy). The cache's files are root's and unreadable to the user.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_a_users_second_job_reads_the_dataset_from_the_nodes_cache() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"");
    let ds = Ds::standard(&cluster, "cache-hit", 32 * MIB, SHARED);

    let first = stage_job(&cluster, &relay, &cluster.user, "cache-hit-1", &ds.url, "");
    first.assert_got(&cluster, &ds, "the first job");
    first.assert_miss(&cluster, &ds, "the first job (an empty cache)");

    // In place, as a careless training script would: a hard link to the cache would take it along.
    let scribble = "printf JOB-WROTE-THIS | dd of=\"$SLUICE_STAGE_DIR/ds/big/weights.bin\" bs=1 \
                    seek=4096 conv=notrunc status=none && echo yes > \"$o/scribbled\"";
    let second = stage_job(
        &cluster,
        &relay,
        &cluster.user,
        "cache-hit-2",
        &ds.url,
        scribble,
    );
    second.assert_got(&cluster, &ds, "the second job");
    second.assert_hit(&cluster, &ds, "the second job");
    assert_eq!(
        second.file("scribbled").trim(),
        "yes",
        "the second job could not write into its own staged copy"
    );
    let output = second.output();
    assert!(
        output.contains("100 % from this node's cache"),
        "the second job's output does not say its dataset came from the node's cache:\n{output}"
    );

    let third = stage_job(&cluster, &relay, &cluster.user, "cache-hit-3", &ds.url, "");
    third.assert_got(
        &cluster,
        &ds,
        "the third job, after the second wrote into its copy",
    );
    third.assert_hit(&cluster, &ds, "the third job");

    let stats = listing(&cluster, NODE).stats;
    assert!(
        stats.hit_bytes >= 2 * ds.bytes && stats.used_bytes >= ds.bytes,
        "the cache's counters after two hits on a {}-byte dataset: {stats:?}",
        ds.bytes
    );
    assert_cache_private(&cluster, NODE);
    cluster.assert_job_left_nothing(&third.job, CLEANUP_TIMEOUT);
}

/// With `[cache] link_hits`, a hit is a hard link to the cache's entry rather than a copy. The
/// job user's task finds its dataset byte-identical, each file root's and read-only (mode 0444,
/// two links: its name and the cache's), and cannot write into one in place, truncate it or chmod
/// it. The other user cannot read it while the job runs, even given its path, nor list the cache.
/// The job's file is the cache's entry (same inode), the origin served nothing for it, and a third
/// job still gets the original bytes. The miss before is the user's own copy, as without links.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_linked_hits_are_read_only_and_private_to_the_job() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"\nlink_hits = true");
    let ds = Ds::standard(&cluster, "cache-link", 32 * MIB, SHARED);
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let first = stage_job(&cluster, &relay, &a, "cache-link-1", &ds.url, "");
    first.assert_got(&cluster, &ds, "the first job");
    first.assert_miss(&cluster, &ds, "the first job (an empty cache)");

    // The second job's task tries to change its copy, says where it is, and waits for the test.
    let f = "$SLUICE_STAGE_DIR/ds/big/weights.bin";
    let then = format!(
        "stat -c '%u %a %h' \"{f}\" > \"$o/stat\"\n\
         if printf JOB-WROTE-THIS | dd of=\"{f}\" bs=1 seek=4096 conv=notrunc status=none \
         2>\"$o/write-err\"; then echo wrote; else echo refused; fi > \"$o/write\"\n\
         if truncate -s 0 \"{f}\" 2>/dev/null; then echo truncated; else echo refused; fi \
         > \"$o/truncate\"\n\
         if chmod u+w \"{f}\" 2>/dev/null; then echo chmodded; else echo refused; fi > \"$o/chmod\"\n\
         echo \"{f}\" > \"$o/path.new\" && mv \"$o/path.new\" \"$o/path\"\n\
         while [ ! -e \"$o/go\" ]; do sleep 0.2; done"
    );
    let out = out_dir(&cluster, &a, "cache-link-2");
    let before = relay.served();
    let job = submit(
        &cluster,
        &a,
        "cache-link-2",
        &ds.url,
        &out,
        &script(&out, &then),
    );
    let task = out.join(NODE);
    cluster.wait_for(
        "the second job's task to try its copy",
        JOB_TIMEOUT,
        Some(&job),
        || task.join("path").exists(),
    );
    let path = fs::read_to_string(task.join("path")).unwrap();
    let path = path.trim();
    let theirs = cluster.as_someone(&b, Path::new("/tmp"), "cat", &[path], None);
    assert!(
        !theirs.status.success() && theirs.stdout.is_empty(),
        "{b} read {a}'s linked copy {path} ({} bytes)",
        theirs.stdout.len()
    );
    let ino = fs::metadata(path).unwrap().ino();
    let in_cache = fs::read_dir(cache_dir(&cluster, NODE).join("data"))
        .unwrap()
        .flatten()
        .any(|e| e.metadata().is_ok_and(|m| m.ino() == ino));
    assert!(in_cache, "{path} is not one of the cache's entries");
    fs::write(task.join("go"), "").unwrap();
    cluster.assert_completes(&job, JOB_TIMEOUT, "the second job");
    let second = Staged {
        served: relay.served() - before,
        progress: stage_progress(&cluster, &job),
        job,
        user: a.clone(),
        out,
    };
    second.assert_hit(&cluster, &ds, "the second job");
    second.assert_same_bytes(&cluster, &ds, "the second job, linked");
    assert_eq!(second.file("stat").trim(), "0 444 2", "owner, mode, links");
    for (what, want) in [
        ("write", "refused"),
        ("truncate", "refused"),
        ("chmod", "refused"),
    ] {
        assert_eq!(
            second.file(what).trim(),
            want,
            "the job's {what} of its linked copy (write: {})",
            second.file("write-err")
        );
    }
    assert!(
        second.file("write-err").contains("Permission denied"),
        "{}",
        second.file("write-err")
    );

    let third = stage_job(&cluster, &relay, &a, "cache-link-3", &ds.url, "");
    third.assert_hit(&cluster, &ds, "the third job");
    third.assert_same_bytes(&cluster, &ds, "the third job");
    for user in [&a, &b] {
        let ls = cluster.as_someone(
            user,
            Path::new("/tmp"),
            "ls",
            &["-R", cache_dir(&cluster, NODE).to_str().unwrap()],
            None,
        );
        assert!(
            !ls.status.success() && ls.stdout.is_empty(),
            "{user} listed the cache: {}",
            String::from_utf8_lossy(&ls.stdout)
        );
    }
    cluster.assert_job_left_nothing(&third.job, CLEANUP_TIMEOUT);
}

/// Authorisation on every hit. A dataset below the shared prefix, cached by the test user's job, is
/// a hit for the other user (allowed it too): identical files, owned by the other user, the
/// origin serving at most 1 %. A dataset below the test user's own prefix (`{user}` in the allow
/// rule), cached by the test user's job, is refused to the other user at job start with the
/// policy's usual message, exactly as without a cache: the job fails, its script never runs, its
/// output carries none of the data, the origin serves nothing and the cache counts no hit.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_another_user_hits_only_what_the_allow_rules_give_them() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"");
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());

    let shared = Ds::standard(&cluster, "cache-users-shared", 8 * MIB, SHARED);
    let fill = stage_job(&cluster, &relay, &a, "cache-users-a", &shared.url, "");
    fill.assert_got(&cluster, &shared, &format!("{a}'s job"));
    fill.assert_miss(&cluster, &shared, &format!("{a}'s job"));
    let hit = stage_job(&cluster, &relay, &b, "cache-users-b", &shared.url, "");
    hit.assert_got(
        &cluster,
        &shared,
        &format!("{b}'s job on the shared dataset"),
    );
    hit.assert_hit(
        &cluster,
        &shared,
        &format!("{b}'s job on the shared dataset"),
    );
    let _ = fs::remove_file(&hit.job.output);

    // A's own dataset, with a marker that must not reach B in any form.
    let secret = format!("A-PRIVATE-DATASET-{}", unique());
    let dir = cluster.data_dir("cache-users-private").join("train");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("secret.txt"), &secret).unwrap();
    random_file(&dir.join("weights.bin"), 4 * MIB);
    let private = Ds::upload(&cluster, dir, &a);
    let own = stage_job(&cluster, &relay, &a, "cache-users-own", &private.url, "");
    own.assert_got(
        &cluster,
        &private,
        &format!("{a}'s job on their own dataset"),
    );
    let cached: Vec<String> = listing(&cluster, NODE)
        .entries
        .into_iter()
        .map(|e| e.url)
        .filter(|u| u.starts_with(&private.url))
        .collect();
    assert_eq!(
        cached.len(),
        2,
        "{a}'s own dataset should be in the cache now: {cached:?}"
    );

    let hits_before = listing(&cluster, NODE).stats.hits;
    let served_before = relay.served();
    let out = out_dir(&cluster, &b, "cache-users-refused");
    let job = submit(
        &cluster,
        &b,
        "cache-users-refused",
        &private.url,
        &out,
        &format!(
            "{}\ncat \"$SLUICE_STAGE_DIR\"/ds/* 2>&1\n",
            script(&out, "")
        ),
    );
    let end = cluster.wait_end(&job, JOB_TIMEOUT);
    let text = job.output_text();
    let _ = fs::remove_file(&job.output);
    assert!(
        !text.contains(&secret),
        "{b}'s job got {a}'s cached object {}/secret.txt (job {} ended {}):\n{text}",
        private.url,
        job.id,
        end.state
    );
    cluster.assert_ended(
        &job,
        &end,
        "FAILED",
        &format!("{b}'s stage-in of {a}'s dataset"),
    );
    assert!(
        text.contains(&format!(
            "--stage-in={} is not allowed by the site's policy for user {b}",
            private.url
        )),
        "{b}'s job output does not carry the policy's refusal:\n{text}"
    );
    assert_eq!(
        relay.served() - served_before,
        0,
        "the origin served bytes for a refused job"
    );
    let why = "the stage-in was refused";
    assert_refused_job_left_no_trace(&cluster, &job, &out, hits_before, &b, why);
}

/// An object re-uploaded with other bytes of the same size (a new ETag; its size alone would not
/// tell) is a miss: the next job reads exactly that object from the origin again and gets the new
/// bytes, while the dataset's unchanged objects still come from the cache.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_a_changed_object_is_read_again_from_the_origin() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"");
    let mut ds = Ds::standard(&cluster, "cache-changed", 8 * MIB, SHARED);

    let first = stage_job(
        &cluster,
        &relay,
        &cluster.user,
        "cache-changed-1",
        &ds.url,
        "",
    );
    first.assert_got(&cluster, &ds, "the first job");
    let old_sums = ds.sums.clone();

    let big = ds.dir.join("big/weights.bin");
    random_file(&big, 8 * MIB);
    let changed = fs::read(&big).unwrap();
    cluster.put_object(
        "datasets-relayed",
        &format!("{}/big/weights.bin", ds.prefix),
        &changed,
    );
    ds.refresh();
    assert_ne!(old_sums, ds.sums, "the re-upload changed nothing");

    let second = stage_job(
        &cluster,
        &relay,
        &cluster.user,
        "cache-changed-2",
        &ds.url,
        "",
    );
    second.assert_got(
        &cluster,
        &ds,
        "the job after the object changed (the new bytes)",
    );
    let size = changed.len() as u64;
    assert_eq!(
        (second.progress.origin_bytes, second.progress.cache_bytes),
        (size, ds.bytes - size),
        "the job after the change should read the changed object from the origin and the rest \
         from the cache: {:?}",
        second.progress
    );
    assert!(
        second.served >= size
            && second.served as f64 <= size as f64 + HIT_ORIGIN_SHARE * ds.bytes as f64,
        "the origin served {} bytes for a changed {size}-byte object (plus the listing)",
        second.served
    );
    let output = second.output();
    assert!(
        output.contains(" % from the origin, ") && output.contains(" % from this node's cache"),
        "the job output should say part came from the origin and part from the cache:\n{output}"
    );
    cluster.assert_hot_tier_cleaned(&second.job, CLEANUP_TIMEOUT);
}

/// Eviction under pressure, with a 24 MiB cache (high watermark 90 %, low 75 %) and 4 MiB objects.
/// Job A caches its 16 MiB dataset and keeps running; job B stages another 16 MiB on the same
/// node, and its fills push out least-recently-used entries — A's — down to the low watermark.
/// Sampled every 100 ms throughout, the agent's used bytes and the cache directory's bytes on
/// disk never exceed the high watermark plus one object; A's staged copy stays byte-identical
/// (checked again by A after B ended); B got its dataset whole; the cache counted evictions and no
/// longer lists all of A's entries.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_eviction_under_pressure_keeps_usage_bounded_and_a_running_jobs_data_intact() {
    let (cluster, _agents, relay) = s3_cache("size = \"24MiB\"");
    let unit = 4 * MIB;
    let ds_a = Ds::objects(&cluster, "cache-evict-a", 4, unit);
    let ds_b = Ds::objects(&cluster, "cache-evict-b", 4, unit);
    let stats = listing(&cluster, NODE).stats;
    assert_eq!(
        stats.capacity_bytes,
        24 * MIB,
        "the cache's size: {stats:?}"
    );
    let high = stats.high_water_bytes;

    // The sampler: the agent's count and the directory's real usage, highest seen.
    let stop = Arc::new(AtomicBool::new(false));
    let (max_used, max_disk) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let sampler = {
        let (stop, max_used, max_disk) = (stop.clone(), max_used.clone(), max_disk.clone());
        let socket = cluster.agent_socket(NODE);
        let dir = cache_dir(&cluster, NODE);
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let asked = sluice_proto::client::call(
                    &socket,
                    Request::CacheList {
                        prefix: None,
                        entries: false,
                    },
                    Duration::from_secs(5),
                );
                if let Ok(Response::Cache(l)) = asked {
                    max_used.fetch_max(l.stats.used_bytes, Ordering::SeqCst);
                }
                max_disk.fetch_max(disk_usage(&dir), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    // Job A: stages, lists, waits for the test's go, then lists its copy again.
    let out_a = out_dir(&cluster, &cluster.user, "cache-evict-a");
    let go = out_a.parent().unwrap().join("go");
    let hold = format!(
        "while [ ! -e '{}' ]; do sleep 0.2; done\n(cd \"$SLUICE_STAGE_DIR/ds\" && {SUMS_CMD}) > \"$o/sums-again\" 2>&1",
        go.display()
    );
    let before = relay.served();
    let job_a = submit(
        &cluster,
        &cluster.user,
        "cache-evict-a",
        &ds_a.url,
        &out_a,
        &script(&out_a, &hold),
    );
    cluster.wait_for(
        "job A to list its staged dataset",
        JOB_TIMEOUT,
        Some(&job_a),
        || out_a.join(NODE).join("owners").exists(),
    );
    let served_a = relay.served() - before;
    let a_entries = |l: &CacheListing| {
        l.entries
            .iter()
            .filter(|e| e.url.starts_with(&ds_a.url))
            .count()
    };
    cluster.wait_for(
        &format!(
            "A's four objects in the cache once A staged them (the origin served {served_a} bytes)"
        ),
        Duration::from_secs(30),
        Some(&job_a),
        || a_entries(&listing(&cluster, NODE)) == 4,
    );

    let b = stage_job(
        &cluster,
        &relay,
        &cluster.user,
        "cache-evict-b",
        &ds_b.url,
        "",
    );
    b.assert_got(&cluster, &ds_b, "job B");
    let after_b = listing(&cluster, NODE);

    fs::write(&go, "").unwrap();
    cluster.assert_completes(&job_a, JOB_TIMEOUT, "job A");
    stop.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let (used, disk) = (
        max_used.load(Ordering::SeqCst),
        max_disk.load(Ordering::SeqCst),
    );
    eprintln!(
        "[cache] eviction: high watermark {high} bytes, unit {unit}; sampled peak used {used}, on \
         disk {disk}; after B: {:?}",
        after_b.stats
    );

    let again = task_file(&out_a, NODE, "sums-again");
    assert!(
        again == ds_a.sums,
        "job A's staged copy changed while job B's fills evicted A's cache entries: {}",
        diff_listings(&ds_a.sums, &again)
    );
    assert_eq!(
        task_file(&out_a, NODE, "sums-ds"),
        ds_a.sums,
        "job A's first listing"
    );
    assert!(
        after_b.stats.evictions > 0 && a_entries(&after_b) < 4,
        "job B's 16 MiB did not evict A's entries from a 24 MiB cache: {:?}",
        after_b
    );
    assert!(
        after_b.stats.used_bytes <= high,
        "after B, the cache holds {} bytes, above its high watermark {high}",
        after_b.stats.used_bytes
    );
    // One object over the high watermark at most; a little more on disk for block rounding and the
    // cache's own bookkeeping.
    assert!(
        used <= high + unit,
        "the agent's count of the cache reached {used} bytes: above the high watermark {high} plus \
         one {unit}-byte object"
    );
    assert!(
        disk <= high + unit + MIB,
        "the cache directory reached {disk} bytes on disk: above the high watermark {high} plus \
         one {unit}-byte object"
    );
    cluster.assert_job_left_nothing(&job_a, CLEANUP_TIMEOUT);
}

/// The node's agent is SIGKILLed while it fills a cache entry (the origin paced so the 48 MiB
/// object takes about 12 s), and started again. The torn entry is never served: after the restart
/// the job's staging reads the whole object from the origin again (counted at the origin) and the
/// job gets the right bytes; the cache then lists the object only as a complete entry, holds
/// nothing on disk beyond its complete entries, and the next job gets it whole from the cache.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_an_entry_torn_by_a_killed_agent_is_never_served() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"");
    let ds = Ds::objects(&cluster, "cache-torn", 1, 48 * MIB);
    let size = ds.bytes; // of its one object
    relay.set_pace(4_000_000);

    let out = out_dir(&cluster, &cluster.user, "cache-torn");
    let job = submit(
        &cluster,
        &cluster.user,
        "cache-torn",
        &ds.url,
        &out,
        &script(&out, ""),
    );
    cluster.wait_running(&job, Duration::from_secs(60));
    cluster.wait_agent_job(
        NODE,
        &job,
        "the object's fill to be a fifth done",
        Duration::from_secs(120),
        |s| s.stages.first().is_some_and(|p| p.bytes_done > size / 5),
    );
    let agent = cluster.kill_agent_and_its_ports(NODE);
    let torn = disk_usage(&cache_dir(&cluster, NODE));
    let before = relay.served();
    eprintln!(
        "[cache] killed the agent of {NODE} mid-fill; {torn} bytes in its cache directory on disk"
    );
    assert!(
        torn > 0,
        "the cache directory held nothing when the agent was killed: no fill was under way"
    );
    relay.set_pace(0);
    cluster.start_agent(&agent);
    cluster.assert_completes(&job, JOB_TIMEOUT, "the job whose agent was killed mid-fill");
    let served = relay.served() - before;
    let sums = task_file(&out, NODE, "sums-ds");
    let what = "the job whose agent was killed mid-fill got other bytes";
    cluster.assert_same_listing(&job, &ds.sums, &sums, what);
    assert!(
        served >= size,
        "after the restart the origin served {served} bytes of the {size}-byte object: part of it \
         came from the torn cache entry\n{}",
        cluster.evidence(&job)
    );

    let l = listing(&cluster, NODE);
    for e in &l.entries {
        assert_eq!(
            e.url,
            format!("{}/obj-00.bin", ds.url),
            "entries: {:?}",
            l.entries
        );
        assert_eq!(e.size, size, "a partial entry is listed: {e:?}");
    }
    let on_disk = disk_usage(&cache_dir(&cluster, NODE));
    assert!(
        on_disk <= l.stats.used_bytes + MIB,
        "the cache directory holds {on_disk} bytes on disk, its complete entries {}: the torn \
         fill was left behind",
        l.stats.used_bytes
    );
    let (ok, table, err) = sluice_cli(&cluster, &["cache", "list"]);
    assert!(ok, "sluice cache list failed: {table}{err}");
    assert!(
        table.lines().filter(|l| l.contains(&ds.url)).count() <= 1,
        "sluice cache list shows the object more than once:\n{table}"
    );

    let next = stage_job(
        &cluster,
        &relay,
        &cluster.user,
        "cache-torn-next",
        &ds.url,
        "",
    );
    next.assert_got(&cluster, &ds, "the next job");
    next.assert_hit(
        &cluster,
        &ds,
        "the next job (the entry the restarted agent filled)",
    );
    cluster.assert_job_left_nothing(&next.job, CLEANUP_TIMEOUT);
}

/// `sluice cache` as root on the node: `stats` of an empty cache; `warm URL` reads the dataset from
/// the origin into the cache only, and `list` then shows every object with its size; a job then
/// stages it without origin reads; `evict URL` removes exactly those entries, after which `list`
/// shows none of them and `stats` no bytes, and the next job reads the origin fully again. As the
/// test user, `sluice cache list` is refused and shows nothing.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_admin_commands_list_stats_warm_and_evict() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"");
    let ds = Ds::standard(&cluster, "cache-cli", 8 * MIB, SHARED);
    let user = cluster.user.clone();
    let objects = ds.objects_by_url();
    let non_empty: Vec<&String> = objects
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(u, _)| u)
        .collect();

    let empty = cache_json(&cluster, &["stats"]);
    assert_eq!(
        (
            empty["stats"]["used_bytes"].as_u64(),
            empty["stats"]["entries"].as_u64()
        ),
        (Some(0), Some(0)),
        "sluice cache stats of a fresh cache:\n{empty:#}"
    );

    let before = relay.served();
    let warmed = cache_json(&cluster, &["warm", &ds.url]);
    let warm_served = relay.served() - before;
    assert_eq!(
        (
            warmed["files"].as_u64(),
            warmed["bytes"].as_u64(),
            warmed["filled_bytes"].as_u64(),
            warmed["cached_bytes"].as_u64()
        ),
        (
            Some(objects.len() as u64),
            Some(ds.bytes),
            Some(ds.bytes),
            Some(0)
        ),
        "sluice cache warm {}:\n{warmed:#}",
        ds.url
    );
    assert!(
        warm_served >= ds.bytes,
        "warm read {warm_served} bytes from the origin for a {}-byte dataset",
        ds.bytes
    );
    let listed = cache_json(&cluster, &["list"]);
    let entries = listed_entries(&listed);
    for url in &non_empty {
        assert_eq!(
            entries.get(*url),
            objects.get(*url),
            "{url} in sluice cache list after warm"
        );
    }
    assert_eq!(
        listed["stats"]["used_bytes"].as_u64(),
        Some(entries.values().sum::<u64>()),
        "used bytes against the entries listed:\n{}",
        listed["stats"]
    );
    let (ok, table, err) = sluice_cli(&cluster, &["cache", "list"]);
    let big = format!("{}/big/weights.bin", ds.url);
    assert!(
        ok && table.contains(&big),
        "sluice cache list (the table) does not show {big}:\n{table}{err}"
    );
    let as_user = cluster.as_user(
        Path::new("/tmp"),
        built_cli().to_str().unwrap(),
        &[
            "--socket",
            cluster.agent_socket(NODE).to_str().unwrap(),
            "cache",
            "list",
        ],
        None,
    );
    assert!(
        !as_user.status.success()
            && !String::from_utf8_lossy(&as_user.stdout).contains(&ds.url)
            && String::from_utf8_lossy(&as_user.stderr)
                .contains("sluice cache commands are for admins"),
        "sluice cache list as {user} was not refused:\n{}{}",
        String::from_utf8_lossy(&as_user.stdout),
        String::from_utf8_lossy(&as_user.stderr)
    );

    let hit = stage_job(&cluster, &relay, &user, "cache-cli-warm", &ds.url, "");
    hit.assert_got(&cluster, &ds, "the job after warm");
    hit.assert_hit(&cluster, &ds, "the job after warm");
    let stats = cache_json(&cluster, &["stats"]);
    assert!(
        stats["stats"]["hit_bytes"].as_u64() >= Some(ds.bytes),
        "sluice cache stats after a {}-byte hit:\n{stats:#}",
        ds.bytes
    );

    let evicted = cache_json(&cluster, &["evict", &ds.url]);
    assert_eq!(
        (evicted["entries"].as_u64(), evicted["bytes"].as_u64()),
        (Some(entries.len() as u64), Some(entries.values().sum())),
        "sluice cache evict {}:\n{evicted:#}",
        ds.url
    );
    let after = cache_json(&cluster, &["list"]);
    assert!(
        after["entries"].as_array().is_some_and(|e| e
            .iter()
            .all(|e| !e["url"].as_str().unwrap_or("").starts_with(&ds.url)))
            && after["stats"]["used_bytes"].as_u64() == Some(0),
        "sluice cache list after evict:\n{after:#}"
    );
    let miss = stage_job(&cluster, &relay, &user, "cache-cli-evicted", &ds.url, "");
    miss.assert_got(&cluster, &ds, "the job after evict");
    miss.assert_miss(&cluster, &ds, "the job after evict");
    cluster.assert_job_left_nothing(&miss.job, CLEANUP_TIMEOUT);
}

// ------------------------------------------------------------------------------ peers' caches

/// `test`'s 3-node `--stage-mode=replicate` job staging `ds` as `ds`, which must complete (`what`
/// names it); every node's copy must be identical to the source.
fn replicate_job(cluster: &Cluster, test: &str, ds: &Ds, what: &str) -> Job {
    let work = cluster.workdir(test);
    let out = work.join("out");
    let stage_in = format!("--stage-in=ds={}", ds.url);
    let job = cluster.submit(
        &work,
        &["-N3", "-w", "n[1-3]", &stage_in, "--stage-mode=replicate"],
        &listing_script(&out, &["ds"]),
    );
    cluster.assert_completes(&job, JOB_TIMEOUT, what);
    for node in &cluster.nodes {
        let sums = task_file(&out, node, "sums-ds");
        let differs = format!("{what}: the dataset on {node} differs from its source");
        cluster.assert_same_listing(&job, &ds.sums, &sums, &differs);
    }
    job
}

/// `sluice --socket <node's> ARGS` as root; (exit status, stdout, stderr).
fn sluice_cli_on(cluster: &Cluster, node: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(built_cli())
        .arg("--socket")
        .arg(cluster.agent_socket(node))
        .args(args)
        .output()
        .expect("run sluice");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// With aggregation, the nodes that miss take the dataset from the one node that has it cached,
/// not from the origin: the dataset (a 64 MiB object of four peer units and a few hundred small
/// ones) is warmed on n2 only, then a 3-node replicate job stages it. The origin serves at most
/// 1 % of it (the three listings), every node's copy is byte-identical to the source, and n1 and
/// n3 have cached it too.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_a_multi_node_job_takes_what_one_node_cached_from_that_nodes_cache() {
    let (cluster, _agents, relay) = s3_cache("size = \"512MiB\"");
    let ds = Ds::standard(&cluster, "cache-peers", 64 * MIB, SHARED);
    let warm_node = "n2";
    let (ok, stdout, stderr) =
        sluice_cli_on(&cluster, warm_node, &["cache", "warm", &ds.url, "--json"]);
    assert!(ok, "sluice cache warm on {warm_node}:\n{stdout}{stderr}");
    for node in &cluster.nodes {
        let used = listing(&cluster, node).stats.used_bytes;
        let want = if node == warm_node { ds.bytes } else { 0 };
        assert_eq!(used, want, "{node}'s cache after warming {warm_node} only");
    }
    relay.take_served();

    let job = replicate_job(&cluster, "cache-peers", &ds, "the 3-node job");
    let served = relay.take_served();
    eprintln!(
        "[cache] cache-peers: job {}: origin served {served} bytes of a {}-byte dataset",
        job.id, ds.bytes
    );
    let share = served as f64 / ds.bytes as f64;
    assert!(
        share <= HIT_ORIGIN_SHARE,
        "the origin served {served} bytes ({:.2} % of the {}-byte dataset) although {warm_node} \
         had it cached; at most {:.0} % allowed\n{}",
        share * 100.0,
        ds.bytes,
        HIT_ORIGIN_SHARE * 100.0,
        cluster.evidence(&job)
    );
    for node in &cluster.nodes {
        let p = cluster.agent_stage(node, &job);
        assert_eq!(
            p.origin_bytes, 0,
            "{node} read from the origin what {warm_node} had cached: {p:?}"
        );
        let used = listing(&cluster, node).stats.used_bytes;
        assert_eq!(used, ds.bytes, "{node}'s cache after the job");
    }
    cluster.assert_job_left_nothing(&job, CLEANUP_TIMEOUT);
}

/// A POSIX source is cached per user (`(path, device, inode, size, mtime)` and the job user). A
/// user's second job on a POSIX tree (a few hundred small files and a 32 MiB one) is placed from
/// the node's cache: identical files, the user's, every byte counted from the cache and the job
/// output saying "100 % from this node's cache". Another user who may read the same tree reads it
/// from its source: never a hit on the first user's entries. Once the big file is closed to the
/// user (`chmod 600`, root's), the user's next job fails with the denial naming that file, its
/// script never runs, its output carries none of the file, nothing is staged and the cache counts
/// no hit: the user's helper opens every file itself before anything is taken from the cache.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_a_users_second_job_on_a_posix_tree_reads_the_nodes_cache() {
    let cluster = Cluster::for_sluice();
    let _agents = CachedAgents::start(&cluster, "size = \"256MiB\"");
    let (a, b) = (cluster.user.clone(), cluster.other_user.clone());
    let ds = Ds::posix(&cluster, "cache-posix", 32 * MIB);
    let (path, big) = (ds.url.clone(), ds.dir.join("big/weights.bin"));
    let job = |user: &str, test: &str| {
        let out = out_dir(&cluster, user, test);
        let job = submit(&cluster, user, test, &path, &out, &script(&out, ""));
        cluster.assert_completes(&job, JOB_TIMEOUT, &format!("{test}: {user}'s job"));
        let progress = stage_progress(&cluster, &job);
        eprintln!(
            "[cache] {test}: job {} of {user}: {} bytes from the cache, {} from the source",
            job.id, progress.cache_bytes, progress.origin_bytes
        );
        Staged {
            job,
            user: user.to_string(),
            out,
            served: 0,
            progress,
        }
    };
    let from = |s: &Staged| (s.progress.cache_bytes, s.progress.origin_bytes);

    let first = job(&a, "cache-posix-1");
    first.assert_got(&cluster, &ds, "the first job");
    assert_eq!(
        from(&first),
        (0, ds.bytes),
        "the first job reads the source"
    );
    let second = job(&a, "cache-posix-2");
    second.assert_got(&cluster, &ds, "the second job");
    assert_eq!(
        from(&second),
        (ds.bytes, 0),
        "{a}'s second job should be all from the cache: {:?}",
        second.progress
    );
    let output = second.output();
    assert!(
        output.contains("100 % from this node's cache"),
        "the second job's output does not say its dataset came from the node's cache:\n{output}"
    );

    let other = job(&b, "cache-posix-other");
    other.assert_got(&cluster, &ds, &format!("{b}'s job"));
    assert_eq!(
        from(&other),
        (0, ds.bytes),
        "{b} must read the source, never {a}'s cache entries: {:?}",
        other.progress
    );
    assert!(
        !other.output().contains("from this node's cache"),
        "{b}'s job output:\n{}",
        other.output()
    );
    assert_cache_private(&cluster, NODE);

    // The big file closed to every user but root.
    fs::set_permissions(&big, fs::Permissions::from_mode(0o600)).unwrap();
    let hits_before = listing(&cluster, NODE).stats.hits;
    let test = "cache-posix-denied";
    let out = out_dir(&cluster, &a, test);
    let listed = format!(
        "{}\nhead -c 64 \"$SLUICE_STAGE_DIR\"/ds/big/weights.bin | od -A n -t x1 2>&1\n",
        script(&out, "")
    );
    let job = submit(&cluster, &a, test, &path, &out, &listed);
    let end = cluster.wait_end(&job, JOB_TIMEOUT);
    let text = job.output_text();
    cluster.assert_ended(
        &job,
        &end,
        "FAILED",
        &format!("{a}'s job on a file closed to them"),
    );
    assert!(
        text.contains(&format!("access to dataset {path} was denied"))
            && text.contains("weights.bin"),
        "{a}'s job output does not say the dataset was denied, naming the file:\n{text}"
    );
    // `od` prints 16 bytes a line: the file's first line, as the task would have printed it.
    let head = fs::read(&big).unwrap()[..16]
        .iter()
        .map(|b| format!(" {b:02x}"))
        .collect::<String>();
    assert!(
        !text.contains(head.trim()),
        "{a}'s job output holds the closed file's bytes:\n{text}"
    );
    let why = "its stage-in was denied: the user cannot read the source";
    assert_refused_job_left_no_trace(&cluster, &job, &out, hits_before, &a, why);
}

/// A multi-node job on a POSIX tree (`--stage-mode=replicate`, shared through the job's peers)
/// goes through every node's own cache: the first 3-node job reads the tree (a few hundred small
/// files and a 24 MiB one, several peer units) from its source once in all and every node keeps
/// all of it; the user's second job on the same nodes is placed by every node from its own cache —
/// no byte from the source or a peer on any node, every node's copy identical, and the job output
/// saying "100 % from this node's cache".
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_a_multi_node_job_on_a_posix_tree_reads_every_nodes_own_cache() {
    let cluster = Cluster::for_sluice();
    let _agents = CachedAgents::start(&cluster, "size = \"256MiB\"");
    let ds = Ds::posix(&cluster, "cache-posix-peers", 24 * MIB);
    let bytes = ds.bytes;
    let job = |test: &str| {
        let job = replicate_job(&cluster, test, &ds, &format!("{test}: the 3-node job"));
        let mut from = Vec::new();
        for node in &cluster.nodes {
            let p = cluster.agent_stage(node, &job);
            from.push((p.cache_bytes, p.origin_bytes, p.peer_bytes));
        }
        eprintln!(
            "[cache] {test}: job {}: per node (cache, origin, peers) bytes of {bytes}: {from:?}",
            job.id
        );
        (job, from)
    };

    let (first, from) = job("cache-posix-peers-1");
    assert_eq!(
        from.iter().map(|f| f.1).sum::<u64>(),
        bytes,
        "the first job reads the tree from its source once in all: {from:?}"
    );
    assert!(from.iter().all(|f| f.0 == 0), "cold caches: {from:?}");
    for node in &cluster.nodes {
        let used = listing(&cluster, node).stats.used_bytes;
        assert_eq!(
            used, bytes,
            "{node}'s cache after the first job keeps the whole tree"
        );
    }
    cluster.assert_hot_tier_cleaned(&first, CLEANUP_TIMEOUT);

    let (second, from) = job("cache-posix-peers-2");
    for (node, f) in cluster.nodes.iter().zip(&from) {
        assert_eq!(
            *f,
            (bytes, 0, 0),
            "{node}: the second job's tree should be all from its own cache (cache, origin, \
             peers)\n{}",
            cluster.evidence(&second)
        );
    }
    let output = second.output_text();
    assert!(
        output.contains("100 % from this node's cache"),
        "the second job's output does not say its dataset came from the node's cache:\n{output}"
    );
    cluster.assert_job_left_nothing(&second, CLEANUP_TIMEOUT);
}

/// `sluice cache warm URL --nodes n[1-3],n9` as root on n1: n1's agent warms its own cache and
/// asks n2's and n3's agents over the peer port to warm theirs. One row per node, each with the
/// whole dataset read from the origin now; n9 (no such node) fails in its row and makes the exit
/// status 1, the others are warmed all the same. Then `sluice cache list` on each node shows every
/// object, and a second warm of the three finds everything cached before.
#[test]
#[ignore = "needs the Slurm test cluster: tests/harness/run-e2e.sh"]
fn cache_warm_on_a_node_list_fills_every_nodes_cache_through_its_agent() {
    let (cluster, _agents, relay) = s3_cache("size = \"256MiB\"");
    let ds = Ds::standard(&cluster, "cache-warm-nodes", 8 * MIB, SHARED);
    let (ok, stdout, stderr) = sluice_cli_on(
        &cluster,
        NODE,
        &["cache", "warm", &ds.url, "--nodes", "n[1-3],n9", "--json"],
    );
    assert!(
        !ok,
        "a warm with a node that cannot be reached must fail:\n{stdout}{stderr}"
    );
    let objects = ds.objects_by_url();
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!("no JSON from sluice cache warm --nodes ({e}):\n{stdout}{stderr}")
    });
    let rows = v["nodes"].as_array().expect("rows");
    let names: Vec<&str> = rows.iter().map(|r| r["node"].as_str().unwrap()).collect();
    assert_eq!(names, ["n1", "n2", "n3", "n9"], "{v:#}");
    for r in &rows[..3] {
        assert!(r.get("error").is_none(), "{r:#}");
        assert_eq!(
            (
                r["warmed"]["files"].as_u64(),
                r["warmed"]["filled_bytes"].as_u64(),
                r["warmed"]["cached_bytes"].as_u64(),
            ),
            (Some(objects.len() as u64), Some(ds.bytes), Some(0)),
            "{r:#}"
        );
    }
    assert!(
        rows[3].get("warmed").is_none() && rows[3]["error"].as_str().is_some_and(|e| !e.is_empty()),
        "n9's row: {:#}",
        rows[3]
    );
    let served = relay.take_served();
    assert!(
        served >= 3 * ds.bytes,
        "three nodes warmed from the origin, yet it served {served} bytes of a {}-byte dataset",
        ds.bytes
    );
    for node in &cluster.nodes {
        let (ok, listed, err) = sluice_cli_on(&cluster, node, &["cache", "list", "--json"]);
        assert!(ok, "sluice cache list on {node}:\n{listed}{err}");
        let listed: Value = serde_json::from_str(&listed).unwrap();
        let entries = listed_entries(&listed);
        for (url, size) in objects.iter().filter(|(_, n)| **n > 0) {
            assert_eq!(
                entries.get(url),
                Some(size),
                "{url} in sluice cache list on {node}"
            );
        }
    }
    let (ok, table, err) = sluice_cli_on(
        &cluster,
        NODE,
        &["cache", "warm", &ds.url, "--nodes", "n[1-3]"],
    );
    assert!(ok, "the second warm:\n{table}{err}");
    for node in &cluster.nodes {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("{node} ")))
            .unwrap_or_else(|| panic!("no row for {node}:\n{table}"));
        let cells: Vec<&str> = row.split("  ").filter(|c| !c.trim().is_empty()).collect();
        assert_eq!(
            cells.get(3).map(|c| c.trim()),
            Some("0 B"),
            "{node}: nothing read from the origin the second time:\n{table}"
        );
    }
    assert!(
        relay.take_served() < ds.bytes / 10,
        "the second warm read the dataset again"
    );
}
