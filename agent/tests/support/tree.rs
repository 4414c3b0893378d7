//! A directory tree as the POSIX staging tests compare it (`agent/tests/posix_*.rs`, each including
//! this file with `#[path]`): the source against what a job got.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Every entry below `root`: files with their bytes and mode, links with their target, directories
/// with their mode OR `dir_bits` (0 compares directory modes exactly; 0o700 ignores the owner bits a
/// stager may add to the directories it makes).
pub fn tree(root: &Path, dir_bits: u32) -> BTreeMap<String, (Vec<u8>, u32)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let md = std::fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                out.insert(rel, (b"dir".to_vec(), (md.mode() & 0o7777) | dir_bits));
                stack.push(p);
            } else if md.file_type().is_symlink() {
                let target = std::fs::read_link(&p).unwrap();
                out.insert(rel, (target.display().to_string().into_bytes(), 0));
            } else {
                out.insert(rel, (std::fs::read(&p).unwrap(), md.mode() & 0o7777));
            }
        }
    }
    out
}
