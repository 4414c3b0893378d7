//! What commits a checkpoint: the checks on `sluice ckpt commit TAG`, and the completion signals
//! frameworks leave in the checkpoint directory (read without following links, as root, so only
//! files the job user owns count).

use crate::job::ckpts::CommitError;
use nix::errno::Errno;
use sluice_core::safefs::{self, Owner, SafeFsError};
use sluice_proto::options::validate_tag;
use std::os::fd::{AsFd, OwnedFd};

/// Largest completion-signal file read (`latest`, `latest_checkpointed_iteration.txt`).
const MAX_SIGNAL_FILE: usize = 256;

/// Checks a commit's tag and that `ckpt/TAG` is a directory owned by the job user (no symlink).
pub fn check_commit_dir(ckpt_dir: &OwnedFd, tag: &str, uid: u32) -> Result<(), CommitError> {
    validate_tag("sluice ckpt commit", tag).map_err(|e| CommitError::BadTag(e.message))?;
    let tag_owned = || tag.to_string();
    let fd = safefs::open_dir(ckpt_dir, tag).map_err(|e| match e.errno() {
        Some(Errno::ENOENT) => CommitError::Missing { tag: tag_owned() },
        Some(Errno::ENOTDIR | Errno::ELOOP) => CommitError::NotADirectory { tag: tag_owned() },
        _ => CommitError::Unusable {
            tag: tag_owned(),
            source: e,
        },
    })?;
    let st = nix::sys::stat::fstat(&fd).map_err(|errno| CommitError::Stat {
        tag: tag_owned(),
        errno,
    })?;
    if st.st_uid != uid {
        return Err(CommitError::NotOwned { tag: tag_owned() });
    }
    Ok(())
}

/// After `--ckpt-restore` placed `tag`, writes the completion signal its framework would have left
/// beside it, so that loading "the latest checkpoint of this directory" finds it, as it did in the
/// job that saved it: DeepSpeed's `latest` (holding the tag) for `global_stepN`, Megatron's
/// `latest_checkpointed_iteration.txt` (holding N) for `iter_NNNNNNN`. Other tags get none. The file
/// is the job user's; one already there is replaced.
pub fn write_restored_signal(
    ckpt_dir: &OwnedFd,
    tag: &str,
    owner: Owner,
) -> Result<(), SafeFsError> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (name, content) = match (tag.strip_prefix("global_step"), tag.strip_prefix("iter_")) {
        (Some(n), _) if digits(n) => ("latest", tag.to_string()),
        (_, Some(n)) if n.len() == 7 && digits(n) => (
            "latest_checkpointed_iteration.txt",
            n.trim_start_matches('0').to_string(),
        ),
        _ => return Ok(()),
    };
    let content = if content.is_empty() {
        "0".to_string()
    } else {
        content
    };
    safefs::remove_tree(ckpt_dir, name, owner.into())?.all_gone(name)?;
    let mut f = safefs::create_file(ckpt_dir, name, Some(owner), 0o644)?;
    std::io::Write::write_all(&mut f, content.as_bytes()).map_err(|e| SafeFsError::Sys {
        op: "write",
        path: name.into(),
        errno: Errno::from_raw(e.raw_os_error().unwrap_or(0)),
    })
}

/// Reads a small completion-signal file without following links; `None` if absent or unusable.
fn read_signal(dir: impl AsFd, name: &str, uid: u32) -> Option<String> {
    use nix::fcntl::{OFlag, openat};
    use std::io::Read;
    let fd = openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK,
        nix::sys::stat::Mode::empty(),
    )
    .ok()?;
    let st = nix::sys::stat::fstat(&fd).ok()?;
    let regular = nix::sys::stat::SFlag::from_bits_truncate(st.st_mode)
        & nix::sys::stat::SFlag::S_IFMT
        == nix::sys::stat::SFlag::S_IFREG;
    if !regular || st.st_uid != uid {
        return None;
    }
    let mut buf = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_SIGNAL_FILE as u64)
        .read_to_end(&mut buf)
        .ok()?;
    Some(String::from_utf8_lossy(&buf).trim().to_string())
}

fn is_dir_of(dir: impl AsFd, name: &str, uid: u32) -> bool {
    safefs::check_component(name).is_ok()
        && safefs::open_dir(dir, name)
            .ok()
            .and_then(|fd| nix::sys::stat::fstat(&fd).ok())
            .is_some_and(|st| st.st_uid == uid)
}

/// Finds the tags that frameworks marked complete in the job's checkpoint directory.
pub fn scan_signals(ckpt_dir: &OwnedFd, uid: u32) -> Vec<String> {
    let mut tags = Vec::new();
    // DeepSpeed: `latest` holds the tag of the last complete checkpoint.
    if let Some(tag) = read_signal(ckpt_dir, "latest", uid)
        && validate_tag("latest", &tag).is_ok()
        && is_dir_of(ckpt_dir, &tag, uid)
    {
        tags.push(tag);
    }
    // Megatron: `latest_checkpointed_iteration.txt` holds N; the checkpoint is `iter_%07d`.
    if let Some(n) = read_signal(ckpt_dir, "latest_checkpointed_iteration.txt", uid)
        .and_then(|s| s.parse::<u64>().ok())
    {
        let tag = format!("iter_{n:07}");
        if is_dir_of(ckpt_dir, &tag, uid) {
            tags.push(tag);
        }
    }
    // torch.distributed.checkpoint: `TAG/.metadata` is written last.
    if let Ok(dup) = ckpt_dir.try_clone()
        && let Ok(mut d) = nix::dir::Dir::from_fd(dup)
    {
        let names: Vec<String> = d
            .iter()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type() == Some(nix::dir::Type::Directory))
            .filter_map(|e| e.file_name().to_str().ok().map(String::from))
            .filter(|n| validate_tag("scan", n).is_ok())
            .take(10_000)
            .collect();
        for name in names {
            if let Ok(sub) = safefs::open_dir(ckpt_dir, &name)
                && read_signal(&sub, ".metadata", uid).is_some()
            {
                tags.push(name);
            }
        }
    }
    tags.sort();
    tags.dedup();
    tags
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framework_signals() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let d = tmp.path();
        std::fs::create_dir_all(d.join("global_step100")).unwrap();
        std::fs::write(d.join("latest"), "global_step100\n").unwrap();
        std::fs::create_dir_all(d.join("iter_0000200")).unwrap();
        std::fs::write(d.join("latest_checkpointed_iteration.txt"), "200").unwrap();
        std::fs::create_dir_all(d.join("dcp-300")).unwrap();
        std::fs::write(d.join("dcp-300/.metadata"), "x").unwrap();
        std::fs::create_dir_all(d.join("dcp-400")).unwrap(); // no .metadata yet: still being written
        let fd = safefs::open_root_dir(d).unwrap();
        assert_eq!(
            scan_signals(&fd, uid),
            vec!["dcp-300", "global_step100", "iter_0000200"]
        );
        // A `latest` that points outside, or is a symlink, commits nothing.
        std::fs::write(d.join("latest"), "../etc").unwrap();
        std::fs::remove_file(d.join("latest_checkpointed_iteration.txt")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join("latest_checkpointed_iteration.txt"))
            .unwrap();
        assert_eq!(scan_signals(&fd, uid), vec!["dcp-300"]);
    }

    #[test]
    fn a_restored_checkpoint_gets_its_frameworks_signal_back() {
        let tmp = tempfile::tempdir().unwrap();
        let me = Owner {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        };
        let d = tmp.path();
        let fd = safefs::open_root_dir(d).unwrap();
        for tag in ["global_step100", "iter_0000200", "step-3"] {
            std::fs::create_dir_all(d.join(tag)).unwrap();
            write_restored_signal(&fd, tag, me).unwrap();
        }
        assert_eq!(
            std::fs::read_to_string(d.join("latest")).unwrap(),
            "global_step100"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("latest_checkpointed_iteration.txt")).unwrap(),
            "200"
        );
        // The frameworks' readers (and sluice's own scan) find exactly what was restored.
        assert_eq!(
            scan_signals(&fd, me.uid),
            vec!["global_step100", "iter_0000200"]
        );
        // A later restore replaces the signal.
        std::fs::create_dir_all(d.join("global_step7")).unwrap();
        write_restored_signal(&fd, "global_step7", me).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.join("latest")).unwrap(),
            "global_step7"
        );
    }
}
