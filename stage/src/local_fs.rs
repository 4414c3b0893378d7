//! What staging does differently on local file systems: where one file's writes serialize on its
//! inode, and where blocks can be allocated before a file is written.

use std::fs;
use std::io;

/// Whether a `statfs` file system type is a local disk or memory file system, where the copy
/// helper copies each file with one thread.
pub fn is_local_fs(t: nix::sys::statfs::FsType) -> bool {
    use nix::sys::statfs::{BTRFS_SUPER_MAGIC, EXT4_SUPER_MAGIC, TMPFS_MAGIC, XFS_SUPER_MAGIC};
    // (ext2 and ext3 have ext4's magic.)
    [
        EXT4_SUPER_MAGIC,
        XFS_SUPER_MAGIC,
        BTRFS_SUPER_MAGIC,
        TMPFS_MAGIC,
    ]
    .contains(&t)
}

/// Whether writes to `file` go one at a time: on a local file system, where the kernel takes the
/// inode's lock for each buffered write, so that writers waiting for it sleep in the process
/// rather than spin on that lock, a core each. (Staging one 1 GiB object from Garage into ext4 with
/// 16 parts in flight: 12 % of the agent's CPU in `rwsem_spin_on_owner`.) A file system that cannot
/// be told is taken as one that writes in parallel.
pub fn one_writer(file: &fs::File) -> bool {
    nix::sys::statfs::fstatfs(file).is_ok_and(|st| is_local_fs(st.filesystem_type()))
}

/// Files from this size up are preallocated ([`preallocate`]).
const PREALLOCATE_FROM: u64 = 1 << 20;

/// Allocates `size` bytes for a new, empty `dst` on ext4 before it is written, as `rsync
/// --preallocate` does: the copy then writes into allocated blocks rather than reserving them page
/// by page (one file of 1 GiB: 0.21–0.26 s, 0.28–0.37 s without, `cp -a` 0.29–0.35 s; the same or
/// less with the writeback included), the file gets contiguous extents, and a tier without room
/// for it fails before its bytes are copied. Only on ext4: XFS and btrfs `copy_file_range` shares
/// extents within one file system, which blocks allocated first would only waste. A file system
/// that cannot preallocate is no error. Returns whether `dst` was allocated (and so has `size`
/// bytes). The copy helper trims a file that shrank since it was listed.
pub fn preallocate(dst: &fs::File, size: u64) -> io::Result<bool> {
    if size < PREALLOCATE_FROM {
        return Ok(false);
    }
    let st = nix::sys::statfs::fstatfs(dst).map_err(io::Error::from)?;
    if st.filesystem_type() != nix::sys::statfs::EXT4_SUPER_MAGIC {
        return Ok(false);
    }
    let len = i64::try_from(size).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    match nix::fcntl::fallocate(dst, nix::fcntl::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EOPNOTSUPP) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Gives `file` (an object's staged copy, its parts written at their offsets as they arrive) its
/// final `size` before any part is written: allocated where [`preallocate`] can, sparse elsewhere.
/// A tier without room for the whole object is not an error here: the file is made sparse, so that
/// each write can still take room from the node's cache before it fails the job.
pub fn set_size(file: &fs::File, size: u64) -> io::Result<()> {
    match preallocate(file, size) {
        Ok(true) => Ok(()),
        Err(e) if e.raw_os_error() != Some(nix::errno::Errno::ENOSPC as i32) => Err(e),
        Ok(false) | Err(_) => file.set_len(size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::process::Command;

    /// A 16 MiB ext4 image mounted in a temporary directory; unmounted when dropped.
    struct SmallExt4(tempfile::TempDir);

    impl SmallExt4 {
        fn mount() -> SmallExt4 {
            let dir = tempfile::tempdir().unwrap();
            let (img, mnt) = (dir.path().join("img"), dir.path().join("mnt"));
            fs::File::create(&img).unwrap().set_len(16 << 20).unwrap();
            fs::create_dir(&mnt).unwrap();
            let ok = |c: &mut Command| assert!(c.status().unwrap().success(), "{c:?}");
            ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img));
            ok(Command::new("mount")
                .args(["-o", "loop"])
                .arg(&img)
                .arg(&mnt));
            SmallExt4(dir)
        }

        fn path(&self) -> std::path::PathBuf {
            self.0.path().join("mnt")
        }
    }

    impl Drop for SmallExt4 {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.path()).status();
        }
    }

    #[test]
    #[ignore = "needs root (mounts a small ext4 image); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn ext4_files_are_preallocated_and_a_file_without_room_is_made_sparse() {
        let tier = SmallExt4::mount();
        let file = |name: &str| fs::File::create_new(tier.path().join(name)).unwrap();
        // Room for it: allocated whole, at its size.
        let f = file("fits");
        assert!(preallocate(&f, 4 << 20).unwrap());
        let m = f.metadata().unwrap();
        assert_eq!(m.len(), 4 << 20);
        assert!(m.blocks() * 512 >= 4 << 20, "{} blocks", m.blocks());
        // Small files are left to the copy.
        assert!(!preallocate(&file("small"), 4096).unwrap());
        // No room: preallocating fails early, with the error a full tier gives...
        let e = preallocate(&file("too-big"), 64 << 20).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(nix::errno::Errno::ENOSPC as i32));
        // ...while an object's file is made sparse at its size, so that each write can still take
        // room from the cache.
        let f = file("object");
        set_size(&f, 64 << 20).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 64 << 20);
    }

    #[test]
    fn other_file_systems_are_not_preallocated() {
        // /dev/shm is tmpfs: a local file system, but not ext4.
        let f = tempfile::tempfile_in("/dev/shm").unwrap();
        assert!(one_writer(&f));
        assert!(!preallocate(&f, 4 << 20).unwrap());
        set_size(&f, 4 << 20).unwrap();
        let m = f.metadata().unwrap();
        assert_eq!((m.len(), m.blocks()), (4 << 20, 0));
    }
}
