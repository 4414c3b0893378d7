//! The C ABI from C: `c_abi.c`, compiled against `include/sluice_writer.h` and linked with the
//! `libsluice_writer.so` cargo built for this test run, writes and checks a file (one with four
//! writer threads), that an aborted file leaves nothing under its name, the error returns, the refusal of CUDA writes without cuFile, and the probe's answer.

use std::path::Path;
use std::process::Command;

#[test]
fn a_c_program_writes_through_the_header_and_the_shared_library() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    // target/<profile>/deps/c_abi-HASH -> target/<profile>/libsluice_writer.so
    let exe = std::env::current_exe().unwrap();
    let libdir = exe.parent().unwrap().parent().unwrap();
    assert!(
        libdir.join("libsluice_writer.so").is_file(),
        "no libsluice_writer.so in {}",
        libdir.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let prog = dir.path().join("c_abi");
    let cc = std::env::var("CC").unwrap_or("cc".into());
    let built = Command::new(&cc)
        .arg("-Wall")
        .arg("-Werror")
        .arg("-o")
        .arg(&prog)
        .arg(here.join("tests/c_abi.c"))
        .arg("-I")
        .arg(here.join("include"))
        .arg("-L")
        .arg(libdir)
        .arg("-lsluice_writer")
        .output()
        .unwrap_or_else(|e| panic!("{cc}: {e} (a C compiler is needed: apt-get install gcc)"));
    assert!(
        built.status.success(),
        "{cc} c_abi.c: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let helper = env!("CARGO_BIN_EXE_sluice-cufile-probe");
    let out = Command::new(&prog)
        .arg(dir.path())
        .env("LD_LIBRARY_PATH", libdir)
        .env("SLUICE_CUFILE_PROBE", helper)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "c_abi exited {}: {said}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{said}");
    assert!(said.starts_with("ok 3149825 bytes"), "{said}");
    // -EOPNOTSUPP: cuFile was not probed available before the write.
    assert!(said.contains("write_cuda=-95"), "{said}");
}
