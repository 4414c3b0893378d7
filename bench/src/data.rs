//! Deterministic benchmark data: incompressible dataset files, and checkpoint-like tensors
//! (bf16 weights ~ N(0, 0.02) rounded to nearest even, fp32 master weights, Adam moments) from
//! `sluice_archive::synth`, the generator of the archive's own tests. Generated once per size and
//! kept (a stamp file marks a finished set), since producing a GiB of normal variates takes seconds
//! on two cores.

use anyhow::{Context, Result};
pub use sluice_archive::synth::Kind;
use sluice_archive::synth::{self, Rng};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::Path;

const BLOCK: usize = 4 << 20;

/// One block of `kind`, from a seed mixed so that neighbouring seeds start far apart.
fn fill_block(kind: Kind, seed: u64, out: &mut [u8]) {
    synth::fill(
        kind,
        &mut Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        out,
    );
}

/// Writes `size` bytes of `kind` to `path`, generating blocks on two threads.
pub fn write_file(path: &Path, kind: Kind, size: u64, seed: u64) -> Result<()> {
    let mut f = std::io::BufWriter::with_capacity(
        BLOCK,
        File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    let blocks = size.div_ceil(BLOCK as u64);
    let mut b = 0u64;
    while b < blocks {
        // Two blocks at a time, one per core.
        let pair: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (b..(b + 2).min(blocks))
                .map(|i| {
                    s.spawn(move || {
                        let len = (size - i * BLOCK as u64).min(BLOCK as u64) as usize;
                        let mut v = vec![0u8; len];
                        fill_block(kind, seed ^ (i + 1).wrapping_mul(0x1000_0001), &mut v);
                        v
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("generator"))
                .collect()
        });
        for v in &pair {
            f.write_all(v)?;
        }
        b += pair.len() as u64;
    }
    f.flush()?;
    Ok(())
}

/// Runs `make` into `dir` unless a stamp for `what` says it is there already.
pub fn cached(dir: &Path, what: &str, make: impl FnOnce(&Path) -> Result<()>) -> Result<bool> {
    let stamp = dir.with_extension("complete");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(what) && dir.exists() {
        return Ok(false);
    }
    let _ = std::fs::remove_file(&stamp);
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    make(dir)?;
    std::fs::write(&stamp, what)?;
    Ok(true)
}

/// `count` random files of `size` bytes below `dir`, spread over 8 subdirectories.
pub fn random_tree(dir: &Path, count: u64, size: u64) -> Result<()> {
    for i in 0..count {
        let sub = dir.join(format!("shard-{}", i % 8));
        if i < 8 {
            std::fs::create_dir_all(&sub)?;
        }
        let mut v = vec![0u8; size as usize];
        fill_block(Kind::Random, 0xABCD + i, &mut v);
        std::fs::write(sub.join(format!("sample-{i:06}.bin")), v)?;
    }
    Ok(())
}

/// A checkpoint directory of about `size` bytes shaped like a mixed-precision training step:
/// bf16 model weights (2 bytes/param), fp32 master weights and Adam moments (4 bytes/param each),
/// in 2 + 3 files, plus a small DCP-style `.metadata` file.
pub fn checkpoint(dir: &Path, size: u64) -> Result<Vec<(String, u64)>> {
    let params = size / 14;
    let bf16 = params * 2 / 2 / 4096 * 4096; // two files
    let fp32 = params * 4 / 4096 * 4096;
    let files: Vec<(String, Kind, u64)> = vec![
        (
            "model/weights-00001-of-00002.bf16".into(),
            Kind::Bf16Weights,
            bf16,
        ),
        (
            "model/weights-00002-of-00002.bf16".into(),
            Kind::Bf16Weights,
            bf16,
        ),
        ("optim/master.fp32".into(), Kind::Fp32Weights, fp32),
        ("optim/exp_avg.fp32".into(), Kind::Fp32ExpAvg, fp32),
        ("optim/exp_avg_sq.fp32".into(), Kind::Fp32ExpAvgSq, fp32),
    ];
    std::fs::create_dir_all(dir.join("model"))?;
    std::fs::create_dir_all(dir.join("optim"))?;
    let mut out = Vec::new();
    for (i, (name, kind, len)) in files.iter().enumerate() {
        write_file(&dir.join(name), *kind, *len, 1000 + i as u64)?;
        out.push((name.clone(), *len));
    }
    let meta = serde_json::json!({
        "format": "sluice-bench synthetic checkpoint",
        "files": out.iter().map(|(n, l)| serde_json::json!({"path": n, "bytes": l})).collect::<Vec<_>>(),
    })
    .to_string();
    std::fs::write(dir.join(".metadata"), &meta)?;
    out.push((".metadata".into(), meta.len() as u64));
    Ok(out)
}

/// Gives a tree to `uid:gid` with directories 0755 and files 0644 (a job user's data).
pub fn chown_tree(path: &Path, uid: u32, gid: u32) -> Result<()> {
    chown(path, Some(uid), Some(gid))?;
    let md = std::fs::symlink_metadata(path)?;
    if md.is_dir() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
        for e in std::fs::read_dir(path)? {
            chown_tree(&e?.path(), uid, gid)?;
        }
    } else {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))?;
    }
    Ok(())
}

/// Files and bytes below `path` (a file counts as one).
pub fn tree_size(path: &Path) -> (u64, u64) {
    let Ok(md) = std::fs::symlink_metadata(path) else {
        return (0, 0);
    };
    if md.is_file() {
        return (1, md.len());
    }
    if !md.is_dir() {
        return (0, 0);
    }
    let mut acc = (0, 0);
    if let Ok(rd) = std::fs::read_dir(path) {
        for e in rd.flatten() {
            let (f, b) = tree_size(&e.path());
            acc.0 += f;
            acc.1 += b;
        }
    }
    acc
}
