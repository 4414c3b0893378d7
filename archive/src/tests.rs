//! Engine tests against an in-memory store. The same behaviour against real stores (file://, Garage,
//! Azurite) is `tests/archive_conformance.rs`.

use super::walk::tests::{assert_root, chown_tree, test_uid};
use super::*;
use crate::synth::{bf16_weights, fp32_values};
use object_store::memory::InMemory;
use sluice_core::safefs::{self, Owner};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Small sizes so debug builds stay quick while still exercising multipart and several chunks.
fn small_cfg() -> ArchiveConfig {
    ArchiveConfig {
        part_size: 256 << 10,
        concurrency: 4,
        zstd_level: 3,
        chunk_size: 64 << 10,
        compress_threads: 2,
        bandwidth_limit: None,
    }
}

fn job() -> JobMeta {
    JobMeta {
        job_id: 7,
        user: "alice".into(),
        job_name: "train".into(),
    }
}

fn write_tree(d: &Path) {
    std::fs::create_dir_all(d.join("model")).unwrap();
    std::fs::create_dir_all(d.join("nested/a/b")).unwrap();
    std::fs::create_dir_all(d.join("empty-dir")).unwrap();
    std::fs::write(d.join("model/weights.bf16"), bf16_weights(300_000, 1)).unwrap();
    std::fs::write(d.join("optim.fp32"), fp32_values(40_000, 2)).unwrap();
    std::fs::write(d.join("empty"), b"").unwrap();
    std::fs::write(d.join("nested/a/b/latest"), b"step10\n").unwrap();
    std::fs::set_permissions(d.join("optim.fp32"), std::fs::Permissions::from_mode(0o600)).unwrap();
    chown_tree(d, test_uid());
}

fn archiver(store: Arc<InMemory>, cfg: ArchiveConfig) -> Archiver {
    Archiver::new(store, "alice/run1", cfg).unwrap()
}

/// `write_tree` in a fresh directory, an empty in-memory store, and an archiver on it.
fn tree_and_store() -> (tempfile::TempDir, Arc<InMemory>, Archiver) {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    let store = Arc::new(InMemory::new());
    let a = archiver(store.clone(), small_cfg());
    (src, store, a)
}

async fn upload(
    a: &Archiver,
    tag: &str,
    node: &str,
    dir: &Path,
) -> Result<PartManifest, ArchiveError> {
    let fd = Arc::new(safefs::open_root_dir(dir).unwrap());
    a.upload_part(tag, node, fd, test_uid(), &ArchiveProgress::default(), None)
        .await
}

/// Uploads `dir` as node n1's part of `tag` and publishes it with n1 as the only node.
async fn publish_alone(a: &Archiver, tag: &str, dir: &Path) -> Manifest {
    upload(a, tag, "n1", dir).await.unwrap();
    let published = a
        .try_publish(tag, &nodes(&["n1"]), job())
        .await
        .unwrap()
        .into_manifest();
    published.unwrap_or_else(|| panic!("{tag} was not published"))
}

fn nodes(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

async fn keys(store: &InMemory) -> Vec<String> {
    let mut k: Vec<String> = store
        .list(None)
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap();
    k.sort();
    k
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_publish_restore_round_trip() {
    let (src, store, a) = tree_and_store();
    let progress = ArchiveProgress::default();
    let fd = Arc::new(safefs::open_root_dir(src.path()).unwrap());
    let part = a
        .upload_part("step10", "n1", fd, test_uid(), &progress, None)
        .await
        .unwrap();
    let p = progress.snapshot();
    assert_eq!((p.files_done, p.files_total), (4, 4));
    assert_eq!(p.bytes_done, p.bytes_total);
    assert_eq!(p.stored_bytes, part.stored_bytes());
    let weights = part
        .files
        .iter()
        .find(|f| f.path == "model/weights.bf16")
        .unwrap();
    assert_eq!(weights.compression.transform, Transform::Bytegroup2);
    assert!(weights.chunks.len() > 1 && weights.stored_size > small_cfg().part_size);
    assert_eq!(
        part.dirs,
        ["empty-dir", "model", "nested", "nested/a", "nested/a/b"]
    );

    let m = a
        .try_publish("step10", &nodes(&["n1"]), job())
        .await
        .unwrap()
        .into_manifest()
        .expect("the only part is there");
    assert!(m.ratio() > 1.1, "ratio {}", m.ratio());
    assert!(
        keys(&store)
            .await
            .contains(&"alice/run1/step10/MANIFEST".to_string())
    );
    // Publishing again is a no-op returning the same manifest.
    assert_eq!(
        a.try_publish("step10", &nodes(&["n1"]), job())
            .await
            .unwrap()
            .into_manifest(),
        Some(m.clone())
    );
    // A published checkpoint is immutable: uploading again returns the existing part.
    assert_eq!(upload(&a, "step10", "n1", src.path()).await.unwrap(), part);

    let dest = tempfile::tempdir().unwrap();
    let owner = Owner {
        uid: test_uid(),
        gid: test_uid(),
    };
    let rp = ArchiveProgress::default();
    let restored = a
        .restore(
            "step10",
            Arc::new(safefs::open_root_dir(dest.path()).unwrap()),
            owner,
            &rp,
        )
        .await
        .unwrap();
    assert_eq!(restored, m);
    assert_eq!(rp.snapshot().bytes_done, m.raw_bytes);
    assert_eq!(rp.snapshot().files_done, 4);
    for f in [
        "model/weights.bf16",
        "optim.fp32",
        "empty",
        "nested/a/b/latest",
    ] {
        let (x, y) = (src.path().join(f), dest.path().join(f));
        assert_eq!(
            std::fs::read(&x).unwrap(),
            std::fs::read(&y).unwrap(),
            "{f}"
        );
        let (mx, my) = (x.metadata().unwrap(), y.metadata().unwrap());
        assert_eq!(mx.mode() & 0o777, my.mode() & 0o777, "{f}");
        assert_eq!(my.uid(), test_uid(), "{f}");
    }
    assert!(dest.path().join("empty-dir").is_dir());
    assert_eq!(a.verify("step10").await.unwrap().files, 4);
    // Verify counts what it checked the way restore does, for the CLI's progress.
    let vp = ArchiveProgress::default();
    a.verify_with_progress("step10", &vp).await.unwrap();
    let p = vp.snapshot();
    assert_eq!((p.files_done, p.files_total), (4, 4));
    assert_eq!((p.bytes_done, p.bytes_total), (m.raw_bytes, m.raw_bytes));
    assert_eq!(p.stored_bytes, m.stored_bytes);
    let list = a.list().await.unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].state, CheckpointState::Complete);
    assert_eq!(list[0].job, Some(job()));
    assert_eq!(a.latest(&[]).await.unwrap().as_deref(), Some("step10"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root (the tree is another user's, the link's target root's); run as root with --ignored, as tests/harness/run-e2e.sh does"]
async fn hostile_tree_uploads_nothing() {
    assert_root("the tree must belong to another user and the link's target to root");
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"root's secret").unwrap();
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    std::os::unix::fs::symlink(
        outside.path().join("secret"),
        src.path().join("model/zz-link"),
    )
    .unwrap();
    let store = Arc::new(InMemory::new());
    let a = archiver(store.clone(), small_cfg());
    let e = upload(&a, "step1", "n1", src.path()).await.unwrap_err();
    assert!(
        matches!(&e, ArchiveError::Refused { path, .. } if path == "model/zz-link"),
        "{e}"
    );
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert_eq!(keys(&store).await, Vec::<String>::new());
}

/// A file that keeps changing while it is read aborts the upload: no part manifest, so the
/// checkpoint is never published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_changing_while_read_is_not_published() {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    let path = src.path().join("model/weights.bf16");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Rewrite bytes in place: same size, new mtime/ctime.
                std::os::unix::fs::FileExt::write_all_at(&f, &[i as u8], (i * 4099) % 500_000)
                    .unwrap();
                i += 1;
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        })
    };
    let store = Arc::new(InMemory::new());
    let a = archiver(store.clone(), small_cfg());
    let e = upload(&a, "step2", "n1", src.path()).await.unwrap_err();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(e.is_modified(), "{e}");
    assert!(
        matches!(&e, ArchiveError::Modified { path, .. } if path == "model/weights.bf16"),
        "{e}"
    );
    let k = keys(&store).await;
    assert!(
        !k.iter()
            .any(|k| k.contains("/parts/") || k.ends_with("MANIFEST")),
        "{k:?}"
    );
    assert_eq!(
        a.try_publish("step2", &nodes(&["n1"]), job())
            .await
            .unwrap()
            .into_manifest(),
        None
    );
    // Once the file is stable, a retry succeeds.
    publish_alone(&a, "step2", src.path()).await;
}

/// The cap holds the upload to the configured rate (virtual time).
#[tokio::test(start_paused = true)]
async fn bandwidth_cap_limits_upload_rate() {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    let store = Arc::new(InMemory::new());
    let rate = 100 << 10;
    let a = archiver(
        store.clone(),
        ArchiveConfig {
            bandwidth_limit: Some(rate),
            ..small_cfg()
        },
    );
    let t0 = tokio::time::Instant::now();
    let part = upload(&a, "step3", "n1", src.path()).await.unwrap();
    let elapsed = t0.elapsed().as_secs_f64();
    // Every request but the first waits for its share: at least (stored - one part) / rate.
    let min = (part.stored_bytes() - small_cfg().part_size) as f64 / rate as f64;
    assert!(
        min > 2.0,
        "the test needs a few seconds of traffic, got {min}"
    );
    assert!(elapsed >= min, "{elapsed} s < {min} s");
    assert!(elapsed < min + 3.0, "{elapsed} s for a minimum of {min} s");

    // Two archivers sharing one node-wide cap upload at the rate together, not each.
    let cap = Bandwidth::new(rate);
    let x = archiver(store.clone(), small_cfg()).with_bandwidth(&cap);
    let y = Archiver::new(store.clone(), "bob/run2", small_cfg())
        .unwrap()
        .with_bandwidth(&cap);
    let t0 = tokio::time::Instant::now();
    let (px, py) = tokio::join!(
        upload(&x, "step4", "n1", src.path()),
        upload(&y, "step4", "n1", src.path())
    );
    let elapsed = t0.elapsed().as_secs_f64();
    let both = px.unwrap().stored_bytes() + py.unwrap().stored_bytes();
    let min = (both - 2 * small_cfg().part_size) as f64 / rate as f64;
    assert!(elapsed >= min, "{elapsed} s < {min} s");
}

#[test]
fn part_size_keeps_objects_under_the_part_limit() {
    use super::upload::part_size_for;
    let mib = 1u64 << 20;
    assert_eq!(part_size_for(16 * mib, 10 * mib), 16 * mib);
    // 1 TiB at 16 MiB would be 65,536 parts: raised to whole MiB so it fits 10,000.
    let tib = 1u64 << 40;
    let p = part_size_for(16 * mib, tib);
    assert_eq!(p % mib, 0);
    assert!(tib.div_ceil(p) <= MAX_PARTS);
    assert!(tib.div_ceil(p - mib) > MAX_PARTS || p == 16 * mib);
}

#[test]
fn config_is_validated() {
    assert!(ArchiveConfig::default().validate().is_ok());
    for bad in [
        ArchiveConfig {
            chunk_size: 100_000,
            ..Default::default()
        },
        ArchiveConfig {
            zstd_level: 30,
            ..Default::default()
        },
        ArchiveConfig {
            concurrency: 0,
            ..Default::default()
        },
        ArchiveConfig {
            bandwidth_limit: Some(0),
            ..Default::default()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
        assert!(Archiver::new(Arc::new(InMemory::new()), "x", bad).is_err());
    }
    for bad in ["", ".hidden", "a/b", "..", "a b", "x\0"] {
        assert!(check_name("checkpoint tag", bad).is_err(), "{bad:?}");
    }
    assert!(check_name("checkpoint tag", "global_step100").is_ok());
}

/// Byte grouping is what beats plain zstd on model weights: the container must do clearly better
/// than zstd -3 over the same bytes.
#[test]
fn container_beats_plain_zstd_on_bf16_weights() {
    let data = bf16_weights(2 << 20, 42); // 4 MiB
    let plain = zstd::bulk::compress(&data, 3).unwrap().len();
    let c = format::choose_compression(Some(&data[..format::SAMPLE_LEN]), 3);
    let ours: usize = data
        .chunks(1 << 20)
        .map(|c2| format::encode_chunk(c2, c).bytes.len())
        .sum();
    let (rp, ro) = (
        data.len() as f64 / plain as f64,
        data.len() as f64 / ours as f64,
    );
    eprintln!("bf16 N(0,0.02): plain zstd -3 {rp:.3}x, sluice container {ro:.3}x");
    assert!(ro > rp * 1.05, "ours {ro:.3} vs plain {rp:.3}");
}

/// A MANIFEST that already exists (another node published first) is success when it is the same,
/// and the existing one wins when it is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_twice_keeps_the_first_manifest() {
    let (src, _store, a) = tree_and_store();
    let m = publish_alone(&a, "step5", src.path()).await;
    // InMemory refuses a second create-only put: the existing, identical manifest is returned.
    assert_eq!(a.put_manifest(&m).await.unwrap(), m);
    let other = Manifest {
        created_unix_ms: m.created_unix_ms + 1,
        ..m.clone()
    };
    assert_eq!(a.put_manifest(&other).await.unwrap(), m);
    assert_eq!(a.manifest("step5").await.unwrap(), m);
}

/// A writer killed mid-save left a temporary file beside the file a later save finished: the
/// archived checkpoint is the finished files, and nothing of the temporary one is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_writer_temp_file_is_not_archived() {
    let (src, store, a) = tree_and_store();
    std::fs::write(src.path().join(".optim.fp32.31337.0.tmp"), b"half a save").unwrap();
    chown_tree(src.path(), test_uid());
    let m = publish_alone(&a, "step6", src.path()).await;
    let paths: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    assert!(
        paths.contains(&"optim.fp32") && !paths.iter().any(|p| p.ends_with(".tmp")),
        "{paths:?}"
    );
    assert!(
        !keys(&store).await.iter().any(|k| k.contains(".tmp")),
        "{:?}",
        keys(&store).await
    );
}

/// F5: whoever can write the archive prefix can put a huge MANIFEST or part there. The agent refuses
/// it from its size, naming the object, without reading it: the file store's object here is a
/// 64 GiB sparse file, which reading whole would take minutes and 64 GiB of memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_manifests_are_refused_unread() {
    let root = tempfile::tempdir().unwrap();
    let store =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(root.path()).unwrap());
    let a = Archiver::new(store, "alice/run1", small_cfg()).unwrap();
    let huge = |rel: &str| {
        let p = root.path().join("alice/run1").join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::File::create(&p)
            .unwrap()
            .set_len(64 << 30)
            .unwrap();
    };
    huge("step1/MANIFEST");
    let t = std::time::Instant::now();
    let e = a.manifest("step1").await.unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(&e, ArchiveError::BadManifest { what, .. } if what == "MANIFEST"),
        "{msg}"
    );
    assert!(
        msg.contains("step1") && msg.contains("68719476736 bytes"),
        "{msg}"
    );
    assert!(msg.contains("64 MiB") && msg.contains("not read"), "{msg}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "it was read"
    );
    // Listing shows the tag as invalid, and `latest` skips it rather than failing.
    let list = a.list().await.unwrap();
    assert!(
        matches!(&list[0].state, CheckpointState::Invalid { reason } if reason.contains("not read")),
        "{list:?}"
    );
    assert_eq!(a.latest(&[]).await.unwrap(), None);

    // A node's part manifest, read when publishing.
    huge("step2/parts/n1.json");
    let e = a
        .try_publish("step2", &nodes(&["n1"]), job())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, ArchiveError::BadManifest { what, .. } if what == "parts/n1.json"),
        "{e}"
    );

    // A manifest just under the limit is still read (and then judged on its content).
    std::fs::write(
        root.path().join("alice/run1/step1/MANIFEST"),
        vec![b' '; 1 << 20],
    )
    .unwrap();
    let e = a.manifest("step1").await.unwrap_err().to_string();
    assert!(!e.contains("not read"), "{e}");
}

/// Restores `tag` into a fresh directory and checks every file of `write_tree` came back.
async fn restore_and_compare(a: &Archiver, tag: &str, src: &Path) -> Manifest {
    let dest = tempfile::tempdir().unwrap();
    let owner = Owner {
        uid: test_uid(),
        gid: test_uid(),
    };
    let fd = Arc::new(safefs::open_root_dir(dest.path()).unwrap());
    let m = a
        .restore(tag, fd, owner, &ArchiveProgress::default())
        .await
        .unwrap();
    for f in [
        "model/weights.bf16",
        "optim.fp32",
        "empty",
        "nested/a/b/latest",
    ] {
        assert_eq!(
            std::fs::read(src.join(f)).unwrap(),
            std::fs::read(dest.path().join(f)).unwrap(),
            "{tag}: {f}"
        );
    }
    m
}

/// Archives written before plane-wise frames (manifest version 1: grouped chunks as one zstd
/// frame) still verify and restore. The archive is rewritten here exactly as version 1 wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_archives_still_restore() {
    let (src, store, a) = tree_and_store();
    let mut m = publish_alone(&a, "step1", src.path()).await;
    let mut rewritten = 0;
    for f in &mut m.files {
        if f.compression.transform == Transform::None {
            continue;
        }
        let raw = std::fs::read(src.path().join(&f.path)).unwrap();
        let mut object = Vec::new();
        let mut at = 0;
        for c in &mut f.chunks {
            assert_eq!(c.codec, Codec::ZstdPlanes, "{}", f.path);
            let frame = format::tests::v1_frame(&raw[at..at + c.raw as usize], f.compression);
            at += c.raw as usize;
            *c = ChunkEntry {
                offset: object.len() as u64,
                stored: frame.bytes.len() as u64,
                raw: c.raw,
                codec: frame.codec,
                transform: frame.transform,
                blake3: frame.blake3.to_hex().to_string(),
            };
            object.extend_from_slice(&frame.bytes);
        }
        f.stored_size = object.len() as u64;
        store
            .put(&a.data_key("step1", &f.path), object.into())
            .await
            .unwrap();
        rewritten += 1;
    }
    assert_eq!(rewritten, 2, "both tensors files are grouped");
    m.stored_bytes = m.files.iter().map(|f| f.stored_size).sum();
    m.version = 1;
    store
        .put(&a.manifest_key("step1"), m.to_json().into())
        .await
        .unwrap();
    assert_eq!(a.manifest("step1").await.unwrap().version, 1);
    assert_eq!(a.verify("step1").await.unwrap().files, 4);
    assert_eq!(restore_and_compare(&a, "step1", src.path()).await, m);
}

/// A chunk size that is not a power of two: the file hash is then computed in file order rather
/// than merged from the chunks' subtrees. Both must restore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_chunk_size_restores() {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    for (tag, chunk) in [("pow2", 64 << 10), ("odd", 68 << 10)] {
        let a = archiver(
            Arc::new(InMemory::new()),
            ArchiveConfig {
                chunk_size: chunk,
                ..small_cfg()
            },
        );
        publish_alone(&a, tag, src.path()).await;
        let m = restore_and_compare(&a, tag, src.path()).await;
        let weights = m.files.iter().find(|f| f.path == "model/weights.bf16");
        assert!(weights.unwrap().chunks.len() > 2, "{tag}");
    }
}

/// `sluice ckpt list --json` prints [`CheckpointInfo`] as it is: the state as one word, and the
/// reason beside it for an invalid checkpoint.
#[test]
fn a_listing_serialises_as_the_cli_prints_it() {
    let info = |state| CheckpointInfo {
        tag: "s1".into(),
        state,
        files: 2,
        raw_bytes: 10,
        stored_bytes: 5,
        ratio: Some(2.0),
        created_unix_ms: 7,
        job: None,
        nodes: vec!["n1".into()],
        data_classes: vec!["STANDARD_IA".into()],
        poison: None,
    };
    let v = serde_json::to_value(info(CheckpointState::Invalid {
        reason: "bad MANIFEST".into(),
    }))
    .unwrap();
    assert_eq!(v["state"], "invalid");
    assert_eq!(v["reason"], "bad MANIFEST");
    assert_eq!(
        (v["tag"].as_str(), v["files"].as_u64()),
        (Some("s1"), Some(2))
    );
    let v = serde_json::to_value(info(CheckpointState::Complete)).unwrap();
    assert_eq!(v["state"], "complete");
    assert!(v.get("reason").is_none());
    assert_eq!(v["data_classes"], serde_json::json!(["STANDARD_IA"]));
}

/// Issue 10, defect 1: a checkpoint only some of the job's nodes wrote (rank 0's `torch.save`) is
/// published once the other nodes answer the commit with empty parts; a part another job left
/// under the same tag never counts as this job's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_written_on_one_node_of_three_is_published() {
    let (src, store, _) = tree_and_store();
    let for_job = |id| archiver(store.clone(), small_cfg()).for_job(id);
    let (n1, n2, n3) = (for_job(7), for_job(7), for_job(7));
    let all = nodes(&["n1", "n2", "n3"]);
    // A part of n2 that an earlier job (6) left under the reused tag.
    let earlier = for_job(6);
    earlier.announce_commit("s1", "n2").await.unwrap();
    earlier.put_empty_part("s1", "n2").await.unwrap();
    assert!(
        n1.commits_of_job().await.unwrap().is_empty(),
        "job 6's commit is not job 7's"
    );

    n1.announce_commit("s1", "n1").await.unwrap();
    upload(&n1, "s1", "n1", src.path()).await.unwrap();
    assert_eq!(n2.commits_of_job().await.unwrap(), ["s1"]);
    assert_eq!(
        n1.try_publish("s1", &all, job()).await.unwrap(),
        Publish::Waiting {
            missing: nodes(&["n2", "n3"])
        },
        "n2's part is job 6's: it does not count"
    );
    n2.put_empty_part("s1", "n2").await.unwrap();
    n3.put_empty_part("s1", "n3").await.unwrap();
    let m = n1
        .try_publish("s1", &all, job())
        .await
        .unwrap()
        .into_manifest()
        .expect("every node answered");
    assert_eq!(
        m.nodes,
        ["n1"],
        "the MANIFEST names the node that holds files"
    );
    assert_eq!(m.files.len(), 4);
    assert!(
        n2.commits_of_job().await.unwrap().is_empty(),
        "published: nothing to answer"
    );
    // The job's notes live under `.jobs/7/`, found with one listing however many tags the prefix
    // holds, and go once the tag is published; `.jobs` is never taken for a tag.
    let keys: Vec<String> = store
        .list(None)
        .map_ok(|o| o.location.to_string())
        .try_collect()
        .await
        .unwrap();
    assert!(
        !keys.iter().any(|k| k.contains("/.jobs/7/")),
        "job 7's commit notes outlived the publish: {keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.ends_with("/.jobs/6/s1/n2.json")),
        "job 6's note is job 6's to remove: {keys:?}"
    );
    let tags: Vec<String> = n1
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.tag)
        .collect();
    assert_eq!(tags, ["s1"]);
    let restored = tempfile::tempdir().unwrap();
    let dest = Arc::new(safefs::open_root_dir(restored.path()).unwrap());
    let owner = Owner {
        uid: test_uid(),
        gid: nix::unistd::getegid().as_raw(),
    };
    n3.restore("s1", dest, owner, &ArchiveProgress::default())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(restored.path().join("model/weights.bf16")).unwrap(),
        std::fs::read(src.path().join("model/weights.bf16")).unwrap(),
        "a node that held nothing restores the whole checkpoint"
    );
}

mod resume;
mod tiering;

/// The agent's `sluice_failures_total{code}` words for archive errors: stable, whatever the message.
#[test]
fn error_codes_are_stable_words() {
    let store = ArchiveError::Store {
        url: "s3://b/".into(),
        op: "put",
        key: "k".into(),
        error: Box::new(object_store::Error::NotFound {
            path: "k".into(),
            source: "gone".into(),
        }),
    };
    assert_eq!(store.code(), "store_not_found");
    // A failed write says `no_space` when the disk (or the user's quota) is full.
    let write = |errno: nix::errno::Errno| ArchiveError::Write {
        tag: "t".into(),
        path: "p".into(),
        detail: errno.desc().into(),
        errno: Some(errno as i32),
    };
    assert_eq!(write(nix::errno::Errno::ENOSPC).code(), "no_space");
    assert_eq!(write(nix::errno::Errno::EDQUOT).code(), "no_space");
    assert_eq!(write(nix::errno::Errno::EACCES).code(), "write");
    // The words the variants' names give (derived): pinned, so a renamed variant cannot change them.
    let (s, t) = (String::new, || "t".to_string());
    #[rustfmt::skip]
    let derived = [
        (ArchiveError::BadUrl { url: s(), reason: s() }, "bad_url"),
        (ArchiveError::BadConfig(s()), "bad_config"),
        (ArchiveError::BadName { what: "tag", name: s() }, "bad_name"),
        (ArchiveError::Refused { tag: t(), path: s(), reason: s() }, "refused"),
        (ArchiveError::Modified { tag: t(), path: s() }, "modified"),
        (ArchiveError::Read { tag: t(), path: s(), detail: s() }, "read"),
        (ArchiveError::NotArchived { url: s(), tag: t() }, "not_archived"),
        (ArchiveError::BadManifest { url: s(), tag: t(), what: s(), reason: s() }, "bad_manifest"),
        (ArchiveError::Corrupt { url: s(), tag: t(), damaged: vec![] }, "corrupt"),
        (ArchiveError::Conflict { tag: t(), path: s(), nodes: (s(), s()) }, "conflict"),
        (ArchiveError::ManifestTooLarge { tag: t(), what: s(), size: 0 }, "manifest_too_large"),
        (ArchiveError::Stopped { tag: t() }, "stopped"),
        (ArchiveError::AlreadyPublished { url: s(), tag: t(), node: s() }, "already_published"),
        (ArchiveError::NotAsFlushed { tag: t(), damaged: vec![] }, "not_as_flushed"),
    ];
    for (error, code) in derived {
        assert_eq!(error.code(), code, "{error:?}");
    }
}
