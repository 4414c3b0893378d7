//! Who may talk to whom: the cluster secret, the per-job key derived from it, and the MACs on
//! every peer request and response.
//!
//! - The **cluster secret** is a root-only file, the same on every node (like `munge.key`): at
//!   least 32 random bytes, a regular file owned by root with mode 0600 (no group or other bits).
//!   [`ClusterSecret::load`] refuses anything else with a message that says what to fix, so a
//!   peer server never starts on a secret a user could have read.
//! - A **job key** is `BLAKE3-derive_key("sluice peer v1", secret ‖ job id ‖ sorted node list)`:
//!   only agents (root, holding the secret) can compute it, and a key is good for one job on one
//!   node list only. No key is ever sent.
//! - A **request** carries the job id (in its path), the requesting node, a timestamp and a MAC
//!   (keyed BLAKE3 with the job key) over method, path and query, job id, node and timestamp.
//! - A **response** to an authenticated request carries a MAC over its status, the job, the unit
//!   (file, offset, length), the unit's BLAKE3 hash (for data) or the reason (for an error), and
//!   the request's MAC, so the requester knows the answer came from an agent of the job and was
//!   meant for this request; the body's hash is then checked against the MAC'd hash.
//!
//! Every field of a MAC'd message is length-prefixed, and requests and responses use different
//! labels, so no message can be read as another. MACs are compared as [`blake3::Hash`]es, whose
//! equality is constant-time.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::Unit;
use sluice_proto::msg::JobId;

/// The context of job-key derivation; a new version of the peer protocol changes it.
const JOB_KEY_CONTEXT: &str = "sluice peer v1";
const REQUEST_LABEL: &[u8] = b"sluice peer request v1";
const RESPONSE_LABEL: &[u8] = b"sluice peer response v1";

/// The context of the admin key's derivation: never a job key's, so neither MACs as the other.
const ADMIN_KEY_CONTEXT: &str = "sluice peer admin v1";
const ADMIN_REQUEST_LABEL: &[u8] = b"sluice admin request v1";
const ADMIN_RESPONSE_LABEL: &[u8] = b"sluice admin response v1";

/// Fewer bytes than this are not a secret worth the name (BLAKE3's key is 32 bytes).
pub const MIN_SECRET_LEN: usize = 32;
/// A secret file larger than this is not a key file (read no further).
const MAX_SECRET_LEN: u64 = 64 << 10;

/// Request headers: the requesting node, its clock (seconds since the epoch) and the MAC.
pub const NODE_HEADER: &str = "x-sluice-node";
pub const TIME_HEADER: &str = "x-sluice-time";
pub const MAC_HEADER: &str = "x-sluice-mac";
/// Response header: the unit's BLAKE3 hash (hex) as the owner read it from the origin.
pub const HASH_HEADER: &str = "x-sluice-blake3";
/// Response header, present (`1`) when the unit's hash is not of an origin read but of a read-back
/// of the serving node's staged copy ([`crate::HashFrom::ReadBack`]). It is MAC'd: the
/// response MAC of a `200` covers [`READ_BACK_MARK`] in place of the (empty) reason, so stripping
/// or adding the header fails the MAC.
pub const READ_BACK_HEADER: &str = "x-sluice-read-back";
/// What a `200`'s response MAC covers in the reason's place when its hash is a read-back's.
pub const READ_BACK_MARK: &[u8] = b"read back";

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the peer secret {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the peer secret {path} is not a regular file — it must be a file of random bytes")]
    NotAFile { path: PathBuf },
    #[error(
        "the peer secret {path} belongs to uid {uid}, not {expected} — it must be root's own file (chown root:root {path})"
    )]
    Owner {
        path: PathBuf,
        uid: u32,
        expected: u32,
    },
    #[error(
        "the peer secret {path} has mode {mode:04o}: group or others may read or change it — run chmod 0600 {path}; peer transfers stay off until then"
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error(
        "the peer secret {path} holds {len} bytes; it needs at least {MIN_SECRET_LEN} random bytes (e.g. dd if=/dev/urandom of={path} bs=32 count=1), the same file on every node"
    )]
    TooShort { path: PathBuf, len: usize },
    #[error("the peer secret {path} is larger than {MAX_SECRET_LEN} bytes; it is not a key file")]
    TooLong { path: PathBuf },
}

/// The cluster secret, read once. Only its derived keys leave this type.
#[derive(Clone)]
pub struct ClusterSecret {
    bytes: Vec<u8>,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// Reads the secret at `path`, which must be a regular file owned by root, mode 0600 or
    /// stricter, of at least [`MIN_SECRET_LEN`] bytes. Never follows a symlink.
    pub fn load(path: &Path) -> Result<ClusterSecret, SecretError> {
        ClusterSecret::load_owned_by(path, 0)
    }

    /// [`load`](Self::load) with the required owner given, so that tests running as an ordinary
    /// user check the same rules on their own files. The agent always uses uid 0.
    pub fn load_owned_by(path: &Path, owner: u32) -> Result<ClusterSecret, SecretError> {
        let read = |source| SecretError::Read {
            path: path.into(),
            source,
        };
        // O_NOFOLLOW: a symlink is refused, not followed; every check is on the opened file.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(path)
            .map_err(read)?;
        let meta = file.metadata().map_err(read)?;
        if !meta.is_file() {
            return Err(SecretError::NotAFile { path: path.into() });
        }
        if meta.uid() != owner {
            return Err(SecretError::Owner {
                path: path.into(),
                uid: meta.uid(),
                expected: owner,
            });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(SecretError::Mode {
                path: path.into(),
                mode,
            });
        }
        let mut bytes = Vec::new();
        file.take(MAX_SECRET_LEN + 1)
            .read_to_end(&mut bytes)
            .map_err(read)?;
        if bytes.len() as u64 > MAX_SECRET_LEN {
            return Err(SecretError::TooLong { path: path.into() });
        }
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort {
                path: path.into(),
                len: bytes.len(),
            });
        }
        Ok(ClusterSecret { bytes })
    }

    /// A secret from bytes already in hand (tests, and a future secret from another source).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> ClusterSecret {
        ClusterSecret {
            bytes: bytes.into(),
        }
    }

    /// The key of `job` on `nodes` (the job's whole node list, in any order, duplicates ignored).
    pub fn job_key(&self, job: JobId, nodes: &[String]) -> JobKey {
        let mut nodes = nodes.to_vec();
        nodes.sort();
        nodes.dedup();
        let job_text = job.to_string();
        let count = (nodes.len() as u64).to_le_bytes();
        let mut parts: Vec<&[u8]> = vec![&self.bytes, job_text.as_bytes(), &count];
        parts.extend(nodes.iter().map(|n| n.as_bytes()));
        let key = MacKey::derive(JOB_KEY_CONTEXT, &parts);
        JobKey { job, nodes, key }
    }
}

impl ClusterSecret {
    /// The admin key: what one agent MACs an admin request to another with (`sluice cache warm
    /// --nodes`, which root asks of its own agent), `BLAKE3-derive_key("sluice peer admin v1",
    /// secret)`. Only root on a node holding the secret can compute it; it is never sent, and no
    /// job key is ever it.
    pub fn admin_key(&self) -> AdminKey {
        AdminKey {
            key: MacKey::derive(ADMIN_KEY_CONTEXT, &[&self.bytes]),
        }
    }
}

/// Feeds `parts` to `h`, each after its length (so no two lists of parts hash alike), and
/// finishes: what every key derivation and every MAC of this module hashes through.
fn hash_parts(mut h: blake3::Hasher, parts: &[&[u8]]) -> blake3::Hash {
    for part in parts {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize()
}

/// The 32 bytes of a derived key and the keyed BLAKE3 MAC made with them: the one MAC code of
/// both roles. Private, so only [`AdminKey`] and [`JobKey`] hold one, and neither can stand where
/// the other is expected. Its `Debug` never shows the bytes.
///
/// ```compile_fail
/// fn answer_job(_: &sluice_peer::JobKey) {}
/// let admin = sluice_peer::ClusterSecret::from_bytes([7u8; 32]).admin_key();
/// answer_job(&admin); // an admin key is never a job key
/// ```
#[derive(Clone)]
struct MacKey([u8; 32]);

impl MacKey {
    /// `BLAKE3-derive_key(context, parts)`, the parts length-prefixed.
    fn derive(context: &str, parts: &[&[u8]]) -> MacKey {
        MacKey(*hash_parts(blake3::Hasher::new_derive_key(context), parts).as_bytes())
    }

    /// The keyed BLAKE3 hash of `parts`, length-prefixed. Compare MACs as [`blake3::Hash`]es,
    /// whose equality is constant-time.
    fn mac(&self, parts: &[&[u8]]) -> blake3::Hash {
        hash_parts(blake3::Hasher::new_keyed(&self.0), parts)
    }

    /// The MAC of a request: `label`, then what the request is (method, path and query, and
    /// for a job key the job), then who sent it when.
    fn request_mac(&self, label: &[u8], request: &[&[u8]], node: &str, time: u64) -> blake3::Hash {
        let time = time.to_string();
        let mut parts = vec![label];
        parts.extend_from_slice(request);
        parts.extend([node.as_bytes(), time.as_bytes()]);
        self.mac(&parts)
    }
}

impl std::fmt::Debug for MacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("..")
    }
}

/// A key that MACs requests: what [`crate::PeerClient`] signs a request with, whichever
/// role the key has.
pub trait RequestKey {
    /// The MAC of a request from `node` at `time`: `pq`, its path and query exactly as it is
    /// sent (percent-encoded).
    fn request_mac(&self, method: &str, pq: &str, node: &str, time: u64) -> blake3::Hash;
}

/// The key of admin requests between agents (see [`ClusterSecret::admin_key`]).
#[derive(Clone)]
pub struct AdminKey {
    key: MacKey,
}

impl std::fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminKey(..)")
    }
}

impl RequestKey for AdminKey {
    fn request_mac(&self, method: &str, pq: &str, node: &str, time: u64) -> blake3::Hash {
        let request = [method, pq].map(str::as_bytes);
        self.key
            .request_mac(ADMIN_REQUEST_LABEL, &request, node, time)
    }
}

impl AdminKey {
    /// The MAC of the answer with `status` and `body` to the request whose MAC was `request`.
    pub fn response_mac(&self, status: u16, body: &[u8], request: &blake3::Hash) -> blake3::Hash {
        self.key.mac(&[
            ADMIN_RESPONSE_LABEL,
            status.to_string().as_bytes(),
            body,
            request.as_bytes(),
        ])
    }
}

/// The key of one job on one node list; what both sides of a peer transfer MAC with.
#[derive(Clone)]
pub struct JobKey {
    job: JobId,
    /// Sorted, without duplicates.
    nodes: Vec<String>,
    key: MacKey,
}

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobKey")
            .field("job", &self.job)
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

impl JobKey {
    pub fn job(&self) -> JobId {
        self.job
    }

    /// The job's nodes, sorted.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    pub fn has_node(&self, node: &str) -> bool {
        self.nodes
            .binary_search_by(|n| n.as_str().cmp(node))
            .is_ok()
    }

    /// The same key without the node list (which [`has_node`](Self::has_node) then finds
    /// empty): what the peer server keeps of an ended job, to MAC its `410` answers.
    pub(crate) fn without_nodes(&self) -> JobKey {
        JobKey {
            job: self.job,
            nodes: Vec::new(),
            key: self.key.clone(),
        }
    }

    /// The MAC of a response with `status` to the request whose MAC was `request`: for a unit's
    /// data `hash` is its BLAKE3 hash and `reason` empty; for an error `hash` is `None` and
    /// `reason` the text of the body.
    pub fn response_mac(
        &self,
        status: u16,
        unit: &Unit,
        hash: Option<&blake3::Hash>,
        reason: &[u8],
        request: &blake3::Hash,
    ) -> blake3::Hash {
        let hash = hash.map(|h| h.as_bytes().to_vec()).unwrap_or_default();
        self.key.mac(&[
            RESPONSE_LABEL,
            status.to_string().as_bytes(),
            self.job.to_string().as_bytes(),
            unit.file.as_bytes(),
            unit.offset.to_string().as_bytes(),
            unit.len.to_string().as_bytes(),
            &hash,
            reason,
            request.as_bytes(),
        ])
    }
}

impl RequestKey for JobKey {
    fn request_mac(&self, method: &str, pq: &str, node: &str, time: u64) -> blake3::Hash {
        let job = self.job.to_string();
        let request = [method, pq, &job].map(str::as_bytes);
        self.key.request_mac(REQUEST_LABEL, &request, node, time)
    }
}

/// Parses a hex MAC or hash header; `None` when absent or malformed.
pub(crate) fn parse_hash(v: Option<&hyper::header::HeaderValue>) -> Option<blake3::Hash> {
    blake3::Hash::from_hex(v?.as_bytes()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn nodes(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn secret_file(dir: &Path, bytes: &[u8], mode: u32) -> PathBuf {
        let p = dir.join("peer.key");
        std::fs::write(&p, bytes).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    fn me() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn a_private_secret_file_loads() {
        let d = tempfile::tempdir().unwrap();
        let p = secret_file(d.path(), &[7; 32], 0o600);
        let s = ClusterSecret::load_owned_by(&p, me()).unwrap();
        assert_eq!(
            s.job_key(1, &nodes(&["n1"])).key.0,
            ClusterSecret::from_bytes([7; 32])
                .job_key(1, &nodes(&["n1"]))
                .key
                .0
        );
        // 0400 is stricter than 0600, and fine.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o400)).unwrap();
        ClusterSecret::load_owned_by(&p, me()).unwrap();
    }

    #[test]
    fn a_secret_others_could_read_or_own_is_refused_with_what_to_do() {
        let d = tempfile::tempdir().unwrap();
        for mode in [0o640, 0o604, 0o660, 0o644] {
            let p = secret_file(d.path(), &[7; 32], mode);
            let e = ClusterSecret::load_owned_by(&p, me()).unwrap_err();
            assert!(matches!(e, SecretError::Mode { .. }), "{mode:o}: {e}");
            assert!(e.to_string().contains("chmod 0600"), "{e}");
        }
        let p = secret_file(d.path(), &[7; 32], 0o600);
        let e = ClusterSecret::load_owned_by(&p, me() + 1).unwrap_err();
        assert!(
            matches!(e, SecretError::Owner { uid, .. } if uid == me()),
            "{e}"
        );
        assert!(e.to_string().contains("chown root:root"), "{e}");
        if me() != 0 {
            // What the agent itself does: a file of an ordinary user is never root's secret.
            let e = ClusterSecret::load(&p).unwrap_err();
            assert!(matches!(e, SecretError::Owner { .. }), "{e}");
        }
    }

    #[test]
    fn short_links_and_non_files_are_not_secrets() {
        let d = tempfile::tempdir().unwrap();
        let p = secret_file(d.path(), &[7; 31], 0o600);
        let e = ClusterSecret::load_owned_by(&p, me()).unwrap_err();
        assert!(matches!(e, SecretError::TooShort { len: 31, .. }), "{e}");
        let p = secret_file(d.path(), &[7; 32], 0o600);
        let link = d.path().join("link.key");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        let e = ClusterSecret::load_owned_by(&link, me()).unwrap_err();
        assert!(matches!(e, SecretError::Read { .. }), "{e}");
        let sub = d.path().join("dir");
        std::fs::create_dir(&sub).unwrap();
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = ClusterSecret::load_owned_by(&sub, me()).unwrap_err();
        assert!(matches!(e, SecretError::NotAFile { .. }), "{e}");
        let e = ClusterSecret::load_owned_by(&d.path().join("missing"), me()).unwrap_err();
        assert!(e.to_string().contains("cannot read the peer secret"), "{e}");
    }

    /// Golden value: agents of different versions in one job must derive the same key.
    #[test]
    fn job_keys_are_stable_and_depend_on_secret_job_and_nodes() {
        let s = ClusterSecret::from_bytes([1u8; 32]);
        let k = s.job_key(42, &nodes(&["n2", "n1", "n3", "n1"]));
        assert_eq!(
            blake3::Hash::from(k.key.0).to_hex().as_str(),
            "57e84de52aae58d8fdbbc6ee4736ea615f63dbd25724a669273a8895521620c7"
        );
        assert_eq!(
            k.nodes(),
            nodes(&["n1", "n2", "n3"]),
            "sorted, deduplicated"
        );
        assert!(k.has_node("n2") && !k.has_node("n4"));
        let same = s.job_key(42, &nodes(&["n3", "n2", "n1"]));
        assert_eq!(
            k.key.0, same.key.0,
            "the order of the node list does not matter"
        );
        for other in [
            s.job_key(43, &nodes(&["n1", "n2", "n3"])),
            s.job_key(42, &nodes(&["n1", "n2"])),
            s.job_key(42, &nodes(&["n1", "n2", "n3", "n4"])),
            ClusterSecret::from_bytes([2u8; 32]).job_key(42, &nodes(&["n1", "n2", "n3"])),
        ] {
            assert_ne!(k.key.0, other.key.0);
        }
        // Field boundaries are part of the input: "n1","n23" is not "n12","n3".
        assert_ne!(
            s.job_key(1, &nodes(&["n1", "n23"])).key.0,
            s.job_key(1, &nodes(&["n12", "n3"])).key.0
        );
    }

    #[test]
    fn the_admin_key_is_no_job_key_and_its_macs_bind_every_field() {
        let s = ClusterSecret::from_bytes([1u8; 32]);
        let a = s.admin_key();
        assert_eq!(a.key.0, s.admin_key().key.0);
        assert_ne!(
            a.key.0,
            ClusterSecret::from_bytes([2u8; 32]).admin_key().key.0
        );
        let job = s.job_key(42, &nodes(&["n1"]));
        assert_ne!(a.key.0, job.key.0);
        let pq = "/v1/admin/cache/warm?url=s3%3A%2F%2Fb%2Fds";
        let m = a.request_mac("POST", pq, "n1", 100);
        assert_ne!(m, job.request_mac("POST", pq, "n1", 100));
        for other in [
            a.request_mac("GET", pq, "n1", 100),
            a.request_mac("POST", "/v1/admin/cache/warm?url=x", "n1", 100),
            a.request_mac("POST", pq, "n2", 100),
            a.request_mac("POST", pq, "n1", 101),
        ] {
            assert_ne!(m, other);
        }
        let r = a.response_mac(200, b"{}", &m);
        assert_ne!(r, a.response_mac(502, b"{}", &m));
        assert_ne!(r, a.response_mac(200, b"{ }", &m));
        assert_ne!(
            r,
            a.response_mac(200, b"{}", &a.request_mac("POST", pq, "n1", 1))
        );
    }

    /// The wire format, spelled out apart from the code that makes it: keyed BLAKE3 over the
    /// fields in order, each after its length as 8 little-endian bytes.
    #[test]
    fn request_macs_are_the_documented_fields_length_prefixed() {
        let by_hand = |key: &MacKey, parts: &[&[u8]]| {
            let mut h = blake3::Hasher::new_keyed(&key.0);
            for p in parts {
                h.update(&(p.len() as u64).to_le_bytes());
                h.update(p);
            }
            h.finalize()
        };
        let s = ClusterSecret::from_bytes([3u8; 32]);
        let (job, admin) = (s.job_key(42, &nodes(&["n1", "n2"])), s.admin_key());
        let pq = "/v1/jobs/42/units?file=a&offset=0&len=1";
        assert_eq!(
            job.request_mac("GET", pq, "n1", 100),
            by_hand(
                &job.key,
                &[REQUEST_LABEL, b"GET", pq.as_bytes(), b"42", b"n1", b"100"]
            )
        );
        assert_eq!(
            admin.request_mac("POST", "/v1/admin/cache/warm?url=u", "n2", 7),
            by_hand(
                &admin.key,
                &[
                    ADMIN_REQUEST_LABEL,
                    b"POST",
                    b"/v1/admin/cache/warm?url=u",
                    b"n2",
                    b"7"
                ]
            )
        );
        let admin_key = {
            let mut h = blake3::Hasher::new_derive_key(ADMIN_KEY_CONTEXT);
            h.update(&32u64.to_le_bytes());
            h.update(&[3u8; 32]);
            h.finalize()
        };
        assert_eq!(admin.key.0, *admin_key.as_bytes());
    }

    #[test]
    fn macs_bind_every_field() {
        let k = ClusterSecret::from_bytes([1u8; 32]).job_key(42, &nodes(&["n1", "n2"]));
        let m = k.request_mac("GET", "/v1/jobs/42/units?file=a&offset=0&len=1", "n1", 100);
        for other in [
            k.request_mac("PUT", "/v1/jobs/42/units?file=a&offset=0&len=1", "n1", 100),
            k.request_mac("GET", "/v1/jobs/42/units?file=b&offset=0&len=1", "n1", 100),
            k.request_mac("GET", "/v1/jobs/42/units?file=a&offset=0&len=1", "n2", 100),
            k.request_mac("GET", "/v1/jobs/42/units?file=a&offset=0&len=1", "n1", 101),
        ] {
            assert_ne!(m, other);
        }
        let u = Unit::new("a", 0, 1);
        let h = blake3::hash(b"x");
        let r = k.response_mac(200, &u, Some(&h), b"", &m);
        assert_ne!(
            r,
            k.response_mac(200, &u, Some(&blake3::hash(b"y")), b"", &m)
        );
        assert_ne!(r, k.response_mac(503, &u, Some(&h), b"", &m));
        let u2 = Unit {
            len: 2,
            ..u.clone()
        };
        assert_ne!(r, k.response_mac(200, &u2, Some(&h), b"", &m));
        let m2 = k.request_mac("GET", "/", "n1", 100);
        assert_ne!(r, k.response_mac(200, &u, Some(&h), b"", &m2));
    }
}
