//! Real training frameworks in jobs: the PyTorch venv that `tests/harness/install.sh` builds outside
//! the clone (checked as the test user, who runs it), the Python job scripts of
//! `tests/harness/frameworks/` (compiled in, written into a test's work directory), and free ports
//! for gloo's rendezvous.

use super::cluster::Cluster;
use std::fs;
use std::path::{Path, PathBuf};

/// Where install.sh puts the venv unless `SLUICE_TORCH_VENV` says otherwise (the same variable).
pub const DEFAULT_TORCH_VENV: &str = "/opt/sluice-test/torch-venv";

/// The job scripts, by file name: the shared checks and one script per framework.
pub const FRAMEWORK_SCRIPTS: [(&str, &str); 7] = [
    (
        "fwcheck.py",
        include_str!("../../harness/frameworks/fwcheck.py"),
    ),
    ("dcp.py", include_str!("../../harness/frameworks/dcp.py")),
    ("ddp.py", include_str!("../../harness/frameworks/ddp.py")),
    (
        "deepspeed_ckpt.py",
        include_str!("../../harness/frameworks/deepspeed_ckpt.py"),
    ),
    (
        "megatron.py",
        include_str!("../../harness/frameworks/megatron.py"),
    ),
    (
        "lightning_ddp.py",
        include_str!("../../harness/frameworks/lightning_ddp.py"),
    ),
    (
        "hf_trainer.py",
        include_str!("../../harness/frameworks/hf_trainer.py"),
    ),
];

/// The PyTorch venv: `SLUICE_TORCH_VENV`, or install.sh's default.
pub fn torch_venv() -> PathBuf {
    std::env::var_os("SLUICE_TORCH_VENV").map_or_else(|| DEFAULT_TORCH_VENV.into(), PathBuf::from)
}

impl Cluster {
    /// The venv's python, once the test user has imported torch with it; panics saying how to
    /// install it otherwise (a framework test never passes without running its framework).
    pub fn torch_python(&self) -> PathBuf {
        let py = torch_venv().join("bin/python");
        let probe = "import torch; print(torch.__version__)";
        let out = self.as_user(Path::new("/"), &py.to_string_lossy(), &["-c", probe], None);
        assert!(
            out.status.success(),
            "PyTorch is not installed where the test user can run it ({}): run tests/harness/install.sh \
             as root, without SLUICE_NO_TORCH=1 (it installs torch into {}, or SLUICE_TORCH_VENV). \
             The test user's `python -c 'import torch'` said: {}",
            py.display(),
            torch_venv().display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        eprintln!(
            "torch {} from {}",
            String::from_utf8_lossy(&out.stdout).trim(),
            py.display()
        );
        py
    }

    /// Whether the test user can import `deepspeed` with the venv's python (install.sh installs it
    /// only where it builds and imports on CPU).
    pub fn has_deepspeed(&self, py: &Path) -> bool {
        let out = self.as_user(
            Path::new("/"),
            "/usr/bin/env",
            &[
                "DS_ACCELERATOR=cpu",
                &py.to_string_lossy(),
                "-c",
                "import deepspeed",
            ],
            None,
        );
        out.status.success()
    }
}

/// Writes the job scripts into `dir` (readable by the job user, who cannot read the clone).
pub fn write_framework_scripts(dir: &Path) {
    for (name, text) in FRAMEWORK_SCRIPTS {
        let path = dir.join(name);
        fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}

/// A file `cargo build --workspace` left beside the sluice CLI (target/debug).
pub fn built(name: &str) -> PathBuf {
    let dir = super::built_cli().parent().unwrap().to_path_buf();
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "no {} (cargo build --workspace builds it; run-e2e.sh does)",
        p.display()
    );
    p
}

/// The `sluice_ckpt` package (`WORK/py`) and the writer library with its probe (`WORK/lib`),
/// copied from the clone and the build into a work directory, where the test user can read them:
/// jobs find them through `PYTHONPATH` and `SLUICE_WRITER_LIB` ([`sluice_ckpt_env`]), as a
/// checkout's user would.
pub fn install_sluice_ckpt(work: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../python/sluice_ckpt")
        .canonicalize()
        .unwrap();
    let pkg = work.join("py/sluice_ckpt");
    fs::create_dir_all(&pkg).unwrap();
    for e in fs::read_dir(&src).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "py") {
            fs::copy(e.path(), pkg.join(e.file_name())).unwrap();
        }
    }
    let lib = work.join("lib");
    fs::create_dir_all(&lib).unwrap();
    for f in ["libsluice_writer.so", "sluice-cufile-probe"] {
        fs::copy(built(f), lib.join(f)).unwrap();
    }
}

/// The variables a job script exports to use what [`install_sluice_ckpt`] put into `work`, with
/// `cli` as the sluice CLI its commits run.
pub fn sluice_ckpt_env(work: &Path, cli: &Path) -> String {
    format!(
        "PYTHONPATH={w}/py SLUICE_WRITER_LIB={w}/lib/libsluice_writer.so SLUICE_CLI={cli}",
        w = work.display(),
        cli = cli.display()
    )
}
