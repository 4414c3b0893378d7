//! Test datasets and how trees of files are compared: the generated dataset, `sha256sum` listings
//! made the same way on the source and in a job's tasks, the listing script the tasks run, and
//! path → sha256 maps of whole trees with readable differences.

use super::cluster::{Cluster, run};
use super::jobs::{Job, task_file};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

// ---------------------------------------------------------------------------------- test datasets

/// The size of the large file: over 64 MiB and not a multiple of any part size, so ranged reads
/// have a short last part.
pub const BIG_FILE_SIZE: usize = 64 * 1024 * 1024 + 12_345;

/// Writes a dataset with what real datasets have and stagers get wrong: nested directories, an
/// empty file, one file over 64 MiB, a few hundred small files, names with spaces and non-ASCII.
/// Directories 0755, files 0644, owned by root: readable by the job user, owned by someone else.
/// With `big = false` the large file is left out (for tests about something else).
pub fn make_dataset(dir: &Path, big: bool) {
    let mut rng = SplitMix64(0x5_1u64 ^ dir.as_os_str().len() as u64);
    let mut write = |rel: &str, len: usize| {
        let path = dir.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        fs::write(&path, &data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    };
    if big {
        write("big/weights.bin", BIG_FILE_SIZE);
    }
    write("empty.txt", 0);
    write("nested/a/b/c/d/deep.txt", 1000);
    write("nested/a/sibling.bin", 70_000);
    write("names/with space.txt", 10);
    write("names/ünïcödé.txt", 11);
    for d in 0..10 {
        for f in 0..30 {
            write(
                &format!("small/shard-{d:02}/part-{f:03}.json"),
                (d * 131 + f * 17) % 4096 + 1,
            );
        }
    }
    let status = Command::new("chmod")
        .args(["-R", "u=rwX,go=rX"])
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success());
}

impl Cluster {
    /// A fresh test dataset (see [`make_dataset`]), `<data dir of test>/train`.
    pub fn dataset(&self, test: &str, big: bool) -> PathBuf {
        let dir = self.data_dir(test).join("train");
        make_dataset(&dir, big);
        dir
    }
}

/// `sha256  ./path` for every file under `dir`, sorted by path: the same command the job's tasks run
/// on their staged copy (see [`LISTING_SCRIPT`]), so the two compare byte for byte.
pub fn checksums(dir: &Path) -> String {
    run(Command::new("bash")
        .arg("-c")
        .arg(format!("cd '{}' && {SUMS_CMD}", dir.display())))
}

/// The directories under `dir` (relative, sorted), as the tasks list them.
pub fn directories(dir: &Path) -> String {
    run(Command::new("bash")
        .arg("-c")
        .arg(format!("cd '{}' && {DIRS_CMD}", dir.display())))
}

/// The shell command that lists `sha256  ./path` of every file below the current directory, sorted:
/// what job scripts run on their copy and [`checksums`] on the source.
pub const SUMS_CMD: &str = "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum";
/// The directories below the current directory, relative and sorted.
pub const DIRS_CMD: &str = "find . -mindepth 1 -type d | LC_ALL=C sort";

/// A batch script whose one task per node records what it sees of sluice in `<out>/<node>/`:
/// `env` (its SLUICE_* variables), `stage_dir`, for each dataset NAME `sums-NAME` and `dirs-NAME`,
/// `owners` (owner of every entry under the stage dir), `jobdir` (owner and mode of the job dir),
/// then `done`.
pub fn listing_script(out: &Path, names: &[&str]) -> String {
    let names = names.join(" ");
    format!(
        r#"#!/bin/bash
srun --ntasks-per-node=1 /bin/bash -c '
set -u
o="{out}/$SLURMD_NODENAME"
mkdir -p "$o"
env | grep "^SLUICE_" | LC_ALL=C sort > "$o/env"
echo "${{SLUICE_STAGE_DIR-<unset>}}" > "$o/stage_dir"
for name in {names}; do
  (cd "$SLUICE_STAGE_DIR/$name" && {SUMS_CMD}) > "$o/sums-$name" 2>&1
  (cd "$SLUICE_STAGE_DIR/$name" && {DIRS_CMD}) > "$o/dirs-$name" 2>&1
done
find "$SLUICE_STAGE_DIR" -printf "%u %P\n" > "$o/owners" 2>&1
stat -c "%U %a" "$SLUICE_STAGE_DIR/.." > "$o/jobdir" 2>&1
touch "$o/done"
'
"#,
        out = out.display()
    )
}

/// A dataset on local disk with what a job's listing of it must show (see [`listing_script`]):
/// its `sha256sum` listing and its directories; and its size in bytes.
pub struct Dataset {
    pub dir: PathBuf,
    pub sums: String,
    pub dirs: String,
    pub bytes: u64,
}

impl Dataset {
    /// The listings and size of the tree at `dir`, as it is now.
    pub fn of(dir: PathBuf) -> Dataset {
        Dataset {
            sums: checksums(&dir),
            dirs: directories(&dir),
            bytes: tree_bytes(&dir),
            dir,
        }
    }
}

/// Writes `len` random bytes to `path`, creating its directory.
pub fn random_file(path: &Path, len: u64) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    run(Command::new("bash")
        .arg("-c")
        .arg(format!("head -c {len} /dev/urandom > '{}'", path.display())));
}

/// `script` (a batch script), made to wait for the test's `go` file before anything else: so that
/// none of its tasks waits on an agent the test is about to take down.
pub fn waiting_for_go(script: &str, go: &Path) -> String {
    script.replacen(
        "#!/bin/bash\n",
        &format!(
            "#!/bin/bash\nwhile [ ! -e '{}' ]; do sleep 0.2; done\n",
            go.display()
        ),
        1,
    )
}

impl Cluster {
    /// A `sha256sum` listing `got` that `job` made is `want`; else panics with `what` (e.g. "the
    /// dataset on n1 differs from its source"), how the two differ, and the job's evidence.
    pub fn assert_same_listing(&self, job: &Job, want: &str, got: &str, what: &str) {
        assert!(
            got == want,
            "{what}: {}\n{}",
            diff_listings(want, got),
            self.evidence(job)
        );
    }

    /// What the task on `node` recorded of dataset `name` with [`listing_script`]: its `sha256sum`
    /// listing is `sums` and its directories are `dirs`.
    pub fn assert_dataset_listed(
        &self,
        job: &Job,
        out: &Path,
        node: &str,
        name: &str,
        sums: &str,
        dirs: &str,
    ) {
        let got = task_file(out, node, &format!("sums-{name}"));
        let what = format!("dataset {name} on {node} differs from its source");
        self.assert_same_listing(job, sums, &got, &what);
        assert_eq!(
            task_file(out, node, &format!("dirs-{name}")),
            dirs,
            "directories of dataset {name} on {node}"
        );
    }
}

/// Describes how two `sha256sum` listings differ (see [`diff_trees`]), and how the actual one
/// starts (a listing of error messages tells more than its differences).
pub fn diff_listings(expected: &str, actual: &str) -> String {
    format!(
        "{}\nthe listing starts with:\n{}",
        diff_trees(&parse_sums(expected), &parse_sums(actual)),
        actual.lines().take(5).collect::<Vec<_>>().join("\n")
    )
}

/// A small deterministic generator for test data (SplitMix64): incompressible enough that a
/// stager cannot get lucky, reproducible without a dependency.
pub(super) struct SplitMix64(pub(super) u64);

impl SplitMix64 {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// `sha256  ./path` lines (what [`SUMS_CMD`] prints) → path → hash. The path loses its `./`, so it
/// reads as [`hash_tree`]'s and a MANIFEST's paths do.
pub fn parse_sums(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once("  "))
        .map(|(h, p)| (p.trim_start_matches("./").to_string(), h.to_string()))
        .collect()
}

/// Every entry below `dir`: relative path → sha256 for regular files, a description otherwise.
pub fn hash_tree(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            let Ok(md) = fs::symlink_metadata(&p) else {
                continue; // removed meanwhile
            };
            if md.is_dir() {
                stack.push(p);
            } else if md.is_file() {
                let sum = run(Command::new("sha256sum").arg(&p));
                out.insert(rel, sum.split_whitespace().next().unwrap_or("").into());
            } else {
                out.insert(
                    rel,
                    format!(
                        "<{:?}, mode {:o}>",
                        md.file_type(),
                        std::os::unix::fs::MetadataExt::mode(&md)
                    ),
                );
            }
        }
    }
    out
}

/// How two path → hash maps differ: the counts, then (at most 10 of each) the paths missing, those
/// unexpected, and those with other content.
pub fn diff_trees(
    expected: &BTreeMap<String, String>,
    actual: &BTreeMap<String, String>,
) -> String {
    let (ek, ak): (BTreeSet<_>, BTreeSet<_>) = (expected.keys().collect(), actual.keys().collect());
    let missing: Vec<_> = ek.difference(&ak).take(10).collect();
    let extra: Vec<_> = ak.difference(&ek).take(10).collect();
    let changed: Vec<_> = expected
        .iter()
        .filter(|(p, h)| actual.get(*p).is_some_and(|a| a != *h))
        .map(|(p, h)| format!("{p}: {} instead of {h}", actual[p]))
        .take(10)
        .collect();
    format!(
        "{} files expected, {} found; missing: {missing:?}; unexpected: {extra:?}; other content: {changed:?}",
        expected.len(),
        actual.len()
    )
}

/// The names in a directory (empty if it is gone or unreadable).
pub fn entries(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every file below `dir`: relative path → size.
pub fn file_sizes(dir: &Path) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let md = e.metadata().unwrap();
            if md.is_dir() {
                stack.push(e.path());
            } else {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, md.len());
            }
        }
    }
    out
}

/// The bytes of every file below `dir`.
pub fn tree_bytes(dir: &Path) -> u64 {
    file_sizes(dir).values().sum()
}
