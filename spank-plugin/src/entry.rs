//! The C entry points Slurm looks up with `dlsym`, and the one trampoline they all go through.
//!
//! Each entry point converts its raw arguments into the safe handle and hands over to
//! [`crate::callbacks`]. The trampoline catches panics: since Rust 1.81 a panic escaping an
//! `extern "C"` function aborts the process, and the process here is sbatch, srun, slurmd or
//! slurmstepd. A caught panic is logged and answered with the callback's "harmless" return code.

use crate::api::{Log, SocketAgent};
use crate::callbacks::{self, FAIL, OK};
use crate::handle::{SlurmLog, Spank};
use crate::sys;
use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_int};
use std::panic::{self, AssertUnwindSafe};

/// Slurm's plugin loader checks these three symbols (`plugin_name`, `plugin_type`, `plugin_version`,
/// as in `SPANK_PLUGIN(sluice, 1)` of spank.h). They are char arrays and an unsigned int in C, so
/// they are exported as such, not as pointers.
#[unsafe(no_mangle)]
pub static plugin_name: [u8; 7] = *b"sluice\0";
#[unsafe(no_mangle)]
pub static plugin_type: [u8; 6] = *b"spank\0";
/// Must equal the major.minor of the Slurm that loads the plugin; taken from the headers at build time.
#[unsafe(no_mangle)]
pub static plugin_version: u32 = sys::SLURM_VERSION_NUMBER;

/// Slurm 25.05 and later read this to decide what a failing `slurm_spank_init` fails: the job, not
/// the node. sluice's init never fails (it returns 0, even after a panic: `on_panic = OK` below),
/// so this is the rule should that ever change: a plugin's failure must not drain nodes. Built only
/// against headers that have the constant (older Slurm has no such symbol and drains).
#[cfg(spank_init_failure_mode)]
#[unsafe(no_mangle)]
pub static slurm_spank_init_failure_mode: c_int = sys::ESPANK_JOB_FAILURE as c_int;

thread_local! {
    /// Every `--stage-in` value seen by the option callback in this process (sbatch/srun/salloc),
    /// read by `init_post_opt`. Per process and single-threaded: Slurm calls both on one thread, and
    /// a thread-local needs no lock that a panic could poison.
    static STAGE_IN: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Runs one callback, turning a panic into `on_panic` and a line in Slurm's log.
fn trampoline(callback: &str, on_panic: c_int, f: impl FnOnce() -> c_int) -> c_int {
    catch_panic(&SlurmLog, callback, on_panic, f)
}

fn catch_panic(
    log: &impl Log,
    callback: &str,
    on_panic: c_int,
    f: impl FnOnce() -> c_int,
) -> c_int {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(rc) => rc,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            // Logging allocates; should even that panic, the process must still not abort.
            let _ = panic::catch_unwind(AssertUnwindSafe(|| {
                log.error(&format!(
                    "internal error in {callback}: {what} (please report this as a sluice bug)"
                ))
            }));
            on_panic
        }
    }
}

/// The plugin arguments from plugstack.conf.
///
/// # Safety
/// `argv` must hold `argc` valid NUL-terminated strings (as Slurm passes them to every callback).
unsafe fn plugin_args(argc: c_int, argv: *mut *mut c_char) -> Vec<String> {
    if argv.is_null() || argc <= 0 {
        return Vec::new();
    }
    (0..argc as usize)
        .filter_map(|i| {
            // SAFETY: i < argc, and the caller guarantees `argv` has `argc` entries.
            let arg = unsafe { *argv.add(i) };
            (!arg.is_null()).then(|| {
                // SAFETY: each non-null entry is a NUL-terminated string owned by Slurm for the call.
                unsafe { CStr::from_ptr(arg) }
                    .to_string_lossy()
                    .into_owned()
            })
        })
        .collect()
}

/// Defines one `slurm_spank_*` entry point, and checks at compile time that spank.h declares an
/// entry point of that name (a misspelt one would never be called) and that ours has exactly its
/// type, `spank_f`. Every entry point is defined here, so every one is checked, with no list to
/// keep in step.
macro_rules! spank_callback {
    ($(#[$doc:meta])* $name:ident, on_panic = $on_panic:expr, |$spank:ident, $args:ident| $body:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// Called by Slurm only, with the handle and arguments of the callback now running.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(sp: sys::spank_t, argc: c_int, argv: *mut *mut c_char) -> c_int {
            trampoline(stringify!($name), $on_panic, || {
                // SAFETY: Slurm passes the live handle of this callback and its plugin arguments;
                // neither escapes the callback.
                #[allow(unused_mut)]
                let (mut $spank, $args) = unsafe { (Spank::from_raw(sp), plugin_args(argc, argv)) };
                $body
            })
        }

        const _: [sys::spank_f; 2] = [Some(sys::$name), Some($name)];
    };
}

spank_callback!(
    /// Every context: registers the options.
    slurm_spank_init, on_panic = OK, |spank, args| callbacks::init(&mut spank, &args)
);

spank_callback!(
    /// After option parsing: validates and forwards `--stage-in` in sbatch/srun/salloc.
    slurm_spank_init_post_opt, on_panic = OK, |spank, _args| {
        STAGE_IN.with_borrow(|stage_in| callbacks::init_post_opt(&mut spank, stage_in))
    }
);

spank_callback!(
    /// job_script context, root, on each node: hands the job to the agent. Never fails.
    slurm_spank_job_prolog, on_panic = OK, |spank, args| callbacks::job_prolog(&spank, &SocketAgent, &args)
);

spank_callback!(
    /// In each task before exec: waits for staging, exports `SLUICE_*`. A failure fails the job only.
    slurm_spank_task_init, on_panic = FAIL, |spank, args| callbacks::task_init(&mut spank, &SocketAgent, &args)
);

spank_callback!(
    /// Remote context, as the batch step ends: prints the job's checkpoint summary. Never fails.
    slurm_spank_exit, on_panic = OK, |spank, args| callbacks::exit(&spank, &SocketAgent, &args)
);

spank_callback!(
    /// job_script context, root, on each node: reports the job's end. Never fails.
    slurm_spank_job_epilog, on_panic = OK, |spank, args| callbacks::job_epilog(&spank, &SocketAgent, &args)
);

/// The option callback registered for every option (`spank_opt_cb_f`); `val` says which option.
///
/// # Safety
/// Called by Slurm only; `optarg` is null or a NUL-terminated string valid for the call.
pub(crate) unsafe extern "C" fn option_callback(
    val: c_int,
    optarg: *const c_char,
    remote: c_int,
) -> c_int {
    trampoline("option callback", OK, || {
        let value = (!optarg.is_null()).then(|| {
            // SAFETY: non-null, and Slurm passes a NUL-terminated option argument valid for the call.
            unsafe { CStr::from_ptr(optarg) }
                .to_string_lossy()
                .into_owned()
        });
        STAGE_IN.with_borrow_mut(|stage_in| {
            callbacks::on_option(&SlurmLog, stage_in, val, value.as_deref(), remote != 0)
        })
    })
}

// The option callback must have exactly the type spank.h declares (the entry points are checked
// where `spank_callback!` defines them).
const _: sys::spank_opt_cb_f = Some(option_callback);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exported_identity_matches_what_slurm_checks() {
        assert_eq!(
            CStr::from_bytes_with_nul(&plugin_name)
                .unwrap()
                .to_str()
                .unwrap(),
            crate::PLUGIN_NAME
        );
        assert_eq!(
            CStr::from_bytes_with_nul(&plugin_type)
                .unwrap()
                .to_str()
                .unwrap(),
            "spank"
        );
        let header = std::fs::read_to_string(
            std::path::Path::new(
                &std::env::var("SLURM_INCLUDE_DIR").unwrap_or("/usr/include".into()),
            )
            .join("slurm/slurm_version.h"),
        )
        .unwrap();
        assert!(
            header.contains(&format!("#define SLURM_VERSION_NUMBER {plugin_version:#x}")),
            "{plugin_version:#x}"
        );
    }

    #[derive(Default)]
    struct Lines(RefCell<Vec<String>>);

    impl Log for Lines {
        fn report(&self, _: &str) {}
        fn error(&self, msg: &str) {
            self.0.borrow_mut().push(msg.to_string());
        }
        fn info(&self, _: &str) {}
        fn verbose(&self, _: &str) {}
        fn debug(&self, _: &str) {}
    }

    #[test]
    fn a_panic_becomes_the_given_code_and_a_log_line() {
        let log = Lines::default();
        assert_eq!(catch_panic(&log, "slurm_spank_task_init", FAIL, || 7), 7);
        assert!(log.0.borrow().is_empty());
        assert_eq!(
            catch_panic(&log, "slurm_spank_task_init", FAIL, || panic!("boom {}", 1)),
            FAIL
        );
        assert_eq!(
            catch_panic(&log, "slurm_spank_job_prolog", OK, || panic!("static")),
            OK
        );
        let lines = log.0.borrow();
        assert_eq!(lines.len(), 2);
        assert!(
            lines[0].contains("internal error in slurm_spank_task_init: boom 1"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("slurm_spank_job_prolog: static"),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn plugin_args_reads_argv() {
        let owned = [
            c"socket=/x/%n.sock".to_owned(),
            c"stage_timeout=5".to_owned(),
        ];
        let mut ptrs: Vec<*mut c_char> = owned.iter().map(|s| s.as_ptr().cast_mut()).collect();
        // SAFETY: two valid NUL-terminated strings that outlive the call.
        let args = unsafe { plugin_args(2, ptrs.as_mut_ptr()) };
        assert_eq!(args, ["socket=/x/%n.sock", "stage_timeout=5"]);
        // SAFETY: argc 0 reads nothing.
        assert!(unsafe { plugin_args(0, ptr_null()) }.is_empty());
    }

    fn ptr_null() -> *mut *mut c_char {
        std::ptr::null_mut()
    }
}
