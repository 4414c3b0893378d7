//! Example messages for the tests of the crates that speak the protocol (feature `testing`, for
//! their dev-dependencies only): one example of each message that several crates' tests build, so
//! that they agree on it and a new field is filled in once.

use crate::msg::{CacheStats, JobId, JobStart};

/// uid and gid of user nobody, the job user of the agent's tests.
pub const NOBODY: u32 = 65534;

const GIB: u64 = 1 << 30;

/// A one-node job of user nobody on `node`, as its prolog announces it.
pub fn nobody_job(
    job_id: JobId,
    node: &str,
    job_name: &str,
    options: Vec<(String, String)>,
) -> JobStart {
    JobStart {
        job_id,
        uid: NOBODY,
        gid: NOBODY,
        user: "nobody".into(),
        node: node.into(),
        nodes: vec![node.into()],
        job_name: job_name.into(),
        options,
    }
}

/// gpu07's cache: 100 GiB, a third full, after a few sweeps (7 hits, 1 miss, 2 evictions).
pub fn cache_stats() -> CacheStats {
    CacheStats {
        root: "/var/lib/sluice/gpu07/hot/cache".into(),
        capacity_bytes: 100 * GIB,
        high_water_bytes: 90 * GIB,
        low_water_bytes: 75 * GIB,
        used_bytes: 33 * GIB,
        entries: 3,
        hits: 7,
        misses: 1,
        hit_bytes: 56 * GIB,
        filled_bytes: 45 * GIB,
        evictions: 2,
        evicted_bytes: 12 * GIB,
    }
}
