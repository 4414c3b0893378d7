//! The access rules against an in-memory archive: whose checkpoints a reader sees, the
//! refusals of a restore's directory, and damage found by verify and restore.

use super::*;
use crate::{ArchiveConfig, synth::fp32_values};
use object_store::ObjectStoreExt;
use object_store::memory::InMemory;
use object_store::path::Path as StorePath;
use sluice_core::safefs::{self, Owner};
use std::path::{Path, PathBuf};
use std::time::Duration;

const PREFIX: &str = "shared/run";

fn me() -> Owner {
    Owner {
        uid: nix::unistd::geteuid().as_raw(),
        gid: nix::unistd::getegid().as_raw(),
    }
}

fn user(name: &str) -> Reader {
    Reader::User(name.into())
}

/// Publishes `tag` as `owner`'s from node n1: `sub/model.bin` (enough data for several frames)
/// and `who`, which says whose it is.
async fn publish(a: &Archiver, tag: &str, owner: &str) {
    let src = tempfile::tempdir().unwrap();
    let sub = src.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("model.bin"), fp32_values(20_000, 1)).unwrap();
    std::fs::write(src.path().join("who"), format!("{tag} of {owner}")).unwrap();
    let fd = Arc::new(safefs::open_root_dir(src.path()).unwrap());
    let counters = ArchiveProgress::default();
    let part = a.upload_part(tag, "n1", fd, me().uid, &counters, None);
    part.await.unwrap();
    let (user, job_name) = (owner.to_string(), "train".to_string());
    let job = JobMeta {
        job_id: 7,
        user,
        job_name,
    };
    a.try_publish(tag, &["n1".into()], job).await.unwrap();
}

/// An in-memory archive in which alice published `a1` and then `a2`, bob `b1` in between.
async fn shared_archive() -> (Arc<InMemory>, Archiver) {
    let store = Arc::new(InMemory::new());
    let a = Archiver::new(store.clone(), PREFIX, ArchiveConfig::default()).unwrap();
    for (tag, owner) in [("a1", "alice"), ("b1", "bob"), ("a2", "alice")] {
        publish(&a, tag, owner).await;
        // MANIFEST times are in milliseconds: keep the order unambiguous.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (store, a)
}

/// Flips one byte in the middle of `tag`'s `sub/model.bin` data object.
async fn damage(store: &InMemory, tag: &str) {
    let key = StorePath::from(format!("{PREFIX}/{tag}/data/sub/model.bin"));
    let got = store.get(&key).await.unwrap();
    let mut bytes = got.bytes().await.unwrap().to_vec();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    store.put(&key, bytes.into()).await.unwrap();
}

fn empty_dir(tmp: &Path, name: &str) -> PathBuf {
    let p = tmp.join(name);
    std::fs::create_dir(&p).unwrap();
    p
}

fn destination(p: &Path) -> Destination {
    let fd = Arc::new(safefs::open_root_dir(p).unwrap());
    Destination::check(fd, me(), p.display().to_string()).unwrap()
}

/// Notes a [`Watch`] was told, and the labels it watched.
#[derive(Default)]
struct Seen {
    labels: Vec<String>,
    notes: Vec<String>,
}

impl Watch for Seen {
    async fn watch<F: Future>(&mut self, what: Reading<'_, F::Output>, work: F) -> F::Output {
        self.labels.push(what.label);
        work.await
    }

    fn note(&mut self, text: &str) {
        self.notes.push(text.to_string());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_checkpoint_reads_as_a_missing_one() {
    let (_, a) = shared_archive().await;
    let bob = user("bob");
    let missing = resolve(&a, &bob, "zz", &[]).await.unwrap_err();
    let foreign = resolve(&a, &bob, "a1", &[]).await.unwrap_err();
    assert_eq!(foreign.code(), ErrorCode::NotFound);
    assert_eq!(
        foreign.to_string().replace("a1", "TAG"),
        missing.to_string().replace("zz", "TAG"),
        "a foreign tag must be answered as a missing one"
    );
    assert_eq!(
        foreign.to_string(),
        format!("{}: no archived checkpoint a1 of yours", a.url())
    );
    // `latest` is the newest of the reader's own; root's is the archive's newest.
    assert_eq!(resolve(&a, &bob, LATEST, &[]).await.unwrap(), "b1");
    assert_eq!(
        resolve(&a, &user("alice"), LATEST, &[]).await.unwrap(),
        "a2"
    );
    assert_eq!(
        resolve(&a, &Reader::Anyone, LATEST, &[]).await.unwrap(),
        "a2"
    );
    let none = resolve(&a, &user("carol"), LATEST, &[]).await.unwrap_err();
    assert!(
        none.to_string()
            .ends_with("no complete checkpoint of yours to use as 'latest'"),
        "{none}"
    );
    let skip = ["a2".to_string(), "b1".to_string(), "a1".to_string()];
    let none = resolve(&a, &Reader::Anyone, LATEST, &skip)
        .await
        .unwrap_err();
    assert!(
        none.to_string()
            .ends_with(": no other complete checkpoint to use as 'latest'"),
        "{none}"
    );
    // A bad tag is the caller's mistake.
    let bad = resolve(&a, &Reader::Anyone, "a/b", &[]).await.unwrap_err();
    assert_eq!(bad.code(), ErrorCode::BadRequest);
    // Listing, verifying and planning follow the same rule.
    let tags = |l: Vec<CheckpointInfo>| l.into_iter().map(|i| i.tag).collect::<Vec<_>>();
    assert_eq!(tags(list(&a, &user("alice")).await.unwrap()), ["a1", "a2"]);
    assert_eq!(
        tags(list(&a, &Reader::Anyone).await.unwrap()),
        ["a1", "b1", "a2"]
    );
    assert!(verify(&a, &bob, "a1", &mut Unwatched).await.is_err());
    assert!(plan(&a, &bob, "a1", false).await.is_err());
    let p = plan(&a, &bob, LATEST, false).await.unwrap();
    assert_eq!((p.tag.as_str(), p.files), ("b1", 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_corrupted_part_and_restore_refuses_it() {
    let (store, a) = shared_archive().await;
    let mut seen = Seen::default();
    let v = verify(&a, &Reader::Anyone, "a2", &mut seen).await.unwrap();
    assert!(v.ok && v.files == 2 && v.damaged.is_empty(), "{v:?}");
    assert_eq!(seen.labels, ["verify a2"]);

    damage(&store, "a2").await;
    let alice = user("alice");
    let v = verify(&a, &alice, "a2", &mut Unwatched).await.unwrap();
    assert!(!v.ok, "{v:?}");
    assert_eq!(
        v.damaged.iter().map(|d| d.0.as_str()).collect::<Vec<_>>(),
        ["sub/model.bin"]
    );

    // A named damaged tag is not restored, and nothing is left behind.
    let tmp = tempfile::tempdir().unwrap();
    let dir = empty_dir(tmp.path(), "named");
    let e = restore(&a, &alice, "a2", false, &destination(&dir), &mut Unwatched)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is damaged: 'sub/model.bin'"), "{e}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // `latest` passes over it, says so, and restores alice's a1.
    let dir = empty_dir(tmp.path(), "latest");
    let mut seen = Seen::default();
    let r = restore(&a, &alice, LATEST, false, &destination(&dir), &mut seen)
        .await
        .unwrap();
    assert_eq!(
        (r.tag.as_str(), r.skipped.as_slice()),
        ("a1", ["a2".to_string()].as_slice())
    );
    assert_eq!(seen.labels, ["restore a2", "restore a1"]);
    assert!(
        seen.notes[0].starts_with("checkpoint a2 cannot be restored (")
            && seen.notes[0].ends_with("falling back to the next newest"),
        "{:?}",
        seen.notes
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("who")).unwrap(),
        "a1 of alice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_gives_only_the_readers_own_files_owned_by_them() {
    let (_, a) = shared_archive().await;
    let bob = user("bob");
    let tmp = tempfile::tempdir().unwrap();
    let dir = empty_dir(tmp.path(), "d");
    let e = restore(&a, &bob, "a1", false, &destination(&dir), &mut Unwatched)
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    let r = restore(&a, &bob, LATEST, false, &destination(&dir), &mut Unwatched)
        .await
        .unwrap();
    assert_eq!((r.tag.as_str(), r.files), ("b1", 2));
    use std::os::unix::fs::MetadataExt;
    let f = dir.join("sub/model.bin");
    assert_eq!(std::fs::metadata(&f).unwrap().uid(), me().uid);
    assert_eq!(
        std::fs::read_to_string(dir.join("who")).unwrap(),
        "b1 of bob"
    );
}

/// Every refusal of a restore's directory, on the descriptor (whatever path led to it), with the
/// words that say what to do.
#[test]
fn a_restores_directory_must_be_the_callers_own_empty_one_on_a_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let uid = me().uid;
    let open = |p: &Path| safefs::open_root_dir(p).unwrap();
    let empty = empty_dir(tmp.path(), "empty");
    assert_eq!(dest_refusal(&open(&empty), uid).unwrap(), None);
    // Someone else's.
    assert_eq!(
        dest_refusal(&open(&empty), uid + 1).unwrap(),
        Some(DestRefusal::Theirs(uid))
    );
    // Not empty, a hidden file too.
    let full = empty_dir(tmp.path(), "full");
    std::fs::write(full.join(".hidden"), b"x").unwrap();
    assert_eq!(
        dest_refusal(&open(&full), uid).unwrap(),
        Some(DestRefusal::NotEmpty)
    );
    // Not a directory.
    let file: OwnedFd = std::fs::File::create(tmp.path().join("f")).unwrap().into();
    assert_eq!(dest_refusal(&file, uid).unwrap(), Some(DestRefusal::NotDir));
    // Kernel file systems, even a directory the caller owns there (their /proc/PID).
    let mine = PathBuf::from(format!("/proc/{}", std::process::id()));
    assert_eq!(
        dest_refusal(&open(&mine), uid).unwrap(),
        Some(DestRefusal::KernelFs)
    );
    // sysfs, and a cgroup file system wherever it is mounted (under a tmpfs with cgroup v1).
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let cgroup = mounts
        .lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.len() > 2 && (f[2] == "cgroup" || f[2] == "cgroup2"))
        .map(|f| f[1].to_string());
    for kernel in ["/sys".to_string()].into_iter().chain(cgroup) {
        assert_eq!(
            dest_refusal(&open(Path::new(&kernel)), 0).unwrap(),
            Some(DestRefusal::KernelFs),
            "{kernel}"
        );
    }
    // As errors: forbidden, naming the destination and what to do.
    let e = Destination::check(Arc::new(open(&mine)), me(), "the destination").unwrap_err();
    assert_eq!(e.code(), ErrorCode::Forbidden);
    assert_eq!(
        e.to_string(),
        "the destination is on a kernel file system (proc, sys, cgroup); restore into a directory on a disk"
    );
    let e = Destination::check(Arc::new(open(&full)), me(), "/x/full").unwrap_err();
    assert_eq!(
        ErrorReply::from(e).message,
        "/x/full is not empty; give the path of a new or empty directory"
    );
    let words = |r: DestRefusal| r.message("D");
    assert_eq!(
        words(DestRefusal::Theirs(5)),
        "D belongs to uid 5; restore into a directory of your own"
    );
    assert_eq!(
        words(DestRefusal::NotDir),
        "D exists and is not a directory; give the path of a new or empty directory"
    );
    assert_eq!(
        words(DestRefusal::Symlink),
        "D is a symbolic link; give the path of a new or empty directory"
    );
}

#[test]
fn a_missing_file_archive_is_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::parse(
        "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n",
        "n1",
        crate::upload_memory,
    )
    .unwrap();
    let url = format!("file://{}/archive", dir.path().display());
    let e = open(&cfg, &url).err().unwrap();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert!(
        e.to_string()
            .ends_with("does not exist; nothing is archived there"),
        "{e}"
    );
    assert!(!dir.path().join("archive").exists());
    let e = open(&cfg, "ftp://x/y").err().unwrap();
    assert_eq!(e.code(), ErrorCode::BadRequest);
}

/// What the agent sends reads back as what the engine listed.
#[test]
fn a_listing_crosses_the_socket_intact() {
    let complete = CheckpointInfo {
        tag: "step1".into(),
        state: CheckpointState::Complete,
        files: 3,
        raw_bytes: 300,
        stored_bytes: 100,
        ratio: Some(3.0),
        created_unix_ms: 5,
        job: Some(JobMeta {
            job_id: 7,
            user: "alice".into(),
            job_name: "train".into(),
        }),
        nodes: vec!["n1".into()],
        data_classes: vec!["default".into()],
        poison: Some(mark("alice", 1000, "loss is NaN")),
    };
    let partial = CheckpointInfo {
        poison: None,
        state: CheckpointState::Partial,
        ratio: None,
        job: None,
        ..complete.clone()
    };
    let invalid = CheckpointInfo::invalid("x".into(), "truncated".into());
    for i in [complete, partial, invalid] {
        let wire = ArchivedCkpt::from(i.clone());
        assert_eq!(CheckpointInfo::from(wire), i);
    }
    let future = ArchivedCkpt {
        state: "frozen".into(),
        ..ArchivedCkpt::from(CheckpointInfo::invalid("y".into(), String::new()))
    };
    assert!(matches!(
        CheckpointInfo::from(future).state,
        CheckpointState::Invalid { reason } if reason.contains("frozen")
    ));
}

// ------------------------------------------------------------------------------ poisoned checkpoints

/// Alice (uid 1000) poisons `tag` by its archive URL (no tag without a MANIFEST).
async fn alice_poisons(a: &Archiver, tag: &str, reason: &str) -> Result<CkptPoisoned, AccessError> {
    poison(a, &user("alice"), tag, mark("alice", 1000, reason), false).await
}

fn mark(user: &str, uid: u32, reason: &str) -> PoisonMark {
    PoisonMark {
        user: user.into(),
        uid,
        at_unix_ms: 1_700_000_000_000,
        reason: reason.into(),
    }
}

/// The mark travels as written, is never replaced (the first reason stands), changes nothing of
/// the checkpoint, and shows in listings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_mark_is_written_once_and_listed() {
    let (store, a) = shared_archive().await;
    let before = a.manifest("a2").await.unwrap();
    let objects = |s: Arc<InMemory>| async move {
        let prefix = StorePath::from(format!("{PREFIX}/a2/data"));
        use futures::TryStreamExt;
        use object_store::ObjectStore;
        let mut all: Vec<_> = s
            .list(Some(&prefix))
            .map_ok(|o| (o.location, o.e_tag))
            .try_collect::<Vec<_>>()
            .await
            .unwrap();
        all.sort();
        all
    };
    let data_before = objects(store.clone()).await;
    let first = alice_poisons(&a, "a2", "loss is NaN at step 3")
        .await
        .unwrap();
    assert!(!first.already && !first.unpublished, "{first:?}");
    assert_eq!(first.mark.reason, "loss is NaN at step 3");
    assert_eq!(a.poison_mark("a2").await.unwrap(), Some(first.mark.clone()));
    // A second poison keeps the first mark, and says so.
    let second = alice_poisons(&a, "a2", "another reason").await.unwrap();
    assert!(second.already);
    assert_eq!(second.mark, first.mark);
    // The data and the MANIFEST are as they were.
    assert_eq!(a.manifest("a2").await.unwrap(), before);
    assert_eq!(objects(store.clone()).await, data_before);
    let listed = list(&a, &user("alice")).await.unwrap();
    let poisoned: Vec<_> = listed
        .iter()
        .map(|i| (i.tag.as_str(), i.poison.as_ref().map(|p| p.reason.as_str())))
        .collect();
    assert_eq!(
        poisoned,
        [("a1", None), ("a2", Some("loss is NaN at step 3"))]
    );
    // What the engine describes.
    let text = crate::poison::describe(&first.mark);
    assert_eq!(
        text,
        "marked bad by alice (uid 1000) at 2023-11-14T22:13:20Z: loss is NaN at step 3"
    );
}

/// `latest` passes over a poisoned checkpoint, saying why; a named restore of it is refused
/// (nothing written) unless forced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_skips_a_poisoned_checkpoint_and_a_named_restore_needs_force() {
    let (_, a) = shared_archive().await;
    let alice = user("alice");
    poison(&a, &alice, "a2", mark("alice", 1000, "loss is NaN"), false)
        .await
        .unwrap();
    assert_eq!(resolve(&a, &alice, LATEST, &[]).await.unwrap(), "a1");
    assert_eq!(a.latest(&[]).await.unwrap().as_deref(), Some("b1"));
    let tmp = tempfile::tempdir().unwrap();
    let dir = empty_dir(tmp.path(), "latest");
    let mut seen = Seen::default();
    let r = restore(&a, &alice, LATEST, false, &destination(&dir), &mut seen)
        .await
        .unwrap();
    assert_eq!(r.tag, "a1");
    let said = format!(
        "checkpoint a2 in {} is poisoned (marked bad by alice (uid 1000) at 2023-11-14T22:13:20Z: loss is NaN); skipped it for the next newest",
        a.url()
    );
    assert_eq!(seen.notes, std::slice::from_ref(&said));
    assert_eq!(r.notes, [said]);
    assert_eq!(
        std::fs::read_to_string(dir.join("who")).unwrap(),
        "a1 of alice"
    );
    // Named: refused, the destination left empty; the plan says the same.
    let dir = empty_dir(tmp.path(), "named");
    let e = restore(&a, &alice, "a2", false, &destination(&dir), &mut Unwatched)
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Forbidden);
    let text = e.to_string();
    assert!(
        text.contains("checkpoint a2 is poisoned (marked bad by alice")
            && text.contains("sluice ckpt restore --force, or --ckpt-restore=a2!"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    assert!(matches!(
        plan(&a, &alice, "a2", false).await,
        Err(AccessError::Poisoned { .. })
    ));
    // Forced: restored, with a note that says what it was.
    let r = restore(&a, &alice, "a2", true, &destination(&dir), &mut Unwatched)
        .await
        .unwrap();
    assert_eq!(r.tag, "a2");
    assert!(
        r.notes[0].ends_with("loss is NaN); restored anyway, as forced"),
        "{:?}",
        r.notes
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("who")).unwrap(),
        "a2 of alice"
    );
    // Nothing of alice's left but poisoned ones: `latest` says there is no other.
    poison(&a, &alice, "a1", mark("alice", 1000, "bad data"), false)
        .await
        .unwrap();
    let none = resolve(&a, &alice, LATEST, &[]).await.unwrap_err();
    assert!(
        none.to_string()
            .ends_with("no other complete checkpoint of yours to use as 'latest'"),
        "{none}"
    );
}

/// Only the owner (or root) poisons: another user's tag reads as missing and gets no mark; a
/// mark someone else put there does not count, and says so rather than hide the owner's poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_poisons_and_a_foreign_mark_does_not_count() {
    let (store, a) = shared_archive().await;
    let e = poison(&a, &user("bob"), "a2", mark("bob", 1001, "mine now"), false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    assert!(
        e.to_string()
            .ends_with("no archived checkpoint a2 of yours"),
        "{e}"
    );
    assert_eq!(a.poison_mark("a2").await.unwrap(), None);
    // Bob, who can write the prefix, puts a mark there himself: it does not count.
    a.poison("a2", mark("bob", 1001, "mine now")).await.unwrap();
    assert_eq!(a.poison_of("a2").await.unwrap(), None);
    assert_eq!(
        resolve(&a, &user("alice"), LATEST, &[]).await.unwrap(),
        "a2"
    );
    let e = poison(&a, &user("alice"), "a2", mark("alice", 1000, "NaN"), false)
        .await
        .unwrap_err();
    assert!(matches!(e, AccessError::ForeignMark { .. }), "{e}");
    assert!(
        e.to_string().contains("ask your admin to remove a2/POISON"),
        "{e}"
    );
    // A tag with no MANIFEST: only for a caller who knows it is theirs (the job that committed it).
    let e = poison(&a, &user("alice"), "a3", mark("alice", 1000, "NaN"), false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    let early = poison(
        &a,
        &user("alice"),
        "a3",
        mark("alice", 1000, "NaN early"),
        true,
    )
    .await
    .unwrap();
    assert!(early.unpublished && !early.already);
    // Its MANIFEST comes later: the mark was waiting for it, and `latest` never takes it.
    publish(&a, "a3", "alice").await;
    assert_eq!(
        a.poison_of("a3").await.unwrap().map(|m| m.reason),
        Some("NaN early".into())
    );
    assert_eq!(
        resolve(&a, &user("alice"), LATEST, &[]).await.unwrap(),
        "a2"
    );
    // `latest` and empty reasons are refused before anything is written.
    let e = poison(&a, &Reader::Anyone, LATEST, mark("root", 0, "x"), true)
        .await
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::BadRequest);
    let e = poison(&a, &Reader::Anyone, "a1", mark("root", 0, " "), true)
        .await
        .unwrap_err();
    assert!(e.to_string().starts_with("give a reason"), "{e}");
    let e = poison(
        &a,
        &Reader::Anyone,
        "a1",
        mark("root", 0, "two\nlines"),
        true,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("one line"), "{e}");
    assert_eq!(a.poison_mark("a1").await.unwrap(), None);
    drop(store);
}
