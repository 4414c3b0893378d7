//! The helper's six modes, each an entry point the `copy-as-user` command runs as the job user:
//! a whole copy ([`copy_tree`]), a shard ([`copy_shard`]), a copy a restarted agent resumes
//! ([`copy_tree_resumable`]), a copy through the node's cache ([`copy_tree_cached`]), and a
//! replica through the job's peers with its repair run (`copy_replica`, `copy_repair`, both
//! through [`copy_shard`]). Each walks the source, reports what it copies and copies it with
//! [`super::copy`]; what it says to the agent is [`super::protocol`].

use super::args::{PeerCopy, Shard, stripe_for};
use super::copy::{
    FileJob, Identified, PIECE, Piece, copy_files, create_dst, create_pair, identify,
    interleave_directories, piece_for, run_pieces,
};
use super::error::{HelperError, Input};
use super::protocol::{AgentMsg, FileIdent, HelperMsg, send};
use super::walk::{Entry, Tree, below, remove_any, umask};
use crate::shard::{ShardManifest, ShardPlan};
use sluice_peer::{Unit, units_of};
use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Copies `src` (a file or a directory tree) to `dst`, which must not exist; fails with what the
/// job shows ([`HelperError`]). Symlinks inside the tree are copied as symlinks. Nothing is
/// fsynced: staged data can be fetched again from its origin, and job end deletes it.
pub fn copy_tree(src: &Path, dst: &Path, out: &mut impl Write) -> Result<(), HelperError> {
    copy_tree_in_pieces(src, dst, piece_for(src, dst), None, None, out)
}

/// [`copy_tree`] of this node's share of the files only, with the manifest of all of them
/// written next to `dst` (`NAME.shard.json`); or, with [`Shard::peers`], this node's part of a
/// replica shared through the job's peers ([`copy_replica`], [`copy_repair`]).
pub fn copy_shard(
    src: &Path,
    dst: &Path,
    shard: &Shard,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    match shard.peers {
        Some(PeerCopy { repair: true, .. }) => copy_repair(src, dst, io::stdin().lock(), out),
        Some(PeerCopy {
            unit_size, cached, ..
        }) => {
            let answers = cached.then(|| io::stdin().lock());
            copy_replica(src, dst, shard, unit_size, answers, out)
        }
        None => copy_tree_in_pieces(src, dst, piece_for(src, dst), Some(shard), None, out),
    }
}

/// [`copy_tree`], with files larger than `piece` bytes copied as several pieces; with `shard`, only
/// the files this node owns.
///
/// With `resume` (a resumable copy, [`copy_tree_resumable`]): `dst` may hold what an earlier run
/// left; the files `resume` names whose source is still the version named are kept, everything
/// else there that is not part of the tree goes, and every file copied whole is reported.
fn copy_tree_in_pieces(
    src: &Path,
    dst: &Path,
    piece: u64,
    shard: Option<&Shard>,
    resume: Option<&HashMap<String, FileIdent>>,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    let tree = Tree::read(src)?;
    let umask = umask();
    let mut manifest = shard.map(|s| ShardManifest::new(&s.plan, &s.dataset, &s.source));
    // Whether this node copies the file at `rel` below the dataset ("" for a dataset that is one
    // file), listing it in the manifest.
    let mut mine = |rel: &Path, size: u64| match (shard, manifest.as_mut()) {
        (Some(s), Some(m)) => {
            let path = if rel.as_os_str().is_empty() {
                s.dataset.clone()
            } else {
                format!("{}/{}", s.dataset, rel.to_string_lossy())
            };
            let owned = s.plan.owns(&path);
            m.add(&s.plan, path, size);
            owned
        }
        _ => true,
    };
    let mut files: Vec<FileJob> = Vec::new();
    for (rel, size, mode) in tree.files() {
        if mine(rel, size) {
            files.push(FileJob {
                stripe: stripe_for(shard, size),
                // A name that is not UTF-8 cannot be noted: copied again after a restart.
                whole: resume.and(rel.to_str()).map(String::from),
                ..FileJob::new(below(src, rel), below(dst, rel), size, mode)
            });
        }
    }
    report_total(out, &files);
    let shared_tier = shard.is_some_and(|s| s.shared_tier);
    if let Some(keep) = resume {
        let kept;
        (kept, files) = keep_unchanged(files, keep);
        let (files, bytes) = count(&kept);
        send(out, &HelperMsg::Kept { files, bytes });
        out.flush().ok();
        clear_leftovers(dst, &tree, &kept)?;
    }
    tree.make(src, dst, umask, shared_tier, resume.is_some())?;
    if tree.dir.is_some() {
        files = interleave_directories(files);
    }
    if shared_tier {
        // This node owns these names now: what an earlier run of the job id left goes.
        for f in &files {
            match fs::remove_file(&f.dst) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(HelperError::io("replacing", &f.dst)(e));
                }
                _ => {}
            }
        }
    }
    copy_files(&files, umask, piece, out)?;
    match (shard, manifest) {
        (Some(s), Some(m)) if !s.shared_tier => write_manifest(dst, &s.dataset, m),
        _ => Ok(()),
    }
}

// ----------------------------------------------------------- resumed after an agent restart

/// [`copy_tree`] (or, with `shard`, [`copy_shard`]'s share of the files) that a restarted agent
/// can resume (`--resume`, see [`crate::resume`]). `dst` may hold what an earlier run of this
/// copy left. First the helper reads the agent's offers on `input` to their end: `keep SIZE DEV
/// INO MTIME MTIME_NS CTIME CTIME_NS "PATH"` for each file the agent noted as copied whole from
/// the source at PATH (below the dataset, JSON-quoted, `""` for a dataset that is one file) while
/// it had that identity, and whose staged copy the agent found unchanged since. After `total`, it keeps each
/// offered file whose source it opens now, as the job user, with exactly that identity, and
/// reports `kept F B`; everything else below `dst` that is not one of the tree's directories goes,
/// and the rest of the tree is made and copied as by [`copy_tree`]. Each file it copies whole, from
/// a source whose identity was the same before and after every piece, is reported as `whole SIZE
/// DEV INO MTIME MTIME_NS CTIME CTIME_NS "PATH"` (with its mode set), for the agent to note.
pub fn copy_tree_resumable(
    src: &Path,
    dst: &Path,
    shard: Option<&Shard>,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    let mut keep = HashMap::new();
    read_agent(input, Input::Offers, |msg| match msg {
        AgentMsg::Keep { file, path } => {
            keep.insert(path, file);
            true
        }
        _ => false,
    })?;
    copy_tree_in_pieces(src, dst, piece_for(src, dst), shard, Some(&keep), out)
}

/// Splits `files` into those `keep` offers whose source, opened now, is the version offered
/// (kept), and the rest (to copy). A source that cannot be opened is copied, and fails as it does.
fn keep_unchanged(
    files: Vec<FileJob>,
    keep: &HashMap<String, FileIdent>,
) -> (Vec<FileJob>, Vec<FileJob>) {
    files.into_iter().partition(|f| {
        let offered = f.whole.as_ref().and_then(|path| keep.get(path));
        offered
            .is_some_and(|want| identify(&f.src).ok().flatten().map(|(_, now)| now) == Some(*want))
    })
}

/// Removes what an earlier run left at `dst` besides the `kept` files and the tree's directories:
/// files cut short or to be copied again, links (made again), names no longer in the source.
/// This process is the job user and removes nothing through a link.
fn clear_leftovers(dst: &Path, tree: &Tree, kept: &[FileJob]) -> Result<(), HelperError> {
    let fail = |p: &Path, e: io::Error| HelperError::io("removing", p)(e);
    if tree.dir.is_none() {
        // A dataset that is one file: it is `dst`, kept or copied again.
        return match kept.is_empty() {
            true => remove_any(dst).map_err(|e| fail(dst, e)),
            false => Ok(()),
        };
    }
    match fs::symlink_metadata(dst) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return remove_any(dst).map_err(|e| fail(dst, e)),
        Err(_) => return Ok(()),
    }
    let mut stays: std::collections::HashSet<PathBuf> =
        kept.iter().map(|f| f.dst.clone()).collect();
    for e in &tree.entries {
        if let Entry::Dir(rel, _) = e {
            stays.insert(dst.join(rel));
        }
    }
    let mut dirs = vec![dst.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let listed = fs::read_dir(&dir).map_err(|e| fail(&dir, e))?;
        for e in listed {
            let path = e.map_err(|e| fail(&dir, e))?.path();
            let is_dir = fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
            if !stays.contains(&path) {
                remove_any(&path).map_err(|e| fail(&path, e))?;
            } else if is_dir {
                dirs.push(path);
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------- with the node's cache

/// [`copy_tree`] on a node with a cache (`--cached`), which the agent asks about every file. The
/// helper opens each regular, non-empty file of the source for reading, as the job user, and
/// reports its identity from `fstat` on that descriptor (`ident IDX SIZE DEV INO MTIME MTIME_NS
/// CTIME CTIME_NS MODE "PATH"`, after `total`), then `idents N`; a file it cannot open fails the copy before
/// anything is made (a user who cannot read a file gets nothing of it, from the cache or else).
/// It then reads the agent's answers on `input` to their end: `hit IDX` for each file the agent
/// holds in its cache for this user and this identity. It makes the tree; each hit as an empty
/// owner-writable file (`cached IDX`), which the agent writes from its cache and gives its mode;
/// and copies every other file, hashing each identified one as it copies it: `copied IDX PIECE
/// HASH` when every piece's descriptor had the reported identity before and after its copy and
/// gave exactly its size (a file that changed meanwhile is staged as read, but not cached).
pub fn copy_tree_cached(
    src: &Path,
    dst: &Path,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    copy_cached_in_pieces(src, dst, PIECE, input, out)
}

fn copy_cached_in_pieces(
    src: &Path,
    dst: &Path,
    piece: u64,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    let (tree, mut files) = read_whole(src, dst, out)?;
    let umask = umask();
    let mut listed = 0;
    for f in files.iter_mut() {
        let Some((opened, file)) = identify(&f.src)? else {
            continue; // no longer a regular file: copied as today (and failing as it does)
        };
        let rel = f.src.strip_prefix(src).ok().and_then(Path::to_str);
        let (Some(rel), true) = (rel, file.size > 0) else {
            continue;
        };
        let mode = opened.metadata().map_or(f.mode, |m| m.mode() & 0o7777);
        f.size = file.size;
        f.cache = Some(Identified {
            idx: listed,
            file,
            piece,
        });
        let path = rel.to_string();
        send(
            out,
            &HelperMsg::Ident {
                idx: listed,
                file,
                mode,
                path,
            },
        );
        listed += 1;
    }
    let hit = read_hits(listed, &vec![true; listed], input, out)?;
    tree.make(src, dst, umask, false, false)?;
    let mut rest = Vec::with_capacity(files.len());
    for f in files {
        match f.cache {
            Some(c) if hit[c.idx] => {
                create_dst(&f, f.mode | 0o200, umask)?;
                send(out, &HelperMsg::Cached { idx: c.idx });
            }
            _ => rest.push(f),
        }
    }
    out.flush().ok();
    if tree.dir.is_some() {
        rest = interleave_directories(rest);
    }
    copy_files(&rest, umask, piece, out)
}

/// The unit file name of the file at `rel` below a dataset named `dataset` (`NAME/rel`, or
/// `NAME` for a dataset that is one file), as the agents of the job name its units to each other.
pub fn peer_unit_file(dataset: &str, rel: &str) -> String {
    if rel.is_empty() {
        dataset.to_string()
    } else {
        format!("{dataset}/{rel}")
    }
}

/// Whether this node's helper copies `unit` from the origin: the units this node owns among
/// `plan`'s nodes, and every empty one (nothing to read, so every node makes its own). The
/// agent decides with this too which units it must fetch from the job's other nodes.
pub fn copies_unit(plan: &ShardPlan, unit: &Unit) -> bool {
    unit.len == 0 || plan.owns(&unit.key())
}

/// `--stage-mode=replicate` through the job's peers, the helper's part. It makes the whole tree
/// as the job user: every directory and link, and every file, each opened for reading first, so
/// the user's own permission on every file gates the dataset on every node. Of the bytes, it
/// copies the `unit_size` units this node owns ([`copies_unit`]), hashing each as it copies it.
/// The files with units it does not copy are made owner-writable and left to the agent, which
/// writes the other units into them (fetched from their owners) and gives them their mode.
///
/// On `out`, after `total F B` (the whole dataset): `file IDX SIZE MODE "PATH"` for every file
/// (MODE octal, PATH JSON-quoted, below the dataset), once the files the agent writes into are
/// made; then `unit IDX OFFSET HASH` for each unit copied (BLAKE3, hex) as it is done, and the
/// usual `progress F B` (F counting the files written whole here). A file whose name is not UTF-8
/// cannot be a unit's name: it is copied whole here, as on every node, and not listed.
///
/// With `answers` (`--peer-cached`, a node with a cache), the helper first opens every listed,
/// regular, non-empty file for reading and reports its identity from `fstat` on that descriptor
/// (`ident IDX SIZE DEV INO MTIME MTIME_NS CTIME CTIME_NS MODE "PATH"`, IDX as in its `file`
/// line; a file it cannot open fails the run as without a cache), then `idents N`, and reads the
/// agent's `hit IDX` answers to their end. A hit is made empty and owner-writable and none of its units is copied:
/// the agent writes it whole from its cache. Of every other identified file, a unit whose
/// descriptor did not have the reported identity before and after its copy is followed by
/// `changed IDX` (the agent does not cache that file).
fn copy_replica(
    src: &Path,
    dst: &Path,
    shard: &Shard,
    unit_size: u64,
    answers: Option<impl io::BufRead>,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    let (tree, mut files) = read_whole(src, dst, out)?;
    let umask = umask();
    tree.make(src, dst, umask, false, false)?;
    if tree.dir.is_some() {
        files = interleave_directories(files);
    }
    let mut pieces = Vec::new();
    let mut listed = Vec::new();
    // Each file's number in the `file` lines (`None`: not listed, copied whole here).
    let numbers: Vec<Option<usize>> = {
        let mut n = 0;
        files
            .iter()
            .map(|f| {
                let rel = f.src.strip_prefix(src).unwrap_or(Path::new(""));
                rel.to_str().map(|_| {
                    n += 1;
                    n - 1
                })
            })
            .collect()
    };
    let hits = match answers {
        Some(input) => identify_replica(src, &mut files, &numbers, unit_size, input, out)?,
        None => Vec::new(),
    };
    for (i, f) in files.iter_mut().enumerate() {
        let rel = f.src.strip_prefix(src).unwrap_or(Path::new(""));
        let Some(rel) = rel.to_str() else {
            pieces.push(Piece {
                file: i,
                offset: 0,
                len: None,
                shared: false,
                unit: None,
            });
            continue;
        };
        if f.cache.is_some_and(|c| hits.get(c.idx) == Some(&true)) {
            // Written whole by the agent, from its cache.
            f.partial = true;
            create_dst(f, f.mode | 0o200, umask)?;
            listed.push((f.size, f.mode, rel.to_string()));
            continue;
        }
        let units = units_of(&peer_unit_file(&shard.dataset, rel), f.size, unit_size);
        let here: Vec<&Unit> = units
            .iter()
            .filter(|u| copies_unit(&shard.plan, u))
            .collect();
        f.partial = here.len() < units.len();
        // Made now: the files the agent writes into (before it hears of them), and those of
        // several units (each unit opens the file).
        let made = f.partial || here.len() > 1;
        if made {
            create_pair(f, f.mode | 0o200, umask)?;
        }
        let idx = listed.len();
        for u in here {
            pieces.push(Piece {
                file: i,
                offset: u.offset,
                len: Some(u.len),
                shared: made,
                unit: Some(idx),
            });
        }
        listed.push((f.size, f.mode, rel.to_string()));
    }
    for (idx, (size, mode, path)) in listed.into_iter().enumerate() {
        send(
            out,
            &HelperMsg::File {
                idx,
                size,
                mode,
                path,
            },
        );
    }
    out.flush().ok();
    run_pieces(&files, &pieces, umask, out)
}

/// The cached part of [`copy_replica`]: identifies the listed files (`numbers`), reports them and
/// reads the agent's answers; returns which listed files are hits.
fn identify_replica(
    src: &Path,
    files: &mut [FileJob],
    numbers: &[Option<usize>],
    unit_size: u64,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<Vec<bool>, HelperError> {
    let mut identified = 0;
    let listed = numbers.iter().flatten().count();
    for (f, idx) in files.iter_mut().zip(numbers) {
        let Some(idx) = *idx else { continue };
        let Some((_, file)) = identify(&f.src)? else {
            continue; // no longer a regular file: copied as without a cache (and failing so)
        };
        if file.size == 0 {
            continue;
        }
        let rel = f.src.strip_prefix(src).ok().and_then(Path::to_str);
        let path = rel.unwrap_or("").to_string();
        f.size = file.size;
        f.cache = Some(Identified {
            idx,
            file,
            piece: unit_size,
        });
        let mode = f.mode;
        send(
            out,
            &HelperMsg::Ident {
                idx,
                file,
                mode,
                path,
            },
        );
        identified += 1;
    }
    let mut ok = vec![false; listed];
    for c in files.iter().filter_map(|f| f.cache) {
        ok[c.idx] = true;
    }
    read_hits(identified, &ok, input, out)
}

/// Reports `idents N` (`identified` files reported), then reads the agent's answers to their end:
/// `hit IDX` for a file `may_hit` allows, each once. Returns which files are hits.
fn read_hits(
    identified: usize,
    may_hit: &[bool],
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<Vec<bool>, HelperError> {
    send(out, &HelperMsg::Idents { count: identified });
    out.flush().ok();
    let mut hit = vec![false; may_hit.len()];
    read_agent(input, Input::CacheAnswers, |msg| match msg {
        AgentMsg::Hit { idx } if may_hit.get(idx) == Some(&true) && !hit[idx] => {
            hit[idx] = true;
            true
        }
        _ => false,
    })?;
    Ok(hit)
}

/// The repair run of a replica: copies, as the job user, the units the agent names on `input`
/// (`IDX OFFSET LEN "PATH"` lines; PATH JSON-quoted, below the dataset, "" for a dataset that
/// is one file) into the files the first run made, hashing each; reports `total`, then
/// `unit IDX OFFSET HASH` per unit as [`copy_replica`] does. The agent asks for these when the
/// node that owns them was routed around.
fn copy_repair(
    src: &Path,
    dst: &Path,
    input: impl io::BufRead,
    out: &mut impl Write,
) -> Result<(), HelperError> {
    let (mut files, mut pieces) = (Vec::new(), Vec::new());
    read_agent(input, Input::UnitRequests, |msg| {
        let AgentMsg::Repair {
            idx,
            offset,
            len,
            path,
        } = msg
        else {
            return false;
        };
        let rel = Path::new(&path);
        if rel
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return false;
        }
        pieces.push(Piece {
            file: files.len(),
            offset,
            len: Some(len),
            shared: true,
            unit: Some(idx),
        });
        files.push(FileJob {
            partial: true,
            ..FileJob::new(below(src, rel), below(dst, rel), len, 0)
        });
        true
    })?;
    report_total(out, &files);
    run_pieces(&files, &pieces, umask(), out)
}

/// Writes a shard's manifest next to the dataset at `dst`, as the job user, never through a link.
fn write_manifest(
    dst: &Path,
    dataset: &str,
    mut manifest: ShardManifest,
) -> Result<(), HelperError> {
    let path = dst
        .parent()
        .unwrap_or(Path::new("/"))
        .join(crate::shard::manifest_name(dataset));
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&path)
        .and_then(|mut f| f.write_all(&manifest.to_json()))
        .map_err(HelperError::io("writing", &path))
}

/// The tree at `src` and every regular file of it, to copy to the same place below `dst`, reported
/// as this run's `total`.
fn read_whole(
    src: &Path,
    dst: &Path,
    out: &mut impl Write,
) -> Result<(Tree, Vec<FileJob>), HelperError> {
    let tree = Tree::read(src)?;
    let files: Vec<FileJob> = tree
        .files()
        .map(|(rel, size, mode)| FileJob::new(below(src, rel), below(dst, rel), size, mode))
        .collect();
    report_total(out, &files);
    Ok((tree, files))
}

/// The files and bytes of `files`.
fn count(files: &[FileJob]) -> (u64, u64) {
    (files.len() as u64, files.iter().map(|f| f.size).sum())
}

/// Reports `total F B`: what this run copies.
fn report_total(out: &mut impl Write, files: &[FileJob]) {
    let (files, bytes) = count(files);
    send(out, &HelperMsg::Total { files, bytes });
    out.flush().ok();
}

/// Reads the agent's messages on `input` to its end (`what` they are, for errors), each one that
/// `take` takes; any other line fails the run.
fn read_agent(
    input: impl io::BufRead,
    what: Input,
    mut take: impl FnMut(AgentMsg) -> bool,
) -> Result<(), HelperError> {
    for line in input.lines() {
        let line = line.map_err(|source| HelperError::ReadInput { what, source })?;
        if !AgentMsg::decode(&line).is_ok_and(&mut take) {
            return Err(HelperError::BadInput { what, line });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy_as_user::{Event, Failure, ShardArgs, piece_hashes_hash};
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    #[test]
    fn copies_a_tree_and_reports_progress() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        fs::create_dir_all(src.path().join("a/b")).unwrap();
        fs::write(src.path().join("a/b/x"), vec![7u8; 100_000]).unwrap();
        fs::write(src.path().join("empty"), b"").unwrap();
        std::os::unix::fs::symlink("a/b/x", src.path().join("link")).unwrap();
        let mut out = Vec::new();
        copy_tree(src.path(), &dst.path().join("ds"), &mut out).unwrap();
        assert_eq!(
            fs::read(dst.path().join("ds/a/b/x")).unwrap(),
            vec![7u8; 100_000]
        );
        assert_eq!(fs::read(dst.path().join("ds/empty")).unwrap(), b"");
        assert_eq!(
            fs::read_link(dst.path().join("ds/link")).unwrap(),
            Path::new("a/b/x")
        );
        assert_eq!(
            counts(&out),
            (
                Some(Event::Total {
                    files: 2,
                    bytes: 100_000
                }),
                Some(Event::Progress {
                    files: 2,
                    bytes: 100_000
                })
            )
        );
    }

    /// The lines of a resumable copy: `kept`, and each `whole` file by its path.
    fn resume_lines(out: Vec<u8>) -> (Option<(u64, u64)>, HashMap<String, FileIdent>) {
        let (mut kept, mut whole) = (None, HashMap::new());
        for line in String::from_utf8(out).unwrap().lines() {
            match HelperMsg::decode(line).unwrap() {
                HelperMsg::Kept { files, bytes } => kept = Some((files, bytes)),
                HelperMsg::Whole { file, path } => {
                    assert!(whole.insert(path, file).is_none(), "reported twice: {line}");
                }
                _ => {}
            }
        }
        (kept, whole)
    }

    /// The count a line of the helper is, if it is one.
    fn event(line: &str) -> Option<Event> {
        HelperMsg::decode(line).ok()?.event()
    }

    /// The counts on the helper's first line (the total) and on its last (the final progress).
    fn counts(out: &[u8]) -> (Option<Event>, Option<Event>) {
        let text = std::str::from_utf8(out).unwrap();
        (
            text.lines().next().and_then(event),
            text.lines().last().and_then(event),
        )
    }

    /// What the agent offers a resumable copy to keep: one line.
    fn keep_line(file: &FileIdent, path: &str) -> String {
        let offer = AgentMsg::Keep {
            file: *file,
            path: path.into(),
        };
        format!("{offer}\n")
    }

    /// A resumable copy reports every file it copied whole, with its source's identity (big files
    /// in pieces too, once their last piece and mode are in). Run again over what it left, as a
    /// restarted agent runs it: an offered file whose source is unchanged is kept as it is (same
    /// inode); one whose source changed is copied again, and so is what was cut short; names no
    /// longer in the source go; the result is the source's tree.
    #[test]
    fn a_resumable_copy_keeps_the_files_offered_whose_source_is_unchanged() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let ds = dst.path().join("ds");
        fs::create_dir_all(src.path().join("d")).unwrap();
        let big: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        fs::write(src.path().join("big"), &big).unwrap();
        fs::set_permissions(src.path().join("big"), fs::Permissions::from_mode(0o444)).unwrap();
        fs::write(src.path().join("d/same"), b"same bytes").unwrap();
        fs::write(src.path().join("d/changes"), b"old bytes").unwrap();
        fs::write(src.path().join("d/cut"), b"cut short by the kill").unwrap();
        std::os::unix::fs::symlink("d/same", src.path().join("link")).unwrap();
        let none = HashMap::new();
        let mut out = Vec::new();
        copy_tree_in_pieces(src.path(), &ds, 4096, None, Some(&none), &mut out).unwrap();
        let (kept, whole) = resume_lines(out);
        assert_eq!(kept, Some((0, 0)));
        let mut names: Vec<&str> = whole.keys().map(String::as_str).collect();
        names.sort();
        assert_eq!(names, ["big", "d/changes", "d/cut", "d/same"]);
        let ident = |rel: &str| FileIdent::of(&fs::File::open(src.path().join(rel)).unwrap());
        assert_eq!(Some(whole["big"]), ident("big").unwrap());
        assert_eq!(fs::read(ds.join("big")).unwrap(), big);

        // What a kill leaves: a file cut short, a name the source no longer has; meanwhile the
        // source of another changed.
        fs::write(ds.join("d/cut"), b"cut").unwrap();
        fs::write(ds.join("d/gone"), b"stale").unwrap();
        fs::write(src.path().join("d/changes"), b"new bytes, longer").unwrap();
        let ino = |rel: &str| fs::symlink_metadata(ds.join(rel)).unwrap().ino();
        let (same_ino, big_ino) = (ino("d/same"), ino("big"));
        let offers: String = ["big", "d/same", "d/changes"]
            .iter()
            .map(|p| keep_line(&whole[*p], p))
            .collect();
        let mut out = Vec::new();
        let keep: HashMap<String, FileIdent> = offers
            .lines()
            .map(|l| match AgentMsg::decode(l) {
                Ok(AgentMsg::Keep { file, path }) => (path, file),
                other => panic!("not an offer: {other:?}"),
            })
            .collect();
        copy_tree_in_pieces(src.path(), &ds, 4096, None, Some(&keep), &mut out).unwrap();
        let (kept, whole) = resume_lines(out);
        assert_eq!(
            kept,
            Some((2, big.len() as u64 + 10)),
            "big and d/same kept"
        );
        let mut copied: Vec<&str> = whole.keys().map(String::as_str).collect();
        copied.sort();
        assert_eq!(copied, ["d/changes", "d/cut"], "copied again");
        assert_eq!((ino("d/same"), ino("big")), (same_ino, big_ino));
        assert_eq!(
            fs::read(ds.join("d/changes")).unwrap(),
            b"new bytes, longer"
        );
        assert_eq!(
            fs::read(ds.join("d/cut")).unwrap(),
            b"cut short by the kill"
        );
        assert!(!ds.join("d/gone").exists());
        assert_eq!(fs::read_link(ds.join("link")).unwrap(), Path::new("d/same"));
        assert_eq!(
            fs::metadata(ds.join("big")).unwrap().mode() & 0o777,
            0o444,
            "kept with its mode"
        );
        // Offers are read as the agent writes them; anything else fails the copy.
        let mut out = Vec::new();
        let bad = copy_tree_resumable(src.path(), &ds, None, &b"keep nonsense\n"[..], &mut out);
        assert!(bad.unwrap_err().to_string().contains("bad offer"));
    }

    /// A dataset that is one file resumes too: kept when its source is unchanged, else copied.
    #[test]
    fn a_resumable_copy_of_one_file_keeps_it_or_copies_it_again() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let (from, to) = (src.path().join("one.bin"), dst.path().join("one"));
        fs::write(&from, b"one file").unwrap();
        let mut out = Vec::new();
        copy_tree_resumable(&from, &to, None, &b""[..], &mut out).unwrap();
        let (_, whole) = resume_lines(out);
        let offer = keep_line(&whole[""], "");
        let ino = fs::metadata(&to).unwrap().ino();
        let mut out = Vec::new();
        copy_tree_resumable(&from, &to, None, offer.as_bytes(), &mut out).unwrap();
        assert_eq!(resume_lines(out), (Some((1, 8)), HashMap::new()));
        assert_eq!(fs::metadata(&to).unwrap().ino(), ino, "kept");
        fs::write(&from, b"another file").unwrap();
        let mut out = Vec::new();
        copy_tree_resumable(&from, &to, None, offer.as_bytes(), &mut out).unwrap();
        assert_eq!(resume_lines(out).0, Some((0, 0)));
        assert_eq!(fs::read(&to).unwrap(), b"another file");
    }

    #[test]
    fn big_files_are_copied_in_pieces_with_their_mode() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..100_003u32).map(|i| (i % 251) as u8).collect();
        fs::write(src.path().join("big"), &data).unwrap();
        fs::set_permissions(src.path().join("big"), fs::Permissions::from_mode(0o444)).unwrap();
        fs::write(src.path().join("small"), b"abc").unwrap();
        fs::set_permissions(src.path().join("small"), fs::Permissions::from_mode(0o640)).unwrap();
        let mut out = Vec::new();
        // 4 KiB pieces: the big file is 25 pieces, copied by several threads.
        copy_tree_in_pieces(
            src.path(),
            &dst.path().join("ds"),
            4096,
            None,
            None,
            &mut out,
        )
        .unwrap();
        let big = dst.path().join("ds/big");
        assert_eq!(fs::read(&big).unwrap(), data);
        assert_eq!(fs::metadata(&big).unwrap().mode() & 0o7777, 0o444);
        let small = dst.path().join("ds/small");
        assert_eq!(fs::read(&small).unwrap(), b"abc");
        assert_eq!(fs::metadata(&small).unwrap().mode() & 0o7777, 0o640);
        assert_eq!(
            counts(&out).1,
            Some(Event::Progress {
                files: 2,
                bytes: 100_006
            })
        );

        // One file as the source: NAME is that file.
        copy_tree_in_pieces(
            &src.path().join("big"),
            &dst.path().join("one"),
            4096,
            None,
            None,
            &mut Vec::new(),
        )
        .unwrap();
        assert_eq!(fs::read(dst.path().join("one")).unwrap(), data);
    }

    #[test]
    fn a_shard_copies_the_nodes_own_files_and_the_whole_manifest() {
        let src = tempfile::tempdir().unwrap();
        for i in 0..30 {
            let d = src.path().join(format!("d{}", i % 3));
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join(format!("f{i}")), vec![i as u8; 100 + i]).unwrap();
        }
        let nodes: Vec<String> = ["n1", "n2"].map(String::from).into();
        let mut union = std::collections::BTreeSet::new();
        let mut manifests = Vec::new();
        for node in &nodes {
            let stage = tempfile::tempdir().unwrap();
            let shard = ShardArgs {
                shard_nodes: Some(nodes.join(",")),
                shard_node: Some(node.clone()),
                dataset: Some("ds".into()),
                source: Some(src.path().display().to_string()),
                ..Default::default()
            }
            .shard()
            .unwrap()
            .unwrap();
            let mut out = Vec::new();
            copy_shard(src.path(), &stage.path().join("ds"), &shard, &mut out).unwrap();
            let manifest = fs::read(stage.path().join("ds.shard.json")).unwrap();
            let parsed: ShardManifest = serde_json::from_slice(&manifest).unwrap();
            assert_eq!(parsed.files.len(), 30);
            let mine: Vec<_> = parsed.files.iter().filter(|f| &f.node == node).collect();
            // Every directory is there; of the files, exactly the ones the manifest gives this node.
            for d in 0..3 {
                assert!(stage.path().join(format!("ds/d{d}")).is_dir());
            }
            let mut held = 0;
            for f in &parsed.files {
                let here = stage.path().join(&f.path);
                assert_eq!(here.exists(), &f.node == node, "{}", f.path);
                if here.exists() {
                    assert_eq!(fs::metadata(&here).unwrap().len(), f.size);
                    assert!(union.insert(f.path.clone()), "{} twice", f.path);
                    held += 1;
                }
            }
            assert_eq!(held, mine.len());
            let bytes: u64 = mine.iter().map(|f| f.size).sum();
            assert_eq!(
                counts(&out).0,
                Some(Event::Total {
                    files: mine.len() as u64,
                    bytes
                }),
                "{node} reports its own share"
            );
            manifests.push(manifest);
        }
        assert_eq!(union.len(), 30);
        assert_eq!(manifests[0], manifests[1]);
        let outside = ShardArgs {
            shard_nodes: Some("n1,n2".into()),
            shard_node: Some("n9".into()),
            dataset: Some("ds".into()),
            source: Some("/x".into()),
            ..Default::default()
        };
        assert!(outside.shard().unwrap_err().contains("n9 is not one of"));
    }

    /// The shared tier: directories another node made are used, a file an earlier run left is
    /// replaced, no manifest is written, and on Lustre a file of a striped class is created by
    /// `lfs setstripe` (a fake `lfs` here: neither Lustre nor the real `lfs` exist where this runs).
    #[test]
    fn a_shared_tier_copy_joins_other_nodes_and_stripes_big_files() {
        let src = tempfile::tempdir().unwrap();
        fs::create_dir_all(src.path().join("d")).unwrap();
        fs::write(src.path().join("d/big"), vec![3u8; 5000]).unwrap();
        fs::set_permissions(src.path().join("d/big"), fs::Permissions::from_mode(0o640)).unwrap();
        fs::write(src.path().join("d/small"), b"tiny").unwrap();
        let stage = tempfile::tempdir().unwrap();
        let dst = stage.path().join("ds");
        // Another node made the directories; an earlier run left a stale copy of the big file.
        fs::create_dir_all(dst.join("d")).unwrap();
        fs::write(dst.join("d/big"), b"stale").unwrap();
        let bin = tempfile::tempdir().unwrap();
        let (lfs, record) = (bin.path().join("lfs"), bin.path().join("args"));
        fs::write(
            &lfs,
            format!(
                "#!/bin/sh\nprintf '%s ' \"$@\" >> '{}'\nfor a; do last=$a; done\n: > \"$last\"\n",
                record.display()
            ),
        )
        .unwrap();
        fs::set_permissions(&lfs, fs::Permissions::from_mode(0o755)).unwrap();
        let shard = ShardArgs {
            shard_nodes: Some("n1".into()),
            shard_node: Some("n1".into()),
            dataset: Some("ds".into()),
            source: Some(src.path().display().to_string()),
            shared_tier: true,
            lfs: Some(lfs),
            stripe: vec!["4096:2:1048576".into()],
            ..Default::default()
        }
        .shard()
        .unwrap()
        .unwrap();
        let mut copied = Ok(());
        for _ in 0..50 {
            // A fork elsewhere in the test binary may briefly hold the fresh script open.
            let _ = fs::remove_file(dst.join("d/small"));
            copied = copy_shard(src.path(), &dst, &shard, &mut Vec::new());
            if !matches!(&copied, Err(e) if e.to_string().contains("Text file busy")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        copied.unwrap();
        assert_eq!(fs::read(dst.join("d/big")).unwrap(), vec![3u8; 5000]);
        assert_eq!(
            fs::metadata(dst.join("d/big")).unwrap().mode() & 0o7777,
            0o640
        );
        assert_eq!(fs::read(dst.join("d/small")).unwrap(), b"tiny");
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            format!("setstripe -c 2 -S 1048576 {} ", dst.join("d/big").display()),
            "only the file of the striped class goes through lfs"
        );
        assert!(!stage.path().join("ds.shard.json").exists());
        let bad = ShardArgs {
            shard_nodes: Some("n1".into()),
            shard_node: Some("n1".into()),
            dataset: Some("ds".into()),
            source: Some("/x".into()),
            shared_tier: true,
            lfs: Some("/bin/lfs".into()),
            stripe: vec!["1:2".into()],
            ..Default::default()
        };
        assert!(bad.shard().unwrap_err().contains("MIN_SIZE:COUNT:SIZE"));
    }

    /// What one node's helper did for a replica: its lines, parsed.
    struct ReplicaRun {
        total: Option<Event>,
        files: Vec<(usize, u64, u32, String)>,
        units: Vec<(usize, u64, blake3::Hash)>,
        last: Option<Event>,
    }

    fn parse_run(out: Vec<u8>) -> ReplicaRun {
        let text = String::from_utf8(out).unwrap();
        let mut run = ReplicaRun {
            total: None,
            files: Vec::new(),
            units: Vec::new(),
            last: None,
        };
        for line in text.lines() {
            let msg = HelperMsg::decode(line);
            match (msg.as_ref().ok().and_then(HelperMsg::event), msg) {
                (Some(e @ Event::Total { .. }), _) => run.total = Some(e),
                (Some(e), _) => run.last = Some(e),
                (
                    None,
                    Ok(HelperMsg::File {
                        idx,
                        size,
                        mode,
                        path,
                    }),
                ) => {
                    assert!(run.units.is_empty(), "every file is listed before a unit");
                    run.files.push((idx, size, mode, path))
                }
                (None, Ok(HelperMsg::Unit { idx, offset, hash })) => {
                    run.units.push((idx, offset, hash))
                }
                (None, Ok(HelperMsg::Changed { idx })) => {
                    panic!("file {idx} reported changed, but no file of these tests changes")
                }
                (None, _) => panic!("a line the agent cannot read: {line:?}"),
            }
        }
        run
    }

    fn replica_args(nodes: &[&str], node: &str, src: &Path, repair: bool) -> Shard {
        ShardArgs {
            shard_nodes: Some(nodes.join(",")),
            shard_node: Some(node.into()),
            dataset: Some("ds".into()),
            source: Some(src.display().to_string()),
            peer_unit_size: Some(4096),
            peer_repair: repair,
            ..Default::default()
        }
        .shard()
        .unwrap()
        .unwrap()
    }

    /// A replica on 3 nodes: each node makes the whole tree and copies exactly the units it owns
    /// (every empty file on every node), reporting each with the hash of the source's bytes; the
    /// three together copy every unit once. The files with others' units are owner-writable for
    /// the agent; the others have their mode. A repair run then copies named units into them.
    #[test]
    fn a_replica_copies_the_nodes_units_hashed_and_makes_every_file() {
        let src = tempfile::tempdir().unwrap();
        fs::create_dir_all(src.path().join("d/e")).unwrap();
        let big: Vec<u8> = (0..3 * 4096 + 123u32).map(|i| (i % 249) as u8).collect();
        fs::write(src.path().join("d/big"), &big).unwrap();
        fs::set_permissions(src.path().join("d/big"), fs::Permissions::from_mode(0o444)).unwrap();
        for i in 0..12 {
            fs::write(src.path().join(format!("d/e/s{i}")), vec![i as u8; 100 + i]).unwrap();
        }
        fs::set_permissions(src.path().join("d/e/s1"), fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(src.path().join("empty"), b"").unwrap();
        std::os::unix::fs::symlink("d/big", src.path().join("link")).unwrap();
        let nodes = ["n1", "n2", "n3"];
        let mut copied = std::collections::BTreeMap::new();
        let mut stages = Vec::new();
        for node in nodes {
            let stage = tempfile::tempdir().unwrap();
            let dst = stage.path().join("ds");
            let shard = replica_args(&nodes, node, src.path(), false);
            let mut out = Vec::new();
            copy_shard(src.path(), &dst, &shard, &mut out).unwrap();
            let run = parse_run(out);
            assert_eq!(
                run.total,
                Some(Event::Total {
                    files: 14,
                    bytes: big.len() as u64 + (0..12).map(|i| 100 + i).sum::<u64>()
                }),
                "{node}: the whole dataset"
            );
            assert_eq!(run.files.len(), 14);
            assert_eq!(fs::read_link(dst.join("link")).unwrap(), Path::new("d/big"));
            for (idx, size, mode, path) in &run.files {
                let here = dst.join(path);
                let want_mode = fs::metadata(src.path().join(path)).unwrap().mode() & 0o7777;
                assert_eq!(*mode, want_mode, "{path}");
                let units = units_of(&peer_unit_file("ds", path), *size, 4096);
                let mine: Vec<&Unit> = units
                    .iter()
                    .filter(|u| copies_unit(&shard.plan, u))
                    .collect();
                // Reported as each is done: the copy threads finish them in any order.
                let mut reported: Vec<u64> = run
                    .units
                    .iter()
                    .filter(|u| u.0 == *idx)
                    .map(|u| u.1)
                    .collect();
                reported.sort_unstable();
                assert_eq!(
                    reported,
                    mine.iter().map(|u| u.offset).collect::<Vec<_>>(),
                    "{node}: {path}"
                );
                let source = fs::read(src.path().join(path)).unwrap();
                if mine.is_empty() {
                    assert!(here.is_file(), "{node}: {path} made for the agent");
                } else {
                    let copy = fs::read(&here).unwrap();
                    for u in &mine {
                        let r = u.offset as usize..(u.offset + u.len) as usize;
                        assert_eq!(copy[r.clone()], source[r.clone()], "{node}: {path}");
                        let (_, _, hash) = run
                            .units
                            .iter()
                            .find(|x| x.0 == *idx && x.1 == u.offset)
                            .unwrap();
                        assert_eq!(*hash, blake3::hash(&source[r]), "{node}: {path}");
                        copied
                            .entry((path.clone(), u.offset))
                            .or_insert_with(Vec::new)
                            .push(node);
                    }
                }
                let mode_here = fs::metadata(&here).unwrap().mode() & 0o7777;
                if mine.len() < units.len() {
                    assert_eq!(
                        mode_here,
                        want_mode | 0o200,
                        "{node}: {path} is the agent's"
                    );
                } else {
                    assert_eq!(mode_here, want_mode, "{node}: {path}");
                }
            }
            stages.push((stage, shard));
        }
        // Every unit copied once in the job, the empty file's by every node.
        let all: usize = 4 + 12 + 1;
        assert_eq!(copied.len(), all);
        for ((path, offset), by) in &copied {
            let want = if path == "empty" { 3 } else { 1 };
            assert_eq!(by.len(), want, "{path}@{offset}: {by:?}");
        }

        // n1 repairs the units of d/big it did not copy (their owner was routed around).
        let (stage, shard) = &stages[0];
        let dst = stage.path().join("ds");
        let missing: Vec<Unit> = units_of("ds/d/big", big.len() as u64, 4096)
            .into_iter()
            .filter(|u| !copies_unit(&shard.plan, u))
            .collect();
        assert!(
            !missing.is_empty(),
            "n1 owns some of d/big's units but not all"
        );
        let requests: String = missing
            .iter()
            .enumerate()
            .map(|(i, u)| format!("{} {} {} \"d/big\"\n", i + 7, u.offset, u.len))
            .collect();
        let mut out = Vec::new();
        copy_repair(src.path(), &dst, requests.as_bytes(), &mut out).unwrap();
        let run = parse_run(out);
        assert_eq!(run.units.len(), missing.len());
        for (i, u) in missing.iter().enumerate() {
            let r = u.offset as usize..(u.offset + u.len) as usize;
            assert!(
                run.units
                    .contains(&(i + 7, u.offset, blake3::hash(&big[r]))),
                "unit {u:?}: {:?}",
                run.units
            );
        }
        let copy = fs::read(dst.join("d/big")).unwrap();
        for u in &missing {
            let r = u.offset as usize..(u.offset + u.len) as usize;
            assert_eq!(copy[r.clone()], big[r]);
        }
        let bad = copy_repair(src.path(), &dst, &b"0 0 1 \"../x\"\n"[..], &mut Vec::new());
        assert!(bad.unwrap_err().to_string().contains("bad unit request"));
        let e = copy_repair(
            src.path(),
            &dst,
            &b"0 0 9999 \"d/e/s2\"\n"[..],
            &mut Vec::new(),
        );
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("shorter than when it was listed")
        );
    }

    /// A cached copy: every non-empty file identified from its descriptor, a hit only made (empty,
    /// owner-writable) for the agent, the others copied with the hash of their pieces in order,
    /// which the agent can compute from the staged copy; an answer naming no file is refused.
    #[test]
    fn a_cached_copy_identifies_files_makes_hits_and_hashes_the_rest_by_piece() {
        let src = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..5 * 4096 + 99u32).map(|i| (i % 253) as u8).collect();
        fs::write(src.path().join("big"), &big).unwrap();
        fs::set_permissions(src.path().join("big"), fs::Permissions::from_mode(0o444)).unwrap();
        fs::create_dir(src.path().join("d")).unwrap();
        fs::write(src.path().join("d/small"), b"small").unwrap();
        fs::write(src.path().join("empty"), b"").unwrap();
        let dst = tempfile::tempdir().unwrap();
        let run = |answers: &str, to: &str| {
            let mut out = Vec::new();
            let r = copy_cached_in_pieces(
                src.path(),
                &dst.path().join(to),
                4096,
                answers.as_bytes(),
                &mut out,
            );
            (r, String::from_utf8(out).unwrap())
        };
        let (r, text) = run("", "miss");
        r.unwrap();
        let lines: Vec<HelperMsg> = text
            .lines()
            .filter_map(|l| HelperMsg::decode(l).ok())
            .collect();
        let idents: Vec<(usize, FileIdent, String)> = lines
            .iter()
            .filter_map(|l| match l {
                HelperMsg::Ident {
                    idx, file, path, ..
                } => Some((*idx, *file, path.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            idents.iter().map(|i| i.2.as_str()).collect::<Vec<_>>(),
            ["big", "d/small"],
            "the non-empty files"
        );
        let md = fs::metadata(src.path().join("big")).unwrap();
        assert_eq!((idents[0].1.ino, idents[0].1.size), (md.ino(), md.len()));
        assert!(lines.contains(&HelperMsg::Idents { count: 2 }));
        let pieces: Vec<blake3::Hash> = big.chunks(4096).map(blake3::hash).collect();
        assert!(
            lines.contains(&HelperMsg::Copied {
                idx: 0,
                piece: 4096,
                hash: piece_hashes_hash(&pieces)
            }),
            "{text}"
        );
        assert!(lines.contains(&HelperMsg::Copied {
            idx: 1,
            piece: 4096,
            hash: piece_hashes_hash(&[blake3::hash(b"small")])
        }));
        assert_eq!(fs::read(dst.path().join("miss/big")).unwrap(), big);

        // The big file a hit: made empty for the agent, not copied.
        let (r, text) = run("hit 0\n", "hit");
        r.unwrap();
        assert!(text.lines().any(|l| l == "cached 0"), "{text}");
        assert!(!text.contains("copied 0 "), "{text}");
        let made = fs::metadata(dst.path().join("hit/big")).unwrap();
        assert_eq!((made.len(), made.mode() & 0o7777), (0, 0o644));
        assert_eq!(fs::read(dst.path().join("hit/d/small")).unwrap(), b"small");
        assert_eq!(
            counts(text.as_bytes()).1,
            Some(Event::Progress { files: 2, bytes: 5 }),
            "the helper counts what it copied"
        );
        let (r, _) = run("hit 2\n", "bad");
        assert!(r.unwrap_err().to_string().contains("bad cache answer"));
        assert!(
            !dst.path().join("bad").exists(),
            "nothing made on a bad answer"
        );
    }

    #[test]
    fn missing_source_is_not_found() {
        let dst = tempfile::tempdir().unwrap();
        let e = copy_tree(
            Path::new("/nonexistent/sluice"),
            &dst.path().join("x"),
            &mut Vec::new(),
        )
        .unwrap_err();
        assert_eq!(e.failure(), Failure::NotFound);
    }
}
