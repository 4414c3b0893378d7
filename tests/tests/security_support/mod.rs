//! What the security tests share on top of `common`: speaking the agent's socket protocol byte by
//! byte as an unprivileged user (a small Python client, since the test process is root and the
//! agent authorises from `SO_PEERCRED`), jobs held running while a test acts, and root-only secrets.

use crate::common::*;
use serde_json::{Value, json};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Connects to an agent socket once per case and sends exactly the bytes the case describes, then
/// reads one reply frame. Reads a JSON spec on stdin, prints one JSON result per case on stdout.
///
/// A case is `{"name", "request"}` (a well-formed frame, version `version` or 1), or raw bytes:
/// `header` (the u32 length to announce), `body` (text), `body_repeat` ([byte, count]),
/// `shutdown` (half-close after sending). The result holds the parsed `reply` (or `reply_error`),
/// any `send_error`, and `raw` (the reply's first bytes as text when it is not JSON).
pub const RAW_CLIENT: &str = r#"
import json, socket, struct, sys

def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed after %d of %d bytes" % (len(buf), n))
        buf += chunk
    return buf

spec = json.load(sys.stdin)
results = []
for case in spec["cases"]:
    r = {"name": case["name"]}
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(case.get("timeout", 20))
        s.connect(spec["socket"])
        if "request" in case:
            body = json.dumps({"version": case.get("version", 1), "request": case["request"]}).encode()
            data = struct.pack(">I", len(body)) + body
        else:
            body = case.get("body", "").encode()
            if "body_repeat" in case:
                body += bytes([case["body_repeat"][0]]) * case["body_repeat"][1]
            header = case.get("header", len(body))
            data = struct.pack(">I", header) + body
        try:
            s.sendall(data)
        except OSError as e:
            r["send_error"] = type(e).__name__
        if case.get("shutdown"):
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        try:
            n = struct.unpack(">I", recv_exact(s, 4))[0]
            raw = recv_exact(s, n)
            try:
                r["reply"] = json.loads(raw)
            except ValueError:
                r["raw"] = raw[:200].decode("utf-8", "replace")
        except Exception as e:
            r["reply_error"] = "%s: %s" % (type(e).__name__, e)
        s.close()
    except Exception as e:
        r["connect_error"] = "%s: %s" % (type(e).__name__, e)
    results.append(r)
print(json.dumps(results))
"#;

/// One reply of [`raw_requests`].
#[derive(Debug, Clone)]
pub struct RawReply {
    pub name: String,
    pub value: Value,
}

impl RawReply {
    /// `(code, message)` of an error reply; `None` if the agent answered something else.
    pub fn error(&self) -> Option<(String, String)> {
        let reply = self.value.get("reply")?;
        if reply.get("result")? != "error" {
            return None;
        }
        Some((
            reply.get("code")?.as_str()?.to_string(),
            reply.get("message")?.as_str()?.to_string(),
        ))
    }

    pub fn result(&self) -> Option<&str> {
        self.value.get("reply")?.get("result")?.as_str()
    }
}

/// Sends `cases` (see [`RAW_CLIENT`]) to `socket` as `user`, one connection each.
pub fn raw_requests(cluster: &Cluster, user: &str, socket: &Path, cases: Value) -> Vec<RawReply> {
    let spec = json!({ "socket": socket, "cases": cases });
    let out = cluster.as_someone(
        user,
        Path::new("/"),
        "/usr/bin/python3",
        &["-c", RAW_CLIENT],
        Some(&spec.to_string()),
    );
    assert!(
        out.status.success(),
        "the raw socket client failed as {user}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "raw client output is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    results
        .into_iter()
        .map(|v| RawReply {
            name: v["name"].as_str().unwrap_or("?").to_string(),
            value: v,
        })
        .collect()
}

/// A job of the test user on one node whose single task runs `before` (bash), tells the test it is
/// there and waits until the test lets it go on ([`HeldJob::release`], at most 3 minutes), then
/// runs `after`: for tests that act while a job runs. Neither part may hold a single quote.
pub struct HeldJob {
    pub job: Job,
    go: PathBuf,
}

impl HeldJob {
    /// Submits it on `node` (with `args` besides) from `work`, and waits until its task is ready.
    pub fn start(
        cluster: &Cluster,
        work: &Path,
        node: &str,
        args: &[&str],
        before: &str,
        after: &str,
    ) -> HeldJob {
        let (ready, go) = (work.join("ready"), work.join("go"));
        let script = format!(
            "#!/bin/bash\nsrun -N1 -n1 bash -c '\n{before}\ntouch {ready}\n\
             for i in $(seq 900); do [ -e {go} ] && break; sleep 0.2; done\n{after}\n'\n",
            ready = ready.display(),
            go = go.display()
        );
        let nodelist = format!("--nodelist={node}");
        let mut all = vec!["-N1", nodelist.as_str()];
        all.extend_from_slice(args);
        let job = cluster.submit(work, &all, &script);
        cluster.wait_for(
            &format!("the task of job {} to be ready on {node}", job.id),
            Duration::from_secs(240),
            Some(&job),
            || ready.exists(),
        );
        HeldJob { job, go }
    }

    /// [`HeldJob::start`] of a job that also stages a dataset `ds` of one file, `file` with
    /// `content`, from a fresh POSIX directory.
    pub fn staging(
        cluster: &Cluster,
        work: &Path,
        node: &str,
        (file, content): (&str, &[u8]),
        before: &str,
        after: &str,
    ) -> HeldJob {
        let data = cluster.data_dir("held");
        fs::write(data.join(file), content).unwrap();
        let stage_in = format!("--stage-in=ds={}", data.display());
        HeldJob::start(cluster, work, node, &[&stage_in], before, after)
    }

    /// Lets the task go on and waits for the job to end.
    pub fn release(&self, cluster: &Cluster) -> JobEnd {
        fs::write(&self.go, b"").unwrap();
        cluster.wait_end(&self.job, Duration::from_secs(240))
    }
}

/// A root-only file (0600) with unique content, outside every job tree: what a hostile job tries to
/// make root read. Returns its path and content.
pub fn root_secret(cluster: &Cluster, test: &str) -> (PathBuf, String) {
    let dir = PathBuf::from(cluster.var("SLUICE_TEST_ROOT"));
    let u = unique();
    let path = dir.join(format!("secret-{test}-{u}"));
    let content = format!("ROOT-ONLY-SECRET-{u}-{}\n", "s".repeat(64));
    fs::write(&path, &content).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    (path, content)
}

/// The file's bytes still are `content` and it is still root's, mode 0600.
pub fn assert_secret_intact(path: &Path, content: &str) {
    use std::os::unix::fs::MetadataExt;
    let md = fs::symlink_metadata(path).unwrap();
    assert!(md.is_file(), "{} is no longer a plain file", path.display());
    assert_eq!(
        (md.uid(), md.mode() & 0o7777),
        (0, 0o600),
        "{} changed owner or mode",
        path.display()
    );
    assert_eq!(fs::read_to_string(path).unwrap(), content);
}

/// `stat -c '%U %a'` of a path, as root.
pub fn owner_mode(path: &Path) -> String {
    run(Command::new("stat").args(["-c", "%U %a"]).arg(path))
        .trim()
        .to_string()
}

/// Whether a byte string occurs in another.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

/// Every file below `dir` (recursively) whose bytes contain `needle`.
pub fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return hits;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(md) = fs::symlink_metadata(&p) else {
            continue;
        };
        if md.is_dir() {
            hits.extend(files_containing(&p, needle));
        } else if md.is_file() && fs::read(&p).is_ok_and(|b| contains(&b, needle)) {
            hits.push(p);
        }
    }
    hits
}
