//! The cuFile probe as a program sees it through the library: on this CPU-only machine, which has
//! no `libcufile.so.0` on the loader's path, it answers "unavailable" and why, in well under a
//! second — also when a libcufile is found whose driver cannot open (the PyPI `nvidia-cufile` of
//! the harness's PyTorch venv, where `cuFileDriverOpen` with the default configuration would never
//! return), and when the child hangs.

use sluice_writer::cufile::{Probe, probe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const HELPER: &str = env!("CARGO_BIN_EXE_sluice-cufile-probe");

/// An answer "available" is only believed with the version the library reported (`cuFileGetVersion`:
/// 1170 for 1.17.0).
#[track_caller]
fn assert_sane_available(answer: &Probe) {
    if let Probe::Available { version } = answer {
        assert!(
            version.is_some_and(|v| v >= 1000),
            "cuFile available, but without a plausible library version: {answer:?}"
        );
    }
}

#[test]
fn without_libcufile_the_probe_says_unavailable_in_under_a_second() {
    let start = Instant::now();
    let answer = probe(None, Some(Path::new(HELPER)), Duration::from_secs(5));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "the probe took {took:?}");
    // A machine of this project's CI has no libcufile on the loader's path; a GPU machine with
    // GDS set up says available, which is right too — but then with the library's version, and
    // never anything vague.
    match &answer {
        Probe::Unavailable(why) => assert_eq!(why, "libcufile.so.0 not found", "{answer:?}"),
        Probe::Available { .. } => assert_sane_available(&answer),
    }
}

/// The libcufile of the harness's PyTorch venv (`SLUICE_TORCH_VENV`, else where
/// tests/harness/install.sh puts it): PyPI's torch for Linux is a CUDA build whose requirements
/// include `nvidia-cufile`, so that venv always has one.
fn venv_libcufile() -> PathBuf {
    let venv = std::env::var("SLUICE_TORCH_VENV").unwrap_or("/opt/sluice-test/torch-venv".into());
    let site_packages: Vec<PathBuf> = std::fs::read_dir(Path::new(&venv).join("lib"))
        .map(|dir| {
            dir.filter_map(|e| Some(e.ok()?.path().join("site-packages")))
                .collect()
        })
        .unwrap_or_default();
    site_packages
        .iter()
        .flat_map(|sp| {
            ["cu13", "cufile", "cu12"].map(|d| sp.join(format!("nvidia/{d}/lib/libcufile.so.0")))
        })
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no libcufile.so.0 under {venv}/lib/python*/site-packages/nvidia: this test needs \
                 the harness's PyTorch venv — run tests/harness/install.sh as root (without \
                 SLUICE_NO_TORCH=1), or set SLUICE_TORCH_VENV to a venv with PyPI's CUDA torch \
                 (or `pip install nvidia-cufile-cu12`)"
            )
        })
}

/// PyTorch's CUDA wheels bring libcufile (`nvidia-cufile`); loaded here without the driver, the
/// probe's cufile.json (compat mode off) makes the open fail at once instead of spinning forever.
#[test]
fn a_libcufile_without_its_driver_answers_unavailable_at_once() {
    let lib = venv_libcufile();
    let lib = lib.to_str().expect("a UTF-8 venv path");
    let start = Instant::now();
    let answer = probe(Some(lib), Some(Path::new(HELPER)), Duration::from_secs(5));
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "the probe of {lib} took {took:?}"
    );
    // Without the nvidia-fs driver (any machine but a GPU node with GDS set up) the open fails
    // with the driver's error; with it, cuFile is available, with the library's version.
    match &answer {
        Probe::Unavailable(why) => assert!(
            why.starts_with("cuFileDriverOpen failed: error 5001"),
            "{lib}: {why}"
        ),
        Probe::Available { .. } => assert_sane_available(&answer),
    }
}

/// A child that never answers is killed at the deadline and the answer says so.
#[test]
fn a_probe_that_hangs_is_killed_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let hang = dir.path().join("hang");
    std::fs::write(&hang, "#!/bin/sh\nexec sleep 30\n").unwrap();
    std::fs::set_permissions(&hang, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let start = Instant::now();
    let answer = probe(None, Some(&hang), Duration::from_millis(300));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert_eq!(
        answer.line(),
        "unavailable: cuFileDriverOpen did not answer within 300ms (killed)"
    );
}
