//! Replicas: a node's part of a committed checkpoint, copied to other nodes of the job so that the
//! checkpoint survives the loss of that node before it is archived (`[fast_tier] replicas`).
//!
//! The sender is the node whose part it is; it pushes each file, then *seals* the part with the
//! list of its files (an empty list for a node that holds none of the tag), the job's node list
//! of the run that committed the checkpoint and when it committed ([`ReplicaSeal`]): what a node
//! restoring the checkpoint (a requeued job, on nodes that may have lost everything) learns from
//! the holders' indexes, which nodes had parts and which checkpoint is the newest. Before it
//! pushes, a sender may ask a holder its free room, since a holder that has none can say so only
//! after reading a good part of the push. A holder keeps what it
//! was sent root-only, outside every job's reach, within the room its admin gave replicas, and
//! frees a part when its sender says (the checkpoint is archived) or when the job is over.
//!
//! On the wire (the peer port, admitted as a unit request is — the job registered here, the job
//! key's MAC over method, path and query, job, node and time, the node in the job, the clock;
//! `from` is always the authenticated node of the request, never a parameter, so a node can
//! push, seal and free only its own parts; the server half is `server/replicas.rs`, the client's
//! `client/replicas.rs`):
//!
//! ```text
//! PUT  /v1/jobs/{job}/replicas/file?tag={t}&file={path}&size={n}&blake3={hex}   body: the file
//!      content-length: {n} (else 400)
//!      201 stored   507 no room (body JSON {"need":n,"free":n})   409 the body did not hash to
//!      blake3 / was not size bytes   400 invalid   500 the holder could not write it
//!      503 busy (all `peer.concurrency` push slots taken for 2 s)
//! POST /v1/jobs/{job}/replicas/seal?tag={t}                   body: JSON ReplicaSeal
//!      200 sealed   409 a listed file was not stored (or differs)
//!      400 a body over MAX_SEAL_BODY, more than MAX_FILES files, a bad path or hash, a node
//!      list check_seal refuses or that names a node not of the job
//! GET  /v1/jobs/{job}/replicas                                200 body: JSON [ReplicaPart]
//! GET  /v1/jobs/{job}/replicas/room                           200 body: JSON {"free":n,"room":n}
//! GET  /v1/jobs/{job}/replicas/file?from={node}&tag={t}&file={path}
//!      200 the bytes, x-sluice-blake3    404 not held here   503 busy (no response slot)
//!      400 from is not a node of the job
//! DELETE /v1/jobs/{job}/replicas?tag={t}                      200 freed (or was not held)
//!
//! any: 501 this node keeps no replicas   410 the job ended here
//!      400 bare: a query that does not parse (a parameter twice, unknown, missing; a tag or
//!      path check_tag / check_path refuse; a size that is not a number, a hash not hex)
//! ```
//!
//! Every answer to an authenticated request is MAC'd (`JobKey::response_mac`) over the unit that
//! names what it is about, so that no answer about one thing verifies as one about another:
//!
//! - a file: `Unit { file: "replica\0{from}\0{tag}\0{path}", offset: 0, len }`, `len` the
//!   push's `size`; for a fetch, the copy's length in a `200` (with its BLAKE3 as the unit hash,
//!   which the requester compares with the hash the part was sealed with) and 0 otherwise;
//! - a part (seal, free): `Unit { file: "replica\0{from}\0{tag}", 0, 0 }`;
//! - the index: `Unit { file: "replica\0", 0, 0 }`, with the index's JSON as the reason, so the
//!   MAC covers the list;
//! - the room: `Unit { file: "replica\0room", 0, 0 }`, with its JSON as the reason.
//!
//! Everything a request names (tag, path, the seal's nodes) comes off the network: a
//! [`ReplicaStore`] checks it ([`check_tag`], [`check_path`], [`check_node`], [`check_seal`]) and
//! never uses it as a path unchecked.

use serde::{Deserialize, Serialize};
use sluice_proto::msg::JobId;

/// One file of a node's part of a checkpoint: its path below the tag's directory, its size and
/// its BLAKE3 hash, as the sender read it from its committed copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaFile {
    pub path: String,
    pub size: u64,
    /// Hex.
    pub blake3: String,
}

/// What a part is sealed with (the body of a seal): every file of it, and what a restore needs to
/// know of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSeal {
    pub files: Vec<ReplicaFile>,
    /// The job's node list of the run that committed the checkpoint: sorted, each once, the
    /// sender among them, at most [`MAX_NODES`].
    pub nodes: Vec<String>,
    /// When the checkpoint was committed, seconds since the epoch.
    pub committed_at: u64,
}

/// A sealed part a node holds: whose (`from`), which checkpoint, every file of it, and the
/// seal's node list and commit time ([`ReplicaSeal`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaPart {
    pub from: String,
    pub tag: String,
    pub files: Vec<ReplicaFile>,
    pub nodes: Vec<String>,
    pub committed_at: u64,
    /// Not a part but the node's word that the archive holds checkpoint `tag` (committed at
    /// `committed_at`; `files` empty): a restore from replicas takes neither it (its replicas are
    /// freed; the archive has it) nor any checkpoint older than it. Only a node's own listing
    /// says so; absent (false) otherwise, and in indexes of agents that predate it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub archived: bool,
}

/// Which part a request is about: the job, the node whose part it is (the authenticated sender
/// of a push, seal or free), the checkpoint's tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PartKey {
    pub job: JobId,
    pub from: String,
    pub tag: String,
}

/// Why a holder did not take or seal a replica.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicaRefusal {
    /// The room the node gives replicas cannot take `need` more bytes (`free` are left).
    #[error("no room for replicas on this node: {need} bytes asked, {free} free")]
    NoRoom { need: u64, free: u64 },
    /// The bytes received were not what the request announced (size or BLAKE3): nothing kept.
    #[error("{0}")]
    Mismatch(String),
    /// A tag, path or file list that cannot be a checkpoint's.
    #[error("{0}")]
    Invalid(String),
    /// The holder could not write or read its copy.
    #[error("{0}")]
    Failed(String),
}

/// The longest path a replica file may have, in bytes.
pub const MAX_PATH: usize = 4096;
/// The most files one sealed part may list (its JSON is bounded by the server as well).
pub const MAX_FILES: usize = 100_000;
/// The most nodes a seal's node list may name: as many as the agent takes in a job's node list
/// (the seal's JSON is bounded by [`MAX_SEAL_BODY`] as well).
pub const MAX_NODES: usize = 65_536;
/// The longest node name.
pub const MAX_NODE: usize = 255;

/// A node name as replicas name their sender (and a store takes it for a directory name): one
/// component of ASCII letters, digits, `.`, `_` and `-`, at most [`MAX_NODE`] bytes, neither `.`
/// nor `..`.
pub fn check_node(node: &str) -> Result<(), ReplicaRefusal> {
    let ok = !node.is_empty()
        && node.len() <= MAX_NODE
        && node != "."
        && node != ".."
        && node
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ReplicaRefusal::Invalid(format!(
            "'{}' is not a node name",
            node.escape_debug()
        )))
    }
}

/// A part of `from` sealed with `files` and `nodes`, as a seal or an index may list it: at most
/// [`MAX_FILES`] files, each path [`check_path`]'s and each hash BLAKE3 in hex; at most
/// [`MAX_NODES`] nodes, each [`check_node`]'s, sorted and each once, `from` among them.
pub fn check_seal(
    from: &str,
    files: &[ReplicaFile],
    nodes: &[String],
) -> Result<(), ReplicaRefusal> {
    let invalid = |why: String| Err(ReplicaRefusal::Invalid(why));
    if files.len() > MAX_FILES {
        return invalid(format!(
            "a part lists {} files, more than the {MAX_FILES} a part may have",
            files.len()
        ));
    }
    for f in files {
        check_path(&f.path)?;
        if blake3::Hash::from_hex(&f.blake3).is_err() {
            return invalid(format!(
                "'{}' is not a BLAKE3 hash in hex",
                f.blake3.escape_debug()
            ));
        }
    }
    if nodes.len() > MAX_NODES {
        return invalid(format!(
            "a seal names {} nodes, more than the {MAX_NODES} a job may have",
            nodes.len()
        ));
    }
    for n in nodes {
        check_node(n)?;
    }
    if !nodes.is_sorted_by(|a, b| a < b) {
        return invalid("a seal's node list is not sorted, each node once".into());
    }
    if nodes.binary_search_by(|n| n.as_str().cmp(from)).is_err() {
        return invalid(format!(
            "a seal's node list does not name its sender {}",
            from.escape_debug()
        ));
    }
    Ok(())
}

/// A tag as the agent accepts checkpoint tags anywhere (`sluice_proto::options::validate_tag`).
pub fn check_tag(tag: &str) -> Result<(), ReplicaRefusal> {
    sluice_proto::options::validate_tag("replica", tag)
        .map_err(|e| ReplicaRefusal::Invalid(e.to_string()))
}

/// A file's path below its tag: relative, components that are neither empty, `.` nor `..`, no
/// NUL, at most [`MAX_PATH`] bytes.
pub fn check_path(path: &str) -> Result<(), ReplicaRefusal> {
    let bad = path.is_empty()
        || path.len() > MAX_PATH
        || path.contains('\0')
        || path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..");
    if bad {
        return Err(ReplicaRefusal::Invalid(format!(
            "'{}' is not a path below a checkpoint's directory",
            path.escape_debug()
        )));
    }
    Ok(())
}

/// A stream of a pushed file's bytes as they arrive (a failed read of the connection ends it with
/// an error).
pub type Incoming = futures::stream::BoxStream<
    'static,
    Result<bytes::Bytes, Box<dyn std::error::Error + Send + Sync>>,
>;

/// Where this node keeps the replicas other nodes push to it (the agent's replica area). Called
/// by the peer server for authenticated agents of the job only; the job is registered with the
/// server while it runs here.
#[async_trait::async_trait]
pub trait ReplicaStore: Send + Sync + 'static {
    /// Stores one file of `part`, announced as `file` (size and hash), from `body`. Takes room
    /// for `file.size` before reading; keeps the file only if exactly `size` bytes came that hash
    /// to `file.blake3`, else frees it and answers [`ReplicaRefusal::Mismatch`]. A file pushed
    /// again replaces the earlier one. The part is not visible in [`index`](Self::index) until
    /// sealed.
    async fn put_file(
        &self,
        part: &PartKey,
        file: &ReplicaFile,
        body: Incoming,
    ) -> Result<(), ReplicaRefusal>;

    /// Seals `part` with `seal`: each of its files must have been stored with that size and
    /// hash; files stored but not listed are removed. Its node list is checked ([`check_seal`]);
    /// it and the commit time come back in [`index`](Self::index). Sealing again with the same
    /// seal is a no-op.
    async fn seal(&self, part: &PartKey, seal: &ReplicaSeal) -> Result<(), ReplicaRefusal>;

    /// The sealed parts of `job` this node holds, each with what it was sealed with.
    async fn index(&self, job: JobId) -> Vec<ReplicaPart>;

    /// The bytes of room free for replicas now, and the room in all (for every job together).
    fn room(&self) -> (u64, u64);

    /// A file of a sealed part, streamed, with its length and the hash it was sealed with; `None`
    /// if this node does not hold it.
    async fn file(&self, part: &PartKey, path: &str) -> Option<crate::UnitStream>;

    /// Frees `part` (sealed or not) and the room it held; freeing what is not held is no error.
    async fn free(&self, part: &PartKey);
}

/// The body of a `507` (MAC'd as its reason): how much room a push asked for and how much is
/// left, so that the sender can say so ([`crate::PeerError::NoRoom`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Room {
    pub need: u64,
    pub free: u64,
}

/// The body of the answer to a room request (MAC'd as its reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RoomLeft {
    pub free: u64,
    pub room: u64,
}

/// What the answers about a file of a part are MAC'd over (see the module header): the file
/// named by its part and path, `len` its size (a push's announced size, a fetched copy's length,
/// 0 for a fetch that found nothing).
pub(crate) fn file_unit(from: &str, tag: &str, path: &str, len: u64) -> crate::Unit {
    crate::Unit::new(format!("replica\0{from}\0{tag}\0{path}"), 0, len)
}

/// What the answers about a whole part (seal, free) are MAC'd over.
pub(crate) fn part_unit(from: &str, tag: &str) -> crate::Unit {
    crate::Unit::new(format!("replica\0{from}\0{tag}"), 0, 0)
}

/// What the answers to an index request are MAC'd over (the index itself as the reason).
pub(crate) fn index_unit() -> crate::Unit {
    crate::Unit::new("replica\0", 0, 0)
}

/// What the answers to a room request are MAC'd over (the room's JSON as the reason).
pub(crate) fn room_unit() -> crate::Unit {
    crate::Unit::new("replica\0room", 0, 0)
}

/// The largest seal body a server reads: a part of [`MAX_FILES`] files with short paths fits, with
/// the node list of a job of thousands of nodes.
pub const MAX_SEAL_BODY: usize = 16 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_paths_that_could_leave_their_directory_are_refused() {
        for tag in ["", ".", "..", "a/b", "a\0", ".hidden", &"x".repeat(256)] {
            assert!(check_tag(tag).is_err(), "{tag:?}");
        }
        for tag in ["s1", "global_step100", "iter_0000200", "a..b", "dcp-3.pt"] {
            check_tag(tag).unwrap();
        }
        for path in [
            "",
            "/etc/passwd",
            "a//b",
            "a/./b",
            "../x",
            "a/..",
            "a/",
            "a\0b",
        ] {
            assert!(check_path(path).is_err(), "{path:?}");
        }
        for path in ["model.pt", "__0_0.distcp", "sub/dir/f", ".metadata", "a..b"] {
            check_path(path).unwrap();
        }
        assert!(check_path(&"x".repeat(MAX_PATH + 1)).is_err());
    }

    #[test]
    fn node_names_that_could_leave_their_directory_are_refused() {
        let long = "n".repeat(MAX_NODE + 1);
        for node in ["", ".", "..", "a/b", "x y", "n\0", "nœud", long.as_str()] {
            assert!(check_node(node).is_err(), "{node:?}");
        }
        for node in [
            "n1",
            "node-01.cluster_a",
            ".n",
            "N_1",
            &"n".repeat(MAX_NODE),
        ] {
            check_node(node).unwrap();
        }
    }

    #[test]
    fn a_seal_names_its_sender_among_sorted_valid_nodes() {
        let nodes = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let file = |path: &str, blake3: &str| ReplicaFile {
            path: path.into(),
            size: 1,
            blake3: blake3.into(),
        };
        let hash = blake3::hash(b"x").to_hex().to_string();
        check_seal("n2", &[file("f", &hash)], &nodes(&["n1", "n2", "n3"])).unwrap();
        check_seal("n2", &[], &nodes(&["n2"])).unwrap();
        for (files, list, why) in [
            (vec![], nodes(&["n1", "n3"]), "does not name its sender"),
            (vec![], nodes(&[]), "does not name its sender"),
            (vec![], nodes(&["n2", "n1"]), "not sorted"),
            (vec![], nodes(&["n1", "n2", "n2"]), "not sorted"),
            (vec![], nodes(&["../n1", "n2"]), "not a node name"),
            (vec![file("../f", &hash)], nodes(&["n2"]), "not a path"),
            (vec![file("f", "zz")], nodes(&["n2"]), "not a BLAKE3"),
        ] {
            let e = check_seal("n2", &files, &list).unwrap_err();
            assert!(
                matches!(&e, ReplicaRefusal::Invalid(m) if m.contains(why)),
                "{list:?}: {e}"
            );
        }
        let many: Vec<String> = (0..=MAX_NODES).map(|i| format!("n{i:06}")).collect();
        let e = check_seal("n000000", &[], &many).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        check_seal("n000000", &[], &many[..MAX_NODES]).unwrap();
    }
}
