//! Why the helper failed: the message the job shows, and the [`Failure`] its exit code tells the
//! agent (from the errno of the file operation that failed, where one did).

use super::protocol::Failure;
use std::io;
use std::path::{Path, PathBuf};

/// What the agent sent the helper on stdin, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    Offers,
    CacheAnswers,
    UnitRequests,
}

impl Input {
    fn many(self) -> &'static str {
        match self {
            Input::Offers => "offers",
            Input::CacheAnswers => "answers",
            Input::UnitRequests => "requests",
        }
    }

    fn one(self) -> &'static str {
        match self {
            Input::Offers => "offer",
            Input::CacheAnswers => "cache answer",
            Input::UnitRequests => "unit request",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// A file operation failed: `what` it was ("opening", "creating", "cannot list", …).
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The source itself cannot be looked at.
    #[error("{}: {source}", path.display())]
    Source { path: PathBuf, source: io::Error },
    #[error("{} is neither a file nor a directory", .0.display())]
    NotFileOrDirectory(PathBuf),
    #[error("reading the agent's {}: {source}", what.many())]
    ReadInput { what: Input, source: io::Error },
    /// A line on stdin that is not what the agent sends this run.
    #[error("bad {} from the agent: {line:?}", what.one())]
    BadInput { what: Input, line: String },
    #[error("running {}: {source}", lfs.display())]
    RunLfs { lfs: PathBuf, source: io::Error },
    #[error("{} setstripe for {} failed: {reason}", lfs.display(), dst.display())]
    Setstripe {
        lfs: PathBuf,
        dst: PathBuf,
        reason: String,
    },
}

impl HelperError {
    /// `HelperError::Io` for `what` on `path`, as a `map_err` argument.
    pub fn io<'a>(
        what: &'static str,
        path: &'a Path,
    ) -> impl Fn(io::Error) -> HelperError + Copy + 'a {
        move |source| HelperError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }

    /// The failure the helper's exit code tells: from the errno of a file operation, where one
    /// failed.
    pub fn failure(&self) -> Failure {
        let (HelperError::Io { source, .. } | HelperError::Source { source, .. }) = self else {
            return Failure::Other;
        };
        match source.kind() {
            io::ErrorKind::NotFound => Failure::NotFound,
            io::ErrorKind::PermissionDenied => Failure::Denied,
            _ if matches!(
                nix::errno::Errno::from_raw(source.raw_os_error().unwrap_or(0)),
                nix::errno::Errno::ENOSPC | nix::errno::Errno::EDQUOT
            ) =>
            {
                Failure::NoSpace
            }
            _ => Failure::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_errno_of_a_file_operation_is_the_failure() {
        let at = |e: io::Error| HelperError::io("copying", Path::new("/d/f"))(e);
        let errno = |n: nix::errno::Errno| io::Error::from_raw_os_error(n as i32);
        use nix::errno::Errno::*;
        assert_eq!(at(errno(ENOENT)).failure(), Failure::NotFound);
        assert_eq!(at(errno(EACCES)).failure(), Failure::Denied);
        assert_eq!(at(errno(ENOSPC)).failure(), Failure::NoSpace);
        assert_eq!(at(errno(EDQUOT)).failure(), Failure::NoSpace);
        assert_eq!(at(errno(EIO)).failure(), Failure::Other);
        assert_eq!(at(io::Error::other("short")).failure(), Failure::Other);
        assert_eq!(
            at(errno(ENOENT)).to_string(),
            format!("copying /d/f: {}", errno(ENOENT))
        );
        let bad = HelperError::BadInput {
            what: Input::CacheAnswers,
            line: "hit x".into(),
        };
        assert_eq!(
            bad.to_string(),
            "bad cache answer from the agent: \"hit x\""
        );
        assert_eq!(bad.failure(), Failure::Other);
    }
}
