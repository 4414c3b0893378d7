//! What a job's user reads about sluice in the job output, and the units it is written in. One
//! place, so that the plugin's end-of-job summary and the CLI say the same things the same way.

use crate::msg::{CkptState, CkptStatus, JobStatus};

/// Bytes in binary units: `512 B`, `1.5 KiB`, `931.3 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    // 1023.95 would print as "1024.0"; move to the next unit instead.
    while value >= 1023.95 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// What this node staged for the job, once its data is ready: datasets, bytes, files, time and
/// rate, and, when the job's other nodes (peers), this node's cache or files kept across an agent
/// restart supplied some of it, the share of each source. Nothing when the job stages nothing.
pub fn job_start(status: &JobStatus) -> Vec<String> {
    let stages = &status.stages;
    if stages.is_empty() {
        return Vec::new();
    }
    let bytes_done: u64 = stages.iter().map(|s| s.bytes_done).sum();
    let files: u64 = stages.iter().map(|s| s.files_done).sum();
    let peer: u64 = stages.iter().map(|s| s.peer_bytes).sum();
    let cache: u64 = stages.iter().map(|s| s.cache_bytes).sum();
    let resumed: u64 = stages.iter().map(|s| s.resumed_bytes).sum();
    // Datasets stage side by side: the job waited for the slowest.
    let ms = stages.iter().map(|s| s.elapsed_ms).max().unwrap_or(0);
    let rate = bytes_done
        .saturating_mul(1000)
        .checked_div(ms)
        .map_or(String::new(), |r| format!(" ({}/s)", bytes(r)));
    let mut line = format!(
        "staged {} dataset(s) on {}: {}, {files} file(s) in {:.1} s{rate}",
        stages.len(),
        status.node,
        bytes(bytes_done),
        ms as f64 / 1000.0
    );
    if let Some(shares) = shares(bytes_done, peer, cache, resumed) {
        line.push_str("; ");
        line.push_str(&shares);
    }
    vec![line]
}

/// Where `done` bytes came from, when not all from the origin: `34 % from the origin, 66 % from
/// the job's other nodes`, `100 % from this node's cache`, `80 % resumed from before the agent
/// restarted` (files a restarted agent found whole and kept, read from nowhere). The shares add up
/// to 100: the other sources' are rounded down and the origin gets the rest when it served
/// anything, so rounding never claims more saved than was; when it served nothing, the rest goes
/// to whichever source lost most to rounding. The origin is named whenever it served anything,
/// and next to peers always (it is what peers save); the others when they supplied anything.
fn shares(done: u64, peer: u64, cache: u64, resumed: u64) -> Option<String> {
    const FROM: [&str; 3] = [
        "from the job's other nodes",
        "from this node's cache",
        "resumed from before the agent restarted",
    ];
    if done == 0 || (peer == 0 && cache == 0 && resumed == 0) {
        return None;
    }
    let done = u128::from(done);
    // Counters of another agent could overlap; never more than the whole.
    let mut left = done;
    let amounts = [peer, cache, resumed].map(|a| {
        let a = u128::from(a).min(left);
        left -= a;
        a
    });
    let mut percent = amounts.map(|a| a * 100 / done);
    let origin_served = left > 0;
    let rest = 100 - percent.iter().sum::<u128>();
    let from_origin = if origin_served {
        rest
    } else {
        let mut most = 0;
        for i in 1..amounts.len() {
            if (amounts[i] * 100) % done > (amounts[most] * 100) % done {
                most = i;
            }
        }
        percent[most] += rest;
        0
    };
    let mut parts = Vec::new();
    if origin_served || peer > 0 {
        parts.push(format!("{from_origin} % from the origin"));
    }
    for ((amount, percent), from) in amounts.iter().zip(percent).zip(FROM) {
        if *amount > 0 {
            parts.push(format!("{percent} % {from}"));
        }
    }
    Some(parts.join(", "))
}

/// The job's checkpoints on this node when its batch script ended: what is archived, what is still
/// on its way (and continues after the job), and every checkpoint sluice will not archive by itself
/// with the reason. Nothing when the job committed no checkpoint here.
pub fn job_end(status: &JobStatus) -> Vec<String> {
    let ckpts = &status.ckpts;
    if ckpts.is_empty() {
        return Vec::new();
    }
    let url = ckpts
        .iter()
        .map(|c| c.archive_url.as_str())
        .find(|u| !u.is_empty())
        .unwrap_or("");
    let archived: Vec<&CkptStatus> = ckpts
        .iter()
        .filter(|c| c.state == CkptState::Archived)
        .collect();
    let mut lines = Vec::new();
    let mut head = format!(
        "job {} on {}: {} of {} checkpoint(s) archived",
        status.job_id,
        status.node,
        archived.len(),
        ckpts.len()
    );
    if let Some(newest) = archived.iter().max_by_key(|c| (c.committed_at, &c.tag)) {
        head.push_str(&format!(
            " (newest {}: {} → {} stored)",
            newest.tag,
            bytes(newest.raw_bytes),
            bytes(newest.stored_bytes)
        ));
    }
    if !url.is_empty() {
        head.push_str(&format!(" in {url}"));
    }
    lines.push(head);
    for c in ckpts {
        if let Some(problem) = c.problem() {
            lines.push(problem);
        } else if c.state != CkptState::Archived {
            let why = c
                .error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}"));
            lines.push(format!(
                "checkpoint {} is {}{why}; archiving continues after the job — follow it with \
                 `sluice ckpt list {url}`",
                c.tag,
                c.state.as_str()
            ));
            if let Some(unprotected) = unprotected(c) {
                lines.push(unprotected);
            }
        }
    }
    lines
}

/// What the job must know of a checkpoint not archived yet whose replicas were asked for
/// (`[fast_tier] replicas`) and that is not protected by them: losing this node before the archive
/// holds it loses this node's part.
fn unprotected(c: &CkptStatus) -> Option<String> {
    let r = c.replicas.as_ref().filter(|r| !r.protected && !r.freed)?;
    let why = match (&r.short, r.held_by.len() >= usize::from(r.wanted)) {
        (Some(short), _) => short.clone(),
        (None, true) => "not every node's part is replicated yet".into(),
        (None, false) => "not replicated yet".into(),
    };
    Some(format!(
        "checkpoint {} is NOT protected by replicas ({why}): until it is archived, losing {} loses it",
        c.tag,
        if r.held_by.len() >= usize::from(r.wanted) {
            "another node of the job"
        } else {
            "this node"
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{JobDirs, JobState};

    fn ckpt(tag: &str, state: CkptState, at: u64) -> CkptStatus {
        CkptStatus {
            tag: tag.into(),
            state,
            on_hot_tier: true,
            in_ram: false,
            archive_url: "s3://ckpt/alice/train".into(),
            files: 2,
            raw_bytes: 3 << 30,
            stored_bytes: 2 << 30,
            bytes_done: 0,
            committed_at: at,
            archived_at: None,
            error: None,
            action_needed: false,
            replicas: None,
        }
    }

    fn job(ckpts: Vec<CkptStatus>) -> JobStatus {
        JobStatus {
            job_id: 12,
            user: "alice".into(),
            uid: 1001,
            node: "n1".into(),
            nodes: vec!["n1".into()],
            state: JobState::Ready,
            dirs: JobDirs {
                stage_dir: String::new(),
                ckpt_dir: String::new(),
                restored_tag: None,
                notes: Vec::new(),
                env: Vec::new(),
            },
            stages: Vec::new(),
            started_at: 0,
            error: None,
            ckpts,
        }
    }

    #[test]
    fn start_summary_sums_the_datasets_and_names_the_peers_share() {
        use crate::msg::{StageProgress, StageState};
        let stage = |name: &str, bytes: u64, peer: u64, ms: u64| StageProgress {
            name: name.into(),
            source: format!("s3://b/{name}"),
            state: StageState::Done,
            files_done: 10,
            files_total: Some(10),
            bytes_done: bytes,
            bytes_total: Some(bytes),
            origin_bytes: bytes - peer,
            peer_bytes: peer,
            cache_bytes: 0,
            resumed_bytes: 0,
            elapsed_ms: ms,
            error: None,
        };
        let mut st = job(Vec::new());
        assert!(job_start(&st).is_empty());
        st.stages = vec![stage("a", 2 << 30, 0, 4000), stage("b", 1 << 30, 0, 2000)];
        assert_eq!(
            job_start(&st),
            ["staged 2 dataset(s) on n1: 3.0 GiB, 20 file(s) in 4.0 s (768.0 MiB/s)"]
        );
        st.stages = vec![stage("a", 3 << 30, 2 << 30, 3000)];
        assert_eq!(
            job_start(&st),
            [
                "staged 1 dataset(s) on n1: 3.0 GiB, 10 file(s) in 3.0 s (1.0 GiB/s); 34 % from \
              the origin, 66 % from the job's other nodes"
            ]
        );
    }

    #[test]
    fn start_summary_names_what_came_from_this_nodes_cache() {
        use crate::msg::{StageProgress, StageState};
        const GIB: u64 = 1 << 30;
        let stage = |bytes: u64, peer: u64, cache: u64| StageProgress {
            name: "ds".into(),
            source: "s3://b/ds".into(),
            state: StageState::Done,
            files_done: 4,
            files_total: Some(4),
            bytes_done: bytes,
            bytes_total: Some(bytes),
            origin_bytes: bytes - peer - cache,
            peer_bytes: peer,
            cache_bytes: cache,
            resumed_bytes: 0,
            elapsed_ms: 500,
            error: None,
        };
        let mut st = job(Vec::new());
        let line = |st: &JobStatus| job_start(st).pop().unwrap();
        // The case: a second job on the same data reads nothing from the origin.
        st.stages = vec![stage(2 * GIB, 0, 2 * GIB)];
        assert_eq!(
            line(&st),
            "staged 1 dataset(s) on n1: 2.0 GiB, 4 file(s) in 0.5 s (4.0 GiB/s); 100 % from \
             this node's cache"
        );
        // Part of it: the origin keeps what rounding leaves (never overstating the saving).
        st.stages = vec![stage(3 * GIB, 0, 2 * GIB)];
        assert!(
            line(&st).ends_with("; 34 % from the origin, 66 % from this node's cache"),
            "{}",
            line(&st)
        );
        // A sliver from the origin still shows as the origin's.
        st.stages = vec![stage(1000, 0, 999)];
        assert!(line(&st).ends_with("; 1 % from the origin, 99 % from this node's cache"));
        // All three sources: the shares add up to 100.
        st.stages = vec![stage(10 * GIB, 3 * GIB, 5 * GIB)];
        assert!(
            line(&st).ends_with(
                "; 20 % from the origin, 30 % from the job's other nodes, 50 % from this node's cache"
            ),
            "{}",
            line(&st)
        );
        // Peers and the cache only: nothing is put on the origin's account by rounding.
        st.stages = vec![stage(3 * GIB, GIB, 2 * GIB)];
        assert!(
            line(&st).ends_with(
                "; 0 % from the origin, 33 % from the job's other nodes, 67 % from this node's cache"
            ),
            "{}",
            line(&st)
        );
        // Summed over datasets, one from the cache and one from the origin.
        st.stages = vec![stage(GIB, 0, GIB), stage(3 * GIB, 0, 0)];
        assert!(line(&st).ends_with("; 75 % from the origin, 25 % from this node's cache"));
        // Counters that overlap (another agent's) never make a share above 100.
        assert_eq!(
            shares(100, 80, 80, 0).as_deref(),
            Some(
                "0 % from the origin, 80 % from the job's other nodes, 20 % from this node's cache"
            )
        );
        assert_eq!(shares(0, 0, 0, 0), None);
        assert_eq!(shares(100, 0, 0, 0), None);
    }

    #[test]
    fn start_summary_names_what_a_restarted_agent_kept() {
        use crate::msg::{StageProgress, StageState};
        let mut st = job(Vec::new());
        st.stages = vec![StageProgress {
            name: "ds".into(),
            source: "s3://b/ds".into(),
            state: StageState::Done,
            files_done: 4,
            files_total: Some(4),
            bytes_done: 1000,
            bytes_total: Some(1000),
            origin_bytes: 300,
            peer_bytes: 0,
            cache_bytes: 0,
            resumed_bytes: 700,
            elapsed_ms: 500,
            error: None,
        }];
        let line = job_start(&st).pop().unwrap();
        assert!(
            line.ends_with("; 30 % from the origin, 70 % resumed from before the agent restarted"),
            "{line}"
        );
        // With the cache too, and nothing from the origin: the shares still add up to 100.
        assert_eq!(
            shares(3, 0, 1, 2).as_deref(),
            Some("33 % from this node's cache, 67 % resumed from before the agent restarted")
        );
    }

    #[test]
    fn human_sizes() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes((1 << 20) - 1), "1.0 MiB");
    }

    #[test]
    fn end_summary_says_which_pending_checkpoints_replicas_do_not_protect() {
        use crate::msg::ReplicaStatus;
        let with = |tag: &str, r: ReplicaStatus| CkptStatus {
            replicas: Some(r),
            ..ckpt(tag, CkptState::Retrying, 1)
        };
        let lines = job_end(&job(vec![
            with(
                "s1",
                ReplicaStatus {
                    wanted: 1,
                    short: Some("n2 has no room for replicas: 3.0 GiB asked, 1.0 GiB free".into()),
                    ..ReplicaStatus::default()
                },
            ),
            with(
                "s2",
                ReplicaStatus {
                    wanted: 1,
                    held_by: vec!["n2".into()],
                    protected: true,
                    ..ReplicaStatus::default()
                },
            ),
        ]));
        assert_eq!(
            lines[2],
            "checkpoint s1 is NOT protected by replicas (n2 has no room for replicas: 3.0 GiB asked, 1.0 GiB free): until it is archived, losing this node loses it"
        );
        assert!(
            lines[3].starts_with("checkpoint s2 is retrying"),
            "{lines:?}"
        );
        assert_eq!(
            lines.len(),
            4,
            "a protected checkpoint needs no warning: {lines:?}"
        );
    }

    #[test]
    fn end_summary_says_what_is_archived_pending_and_refused() {
        assert!(job_end(&job(Vec::new())).is_empty());
        let mut refused = ckpt("s3", CkptState::Refused, 3);
        refused.error = Some("the archive holds s3 with other content".into());
        refused.action_needed = true;
        let mut retrying = ckpt("s4", CkptState::Retrying, 4);
        retrying.error = Some("the archive store is unreachable".into());
        let lines = job_end(&job(vec![
            ckpt("s1", CkptState::Archived, 1),
            ckpt("s2", CkptState::Archived, 2),
            refused,
            retrying,
        ]));
        assert_eq!(
            lines,
            vec![
                "job 12 on n1: 2 of 4 checkpoint(s) archived (newest s2: 3.0 GiB → 2.0 GiB \
                 stored) in s3://ckpt/alice/train",
                "checkpoint s3 is NOT archived: the archive holds s3 with other content",
                "checkpoint s4 is retrying: the archive store is unreachable; archiving continues \
                 after the job — follow it with `sluice ckpt list s3://ckpt/alice/train`",
            ]
        );
    }
}
