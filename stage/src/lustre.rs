//! Lustre for the shared tier (`--stage-tier=shared`, `[shared_tier]`): whether the job's
//! directory is on Lustre ([`is_lustre`], the `statfs` magic), and creating a staged file with the
//! stripe layout of its size class ([`create_striped`], `lfs setstripe`) before its bytes are
//! written. Off Lustre (BeeOND, or the test cluster's stand-in directory) files are created as on
//! the hot tier and keep the directory's default layout.
//!
//! Why [`create_striped`] is shaped the way it is: the job's shared directory belongs to the job
//! user, who can rename, replace or symlink anything in it at any moment, while the agent runs as
//! root. A root `lfs setstripe /lustre/.../JOB/x` would follow whatever the user raced into that
//! path and create a file anywhere root can. So:
//! - `lfs` runs as the job user (`CommandExt::uid`/`gid`; std drops root's supplementary groups
//!   with `setgroups(0)` when it changes the uid of a root parent, so the child has the job's uid
//!   and gid and no other groups — the root-only test reads them back from `/proc/self/status`).
//!   Whatever a race makes it touch, it touches with the user's own rights.
//! - It is given the directory the caller already holds open, never a path to it: the fd becomes
//!   the child's stdin (std's `Stdio::from(OwnedFd)`, a `dup2` in the child only, so the fd is not
//!   inherited by any other process the agent starts meanwhile), and the file argument is
//!   `/proc/self/fd/0/NAME`, which the kernel resolves through the open directory, wherever it has
//!   been moved. `NAME` is one checked component (no `/`, not `.` or `..`).
//! - The child's environment is cleared (the agent's may hold store credentials and a process of
//!   the job user's can be read by that user), save `PATH` (to find a bare `lfs`) and `LC_ALL=C`.
//!
//! `lfs` creates the empty file (mode 0644 less the agent's umask, the job user's). The caller then
//! opens it relative to the directory without following links and checks that it is a regular file
//! of the job user before writing into it: `NAME` may be anything by then.
//!
//! Neither a real Lustre mount nor the real `lfs` exist where sluice is built and tested: the
//! magic number comparison and the `lfs` invocation (arguments, identity, directory, errors) are
//! unit-tested with a fake `lfs` script, not against Lustre.

use sluice_core::config::StripeClass;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

/// `f_type` of a Lustre client mount (`LL_SUPER_MAGIC` in Lustre's `lustre_user.h`).
pub const LL_SUPER_MAGIC: i64 = 0x0BD0_0BD0;

/// Whether `fd` (the job's shared directory, or its parent) is on a Lustre client mount.
pub fn is_lustre(fd: &impl AsFd) -> io::Result<bool> {
    let st = nix::sys::statfs::fstatfs(fd.as_fd()).map_err(io::Error::from)?;
    #[allow(clippy::unnecessary_cast)] // `f_type`'s width differs between libcs
    Ok(is_lustre_magic(st.filesystem_type().0 as i64))
}

/// Whether a `statfs` `f_type` is Lustre's.
pub fn is_lustre_magic(f_type: i64) -> bool {
    f_type == LL_SUPER_MAGIC
}

#[derive(Debug, thiserror::Error)]
pub enum LustreError {
    #[error(
        "'{}' is not a file name sluice creates in the shared directory (one path component: no '/', not '.' or '..')",
        name.to_string_lossy()
    )]
    BadName { name: OsString },
    #[error("cannot run {}: {source}", lfs.display())]
    Spawn {
        lfs: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{} setstripe -c {count} -S {size} for '{}' failed ({status}): {message}",
        lfs.display(),
        name.to_string_lossy()
    )]
    Failed {
        lfs: PathBuf,
        name: OsString,
        count: i32,
        size: u64,
        status: ExitStatus,
        /// The last line `lfs` wrote to stderr (Lustre's reason).
        message: String,
    },
}

/// The arguments of `lfs` that create `file` with `class`'s layout: sizes in bytes, `-c -1` for
/// all OSTs.
pub fn setstripe_args(class: &StripeClass, file: &OsStr) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["setstripe", "-c", &class.count.to_string(), "-S"]
        .into_iter()
        .map(OsString::from)
        .collect();
    args.push(class.size.to_string().into());
    args.push(file.to_os_string());
    args
}

/// Creates the empty file `name` in the open directory `dir` with `class`'s stripe layout, by
/// running `lfs` as `uid:gid` (see the module header for why). Blocks until `lfs` exits: call it
/// from a blocking thread. Fails if `name` exists.
pub fn create_striped(
    lfs: &Path,
    dir: &impl AsFd,
    name: impl AsRef<OsStr>,
    class: &StripeClass,
    uid: u32,
    gid: u32,
) -> Result<(), LustreError> {
    let name = name.as_ref();
    let bytes = name.as_encoded_bytes();
    if bytes.is_empty()
        || name == "."
        || name == ".."
        || bytes.contains(&b'/')
        || bytes.contains(&0)
    {
        return Err(LustreError::BadName { name: name.into() });
    }
    let spawn = |source| LustreError::Spawn {
        lfs: lfs.to_path_buf(),
        source,
    };
    let stdin = dir.as_fd().try_clone_to_owned().map_err(spawn)?;
    let mut file = OsString::from("/proc/self/fd/0/");
    file.push(name);
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    let out = Command::new(lfs)
        .args(setstripe_args(class, &file))
        .env_clear()
        .env("PATH", path)
        .env("LC_ALL", "C")
        .current_dir("/")
        .uid(uid)
        .gid(gid)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(spawn)?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let message = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("(nothing on stderr)")
        .to_string();
    Err(LustreError::Failed {
        lfs: lfs.to_path_buf(),
        name: name.into(),
        count: class.count,
        size: class.size,
        status: out.status,
        message,
    })
}

#[cfg(test)]
mod tests {
    //! The real `lfs` and a real Lustre mount are not exercised here (neither exists on the
    //! machines sluice is tested on): a fake `lfs` shell script records its arguments and identity
    //! and creates the file as `lfs setstripe` would.

    use super::*;
    use std::fs::File;
    use std::os::fd::OwnedFd;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    const ETXTBSY: i32 = 26;

    /// A fake `lfs` in `bin`: writes its arguments, one a line, then its `/proc/self/status`
    /// identity lines to `record`, and creates its last argument, or with `fail` prints two lines
    /// to stderr and exits 3.
    fn fake_lfs(bin: &Path, record: &Path, fail: bool) -> PathBuf {
        let lfs = bin.join("lfs");
        let act = if fail {
            "echo 'lfs setstripe: setstripe error' >&2\necho 'error: setstripe: invalid stripe count -1 for pool: Invalid argument' >&2\nexit 3"
        } else {
            ": > \"$last\""
        };
        let script = format!(
            "#!/bin/sh\nfor a; do printf '%s\\n' \"$a\"; last=$a; done > '{r}'\ngrep -E '^(Uid|Gid|Groups|CapEff):' /proc/self/status >> '{r}'\n{act}\n",
            r = record.display()
        );
        std::fs::write(&lfs, script).unwrap();
        std::fs::set_permissions(&lfs, std::fs::Permissions::from_mode(0o755)).unwrap();
        lfs
    }

    /// [`create_striped`], again while a process another test forked in the instant the script
    /// was being written still holds it open for writing (ETXTBSY).
    fn create(
        lfs: &Path,
        dir: &OwnedFd,
        name: &str,
        class: &StripeClass,
        uid: u32,
        gid: u32,
    ) -> Result<(), LustreError> {
        for _ in 0..50 {
            match create_striped(lfs, dir, name, class, uid, gid) {
                Err(LustreError::Spawn { source, .. })
                    if source.raw_os_error() == Some(ETXTBSY) =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                other => return other,
            }
        }
        create_striped(lfs, dir, name, class, uid, gid)
    }

    /// A temporary directory with a [`fake_lfs`] in it, which records into `record` there.
    fn lfs_in_tmp(failing: bool) -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let record = tmp.path().join("record");
        let lfs = fake_lfs(tmp.path(), &record, failing);
        (tmp, record, lfs)
    }

    /// [`create`] as the user running the tests.
    fn create_as_me(
        lfs: &Path,
        dir: &OwnedFd,
        name: &str,
        class: &StripeClass,
    ) -> Result<(), LustreError> {
        let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
        create(lfs, dir, name, class, uid.as_raw(), gid.as_raw())
    }

    fn open_dir(p: &Path) -> OwnedFd {
        File::open(p).unwrap().into()
    }

    /// A `job` directory in `tmp`, and it held open as the stager holds a job's directory.
    fn job_dir(tmp: &Path) -> (PathBuf, OwnedFd) {
        let job = tmp.join("job");
        std::fs::create_dir(&job).unwrap();
        let dir = open_dir(&job);
        (job, dir)
    }

    fn args_of(record: &Path) -> Vec<String> {
        std::fs::read_to_string(record)
            .unwrap()
            .lines()
            .take(6)
            .map(String::from)
            .collect()
    }

    const ONE_MIB: StripeClass = StripeClass {
        min_size: 0,
        count: 1,
        size: 1 << 20,
    };

    #[test]
    fn only_lustres_magic_number_is_lustre() {
        assert!(is_lustre_magic(0x0BD0_0BD0));
        for other in [0xEF53, 0x0102_1994, 0x5846_5342, 0x1953_0216, 0] {
            assert!(!is_lustre_magic(other), "{other:#x}");
        }
        // No Lustre here: a temporary directory is on something else, and asking works.
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_lustre(&open_dir(dir.path())).unwrap());
    }

    #[test]
    fn lfs_is_given_the_class_in_bytes_and_the_file_through_the_open_directory() {
        let (tmp, record, lfs) = lfs_in_tmp(false);
        let (job, dir) = job_dir(tmp.path());
        create_as_me(&lfs, &dir, "train-00001.tar", &ONE_MIB).unwrap();
        assert_eq!(
            args_of(&record),
            [
                "setstripe",
                "-c",
                "1",
                "-S",
                "1048576",
                "/proc/self/fd/0/train-00001.tar"
            ]
        );
        let made = std::fs::symlink_metadata(job.join("train-00001.tar")).unwrap();
        assert!(made.is_file() && made.len() == 0);

        let all = StripeClass {
            min_size: 1 << 30,
            count: -1,
            size: 4 << 20,
        };
        create_as_me(&lfs, &dir, "big.bin", &all).unwrap();
        assert_eq!(
            args_of(&record)[..5],
            ["setstripe", "-c", "-1", "-S", "4194304"]
        );
        assert!(job.join("big.bin").is_file());
    }

    #[test]
    fn the_file_lands_in_the_open_directory_even_after_its_path_was_swapped() {
        let (tmp, _record, lfs) = lfs_in_tmp(false);
        let (job, dir) = job_dir(tmp.path());
        // What a job user could do to their own directory: move it and put a link in its place.
        let moved = tmp.path().join("moved");
        std::fs::rename(&job, &moved).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &job).unwrap();
        create_as_me(&lfs, &dir, "x", &ONE_MIB).unwrap();
        assert!(
            moved.join("x").is_file(),
            "created in the directory held open"
        );
        assert!(
            !elsewhere.join("x").exists(),
            "not where the path now leads"
        );
    }

    #[test]
    fn a_failing_lfs_is_reported_with_its_last_line_of_stderr() {
        let (tmp, _record, lfs) = lfs_in_tmp(true);
        let dir = open_dir(tmp.path());
        let class = StripeClass {
            min_size: 0,
            count: -1,
            size: 1 << 20,
        };
        let e = create_as_me(&lfs, &dir, "f", &class).unwrap_err();
        assert!(matches!(e, LustreError::Failed { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "{} setstripe -c -1 -S 1048576 for 'f' failed (exit status: 3): error: setstripe: invalid stripe count -1 for pool: Invalid argument",
                lfs.display()
            )
        );
        let missing = tmp.path().join("no-lfs");
        let e = create_as_me(&missing, &dir, "f", &class).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("cannot run {}: ", missing.display())),
            "{e}"
        );
    }

    #[test]
    fn a_name_that_is_not_one_component_is_refused_before_lfs_runs() {
        let (tmp, record, lfs) = lfs_in_tmp(false);
        let dir = open_dir(tmp.path());
        for name in ["a/b", "../x", "/etc/passwd", ".", "..", "", "a\0b"] {
            let e = create_as_me(&lfs, &dir, name, &ONE_MIB).unwrap_err();
            assert!(matches!(e, LustreError::BadName { .. }), "{name:?}: {e:?}");
            assert!(
                e.to_string().contains("one path component"),
                "{name:?}: {e}"
            );
        }
        assert!(!record.exists(), "lfs never ran");
    }

    #[test]
    #[ignore = "needs root, like sluiced (lfs runs as another user); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    fn lfs_runs_as_the_job_user_with_no_other_groups() {
        sluice_core::testing::assert_root("it runs lfs as another user");
        let (uid, gid) = (65534, 65533);
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let job = tmp.path().join("job");
        std::fs::create_dir(&job).unwrap();
        std::os::unix::fs::chown(&job, Some(uid), Some(gid)).unwrap();
        let record = job.join("record");
        let lfs = fake_lfs(tmp.path(), &record, false);
        let dir = open_dir(&job);
        create(&lfs, &dir, "f", &ONE_MIB, uid, gid).unwrap();
        let text = std::fs::read_to_string(&record).unwrap();
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_else(|| panic!("no {k} in {text}"))
        };
        // Real, effective, saved and file-system ids all the job user's; no root group, no caps.
        assert_eq!(field("Uid:"), "65534 65534 65534 65534");
        assert_eq!(field("Gid:"), "65533 65533 65533 65533");
        assert_eq!(field("Groups:"), "");
        assert_eq!(field("CapEff:"), "0000000000000000");
        assert_eq!(std::fs::metadata(job.join("f")).unwrap().uid(), uid);

        // Root's own directory next to it: the job user's lfs cannot create a file there.
        let root_dir = tmp.path().join("root-only");
        std::fs::create_dir(&root_dir).unwrap();
        let e = create(&lfs, &open_dir(&root_dir), "f", &ONE_MIB, uid, gid).unwrap_err();
        assert!(matches!(e, LustreError::Failed { .. }), "{e:?}");
        assert!(!root_dir.join("f").exists());
    }
}
