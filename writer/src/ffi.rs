//! The C ABI of `libsluice_writer.so` (declared in `include/sluice_writer.h`, which documents each
//! function for its callers: the `sluice_ckpt` Python package through ctypes, and C/C++ programs).
//!
//! Every entry point goes through [`guard`]: a panic never crosses into the caller (since Rust 1.81
//! it would abort the training process); it becomes an error return and a message for
//! `sluice_writer_last_error`. The messages are per thread, as `errno` is, so threads writing
//! different files (DCP's writer threads) do not read each other's. Pointers from the caller are
//! checked for null before use; everything else about them is the caller's contract, stated in
//! the header and repeated at each `unsafe` block.

#![allow(unsafe_code)]

use crate::cufile::{self, CuFileHandle};
use crate::file::{AlignedWriter, Options};
use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::Duration;

/// What a `sluice_writer *` points at: the file being written and, once CUDA memory was written
/// to it, its cuFile registration.
pub struct Handle {
    writer: AlignedWriter,
    cufile: Option<CuFileHandle>,
}

/// A failure: the `errno`-style code the C caller gets (negated) and the message it can read.
struct Failure {
    errno: c_int,
    message: String,
}

impl From<crate::file::WriteError> for Failure {
    fn from(e: crate::file::WriteError) -> Failure {
        Failure {
            errno: e.errno(),
            message: e.to_string(),
        }
    }
}

fn invalid(message: impl Into<String>) -> Failure {
    Failure {
        errno: libc::EINVAL,
        message: message.into(),
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A message with a NUL in it (from a path) is cut there rather than lost.
    let bytes: Vec<u8> = message.bytes().take_while(|&b| b != 0).collect();
    let c = CString::new(bytes).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning a failure or a panic into `on_error` and the thread's last error message.
fn guard<T>(on_error: impl FnOnce(c_int) -> T, f: impl FnOnce() -> Result<T, Failure>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(fail)) => {
            set_last_error(&fail.message);
            on_error(fail.errno)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal error in libsluice_writer: {what}"));
            on_error(libc::EIO)
        }
    }
}

/// A C string argument as a `&str`.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string that lives for the call.
unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and NUL-terminated and alive for the call by this function's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// # Safety
/// `w` must be null or a pointer from `sluice_writer_open` not yet closed, used by one thread at
/// a time.
unsafe fn handle<'a>(w: *mut Handle) -> Result<&'a mut Handle, Failure> {
    if w.is_null() {
        return Err(invalid("the writer is NULL"));
    }
    // SAFETY: by the contract it is a live `Box<Handle>` pointer from `sluice_writer_open`, and no
    // other reference to it exists during the call.
    Ok(unsafe { &mut *w })
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `path` must be a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_open(path: *const c_char, block_size: usize) -> *mut Handle {
    // SAFETY: the caller passes a NUL-terminated path (header contract).
    unsafe { sluice_writer_open_threads(path, block_size, 0) }
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `path` must be a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_open_threads(
    path: *const c_char,
    block_size: usize,
    threads: c_uint,
) -> *mut Handle {
    guard(
        |_| std::ptr::null_mut(),
        || {
            // SAFETY: the caller passes a NUL-terminated path (header contract).
            let path = unsafe { c_str(path, "path") }?;
            let options = Options {
                block_size,
                threads: threads as usize,
            };
            let writer = AlignedWriter::open(Path::new(path), options)?;
            Ok(Box::into_raw(Box::new(Handle {
                writer,
                cufile: None,
            })))
        },
    )
}

/// The shape of both writes: 0 or `-errno`; `write` runs on the live writer `w` unless there is
/// nothing to write (`len` 0, where `data` may be NULL); a NULL `data` with bytes to write is
/// refused (`what` names it in the message).
///
/// # Safety
/// `w` must be null or a pointer from `sluice_writer_open` not yet closed, used by one thread at
/// a time (as for [`handle`]).
unsafe fn write_call(
    w: *mut Handle,
    data: *const c_void,
    len: usize,
    what: &str,
    write: impl FnOnce(&mut Handle) -> Result<(), Failure>,
) -> c_int {
    guard(
        |e| -e,
        || {
            // SAFETY: by this function's contract.
            let h = unsafe { handle(w) }?;
            if len == 0 {
                return Ok(0);
            }
            if data.is_null() {
                return Err(invalid(format!("{what} is NULL")));
            }
            write(h)?;
            Ok(0)
        },
    )
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `w` from `sluice_writer_open`, not closed; `buf` points to `len` readable bytes (or `len` is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_write(
    w: *mut Handle,
    buf: *const c_void,
    len: usize,
) -> c_int {
    let write = |h: &mut Handle| {
        // SAFETY: non-null, and `len` readable bytes that the caller does not change during the
        // call (header contract); they are copied before it returns.
        let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
        Ok(h.writer.write(bytes)?)
    };
    // SAFETY: `w` is a live writer of this thread (header contract).
    unsafe { write_call(w, buf, len, "buf", write) }
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `w` from `sluice_writer_open`, not closed; `devptr` points to `len` bytes of CUDA device memory.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_write_cuda(
    w: *mut Handle,
    devptr: *const c_void,
    len: usize,
) -> c_int {
    let write = |h: &mut Handle| {
        let unsupported = |message: String| Failure {
            errno: libc::EOPNOTSUPP,
            message,
        };
        if h.cufile.is_none() {
            h.cufile = Some(CuFileHandle::register(&h.writer).map_err(unsupported)?);
        }
        let cu = h.cufile.as_ref().expect("registered above");
        // SAFETY: `devptr` is `len` bytes of device memory, unchanged during the call (header
        // contract), and `cu` is the registration of this handle's writer.
        unsafe { cu.write(&mut h.writer, devptr, len) }.map_err(|message| Failure {
            errno: libc::EIO,
            message,
        })
    };
    // SAFETY: `w` is a live writer of this thread (header contract).
    unsafe { write_call(w, devptr, len, "devptr", write) }
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `w` from `sluice_writer_open`, not closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_position(w: *mut Handle) -> i64 {
    guard(
        |e| -i64::from(e),
        // SAFETY: `w` is a live writer of this thread (header contract).
        || Ok(unsafe { handle(w) }?.writer.position() as i64),
    )
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `w` from `sluice_writer_open`, not closed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_is_direct(w: *mut Handle) -> c_int {
    guard(
        |e| -e,
        // SAFETY: `w` is a live writer of this thread (header contract).
        || Ok(c_int::from(unsafe { handle(w) }?.writer.is_direct())),
    )
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `w` from `sluice_writer_open`, not closed; not used again after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_close(w: *mut Handle) -> c_int {
    guard(
        |e| -e,
        || {
            if w.is_null() {
                return Err(invalid("the writer is NULL"));
            }
            // SAFETY: `w` came from `Box::into_raw` in `sluice_writer_open` and is closed once
            // (header contract): ownership comes back here and it is freed at the end of the call.
            let h = unsafe { Box::from_raw(w) };
            let Handle { writer, cufile } = *h;
            // Deregistered before the file is closed.
            drop(cufile);
            writer.close()?;
            Ok(0)
        },
    )
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `w` null, or from `sluice_writer_open` and not closed; not used again after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_writer_abort(w: *mut Handle) {
    guard(
        |_| (),
        || {
            if !w.is_null() {
                // SAFETY: as in `sluice_writer_close`: the box comes back once and is dropped,
                // which stops the writer threads and removes the unfinished file.
                drop(unsafe { Box::from_raw(w) });
            }
            Ok(())
        },
    )
}

/// See `sluice_writer.h`.
#[unsafe(no_mangle)]
pub extern "C" fn sluice_writer_last_error() -> *const c_char {
    // The pointer stays valid until this thread's next failing call replaces the string.
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// See `sluice_writer.h`.
#[unsafe(no_mangle)]
pub extern "C" fn sluice_writer_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// See `sluice_writer.h`.
///
/// # Safety
/// `lib` null or a NUL-terminated string; `why` null or `why_len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sluice_cufile_probe(
    lib: *const c_char,
    timeout_ms: c_uint,
    why: *mut c_char,
    why_len: usize,
) -> c_int {
    guard(
        |e| -e,
        || {
            let lib = if lib.is_null() {
                None
            } else {
                // SAFETY: non-null, so NUL-terminated by the header's contract.
                Some(unsafe { c_str(lib, "lib") }?)
            };
            let timeout = Duration::from_millis(if timeout_ms == 0 {
                10_000
            } else {
                u64::from(timeout_ms)
            });
            let answer = cufile::probe(lib, None, timeout);
            if !why.is_null() && why_len > 0 {
                let line = answer.line();
                let n = line.len().min(why_len - 1);
                // SAFETY: `why` has `why_len` writable bytes (contract); `n + 1 <= why_len`
                // bytes are written, the last a NUL; the source is a live Rust string.
                unsafe {
                    std::ptr::copy_nonoverlapping(line.as_ptr(), why.cast::<u8>(), n);
                    *why.add(n) = 0;
                }
            }
            Ok(c_int::from(answer.is_available()))
        },
    )
}
