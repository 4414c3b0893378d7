use super::*;

/// A config with a cache in `dir`; `min_free = 0`, so that how full the build machine's disk is
/// decides nothing here.
fn config(dir: &Path, cache: &str) -> Config {
    let text = format!(
        "[agent]\nsocket='{d}/s'\nstate_dir='{d}/st'\n[hot_tier]\nroot='{d}/hot'\n[cache]\nmin_free=0\n{cache}\n",
        d = dir.display()
    );
    std::fs::create_dir_all(dir.join("hot")).unwrap();
    Config::parse(&text, "n1", sluice_archive::upload_memory).unwrap()
}

/// The cache `cfg` configures (it has one), opened as the agent opens it at start.
fn open(cfg: &Config) -> Arc<Cache> {
    Cache::open(cfg).unwrap().unwrap()
}

/// An 8 MiB cache in a fresh temporary directory, opened: the directory, the config (to open it
/// again, as a restarted agent does) and the cache.
fn eight_mib() -> (tempfile::TempDir, Config, Arc<Cache>) {
    let t = tempfile::tempdir().unwrap();
    let cfg = config(t.path(), "size='8MiB'");
    let cache = open(&cfg);
    (t, cfg, cache)
}

fn key(name: &str, etag: &str, size: u64) -> Key {
    Key {
        url: format!("s3://bucket/{name}"),
        endpoint: None,
        etag: Some(etag.into()),
        version: None,
        size,
        posix: None,
    }
}

/// Fills an entry for `key` with `byte`, committed.
fn put(cache: &Arc<Cache>, key: &Key, byte: u8) -> Result<(), String> {
    let fill = cache.begin_fill(key.clone())?;
    fill.write_at(&vec![byte; key.size as usize], 0);
    assert!(fill.commit());
    Ok(())
}

fn read_hit(cache: &Arc<Cache>, key: &Key, dir: &Path) -> Option<Vec<u8>> {
    let hit = cache.lookup(key)?;
    let out = dir.join("out");
    let f = File::create(&out).unwrap();
    hit.copy_to(&f, None).unwrap();
    Some(std::fs::read(out).unwrap())
}

#[test]
fn a_committed_entry_is_hit_and_a_changed_object_misses() {
    let (t, _, cache) = eight_mib();
    let k = key("a", "\"e1\"", 1000);
    assert!(cache.lookup(&k).is_none());
    put(&cache, &k, 7).unwrap();
    assert_eq!(read_hit(&cache, &k, t.path()), Some(vec![7; 1000]));
    // Same URL, another ETag (the object was overwritten), or another size: a miss.
    assert!(cache.lookup(&key("a", "\"e2\"", 1000)).is_none());
    assert!(cache.lookup(&key("a", "\"e1\"", 999)).is_none());
    let s = cache.stats();
    assert_eq!(
        (s.hits, s.misses, s.hit_bytes, s.entries, s.used_bytes),
        (1, 3, 1000, 1, 1000)
    );
    // Entries are root's alone.
    let mode = std::fs::metadata(t.path().join("hot/cache"))
        .unwrap()
        .permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o700
    );
}

#[test]
fn a_fill_that_never_committed_is_never_served_even_after_a_restart() {
    let (t, cfg, cache) = eight_mib();
    let k = key("torn", "\"e\"", 4096);
    let fill = cache.begin_fill(k.clone()).unwrap();
    fill.write_at(&[1; 2048], 0);
    // A second fill of the same object while the first runs is refused, not doubled.
    assert!(cache.begin_fill(k.clone()).is_err());
    // The agent is killed here: nothing is renamed into data/, the fill file stays in fill/.
    std::mem::forget(fill);
    assert!(cache.lookup(&k).is_none());
    drop(cache);
    let cache = open(&cfg);
    assert!(cache.lookup(&k).is_none());
    assert_eq!(
        std::fs::read_dir(t.path().join("hot/cache/fill"))
            .unwrap()
            .count(),
        0
    );
    // An entry short of its key's size (torn data/ file) is removed when the agent starts.
    put(&cache, &k, 2).unwrap();
    let id = k.id();
    drop(cache);
    let data = t.path().join("hot/cache/data").join(&id);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(100)
        .unwrap();
    let cache = open(&cfg);
    assert!(cache.lookup(&k).is_none());
    assert!(!data.exists());
    // A tainted fill (the origin's bytes were not the listed version's) is not committed.
    let fill = cache.begin_fill(k.clone()).unwrap();
    fill.write_at(&[3; 4096], 0);
    fill.taint("the object changed");
    assert!(!fill.commit());
    assert!(cache.lookup(&k).is_none());
    // Nor one missing bytes.
    let fill = cache.begin_fill(k.clone()).unwrap();
    fill.write_at(&[3; 100], 0);
    assert!(!fill.commit());
    assert_eq!(cache.stats().used_bytes, 0);
}

#[test]
fn entries_survive_a_restart_with_their_last_use() {
    let (t, cfg, cache) = eight_mib();
    let (a, b) = (key("a", "1", 10), key("b", "1", 20));
    put(&cache, &a, 1).unwrap();
    put(&cache, &b, 2).unwrap();
    drop(cache);
    let cache = open(&cfg);
    assert_eq!(cache.stats().used_bytes, 30);
    assert_eq!(read_hit(&cache, &b, t.path()), Some(vec![2; 20]));
    let urls: Vec<String> = cache.entries(None).into_iter().map(|e| e.url).collect();
    assert_eq!(urls.len(), 2);
    assert_eq!(cache.entries(Some("s3://bucket/a")).len(), 1);
}

#[test]
fn filling_past_the_high_watermark_evicts_the_least_recently_used_down_to_the_low_one() {
    let t = tempfile::tempdir().unwrap();
    // 10 MiB, high 90 % = 9 MiB, low 50 % = 5 MiB.
    let cache = open(&config(
        t.path(),
        "size='10MiB'\nhigh_water=90\nlow_water=50",
    ));
    let mib = 1 << 20;
    let keys: Vec<Key> = (0..4)
        .map(|i| key(&format!("k{i}"), "1", 2 * mib))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        put(&cache, k, 1).unwrap();
        // Distinct last uses, oldest first.
        lock(&cache.state)
            .entries
            .get_mut(&k.id())
            .unwrap()
            .last_use = 1000 + i as u64;
    }
    assert_eq!(cache.stats().used_bytes, 8 * mib);
    // k0 is in use (a job copies it out): it stays whatever its age.
    let pinned = cache.lookup(&keys[0]).unwrap();
    // 8 + 2 > 9 MiB: evict to 5 - 2 = 3 MiB: k1, k2, k3 go.
    put(&cache, &key("new", "1", 2 * mib), 1).unwrap();
    let left: Vec<String> = cache.entries(None).into_iter().map(|e| e.url).collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.contains(&keys[0].url) && left.contains(&"s3://bucket/new".to_string()));
    let s = cache.stats();
    assert_eq!(
        (s.evictions, s.evicted_bytes, s.used_bytes),
        (3, 6 * mib, 4 * mib)
    );
    assert!(s.used_bytes <= s.high_water_bytes);
    // Larger than the high watermark: never cached.
    assert!(cache.begin_fill(key("huge", "1", 10 * mib)).is_err());
    // Everything in use: no room is made, the fill is refused.
    let p2 = cache.lookup(&key("new", "1", 2 * mib)).unwrap();
    put(&cache, &key("x", "1", 3 * mib), 1).unwrap();
    let p3 = cache.lookup(&key("x", "1", 3 * mib)).unwrap();
    let err = cache.begin_fill(key("y", "1", 4 * mib)).unwrap_err();
    assert!(err.contains("in use"), "{err}");
    drop((pinned, p2));
    // Evicting by prefix keeps what is in use.
    let e = cache.evict_prefix("s3://bucket/", true);
    assert_eq!((e.entries, e.in_use, e.dry_run), (2, 1, true));
    assert_eq!(cache.stats().entries, 3);
    let e = cache.evict_prefix("s3://bucket/", false);
    assert_eq!((e.entries, e.bytes, e.in_use), (2, 4 * mib, 1));
    drop(p3);
    assert_eq!(cache.yield_space(1), 3 * mib);
    assert_eq!(cache.stats().entries, 0);
}

#[test]
fn a_hit_copied_with_units_hashes_each_unit() {
    let (t, _, cache) = eight_mib();
    let k = key("u", "1", 10_000);
    let fill = cache.begin_fill(k.clone()).unwrap();
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    fill.write_at(&bytes[4000..], 4000);
    fill.write_at(&bytes[..4000], 0);
    assert!(fill.commit());
    let hit = cache.lookup(&k).unwrap();
    let f = File::create(t.path().join("u")).unwrap();
    let hashes = hit.copy_to(&f, Some(4096)).unwrap();
    assert_eq!(std::fs::read(t.path().join("u")).unwrap(), bytes);
    let want: Vec<blake3::Hash> = bytes.chunks(4096).map(blake3::hash).collect();
    assert_eq!(hashes, want);
}

/// Flips one byte of the entry file of `k` in `dir`'s cache, as root could.
fn flip(dir: &Path, k: &Key, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("hot/cache/data").join(k.id()))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 1], at).unwrap();
}

/// Issue 24: a committed entry is verified before it is served. One whose bytes changed on disk
/// since it was last verified (a byte flipped by root), or while the agent was down, is dropped,
/// not served: the job reads the origin. An entry of an agent that recorded no hash is removed at
/// start. Before, an entry was served on its size alone.
#[test]
fn an_entry_whose_bytes_changed_is_dropped_not_served() {
    let (t, cfg, cache) = eight_mib();
    let k = key("c", "\"e\"", 5000);
    let data = t.path().join("hot/cache/data").join(k.id());
    put(&cache, &k, 7).unwrap();
    assert_eq!(read_hit(&cache, &k, t.path()), Some(vec![7; 5000]));
    // Any later write is in a later clock tick than the entry's last change.
    std::thread::sleep(std::time::Duration::from_millis(30));
    flip(t.path(), &k, 4000);
    assert_eq!(read_hit(&cache, &k, t.path()), None, "not served");
    assert!(!data.exists(), "dropped");
    let s = cache.stats();
    assert_eq!((s.entries, s.used_bytes, s.hits, s.misses), (0, 0, 1, 1));

    // Changed while the agent was down: its first use after the start reads it whole.
    put(&cache, &k, 7).unwrap();
    drop(cache);
    flip(t.path(), &k, 0);
    let cache = open(&cfg);
    assert_eq!(cache.stats().entries, 1);
    assert!(cache.lookup_for_peer(&k).is_none(), "not served to a peer");
    assert!(!data.exists());
    put(&cache, &k, 7).unwrap();
    drop(cache);
    let cache = open(&cfg);
    assert_eq!(read_hit(&cache, &k, t.path()), Some(vec![7; 5000]));

    // An entry whose .meta holds its key but no hash (filled by an agent that kept none).
    drop(cache);
    std::fs::write(
        t.path().join(format!("hot/cache/data/{}.meta", k.id())),
        serde_json::to_vec(&k).unwrap(),
    )
    .unwrap();
    let cache = open(&cfg);
    assert_eq!(cache.stats().entries, 0);
    assert!(!data.exists());
}
