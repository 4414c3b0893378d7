//! Human-readable output: pure functions from the agent's structs to text.
//!
//! Nothing here does I/O or reads the clock (the caller passes `now`), so every view is unit-tested
//! exactly as a user sees it. Scripts should use `--json`; this layout may change.
//!
//! Strings from the agent (user names, sources, error messages from object stores) are printed
//! through [`clean`], so a control character in them cannot garble the table or the terminal.

use crate::ckpt::{DestCheck, RestorePlan, Restored, Verified};
use sluice_archive::store::is_offline_class;
use sluice_archive::{CheckpointInfo, CheckpointState};
use sluice_proto::msg::{
    CacheEntry, CacheEvicted, CacheListing, CacheStats, CacheWarmed, CkptPoisoned, CkptState,
    CkptStatus, JobId, JobStatus, NodeStatus, NodeWarmed, StageProgress, WorkerStatus,
};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Longest DATASETS cell in the status table; the detail view shows every name.
const MAX_DATASETS_CELL: usize = 32;
/// Longest NODES cell in an archive listing; `--json` lists every node.
const MAX_NODES_CELL: usize = 32;
/// Nodes listed by name in the job view before the rest are counted.
const MAX_NODES_SHOWN: usize = 16;

pub use sluice_proto::summary::bytes;

/// A transfer rate; `-` when nothing has moved yet.
pub fn rate(bytes_per_sec: u64) -> String {
    if bytes_per_sec == 0 {
        "-".to_string()
    } else {
        format!("{}/s", bytes(bytes_per_sec))
    }
}

/// A compact duration: `850ms`, `12.3s`, `4m05s`, `1h02m03s`, `2d03h04m`.
pub fn duration_ms(ms: u64) -> String {
    let s = ms / 1000;
    let (m, h, d) = (s / 60, s / 3600, s / 86_400);
    match ms {
        0..1_000 => format!("{ms}ms"),
        1_000..60_000 => format!("{}.{}s", s, (ms % 1000) / 100),
        60_000..3_600_000 => format!("{m}m{:02}s", s % 60),
        3_600_000..86_400_000 => format!("{h}h{:02}m{:02}s", m % 60, s % 60),
        _ => format!("{d}d{:02}h{:02}m", h % 24, m % 60),
    }
}

/// A compression ratio (raw bytes per stored byte): `1.46x`; `-` when there is none.
pub fn ratio(r: Option<f64>) -> String {
    match r {
        Some(r) if r.is_finite() => format!("{r:.2}x"),
        _ => "-".to_string(),
    }
}

/// Raw / stored, when something is stored.
pub fn ratio_of(raw: u64, stored: u64) -> Option<f64> {
    (stored > 0).then(|| raw as f64 / stored as f64)
}

/// A UTC timestamp to the second from Unix seconds; `-` for 0 (not known).
pub fn timestamp(secs: u64) -> String {
    if secs == 0 {
        return "-".to_string();
    }
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs)).to_string()
}

/// `done/total`, with `?` for a total not known yet (listing still running).
fn fraction(done: u64, total: Option<u64>, unit: impl Fn(u64) -> String) -> String {
    match total {
        Some(total) => format!("{}/{}", unit(done), unit(total)),
        None => format!("{}/?", unit(done)),
    }
}

/// ` (79%)` when the total is known and non-zero.
fn percent(done: u64, total: Option<u64>) -> String {
    match total {
        Some(total) if total > 0 => format!(
            " ({}%)",
            (u128::from(done) * 100 / u128::from(total)).min(100)
        ),
        _ => String::new(),
    }
}

/// One line of printable text: control characters (newlines included) become spaces.
pub fn clean(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// Cuts `s` to at most `max` characters, marking the cut with `…`.
fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Left-aligned columns separated by two spaces; the last column is not padded.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let width = |cell: &str| cell.chars().count();
    let mut widths: Vec<usize> = header.iter().map(|h| width(h)).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(width(cell));
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            line.extend(std::iter::repeat_n(' ', w - width(cell)));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// All of a job's datasets on this node taken together.
struct Totals {
    files_done: u64,
    files_total: Option<u64>,
    bytes_done: u64,
    bytes_total: Option<u64>,
    rate_bps: u64,
}

impl Totals {
    fn of(stages: &[StageProgress]) -> Totals {
        let sum = |field: fn(&StageProgress) -> u64| {
            stages.iter().fold(0u64, |a, s| a.saturating_add(field(s)))
        };
        // `None` as soon as one dataset's total is unknown.
        let total = |field: fn(&StageProgress) -> Option<u64>| {
            stages
                .iter()
                .try_fold(0u64, |a, s| Some(a.saturating_add(field(s)?)))
        };
        let bytes_done = sum(|s| s.bytes_done);
        // Datasets stage concurrently, so the job's wall time is the longest dataset's.
        let elapsed_ms = stages.iter().map(|s| s.elapsed_ms).max().unwrap_or(0);
        let rate_bps = (u128::from(bytes_done) * 1000)
            .checked_div(u128::from(elapsed_ms))
            .map_or(0, |r| u64::try_from(r).unwrap_or(u64::MAX));
        Totals {
            files_done: sum(|s| s.files_done),
            files_total: total(|s| s.files_total),
            bytes_done,
            bytes_total: total(|s| s.bytes_total),
            rate_bps,
        }
    }
}

fn progress_cell(stages: &[StageProgress]) -> String {
    if stages.is_empty() {
        return "-".to_string();
    }
    let t = Totals::of(stages);
    format!(
        "{} files, {}, {}",
        fraction(t.files_done, t.files_total, |n| n.to_string()),
        fraction(t.bytes_done, t.bytes_total, bytes),
        rate(t.rate_bps)
    )
}

/// The job's own error, else the first dataset's.
fn error_cell(job: &JobStatus) -> String {
    if let Some(e) = &job.error {
        return clean(e);
    }
    match job
        .stages
        .iter()
        .find_map(|s| Some((&s.name, s.error.as_ref()?)))
    {
        Some((name, e)) => clean(&format!("{name}: {e}")),
        None => "-".to_string(),
    }
}

/// `sluice status`: the node, its hot tier, a table of the jobs the caller may see, and one of the
/// agent's background workers (how long each has been in its state says whether one is stuck).
/// `now` dates the workers' states.
pub fn node_status(status: &NodeStatus, now: SystemTime) -> String {
    let free_pct = percent(status.hot_free_bytes, Some(status.hot_total_bytes));
    let mut out = format!(
        "node      {}\n\
         agent     sluiced {}\n\
         hot tier  {}\n  \
           size    {}\n  \
           free    {}{free_pct}\n  \
           used    {} by sluice jobs\n",
        clean(&status.node),
        clean(&status.agent_version),
        clean(&status.hot_root),
        bytes(status.hot_total_bytes),
        bytes(status.hot_free_bytes),
        bytes(status.hot_used_bytes),
    );
    if let Some(cache) = &status.cache {
        out.push_str(&status_cache(cache));
    }
    out.push('\n');
    out.push_str(&status_jobs(&status.jobs));
    if !status.workers.is_empty() {
        out.push('\n');
        out.push_str(&status_workers(&status.workers, now));
    }
    out
}

/// `sluice status`'s table of jobs.
fn status_jobs(jobs: &[JobStatus]) -> String {
    if jobs.is_empty() {
        return "No sluice jobs on this node that you may see.\n".to_string();
    }
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|job| {
            let names: Vec<&str> = job.stages.iter().map(|s| s.name.as_str()).collect();
            let datasets = if names.is_empty() {
                "-".to_string()
            } else {
                clean(&names.join(","))
            };
            vec![
                job.job_id.to_string(),
                clean(&job.user),
                job.state.as_str().to_string(),
                truncate(&datasets, MAX_DATASETS_CELL),
                progress_cell(&job.stages),
                error_cell(job),
            ]
        })
        .collect();
    table(
        &["JOBID", "USER", "STATE", "DATASETS", "PROGRESS", "ERROR"],
        &rows,
    )
}

/// `sluice status`'s table of the agent's background workers: what each does, for how long, how
/// many turns of its loop it made, and the error of its last turn.
fn status_workers(workers: &[WorkerStatus], now: SystemTime) -> String {
    let rows: Vec<Vec<String>> = workers
        .iter()
        .map(|w| {
            vec![
                clean(&w.name),
                clean(&w.state),
                in_state(w.since, now),
                w.turns.to_string(),
                w.last_error.as_deref().map_or("-".to_string(), clean),
            ]
        })
        .collect();
    table(&["WORKER", "STATE", "FOR", "TURNS", "LAST ERROR"], &rows)
}

/// How long since `since` (Unix seconds): `-` when not known, or when the agent's clock is ahead.
fn in_state(since: u64, now: SystemTime) -> String {
    let at = UNIX_EPOCH + Duration::from_secs(since);
    match now.duration_since(at) {
        Ok(d) if since > 0 => match d.as_secs() {
            0 => "<1s".to_string(),
            secs => duration_ms(secs.saturating_mul(1000)),
        },
        _ => "-".to_string(),
    }
}

/// `sluice status`'s lines on the cross-job cache: how full it is, how often it hits, what it saved
/// and what it had to give up.
fn status_cache(c: &CacheStats) -> String {
    format!(
        "cache     {}\n  \
           used    {} of {}{}, {}\n  \
           hits    {}\n  \
           served  {} from the cache (not read from the origin again)\n  \
           evicted {}, {}\n",
        clean(&c.root),
        bytes(c.used_bytes),
        bytes(c.capacity_bytes),
        percent(c.used_bytes, Some(c.capacity_bytes)),
        entries(c.entries),
        lookups(c),
        bytes(c.hit_bytes),
        entries(c.evictions),
        bytes(c.evicted_bytes),
    )
}

fn started(started_at: u64, now: SystemTime) -> String {
    if started_at == 0 {
        return "unknown".to_string();
    }
    let at = UNIX_EPOCH + Duration::from_secs(started_at);
    let stamp = humantime::format_rfc3339_seconds(at);
    match now.duration_since(at) {
        Ok(ago) => format!(
            "{stamp} ({} ago)",
            duration_ms(u64::try_from(ago.as_millis()).unwrap_or(u64::MAX))
        ),
        // The agent's clock is ahead of ours; the timestamp alone is still right.
        Err(_) => stamp.to_string(),
    }
}

fn node_list(nodes: &[String]) -> String {
    if nodes.is_empty() {
        return "-".to_string();
    }
    let shown: Vec<String> = nodes
        .iter()
        .take(MAX_NODES_SHOWN)
        .map(|n| clean(n))
        .collect();
    let mut list = shown.join(", ");
    if nodes.len() > MAX_NODES_SHOWN {
        list.push_str(&format!(
            ", … ({} more; --json lists all)",
            nodes.len() - MAX_NODES_SHOWN
        ));
    }
    format!("{list} ({} in all)", nodes.len())
}

/// `sluice job JOBID`: one job on this node, with every dataset. `now` dates the job's start.
pub fn job_detail(job: &JobStatus, now: SystemTime) -> String {
    let mut out = format!(
        "job {}  {}\n  \
           user       {} (uid {})\n  \
           started    {}\n  \
           node       {}\n  \
           nodes      {}\n  \
           stage dir  {}\n  \
           ckpt dir   {}\n",
        job.job_id,
        job.state.as_str(),
        clean(&job.user),
        job.uid,
        started(job.started_at, now),
        clean(&job.node),
        node_list(&job.nodes),
        clean(&job.dirs.stage_dir),
        clean(&job.dirs.ckpt_dir),
    );
    if let Some(e) = &job.error {
        out.push_str(&format!("  error      {}\n", clean(e)));
    }
    if job.stages.is_empty() {
        out.push_str("\nNo datasets to stage.\n");
        return out;
    }
    out.push_str(&format!("\ndatasets ({})\n", job.stages.len()));
    for s in &job.stages {
        out.push_str(&format!(
            "  {}  {}\n    \
               source   {}\n    \
               files    {}{}\n    \
               bytes    {}{}\n    \
               rate     {}\n    \
               elapsed  {}\n",
            clean(&s.name),
            s.state.as_str(),
            clean(&s.source),
            fraction(s.files_done, s.files_total, |n| n.to_string()),
            percent(s.files_done, s.files_total),
            fraction(s.bytes_done, s.bytes_total, bytes),
            percent(s.bytes_done, s.bytes_total),
            rate(s.rate_bps()),
            duration_ms(s.elapsed_ms),
        ));
        // Where the bytes came from, once the job's other nodes (peer transfers), this node's
        // cache or files kept across an agent restart supplied some: what this node read from the
        // origin itself is what the origin served it.
        if s.peer_bytes > 0 || s.cache_bytes > 0 || s.resumed_bytes > 0 {
            let mut from = format!("{} origin", bytes(s.origin_bytes));
            if s.peer_bytes > 0 {
                from.push_str(&format!(", {} peers", bytes(s.peer_bytes)));
            }
            if s.cache_bytes > 0 {
                from.push_str(&format!(", {} this node's cache", bytes(s.cache_bytes)));
            }
            if s.resumed_bytes > 0 {
                from.push_str(&format!(
                    ", {} kept from before the agent restarted",
                    bytes(s.resumed_bytes)
                ));
            }
            out.push_str(&format!("    from     {from}\n"));
        }
        if let Some(e) = &s.error {
            out.push_str(&format!("    error    {}\n", clean(e)));
        }
    }
    out
}

// ------------------------------------------------------------------------------------ checkpoints

/// `sluice ckpt commit`: what was committed, and where it is going when the agent said so.
pub fn committed(tag: &str, job_id: JobId, node: Option<&str>, url: Option<&str>) -> String {
    let node = node.map_or_else(|| "this node".to_string(), |n| format!("node {}", clean(n)));
    match url {
        Some(url) => format!(
            "committed {} (job {job_id}, {node}); archiving to {}\n",
            clean(tag),
            clean(url)
        ),
        None => format!("committed {} (job {job_id}, {node})\n", clean(tag)),
    }
}

/// States in which this node's agent knows a checkpoint's size.
fn ckpt_size_known(c: &CkptStatus) -> bool {
    matches!(c.state, CkptState::WaitingForNodes | CkptState::Archived)
        || c.raw_bytes > 0
        || c.stored_bytes > 0
}

/// Where a checkpoint's part of this node is: `ram` (the RAM tier; alone: not flushed yet),
/// `nvme` (the hot tier), both, then `+NODE` for each node holding a replica of it
/// (`[fast_tier] replicas`), or `-` (only in the archive, if STATE says archived).
fn location(c: &CkptStatus) -> String {
    let mut at: Vec<String> = Vec::new();
    if c.in_ram {
        at.push("ram".into());
    }
    if c.on_hot_tier {
        at.push("nvme".into());
    }
    if let Some(r) = c.replicas.as_ref().filter(|r| !r.freed) {
        at.extend(r.held_by.iter().map(|n| clean(n)));
    }
    if at.is_empty() {
        "-".into()
    } else {
        at.join("+")
    }
}

/// Where the checkpoint stands with its replicas: `protected` (every node's part is on as many
/// other nodes as asked), `1/1` (this node's part is; not yet known of the others'), `0/1`,
/// `freed` (archived: the replicas went), `-` (none asked or not flushed yet).
fn replicas(c: &CkptStatus) -> String {
    match &c.replicas {
        None => "-".into(),
        Some(r) if r.freed => "freed".into(),
        Some(r) if r.protected => "protected".into(),
        Some(r) if r.held_by.is_empty() && r.short.is_none() => "-".into(),
        Some(r) => format!("{}/{}", r.held_by.len(), r.wanted),
    }
}

/// Why fewer nodes than asked hold a replica of the checkpoint, while it is not archived.
fn replicas_short(c: &CkptStatus) -> Option<String> {
    let r = c
        .replicas
        .as_ref()
        .filter(|r| !r.freed && c.archived_at.is_none())?;
    let short = r.short.as_deref()?;
    Some(format!(
        "replicas: {} of {} ({})",
        r.held_by.len(),
        r.wanted,
        clean(short)
    ))
}

/// `sluice ckpt list` in a job: the job's checkpoints on this node, oldest commit first as the
/// agent sends them.
pub fn job_ckpts(job_id: JobId, ckpts: &[CkptStatus]) -> String {
    let url = ckpts
        .iter()
        .map(|c| c.archive_url.as_str())
        .find(|u| !u.is_empty());
    let mut out = match url {
        Some(url) => format!("job {job_id} on this node; archive {}\n", clean(url)),
        None => format!("job {job_id} on this node\n"),
    };
    if ckpts.is_empty() {
        out.push_str(
            "\nNo committed checkpoints yet (commit one with `sluice ckpt commit TAG`).\n",
        );
        return out;
    }
    // REPLICAS only for a job that has them (`[fast_tier] replicas`).
    let replicated = ckpts.iter().any(|c| c.replicas.is_some());
    let rows: Vec<Vec<String>> = ckpts
        .iter()
        .map(|c| {
            let known = ckpt_size_known(c);
            let size = |n: u64| if known { bytes(n) } else { "-".to_string() };
            let mut row = vec![clean(&c.tag), c.state.as_str().to_string(), location(c)];
            if replicated {
                row.push(replicas(c));
            }
            row.extend([
                size(c.raw_bytes),
                size(c.stored_bytes),
                ratio(ratio_of(c.raw_bytes, c.stored_bytes).filter(|_| known)),
                timestamp(c.committed_at),
                c.archived_at.map_or_else(|| "-".to_string(), timestamp),
                match (c.error.as_deref(), replicas_short(c)) {
                    (Some(e), _) => clean(e),
                    (None, Some(short)) => short,
                    (None, None) => "-".to_string(),
                },
            ]);
            row
        })
        .collect();
    let mut header = vec!["TAG", "STATE", "WHERE"];
    if replicated {
        header.push("REPLICAS");
    }
    header.extend(["SIZE", "STORED", "RATIO", "COMMITTED", "ARCHIVED", "ERROR"]);
    out.push('\n');
    out.push_str(&table(&header, &rows));
    out
}

/// `complete`, `partial` or `invalid`.
pub fn archive_state(state: &CheckpointState) -> &'static str {
    match state {
        CheckpointState::Complete => "complete",
        CheckpointState::Partial => "partial",
        CheckpointState::Invalid { .. } => "invalid",
    }
}

/// The storage classes of a checkpoint's data: `STANDARD_IA`, `Cool+default` (written with
/// different classes), `-` (no data objects).
fn data_classes(classes: &[String]) -> String {
    if classes.is_empty() {
        "-".to_string()
    } else {
        truncate(&clean(&classes.join("+")), MAX_NODES_CELL)
    }
}

/// `sluice ckpt list URL`: every tag of an archive, oldest first, with why an invalid one is and
/// which must come back from an offline storage class before it can be restored.
pub fn archive_ckpts(url: &str, list: &[CheckpointInfo]) -> String {
    let mut out = format!("archive {}\n\n", clean(url));
    if list.is_empty() {
        out.push_str("No checkpoints there.\n");
        return out;
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|c| {
            let invalid = matches!(c.state, CheckpointState::Invalid { .. });
            let dash = || "-".to_string();
            let nodes = if c.nodes.is_empty() {
                dash()
            } else {
                truncate(&clean(&c.nodes.join(",")), MAX_NODES_CELL)
            };
            vec![
                clean(&c.tag),
                if c.poison.is_some() {
                    "poisoned".to_string()
                } else {
                    archive_state(&c.state).to_string()
                },
                if invalid { dash() } else { c.files.to_string() },
                if invalid { dash() } else { bytes(c.raw_bytes) },
                if invalid {
                    dash()
                } else {
                    bytes(c.stored_bytes)
                },
                ratio(c.ratio),
                data_classes(&c.data_classes),
                timestamp(c.created_unix_ms / 1000),
                c.job.as_ref().map_or_else(dash, |j| j.job_id.to_string()),
                nodes,
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "TAG", "STATE", "FILES", "SIZE", "STORED", "RATIO", "CLASS", "CREATED", "JOB", "NODES",
        ],
        &rows,
    ));
    let partial = list.iter().any(|c| c.state == CheckpointState::Partial);
    let notes: Vec<String> = list
        .iter()
        .filter_map(|c| match &c.state {
            _ if c.poison.is_some() => c.poison.as_ref().map(|m| {
                format!(
                    "{}: poisoned ({}); latest passes over it, a restore needs --force\n",
                    clean(&c.tag),
                    clean(&sluice_archive::poison::describe(m))
                )
            }),
            CheckpointState::Invalid { reason } => Some(format!(
                "{}: unusable MANIFEST ({}); it is never restored\n",
                clean(&c.tag),
                clean(reason)
            )),
            _ => {
                let offline: Vec<&str> = c
                    .data_classes
                    .iter()
                    .map(String::as_str)
                    .filter(|k| is_offline_class(k))
                    .collect();
                (!offline.is_empty()).then(|| {
                    format!(
                        "{}: its data is in {}: have the store restore (rehydrate) it before \
                         `sluice ckpt restore` or --ckpt-restore can read it\n",
                        clean(&c.tag),
                        clean(&offline.join(", "))
                    )
                })
            }
        })
        .collect();
    if partial || !notes.is_empty() {
        out.push('\n');
    }
    if partial {
        out.push_str(
            "partial: no MANIFEST yet (still archiving, or an archive that failed); never restored\n",
        );
    }
    for n in notes {
        out.push_str(&n);
    }
    out
}

/// `sluice ckpt verify`: OK with what was checked, or DAMAGED with every damaged file.
pub fn verify(v: &Verified) -> String {
    let (tag, url) = (clean(&v.tag), clean(&v.url));
    if v.ok {
        return format!(
            "checkpoint {tag} at {url}: OK\n  \
               {} file(s), {} ({} stored, ratio {}) match the MANIFEST's checksums\n",
            v.files,
            bytes(v.raw_bytes),
            bytes(v.stored_bytes),
            ratio(ratio_of(v.raw_bytes, v.stored_bytes)),
        );
    }
    let mut out = format!(
        "checkpoint {tag} at {url}: DAMAGED, {} of {} file(s)\n",
        v.damaged.len(),
        v.files
    );
    for d in &v.damaged {
        out.push_str(&format!("  {}: {}\n", clean(&d.path), clean(&d.detail)));
    }
    out.push_str(&format!(
        "Do not restore it: restore an older checkpoint (sluice ckpt list {url}).\n"
    ));
    out
}

/// `sluice ckpt restore`: what is where now.
/// `sluice ckpt poison`: the mark now on the checkpoint (or the one it had already).
pub fn poisoned(p: &CkptPoisoned) -> String {
    let (tag, url) = (clean(&p.tag), clean(&p.url));
    let why = clean(&sluice_archive::poison::describe(&p.mark));
    if p.already {
        return format!(
            "checkpoint {tag} in {url} is poisoned already ({why}); the first mark stays\n"
        );
    }
    let mut out = format!("poisoned {tag} in {url}: {why}\n");
    if p.unpublished {
        out.push_str(
            "  it is not archived yet: the mark waits beside its MANIFEST, and no restore can take it before\n",
        );
    }
    out.push_str(&format!(
        "  --ckpt-restore=latest passes over it; to restore it anyway: --ckpt-restore={tag}! or sluice ckpt restore --force\n"
    ));
    out
}

pub fn restored(r: &Restored) -> String {
    format!(
        "restored {} from {} into {}: {} file(s), {}, checksums verified\n",
        clean(&r.tag),
        clean(&r.url),
        clean(&r.dest.display().to_string()),
        r.files,
        bytes(r.raw_bytes)
    )
}

/// `sluice ckpt restore --dry-run`: what a restore would take, and what it would make of DEST.
pub fn restore_plan(p: &RestorePlan) -> String {
    let dest = clean(&p.dest.display().to_string());
    let what = match &p.dest_check {
        DestCheck::Create => format!("{dest} does not exist: the restore would create it"),
        DestCheck::Empty => {
            format!("{dest} is an empty directory of yours: the restore would fill it")
        }
        DestCheck::Refused { reason } => format!("the restore would be refused: {}", clean(reason)),
    };
    format!(
        "dry run: would restore {} from {} into {dest}\n  \
           {} file(s), {} ({} to download)\n  \
           {what}\n\
         Nothing was written; checksums are checked as a restore reads the data.\n",
        clean(&p.tag),
        clean(&p.url),
        p.files,
        bytes(p.raw_bytes),
        bytes(p.stored_bytes),
    )
}

// ------------------------------------------------------------------------------------------ cache

/// `1 entry`, `3 entries`.
fn entries(n: u64) -> String {
    if n == 1 {
        "1 entry".to_string()
    } else {
        format!("{n} entries")
    }
}

/// Hits over lookups: `87.5%`; `-` before the first lookup.
fn hit_ratio(c: &CacheStats) -> String {
    c.hit_ratio()
        .map_or_else(|| "-".to_string(), |r| format!("{:.1}%", r * 100.0))
}

/// `87.5% of 8 lookups (7 hits, 1 miss)`, or that there was none yet.
fn lookups(c: &CacheStats) -> String {
    let lookups = c.hits.saturating_add(c.misses);
    if lookups == 0 {
        return "no lookups yet".to_string();
    }
    let misses = if c.misses == 1 { "miss" } else { "misses" };
    format!(
        "{} of {lookups} lookups ({} hits, {} {misses})",
        hit_ratio(c),
        c.hits,
        c.misses
    )
}

/// The one line that heads `sluice cache list`: where the cache is, how full, how useful.
fn cache_head(l: &CacheListing) -> String {
    let c = &l.stats;
    format!(
        "cache on {} ({}): {} of {}{}, {}; {}\n",
        clean(&l.node),
        clean(&c.root),
        bytes(c.used_bytes),
        bytes(c.capacity_bytes),
        percent(c.used_bytes, Some(c.capacity_bytes)),
        entries(c.entries),
        match c.hit_ratio() {
            Some(_) => format!("hit ratio {}", hit_ratio(c)),
            None => "no lookups yet".to_string(),
        },
    )
}

/// `sluice cache list [PREFIX]`: the entries as the agent sends them, least recently used (the
/// next to be evicted) first.
pub fn cache_list(l: &CacheListing, prefix: Option<&str>) -> String {
    let mut out = cache_head(l);
    out.push('\n');
    if l.entries.is_empty() {
        match prefix {
            Some(p) => out.push_str(&format!("No entries under {}.\n", clean(p))),
            None => out.push_str("The cache is empty.\n"),
        }
        return out;
    }
    let rows: Vec<Vec<String>> = l
        .entries
        .iter()
        .map(|e: &CacheEntry| {
            vec![
                clean(&e.url),
                bytes(e.size),
                timestamp(e.last_use),
                if e.in_use { "yes" } else { "no" }.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(&["URL", "SIZE", "LAST USE", "IN USE"], &rows));
    if l.left_out > 0 {
        out.push_str(&format!(
            "\n... and {} not shown (a prefix narrows the listing)\n",
            entries(l.left_out)
        ));
    }
    if let Some(p) = prefix {
        let size = l.entries.iter().fold(0u64, |a, e| a.saturating_add(e.size));
        out.push_str(&format!(
            "\n{} under {}, {}\n",
            entries(l.entries.len() as u64),
            clean(p),
            bytes(size)
        ));
    }
    if l.entries.iter().any(|e| e.in_use) {
        out.push_str(
            "\nIN USE yes: a job is reading it right now; it is not evicted until the job is done.\n",
        );
    }
    out
}

/// `sluice cache stats`: every counter, with what it means.
pub fn cache_stats(l: &CacheListing) -> String {
    let c = &l.stats;
    let of_capacity = |n: u64| format!("{}{}", bytes(n), percent(n, Some(c.capacity_bytes)));
    format!(
        "cache on {}\n  \
           root        {}\n  \
           capacity    {}\n  \
           high water  {}: filling past it evicts the least recently used entries\n  \
           low water   {}: eviction stops there\n  \
           used        {} in {}\n  \
           hits        {}\n  \
           misses      {}\n  \
           hit ratio   {}\n  \
           from cache  {} placed into jobs: bytes the origin did not serve again\n  \
           filled      {} written into new entries\n  \
           evictions   {}, {}\n",
        clean(&l.node),
        clean(&c.root),
        bytes(c.capacity_bytes),
        of_capacity(c.high_water_bytes),
        of_capacity(c.low_water_bytes),
        of_capacity(c.used_bytes),
        entries(c.entries),
        c.hits,
        c.misses,
        hit_ratio(c),
        bytes(c.hit_bytes),
        bytes(c.filled_bytes),
        entries(c.evictions),
        bytes(c.evicted_bytes),
    )
}

/// `sluice cache warm URL`: the dataset's objects, which of them were cached before (nothing read),
/// which were not (read from the origin into the cache), and which of those could not be cached
/// and why.
pub fn cache_warmed(w: &CacheWarmed) -> String {
    let mut out = format!(
        "warmed {} on {}: {} object(s), {}\n  \
           cached before  {} object(s), {} (nothing read)\n  \
           new            {} object(s), {}, read from the origin into the cache\n",
        clean(&w.url),
        clean(&w.node),
        w.files,
        bytes(w.bytes),
        w.cached_files,
        bytes(w.cached_bytes),
        w.filled_files,
        bytes(w.filled_bytes),
    );
    if !w.skipped.is_empty() {
        out.push_str(&format!(
            "  skipped        {} object(s), not cached (jobs read them from the origin):\n",
            w.skipped.len()
        ));
        for s in &w.skipped {
            out.push_str(&format!("    {}\n", clean(s)));
        }
    }
    out
}

/// `sluice cache warm URL --nodes LIST`: one row per node — its objects and bytes, how much of it
/// was read from the origin now and how much was cached before — then what each node skipped, and
/// the nodes that failed.
pub fn cache_warmed_nodes(url: &str, rows: &[NodeWarmed]) -> String {
    let dash = || "-".to_string();
    let table_rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| match &r.warmed {
            Some(w) => vec![
                clean(&r.node),
                w.files.to_string(),
                bytes(w.bytes),
                bytes(w.filled_bytes),
                bytes(w.cached_bytes),
                w.skipped.len().to_string(),
                String::new(),
            ],
            None => vec![
                clean(&r.node),
                dash(),
                dash(),
                dash(),
                dash(),
                dash(),
                clean(r.error.as_deref().unwrap_or("no answer")),
            ],
        })
        .collect();
    let mut out = format!("warmed {} on {} node(s)\n", clean(url), rows.len());
    out.push_str(&table(
        &[
            "NODE",
            "OBJECTS",
            "BYTES",
            "FROM ORIGIN",
            "CACHED BEFORE",
            "SKIPPED",
            "ERROR",
        ],
        &table_rows,
    ));
    for r in rows {
        if let Some(w) = r.warmed.as_ref().filter(|w| !w.skipped.is_empty()) {
            out.push_str(&format!(
                "\nskipped on {} (jobs read them from the origin):\n",
                clean(&r.node)
            ));
            for s in &w.skipped {
                out.push_str(&format!("  {}\n", clean(s)));
            }
        }
    }
    let failed = rows.iter().filter(|r| r.warmed.is_none()).count();
    if failed > 0 {
        out.push_str(&format!(
            "\n{failed} of {} node(s) not warmed: see ERROR\n",
            rows.len()
        ));
    }
    out
}

/// `sluice cache evict PREFIX|--all [--dry-run]`: what went (or would go), and what stays because
/// a job uses it.
pub fn cache_evicted(e: &CacheEvicted, prefix: &str) -> String {
    let under = if prefix.is_empty() {
        String::new()
    } else {
        format!(" under {}", clean(prefix))
    };
    let node = clean(&e.node);
    let mut out = if e.entries == 0 && e.in_use == 0 {
        format!("no cache entries{under} on {node}; nothing to evict\n")
    } else if e.dry_run {
        format!(
            "dry run: would evict {} ({}){under} from the cache on {node}\n",
            entries(e.entries),
            bytes(e.bytes)
        )
    } else {
        format!(
            "evicted {} ({}){under} from the cache on {node}\n",
            entries(e.entries),
            bytes(e.bytes)
        )
    };
    if e.in_use > 0 {
        let (what, verb, who) = match (e.in_use, e.dry_run) {
            (1, false) => (
                "1 more entry matches",
                "stays",
                "a job is reading or filling it",
            ),
            (1, true) => (
                "1 more entry matches",
                "would stay",
                "a job is reading or filling it",
            ),
            (_, false) => ("", "stay", "jobs are reading or filling them"),
            (_, true) => ("", "would stay", "jobs are reading or filling them"),
        };
        let what = if what.is_empty() {
            format!("{} more entries match", e.in_use)
        } else {
            what.to_string()
        };
        out.push_str(&format!(
            "  {what} and {verb}: {who} (evict again once the job is done)\n"
        ));
    }
    if e.dry_run {
        out.push_str("Nothing was removed.\n");
    }
    out
}

/// An error and its causes on one line, as `{:#}` prints them, but without the causes whose text
/// the message already holds: object_store's errors repeat their source's text, and an archive
/// error says what its store error was in a shorter form.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1).map(|c| c.to_string()) {
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;

    #[test]
    fn an_error_says_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("503 Service Unavailable")]
        struct Inner;
        #[derive(Debug, thiserror::Error)]
        #[error("Generic S3 error: after 3 retries: {0}")]
        struct Repeats(#[source] Inner);
        let e = anyhow::Error::new(Repeats(Inner)).context("listing s3://b/x");
        assert_eq!(
            error_text(&e),
            "listing s3://b/x: Generic S3 error: after 3 retries: 503 Service Unavailable"
        );
    }

    #[test]
    fn human_sizes() {
        let cases = [
            (0, "0 B"),
            (1023, "1023 B"),
            (1024, "1.0 KiB"),
            (1536, "1.5 KiB"),
            (10 * 1024 * 1024 - 1, "10.0 MiB"),
            (1024 * 1024 - 1, "1.0 MiB"),
            (7 * (1 << 30) + (1 << 29), "7.5 GiB"),
            (1 << 40, "1.0 TiB"),
            (u64::MAX, "16.0 EiB"),
        ];
        for (n, want) in cases {
            assert_eq!(bytes(n), want, "{n}");
        }
    }

    #[test]
    fn rates_and_durations() {
        assert_eq!(rate(0), "-");
        assert_eq!(rate(512 << 20), "512.0 MiB/s");
        assert_eq!(rate(900), "900 B/s");
        let cases = [
            (0, "0ms"),
            (850, "850ms"),
            (12_345, "12.3s"),
            (59_999, "59.9s"),
            (245_000, "4m05s"),
            (3_723_000, "1h02m03s"),
            (183_840_000, "2d03h04m"),
        ];
        for (ms, want) in cases {
            assert_eq!(duration_ms(ms), want, "{ms}");
        }
    }

    /// The node's lines of [`fixtures::node_status`]'s view, before the cache's and the tables.
    const NODE_LINES: &str = "\
node      gpu07
agent     sluiced 0.1.0
hot tier  /var/lib/sluice/gpu07/hot
  size    1.7 TiB
  free    1.2 TiB (68%)
  used    44.5 GiB by sluice jobs
";

    #[test]
    fn status_view() {
        let want = format!(
            "{NODE_LINES}
JOBID  USER   STATE    DATASETS          PROGRESS                                       ERROR
4242   alice  staging  imagenet,weights  813/? files, 34.6 GiB/?, 2.2 GiB/s             -
4250   bob    failed   corpus            0/0 files, 0 B/0 B, -                          corpus: s3://corpus/v2 not found — check the path; the job was not started
4251   carol  ready    -                 -                                              -
4260   dave   ready    ckpt              1200/1200 files, 10.0 GiB/10.0 GiB, 1.0 GiB/s  -

WORKER         STATE      FOR    TURNS  LAST ERROR
housekeeping   idle       12.0s  3      -
ckpt job 4242  archiving  1m32s  40     -
ckpt job 4260  idle       2m12s  61     step-900: the archive store is unreachable; retrying (connecting to s3.example.org:443 timed out)
"
        );
        let now = UNIX_EPOCH + Duration::from_secs(fixtures::STARTED_AT + 192);
        assert_eq!(node_status(&fixtures::node_status(), now), want);
    }

    /// From an agent before workers were reported, or with none the caller may see: no table.
    #[test]
    fn status_without_workers() {
        let mut status = fixtures::node_status();
        status.workers.clear();
        let text = node_status(&status, UNIX_EPOCH);
        assert!(!text.contains("WORKER"), "{text}");
        assert!(text.ends_with(" 1.0 GiB/s  -\n"), "{text}");
    }

    /// What a worker says comes from the agent: control characters cannot garble the table, and a
    /// state entered "after" the caller's clock (the agent's is ahead) or at an unknown time has no
    /// duration.
    #[test]
    fn worker_rows_with_odd_input() {
        let mut status = fixtures::node_status();
        status.workers.truncate(1);
        status.workers[0].last_error = Some("store\n\x1b[31mdown".into());
        status.workers[0].since = fixtures::STARTED_AT + 10;
        let now = UNIX_EPOCH + Duration::from_secs(fixtures::STARTED_AT + 10);
        assert!(
            node_status(&status, now)
                .ends_with("\nhousekeeping  idle   <1s  3      store  [31mdown\n"),
            "{}",
            node_status(&status, now)
        );
        let no_duration = "\nhousekeeping  idle   -    3      store  [31mdown\n";
        let text = node_status(&status, UNIX_EPOCH);
        assert!(text.ends_with(no_duration), "{text}");
        status.workers[0].since = 0;
        let text = node_status(&status, now);
        assert!(text.ends_with(no_duration), "{text}");
    }

    #[test]
    fn status_without_jobs() {
        let mut status = fixtures::node_status();
        status.jobs.clear();
        status.hot_total_bytes = 0;
        let text = node_status(&status, UNIX_EPOCH);
        assert!(
            text.contains("  size    0 B\n  free    1.2 TiB\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "used    44.5 GiB by sluice jobs\n\nNo sluice jobs on this node that you may see.\n\nWORKER  "
            ),
            "{text}"
        );
    }

    #[test]
    fn job_view() {
        let now = UNIX_EPOCH + Duration::from_secs(fixtures::STARTED_AT + 192);
        let want = "\
job 4242  staging
  user       alice (uid 1000)
  started    2026-05-01T10:00:00Z (3m12s ago)
  node       gpu07
  nodes      gpu07, gpu08 (2 in all)
  stage dir  /var/lib/sluice/gpu07/hot/jobs/4242/stage
  ckpt dir   /var/lib/sluice/gpu07/hot/jobs/4242/ckpt

datasets (2)
  imagenet  copying
    source   s3://datasets/imagenet
    files    812/1000 (81%)
    bytes    7.9 GiB/10.0 GiB (79%)
    rate     506.6 MiB/s
    elapsed  16.0s
  weights  listing
    source   /lustre/models/llama-8b
    files    1/?
    bytes    26.6 GiB/?
    rate     1.7 GiB/s
    elapsed  16.0s
";
        assert_eq!(job_detail(&fixtures::staging_job(), now), want);
    }

    /// A dataset shared with the job's other nodes, found in this node's cache or kept across an
    /// agent restart says where its bytes came from.
    #[test]
    fn job_view_says_where_a_datasets_bytes_came_from() {
        const GIB: u64 = 1 << 30;
        // (origin, peers, this node's cache, kept across a restart): what the view says
        for (origin, peer, cache, resumed, want) in [
            (
                3 * GIB,
                6 * GIB,
                0,
                0,
                "    elapsed  16.0s\n    from     3.0 GiB origin, 6.0 GiB peers\n  weights  listing\n",
            ),
            (
                GIB,
                0,
                7 * GIB,
                0,
                "    elapsed  16.0s\n    from     1.0 GiB origin, 7.0 GiB this node's cache\n",
            ),
            (
                GIB,
                GIB / 2,
                7 * GIB,
                0,
                "    from     1.0 GiB origin, 512.0 MiB peers, 7.0 GiB this node's cache\n",
            ),
            (
                GIB,
                0,
                0,
                3 * GIB,
                "    from     1.0 GiB origin, 3.0 GiB kept from before the agent restarted\n",
            ),
        ] {
            let mut job = fixtures::staging_job();
            let stage = &mut job.stages[0];
            (stage.origin_bytes, stage.peer_bytes) = (origin, peer);
            (stage.cache_bytes, stage.resumed_bytes) = (cache, resumed);
            let text = job_detail(&job, UNIX_EPOCH);
            assert!(text.contains(want), "{text}");
        }
        // Without peer transfers there is no such line (every byte came from the origin).
        assert!(!job_detail(&fixtures::staging_job(), UNIX_EPOCH).contains("    from "));
    }

    #[test]
    fn job_view_with_errors_and_odd_input() {
        let mut job = fixtures::failed_job();
        job.error = Some("staging failed:\n\x1b[31mcorpus\x1b[0m".into());
        job.nodes = (1..=20).map(|i| format!("n{i}")).collect();
        job.started_at = 0;
        let text = job_detail(&job, UNIX_EPOCH);
        assert!(
            text.contains("  error      staging failed:  [31mcorpus [0m\n"),
            "{text}"
        );
        assert!(text.contains("  started    unknown\n"), "{text}");
        assert!(
            text.contains("n15, n16, … (4 more; --json lists all) (20 in all)\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "    error    s3://corpus/v2 not found — check the path; the job was not started\n"
            ),
            "{text}"
        );
        // A clock behind the agent's still prints the start time.
        let ahead = fixtures::staging_job();
        assert!(job_detail(&ahead, UNIX_EPOCH).contains("  started    2026-05-01T10:00:00Z\n"));
        assert!(
            job_detail(&fixtures::node_status().jobs[2], UNIX_EPOCH)
                .ends_with("\nNo datasets to stage.\n")
        );
    }

    #[test]
    fn long_dataset_lists_are_cut() {
        assert_eq!(truncate("abc", 3), "abc");
        assert_eq!(truncate("abcd", 3), "ab…");
        let mut status = fixtures::node_status();
        let template = status.jobs[1].stages[0].clone();
        status.jobs[1].stages = (0..10)
            .map(|i| StageProgress {
                name: format!("shard-{i}"),
                ..template.clone()
            })
            .collect();
        let text = node_status(&status, UNIX_EPOCH);
        assert!(
            text.contains(" shard-0,shard-1,shard-2,shard-3…  "),
            "{text}"
        );
    }

    #[test]
    fn ratios_and_timestamps() {
        assert_eq!(ratio(Some(1.4567)), "1.46x");
        assert_eq!(ratio(Some(1.0)), "1.00x");
        assert_eq!(ratio(None), "-");
        assert_eq!(ratio(Some(f64::INFINITY)), "-");
        assert_eq!(ratio_of(3, 2), Some(1.5));
        assert_eq!(ratio_of(3, 0), None);
        assert_eq!(timestamp(0), "-");
        assert_eq!(timestamp(fixtures::STARTED_AT), "2026-05-01T10:00:00Z");
    }

    #[test]
    fn committed_says_where_it_goes() {
        assert_eq!(
            committed(
                "step100",
                4242,
                Some("gpu07"),
                Some("s3://ckpt/alice/train")
            ),
            "committed step100 (job 4242, node gpu07); archiving to s3://ckpt/alice/train\n"
        );
        assert_eq!(
            committed("step100", 4242, None, None),
            "committed step100 (job 4242, this node)\n"
        );
    }

    #[test]
    fn job_ckpts_view() {
        let want = "\
job 4242 on this node; archive s3://ckpt/alice/train

TAG      STATE              WHERE           REPLICAS   SIZE     STORED   RATIO  COMMITTED             ARCHIVED              ERROR
step100  archived           -               -          3.0 GiB  2.0 GiB  1.46x  2026-05-01T10:10:00Z  2026-05-01T10:11:10Z  -
step200  archived           nvme            -          3.0 GiB  2.0 GiB  1.46x  2026-05-01T10:20:00Z  2026-05-01T10:21:10Z  -
step300  waiting-for-nodes  nvme            -          1.5 GiB  1.0 GiB  1.46x  2026-05-01T10:30:00Z  -                     -
step400  retrying           nvme            -          -        -        -      2026-05-01T10:40:00Z  -                     s3://ckpt/alice/train: put 'alice/train/step400/data/model.bin': connection refused
step500  archiving          ram+nvme+gpu08  protected  -        -        -      2026-05-01T10:50:00Z  -                     -
step550  archiving          ram+nvme        0/1        -        -        -      2026-05-01T10:55:00Z  -                     replicas: 0 of 1 (gpu08 has no room for replicas: 8.0 GiB asked, 1.0 GiB free)
step600  committed          ram             -          -        -        -      2026-05-01T11:00:00Z  -                     -
";
        assert_eq!(job_ckpts(fixtures::CKPT_JOB, &fixtures::job_ckpts()), want);
    }

    #[test]
    fn job_ckpts_edge_cases() {
        assert_eq!(
            job_ckpts(7, &[]),
            "job 7 on this node\n\nNo committed checkpoints yet (commit one with `sluice ckpt commit TAG`).\n"
        );
        // No archive configured; an archived empty checkpoint has a size (0 B) but no ratio;
        // control characters from the agent cannot garble the table.
        let mut c = fixtures::job_ckpts();
        c.truncate(1);
        c[0].archive_url.clear();
        (c[0].raw_bytes, c[0].stored_bytes) = (0, 0);
        c[0].error = Some("line\nbreak\x1b[31m".into());
        let text = job_ckpts(7, &c);
        assert!(text.starts_with("job 7 on this node\n\nTAG  "), "{text}");
        assert!(
            text.contains("  archived  -      0 B   0 B     -      ")
                && text.ends_with("  line break [31m\n"),
            "{text}"
        );
    }

    #[test]
    fn archive_view() {
        let want = "\
archive s3://ckpt/alice/train

TAG      STATE     FILES  SIZE     STORED     RATIO  CLASS        CREATED               JOB   NODES
step100  complete  24     6.0 GiB  4.1 GiB    1.46x  STANDARD_IA  2026-05-01T10:11:00Z  4242  gpu07,gpu08
step200  partial   9      3.0 GiB  953.7 MiB  -      default      2026-05-01T10:21:00Z  -     gpu07
step150  invalid   -      -        -          -      -            -                     -     -

partial: no MANIFEST yet (still archiving, or an archive that failed); never restored
step150: unusable MANIFEST (unsupported version 9); it is never restored
";
        assert_eq!(
            archive_ckpts(fixtures::CKPT_URL, &fixtures::archive_listing()),
            want
        );
    }

    #[test]
    fn archive_view_edge_cases() {
        assert_eq!(
            archive_ckpts("file:///a", &[]),
            "archive file:///a\n\nNo checkpoints there.\n"
        );
        // Complete checkpoints only: no notes. Many nodes are cut (--json has them all).
        let mut list = fixtures::archive_listing();
        list.truncate(1);
        list[0].nodes = (1..=40).map(|i| format!("node{i:03}")).collect();
        let text = archive_ckpts("file:///a", &list);
        assert!(
            text.ends_with("  node001,node002,node003,node004…\n"),
            "{text}"
        );
        // Data in an offline class (written by nodes configured differently here) is listed
        // with what it takes to restore it; a manifest's class cannot garble the table.
        list[0].nodes = vec!["n1".into()];
        list[0].data_classes = vec!["DEEP_ARCHIVE".into(), "Archive".into(), "x\x1b[2J".into()];
        let text = archive_ckpts("s3://a", &list);
        assert!(
            text.contains("  1.46x  DEEP_ARCHIVE+Archive+x [2J  2026-"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "\nstep100: its data is in DEEP_ARCHIVE, Archive: have the store restore \
                 (rehydrate) it before `sluice ckpt restore` or --ckpt-restore can read it\n"
            ),
            "{text}"
        );
    }

    fn verified(ok: bool) -> Verified {
        Verified {
            url: "file:///srv/ckpt".into(),
            tag: "step100".into(),
            ok,
            files: 7,
            raw_bytes: 13 << 20,
            stored_bytes: 10 << 20,
            damaged: Vec::new(),
        }
    }

    #[test]
    fn verify_views() {
        assert_eq!(
            verify(&verified(true)),
            "checkpoint step100 at file:///srv/ckpt: OK\n  \
             7 file(s), 13.0 MiB (10.0 MiB stored, ratio 1.30x) match the MANIFEST's checksums\n"
        );
        let mut bad = verified(false);
        bad.damaged = vec![
            crate::ckpt::DamagedFile {
                path: "model/weights.bf16".into(),
                detail: "chunk 1 of 3: checksum mismatch".into(),
            },
            crate::ckpt::DamagedFile {
                path: "optim/step".into(),
                detail: "its data object is missing".into(),
            },
        ];
        assert_eq!(
            verify(&bad),
            "checkpoint step100 at file:///srv/ckpt: DAMAGED, 2 of 7 file(s)\n  \
             model/weights.bf16: chunk 1 of 3: checksum mismatch\n  \
             optim/step: its data object is missing\n\
             Do not restore it: restore an older checkpoint (sluice ckpt list file:///srv/ckpt).\n"
        );
    }

    #[test]
    fn restore_views() {
        let r = Restored {
            url: "s3://ckpt/alice/train".into(),
            tag: "step200".into(),
            dest: "/scratch/alice/step200".into(),
            files: 12,
            raw_bytes: 3 << 30,
            stored_bytes: 2 << 30,
            skipped: vec!["step300".into()],
            notes: Vec::new(),
        };
        assert_eq!(
            restored(&r),
            "restored step200 from s3://ckpt/alice/train into /scratch/alice/step200: \
             12 file(s), 3.0 GiB, checksums verified\n"
        );
        let mut plan = RestorePlan {
            dry_run: true,
            url: "s3://ckpt/alice/train".into(),
            tag: "step200".into(),
            dest: "/scratch/alice/step200".into(),
            dest_check: DestCheck::Create,
            files: 12,
            raw_bytes: 3 << 30,
            stored_bytes: 2 << 30,
        };
        assert_eq!(
            restore_plan(&plan),
            "dry run: would restore step200 from s3://ckpt/alice/train into /scratch/alice/step200\n  \
               12 file(s), 3.0 GiB (2.0 GiB to download)\n  \
               /scratch/alice/step200 does not exist: the restore would create it\n\
             Nothing was written; checksums are checked as a restore reads the data.\n"
        );
        plan.dest_check = DestCheck::Empty;
        assert!(restore_plan(&plan).contains(
            "\n  /scratch/alice/step200 is an empty directory of yours: the restore would fill it\n"
        ));
        plan.dest_check = DestCheck::Refused {
            reason: "/scratch/alice/step200 is not empty\x1b[2J".into(),
        };
        assert!(restore_plan(&plan).contains(
            "\n  the restore would be refused: /scratch/alice/step200 is not empty [2J\n"
        ));
    }

    #[test]
    fn status_view_with_a_cache() {
        let mut status = fixtures::node_status();
        status.cache = Some(fixtures::cache_stats());
        let want = format!(
            "{NODE_LINES}\
cache     /var/lib/sluice/gpu07/hot/cache
  used    33.0 GiB of 100.0 GiB (33%), 3 entries
  hits    87.5% of 8 lookups (7 hits, 1 miss)
  served  56.0 GiB from the cache (not read from the origin again)
  evicted 2 entries, 12.0 GiB

JOBID  USER   STATE    DATASETS  "
        );
        assert!(
            node_status(&status, UNIX_EPOCH).starts_with(&want),
            "{}",
            node_status(&status, UNIX_EPOCH)
        );
        // A fresh cache, and one without lookups: no ratio to show.
        status.cache = Some(CacheStats {
            root: "/c".into(),
            capacity_bytes: 1 << 30,
            ..CacheStats::default()
        });
        let text = node_status(&status, UNIX_EPOCH);
        assert!(
            text.contains(
                "cache     /c\n  used    0 B of 1.0 GiB (0%), 0 entries\n  hits    no lookups yet\n  \
                 served  0 B from the cache (not read from the origin again)\n  \
                 evicted 0 entries, 0 B\n\nJOBID  "
            ),
            "{text}"
        );
        // Without a cache (or from an agent before it), no cache lines.
        assert!(!node_status(&fixtures::node_status(), UNIX_EPOCH).contains("cache"));
    }

    #[test]
    fn cache_list_view() {
        let want = "\
cache on gpu07 (/var/lib/sluice/gpu07/hot/cache): 33.0 GiB of 100.0 GiB (33%), 3 entries; hit ratio 87.5%

URL                                     SIZE      LAST USE              IN USE
s3://datasets/corpus/v1.tar             2.0 GiB   2026-05-01T10:05:00Z  no
s3://datasets/imagenet/train.tar        30.0 GiB  2026-05-01T10:20:00Z  no
az://models/llama-8b/model.safetensors  1.0 GiB   2026-05-01T10:42:00Z  yes

IN USE yes: a job is reading it right now; it is not evicted until the job is done.
";
        assert_eq!(cache_list(&fixtures::cache_listing(), None), want);
        // More than one answer holds: the agent says how many it left out.
        let mut l = fixtures::cache_listing();
        l.left_out = 4321;
        assert!(
            cache_list(&l, None)
                .contains("yes\n\n... and 4321 entries not shown (a prefix narrows the listing)\n"),
            "{}",
            cache_list(&l, None)
        );
    }

    #[test]
    fn cache_list_under_a_prefix_and_empty() {
        let mut l = fixtures::cache_listing();
        l.entries.retain(|e| e.url.starts_with("s3://datasets/"));
        let text = cache_list(&l, Some("s3://datasets/"));
        assert!(
            text.ends_with(
                "\ns3://datasets/imagenet/train.tar  30.0 GiB  2026-05-01T10:20:00Z  no\n\n\
                 2 entries under s3://datasets/, 32.0 GiB\n"
            ),
            "{text}"
        );
        l.entries.clear();
        assert!(
            cache_list(&l, Some("s3://none/\x1b[2J"))
                .ends_with("3 entries; hit ratio 87.5%\n\nNo entries under s3://none/ [2J.\n")
        );
        l.stats = CacheStats::default();
        assert_eq!(
            cache_list(&l, None),
            "cache on gpu07 (): 0 B of 0 B, 0 entries; no lookups yet\n\nThe cache is empty.\n"
        );
    }

    #[test]
    fn cache_stats_view() {
        let want = "\
cache on gpu07
  root        /var/lib/sluice/gpu07/hot/cache
  capacity    100.0 GiB
  high water  90.0 GiB (90%): filling past it evicts the least recently used entries
  low water   75.0 GiB (75%): eviction stops there
  used        33.0 GiB (33%) in 3 entries
  hits        7
  misses      1
  hit ratio   87.5%
  from cache  56.0 GiB placed into jobs: bytes the origin did not serve again
  filled      45.0 GiB written into new entries
  evictions   2 entries, 12.0 GiB
";
        assert_eq!(cache_stats(&fixtures::cache_listing()), want);
    }

    #[test]
    fn cache_warm_view() {
        let want = "\
warmed s3://datasets/imagenet/ on gpu07: 1000 object(s), 10.0 GiB
  cached before  500 object(s), 4.0 GiB (nothing read)
  new            499 object(s), 6.0 GiB, read from the origin into the cache
  skipped        1 object(s), not cached (jobs read them from the origin):
    s3://datasets/imagenet/all.tar: 120.0 GiB is larger than the cache (100.0 GiB)
";
        assert_eq!(cache_warmed(&fixtures::cache_warmed()), want);
        // Everything there already: nothing read, nothing skipped.
        let mut w = fixtures::cache_warmed();
        (w.cached_files, w.cached_bytes) = (w.files, w.bytes);
        (w.filled_files, w.filled_bytes) = (0, 0);
        w.skipped.clear();
        assert!(
            cache_warmed(&w).ends_with(
                "  cached before  1000 object(s), 10.0 GiB (nothing read)\n  \
                 new            0 object(s), 0 B, read from the origin into the cache\n"
            ),
            "{}",
            cache_warmed(&w)
        );
    }

    #[test]
    fn cache_evict_views() {
        assert_eq!(
            cache_evicted(&fixtures::cache_evicted(false), "s3://datasets/"),
            "evicted 2 entries (32.0 GiB) under s3://datasets/ from the cache on gpu07\n  \
             1 more entry matches and stays: a job is reading or filling it (evict again once \
             the job is done)\n"
        );
        assert_eq!(
            cache_evicted(&fixtures::cache_evicted(true), ""),
            "dry run: would evict 2 entries (32.0 GiB) from the cache on gpu07\n  \
             1 more entry matches and would stay: a job is reading or filling it (evict again \
             once the job is done)\nNothing was removed.\n"
        );
        let mut e = fixtures::cache_evicted(false);
        e.in_use = 3;
        assert!(cache_evicted(&e, "s3://d/").ends_with(
            "\n  3 more entries match and stay: jobs are reading or filling them (evict again \
             once the job is done)\n"
        ));
        (e.entries, e.bytes, e.in_use) = (1, 1024, 0);
        assert_eq!(
            cache_evicted(&e, "s3://d/x"),
            "evicted 1 entry (1.0 KiB) under s3://d/x from the cache on gpu07\n"
        );
        (e.entries, e.bytes) = (0, 0);
        assert_eq!(
            cache_evicted(&e, "s3://typo/"),
            "no cache entries under s3://typo/ on gpu07; nothing to evict\n"
        );
    }
}
