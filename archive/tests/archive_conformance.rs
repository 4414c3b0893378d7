//! One conformance suite for the checkpoint archive engine, run with the same assertions against every
//! backend: the local file system (`file://`, always), Garage (S3) and Azurite (Azure Blob) when the
//! test cluster is up (`tests/harness/cluster.sh up` writes `/run/sluice-test/env`; the harness runs
//! these with `--ignored`).
//!
//! The store is wrapped in a recorder that logs every completed write, so "MANIFEST is written last"
//! and "large files go multipart" are checked on what the store actually saw, and that can inject a
//! failure into multipart parts.
//!
//! Runs as root in CI (files of the checkpoint belong to an unprivileged uid, as a job's would).

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use sluice_archive::synth::{bf16_weights, fp32_values};
use sluice_archive::testing::{Request, Watch, Watched, Write};
use sluice_archive::{
    ArchiveConfig, ArchiveError, ArchiveProgress, Archiver, CheckpointState, JobMeta, Manifest,
    Transform, open_archive_with,
};
use sluice_core::config::Config;
use sluice_core::safefs::{self, Owner};
use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path as FsPath;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

// ------------------------------------------------------------------------------------ the recorder

/// Watches the writes the backend's store completed, noting the storage class each asked for.
#[derive(Debug)]
struct Recorder {
    log: Arc<Mutex<Vec<Write>>>,
    /// Fail every multipart part after the first.
    fail_parts: Arc<AtomicBool>,
    /// The storage class each PUT and multipart upload asked for, by key (the last request's).
    classes: Arc<Mutex<BTreeMap<String, Option<String>>>>,
}

impl Watch for Recorder {
    fn before(
        &self,
        location: &Path,
        _: Request,
        attributes: &object_store::Attributes,
    ) -> object_store::Result<()> {
        let class = attributes
            .get(&object_store::Attribute::StorageClass)
            .map(|v| v.as_ref().to_string());
        self.classes
            .lock()
            .unwrap()
            .insert(location.to_string(), class);
        Ok(())
    }

    fn before_part(&self, _: &Path, n: usize) -> object_store::Result<()> {
        if self.fail_parts.load(Ordering::Relaxed) && n > 1 {
            return Err(object_store::Error::Generic {
                store: "Recorder",
                source: "injected part failure".into(),
            });
        }
        Ok(())
    }

    fn wrote(&self, write: Write) {
        self.log.lock().unwrap().push(write);
    }
}

// ------------------------------------------------------------------------------------ backends

const ENV_FILE: &str = "/run/sluice-test/env";

fn cluster_env() -> BTreeMap<String, String> {
    let path = std::env::var("SLUICE_TEST_ENV").unwrap_or_else(|_| ENV_FILE.to_string());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {path} ({e}): bring the test cluster up with tests/harness/cluster.sh up"
        )
    });
    text.lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| !k.trim_start().starts_with('#'))
        .map(|(k, v)| {
            (
                k.trim().to_string(),
                v.trim().trim_matches('\'').to_string(),
            )
        })
        .collect()
}

/// The agent config the backends are opened with, as an admin would write it.
fn agent_config(env: Option<&BTreeMap<String, String>>) -> Config {
    agent_config_with_class(env, "", "")
}

/// [`agent_config`] with `data_class = 'S3'` and `data_class = 'AZ'` in the `s3://` and `az://`
/// profiles (none for "").
fn agent_config_with_class(env: Option<&BTreeMap<String, String>>, s3: &str, az: &str) -> Config {
    let class = |c: &str| {
        if c.is_empty() {
            String::new()
        } else {
            format!("data_class = '{c}'")
        }
    };
    let (s3, az) = (class(s3), class(az));
    let mut text = "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n".to_string();
    if let Some(env) = env {
        let v = |k: &str| {
            env.get(k)
                .unwrap_or_else(|| panic!("{ENV_FILE} has no {k}"))
                .clone()
        };
        text += &format!(
            "[[store]]\nprefix='s3://'\nendpoint='{}'\nregion='{}'\naccess_key_id='{}'\n\
             secret_access_key='{}'\nallow_http=true\n{s3}\n[[store]]\nprefix='az://'\nuse_emulator=true\n{az}\n",
            v("SLUICE_TEST_S3_ENDPOINT"),
            v("SLUICE_TEST_S3_REGION"),
            v("SLUICE_TEST_S3_KEY_ID"),
            v("SLUICE_TEST_S3_SECRET"),
        );
    }
    Config::parse(&text, "n1", sluice_archive::upload_memory).unwrap()
}

struct Backend {
    name: &'static str,
    /// The archive URL: `<root>/<unique base>`.
    url: String,
    cfg: Config,
    /// Keeps a file:// archive alive for the test.
    _dir: Option<tempfile::TempDir>,
}

fn unique_base(backend: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("conformance/{backend}-{}-{nanos}", std::process::id())
}

impl Backend {
    fn local() -> Backend {
        let dir = tempfile::tempdir().unwrap();
        Backend {
            name: "file",
            url: format!("file://{}/{}", dir.path().display(), unique_base("file")),
            cfg: agent_config(None),
            _dir: Some(dir),
        }
    }

    fn cluster(scheme: &'static str) -> Backend {
        let env = cluster_env();
        Backend {
            name: scheme,
            url: format!("{scheme}://ckpt/{}", unique_base(scheme)),
            cfg: agent_config(Some(&env)),
            _dir: None,
        }
    }
}

/// 5 MiB: S3's smallest multipart part, so the "large" file of the suite stays small.
fn archive_cfg() -> ArchiveConfig {
    ArchiveConfig {
        part_size: 5 << 20,
        concurrency: 8,
        zstd_level: 1,
        chunk_size: 1 << 20,
        compress_threads: 2,
        bandwidth_limit: None,
    }
}

/// An archiver on the backend's store wrapped in a recorder, plus the raw store and the log.
struct Harness {
    archiver: Archiver,
    raw: Arc<dyn ObjectStore>,
    log: Arc<Mutex<Vec<Write>>>,
    fail_parts: Arc<AtomicBool>,
    /// The storage class each write asked for, by key.
    classes: Arc<Mutex<BTreeMap<String, Option<String>>>>,
    /// The base prefix inside the raw store.
    base: String,
}

fn harness(b: &Backend) -> Harness {
    // open_archive_with is what the agent uses; take its store apart to wrap it.
    let opened = open_archive_with(&b.cfg, &b.url, archive_cfg()).unwrap();
    let loc = sluice_archive::parse_archive_url(&b.url).unwrap();
    let (raw, base): (Arc<dyn ObjectStore>, String) = match &loc.store {
        sluice_archive::ArchiveStore::Local(p) => (
            Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(p)
                    .unwrap()
                    .with_fsync(true),
            ),
            String::new(),
        ),
        sluice_archive::ArchiveStore::Object { scheme, bucket } => (
            sluice_archive::store::open(&b.cfg, *scheme, bucket).unwrap(),
            loc.prefix.clone(),
        ),
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let fail_parts = Arc::new(AtomicBool::new(false));
    let classes = Arc::new(Mutex::new(BTreeMap::new()));
    let rec = Arc::new(Watched::new(
        raw.clone(),
        Recorder {
            log: log.clone(),
            fail_parts: fail_parts.clone(),
            classes: classes.clone(),
        },
    ));
    let archiver = Archiver::with_url(rec, &base, archive_cfg(), opened.url().to_string())
        .unwrap()
        .with_data_class(opened.data_class().map(String::from));
    Harness {
        archiver,
        raw,
        log,
        fail_parts,
        classes,
        base,
    }
}

impl Harness {
    fn key(&self, rel: &str) -> Path {
        let full = if self.base.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.base)
        };
        Path::from_iter(full.split('/'))
    }

    fn writes(&self) -> Vec<Write> {
        self.log.lock().unwrap().clone()
    }

    async fn exists(&self, rel: &str) -> bool {
        match self.raw.head(&self.key(rel)).await {
            Ok(_) => true,
            Err(object_store::Error::NotFound { .. }) => false,
            Err(e) => panic!("head {rel}: {e}"),
        }
    }

    /// Removes everything the test wrote (cluster buckets are shared).
    async fn clean_up(&self) {
        let prefix = self.key("");
        let keys: Vec<Path> = self
            .raw
            .list(Some(&prefix))
            .map_ok(|m| m.location)
            .try_collect()
            .await
            .unwrap_or_default();
        for k in keys {
            let _ = self.raw.delete(&k).await;
        }
    }
}

// ------------------------------------------------------------------------------------ test data

fn job_uid() -> u32 {
    if nix::unistd::geteuid().is_root() {
        4242
    } else {
        nix::unistd::geteuid().as_raw()
    }
}

fn owner() -> Owner {
    Owner {
        uid: job_uid(),
        gid: job_uid(),
    }
}

/// Writes `files` (path → content) below `dir`, owned by the job uid as a job would leave them.
fn write_ckpt(dir: &FsPath, files: &[(&str, Vec<u8>)]) {
    for (rel, data) in files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, data).unwrap();
    }
    if nix::unistd::geteuid().is_root() {
        let mut stack = vec![dir.to_path_buf()];
        while let Some(p) = stack.pop() {
            std::os::unix::fs::lchown(&p, Some(job_uid()), Some(job_uid())).unwrap();
            if p.is_dir() {
                stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            }
        }
    }
}

async fn upload(h: &Harness, tag: &str, node: &str, dir: &FsPath) -> Result<(), ArchiveError> {
    let fd = Arc::new(safefs::open_root_dir(dir).unwrap());
    h.archiver
        .upload_part(tag, node, fd, job_uid(), &ArchiveProgress::default(), None)
        .await
        .map(|_| ())
}

async fn restore(h: &Harness, tag: &str) -> (tempfile::TempDir, Result<Manifest, ArchiveError>) {
    let dest = tempfile::tempdir().unwrap();
    let fd = Arc::new(safefs::open_root_dir(dest.path()).unwrap());
    let r = h
        .archiver
        .restore(tag, fd, owner(), &ArchiveProgress::default())
        .await;
    (dest, r)
}

fn assert_same_tree(src: &FsPath, dest: &FsPath, files: &[(&str, Vec<u8>)]) {
    for (rel, data) in files {
        let got = std::fs::read(dest.join(rel)).unwrap_or_else(|e| panic!("restored {rel}: {e}"));
        assert!(got == *data, "{rel} differs after restore");
        let (ms, md) = (
            src.join(rel).metadata().unwrap(),
            dest.join(rel).metadata().unwrap(),
        );
        assert_eq!(ms.mode() & 0o777, md.mode() & 0o777, "mode of {rel}");
        assert_eq!(md.uid(), job_uid(), "owner of {rel}");
    }
}

fn job(id: u32) -> JobMeta {
    JobMeta {
        job_id: id,
        user: "sluiceuser".into(),
        job_name: "train".into(),
    }
}

/// `try_publish`'s MANIFEST, or `None` while a part is missing; panics on an error.
async fn publish(h: &Harness, tag: &str, nodes: &[String], job: JobMeta) -> Option<Manifest> {
    h.archiver
        .try_publish(tag, nodes, job)
        .await
        .unwrap()
        .into_manifest()
}

fn nodes(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

// ------------------------------------------------------------------------------------ the suite

async fn conformance(b: Backend) {
    let h = harness(&b);
    let r = std::panic::AssertUnwindSafe(suite(&b, &h));
    let outcome = futures::FutureExt::catch_unwind(r).await;
    h.clean_up().await;
    if let Err(p) = outcome {
        std::panic::resume_unwind(p);
    }
}

async fn suite(b: &Backend, h: &Harness) {
    let name = b.name;
    // ---- one node archives a checkpoint of every kind of file
    let src = tempfile::tempdir().unwrap();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("model/weights.bf16", bf16_weights(1_500_000, 1)), // 3 MiB
        ("optim/exp_avg.fp32", fp32_values(2_500_000, 2)),  // 10 MiB: above the 5 MiB part size
        ("optim/step", b"100\n".to_vec()),
        ("empty", Vec::new()),
        // What torch.distributed.checkpoint writes last: a dot file.
        ("dcp/.metadata", b"dcp metadata".to_vec()),
        (
            "nested/deeper/still/config.json",
            b"{\"lr\": 0.0001}\n".to_vec(),
        ),
        (
            "notes/step 100 – ünïcode 100%.txt",
            b"names survive\n".to_vec(),
        ),
    ];
    write_ckpt(src.path(), &files);
    std::fs::set_permissions(
        src.path().join("optim/step"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    upload(h, "step100", "n1", src.path()).await.unwrap();
    let m = h
        .archiver
        .try_publish("step100", &nodes(&["n1"]), job(1))
        .await
        .unwrap()
        .into_manifest()
        .unwrap_or_else(|| panic!("{name}: the only part is written, publish must succeed"));
    assert_eq!(m.files.len(), files.len(), "{name}");
    let weights = m
        .files
        .iter()
        .find(|f| f.path == "model/weights.bf16")
        .unwrap();
    assert_eq!(
        weights.compression.transform,
        Transform::Bytegroup2,
        "{name}"
    );
    let optim = m
        .files
        .iter()
        .find(|f| f.path == "optim/exp_avg.fp32")
        .unwrap();
    assert_eq!(optim.compression.transform, Transform::Bytegroup4, "{name}");
    assert!(
        optim.stored_size > 5 << 20,
        "{name}: the large file must exceed the part size"
    );

    // MANIFEST is the last write, after the part manifest, after every data object; the large
    // file went multipart and the others were single PUTs.
    let writes = h.writes();
    let manifest_key = h.key("step100/MANIFEST").to_string();
    let part_key = h.key("step100/parts/n1.json").to_string();
    assert_eq!(
        writes.last(),
        Some(&Write::Put(manifest_key.clone())),
        "{name}: {writes:#?}"
    );
    let part_at = writes
        .iter()
        .position(|w| *w == Write::Put(part_key.clone()))
        .unwrap();
    assert_eq!(part_at, writes.len() - 2, "{name}: {writes:#?}");
    let optim_key = h.key("step100/data/optim/exp_avg.fp32").to_string();
    assert!(
        writes.contains(&Write::Multipart(optim_key)),
        "{name}: {writes:#?}"
    );
    assert_eq!(
        writes
            .iter()
            .filter(|w| matches!(w, Write::Put(k) if k.contains("/data/")))
            .count(),
        files.len() - 1,
        "{name}: {writes:#?}"
    );

    // ---- list: complete, with a compression ratio
    let list = h.archiver.list().await.unwrap();
    assert_eq!(list.len(), 1, "{name}: {list:#?}");
    assert_eq!(list[0].state, CheckpointState::Complete, "{name}");
    assert_eq!(
        list[0].raw_bytes,
        files.iter().map(|f| f.1.len() as u64).sum::<u64>()
    );
    let ratio = list[0].ratio.unwrap();
    assert!(ratio > 1.1, "{name}: ratio {ratio}");

    // ---- restore is byte-identical; verify passes
    let (dest, r) = restore(h, "step100").await;
    r.unwrap();
    assert_same_tree(src.path(), dest.path(), &files);
    let report = h.archiver.verify("step100").await.unwrap();
    assert_eq!(report.files, files.len() as u64);

    // ---- two nodes: MANIFEST only after both parts
    let (a, bdir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let files_a: Vec<(&str, Vec<u8>)> = vec![
        ("rank0.bf16", bf16_weights(200_000, 3)),
        ("latest", b"step200".to_vec()),
    ];
    let files_b: Vec<(&str, Vec<u8>)> = vec![
        ("rank1.bf16", bf16_weights(200_000, 4)),
        ("latest", b"step200".to_vec()),
    ];
    write_ckpt(a.path(), &files_a);
    write_ckpt(bdir.path(), &files_b);
    let both = nodes(&["n1", "n2"]);
    upload(h, "step200", "n1", a.path()).await.unwrap();
    assert_eq!(publish(h, "step200", &both, job(2)).await, None);
    assert!(
        !h.exists("step200/MANIFEST").await,
        "{name}: MANIFEST before every part"
    );
    let partial = h.archiver.list().await.unwrap();
    let p = partial.iter().find(|i| i.tag == "step200").unwrap();
    assert_eq!(
        (p.state.clone(), p.nodes.clone()),
        (CheckpointState::Partial, nodes(&["n1"]))
    );
    upload(h, "step200", "n2", bdir.path()).await.unwrap();
    let m2 = h
        .archiver
        .try_publish("step200", &both, job(2))
        .await
        .unwrap()
        .into_manifest()
        .unwrap();
    assert_eq!(m2.nodes, both);
    let by_node: Vec<(&str, &str)> = m2
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.node.as_str()))
        .collect();
    assert_eq!(
        by_node,
        [("latest", "n1"), ("rank0.bf16", "n1"), ("rank1.bf16", "n2")]
    );
    // The other node publishing too agrees on the same manifest.
    assert_eq!(publish(h, "step200", &both, job(2)).await, Some(m2.clone()));
    let (dest2, r) = restore(h, "step200").await;
    r.unwrap();
    assert_same_tree(a.path(), dest2.path(), &files_a);
    assert_same_tree(bdir.path(), dest2.path(), &files_b);
    assert_eq!(
        h.archiver.latest(&[]).await.unwrap().as_deref(),
        Some("step200")
    );

    // ---- a tag with data but no MANIFEST is partial and never restored
    upload(h, "step300", "n1", a.path()).await.unwrap();
    let list = h.archiver.list().await.unwrap();
    let p = list.iter().find(|i| i.tag == "step300").unwrap();
    assert_eq!(p.state, CheckpointState::Partial, "{name}");
    assert!(p.stored_bytes > 0);
    let (_d, r) = restore(h, "step300").await;
    assert!(
        matches!(r, Err(ArchiveError::NotArchived { .. })),
        "{name}: {r:?}"
    );
    assert!(matches!(
        h.archiver.verify("step300").await,
        Err(ArchiveError::NotArchived { .. })
    ));
    assert_eq!(
        h.archiver.latest(&[]).await.unwrap().as_deref(),
        Some("step200"),
        "{name}"
    );

    // ---- corruption: one data object overwritten in the store
    let victim = h.key("step200/data/rank1.bf16");
    let mut bytes = h
        .raw
        .get(&victim)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    h.raw.put(&victim, bytes.clone().into()).await.unwrap();
    let e = h.archiver.verify("step200").await.unwrap_err();
    assert!(
        matches!(&e, ArchiveError::Corrupt { damaged, .. } if damaged.len() == 1 && damaged[0].path == "rank1.bf16"),
        "{name}: {e}"
    );
    assert!(e.to_string().contains("rank1.bf16"), "{e}");
    let (_d, r) = restore(h, "step200").await;
    let e = r.unwrap_err();
    assert!(
        e.to_string().contains("rank1.bf16") && e.is_corrupt(),
        "{name}: {e}"
    );
    // The caller falls back: the newest other intact checkpoint.
    assert_eq!(
        h.archiver
            .latest(&nodes(&["step200"]))
            .await
            .unwrap()
            .as_deref(),
        Some("step100"),
        "{name}"
    );
    // A truncated object is caught from the listing alone: latest skips the tag by itself.
    h.raw
        .put(&victim, bytes[..mid].to_vec().into())
        .await
        .unwrap();
    assert_eq!(
        h.archiver.latest(&[]).await.unwrap().as_deref(),
        Some("step100"),
        "{name}"
    );

    // ---- a failing multipart upload is aborted, and nothing is published
    h.fail_parts.store(true, Ordering::Relaxed);
    let e = upload(h, "step400", "n1", src.path()).await.unwrap_err();
    h.fail_parts.store(false, Ordering::Relaxed);
    assert!(
        e.to_string().contains("injected part failure"),
        "{name}: {e}"
    );
    let big = h.key("step400/data/optim/exp_avg.fp32").to_string();
    assert!(
        h.writes().contains(&Write::Aborted(big)),
        "{name}: {:#?}",
        h.writes()
    );
    assert!(!h.exists("step400/data/optim/exp_avg.fp32").await, "{name}");
    assert!(!h.exists("step400/parts/n1.json").await, "{name}");
    assert_eq!(publish(h, "step400", &nodes(&["n1"]), job(4)).await, None);
    // A retry completes it; two nodes racing to publish agree on one MANIFEST (a create-only put
    // where the store has one — Azurite, file:// — and identical bytes where it does not: Garage).
    upload(h, "step400", "n1", src.path()).await.unwrap();
    let one = nodes(&["n1"]);
    let (x, y) = tokio::join!(
        h.archiver.try_publish("step400", &one, job(4)),
        h.archiver.try_publish("step400", &one, job(4))
    );
    let (x, y) = (
        x.unwrap().into_manifest().unwrap(),
        y.unwrap().into_manifest().unwrap(),
    );
    assert_eq!(x, y, "{name}");
    assert_eq!(h.archiver.manifest("step400").await.unwrap(), x, "{name}");
    h.archiver.verify("step400").await.unwrap();

    // ---- the plain agent entry point sees the same archive
    let plain = open_archive_with(&b.cfg, &b.url, archive_cfg()).unwrap();
    let mut tags: Vec<(String, CheckpointState)> = plain
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|i| (i.tag, i.state))
        .collect();
    tags.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        tags,
        [
            ("step100".to_string(), CheckpointState::Complete),
            ("step200".to_string(), CheckpointState::Complete),
            ("step300".to_string(), CheckpointState::Partial),
            ("step400".to_string(), CheckpointState::Complete),
        ],
        "{name}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_file_system() {
    conformance(Backend::local()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test cluster: tests/harness/run-e2e.sh"]
async fn garage_s3() {
    conformance(Backend::cluster("s3")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test cluster: tests/harness/run-e2e.sh"]
async fn azurite_blob() {
    conformance(Backend::cluster("az")).await;
}

// ------------------------------------------------------------------------------------ tiering

/// What the store itself says the storage class of `key` (in bucket/container `ckpt`) is, read
/// behind object_store's back (object_store does not report it): for S3 the `x-amz-storage-class`
/// header of a HEAD (signed by curl), for Azure the access tier of Get Blob Properties (a HEAD,
/// through the harness's rclone). `None`: the store names no class.
fn stored_class(env: &BTreeMap<String, String>, scheme: &str, key: &str) -> Option<String> {
    let v = |k: &str| env.get(k).unwrap_or_else(|| panic!("no {k}")).as_str();
    match scheme {
        "s3" => sluice_e2e::storage_class::s3(
            &format!("{}/ckpt/{key}", v("SLUICE_TEST_S3_ENDPOINT")),
            v("SLUICE_TEST_S3_REGION"),
            v("SLUICE_TEST_S3_KEY_ID"),
            v("SLUICE_TEST_S3_SECRET"),
        ),
        "az" => {
            let stat = sluice_e2e::storage_class::run_ok(
                std::process::Command::new(v("SLUICE_TEST_RCLONE"))
                    .args(["lsjson", "--stat"])
                    .arg(format!("azurite:ckpt/{key}"))
                    .env(
                        "RCLONE_CONFIG",
                        "/nonexistent/sluice-conformance-rclone.conf",
                    )
                    .env("RCLONE_CONFIG_AZURITE_TYPE", "azureblob")
                    .env("RCLONE_CONFIG_AZURITE_USE_EMULATOR", "true"),
            );
            let j: serde_json::Value = serde_json::from_str(&stat).unwrap();
            j["Tier"]
                .as_str()
                .filter(|t| !t.is_empty())
                .map(String::from)
        }
        other => panic!("no such backend {other}"),
    }
}

/// Archive tiering against a real store: with `data_class` in the store profile, every data
/// object's PUT or multipart upload asks for the class and the manifests record it, while the part
/// manifest and the MANIFEST are written without one; then what the store made of it.
/// On S3 the archive reaches Garage through a [`HeadRelay`], so the test also sees the headers
/// object_store put on the wire.
async fn tiering(scheme: &'static str, configured: &str, class: &str) {
    let env = cluster_env();
    let (cfg, relay) = if scheme == "s3" {
        let relay = HeadRelay::start(&env["SLUICE_TEST_S3_ENDPOINT"]).await;
        let mut relayed = env.clone();
        relayed.insert("SLUICE_TEST_S3_ENDPOINT".into(), relay.endpoint());
        let cfg = agent_config_with_class(Some(&relayed), configured, "");
        (cfg, Some(relay))
    } else {
        (agent_config_with_class(Some(&env), "", configured), None)
    };
    let b = Backend {
        name: scheme,
        url: format!(
            "{scheme}://ckpt/{}",
            unique_base(&format!("tiering-{scheme}"))
        ),
        cfg,
        _dir: None,
    };
    let h = harness(&b);
    let r = std::panic::AssertUnwindSafe(tiering_suite(&b, &h, &env, class, relay.as_ref()));
    let outcome = futures::FutureExt::catch_unwind(r).await;
    h.clean_up().await;
    if let Err(p) = outcome {
        std::panic::resume_unwind(p);
    }
}

/// A relay between object_store and an HTTP/1.1 store that records the head (request line and
/// headers) of every request it forwards. Requests and answers pass unchanged (SigV4 signs the Host
/// the client used, which the store then checks as it receives it); a request body is framed by
/// its Content-Length, which object_store always sends to S3.
struct HeadRelay {
    addr: std::net::SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HeadRelay {
    async fn start(upstream: &str) -> HeadRelay {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let upstream = upstream
            .strip_prefix("http://")
            .unwrap_or(upstream)
            .trim_end_matches('/')
            .to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let log = heads.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (upstream, log) = (upstream.clone(), log.clone());
                tokio::spawn(async move {
                    let Ok(store) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (client_r, mut client_w) = client.into_split();
                    let (mut store_r, mut store_w) = store.into_split();
                    let answers = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut store_r, &mut client_w).await;
                    });
                    let mut client_r = tokio::io::BufReader::new(client_r);
                    'requests: loop {
                        let mut head = String::new();
                        loop {
                            let mut line = String::new();
                            match client_r.read_line(&mut line).await {
                                Ok(0) | Err(_) => break 'requests,
                                Ok(_) => head.push_str(&line),
                            }
                            if line == "\r\n" {
                                break;
                            }
                        }
                        let length: u64 = head
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse().ok())?
                            })
                            .unwrap_or(0);
                        log.lock().unwrap().push(head.clone());
                        if store_w.write_all(head.as_bytes()).await.is_err() {
                            break;
                        }
                        let mut body = (&mut client_r).take(length);
                        if tokio::io::copy(&mut body, &mut store_w).await.is_err() {
                            break;
                        }
                    }
                    let _ = store_w.shutdown().await;
                    let _ = answers.await;
                });
            }
        });
        HeadRelay { addr, heads, task }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The recorded heads of `method` requests for `path` whose query starts with `query`.
    fn requests(&self, method: &str, path: &str, query: &str) -> Vec<String> {
        self.heads
            .lock()
            .unwrap()
            .iter()
            .filter(|h| {
                let line = h.lines().next().unwrap_or_default();
                let mut words = line.split(' ');
                let target = words.next().filter(|m| *m == method).and(words.next());
                target.is_some_and(|t| {
                    let (p, q) = t.split_once('?').unwrap_or((t, ""));
                    p == path && q.starts_with(query)
                })
            })
            .cloned()
            .collect()
    }
}

impl Drop for HeadRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The value of header `name` in a recorded request head.
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

async fn tiering_suite(
    b: &Backend,
    h: &Harness,
    env: &BTreeMap<String, String>,
    class: &str,
    relay: Option<&HeadRelay>,
) {
    let name = b.name;
    // The profile's class, spelled as the store spells it, is what the agent's archiver uses.
    let plain = open_archive_with(&b.cfg, &b.url, archive_cfg()).unwrap();
    assert_eq!(plain.data_class(), Some(class), "{name}");
    let src = tempfile::tempdir().unwrap();
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("optim/exp_avg.fp32", fp32_values(2_500_000, 2)), // 10 MiB: multipart
        ("model/config.json", b"{\"layers\": 2}\n".to_vec()),
        ("empty", Vec::new()),
    ];
    write_ckpt(src.path(), &files);
    upload(h, "step1", "n1", src.path()).await.unwrap();
    let m = publish(h, "step1", &nodes(&["n1"]), job(1)).await.unwrap();
    assert!(
        h.writes().contains(&Write::Multipart(
            h.key("step1/data/optim/exp_avg.fp32").to_string()
        )),
        "{name}: {:#?}",
        h.writes()
    );

    // What each request asked for.
    let asked = h.classes.lock().unwrap().clone();
    for (rel, _) in &files {
        let key = h.key(&format!("step1/data/{rel}")).to_string();
        assert_eq!(
            asked.get(&key),
            Some(&Some(class.to_string())),
            "{name}: {key}"
        );
    }
    for rel in ["step1/parts/n1.json", "step1/MANIFEST"] {
        let key = h.key(rel).to_string();
        assert_eq!(asked.get(&key), Some(&None), "{name}: {key}");
    }
    // The MANIFEST records it per file, and `list` (what `sluice ckpt list` prints) reads it
    // from there.
    assert!(
        m.files
            .iter()
            .all(|f| f.storage_class.as_deref() == Some(class)),
        "{name}: {:?}",
        m.files
    );
    let list = plain.list().await.unwrap();
    assert_eq!(list[0].data_classes, [class], "{name}");

    // On the wire (S3): each data object's PUT, and the CreateMultipartUpload of the large one,
    // carried x-amz-storage-class; the part manifest's and the MANIFEST's PUT did not.
    if let Some(relay) = relay {
        let key = |rel: &str| format!("/ckpt/{}", h.key(rel));
        let asked = [
            ("step1/data/model/config.json", Some(class)),
            ("step1/data/empty", Some(class)),
            ("step1/MANIFEST", None),
            ("step1/parts/n1.json", None),
        ];
        for (rel, want) in asked {
            let puts = relay.requests("PUT", &key(rel), "");
            assert!(
                !puts.is_empty(),
                "{name}: no PUT of {rel} went through the relay"
            );
            for put in puts {
                assert_eq!(header(&put, "x-amz-storage-class"), want, "{put}");
            }
        }
        let create = relay.requests("POST", &key("step1/data/optim/exp_avg.fp32"), "uploads");
        assert_eq!(create.len(), 1, "{name}: CreateMultipartUpload");
        assert_eq!(
            header(&create[0], "x-amz-storage-class"),
            Some(class),
            "{}",
            create[0]
        );
    }

    // What the store made of it: Azurite keeps the tier of every data object (Put Blob and Put
    // Block List alike) and the MANIFEST is Hot, its default; Garage takes x-amz-storage-class and
    // keeps no class at all (a HEAD names none: everything is STANDARD). Should Garage start
    // keeping classes, docs/admin-guide.md's "Archive tiering" must say so.
    let azure = name == "az";
    let data = files
        .iter()
        .map(|(rel, _)| (format!("step1/data/{rel}"), class));
    let meta = ["step1/MANIFEST", "step1/parts/n1.json"].map(|rel| (rel.to_string(), "Hot"));
    for (rel, want) in data.chain(meta) {
        let key = h.key(&rel).to_string();
        let got = stored_class(env, name, &key);
        assert_eq!(got.as_deref(), azure.then_some(want), "{name}: {key}");
    }

    // The data restores (an online class).
    let (dest, r) = restore(h, "step1").await;
    r.unwrap();
    assert_same_tree(src.path(), dest.path(), &files);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test cluster: tests/harness/run-e2e.sh"]
async fn tiering_garage_s3() {
    tiering("s3", "standard_ia", "STANDARD_IA").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test cluster: tests/harness/run-e2e.sh"]
async fn tiering_azurite_blob() {
    tiering("az", "cool", "Cool").await;
}

/// Data in Azure's Archive tier is offline: the checkpoint publishes and lists (its MANIFEST is
/// Hot), but reading its data fails with the store's own reason until the blobs are rehydrated —
/// what docs/admin-guide.md's "Archive tiering" tells admins. (Garage has no offline class to try.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test cluster: tests/harness/run-e2e.sh"]
async fn tiering_azurite_archive_tier_lists_but_is_not_read() {
    let env = cluster_env();
    let b = Backend {
        name: "az",
        url: format!("az://ckpt/{}", unique_base("tiering-archive")),
        cfg: agent_config_with_class(Some(&env), "", "archive"),
        _dir: None,
    };
    let h = harness(&b);
    let r = std::panic::AssertUnwindSafe(async {
        let src = tempfile::tempdir().unwrap();
        let files: Vec<(&str, Vec<u8>)> = vec![("model.bin", bf16_weights(100_000, 3))];
        write_ckpt(src.path(), &files);
        upload(&h, "step1", "n1", src.path()).await.unwrap();
        publish(&h, "step1", &nodes(&["n1"]), job(1)).await.unwrap();
        let key = h.key("step1/data/model.bin").to_string();
        assert_eq!(stored_class(&env, "az", &key).as_deref(), Some("Archive"));
        let plain = open_archive_with(&b.cfg, &b.url, archive_cfg()).unwrap();
        let list = plain.list().await.unwrap();
        assert_eq!(
            (&list[0].state, list[0].data_classes.as_slice()),
            (
                &CheckpointState::Complete,
                ["Archive".to_string()].as_slice()
            )
        );
        let (_dest, r) = restore(&h, "step1").await;
        let e = r.unwrap_err();
        let shown = e.describe();
        eprintln!("restoring Archive-tier data: {shown}");
        assert!(
            shown.contains("model.bin'")
                && shown.contains("its data is in an offline storage class")
                && shown.contains("(BlobArchived: "),
            "{shown}"
        );
        assert!(!e.is_corrupt(), "offline data is not damaged data: {e}");
    });
    let outcome = futures::FutureExt::catch_unwind(r).await;
    h.clean_up().await;
    if let Err(p) = outcome {
        std::panic::resume_unwind(p);
    }
}
