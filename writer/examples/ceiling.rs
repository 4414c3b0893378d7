//! The writer's ceiling: how fast one file is written from host memory through
//! [`AlignedWriter`] with 1, 2, 4… writer threads, open to close (fsync and rename included).
//!
//! ```text
//! cargo run --release -p sluice-writer --example ceiling -- DIR [SIZE_MIB] [THREADS,…] [REPS]
//! ```
//!
//! `DIR` is the file system to measure (bench/README.md's writer section: `/dev/shm`, and ext4 on a
//! loop device with direct I/O over a file in tmpfs, which costs no disk time). The source is one
//! buffer of `SIZE_MIB` (default 2048) touched beforehand, written in 64 MiB pieces as a tensor-by-
//! tensor save would, twice: from a 4 KiB-aligned address (as pinned host memory is: the blocks go
//! to the file straight from it) and from 64 bytes past one (copied through the writer's buffers
//! first). Each repetition writes a fresh file, removed afterwards. It prints, per thread count and
//! source, the best and the median rate of `REPS` (default 3) in GB/s (10^9 bytes/s).

use sluice_core::iobuf::AlignedBuf;
use sluice_writer::file::{AlignedWriter, Options};
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().map(PathBuf::from) else {
        eprintln!("usage: ceiling DIR [SIZE_MIB] [THREADS,...] [REPS]");
        std::process::exit(2);
    };
    let mib: usize = args.get(1).map_or(2048, |s| s.parse().expect("SIZE_MIB"));
    let threads: Vec<usize> = args.get(2).map_or(vec![1, 2, 4], |s| {
        s.split(',').map(|t| t.parse().expect("THREADS")).collect()
    });
    let reps: usize = args.get(3).map_or(3, |s| s.parse().expect("REPS"));
    let size = mib << 20;
    let mut memory = AlignedBuf::new(size + 4096);
    for (i, b) in memory.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761) as u8;
    }
    let sources = [
        ("aligned", &memory[..size]),
        ("copied", &memory[64..size + 64]),
    ];
    for (n, (how, source)) in threads
        .iter()
        .flat_map(|&n| sources.iter().map(move |s| (n, *s)))
    {
        let mut rates = Vec::new();
        let mut direct = false;
        for r in 0..reps {
            let path = dir.join(format!("sluice-ceiling-{n}-{how}-{r}"));
            let start = Instant::now();
            let options = Options {
                block_size: 0,
                threads: n,
            };
            let mut w = AlignedWriter::open(&path, options).expect("open");
            direct = w.is_direct();
            for piece in source.chunks(64 << 20) {
                w.write(piece).expect("write");
            }
            w.close().expect("close");
            let secs = start.elapsed().as_secs_f64();
            std::fs::remove_file(&path).expect("remove");
            rates.push(size as f64 / secs / 1e9);
        }
        rates.sort_by(f64::total_cmp);
        println!(
            "{} threads={n} source={how} size={mib}MiB direct={direct} best={:.2} GB/s median={:.2} GB/s",
            dir.display(),
            rates[rates.len() - 1],
            rates[rates.len() / 2]
        );
    }
}
