//! What the helper and the agent ([`crate::posix`]) say to each other, typed and encoded in
//! this one place: [`HelperMsg`] on the helper's stdout, [`AgentMsg`] on its stdin, and a failure
//! as the helper's exit code ([`Failure`]) with its message as the last line on stderr.
//!
//! Each message is one line, `KIND FIELD…` (a unit request has no kind): numbers in decimal,
//! modes in octal, hashes in hex, and a path (below the dataset, `""` for a dataset that is one
//! file) JSON-quoted and last, so that it may hold spaces. The helper runs as the job user, who
//! may make it print anything: decoding a line the protocol does not have is an error, never a
//! panic, and each side takes only the messages its run has.
//!
//! The helper is the agent's own executable (`sluiced copy-as-user`, `sluice_agent::run` starts
//! `current_exe`), so both ends are always the same version.

use std::fmt;
use std::fs;
use std::os::unix::fs::MetadataExt;

/// How the helper failed, as its exit code tells the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The source (or a file of it) is not there.
    NotFound,
    /// The job user may not read the source or write the stage directory.
    Denied,
    /// The node's hot tier (or the user's quota on it) is full.
    NoSpace,
    Other,
}

impl Failure {
    /// The helper's exit code for this failure.
    pub fn exit_code(self) -> u8 {
        match self {
            Failure::Other => 1,
            Failure::NotFound => 2,
            Failure::Denied => 3,
            Failure::NoSpace => 4,
        }
    }

    /// The failure an exit code (`None`: killed by a signal) tells.
    pub fn from_exit(code: Option<i32>) -> Failure {
        [Failure::NotFound, Failure::Denied, Failure::NoSpace]
            .into_iter()
            .find(|f| code == Some(i32::from(f.exit_code())))
            .unwrap_or(Failure::Other)
    }

    /// The message of a failed helper: the last line it wrote on stderr.
    pub fn message(stderr: &str) -> &str {
        stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("copy helper failed")
    }
}

/// A count of the helper's files and bytes, as [`crate::Progress`] takes it in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// What the helper copies (after the walk): `total F B`.
    Total { files: u64, bytes: u64 },
    /// What it copied so far, every 200 ms and once more at the end: `progress F B`.
    Progress { files: u64, bytes: u64 },
}

/// The identity of a source file as `fstat` of a descriptor opened for reading gives it: what a
/// cache entry of a POSIX file is keyed by (with its path and the user), see [`crate::cache`].
///
/// The ctime is part of it: a user can rewrite a file and set its mtime back (`touch -d`,
/// `utimensat`), but any change to a file sets its ctime to now, and nobody can set that back.
/// (Staging logs written before it was kept name no ctime, which then matches no file: those files
/// are copied again.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileIdent {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    pub mtime: i64,
    pub mtime_ns: i64,
    /// `st_ctime` and `st_ctime_nsec`.
    #[serde(default)]
    pub ctime: i64,
    #[serde(default)]
    pub ctime_ns: i64,
}

impl FileIdent {
    /// The identity of the file open as `f`; `None` for anything but a regular file.
    pub(crate) fn of(f: &fs::File) -> std::io::Result<Option<FileIdent>> {
        let m = f.metadata()?;
        Ok(m.is_file().then(|| FileIdent {
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime: m.mtime(),
            mtime_ns: m.mtime_nsec(),
            ctime: m.ctime(),
            ctime_ns: m.ctime_nsec(),
        }))
    }
}

/// The identity's fields as messages carry them, in order: size, dev, ino, mtime, mtime_ns,
/// ctime, ctime_ns.
impl fmt::Display for FileIdent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {} {} {} {}",
            self.size, self.dev, self.ino, self.mtime, self.mtime_ns, self.ctime, self.ctime_ns
        )
    }
}

/// The helper's messages to the agent, on its stdout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelperMsg {
    /// `total F B`: see [`Event::Total`].
    Total { files: u64, bytes: u64 },
    /// `progress F B`: see [`Event::Progress`].
    Progress { files: u64, bytes: u64 },
    /// `kept F B`, of a resumable copy: of the files offered, these were kept, their source
    /// being the version they were copied from.
    Kept { files: u64, bytes: u64 },
    /// `whole IDENT "PATH"`, of a resumable copy: the file at `path` is copied whole, with its
    /// mode, from a source whose identity was `file` before and after every piece of the copy.
    Whole { file: FileIdent, path: String },
    /// `ident IDX IDENT MODE "PATH"`, of a cached copy: a regular, non-empty file of the dataset,
    /// opened for reading as the job user, with the identity and mode `fstat` gave on that
    /// descriptor.
    Ident {
        idx: usize,
        file: FileIdent,
        mode: u32,
        path: String,
    },
    /// `idents N`: every file is identified; the helper now reads the agent's answers.
    Idents { count: usize },
    /// `cached IDX`: file `idx` is made, owner-writable and empty, for the agent to write from
    /// its cache.
    Cached { idx: usize },
    /// `copied IDX PIECE HASH`: file `idx` was copied from a descriptor whose identity stayed the
    /// one reported, before and after each piece; its hash
    /// ([`super::piece_hashes_hash`]) in pieces of `piece` bytes.
    Copied {
        idx: usize,
        piece: u64,
        hash: blake3::Hash,
    },
    /// `file IDX SIZE MODE "PATH"`, of a replica: a file of the dataset, made (if the agent
    /// writes into it) and listed as `idx`.
    File {
        idx: usize,
        size: u64,
        mode: u32,
        path: String,
    },
    /// `unit IDX OFFSET HASH`: a unit of file `idx` (or, in a repair run, of request `idx`) is
    /// copied, with its hash.
    Unit {
        idx: usize,
        offset: u64,
        hash: blake3::Hash,
    },
    /// `changed IDX`: an identified file of a replica was not the one identified while a unit
    /// of it was copied: staged as read, but not to be cached.
    Changed { idx: usize },
}

/// The agent's messages to the helper, on its stdin, all written before the helper goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentMsg {
    /// `keep IDENT "PATH"`, to a resumable copy: the agent noted the file at `path` as copied
    /// whole from a source of identity `file`, and found its staged copy unchanged since.
    Keep { file: FileIdent, path: String },
    /// `hit IDX`, to a cached copy: the agent holds identified file `idx` in its cache.
    Hit { idx: usize },
    /// `IDX OFFSET LEN "PATH"`, to a repair run: copy these bytes of the file at `path`.
    Repair {
        idx: usize,
        offset: u64,
        len: u64,
        path: String,
    },
}

/// A line that is no message of the protocol (or not one its reader takes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a message of the copy helper's protocol: {line:?}")]
pub struct DecodeError {
    pub line: String,
}

/// A path as the last field of a message.
struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&serde_json::to_string(self.0).expect("a string serializes"))
    }
}

impl fmt::Display for HelperMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HelperMsg::Total { files, bytes } => write!(f, "total {files} {bytes}"),
            HelperMsg::Progress { files, bytes } => write!(f, "progress {files} {bytes}"),
            HelperMsg::Kept { files, bytes } => write!(f, "kept {files} {bytes}"),
            HelperMsg::Whole { file, path } => write!(f, "whole {file} {}", Quoted(path)),
            HelperMsg::Ident {
                idx,
                file,
                mode,
                path,
            } => write!(f, "ident {idx} {file} {mode:o} {}", Quoted(path)),
            HelperMsg::Idents { count } => write!(f, "idents {count}"),
            HelperMsg::Cached { idx } => write!(f, "cached {idx}"),
            HelperMsg::Copied { idx, piece, hash } => write!(f, "copied {idx} {piece} {hash}"),
            HelperMsg::File {
                idx,
                size,
                mode,
                path,
            } => write!(f, "file {idx} {size} {mode:o} {}", Quoted(path)),
            HelperMsg::Unit { idx, offset, hash } => write!(f, "unit {idx} {offset} {hash}"),
            HelperMsg::Changed { idx } => write!(f, "changed {idx}"),
        }
    }
}

impl fmt::Display for AgentMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentMsg::Keep { file, path } => write!(f, "keep {file} {}", Quoted(path)),
            AgentMsg::Hit { idx } => write!(f, "hit {idx}"),
            AgentMsg::Repair {
                idx,
                offset,
                len,
                path,
            } => write!(f, "{idx} {offset} {len} {}", Quoted(path)),
        }
    }
}

/// The fields of a line, read in order.
struct Fields<'a>(Option<&'a str>);

impl<'a> Fields<'a> {
    fn word(&mut self) -> Option<&'a str> {
        let rest = self.0?;
        let (word, rest) = match rest.split_once(' ') {
            Some((word, rest)) => (word, Some(rest)),
            None => (rest, None),
        };
        self.0 = rest;
        Some(word)
    }

    fn num<T: std::str::FromStr>(&mut self) -> Option<T> {
        self.word()?.parse().ok()
    }

    fn mode(&mut self) -> Option<u32> {
        u32::from_str_radix(self.word()?, 8).ok()
    }

    fn hash(&mut self) -> Option<blake3::Hash> {
        blake3::Hash::from_hex(self.word()?).ok()
    }

    fn ident(&mut self) -> Option<FileIdent> {
        Some(FileIdent {
            size: self.num()?,
            dev: self.num()?,
            ino: self.num()?,
            mtime: self.num()?,
            mtime_ns: self.num()?,
            ctime: self.num()?,
            ctime_ns: self.num()?,
        })
    }

    /// The rest of the line, a quoted path.
    fn path(self) -> Option<String> {
        serde_json::from_str(self.0?).ok()
    }

    /// `msg`, if the line has no more fields.
    fn end<T>(self, msg: T) -> Option<T> {
        self.0.is_none().then_some(msg)
    }
}

impl HelperMsg {
    pub fn decode(line: &str) -> Result<HelperMsg, DecodeError> {
        let mut it = Fields(Some(line));
        let msg = match it.word() {
            Some("total") => it.count(|files, bytes| HelperMsg::Total { files, bytes }),
            Some("progress") => it.count(|files, bytes| HelperMsg::Progress { files, bytes }),
            Some("kept") => it.count(|files, bytes| HelperMsg::Kept { files, bytes }),
            Some("whole") => (|| {
                let file = it.ident()?;
                Some(HelperMsg::Whole {
                    file,
                    path: it.path()?,
                })
            })(),
            Some("ident") => (|| {
                let (idx, file, mode) = (it.num()?, it.ident()?, it.mode()?);
                Some(HelperMsg::Ident {
                    idx,
                    file,
                    mode,
                    path: it.path()?,
                })
            })(),
            Some("idents") => it
                .num()
                .and_then(|count| it.end(HelperMsg::Idents { count })),
            Some("cached") => it.num().and_then(|idx| it.end(HelperMsg::Cached { idx })),
            Some("copied") => (|| {
                let msg = HelperMsg::Copied {
                    idx: it.num()?,
                    piece: it.num()?,
                    hash: it.hash()?,
                };
                it.end(msg)
            })(),
            Some("file") => (|| {
                let (idx, size, mode) = (it.num()?, it.num()?, it.mode()?);
                Some(HelperMsg::File {
                    idx,
                    size,
                    mode,
                    path: it.path()?,
                })
            })(),
            Some("unit") => (|| {
                let msg = HelperMsg::Unit {
                    idx: it.num()?,
                    offset: it.num()?,
                    hash: it.hash()?,
                };
                it.end(msg)
            })(),
            Some("changed") => it.num().and_then(|idx| it.end(HelperMsg::Changed { idx })),
            _ => None,
        };
        msg.ok_or_else(|| DecodeError { line: line.into() })
    }

    /// The count this message is, if it is one.
    pub fn event(&self) -> Option<Event> {
        match *self {
            HelperMsg::Total { files, bytes } => Some(Event::Total { files, bytes }),
            HelperMsg::Progress { files, bytes } => Some(Event::Progress { files, bytes }),
            _ => None,
        }
    }
}

impl Fields<'_> {
    /// `F B` and the end of the line.
    fn count(mut self, msg: impl FnOnce(u64, u64) -> HelperMsg) -> Option<HelperMsg> {
        let (files, bytes) = (self.num()?, self.num()?);
        self.end(msg(files, bytes))
    }
}

impl AgentMsg {
    /// The message as the helper reads it: one line, with its newline.
    pub fn encode(&self) -> String {
        format!("{self}\n")
    }

    pub fn decode(line: &str) -> Result<AgentMsg, DecodeError> {
        let mut it = Fields(Some(line));
        let msg = match it.word() {
            Some("keep") => (|| {
                let file = it.ident()?;
                Some(AgentMsg::Keep {
                    file,
                    path: it.path()?,
                })
            })(),
            Some("hit") => it.num().and_then(|idx| it.end(AgentMsg::Hit { idx })),
            Some(idx) => (|| {
                let (idx, offset, len) = (idx.parse().ok()?, it.num()?, it.num()?);
                Some(AgentMsg::Repair {
                    idx,
                    offset,
                    len,
                    path: it.path()?,
                })
            })(),
            None => None,
        };
        msg.ok_or_else(|| DecodeError { line: line.into() })
    }
}

/// Writes `msg` as one line (a reader that went away is not the copy's problem: the helper's
/// exit tells the rest).
pub(super) fn send(out: &mut impl std::io::Write, msg: &HelperMsg) {
    writeln!(out, "{msg}").ok();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> FileIdent {
        FileIdent {
            dev: 64769,
            ino: 1 << 40,
            size: 12345,
            mtime: -5,
            mtime_ns: 999_999_999,
            ctime: 1_700_000_000,
            ctime_ns: 7,
        }
    }

    /// Every message of both directions, paths with spaces, quotes and non-ASCII among them.
    fn helper_msgs() -> Vec<HelperMsg> {
        let (file, hash) = (ident(), blake3::hash(b"bytes"));
        let path = String::from("d/a file \"quoted\" é\\");
        vec![
            HelperMsg::Total { files: 3, bytes: 0 },
            HelperMsg::Progress {
                files: 0,
                bytes: u64::MAX,
            },
            HelperMsg::Kept { files: 1, bytes: 2 },
            HelperMsg::Whole {
                file,
                path: path.clone(),
            },
            HelperMsg::Whole {
                file,
                path: String::new(),
            },
            HelperMsg::Ident {
                idx: 4,
                file,
                mode: 0o4755,
                path: path.clone(),
            },
            HelperMsg::Idents { count: 9 },
            HelperMsg::Cached { idx: 0 },
            HelperMsg::Copied {
                idx: 2,
                piece: 4096,
                hash,
            },
            HelperMsg::File {
                idx: 1,
                size: 77,
                mode: 0o600,
                path,
            },
            HelperMsg::Unit {
                idx: 5,
                offset: 8192,
                hash,
            },
            HelperMsg::Changed { idx: 6 },
        ]
    }

    fn agent_msgs() -> Vec<AgentMsg> {
        vec![
            AgentMsg::Keep {
                file: ident(),
                path: "x y/z".into(),
            },
            AgentMsg::Keep {
                file: ident(),
                path: String::new(),
            },
            AgentMsg::Hit { idx: 12 },
            AgentMsg::Repair {
                idx: 7,
                offset: 4096,
                len: 100,
                path: "d/big \"1\"".into(),
            },
        ]
    }

    #[test]
    fn every_message_decodes_to_itself() {
        for msg in helper_msgs() {
            let line = msg.to_string();
            assert!(!line.contains('\n'), "{line}");
            assert_eq!(HelperMsg::decode(&line), Ok(msg), "{line}");
        }
        for msg in agent_msgs() {
            let line = msg.to_string();
            assert!(!line.contains('\n'), "{line}");
            assert_eq!(AgentMsg::decode(&line), Ok(msg), "{line}");
        }
    }

    /// The lines as the helper always wrote them (the agent reads nothing else).
    #[test]
    fn the_lines_are_the_ones_the_helper_writes() {
        let hash = blake3::hash(b"bytes");
        let cases = [
            (
                HelperMsg::Total { files: 2, bytes: 9 }.to_string(),
                "total 2 9".to_string(),
            ),
            (
                HelperMsg::Ident {
                    idx: 0,
                    file: ident(),
                    mode: 0o644,
                    path: "a b".into(),
                }
                .to_string(),
                "ident 0 12345 64769 1099511627776 -5 999999999 1700000000 7 644 \"a b\"".into(),
            ),
            (
                HelperMsg::Unit {
                    idx: 1,
                    offset: 2,
                    hash,
                }
                .to_string(),
                format!("unit 1 2 {}", hash.to_hex()),
            ),
            (
                AgentMsg::Repair {
                    idx: 7,
                    offset: 0,
                    len: 1,
                    path: "d/big".into(),
                }
                .to_string(),
                "7 0 1 \"d/big\"".into(),
            ),
            (AgentMsg::Hit { idx: 3 }.to_string(), "hit 3".into()),
        ];
        for (got, want) in cases {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for line in [
            "",
            " ",
            "total",
            "total 1",
            "total 1 2 3",
            "total -1 2",
            "total 1  2",
            "progress x y",
            "nonsense 1 2",
            "whole 1 2 3",
            "whole 1 2 3 4 5 6 7 path-not-quoted",
            "ident 0 1 2 3 4 5 6 7 999 \"p\"",
            "idents",
            "cached 1 2",
            "copied 1 2 nothex",
            "unit 1 2 00",
            "changed",
            "file 0 1 644",
            "keep 1 2 3 4 5 6 7 \"p\"",
            "hit 0",
        ] {
            assert!(HelperMsg::decode(line).is_err(), "{line:?}");
        }
        for line in [
            "",
            "hit",
            "hit -1",
            "hit 1 2",
            "keep",
            "keep 1 2 3 4 5 6 7",
            "keep 1 2 3 4 5 6 7 \"unterminated",
            "0 0 1",
            "0 0 1 ../x",
            "x 0 1 \"p\"",
            "total 1 2",
        ] {
            assert!(AgentMsg::decode(line).is_err(), "{line:?}");
        }
        // Every cut and every one-byte change of every message decodes or fails, and a success
        // encodes back to a line that decodes the same.
        let lines: Vec<String> = helper_msgs()
            .iter()
            .map(ToString::to_string)
            .chain(agent_msgs().iter().map(ToString::to_string))
            .collect();
        for line in &lines {
            let bytes = line.as_bytes();
            let mut variants: Vec<Vec<u8>> =
                (0..bytes.len()).map(|n| bytes[..n].to_vec()).collect();
            for i in 0..bytes.len() {
                for b in [b' ', b'"', b'x', b'9', b'-', 0xff] {
                    let mut v = bytes.to_vec();
                    v[i] = b;
                    variants.push(v);
                }
            }
            for v in variants {
                let text = String::from_utf8_lossy(&v);
                if let Ok(m) = HelperMsg::decode(&text) {
                    assert_eq!(HelperMsg::decode(&m.to_string()), Ok(m));
                }
                if let Ok(m) = AgentMsg::decode(&text) {
                    assert_eq!(AgentMsg::decode(&m.to_string()), Ok(m));
                }
            }
        }
    }

    #[test]
    fn exit_codes_name_the_failure() {
        for f in [
            Failure::NotFound,
            Failure::Denied,
            Failure::NoSpace,
            Failure::Other,
        ] {
            assert_eq!(Failure::from_exit(Some(f.exit_code().into())), f);
        }
        assert_eq!(Failure::from_exit(None), Failure::Other, "a signal");
        assert_eq!(Failure::from_exit(Some(9)), Failure::Other);
        assert_eq!(Failure::message("warning\nthe error\n\n"), "the error");
        assert_eq!(Failure::message(""), "copy helper failed");
    }

    #[test]
    fn counts_are_events() {
        assert_eq!(
            HelperMsg::Total { files: 1, bytes: 2 }.event(),
            Some(Event::Total { files: 1, bytes: 2 })
        );
        assert_eq!(HelperMsg::Cached { idx: 1 }.event(), None);
    }
}
