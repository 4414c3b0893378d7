//! GPUDirect Storage (cuFile): whether it can be used here ([`probe`]), and writing CUDA memory
//! straight to a file with it ([`CuFileHandle::write`]).
//!
//! `libcufile.so.0` is loaded at run time (`dlopen` through `libloading`), never linked: the
//! library builds and runs on machines without CUDA, and the handful of cuFile types it needs are
//! declared here by hand (`cufile.h` includes `cuda.h`, which these machines need not have).
//!
//! **Why the probe runs in a child process.** On a machine without the `nvidia-fs` driver,
//! `cuFileDriverOpen` with the default configuration (compat mode allowed) never returns: it spins
//! after failing to read `/proc/modules` (seen with libcufile 1.17 from PyPI's `nvidia-cufile` on a
//! CPU-only machine). So the probe runs the open in `sluice-cufile-probe`, a small program installed
//! beside `libsluice_writer.so`, with a `cufile.json` (`CUFILE_ENV_PATH_JSON`) that sets
//! `allow_compat_mode=false` — which makes the open fail at once (error 5001, "nvidia-fs driver is
//! not loaded") where there is no GDS — under a deadline after which the child is killed and the
//! answer is "unavailable". Only when a probe in this process answered "available" does
//! [`Driver::get`] open the driver in-process: where the open succeeded without compat mode it
//! returns promptly with the default configuration too.

#![allow(unsafe_code)]

use crate::file::AlignedWriter;
use libloading::{Library, Symbol};
use std::ffi::{c_int, c_void};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The library's soname, looked up on the loader's search path unless the caller names a path.
pub const LIB: &str = "libcufile.so.0";
/// The probe's child program, beside `libsluice_writer.so`.
pub const HELPER: &str = "sluice-cufile-probe";
/// The configuration the probe's child runs with: compat mode off (so a missing driver fails the
/// open instead of hanging it), logs to the child's own temporary directory.
const PROBE_JSON: &str =
    r#"{"properties": {"allow_compat_mode": false}, "logging": {"level": "ERROR"}}"#;
/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD` of `CUfileFileHandleType`.
const HANDLE_TYPE_OPAQUE_FD: c_int = 1;
/// `CU_FILE_DRIVER_NOT_INITIALIZED`.
const DRIVER_NOT_INITIALIZED: c_int = 5001;

/// `CUfileError_t`: the cuFile error (`CUfileOpError`, 0 = success) and the CUDA driver's
/// (`CUresult`), both C enums.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CuFileError {
    err: c_int,
    cu_err: c_int,
}

/// The `handle` union of `CUfileDescr_t`.
#[repr(C)]
union DescrHandle {
    fd: c_int,
    handle: *mut c_void,
}

/// `CUfileDescr_t`.
#[repr(C)]
struct CuFileDescr {
    kind: c_int,
    handle: DescrHandle,
    fs_ops: *const c_void,
}

type DriverOpenFn = unsafe extern "C" fn() -> CuFileError;
type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> CuFileError;
type HandleRegisterFn = unsafe extern "C" fn(*mut *mut c_void, *mut CuFileDescr) -> CuFileError;
type HandleDeregisterFn = unsafe extern "C" fn(*mut c_void);
type WriteFn =
    unsafe extern "C" fn(*mut c_void, *const c_void, usize, libc::off_t, libc::off_t) -> isize;

fn describe(e: CuFileError) -> String {
    match e.err {
        DRIVER_NOT_INITIALIZED => {
            "error 5001: the nvidia-fs driver is not loaded (GPUDirect Storage is not set up here)"
                .into()
        }
        n => format!("cuFile error {n} (CUDA error {})", e.cu_err),
    }
}

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `cuFileDriverOpen` succeeded without compat mode: CUDA memory can go to files with cuFile.
    Available { version: Option<i32> },
    /// cuFile cannot be used here; the reason, for the user.
    Unavailable(String),
}

impl Probe {
    pub fn is_available(&self) -> bool {
        matches!(self, Probe::Available { .. })
    }

    /// One line: `available (libcufile 1170)` or `unavailable: REASON`.
    pub fn line(&self) -> String {
        match self {
            Probe::Available { version: Some(v) } => format!("available (libcufile {v})"),
            Probe::Available { version: None } => "available".into(),
            Probe::Unavailable(why) => format!("unavailable: {why}"),
        }
    }
}

/// The library the last probe of this process found available, for [`Driver::get`].
static AVAILABLE: OnceLock<String> = OnceLock::new();

/// Probes cuFile in a child process (`helper`, else [`helper_path`]) loading `lib` (a soname or a
/// path; [`LIB`] by default), answering within `timeout` whatever the library does.
pub fn probe(lib: Option<&str>, helper: Option<&Path>, timeout: Duration) -> Probe {
    let lib = lib.unwrap_or(LIB);
    let Some(helper) = helper.map(Path::to_path_buf).or_else(helper_path) else {
        return Probe::Unavailable(format!(
            "the probe's helper program {HELPER} was not found beside libsluice_writer.so \
             (set SLUICE_CUFILE_PROBE to its path)"
        ));
    };
    let answer = run_child(&helper, lib, timeout);
    if answer.is_available() {
        let _ = AVAILABLE.set(lib.to_string());
    }
    answer
}

fn run_child(helper: &Path, lib: &str, timeout: Duration) -> Probe {
    let unavailable = |why: String| Probe::Unavailable(why);
    // The child's own directory: its cufile.json, and the cufile.log the library may write to
    // its working directory.
    static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!(
        "sluice-cufile-probe-{}-{nanos}-{}",
        std::process::id(),
        PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("cufile.json"), PROBE_JSON))
    {
        return unavailable(format!(
            "cannot write the probe's cufile.json in {}: {e}",
            dir.display()
        ));
    }
    let spawned = Command::new(helper)
        .arg(lib)
        .env("CUFILE_ENV_PATH_JSON", dir.join("cufile.json"))
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let answer = match spawned {
        Err(e) => unavailable(format!("cannot run {}: {e}", helper.display())),
        Ok(mut child) => {
            let start = Instant::now();
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        let mut out = String::new();
                        if let Some(mut s) = child.stdout.take() {
                            let _ = s.read_to_string(&mut out);
                        }
                        break parse_answer(out.trim(), status);
                    }
                    Ok(None) if start.elapsed() < timeout => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Ok(None) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break unavailable(format!(
                            "cuFileDriverOpen did not answer within {timeout:?} (killed)"
                        ));
                    }
                    Err(e) => break unavailable(format!("waiting for the probe: {e}")),
                }
            }
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    answer
}

fn parse_answer(out: &str, status: std::process::ExitStatus) -> Probe {
    if let Some(v) = out.strip_prefix("available") {
        return Probe::Available {
            version: v.trim().parse().ok(),
        };
    }
    match out.strip_prefix("unavailable: ") {
        Some(why) => Probe::Unavailable(why.to_string()),
        None => Probe::Unavailable(format!(
            "the probe exited with {status} without an answer{}",
            if out.is_empty() {
                String::new()
            } else {
                format!(": {out}")
            }
        )),
    }
}

/// Where the helper program is: `$SLUICE_CUFILE_PROBE`; else beside the loaded
/// `libsluice_writer.so` (found in `/proc/self/maps`); else beside the running program or one
/// directory up (a cargo test binary in `target/*/deps`).
pub fn helper_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SLUICE_CUFILE_PROBE") {
        return Some(PathBuf::from(p));
    }
    let mut dirs = Vec::new();
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        dirs.extend(
            maps.lines()
                .filter_map(|l| l.split_whitespace().nth(5))
                .filter(|p| p.ends_with("/libsluice_writer.so"))
                .filter_map(|p| Path::new(p).parent().map(Path::to_path_buf)),
        );
    }
    if let Ok(exe) = std::env::current_exe() {
        dirs.extend(exe.ancestors().skip(1).take(2).map(Path::to_path_buf));
    }
    dirs.into_iter()
        .map(|d| d.join(HELPER))
        .find(|p| p.is_file())
}

/// The child's side (`sluice-cufile-probe LIB`): load `lib`, open the driver, close it, and say
/// what happened in one line, `available VERSION` or `unavailable: REASON`. The parent gave it the
/// configuration (`CUFILE_ENV_PATH_JSON`) and the deadline.
pub fn child_answer(lib: &str) -> String {
    // SAFETY: loading a library runs its initialisers; that is the point of this process, which
    // does nothing else and whose parent kills it if it hangs.
    let library = match unsafe { Library::new(lib) } {
        Ok(l) => l,
        Err(e) => {
            let detail = e.to_string();
            return if detail.contains("No such file") || detail.contains("cannot open shared") {
                format!("unavailable: {lib} not found")
            } else {
                format!("unavailable: {lib} could not be loaded: {detail}")
            };
        }
    };
    let version = get_version(&library);
    // SAFETY: `cuFileDriverOpen` has this signature in cufile.h (no arguments, `CUfileError_t`
    // returned by value); the symbol's library stays loaded while it is called.
    let open: Symbol<DriverOpenFn> = match unsafe { library.get(b"cuFileDriverOpen\0") } {
        Ok(f) => f,
        Err(e) => return format!("unavailable: {lib} has no cuFileDriverOpen: {e}"),
    };
    // SAFETY: the declared signature matches cufile.h; the call takes no pointers.
    let opened = unsafe { open() };
    if opened.err != 0 {
        return format!("unavailable: cuFileDriverOpen failed: {}", describe(opened));
    }
    close_driver(&library);
    match version {
        Some(v) => format!("available {v}"),
        None => "available".into(),
    }
}

fn get_version(library: &Library) -> Option<i32> {
    // SAFETY: `cuFileGetVersion(int *)` per cufile.h; the symbol outlives the call.
    let f: Symbol<GetVersionFn> = unsafe { library.get(b"cuFileGetVersion\0") }.ok()?;
    let mut v: c_int = 0;
    // SAFETY: `v` is a live, writable int for the whole call, which is all it writes.
    let r = unsafe { f(&mut v) };
    (r.err == 0).then_some(v)
}

/// `cuFileDriverClose_v2` (what `cuFileDriverClose` is a macro for since CUDA 12), else the old
/// `cuFileDriverClose` symbol of older libraries.
fn close_driver(library: &Library) {
    for name in [&b"cuFileDriverClose_v2\0"[..], &b"cuFileDriverClose\0"[..]] {
        // SAFETY: both take no arguments and return `CUfileError_t`, per cufile.h.
        if let Ok(f) = unsafe { library.get::<DriverOpenFn>(name) } {
            // SAFETY: as declared; called once, after a successful open.
            let _ = unsafe { f() };
            return;
        }
    }
}

/// The function `name` (NUL-terminated) of `library`, copied out as a `T`.
///
/// # Safety
/// `T` must be the type of the function's declaration, and the copy must not be called once
/// `library` is unloaded.
unsafe fn function<T: Copy>(library: &Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller's.
    unsafe { library.get::<T>(name) }
        .map(|f| *f)
        .map_err(|e| e.to_string())
}

/// The cuFile driver opened in this process, with the functions the write path calls. Kept open
/// until the process ends (cuFile keeps per-process state; closing and reopening it between
/// checkpoints would cost more than it frees).
pub struct Driver {
    register: HandleRegisterFn,
    deregister: HandleDeregisterFn,
    write: WriteFn,
    _library: Library,
}

static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

impl Driver {
    /// The driver, opened once per process; only after a [`probe`] in this process answered
    /// available (else opening it might never return).
    pub fn get() -> Result<&'static Driver, String> {
        let Some(lib) = AVAILABLE.get() else {
            return Err(
                "cuFile was not probed available in this process (call the probe first)".into(),
            );
        };
        DRIVER
            .get_or_init(|| Driver::open(lib))
            .as_ref()
            .map_err(Clone::clone)
    }

    fn open(lib: &str) -> Result<Driver, String> {
        // SAFETY: the probe loaded and opened this library in a child process; loading it here
        // runs the same initialisers.
        let library = unsafe { Library::new(lib) }.map_err(|e| format!("load {lib}: {e}"))?;
        // SAFETY: for all four, the types are those of cufile.h's declarations; the function
        // pointers are copied out while `library` is alive and `Driver` keeps it loaded for as
        // long as they can be called (a `'static` value).
        let (open, register, deregister, write) = unsafe {
            (
                function::<DriverOpenFn>(&library, b"cuFileDriverOpen\0")?,
                function::<HandleRegisterFn>(&library, b"cuFileHandleRegister\0")?,
                function::<HandleDeregisterFn>(&library, b"cuFileHandleDeregister\0")?,
                function::<WriteFn>(&library, b"cuFileWrite\0")?,
            )
        };
        // SAFETY: as declared; no pointers.
        let opened = unsafe { open() };
        if opened.err != 0 {
            return Err(format!("cuFileDriverOpen: {}", describe(opened)));
        }
        Ok(Driver {
            register,
            deregister,
            write,
            _library: library,
        })
    }
}

/// One writer's file registered with cuFile; deregistered when dropped (before the file closes).
pub struct CuFileHandle {
    raw: *mut c_void,
    driver: &'static Driver,
}

impl CuFileHandle {
    /// Registers `w`'s file, which must have been opened with `O_DIRECT` (GDS writes bypass the
    /// page cache).
    pub fn register(w: &AlignedWriter) -> Result<CuFileHandle, String> {
        if !w.is_direct() {
            return Err(format!(
                "{} is not open with O_DIRECT (a tmpfs?): cuFile cannot write it",
                w.path().display()
            ));
        }
        let driver = Driver::get()?;
        let mut descr = CuFileDescr {
            kind: HANDLE_TYPE_OPAQUE_FD,
            handle: DescrHandle {
                fd: w.file().as_raw_fd(),
            },
            fs_ops: std::ptr::null(),
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` and `descr` are live and writable for the call; the descriptor is open
        // and stays open while the handle exists (the handle is dropped before the writer closes
        // its file, see `ffi`).
        let r = unsafe { (driver.register)(&mut raw, &mut descr) };
        if r.err != 0 {
            return Err(format!("cuFileHandleRegister: {}", describe(r)));
        }
        Ok(CuFileHandle { raw, driver })
    }

    /// Writes `len` bytes of CUDA device memory at `devptr` at the writer's position, after
    /// writing out what it buffered.
    ///
    /// # Safety
    /// `devptr` must point to at least `len` bytes of CUDA device memory (or memory cuFile
    /// accepts) that stay valid and unchanged for the call, and `self` must be `w`'s handle.
    pub unsafe fn write(
        &self,
        w: &mut AlignedWriter,
        devptr: *const c_void,
        len: usize,
    ) -> Result<(), String> {
        w.flush().map_err(|e| e.to_string())?;
        let start = w.position();
        let mut done = 0usize;
        while done < len {
            let at = libc::off_t::try_from(start + done as u64).map_err(|e| e.to_string())?;
            let from = libc::off_t::try_from(done).map_err(|e| e.to_string())?;
            // SAFETY: by this function's contract `devptr..devptr+len` is valid device memory;
            // cuFile reads `len - done` bytes at offset `done` of it, inside that range.
            let n = unsafe { (self.driver.write)(self.raw, devptr, len - done, at, from) };
            if n <= 0 {
                return Err(format!(
                    "cuFileWrite of {} bytes at offset {at} of {}: returned {n}",
                    len - done,
                    w.path().display()
                ));
            }
            done += n as usize;
        }
        w.skip(len as u64).map_err(|e| e.to_string())
    }
}

impl Drop for CuFileHandle {
    fn drop(&mut self) {
        // SAFETY: `raw` came from a successful `cuFileHandleRegister` and is deregistered once.
        unsafe { (self.driver.deregister)(self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_into_what_the_user_reads() {
        use std::os::unix::process::ExitStatusExt;
        let ok = std::process::ExitStatus::from_raw(0);
        assert_eq!(
            parse_answer("available 1170", ok),
            Probe::Available {
                version: Some(1170)
            }
        );
        assert_eq!(
            parse_answer("unavailable: libcufile.so.0 not found", ok).line(),
            "unavailable: libcufile.so.0 not found"
        );
        let crashed = std::process::ExitStatus::from_raw(11);
        assert!(
            parse_answer("", crashed)
                .line()
                .starts_with("unavailable: the probe exited")
        );
    }

    #[test]
    fn a_library_that_is_not_there_is_named() {
        assert_eq!(
            child_answer("libsluice-no-such-cufile.so.0"),
            "unavailable: libsluice-no-such-cufile.so.0 not found"
        );
    }

    #[test]
    fn the_driver_is_not_opened_without_a_probe_that_said_available() {
        if AVAILABLE.get().is_none() {
            assert!(Driver::get().err().unwrap().contains("not probed"));
        }
    }
}
