//! Archive URLs (`--ckpt-archive`): which store, which bucket, which base prefix.

use super::{ArchiveConfig, ArchiveError, Archiver};
use crate::store;
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use sluice_core::config::Config;
use sluice_proto::options::ObjectScheme;
use std::path::PathBuf;
use std::sync::Arc;

/// The store an archive URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArchiveStore {
    /// `file:///abs/path`: a directory (a shared file system), used as the root of the store.
    Local(PathBuf),
    Object {
        scheme: ObjectScheme,
        bucket: String,
    },
}

/// A parsed archive URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchiveLocation {
    pub store: ArchiveStore,
    /// The base prefix inside the store, without leading or trailing `/` (may be empty).
    pub prefix: String,
}

impl std::fmt::Display for ArchiveLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.store {
            ArchiveStore::Local(p) => write!(f, "file://{}", p.display()),
            ArchiveStore::Object { scheme, bucket } if self.prefix.is_empty() => {
                write!(f, "{}://{bucket}", scheme.url_scheme())
            }
            ArchiveStore::Object { scheme, bucket } => {
                write!(f, "{}://{bucket}/{}", scheme.url_scheme(), self.prefix)
            }
        }
    }
}

const URL_HELP: &str =
    "use file:///abs/path, s3://bucket/prefix, az://container/prefix or gs://bucket/prefix";

/// Parses an archive URL. Pure: touches nothing.
pub fn parse_archive_url(url: &str) -> Result<ArchiveLocation, ArchiveError> {
    // Never echo something that may hold credentials (user:secret@host, ?sig=...).
    let shown = |u: &str| {
        if u.contains('@') || u.contains('?') {
            "<URL with credentials or a query, not shown>".to_string()
        } else {
            u.to_string()
        }
    };
    let bad = |reason: String| ArchiveError::BadUrl {
        url: shown(url),
        reason,
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(bad(format!("not a URL; {URL_HELP}")));
    };
    if url.contains('@') || url.contains('?') || url.contains('#') {
        return Err(bad(format!(
            "credentials, queries and fragments do not belong in an archive URL (the agent's store \
             profiles hold credentials); {URL_HELP}"
        )));
    }
    let check_segments = |path: &str| -> Result<(), ArchiveError> {
        if path
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == ".." || s.contains('\0'))
        {
            return Err(bad(
                "the path may not hold empty, '.' or '..' segments".into()
            ));
        }
        Ok(())
    };
    if scheme == "file" {
        if !rest.starts_with('/') {
            return Err(bad(
                "a file:// URL needs an absolute path, as in file:///lustre/ckpt".into(),
            ));
        }
        let path = rest.trim_end_matches('/');
        if path.is_empty() {
            return Err(bad("the file system root cannot be an archive".into()));
        }
        check_segments(&path[1..])?;
        return Ok(ArchiveLocation {
            store: ArchiveStore::Local(PathBuf::from(path)),
            prefix: String::new(),
        });
    }
    let scheme = match scheme {
        "s3" => ObjectScheme::S3,
        "az" | "azure" | "abfs" => ObjectScheme::Azure,
        "gs" => ObjectScheme::Gcs,
        other => return Err(bad(format!("unknown scheme '{other}://'; {URL_HELP}"))),
    };
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty()
        || !bucket
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(bad(format!(
            "'{bucket}' is not a valid bucket or container name"
        )));
    }
    let prefix = prefix.trim_end_matches('/');
    if !prefix.is_empty() {
        check_segments(prefix)?;
    }
    Ok(ArchiveLocation {
        store: ArchiveStore::Object {
            scheme,
            bucket: bucket.to_string(),
        },
        prefix: prefix.to_string(),
    })
}

/// A `file://` archive is written by root through paths (object_store's `LocalFileSystem`), so it
/// must live where only root can change anything: every component of `path` a real directory (no
/// symlink) owned by the agent's user and not writable by others — except sticky directories such as
/// `/tmp`, where nobody can replace another user's entry. Otherwise a user could redirect root's
/// writes with a symlink. A process that is not root (a user's `sluice ckpt list|restore
/// file:///…`) also accepts root's directories: only root or the caller can change them, and the
/// caller has no privilege for anyone to redirect.
///
/// The walk is fd-relative from `/`: each component is opened `O_NOFOLLOW | O_DIRECTORY` below the
/// fd of its already-checked parent and checked on the opened fd, and a missing one is created with
/// `mkdirat` (mode 0700) in that parent, then opened and checked the same way. So a symlink planted
/// in a sticky directory between two steps is refused, never followed (F7 in docs/SECURITY.md: a
/// path-based check followed by a recursive `mkdir` created a directory at the link's target).
/// `before_step` runs before each component is looked at (a test plants its symlink there).
fn open_local_root(
    path: &std::path::Path,
    mut before_step: impl FnMut(&std::path::Path),
) -> Result<std::os::fd::OwnedFd, String> {
    use nix::errno::Errno;
    use nix::sys::stat::{SFlag, fstat, fstatat};
    use std::os::unix::ffi::OsStrExt;

    let me = nix::unistd::geteuid().as_raw();
    let refuse = |p: &std::path::Path, what: &str| {
        format!(
            "{} {what}; the agent writes file:// archives only below directories that only root can change (ask your admin for an archive location)",
            p.display()
        )
    };
    let check = |fd: &std::os::fd::OwnedFd, p: &std::path::Path| -> Result<(), String> {
        let st = fstat(fd).map_err(|e| format!("{}: {e}", p.display()))?;
        if st.st_uid != me && st.st_uid != 0 {
            return Err(refuse(p, &format!("is owned by uid {}", st.st_uid)));
        }
        if st.st_mode & 0o022 != 0 && st.st_mode & 0o1000 == 0 {
            return Err(refuse(p, "is writable by other users"));
        }
        Ok(())
    };
    let mut cur_path = PathBuf::from("/");
    before_step(&cur_path);
    let mut cur = sluice_core::safefs::open_root_dir(&cur_path).map_err(|e| e.to_string())?;
    check(&cur, &cur_path)?;
    for c in path.components().skip(1) {
        let std::path::Component::Normal(name) = c else {
            return Err(format!("{}: not a plain absolute path", path.display()));
        };
        let Some(name) = std::str::from_utf8(name.as_bytes()).ok() else {
            return Err(format!("{}: not UTF-8", path.display()));
        };
        cur_path.push(name);
        before_step(&cur_path);
        // Creates the component if it is missing; an existing entry is opened O_NOFOLLOW.
        let next = match sluice_core::safefs::ensure_dir(&cur, name, None, 0o700) {
            Ok(fd) => fd,
            Err(e) if matches!(e.errno(), Some(Errno::ELOOP | Errno::ENOTDIR)) => {
                let st = fstatat(&cur, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
                let link = st.is_ok_and(|st| {
                    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK
                });
                return Err(refuse(
                    &cur_path,
                    if link {
                        "is a symbolic link"
                    } else {
                        "is not a directory"
                    },
                ));
            }
            // Another user's directory (`ensure_dir` takes only root's or this process's user's).
            Err(e) if e.errno() == Some(Errno::EPERM) => {
                let st = fstatat(&cur, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
                let what = st.map_or_else(
                    |_| "is another user's".to_string(),
                    |st| format!("is owned by uid {}", st.st_uid),
                );
                return Err(refuse(&cur_path, &what));
            }
            Err(e) => return Err(format!("cannot create {}: {e}", cur_path.display())),
        };
        check(&next, &cur_path)?;
        cur = next;
    }
    Ok(cur)
}

/// Opens the archive at `url` with the default [`ArchiveConfig`]; see [`open_archive_with`].
pub fn open_archive(cfg: &Config, url: &str) -> Result<Archiver, ArchiveError> {
    let c = &cfg.ckpt;
    let archive_cfg = ArchiveConfig {
        part_size: c.part_size,
        concurrency: c.concurrency,
        zstd_level: c.zstd_level,
        bandwidth_limit: None, // the node-wide cap is shared through Agent's Bandwidth
        ..ArchiveConfig::default()
    };
    open_archive_with(cfg, url, archive_cfg)
}

/// Opens the archive at `url`: object stores through the agent's store profiles
/// ([`crate::store`]; data objects in the profile's `data_class`), `file://` as a local directory
/// in a root-controlled tree (missing directories are created, mode 0700: users read their
/// archives through the agent; writes are fsynced so "put returned" means durable, as on object
/// stores).
pub fn open_archive_with(
    cfg: &Config,
    url: &str,
    archive_cfg: ArchiveConfig,
) -> Result<Archiver, ArchiveError> {
    let loc = parse_archive_url(url)?;
    let shown = loc.to_string();
    // Object stores only: a file:// archive has no storage classes (LocalFileSystem refuses them).
    let data_class = match &loc.store {
        ArchiveStore::Object { scheme, bucket } => store::data_class(cfg, *scheme, bucket),
        ArchiveStore::Local(_) => None,
    };
    let store: Arc<dyn ObjectStore> = match &loc.store {
        ArchiveStore::Local(path) => {
            let bad = |reason: String| ArchiveError::BadUrl {
                url: shown.clone(),
                reason,
            };
            // Once every component is checked and root's, nobody else can swap one: the paths
            // object_store uses below resolve through the same directories.
            open_local_root(path, |_| {}).map_err(bad)?;
            let fs = LocalFileSystem::new_with_prefix(path).map_err(|e| ArchiveError::BadUrl {
                url: shown.clone(),
                reason: e.to_string(),
            })?;
            Arc::new(fs.with_fsync(true).with_automatic_cleanup(true))
        }
        ArchiveStore::Object { scheme, bucket } => {
            if matches!(scheme, ObjectScheme::S3 | ObjectScheme::Gcs)
                && archive_cfg.part_size < 5 << 20
            {
                return Err(ArchiveError::BadConfig(format!(
                    "{shown}: multipart parts must be at least 5MiB on S3 and GCS, got {}",
                    archive_cfg.part_size
                )));
            }
            store::open(cfg, *scheme, bucket).map_err(|e| ArchiveError::BadUrl {
                url: shown.clone(),
                reason: e.to_string(),
            })?
        }
    };
    Ok(Archiver::with_url(store, &loc.prefix, archive_cfg, shown)?.with_data_class(data_class))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(scheme: ObjectScheme, bucket: &str, prefix: &str) -> ArchiveLocation {
        ArchiveLocation {
            store: ArchiveStore::Object {
                scheme,
                bucket: bucket.into(),
            },
            prefix: prefix.into(),
        }
    }

    #[test]
    fn parses_every_scheme() {
        let p = |u: &str| parse_archive_url(u).unwrap();
        assert_eq!(
            p("s3://ckpt/alice/run1/"),
            obj(ObjectScheme::S3, "ckpt", "alice/run1")
        );
        assert_eq!(p("s3://ckpt"), obj(ObjectScheme::S3, "ckpt", ""));
        assert_eq!(p("az://c/x"), obj(ObjectScheme::Azure, "c", "x"));
        assert_eq!(p("azure://c/x"), obj(ObjectScheme::Azure, "c", "x"));
        assert_eq!(p("gs://b/y/z"), obj(ObjectScheme::Gcs, "b", "y/z"));
        assert_eq!(
            p("file:///lustre/ckpt/"),
            ArchiveLocation {
                store: ArchiveStore::Local("/lustre/ckpt".into()),
                prefix: String::new()
            }
        );
        assert_eq!(
            p("s3://ckpt/alice/run1").to_string(),
            "s3://ckpt/alice/run1"
        );
        assert_eq!(p("file:///a/b").to_string(), "file:///a/b");
    }

    #[test]
    fn refuses_bad_urls_without_echoing_secrets() {
        for bad in [
            "ckpt/x",
            "/abs/path",
            "http://x/y",
            "file://relative/x",
            "file:///",
            "file:///a/../b",
            "s3://",
            "s3:///x",
            "s3://b/a//c",
            "s3://b/../c",
            "s3://b c/x",
        ] {
            assert!(parse_archive_url(bad).is_err(), "{bad}");
        }
        let e = parse_archive_url("s3://AKIA:secret@bucket/x")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("secret"), "{e}");
        let e = parse_archive_url("az://c/x?sig=topsecret")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("topsecret"), "{e}");
    }

    #[test]
    fn file_archives_create_their_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("new/archive");
        let cfg = Config::parse(
            "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n",
            "n1",
            crate::upload_memory,
        )
        .unwrap();
        let a = open_archive(&cfg, &format!("file://{}", dir.display())).unwrap();
        assert!(dir.is_dir());
        // Created private: users read archives through the agent.
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(dir.metadata().unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(a.url(), format!("file://{}", dir.display()));
        let small = ArchiveConfig {
            part_size: 1 << 20,
            ..ArchiveConfig::default()
        };
        let e = open_archive_with(&cfg, "s3://b/x", small).unwrap_err();
        assert!(e.to_string().contains("5MiB"), "{e}");

        // A directory a user could change is refused: root would follow their symlinks.
        let open = |p: &std::path::Path| open_archive(&cfg, &format!("file://{}", p.display()));
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = open(&link.join("x")).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = open(&shared.join("x")).unwrap_err();
        assert!(e.to_string().contains("writable by other users"), "{e}");
        assert!(!shared.join("x").exists());
        if nix::unistd::geteuid().is_root() {
            let users = tmp.path().join("users");
            std::fs::create_dir(&users).unwrap();
            std::os::unix::fs::lchown(&users, Some(4242), None).unwrap();
            let e = open(&users.join("x")).unwrap_err();
            assert!(e.to_string().contains("owned by uid 4242"), "{e}");
        }
    }

    /// F7 in docs/SECURITY.md: a user wins the race and plants a symlink in a sticky directory
    /// right after its parent was checked and before the component is created. The walk creates
    /// with `mkdirat` under the parent's fd and opens `O_NOFOLLOW`, so nothing is ever created at
    /// the link's target.
    #[test]
    fn a_symlink_planted_while_the_archive_directory_is_created_is_never_followed() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let sticky = tmp.path().join("sticky");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let target = tmp.path().join("etc");
        std::fs::create_dir(&target).unwrap();
        let arch = sticky.join("arch");
        let plant_at = |at: PathBuf| {
            let target = target.clone();
            move |step: &std::path::Path| {
                if step == at {
                    std::os::unix::fs::symlink(&target, step).unwrap();
                }
            }
        };

        // The link replaces a missing component the walk is about to create.
        let e = open_local_root(&arch.join("x"), plant_at(arch.clone())).unwrap_err();
        assert!(e.contains("arch is a symbolic link"), "{e}");
        assert!(e.contains("ask your admin"), "{e}");
        assert_eq!(
            std::fs::read_dir(&target).unwrap().count(),
            0,
            "created at the target"
        );
        assert!(arch.symlink_metadata().unwrap().file_type().is_symlink());
        std::fs::remove_file(&arch).unwrap();

        // The same one level deeper, below a directory the walk just made.
        let e = open_local_root(&arch.join("x/y"), plant_at(arch.join("x"))).unwrap_err();
        assert!(e.contains("x is a symbolic link"), "{e}");
        assert_eq!(
            std::fs::read_dir(&target).unwrap().count(),
            0,
            "created at the target"
        );

        // The archive's own directories are the agent's and private, so nobody can swap them later.
        let ok = sticky.join("ok/a/b");
        open_local_root(&ok, |_| {}).unwrap();
        for p in [sticky.join("ok"), sticky.join("ok/a"), ok] {
            let m = p.symlink_metadata().unwrap();
            assert!(m.is_dir(), "{}", p.display());
            assert_eq!(m.permissions().mode() & 0o7777, 0o700, "{}", p.display());
        }

        // A user who makes the component first (as their own directory) is refused too.
        if nix::unistd::geteuid().is_root() {
            let theirs = sticky.join("theirs");
            let e = open_local_root(&theirs.join("x"), |step: &std::path::Path| {
                if step.ends_with("theirs") {
                    std::fs::create_dir(step).unwrap();
                    std::os::unix::fs::lchown(step, Some(4242), None).unwrap();
                }
            })
            .unwrap_err();
            assert!(e.contains("theirs is owned by uid 4242"), "{e}");
            assert!(!theirs.join("x").exists());
        }
    }
}
