//! The safe layer over the SPANK C API: [`Spank`] wraps the `spank_t` that Slurm passes to a
//! callback, and [`SlurmLog`] wraps Slurm's log functions. Every `ESPANK_*` code becomes a
//! [`SpankError`]; every string crosses as an owned, NUL-free `CString`.

use crate::api::{Context, Log, OptionSpec, SpankApi, SpankError};
use crate::sys;
use std::ffi::{CStr, CString, c_char, c_int};
use std::ptr;

/// Maps an `ESPANK_*` return code.
fn check(rc: sys::spank_err_t) -> Result<(), SpankError> {
    Err(match rc {
        0 => return Ok(()),
        sys::ESPANK_ERROR => SpankError::Error,
        sys::ESPANK_BAD_ARG => SpankError::BadArg,
        sys::ESPANK_NOT_TASK => SpankError::NotTask,
        sys::ESPANK_ENV_EXISTS => SpankError::EnvExists,
        sys::ESPANK_ENV_NOEXIST => SpankError::EnvNoExist,
        sys::ESPANK_NOSPACE => SpankError::NoSpace,
        sys::ESPANK_NOT_REMOTE => SpankError::NotRemote,
        sys::ESPANK_NOEXIST => SpankError::NoExist,
        sys::ESPANK_NOT_EXECD => SpankError::NotExecd,
        sys::ESPANK_NOT_AVAIL => SpankError::NotAvail,
        sys::ESPANK_NOT_LOCAL => SpankError::NotLocal,
        other => SpankError::Other(other),
    })
}

/// A `CString` for Slurm; interior NULs (which C would silently cut at) become '?'.
pub(crate) fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "?")).expect("NULs were replaced")
}

/// The line handed to Slurm's log: every message carries the plugin's name, so a user reading the
/// job's output or an admin reading slurmd's log knows who speaks.
pub(crate) fn log_line(msg: &str) -> CString {
    c_string(&format!("{}: {msg}", crate::PLUGIN_NAME))
}

/// Slurm's logging functions. Usable without a handle (the option callback gets none).
pub struct SlurmLog;

impl SlurmLog {
    fn emit(f: unsafe extern "C" fn(*const c_char, ...), msg: &str) {
        let line = log_line(msg);
        // SAFETY: the format is a static "%s" and its one argument a valid NUL-terminated string that
        // outlives the call, so the printf-style function reads exactly one string argument.
        unsafe { f(c"%s".as_ptr(), line.as_ptr()) }
    }
}

impl Log for SlurmLog {
    fn report(&self, msg: &str) {
        Self::emit(sys::slurm_spank_log, msg);
    }
    fn error(&self, msg: &str) {
        Self::emit(sys::slurm_error, msg);
    }
    fn info(&self, msg: &str) {
        Self::emit(sys::slurm_info, msg);
    }
    fn verbose(&self, msg: &str) {
        Self::emit(sys::slurm_verbose, msg);
    }
    fn debug(&self, msg: &str) {
        Self::emit(sys::slurm_debug, msg);
    }
}

/// The handle Slurm passes to a callback; valid for the duration of that callback only.
pub struct Spank {
    raw: sys::spank_t,
}

impl Spank {
    /// # Safety
    /// `raw` must be the handle Slurm passed to the callback now running, and the returned value must
    /// not outlive that callback.
    pub unsafe fn from_raw(raw: sys::spank_t) -> Spank {
        Spank { raw }
    }

    fn get_u32_item(&self, item: sys::spank_item_t) -> Result<u32, SpankError> {
        let mut value: u32 = 0;
        // SAFETY: `raw` is the live handle (see `from_raw`). For S_JOB_ID, S_JOB_STEPID, S_JOB_UID and
        // S_JOB_GID spank.h documents one out-argument of type `uint32_t *`, `uint32_t *`,
        // `uid_t *`, `gid_t *`, all 32-bit unsigned on Linux; it points to a local that lives across the call.
        check(unsafe { sys::spank_get_item(self.raw, item, &mut value as *mut u32) })?;
        Ok(value)
    }
}

impl Log for Spank {
    fn report(&self, msg: &str) {
        SlurmLog.report(msg)
    }
    fn error(&self, msg: &str) {
        SlurmLog.error(msg)
    }
    fn info(&self, msg: &str) {
        SlurmLog.info(msg)
    }
    fn verbose(&self, msg: &str) {
        SlurmLog.verbose(msg)
    }
    fn debug(&self, msg: &str) {
        SlurmLog.debug(msg)
    }
}

// libc's uid_t/gid_t must be the u32 that `get_u32_item` hands to spank_get_item.
const _: () = assert!(size_of::<libc::uid_t>() == 4 && size_of::<libc::gid_t>() == 4);

impl SpankApi for Spank {
    fn context(&self) -> Context {
        // SAFETY: spank_context takes no arguments and only reads Slurm's global plugin stack.
        match unsafe { sys::spank_context() } {
            sys::S_CTX_LOCAL => Context::Local,
            sys::S_CTX_REMOTE => Context::Remote,
            sys::S_CTX_ALLOCATOR => Context::Allocator,
            sys::S_CTX_SLURMD => Context::Slurmd,
            sys::S_CTX_JOB_SCRIPT => Context::JobScript,
            _ => Context::Unknown,
        }
    }

    fn register_option(&mut self, opt: &OptionSpec) -> Result<(), SpankError> {
        let (name, arginfo, usage) = (
            c_string(opt.name),
            c_string(opt.arginfo),
            c_string(opt.usage),
        );
        let mut raw = sys::spank_option {
            name: name.as_ptr().cast_mut(),
            arginfo: arginfo.as_ptr().cast_mut(),
            usage: usage.as_ptr().cast_mut(),
            has_arg: 1,
            val: opt.val,
            cb: Some(crate::entry::option_callback),
        };
        // SAFETY: `raw` is the live handle. Slurm copies name, arginfo and usage
        // (`_spank_option_copy` in plugstack.c) and keeps only the callback pointer, a plain
        // function of this library, which stays loaded (Slurm never dlcloses SPANK plugins).
        // The strings outlive the call.
        check(unsafe { sys::spank_option_register(self.raw, &mut raw) })
    }

    fn getopt(&self, name: &str) -> Result<Option<String>, SpankError> {
        let cname = c_string(name);
        let mut opt = sys::spank_option {
            name: cname.as_ptr().cast_mut(),
            arginfo: ptr::null_mut(),
            usage: ptr::null_mut(),
            has_arg: 1,
            val: 0,
            cb: None,
        };
        let mut arg: *mut c_char = ptr::null_mut();
        // SAFETY: `raw` is the live handle; Slurm only reads `opt` (it looks the option up by name)
        // and stores into `arg` a pointer to its own copy of the value, or nothing.
        let rc = unsafe { sys::spank_option_getopt(self.raw, &mut opt, &mut arg) };
        match check(rc) {
            Ok(()) if arg.is_null() => Ok(Some(String::new())),
            // SAFETY: on success `arg` points to a NUL-terminated string owned by Slurm's option
            // cache, valid at least until this callback returns; it is copied at once.
            Ok(()) => Ok(Some(
                unsafe { CStr::from_ptr(arg) }
                    .to_string_lossy()
                    .into_owned(),
            )),
            // "Option is known but was not used by this job."
            Err(SpankError::Error) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn job_id(&self) -> Result<u32, SpankError> {
        self.get_u32_item(sys::S_JOB_ID)
    }

    fn step_id(&self) -> Result<u32, SpankError> {
        self.get_u32_item(sys::S_JOB_STEPID)
    }

    fn job_uid(&self) -> Result<u32, SpankError> {
        self.get_u32_item(sys::S_JOB_UID)
    }

    fn job_gid(&self) -> Result<u32, SpankError> {
        self.get_u32_item(sys::S_JOB_GID)
    }

    fn getenv(&self, name: &str) -> Result<Option<String>, SpankError> {
        let cname = c_string(name);
        let mut len = 4096usize;
        loop {
            let mut buf = vec![0u8; len];
            // SAFETY: `raw` is the live handle; `buf` is writable for `len` bytes, and spank_getenv
            // writes at most `len` bytes including the terminating NUL (strlcpy).
            let rc = unsafe {
                sys::spank_getenv(
                    self.raw,
                    cname.as_ptr(),
                    buf.as_mut_ptr().cast::<c_char>(),
                    len as c_int,
                )
            };
            match check(rc) {
                Ok(()) => {
                    let value = CStr::from_bytes_until_nul(&buf).map_err(|_| SpankError::BadArg)?;
                    return Ok(Some(value.to_string_lossy().into_owned()));
                }
                Err(SpankError::EnvNoExist) => return Ok(None),
                Err(SpankError::NoSpace) if len < 1 << 20 => len *= 16,
                Err(e) => return Err(e),
            }
        }
    }

    fn setenv(&mut self, name: &str, value: &str, overwrite: bool) -> Result<(), SpankError> {
        let (name, value) = (c_string(name), c_string(value));
        // SAFETY: `raw` is the live handle; Slurm copies both strings into the job's environment.
        check(unsafe {
            sys::spank_setenv(
                self.raw,
                name.as_ptr(),
                value.as_ptr(),
                c_int::from(overwrite),
            )
        })
    }

    fn job_control_setenv(
        &mut self,
        name: &str,
        value: &str,
        overwrite: bool,
    ) -> Result<(), SpankError> {
        let (name, value) = (c_string(name), c_string(value));
        // SAFETY: `raw` is the live handle; Slurm copies both strings into the job-control environment.
        check(unsafe {
            sys::spank_job_control_setenv(
                self.raw,
                name.as_ptr(),
                value.as_ptr(),
                c_int::from(overwrite),
            )
        })
    }

    fn process_env(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }

    fn hostname(&self) -> Option<String> {
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is writable for its full length, which is what gethostname is told.
        if unsafe { libc::gethostname(buf.as_mut_ptr().cast::<c_char>(), buf.len()) } != 0 {
            return None;
        }
        // gethostname may leave the name unterminated when it is truncated: then there is no NUL.
        let name = CStr::from_bytes_until_nul(&buf).ok()?;
        Some(name.to_string_lossy().into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn espank_codes_map_to_typed_errors() {
        assert_eq!(check(0), Ok(()));
        assert_eq!(check(3000), Err(SpankError::Error));
        assert_eq!(check(3004), Err(SpankError::EnvNoExist));
        assert_eq!(check(3006), Err(SpankError::NotRemote));
        assert_eq!(check(3010), Err(SpankError::NotLocal));
        assert_eq!(check(42), Err(SpankError::Other(42)));
    }

    #[test]
    fn log_lines_are_prefixed_and_never_truncated_by_nuls() {
        assert_eq!(
            log_line("--stage-in: bad").to_str().unwrap(),
            "sluice: --stage-in: bad"
        );
        assert_eq!(log_line("a\0b").to_str().unwrap(), "sluice: a?b");
    }
}
