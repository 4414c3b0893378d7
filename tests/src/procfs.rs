//! What `/proc` says of a process the tests and the bench watch (an agent, Garage): the CPU time
//! it spent and its peak resident memory. One reading of these files for the bench's cases and the
//! agent fleet ([`crate::fleet`]).

use std::io;
use std::process::Command;
use std::sync::OnceLock;

/// Clock ticks per second of `/proc/PID/stat`'s times (`getconf CLK_TCK`: 100 on Linux).
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|t: &f64| *t > 0.0)
            .unwrap_or(100.0)
    })
}

/// The sum of `n` CPU-time fields of a `/proc/.../stat` line from utime (field 14) on, in seconds:
/// 2 for utime and stime, 4 with cutime and cstime.
pub fn stat_cpu_s(stat: &str, n: usize) -> Option<f64> {
    // Fields after the command's closing parenthesis: state is field 3, utime 14 .. cstime 17.
    let rest = stat.rsplit_once(") ")?.1;
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(n)
        .filter_map(|v| v.parse().ok())
        .collect();
    (f.len() == n).then(|| f.iter().sum::<f64>() / clock_ticks())
}

/// CPU seconds (user + system, all threads, plus children it waited for) process `pid` has used
/// so far, from `/proc/PID/stat`.
pub fn cpu_s(pid: u32) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    stat_cpu_s(&stat, 4).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("cannot read /proc/{pid}/stat: {stat:?}"),
        )
    })
}

/// The peak resident memory of process `pid` (`VmHWM` of `/proc/PID/status`), KiB.
pub fn vm_hwm_kib(pid: u32) -> io::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("no VmHWM in /proc/{pid}/status"),
            )
        })
}

/// Resets process `pid`'s peak resident memory to its current one (`clear_refs` ← 5, Linux
/// 4.0 and later), so that a later [`vm_hwm_kib`] is the peak since now.
pub fn reset_hwm(pid: u32) -> io::Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
}

#[cfg(test)]
#[test]
fn this_process_has_spent_cpu_and_has_a_peak() {
    let me = std::process::id();
    let spin = std::time::Instant::now();
    while spin.elapsed() < std::time::Duration::from_millis(50) {
        std::hint::black_box(spin.elapsed());
    }
    assert!(cpu_s(me).unwrap() > 0.0);
    assert!(vm_hwm_kib(me).unwrap() > 0);
    let stat = "1 (a b) c) S 0 0 0 0 0 0 0 0 0 0 300 200 100 50 20 0";
    assert_eq!(stat_cpu_s(stat, 2), Some(500.0 / clock_ticks()));
    assert_eq!(stat_cpu_s(stat, 4), Some(650.0 / clock_ticks()));
}
