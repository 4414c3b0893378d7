//! Archive tiering: data objects are written in the configured storage class, everything listing,
//! publishing and restore read first stays in the default class, and the manifests say which
//! class each file's data went to. The in-memory store keeps the attributes each PUT and multipart
//! upload carried, so these tests see what the store was asked for; object_store turns the
//! attribute into `x-amz-storage-class` / `x-ms-access-tier` (the conformance suite checks the
//! real stores).

use super::*;
use object_store::Attribute;

/// The storage class the store was asked to keep `key` in; `None` = none was given.
async fn class_of(store: &InMemory, key: &str) -> Option<String> {
    let got = store
        .get(&ObjPath::from(key))
        .await
        .unwrap_or_else(|e| panic!("{key}: {e}"));
    got.attributes
        .get(&Attribute::StorageClass)
        .map(|v| v.as_ref().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_objects_get_the_class_and_manifests_stay_in_the_default() {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    let store = Arc::new(InMemory::new());
    let a = archiver(store.clone(), small_cfg())
        .for_job(job().job_id)
        .with_data_class(Some("STANDARD_IA".into()));
    assert_eq!(a.data_class(), Some("STANDARD_IA"));
    a.announce_commit("step10", "n1").await.unwrap();
    let note = "alice/run1/.jobs/7/step10/n1.json";
    assert_eq!(class_of(&store, note).await, None, "the commit note");
    let m = publish_alone(&a, "step10", src.path()).await;

    // Every data object, the multipart one (weights: above the 256 KiB part size) and the
    // single PUTs, the empty file's too, was stored with the class; the part manifest and
    // the MANIFEST without one.
    let weights = m
        .files
        .iter()
        .find(|f| f.path == "model/weights.bf16")
        .unwrap();
    assert!(weights.stored_size > small_cfg().part_size, "multipart");
    for f in &m.files {
        let key = format!("alice/run1/step10/data/{}", f.path);
        assert_eq!(
            class_of(&store, &key).await.as_deref(),
            Some("STANDARD_IA"),
            "{key}"
        );
        assert_eq!(
            f.storage_class.as_deref(),
            Some("STANDARD_IA"),
            "{}",
            f.path
        );
    }
    for key in [
        "alice/run1/step10/MANIFEST",
        "alice/run1/step10/parts/n1.json",
    ] {
        assert_eq!(class_of(&store, key).await, None, "{key}");
    }

    // `list` reads the class from the MANIFEST; the checkpoint restores as any other.
    let list = a.list().await.unwrap();
    assert_eq!(list[0].data_classes, ["STANDARD_IA"]);
    let json = serde_json::to_value(&list[0]).unwrap();
    assert_eq!(json["data_classes"], serde_json::json!(["STANDARD_IA"]));
    restore_and_compare(&a, "step10", src.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_class_nothing_is_asked_and_list_says_default() {
    let (src, store, a) = tree_and_store();
    let m = publish_alone(&a, "step10", src.path()).await;
    for f in &m.files {
        let key = format!("alice/run1/step10/data/{}", f.path);
        assert_eq!(class_of(&store, &key).await, None, "{key}");
    }
    // The MANIFEST is what it was before classes were recorded: no storage_class anywhere.
    let raw = store
        .get(&ObjPath::from("alice/run1/step10/MANIFEST"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&raw).contains("storage_class"),
        "{}",
        String::from_utf8_lossy(&raw)
    );
    assert_eq!(a.list().await.unwrap()[0].data_classes, ["default"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_shows_the_classes_of_partial_and_mixed_checkpoints() {
    let src = tempfile::tempdir().unwrap();
    write_tree(src.path());
    let store = Arc::new(InMemory::new());
    let cool = archiver(store.clone(), small_cfg()).with_data_class(Some("Cool".into()));
    let plain = archiver(store.clone(), small_cfg());
    // Partial: only n1's part is there; its class comes from the part manifest.
    upload(&cool, "step1", "n1", src.path()).await.unwrap();
    // Two nodes configured differently (an admin changing data_class between them).
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("rank1.pt"), b"rank one").unwrap();
    chown_tree(other.path(), test_uid());
    upload(&cool, "step2", "n1", src.path()).await.unwrap();
    upload(&plain, "step2", "n2", other.path()).await.unwrap();
    plain
        .try_publish("step2", &nodes(&["n1", "n2"]), job())
        .await
        .unwrap()
        .into_manifest()
        .expect("published");
    // A checkpoint without files has no data objects, hence no class.
    let empty = tempfile::tempdir().unwrap();
    chown_tree(empty.path(), test_uid());
    publish_alone(&cool, "step3", empty.path()).await;

    let list = plain.list().await.unwrap();
    let by_tag = |t: &str| list.iter().find(|c| c.tag == t).unwrap();
    assert_eq!(by_tag("step1").state, CheckpointState::Partial);
    assert_eq!(by_tag("step1").data_classes, ["Cool"]);
    assert_eq!(by_tag("step2").data_classes, ["Cool", "default"]);
    assert!(by_tag("step3").data_classes.is_empty());
    assert_eq!(
        class_of(&store, "alice/run1/step2/data/rank1.pt").await,
        None
    );
}
