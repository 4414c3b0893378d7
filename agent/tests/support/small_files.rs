//! The files of the POSIX test datasets (`agent/tests/posix_cache.rs`, `posix_peers.rs`,
//! `posix_resume.rs`, each including this file with `#[path]`): a big read-only file, and many
//! small files of different sizes in two directories.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Writes `big.bin` below `dir`: `len` bytes of a pseudo-random pattern, of mode 0444 (read-only,
/// as datasets often are); returns its bytes.
pub fn big_file(dir: &Path, len: u32) -> u64 {
    let big: Vec<u8> = (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    std::fs::write(dir.join("big.bin"), &big).unwrap();
    chmod(dir, "big.bin", 0o444);
    len.into()
}

/// Sets the mode of `rel` below `dir`.
pub fn chmod(dir: &Path, rel: &str, mode: u32) {
    std::fs::set_permissions(dir.join(rel), std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The `i`th small file: every third in `small/deeper`, the others in `small`.
pub fn small_file(i: u32) -> String {
    let sub = if i.is_multiple_of(3) {
        "small/deeper"
    } else {
        "small"
    };
    format!("{sub}/part-{i:03}.bin")
}

/// Writes `count` small files below `dir`, the `i`th of 500 + 1013·i bytes; returns their bytes.
pub fn small_files(dir: &Path, count: u32) -> u64 {
    std::fs::create_dir_all(dir.join("small/deeper")).unwrap();
    let mut bytes = 0;
    for i in 0..count {
        let n = 500 + i as usize * 1013;
        let data: Vec<u8> = (0..n).map(|j| (j as u32 ^ (i * 7)) as u8).collect();
        std::fs::write(dir.join(small_file(i)), data).unwrap();
        bytes += n as u64;
    }
    bytes
}
