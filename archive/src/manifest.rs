//! Manifests: what a node archived of a checkpoint (`parts/<node>.json`) and what the checkpoint is
//! (`MANIFEST`, the merge of every node's part, written last).
//!
//! Both are versioned JSON documents (`format` names the kind, `version` its layout). A reader refuses a
//! newer version than it knows rather than guessing; within a version, unknown fields are ignored so
//! additions stay readable by older agents. Serialisation is deterministic (fixed field order, files
//! sorted by path, no maps), so two nodes that publish the same checkpoint write the same bytes.
//!
//! A manifest read from the store is untrusted input: [`Manifest::parse`] checks every path is a
//! plain relative path and every chunk list adds up, before restore acts on it.

use super::format::{self, Codec, Expected, FileCompression, HEADER_LEN, Transform};
use serde::{Deserialize, Serialize};
use sluice_core::safefs;

pub const FORMAT: &str = "sluice-checkpoint";
pub const PART_FORMAT: &str = "sluice-checkpoint-part";
/// The layout written by this agent, and the newest it reads. Version 2 added plane-wise chunk
/// frames (codec `zstd_planes`, see [`super::format`]); version 1 manifests are still read.
pub const VERSION: u32 = 2;

/// The job that wrote a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobMeta {
    pub job_id: u32,
    pub user: String,
    pub job_name: String,
}

/// One chunk of a file: a frame of the file's data object (see [`super::format`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkEntry {
    /// Where the frame starts in the data object.
    pub offset: u64,
    /// Frame length (header and payload).
    pub stored: u64,
    /// Bytes of file content.
    pub raw: u64,
    pub codec: Codec,
    pub transform: Transform,
    /// BLAKE3 of the frame, hex.
    pub blake3: String,
}

impl ChunkEntry {
    pub fn expected(&self) -> Expected {
        Expected {
            raw_len: self.raw,
            codec: self.codec,
            transform: self.transform,
            // Checked by `validate_files`, so a parsed manifest always has valid hashes.
            blake3: blake3::Hash::from_hex(&self.blake3).unwrap_or(blake3::Hash::from([0; 32])),
        }
    }
}

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative path inside the checkpoint directory, `/`-separated.
    pub path: String,
    /// The node whose hot tier held it.
    pub node: String,
    /// Raw size in bytes.
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// BLAKE3 of the raw content, hex.
    pub blake3: String,
    pub compression: FileCompression,
    /// Size of the data object.
    pub stored_size: u64,
    pub chunks: Vec<ChunkEntry>,
    /// The storage class (S3, GCS) or access tier (Azure) its data object was written with: the
    /// store profile's `data_class`. Absent when none was asked for (the store's default), and
    /// in manifests written before classes were recorded, which means the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class: Option<String>,
}

impl FileEntry {
    /// The file's content hash, parsed.
    pub fn content_hash(&self) -> blake3::Hash {
        blake3::Hash::from_hex(&self.blake3).unwrap_or(blake3::Hash::from([0; 32]))
    }

    /// Identical content and encoding, whichever node archived it (and with whichever class: the
    /// nodes share its one data object).
    fn same_object(&self, other: &FileEntry) -> bool {
        FileEntry {
            node: String::new(),
            storage_class: None,
            ..self.clone()
        } == FileEntry {
            node: String::new(),
            storage_class: None,
            ..other.clone()
        }
    }
}

/// What one node archived of a checkpoint: `BASE/TAG/parts/<node>.json`, written after all of the
/// node's data objects are durable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartManifest {
    pub format: String,
    pub version: u32,
    pub tag: String,
    pub node: String,
    /// The job whose node wrote the part: a publisher merges only its own job's parts (a tag
    /// reused by a later job under the same prefix never mixes in an earlier job's files).
    /// Absent in parts written before job ids were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u32>,
    /// When the part was completed (Unix time, milliseconds, this node's clock).
    pub created_unix_ms: u64,
    pub chunk_size: u64,
    /// Every directory of the tree (so empty ones are restored too), sorted.
    pub dirs: Vec<String>,
    /// Sorted by path.
    pub files: Vec<FileEntry>,
}

/// A complete archived checkpoint: `BASE/TAG/MANIFEST`, written after every part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub tag: String,
    /// The newest of the parts' completion times: the checkpoint's time.
    pub created_unix_ms: u64,
    pub job: JobMeta,
    /// The nodes whose parts make up the checkpoint, sorted.
    pub nodes: Vec<String>,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub dirs: Vec<String>,
    /// Sorted by path.
    pub files: Vec<FileEntry>,
}

impl Manifest {
    pub fn raw_bytes(&self) -> u64 {
        self.raw_bytes
    }

    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    /// Raw bytes per stored byte (1.0 for an empty checkpoint).
    pub fn ratio(&self) -> f64 {
        ratio(self.raw_bytes, self.stored_bytes)
    }

    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).expect("a manifest always serialises");
        v.push(b'\n');
        v
    }

    /// Parses and checks a MANIFEST read from the store for checkpoint `tag`.
    pub fn parse(bytes: &[u8], tag: &str) -> Result<Manifest, String> {
        check_header(bytes, FORMAT)?;
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if m.tag != tag {
            return Err(format!("it describes checkpoint '{}'", m.tag));
        }
        validate_files(&m.files, &m.dirs)?;
        let raw: u64 = m.files.iter().map(|f| f.size).sum();
        let stored: u64 = m.files.iter().map(|f| f.stored_size).sum();
        if (raw, stored) != (m.raw_bytes, m.stored_bytes) {
            return Err("its totals do not add up".into());
        }
        Ok(m)
    }
}

impl PartManifest {
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).expect("a manifest always serialises");
        v.push(b'\n');
        v
    }

    pub fn parse(bytes: &[u8], tag: &str, node: &str) -> Result<PartManifest, String> {
        check_header(bytes, PART_FORMAT)?;
        let p: PartManifest = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        if p.tag != tag || p.node != node {
            return Err(format!(
                "it describes checkpoint '{}' of node '{}'",
                p.tag, p.node
            ));
        }
        validate_files(&p.files, &p.dirs)?;
        if p.files.iter().any(|f| f.node != node) {
            return Err("it lists files of another node".into());
        }
        Ok(p)
    }

    pub fn raw_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    pub fn stored_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.stored_size).sum()
    }
}

/// What `ckpt list` shows for a storage class never asked for: the store's default class.
pub const DEFAULT_CLASS: &str = "default";

/// The classes the data objects of `files` were written with, sorted and distinct,
/// [`DEFAULT_CLASS`] for those written without one; empty when there are no files.
pub fn storage_classes<'a>(files: impl IntoIterator<Item = &'a FileEntry>) -> Vec<String> {
    let classes: std::collections::BTreeSet<&str> = files
        .into_iter()
        .map(|f| f.storage_class.as_deref().unwrap_or(DEFAULT_CLASS))
        .collect();
    classes.into_iter().map(String::from).collect()
}

pub fn ratio(raw: u64, stored: u64) -> f64 {
    if stored == 0 {
        1.0
    } else {
        raw as f64 / stored as f64
    }
}

fn check_header(bytes: &[u8], format: &str) -> Result<(), String> {
    #[derive(Deserialize)]
    struct Probe {
        format: Option<String>,
        version: Option<u32>,
    }
    let p: Probe = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if p.format.as_deref() != Some(format) {
        return Err(format!("it is not a {format} document"));
    }
    match p.version {
        Some(v) if v > VERSION => Err(format!(
            "it has version {v}, and this agent reads up to version {VERSION}: upgrade sluice"
        )),
        Some(0) | None => Err("it has no valid version".into()),
        Some(_) => Ok(()),
    }
}

/// Checks a relative path of plain components, as restore will create it.
pub fn check_rel_path(path: &str) -> Result<Vec<&str>, String> {
    let parts: Vec<&str> = path.split('/').collect();
    if parts.len() > safefs::MAX_DEPTH {
        return Err(format!("'{path}' nests too deep"));
    }
    for p in &parts {
        if safefs::check_component(p).is_err() || p.len() > 255 {
            return Err(format!("'{path}' is not a plain relative path"));
        }
    }
    Ok(parts)
}

/// Every path plain and unique, every chunk list consistent with its file.
fn validate_files(files: &[FileEntry], dirs: &[String]) -> Result<(), String> {
    for d in dirs {
        check_rel_path(d)?;
    }
    let mut prev: Option<&str> = None;
    for f in files {
        check_rel_path(&f.path)?;
        if prev.is_some_and(|p| p >= f.path.as_str()) {
            return Err(format!("files are not sorted and unique at '{}'", f.path));
        }
        prev = Some(&f.path);
        let bad = |what: &str| Err(format!("file '{}': {what}", f.path));
        if f.mode > 0o7777 {
            return bad("invalid mode");
        }
        if blake3::Hash::from_hex(&f.blake3).is_err() {
            return bad("invalid checksum");
        }
        if f.storage_class
            .as_deref()
            .is_some_and(|c| !plausible_class(c))
        {
            return bad("invalid storage class");
        }
        let (mut offset, mut raw) = (0u64, 0u64);
        for c in &f.chunks {
            if c.offset != offset
                || c.stored < HEADER_LEN as u64
                || c.raw == 0
                || c.raw > format::MAX_CHUNK as u64
                || blake3::Hash::from_hex(&c.blake3).is_err()
                || (c.codec == Codec::Stored
                    && (c.transform != Transform::None || c.stored != c.raw + HEADER_LEN as u64))
            {
                return bad("inconsistent chunk list");
            }
            offset += c.stored;
            raw += c.raw;
        }
        if offset != f.stored_size || raw != f.size {
            return bad("chunk sizes do not add up");
        }
    }
    Ok(())
}

/// A storage class as a store names one (`STANDARD_IA`, `Cool`): what `sluice ckpt list` may print
/// from an untrusted manifest.
fn plausible_class(c: &str) -> bool {
    (1..=64).contains(&c.len()) && c.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Two nodes archived the same path with different contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub path: String,
    pub nodes: (String, String),
}

/// Merges the parts of every node into the checkpoint's manifest. Deterministic: the same parts give
/// the same bytes, whichever node merges. A path archived by several nodes must be the same object
/// (identical content and encoding), since they share its data key.
pub fn merge(tag: &str, job: JobMeta, mut parts: Vec<PartManifest>) -> Result<Manifest, Conflict> {
    parts.sort_by(|a, b| a.node.cmp(&b.node));
    let mut files: Vec<FileEntry> = parts.iter().flat_map(|p| p.files.clone()).collect();
    // Stable: for a shared path, the entry of the first node (by name) is kept.
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let mut merged: Vec<FileEntry> = Vec::with_capacity(files.len());
    for f in files {
        match merged.last() {
            Some(last) if last.path == f.path => {
                if !last.same_object(&f) {
                    return Err(Conflict {
                        path: f.path,
                        nodes: (last.node.clone(), f.node),
                    });
                }
            }
            _ => merged.push(f),
        }
    }
    let mut dirs: Vec<String> = parts.iter().flat_map(|p| p.dirs.clone()).collect();
    dirs.sort();
    dirs.dedup();
    Ok(Manifest {
        format: FORMAT.into(),
        version: VERSION,
        tag: tag.into(),
        created_unix_ms: parts.iter().map(|p| p.created_unix_ms).max().unwrap_or(0),
        job,
        // The nodes that contributed files or directories; a node that held nothing of the tag
        // wrote an empty part only to say so.
        nodes: {
            let holding: Vec<String> = parts
                .iter()
                .filter(|p| !p.files.is_empty() || !p.dirs.is_empty())
                .map(|p| p.node.clone())
                .collect();
            if holding.is_empty() {
                parts.iter().map(|p| p.node.clone()).collect()
            } else {
                holding
            }
        },
        raw_bytes: merged.iter().map(|f| f.size).sum(),
        stored_bytes: merged.iter().map(|f| f.stored_size).sum(),
        dirs,
        files: merged,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::encode_chunk;
    use crate::synth::bf16_weights;

    fn file(path: &str, node: &str, data: &[u8]) -> FileEntry {
        let c = FileCompression {
            codec: Codec::Zstd,
            level: 3,
            transform: Transform::Bytegroup2,
        };
        let mut chunks = Vec::new();
        let mut offset = 0;
        for raw in data.chunks(1000) {
            let f = encode_chunk(raw, c);
            chunks.push(ChunkEntry {
                offset,
                stored: f.bytes.len() as u64,
                raw: raw.len() as u64,
                codec: f.codec,
                transform: f.transform,
                blake3: f.blake3.to_hex().to_string(),
            });
            offset += f.bytes.len() as u64;
        }
        FileEntry {
            path: path.into(),
            node: node.into(),
            size: data.len() as u64,
            mode: 0o644,
            blake3: blake3::hash(data).to_hex().to_string(),
            compression: c,
            stored_size: offset,
            chunks,
            storage_class: None,
        }
    }

    fn part(node: &str, files: Vec<FileEntry>, t: u64) -> PartManifest {
        PartManifest {
            job_id: None,
            format: PART_FORMAT.into(),
            version: VERSION,
            tag: "step10".into(),
            node: node.into(),
            created_unix_ms: t,
            chunk_size: 1000,
            dirs: vec!["d".into()],
            files,
        }
    }

    fn job() -> JobMeta {
        JobMeta {
            job_id: 42,
            user: "alice".into(),
            job_name: "train".into(),
        }
    }

    /// The checkpoint `step10` of [`job`], merged from `parts`.
    fn merged(parts: Vec<PartManifest>) -> Result<Manifest, Conflict> {
        merge("step10", job(), parts)
    }

    #[test]
    fn manifests_round_trip_and_merge_deterministically() {
        let w = bf16_weights(3000, 1);
        let p1 = part(
            "n1",
            vec![file("d/a.bin", "n1", &w), file("z", "n1", b"")],
            5,
        );
        let p2 = part("n2", vec![file("d/b.bin", "n2", &w[..100])], 9);
        let back = PartManifest::parse(&p1.to_json(), "step10", "n1").unwrap();
        assert_eq!(back, p1);
        assert!(PartManifest::parse(&p1.to_json(), "step10", "n2").is_err());

        let m = merged(vec![p2.clone(), p1.clone()]).unwrap();
        let m2 = merged(vec![p1.clone(), p2.clone()]).unwrap();
        assert_eq!(m.to_json(), m2.to_json(), "merge order must not matter");
        assert_eq!(m.nodes, ["n1", "n2"]);
        assert_eq!(m.created_unix_ms, 9);
        let paths: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, ["d/a.bin", "d/b.bin", "z"]);
        assert_eq!(m.raw_bytes, 6100);
        assert!(m.ratio() > 1.0);
        let json = m.to_json();
        assert_eq!(Manifest::parse(&json, "step10").unwrap(), m);
        // The document says what it is and which layout.
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["format"], "sluice-checkpoint");
        assert_eq!(v["version"], 2);
        assert_eq!(v["files"][0]["compression"]["transform"], "bytegroup2");
        assert_eq!(v["job"]["job_id"], 42);
    }

    #[test]
    fn newer_foreign_and_hostile_manifests_are_refused() {
        let w = bf16_weights(3000, 1);
        let m = merged(vec![part("n1", vec![file("a", "n1", &w)], 1)]).unwrap();
        let mut v: serde_json::Value = serde_json::from_slice(&m.to_json()).unwrap();
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut x = v.clone();
            f(&mut x);
            serde_json::to_vec(&x).unwrap()
        };
        let e = Manifest::parse(&with(&|x| x["version"] = 3.into()), "step10").unwrap_err();
        assert!(e.contains("version 3") && e.contains("upgrade"), "{e}");
        // Version 1 (before plane-wise frames) is still read.
        assert!(Manifest::parse(&with(&|x| x["version"] = 1.into()), "step10").is_ok());
        // Unknown fields of the same version are fine (additions stay readable).
        assert!(Manifest::parse(&with(&|x| x["future"] = true.into()), "step10").is_ok());
        assert!(Manifest::parse(&with(&|x| x["format"] = "x".into()), "step10").is_err());
        assert!(Manifest::parse(&m.to_json(), "other").is_err());
        assert!(Manifest::parse(b"{\"format\":\"sluice-checkpoint\"", "step10").is_err());
        for bad in ["../etc/passwd", "/abs", "a//b", "a/./b", ""] {
            let e = Manifest::parse(&with(&|x| x["files"][0]["path"] = bad.into()), "step10")
                .unwrap_err();
            assert!(e.contains("plain relative path"), "{bad}: {e}");
        }
        let e =
            Manifest::parse(&with(&|x| x["files"][0]["size"] = 1.into()), "step10").unwrap_err();
        assert!(e.contains("add up"), "{e}");
        let e = Manifest::parse(
            &with(&|x| x["files"][0]["chunks"][0]["offset"] = 5.into()),
            "step10",
        )
        .unwrap_err();
        assert!(e.contains("chunk"), "{e}");
        v["raw_bytes"] = 1.into();
        assert!(Manifest::parse(&serde_json::to_vec(&v).unwrap(), "step10").is_err());
    }

    #[test]
    fn the_storage_class_is_recorded_per_file_and_old_manifests_read_as_default() {
        let w = bf16_weights(3000, 1);
        let mut cold = file("a.bin", "n1", &w);
        cold.storage_class = Some("STANDARD_IA".into());
        let m = merged(vec![part("n1", vec![cold, file("b", "n1", b"x")], 1)]).unwrap();
        let json = m.to_json();
        let v: serde_json::Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["files"][0]["storage_class"], "STANDARD_IA");
        // Written without a class, a file's entry has no such field: manifests of archives
        // without data_class keep the bytes they had before classes were recorded.
        assert!(v["files"][1].get("storage_class").is_none(), "{v}");
        let back = Manifest::parse(&json, "step10").unwrap();
        assert_eq!(back, m);
        assert_eq!(storage_classes(&back.files), ["STANDARD_IA", "default"]);
        assert!(storage_classes(&[]).is_empty());
        // A manifest from before classes were recorded reads as the store's default.
        let mut old = v.clone();
        old["files"][0]
            .as_object_mut()
            .unwrap()
            .remove("storage_class");
        let old = Manifest::parse(&serde_json::to_vec(&old).unwrap(), "step10").unwrap();
        assert_eq!(storage_classes(&old.files), ["default"]);
        // The class is printed by `ckpt list`: an untrusted manifest cannot put anything there.
        for bad in ["", "STANDARD IA", "\u{1b}[2J", &"X".repeat(65)] {
            let mut x = v.clone();
            x["files"][0]["storage_class"] = bad.into();
            let e = Manifest::parse(&serde_json::to_vec(&x).unwrap(), "step10").unwrap_err();
            assert!(e.contains("invalid storage class"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn nodes_sharing_a_file_need_not_agree_on_its_class() {
        let mut a = file("cfg.json", "n1", b"{}");
        a.storage_class = Some("Cool".into());
        let b = file("cfg.json", "n2", b"{}");
        let m = merged(vec![part("n2", vec![b], 1), part("n1", vec![a], 1)]).unwrap();
        assert_eq!(m.files.len(), 1);
        assert_eq!(m.files[0].storage_class.as_deref(), Some("Cool"));
    }

    #[test]
    fn nodes_may_share_identical_files_but_not_conflicting_ones() {
        let w = bf16_weights(3000, 1);
        let same = merged(vec![
            part("n1", vec![file("cfg.json", "n1", b"{}")], 1),
            part("n2", vec![file("cfg.json", "n2", b"{}")], 1),
        ])
        .unwrap();
        assert_eq!(same.files.len(), 1);
        assert_eq!(same.files[0].node, "n1");
        let c = merged(vec![
            part("n2", vec![file("x", "n2", &w[..10])], 1),
            part("n1", vec![file("x", "n1", &w[..20])], 1),
        ])
        .unwrap_err();
        assert_eq!(c.path, "x");
        assert_eq!(c.nodes, ("n1".to_string(), "n2".to_string()));
    }
}
