//! Running one measured command: wall time, and the CPU seconds (user + system) of its whole process
//! tree, from the rusage `wait` reports for terminated children (`RUSAGE_CHILDREN`, before/after:
//! the orchestrator runs one measured command at a time and waits for nothing else meanwhile).

use anyhow::{Result, bail};
use serde::Serialize;
use sluice_e2e::procfs;
use std::fmt::Display;
use std::process::{Command, Output, Stdio};
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub wall_s: f64,
    /// User + system CPU seconds of the command and its children.
    pub cpu_s: f64,
    #[serde(skip)]
    pub stdout: String,
    /// What the case adds: stored bytes, the driver's JSON, ...
    pub extra: serde_json::Value,
}

fn children_cpu() -> f64 {
    // SAFETY: rusage is plain integers and timevals, for which all-zero bytes are a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct we pass, which lives for the call.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// CPU seconds (user + system, all threads, plus children it waited for) process `pid` has used
/// so far, from `/proc/PID/stat`: what a server (Garage, Azurite) or an agent spent.
pub fn process_cpu_s(pid: u32) -> Result<f64> {
    procfs::cpu_s(pid).map_err(|e| anyhow::anyhow!("process {pid}: {e}"))
}

/// CPU seconds (user + system) each thread of process `pid` has used so far, by thread id, from
/// `/proc/PID/task/TID/stat`: the busiest thread tells a server held back by one thread (Azurite's
/// JavaScript event loop) from one short of cores.
pub fn thread_cpu_s(pid: u32) -> std::collections::HashMap<u32, f64> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Default::default();
    };
    tasks
        .filter_map(|t| {
            let tid: u32 = t.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
            // utime and stime only: a thread's cutime and cstime are its process's.
            Some((tid, procfs::stat_cpu_s(&stat, 2)?))
        })
        .collect()
}

/// Flushes dirty pages so one run's writeback does not land in the next one's time (untimed).
pub fn sync() {
    // SAFETY: sync(2) has no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// Runs `cmd` to completion and measures it; a non-zero exit is an error carrying stderr's tail.
pub fn measure(cmd: &mut Command) -> Result<Sample> {
    let before = children_cpu();
    let t = Instant::now();
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()?;
    let wall_s = t.elapsed().as_secs_f64();
    let cpu_s = children_cpu() - before;
    ensure_success(format_args!("{:?}", cmd.get_program()), &out, 8, " | ")?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let extra = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .unwrap_or(serde_json::Value::Null);
    Ok(Sample {
        wall_s,
        cpu_s,
        stdout,
        extra,
    })
}

/// Runs each of `cases` cases `reps` times, `run(case, rep)`, every repetition starting one case
/// later than the one before, so that no case always runs first (after whatever the case before
/// it left); returns the results case by case, in the order of their repetitions.
pub fn interleaved<T>(
    cases: usize,
    reps: usize,
    mut run: impl FnMut(usize, usize) -> Result<T>,
) -> Result<Vec<Vec<T>>> {
    let mut out: Vec<Vec<T>> = (0..cases).map(|_| Vec::new()).collect();
    for rep in 0..reps {
        for k in 0..cases {
            let i = (k + rep) % cases;
            out[i].push(run(i, rep)?);
        }
    }
    Ok(out)
}

/// An error unless `out` exited 0, naming `what` (the program), its exit status and the last
/// `lines` lines of its stderr joined by `sep`.
pub fn ensure_success(what: impl Display, out: &Output, lines: usize, sep: &str) -> Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "{what} failed ({}): {}",
        out.status,
        stderr_tail(&out.stderr, lines, sep)
    )
}

/// The last `n` lines of a command's stderr, joined by `sep`: what a failure message quotes.
fn stderr_tail(stderr: &[u8], n: usize, sep: &str) -> String {
    let err = String::from_utf8_lossy(stderr);
    let tail: Vec<&str> = err.lines().rev().take(n).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join(sep)
}

/// Runs an unmeasured helper command (setup, cleanup); errors carry stderr's tail.
pub fn run_quiet(cmd: &mut Command) -> Result<String> {
    Ok(measure(cmd)?.stdout)
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}
