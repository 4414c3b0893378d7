//! The cuFile probe as a program sees it through the library: on this CPU-only machine, which has
//! no `libcufile.so.0` on the loader's path, it answers "unavailable" and why, in well under a
//! second — also when a libcufile is found whose driver cannot open (the PyPI `nvidia-cufile` of
//! the harness's PyTorch venv, where `cuFileDriverOpen` with the default configuration would never
//! return), and when the child hangs.

use sluice_writer::cufile::{Probe, probe};
use std::path::Path;
use std::time::{Duration, Instant};

const HELPER: &str = env!("CARGO_BIN_EXE_sluice-cufile-probe");

#[test]
fn without_libcufile_the_probe_says_unavailable_in_under_a_second() {
    let start = Instant::now();
    let answer = probe(None, Some(Path::new(HELPER)), Duration::from_secs(5));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "the probe took {took:?}");
    // A machine of this project's CI has no libcufile on the loader's path; a GPU machine with
    // GDS set up would say available, which is fine too — but never anything vague.
    match &answer {
        Probe::Unavailable(why) => assert_eq!(why, "libcufile.so.0 not found", "{answer:?}"),
        Probe::Available { .. } => eprintln!("cuFile is available on this machine"),
    }
    eprintln!("probe: {} in {took:?}", answer.line());
}

/// PyTorch's CUDA wheels bring libcufile (`nvidia-cufile`); loaded here without the driver, the
/// probe's cufile.json (compat mode off) makes the open fail at once instead of spinning forever.
#[test]
fn a_libcufile_without_its_driver_answers_unavailable_at_once() {
    let venv = std::env::var("SLUICE_TORCH_VENV").unwrap_or("/opt/sluice-test/torch-venv".into());
    let Some(lib) = ["cu13", "cufile", "cu12"]
        .iter()
        .map(|d| format!("{venv}/lib/python3.11/site-packages/nvidia/{d}/lib/libcufile.so.0"))
        .find(|p| Path::new(p).is_file())
    else {
        eprintln!("no libcufile in {venv}: the driver-open case was not tried");
        return;
    };
    let start = Instant::now();
    let answer = probe(Some(&lib), Some(Path::new(HELPER)), Duration::from_secs(5));
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "the probe took {took:?}");
    if let Probe::Unavailable(why) = &answer {
        assert!(
            why.starts_with("cuFileDriverOpen failed: error 5001"),
            "{why}"
        );
    }
    eprintln!("probe of {lib}: {} in {took:?}", answer.line());
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
