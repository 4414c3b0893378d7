//! What this node serves on the peer port as replicas ([`ReplicaStore`]): the parts other nodes
//! pushed to its replica area ([`ReplicaArea`]), and its own parts of the job's checkpoints, from
//! the job's own copy. A restore from replicas (`ckpt::replica_restore`) asks every node of the
//! job for its index; a node that survived holds its own part in its `$SLUICE_CKPT_DIR` (or on the
//! hot tier), which is as good a copy as a replica of it, and nearer.
//!
//! A node's own part is listed while its checkpoint is committed here, not lost and not archived,
//! and only as it was sealed for its replicas (`Replication::part`, journaled): the files with
//! the BLAKE3 its flush read. An archived checkpoint is listed without files, marked `archived`:
//! its replicas are freed and the archive holds it, so a restore from replicas takes neither it
//! nor anything older (the nodes then restore it from the archive, all of them the same tag).
//! Its files are opened as root inside the user's tree, never following a link, each the size it
//! was sealed with (`replicate::open_file`); the user may have changed a byte since, which the
//! requester finds, since it checks every file against the sealed hash.
//!
//! Pushes, seals, the room and frees are the area's alone: no node pushes to itself.

use super::CkptCtx;
use super::replicate::open_file;
use crate::replica_area::{ReplicaArea, file_body};
use sluice_core::rt::blocking;
use sluice_peer::replica::Incoming;
use sluice_peer::{
    HashFrom, PartKey, ReplicaFile, ReplicaPart, ReplicaRefusal, ReplicaSeal, ReplicaStore,
    UnitStream,
};
use sluice_proto::msg::JobId;
use std::sync::Arc;

/// This node's replicas: the area's, and its own parts (see the module header).
pub(crate) struct NodeReplicas {
    pub(crate) area: Arc<ReplicaArea>,
    pub(crate) ckpt: Arc<CkptCtx>,
}

impl NodeReplicas {
    fn me(&self) -> &str {
        &self.ckpt.cfg.node
    }

    /// This node's own sealed parts of `job`'s checkpoints that it still holds, and the
    /// checkpoints it knows archived (`archived`, no files: a restore takes nothing older).
    fn own_parts(&self, job: JobId) -> Vec<ReplicaPart> {
        let Some(job) = self.ckpt.jobs.get(job) else {
            return Vec::new();
        };
        let mut nodes = job.start.nodes.clone();
        nodes.sort();
        nodes.dedup();
        job.ckpts
            .entries()
            .iter()
            .filter_map(|e| {
                if e.archived_at().is_some() {
                    return Some(ReplicaPart {
                        from: self.me().to_string(),
                        tag: e.tag.clone(),
                        files: Vec::new(),
                        nodes: nodes.clone(),
                        committed_at: e.committed_at,
                        archived: true,
                    });
                }
                let seal = own_seal(e)?;
                Some(ReplicaPart {
                    from: self.me().to_string(),
                    tag: e.tag.clone(),
                    files: seal.files.clone(),
                    nodes: seal.nodes.clone(),
                    committed_at: seal.committed_at,
                    archived: false,
                })
            })
            .collect()
    }

    /// File `path` of this node's own part `part`, from the job's copy.
    async fn own_file(&self, part: &PartKey, path: &str) -> Option<UnitStream> {
        let job = self.ckpt.jobs.get(part.job)?;
        let entry = job.ckpts.get(&part.tag)?;
        let file: ReplicaFile = own_seal(&entry)?
            .files
            .iter()
            .find(|f| f.path == path)?
            .clone();
        let hash = blake3::Hash::from_hex(&file.blake3).ok()?;
        let (dirs, in_ram, uid, tag) = (
            self.ckpt.dirs(&job),
            entry.in_ram(),
            job.start.uid,
            part.tag.clone(),
        );
        let f = file.clone();
        let opened = blocking(move || open_file(&dirs, in_ram, &tag, uid, &f)).await;
        let opened = opened
            .inspect_err(|why| {
                tracing::info!(
                    job_id = part.job,
                    tag = part.tag,
                    "this node's own part cannot be served: {why}"
                );
            })
            .ok()?;
        Some(UnitStream {
            len: file.size,
            hash,
            // The job user's copy, which its user can change: the requester checks the hash.
            from: HashFrom::ReadBack,
            body: file_body(opened, file.size, format!("{}/{path}", part.tag)),
        })
    }
}

/// The seal of this node's own part of `entry`, while this node holds it for a restore: sealed
/// for this commit, not lost, not archived.
fn own_seal(entry: &super::CkptEntry) -> Option<Arc<ReplicaSeal>> {
    if entry.is_lost() || entry.archived_at().is_some() {
        return None;
    }
    let r = entry.replication();
    r.part
        .clone()
        .filter(|_| r.generation == entry.generation())
}

#[async_trait::async_trait]
impl ReplicaStore for NodeReplicas {
    async fn put_file(
        &self,
        part: &PartKey,
        file: &ReplicaFile,
        body: Incoming,
    ) -> Result<(), ReplicaRefusal> {
        self.area.put_file(part, file, body).await
    }

    async fn seal(&self, part: &PartKey, seal: &ReplicaSeal) -> Result<(), ReplicaRefusal> {
        self.area.seal(part, seal).await
    }

    async fn index(&self, job: JobId) -> Vec<ReplicaPart> {
        let mut parts: Vec<ReplicaPart> = self
            .area
            .index(job)
            .await
            .into_iter()
            .filter(|p| p.from != self.me())
            .collect();
        parts.extend(self.own_parts(job));
        parts
    }

    fn room(&self) -> (u64, u64) {
        self.area.room()
    }

    async fn file(&self, part: &PartKey, path: &str) -> Option<UnitStream> {
        if part.from == self.me() {
            self.own_file(part, path).await
        } else {
            self.area.file(part, path).await
        }
    }

    async fn free(&self, part: &PartKey) {
        self.area.free(part).await
    }
}
