//! Restore aggregation: `--ckpt-restore` on a multi-node job reads the archive once per job. Each
//! file of the checkpoint has one owner among the job's nodes (rendezvous hashing of
//! `.ckpt-restore/TAG/PATH`); the owner restores it from the archive (verified chunk by chunk, as
//! any restore) and serves it to the job's other nodes through the peer port, unit by unit, like
//! a staged dataset. A node takes the files it does not own from their owners: each unit is checked
//! against the hash its owner read back, and the whole file against the MANIFEST's BLAKE3, so a
//! peer can make a node fetch again but never keep a wrong byte. A file a peer cannot give (gone,
//! unreachable, corrupt, or it restored another checkpoint) is restored from the archive instead.

use futures::StreamExt;
use sluice_archive::manifest::FileEntry;
use sluice_archive::{ArchiveError, ArchiveProgress, Archiver, Manifest};
use sluice_core::rt::blocking;
use sluice_core::safefs::{self, Owner};
use sluice_peer::units_of;
use sluice_stage::JobPeers;
use sluice_stage::peers::open_staged;
use sluice_stage::sink::HashingSink;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::sync::Arc;

/// The unit file names of restored checkpoints start with this (no dataset NAME can: it starts
/// with '.').
const UNITS: &str = ".ckpt-restore";

/// How a checkpoint's bytes reached this node.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Sources {
    pub archive: u64,
    pub peers: u64,
}

/// Restores `tag` into `dest` with the job's other nodes (see the module header). `done` tells
/// them, once this node offered what it restored (or gave up), that it will offer nothing more;
/// before it fetches their files, so that no two nodes wait for each other.
pub(crate) async fn restore(
    archiver: &Archiver,
    tag: &str,
    dest: Arc<OwnedFd>,
    owner: Owner,
    done: Done,
    progress: &ArchiveProgress,
) -> Result<(Manifest, Sources), ArchiveError> {
    let peers = &done.0.clone();
    let prefix = format!("{UNITS}/{tag}");
    let key = |path: &str| format!("{prefix}/{path}");
    let me = peers.node().to_string();
    let mine = |f: &FileEntry| peers.owner_among_all(&key(&f.path)) == me;
    let m = archiver
        .restore_files(tag, dest.clone(), owner, progress, &mine)
        .await?;
    let mut sources = Sources {
        archive: offer(&m, &dest, owner, done).await,
        peers: 0,
    };
    // Take the others' files, several at a time; what a peer cannot give comes from the archive.
    let theirs: Vec<(FileEntry, String)> = m
        .files
        .iter()
        .filter(|f| !mine(f))
        .map(|f| (f.clone(), key(&f.path)))
        .collect();
    let fetches = theirs.into_iter().map(|(f, key)| {
        let (dest, peers) = (dest.clone(), peers.clone());
        async move {
            let r = fetch_file(&peers, &dest, &f, &key, owner).await;
            (f.path, r)
        }
    });
    let fetched: Vec<(String, Result<u64, String>)> = futures::stream::iter(fetches)
        .buffer_unordered(8)
        .collect()
        .await;
    let mut fallback: Vec<String> = Vec::new();
    for (path, r) in fetched {
        match r {
            Ok(n) => sources.peers += n,
            Err(why) => {
                tracing::warn!(tag, "{path}: {why}; restoring it from the archive");
                let (d, p) = (dest.clone(), path.clone());
                let _ = blocking(move || remove_file(&d, &p, owner)).await;
                fallback.push(path);
            }
        }
    }
    if !fallback.is_empty() {
        let again = |f: &FileEntry| fallback.contains(&f.path);
        archiver
            .restore_files(
                tag,
                dest.clone(),
                owner,
                &ArchiveProgress::default(),
                &again,
            )
            .await?;
        sources.archive += m
            .files
            .iter()
            .filter(|f| again(f))
            .map(|f| f.size)
            .sum::<u64>();
    }
    Ok((m, sources))
}

/// Offers this node's files of checkpoint `m` (in `dest`) to the job's other nodes: the hash of
/// each unit as it is on disk (the archive's checks passed, or the hot-tier copy verified against
/// the MANIFEST), then tells them it will offer nothing more. Returns the bytes offered.
pub(crate) async fn offer(m: &Manifest, dest: &Arc<OwnedFd>, owner: Owner, done: Done) -> u64 {
    let peers = done.0.clone();
    let prefix = format!("{UNITS}/{}", m.tag);
    let key = |path: &str| format!("{prefix}/{path}");
    let unit_size = peers.unit_size();
    let mut offered = 0;
    for f in m
        .files
        .iter()
        .filter(|f| peers.owner_among_all(&key(&f.path)) == peers.node())
    {
        let units = units_of(&key(&f.path), f.size, unit_size);
        peers.add_object(dest.clone(), prefix.len() + 1, &units);
        let (d, rel, us) = (dest.clone(), f.path.clone(), units.clone());
        let hashes = blocking(move || {
            let file = open_staged(&d, &rel, owner)?;
            us.iter()
                .map(|u| {
                    let mut buf = vec![0u8; u.len as usize];
                    file.read_exact_at(&mut buf, u.offset)?;
                    Ok(blake3::hash(&buf))
                })
                .collect::<std::io::Result<Vec<_>>>()
        })
        .await;
        match hashes {
            Ok(hashes) => {
                // Read back from the restored copy, which its user can write.
                for (u, h) in units.iter().zip(hashes) {
                    peers.held_from(u, h, sluice_peer::HashFrom::ReadBack);
                }
                offered += f.size;
            }
            Err(e) => {
                for u in &units {
                    peers.failed(u, format!("reading the restored copy: {e}"));
                }
            }
        }
    }
    drop(done);
    offered
}

/// The job's peers, told when dropped that this node offered all it will of the restore (it is
/// one of the job's shared pieces of work, like each object-store dataset: see
/// [`NodePeers::join`](sluice_stage::NodePeers::join)). Dropped exactly once, whichever way the
/// restore goes.
pub(crate) struct Done(pub(crate) Arc<JobPeers>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.dataset_done();
    }
}

/// Fetches file `f` from its owner into `dest`, unit by unit, and checks it against the MANIFEST.
async fn fetch_file(
    peers: &Arc<JobPeers>,
    dest: &Arc<OwnedFd>,
    f: &FileEntry,
    key: &str,
    owner: Owner,
) -> Result<u64, String> {
    let node = peers.owner_among_all(key).to_string();
    let (d, path, mode) = (dest.clone(), f.path.clone(), f.mode & 0o777);
    let file = blocking(move || {
        let parts: Vec<&str> = path.split('/').collect();
        let (name, dirs) = parts.split_last().expect("split yields one part");
        let dir = safefs::ensure_dirs(&d, dirs, Some(owner))?;
        safefs::create_file(&dir, name, Some(owner), mode | 0o600)
    })
    .await
    .map(Arc::new)
    .map_err(|e| format!("creating it: {e}"))?;
    for unit in units_of(key, f.size, peers.unit_size()) {
        let mut sink = HashingSink::direct(file.clone(), unit.offset, ());
        peers
            .fetch(&node, &unit, &mut sink)
            .await
            .map(drop)
            .map_err(|e| format!("from node {node}: {e}"))?;
    }
    drop(file);
    let (want, d, rel) = (f.content_hash(), dest.clone(), f.path.clone());
    let got = blocking(move || {
        let mut h = blake3::Hasher::new();
        let read = open_staged(&d, &rel, owner)?;
        h.update_reader(&read)?;
        read.set_permissions(std::fs::Permissions::from_mode(mode))?;
        Ok::<_, std::io::Error>(h.finalize())
    })
    .await
    .map_err(|e| format!("reading it back: {e}"))?;
    if got != want {
        return Err(format!(
            "the bytes from node {node} do not match the MANIFEST's BLAKE3"
        ));
    }
    Ok(f.size)
}

/// Removes the half-fetched `path` below `dest` (never through a link), the job user's.
fn remove_file(dest: &OwnedFd, path: &str, owner: Owner) -> Result<(), safefs::SafeFsError> {
    let parts: Vec<&str> = path.split('/').collect();
    let (name, dirs) = parts.split_last().expect("split yields one part");
    let mut dir = dest
        .try_clone()
        .map_err(|e| safefs::SafeFsError::BadPath(e.to_string()))?;
    for d in dirs {
        dir = safefs::open_dir(&dir, d)?;
    }
    safefs::remove_tree(&dir, name, owner.into()).map(drop)
}

/// The note for the job's output.
pub(crate) fn note(tag: &str, s: Sources) -> String {
    let total = s.archive + s.peers;
    format!(
        "checkpoint {tag} restored: {} of {} from the job's other nodes, the rest from the archive",
        sluice_proto::summary::bytes(s.peers),
        sluice_proto::summary::bytes(total)
    )
}
