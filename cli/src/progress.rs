//! How far `sluice ckpt restore|verify` are, on stderr, from the archive engine's live counters
//! ([`ArchiveProgress`], which the engine updates and this module polls).
//!
//! On a terminal a bar (indicatif: redraws, terminal width, rate and ETA estimates) — bytes and
//! files done of their totals, rate, time left — replaced at the end by one final line. Elsewhere
//! (a job's output file, a pipe, `TERM=dumb`) plain lines, at most one every [`LINE_EVERY`] plus
//! the final one, so a log gets a readable trace instead of escape codes. `--quiet`: nothing.
//! Stdout (the result, `--json`) is never touched.

use crate::render::{bytes, duration_ms};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};
use sluice_archive::access::{Reading, Watch};
use sluice_archive::{ArchiveProgress, ProgressSnapshot};
use std::fmt::Write;
use std::time::{Duration, Instant};

/// The least time between two plain progress lines.
pub const LINE_EVERY: Duration = Duration::from_secs(5);
/// How often the counters are read.
const POLL_BAR: Duration = Duration::from_millis(100);
const POLL_LINES: Duration = Duration::from_millis(500);

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A bar redrawn in place (stderr is a terminal that can draw one).
    Bar,
    /// Plain lines, now and then.
    Lines,
    /// Nothing (`--quiet`).
    Off,
}

impl Mode {
    /// The mode for this process's stderr: a bar where indicatif would draw one (a terminal,
    /// `TERM` set and not `dumb`), plain lines elsewhere, nothing with `--quiet`.
    pub fn for_stderr(quiet: bool) -> Mode {
        Mode::choose(quiet, !ProgressDrawTarget::stderr().is_hidden())
    }

    pub fn choose(quiet: bool, can_draw_bar: bool) -> Mode {
        match (quiet, can_draw_bar) {
            (true, _) => Mode::Off,
            (false, true) => Mode::Bar,
            (false, false) => Mode::Lines,
        }
    }
}

/// Drives `work` to its end while showing `progress` under `label` (`restore step-3`) as `mode`
/// says, then the final line; `finished` tells an outcome that went through everything (success,
/// or a verify that found damage) from one that stopped short.
pub async fn show<F: Future>(
    mode: Mode,
    label: &str,
    progress: &ArchiveProgress,
    finished: impl Fn(&F::Output) -> bool,
    work: F,
) -> F::Output {
    let started = Instant::now();
    let out = match mode {
        Mode::Off => return work.await,
        Mode::Bar => with_bar(label, progress, work).await,
        Mode::Lines => {
            let mut lines = Lines::new(label, LINE_EVERY, started);
            poll(work, POLL_LINES, || {
                if let Some(line) = lines.tick(Instant::now(), &progress.snapshot()) {
                    eprintln!("{line}");
                }
            })
            .await
        }
    };
    let end = final_line(
        label,
        &progress.snapshot(),
        started.elapsed(),
        finished(&out),
    );
    if let Some(line) = end {
        eprintln!("{line}");
    }
    out
}

/// The archive-access module's [`Watch`]: its verifies and restores shown as `mode` says, its
/// notes on stderr through `note`.
pub struct Shown<N> {
    mode: Mode,
    note: N,
}

impl<N: FnMut(&str)> Shown<N> {
    pub fn new(mode: Mode, note: N) -> Shown<N> {
        Shown { mode, note }
    }
}

impl<N: FnMut(&str)> Watch for Shown<N> {
    async fn watch<F: Future>(&mut self, what: Reading<'_, F::Output>, work: F) -> F::Output {
        show(self.mode, &what.label, what.counters, what.finished, work).await
    }

    fn note(&mut self, text: &str) {
        (self.note)(text)
    }
}

/// Awaits `work`, calling `each` every `period` meanwhile.
async fn poll<F: Future>(work: F, period: Duration, mut each: impl FnMut()) -> F::Output {
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tick.tick() => each(),
        }
    }
}

/// The bar appears once the totals are known (an empty `0 B of 0 B` bar says nothing), and is
/// cleared at the end for the final line.
async fn with_bar<F: Future>(label: &str, progress: &ArchiveProgress, work: F) -> F::Output {
    let mut bar: Option<ProgressBar> = None;
    let out = poll(work, POLL_BAR, || {
        let p = progress.snapshot();
        if !known(&p) {
            return;
        }
        let bar = bar.get_or_insert_with(|| {
            let bar =
                ProgressBar::with_draw_target(Some(p.bytes_total), ProgressDrawTarget::stderr());
            bar.set_style(bar_style());
            bar.set_prefix(label.to_string());
            bar
        });
        bar.set_length(p.bytes_total);
        bar.set_message(format!("{} of {} files", p.files_done, p.files_total));
        bar.set_position(p.bytes_done);
    })
    .await;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    out
}

/// `restore step-3 [=====>      ] 1.2 GiB of 4.0 GiB, 12 of 40 files, 310 MiB/s, 9s left`, sizes
/// written as the rest of sluice writes them.
fn bar_style() -> ProgressStyle {
    let size = |n: u64, w: &mut dyn Write| {
        let _ = w.write_str(&bytes(n));
    };
    ProgressStyle::with_template(
        "{prefix} [{wide_bar}] {done} of {total}, {msg}, {rate}, {eta} left",
    )
    .expect("a valid template")
    .progress_chars("=> ")
    .with_key("done", move |s: &ProgressState, w: &mut dyn Write| {
        size(s.pos(), w)
    })
    .with_key("total", move |s: &ProgressState, w: &mut dyn Write| {
        size(s.len().unwrap_or(0), w)
    })
    .with_key("rate", |s: &ProgressState, w: &mut dyn Write| {
        let _ = w.write_str(&rate(s.per_sec()));
    })
}

/// The plain lines: when one is due, and what it says.
pub struct Lines {
    label: String,
    every: Duration,
    /// When the last line was printed (or the start), and the bytes done then: the rate of the
    /// next line is the rate since.
    last: (Instant, u64),
}

impl Lines {
    pub fn new(label: &str, every: Duration, now: Instant) -> Lines {
        Lines {
            label: label.to_string(),
            every,
            last: (now, 0),
        }
    }

    /// The line to print at `now`, if one is due: `every` after the last one, and only once the
    /// totals are known (the MANIFEST is read).
    pub fn tick(&mut self, now: Instant, p: &ProgressSnapshot) -> Option<String> {
        let (at, bytes_then) = self.last;
        let since = now.saturating_duration_since(at);
        if since < self.every || !known(p) {
            return None;
        }
        self.last = (now, p.bytes_done);
        let per_sec = p.bytes_done.saturating_sub(bytes_then) as f64 / since.as_secs_f64();
        let mut line = counts(&self.label, p, per_sec);
        if per_sec > 0.0 && p.bytes_total > p.bytes_done {
            let left = (p.bytes_total - p.bytes_done) as f64 / per_sec;
            let left = Duration::try_from_secs_f64(left).unwrap_or(Duration::MAX);
            let _ = write!(line, ", {} left", duration_ms(saturating_ms(left)));
        }
        Some(line)
    }
}

/// The last line, on any terminal or none: `restore step-3: 4.0 GiB of 4.0 GiB, 40 of 40 files,
/// 310 MiB/s, done in 13.2s` (the rate over the whole run), or `stopped after` when the work ended
/// short. Nothing for work that ended before its MANIFEST was read (its error says why).
pub fn final_line(
    label: &str,
    p: &ProgressSnapshot,
    elapsed: Duration,
    finished: bool,
) -> Option<String> {
    if !finished && !known(p) {
        return None;
    }
    let secs = elapsed.as_secs_f64();
    let per_sec = if secs > 0.0 {
        p.bytes_done as f64 / secs
    } else {
        0.0
    };
    let how = if finished { "done in" } else { "stopped after" };
    Some(format!(
        "{}, {how} {}",
        counts(label, p, per_sec),
        duration_ms(saturating_ms(elapsed))
    ))
}

/// Whether the totals are set: the engine read the MANIFEST.
fn known(p: &ProgressSnapshot) -> bool {
    p.files_total > 0 || p.bytes_total > 0
}

/// `restore step-3: 1.2 GiB of 4.0 GiB, 12 of 40 files, 310 MiB/s`.
fn counts(label: &str, p: &ProgressSnapshot, per_sec: f64) -> String {
    format!(
        "{label}: {} of {}, {} of {} files, {}",
        bytes(p.bytes_done),
        bytes(p.bytes_total),
        p.files_done,
        p.files_total,
        rate(per_sec)
    )
}

fn rate(per_sec: f64) -> String {
    format!("{}/s", bytes(per_sec.max(0.0) as u64))
}

fn saturating_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    fn snap(files_done: u64, bytes_done: u64) -> ProgressSnapshot {
        ProgressSnapshot {
            files_done,
            files_total: 40,
            bytes_done,
            bytes_total: 4 * GIB,
            stored_bytes: 0,
        }
    }

    #[test]
    fn the_mode_follows_quiet_then_the_terminal() {
        assert_eq!(Mode::choose(true, true), Mode::Off);
        assert_eq!(Mode::choose(true, false), Mode::Off);
        assert_eq!(Mode::choose(false, true), Mode::Bar);
        assert_eq!(Mode::choose(false, false), Mode::Lines);
    }

    #[test]
    fn plain_lines_come_at_most_every_interval_with_the_rate_since_the_last() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Nothing before the totals are known, nor before the interval is up.
        let mut l = Lines::new("restore step-3", Duration::from_secs(5), t0);
        assert_eq!(l.tick(at(6_000), &ProgressSnapshot::default()), None);
        let mut l = Lines::new("restore step-3", Duration::from_secs(5), t0);
        assert_eq!(l.tick(at(500), &snap(1, 100 * MIB)), None);
        assert_eq!(l.tick(at(4_999), &snap(2, 200 * MIB)), None);
        // 1.2 GiB in 4 s: 307 MiB/s, and 2.8 GiB left at that rate.
        let done = 1229 * MIB;
        let mut l = Lines::new("restore step-3", Duration::from_secs(4), t0);
        assert_eq!(
            l.tick(at(4_000), &snap(12, done)).as_deref(),
            Some("restore step-3: 1.2 GiB of 4.0 GiB, 12 of 40 files, 307.2 MiB/s, 9.3s left")
        );
        // The next one only a whole interval later, with the rate of that interval.
        assert_eq!(l.tick(at(7_999), &snap(20, done + 100 * MIB)), None);
        assert_eq!(
            l.tick(at(8_000), &snap(20, done + 100 * MIB)).as_deref(),
            Some("restore step-3: 1.3 GiB of 4.0 GiB, 20 of 40 files, 25.0 MiB/s, 1m50s left")
        );
        // Stalled: no time left to tell.
        assert_eq!(
            l.tick(at(12_000), &snap(20, done + 100 * MIB)).as_deref(),
            Some("restore step-3: 1.3 GiB of 4.0 GiB, 20 of 40 files, 0 B/s")
        );
    }

    #[test]
    fn the_final_line_says_how_it_ended() {
        let all = snap(40, 4 * GIB);
        assert_eq!(
            final_line("verify step-3", &all, Duration::from_secs(16), true).as_deref(),
            Some("verify step-3: 4.0 GiB of 4.0 GiB, 40 of 40 files, 256.0 MiB/s, done in 16.0s")
        );
        assert_eq!(
            final_line(
                "restore step-3",
                &snap(3, GIB),
                Duration::from_secs(2),
                false
            )
            .as_deref(),
            Some(
                "restore step-3: 1.0 GiB of 4.0 GiB, 3 of 40 files, 512.0 MiB/s, stopped after 2.0s"
            )
        );
        // Failed before the MANIFEST was read: the error says it all.
        let none = ProgressSnapshot::default();
        assert_eq!(final_line("restore x", &none, Duration::ZERO, false), None);
        // An empty checkpoint restored is still said to be done.
        assert_eq!(
            final_line("restore x", &none, Duration::ZERO, true).as_deref(),
            Some("restore x: 0 B of 0 B, 0 of 0 files, 0 B/s, done in 0ms")
        );
    }

    #[test]
    fn the_bar_template_is_valid() {
        let bar = ProgressBar::hidden();
        bar.set_style(bar_style());
        bar.set_length(10);
        bar.set_position(5);
    }
}
