//! The agent's Prometheus endpoint: `GET /metrics` in the Prometheus text format (0.0.4), on the
//! address `[metrics]` gives (off without the section: no listener at all).
//!
//! Two kinds of numbers, kept apart on purpose:
//!
//! - **Events** ([`Metrics`]): counters and histograms bumped at the one place each event happens —
//!   a job's set-up ending (bytes and files staged, stage durations, set-up failures), a restore, a
//!   checkpoint part uploaded or failing, a connection refused by admission. The agent holds one
//!   `Metrics` and records into it whether or not the endpoint is on; recording is a few atomics.
//! - **State** ([`Snapshot`], a [`Collector`]): gauges read from what the agent already owns at
//!   the moment of the scrape — the job table, each job's checkpoint entries, the hot tier's file
//!   system, the background workers' statuses ([`encode_workers`]) — so they can never drift from
//!   what `sluice status` shows.
//!
//! Labels are bounded by construction: a source kind, an operation and a stable error code (each
//! error type's own `code()`, one exhaustive match beside the type), an admission reason, a job
//! state. Never a job id, a user, a tag or a path: those belong in `sluice status`, not in a time
//! series.
//!
//! Staged bytes come from the dataset's origin, with `[peer]` from the job's other nodes, and with
//! `[cache]` from this node's cache: `sluice_origin_bytes_total` and `sluice_peer_bytes_total`
//! count the first two by source kind, the cache's own `sluice_cache_hit_bytes_total` the third,
//! and the three add up to `sluice_stage_bytes_total`. The cache's sizes and counters are state
//! ([`encode_cache`], read from [`CacheStats`] at each scrape, absent without a cache).
//!
//! The scrape runs on the blocking pool (statvfs, and a walk of each checkpoint still waiting
//! for its archive whose size is not known yet, remembered per commit). The listener serves at
//! most [`MAX_CONNECTIONS`] connections at once, each given [`HEADER_TIMEOUT`] to send a request.

use crate::hot_tier::HotTier;
use crate::job::Job;
use crate::job_table::JobTable;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Metric, Registry, Unit};
use sluice_archive::{ArchiveError, PartManifest};
use sluice_core::config::{Config, MetricsConfig};
use sluice_core::rt::{blocking, lock};
use sluice_core::worker::Workers;
use sluice_proto::msg::{
    CacheStats, CkptState, JobId, JobState, StageProgress, StageState, WorkerStatus,
};
use sluice_proto::options::{ObjectScheme, Source};
use sluice_stage::cache::Cache;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Scrape connections served at once; more are closed at once (Prometheus needs one per server).
pub const MAX_CONNECTIONS: usize = 8;
/// How long a connection may take to send its request's headers (also between keep-alive requests).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("[metrics] listen = {addr}: cannot listen there: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    /// `s3`, `azure`, `gcs` or `posix`.
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    /// `setup`, `stage`, `restore` or `archive`.
    operation: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FromLabels {
    /// `this_node` or `other_nodes`.
    from: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    /// `user_limit` or `full`.
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
    protocol: String,
}

const SOURCES: [&str; 4] = ["s3", "azure", "gcs", "posix"];
/// Why admission refuses a connection (the socket server's `Refused::reason`).
pub(crate) const REFUSAL_REASONS: [&str; 2] = ["user_limit", "full"];

/// The units of series in bytes and in seconds (`_bytes`, `_seconds` after their names).
const BYTES: Option<&Unit> = Some(&Unit::Bytes);
const SECONDS: Option<&Unit> = Some(&Unit::Seconds);

/// One series as the tables here list it: its name (after `sluice_`), help, unit, and the metric
/// or the value read.
type Series<V> = (&'static str, &'static str, Option<&'static Unit>, V);

/// Durations from half a second to a little over two hours, doubling.
fn duration_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.5, 2.0, 15))
}

/// A metric of any type, so that the event metrics' registrations can be one table (the
/// library encodes a `Box<dyn EncodeMetric>` but does not take one as a [`Metric`]).
#[derive(Debug)]
struct AnyMetric(Box<dyn Metric>);

impl EncodeMetric for AnyMetric {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The agent's event counters. Cloning shares them.
#[derive(Clone, Debug)]
pub struct Metrics {
    stage_bytes: Family<SourceLabels, Counter>,
    stage_files: Family<SourceLabels, Counter>,
    origin_bytes: Family<SourceLabels, Counter>,
    peer_bytes: Family<SourceLabels, Counter>,
    stage_duration: Family<SourceLabels, Histogram, fn() -> Histogram>,
    restore_duration: Histogram,
    archive_duration: Histogram,
    archive_bytes: Counter,
    archive_stored_bytes: Counter,
    failures: Family<FailureLabels, Counter>,
    refused: Family<ReasonLabels, Counter>,
    replica_bytes: Counter,
    replicas_short: Counter,
    protected: Counter,
    replica_restore_bytes: Family<FromLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        let m = Metrics {
            stage_bytes: Family::default(),
            stage_files: Family::default(),
            origin_bytes: Family::default(),
            peer_bytes: Family::default(),
            stage_duration: Family::new_with_constructor(duration_buckets),
            restore_duration: duration_buckets(),
            archive_duration: duration_buckets(),
            archive_bytes: Counter::default(),
            archive_stored_bytes: Counter::default(),
            failures: Family::default(),
            refused: Family::default(),
            replica_bytes: Counter::default(),
            replicas_short: Counter::default(),
            protected: Counter::default(),
            replica_restore_bytes: Family::default(),
        };
        // Every series of a bounded label set exists from the start, at 0, so that `increase()`
        // sees the first event and a dashboard shows 0 rather than nothing.
        for source in SOURCES {
            let l = SourceLabels { source };
            drop(m.stage_bytes.get_or_create(&l));
            drop(m.stage_files.get_or_create(&l));
            drop(m.origin_bytes.get_or_create(&l));
            drop(m.peer_bytes.get_or_create(&l));
            drop(m.stage_duration.get_or_create(&l));
        }
        for reason in REFUSAL_REASONS {
            drop(m.refused.get_or_create(&ReasonLabels { reason }));
        }
        for from in ["this_node", "other_nodes"] {
            drop(m.replica_restore_bytes.get_or_create(&FromLabels { from }));
        }
        m
    }
}

impl Metrics {
    /// A job's set-up (staging and restore) ended: what each dataset put on the hot tier, and how
    /// long the completed ones took. Bytes of a dataset cut short count too: they were read and
    /// written. (A failed set-up's reason is counted by [`Metrics::failure`].)
    pub(crate) fn set_up_done(&self, job: &Job) {
        if let Ok(options) = &job.options {
            for (spec, progress) in options.stage_in.iter().zip(&job.stages) {
                let l = SourceLabels {
                    source: source_kind(&spec.source),
                };
                let p = progress.snapshot();
                self.stage_bytes.get_or_create(&l).inc_by(p.bytes_done);
                self.stage_files.get_or_create(&l).inc_by(p.files_done);
                self.origin_bytes.get_or_create(&l).inc_by(origin_bytes(&p));
                self.peer_bytes.get_or_create(&l).inc_by(p.peer_bytes);
                if p.state == StageState::Done {
                    self.stage_duration
                        .get_or_create(&l)
                        .observe(p.elapsed_ms as f64 / 1000.0);
                }
            }
        }
    }

    /// `--ckpt-restore` put `tag` in place (nothing when there was nothing to restore).
    pub(crate) fn restored(&self, tag: Option<&str>, took: Duration) {
        if tag.is_some() {
            self.restore_duration.observe(took.as_secs_f64());
        }
    }

    /// One attempt to upload this node's part of a checkpoint ended.
    pub(crate) fn part_uploaded(
        &self,
        took: Duration,
        result: &Result<PartManifest, ArchiveError>,
    ) {
        match result {
            Ok(part) => {
                self.archive_duration.observe(took.as_secs_f64());
                self.archive_bytes.inc_by(part.raw_bytes());
                self.archive_stored_bytes.inc_by(part.stored_bytes());
            }
            Err(e) => self.failure("archive", e.code()),
        }
    }

    /// Admission closed a connection to the agent's socket, for `reason` (the refusal's own word,
    /// one of [`REFUSAL_REASONS`]).
    pub(crate) fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// This node's part of a checkpoint went to another node of the job as a replica.
    pub(crate) fn replica_sent(&self, bytes: u64) {
        self.replica_bytes.inc_by(bytes);
    }

    /// A node of the job did not take a replica of this node's part (no room, not reached).
    pub(crate) fn replica_refused(&self) {
        self.replicas_short.inc();
    }

    /// A checkpoint of a job on this node became protected: every node's part held by as many
    /// other nodes as the job asks.
    pub(crate) fn ckpt_protected(&self) {
        self.protected.inc();
    }

    /// A restore from replicas took `here` bytes from this node's own copies and replicas and
    /// `others` from the job's other nodes.
    pub(crate) fn restored_from_replicas(&self, here: u64, others: u64) {
        for (from, bytes) in [("this_node", here), ("other_nodes", others)] {
            self.replica_restore_bytes
                .get_or_create(&FromLabels { from })
                .inc_by(bytes);
        }
    }

    /// `operation` (`setup`, `stage`, `restore` or `archive`) failed with the error whose stable
    /// code is `code` (the error type's own `code()`).
    pub(crate) fn failure(&self, operation: &'static str, code: &'static str) {
        self.failures
            .get_or_create(&FailureLabels { operation, code })
            .inc();
    }

    /// The registry of the event metrics and the build info, under the `sluice_` prefix. The
    /// endpoint adds the scrape-time [`Snapshot`].
    fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix("sluice");
        r.register(
            "build",
            "The running agent's version and the socket protocol version it speaks",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
                protocol: sluice_proto::PROTO_VERSION.to_string(),
            }),
        );
        let events: [Series<Box<dyn Metric>>; 15] = [
            (
                "stage",
                "Bytes staged onto the hot tier, by the kind of the dataset's source",
                BYTES,
                Box::new(self.stage_bytes.clone()),
            ),
            (
                "stage_files",
                "Files staged onto the hot tier, by the kind of the dataset's source",
                None,
                Box::new(self.stage_files.clone()),
            ),
            (
                "origin",
                "Bytes read from datasets' origins (object stores, POSIX file systems) for staging",
                BYTES,
                Box::new(self.origin_bytes.clone()),
            ),
            (
                "peer",
                "Of the bytes staged, those taken from the job's other nodes instead of the origin",
                BYTES,
                Box::new(self.peer_bytes.clone()),
            ),
            (
                "stage_duration",
                "Time to stage one dataset completely, by the kind of its source",
                SECONDS,
                Box::new(self.stage_duration.clone()),
            ),
            (
                "restore_duration",
                "Time to put a job's --ckpt-restore checkpoint in place",
                SECONDS,
                Box::new(self.restore_duration.clone()),
            ),
            (
                "archive_duration",
                "Time to upload this node's part of a checkpoint (read, compress, hash, upload)",
                SECONDS,
                Box::new(self.archive_duration.clone()),
            ),
            (
                "archive",
                "Bytes of checkpoint files this node archived, as read from the hot tier",
                BYTES,
                Box::new(self.archive_bytes.clone()),
            ),
            (
                "archive_stored",
                "Bytes this node wrote to archives for those files, after compression",
                BYTES,
                Box::new(self.archive_stored_bytes.clone()),
            ),
            (
                "failures",
                "Failed set-ups, stagings, restores and archive attempts, by stable error code",
                None,
                Box::new(self.failures.clone()),
            ),
            (
                "connections_refused",
                "Connections to the agent's socket closed by admission (per-user or total limit)",
                None,
                Box::new(self.refused.clone()),
            ),
            (
                "replica",
                "Bytes of this node's checkpoint parts copied to other nodes of the job as replicas",
                BYTES,
                Box::new(self.replica_bytes.clone()),
            ),
            (
                "replicas_not_placed",
                "Times a node of the job did not take a replica of this node's part (no room, not reached)",
                None,
                Box::new(self.replicas_short.clone()),
            ),
            (
                "ckpt_protected",
                "Checkpoints of jobs on this node that became protected: every node's part held by as many other nodes as the job asks",
                None,
                Box::new(self.protected.clone()),
            ),
            (
                "replica_restore",
                "Bytes --ckpt-restore took from replicas, from this node's copies or the job's other nodes (none from the archive)",
                BYTES,
                Box::new(self.replica_restore_bytes.clone()),
            ),
        ];
        for (name, help, unit, metric) in events {
            let metric = AnyMetric(metric);
            match unit {
                Some(unit) => r.register_with_unit(name, help, unit.clone(), metric),
                None => r.register(name, help, metric),
            }
        }
        r
    }
}

/// Of a dataset's staged bytes, those read from its origin: what came from neither the job's other
/// nodes nor this node's cache (the cache counts its own, `sluice_cache_hit_bytes_total`), nor was
/// kept from before an agent restart.
fn origin_bytes(p: &StageProgress) -> u64 {
    p.bytes_done
        .saturating_sub(p.peer_bytes)
        .saturating_sub(p.cache_bytes)
        .saturating_sub(p.resumed_bytes)
}

/// The label value of a dataset's source.
fn source_kind(source: &Source) -> &'static str {
    match source {
        Source::Posix { .. } => "posix",
        Source::Object { scheme, .. } => match scheme {
            ObjectScheme::S3 => "s3",
            ObjectScheme::Azure => "azure",
            ObjectScheme::Gcs => "gcs",
        },
    }
}

/// The gauges read from the agent's state at each scrape.
pub(crate) struct Snapshot {
    jobs: Arc<JobTable>,
    hot: HotTier,
    cfg: Arc<Config>,
    cache: Option<Arc<Cache>>,
    workers: Arc<Workers>,
    /// Sizes of checkpoints waiting for their archive, by (job, tag, commit generation): a
    /// committed checkpoint's files do not change (if they do, it is committed again), so each is
    /// walked once, not at every scrape.
    sizes: Mutex<HashMap<(JobId, String, u64), u64>>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot").finish_non_exhaustive()
    }
}

/// Checkpoints committed on this node and not archived yet.
#[derive(Debug, Default, PartialEq, Eq)]
struct Backlog {
    /// Still being worked on: waiting for an upload, uploading, waiting for other nodes' parts,
    /// retrying after a failure.
    checkpoints: u64,
    bytes: u64,
    /// Given up until the user acts (refused, incomplete, changed too often).
    blocked: u64,
}

impl Snapshot {
    /// Reads the agent's job table, hot tier, configuration and cache at each scrape.
    pub(crate) fn new(
        jobs: Arc<JobTable>,
        hot: HotTier,
        cfg: Arc<Config>,
        cache: Option<Arc<Cache>>,
        workers: Arc<Workers>,
    ) -> Snapshot {
        Snapshot {
            jobs,
            hot,
            cfg,
            cache,
            workers,
            sizes: Mutex::new(HashMap::new()),
        }
    }

    /// Blocks: may walk checkpoint directories.
    fn backlog(&self) -> Backlog {
        let mut b = Backlog::default();
        let mut sizes = lock(&self.sizes);
        let mut seen = HashSet::new();
        for job in self.jobs.snapshot() {
            for e in job.ckpts.entries() {
                if e.state() == CkptState::Archived {
                    continue;
                }
                if e.action_needed() {
                    b.blocked += 1;
                    continue;
                }
                b.checkpoints += 1;
                let key = (job.start.job_id, e.tag.clone(), e.generation());
                let known = e.status("", 0).raw_bytes;
                let size = match sizes.get(&key) {
                    Some(s) => *s,
                    None if known > 0 => known,
                    None => {
                        let s = self.ckpt_size(&job, &e.tag);
                        sizes.insert(key.clone(), s);
                        s
                    }
                };
                seen.insert(key);
                b.bytes += size;
            }
        }
        sizes.retain(|k, _| seen.contains(k));
        b
    }

    /// The bytes of files in a job's checkpoint directory `tag` (0 if it cannot be read: the
    /// archive attempt will say why).
    fn ckpt_size(&self, job: &Job, tag: &str) -> u64 {
        let dir = self
            .hot
            .open_ckpt(job.start.job_id)
            .and_then(|d| sluice_core::safefs::open_dir(d, tag));
        let Ok(dir) = dir else { return 0 };
        sluice_archive::walk::walk(&dir, job.start.uid)
            .map(|t| t.files.iter().map(|f| f.size).sum())
            .unwrap_or(0)
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let usage = self.hot.usage();
        let high_water = f64::from(self.cfg.ckpt.high_water) / 100.0;
        let backlog = self.backlog();
        let mut jobs: HashMap<&'static str, u64> = HashMap::new();
        for j in self.jobs.snapshot() {
            *jobs.entry(j.state().as_str()).or_default() += 1;
        }
        let gauges: [Series<u64>; 5] = [
            (
                "hot_tier_used",
                "Bytes used on the hot tier's file system (by anyone)",
                BYTES,
                usage.used_bytes,
            ),
            (
                "hot_tier_capacity",
                "Size of the hot tier's file system",
                BYTES,
                usage.total_bytes,
            ),
            (
                "archive_backlog_checkpoints",
                "Checkpoints committed on this node and not archived yet that sluice is working on",
                None,
                backlog.checkpoints,
            ),
            (
                "archive_backlog",
                "Bytes of those checkpoints on this node",
                BYTES,
                backlog.bytes,
            ),
            (
                "archive_blocked_checkpoints",
                "Committed checkpoints sluice will not archive until their user acts (refused, incomplete, changing)",
                None,
                backlog.blocked,
            ),
        ];
        encode_series(&mut enc, gauges, ConstGauge::new)?;
        let ratio = (
            "hot_tier_high_water_ratio",
            "ckpt.high_water: above this fraction of the hot tier, archived checkpoints are trimmed",
            None,
            high_water,
        );
        encode_series(&mut enc, [ratio], ConstGauge::new)?;
        if let Some(cache) = &self.cache {
            encode_cache(&mut enc, &cache.stats())?;
        }
        encode_workers(&mut enc, &self.workers.statuses())?;
        let mut family = enc.encode_descriptor(
            "jobs",
            "Jobs in the agent's table, by state",
            None,
            MetricType::Gauge,
        )?;
        for state in [
            JobState::Staging,
            JobState::Ready,
            JobState::Failed,
            JobState::Ended,
        ] {
            let name = state.as_str();
            let v = ConstGauge::new(jobs.get(name).copied().unwrap_or(0));
            v.encode(family.encode_family(&StateLabels { state: name })?)?;
        }
        Ok(())
    }
}

/// Encodes series without labels, read at the scrape: each `(name, help, unit, value)` as the
/// metric `metric` makes of its value (a [`ConstGauge`] or a [`ConstCounter`]).
fn encode_series<V, M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    series: impl IntoIterator<Item = Series<V>>,
    metric: impl Fn(V) -> M,
) -> Result<(), std::fmt::Error> {
    for (name, help, unit, value) in series {
        let m = metric(value);
        m.encode(enc.encode_descriptor(name, help, unit, m.metric_type())?)?;
    }
    Ok(())
}

/// The cross-job cache's series, from its [`CacheStats`]: sizes as gauges, the counters since the
/// agent started as counters (they restart at 0 with it, which `rate()` and `increase()` expect).
fn encode_cache(enc: &mut DescriptorEncoder, c: &CacheStats) -> Result<(), std::fmt::Error> {
    let gauges: [Series<u64>; 5] = [
        (
            "cache_capacity",
            "The cross-job cache's size limit ([cache])",
            BYTES,
            c.capacity_bytes,
        ),
        (
            "cache_high_water",
            "Filling the cache past this evicts its least recently used entries",
            BYTES,
            c.high_water_bytes,
        ),
        (
            "cache_low_water",
            "Eviction stops when the cache is down to this",
            BYTES,
            c.low_water_bytes,
        ),
        (
            "cache_used",
            "Bytes of the cache's complete entries (fills in progress not counted)",
            BYTES,
            c.used_bytes,
        ),
        (
            "cache_entries",
            "Complete entries in the cache",
            None,
            c.entries,
        ),
    ];
    encode_series(enc, gauges, ConstGauge::new)?;
    let counters: [Series<u64>; 6] = [
        (
            "cache_hits",
            "Objects staged from this node's cache instead of being read again",
            None,
            c.hits,
        ),
        (
            "cache_misses",
            "Objects looked up in the cache and not there (or changed at the origin)",
            None,
            c.misses,
        ),
        (
            "cache_hit",
            "Bytes placed into jobs from the cache: origin traffic saved",
            BYTES,
            c.hit_bytes,
        ),
        (
            "cache_filled",
            "Bytes written into new cache entries",
            BYTES,
            c.filled_bytes,
        ),
        (
            "cache_evictions",
            "Cache entries evicted: least recently used past the high water or to give jobs room, or by sluice cache evict",
            None,
            c.evictions,
        ),
        (
            "cache_evicted",
            "Bytes of the evicted cache entries",
            BYTES,
            c.evicted_bytes,
        ),
    ];
    encode_series(enc, counters, ConstCounter::new)
}

/// The background workers (each job's checkpoint worker, housekeeping, the peer server): how many
/// run, and how many of them met an error in their last turn — a checkpoint that would not
/// archive, the peer port taken. Which ones, and why, is `sluice status`'s to say: a worker's name
/// holds a job id, which is no label.
fn encode_workers(
    enc: &mut DescriptorEncoder,
    workers: &[WorkerStatus],
) -> Result<(), std::fmt::Error> {
    let failing = workers.iter().filter(|w| w.last_error.is_some()).count();
    let gauges: [Series<usize>; 2] = [
        (
            "workers",
            "Background workers of the agent: one per job for its checkpoints, housekeeping, the peer server",
            None,
            workers.len(),
        ),
        (
            "workers_failing",
            "Of those, the ones whose last turn met an error (a checkpoint not archived, the peer port taken); sluice status says which and why",
            None,
            failing,
        ),
    ];
    encode_series(enc, gauges, |v| ConstGauge::new(v as u64))
}

/// Binds `[metrics] listen`, before the agent starts anything: a wrong address stops the agent
/// with the reason instead of leaving it unwatched.
pub async fn bind(cfg: &MetricsConfig) -> Result<TcpListener, MetricsError> {
    sluice_peer::http::bind_tcp(&cfg.listen.to_string())
        .await
        .map_err(|source| MetricsError::Listen {
            addr: cfg.listen,
            source,
        })
}

/// Serves `GET /metrics` on `listener` until `cancel` is cancelled, then waits for the connections
/// it started (each ends with the same token): the event `metrics` and, read at each scrape, the
/// `state` gauges.
pub(crate) async fn serve(
    metrics: Metrics,
    state: Snapshot,
    listener: TcpListener,
    cancel: CancellationToken,
) {
    let mut registry = metrics.registry();
    registry.register_collector(Box::new(state));
    let registry = Arc::new(registry);
    if let Ok(a) = listener.local_addr() {
        tracing::info!("metrics: serving http://{a}/metrics");
    }
    let limits = sluice_peer::http::Limits {
        max_connections: MAX_CONNECTIONS,
        max_per_source: MAX_CONNECTIONS,
        header_timeout: HEADER_TIMEOUT,
        max_buf_size: 16 << 10,
    };
    sluice_peer::http::serve("metrics", listener, cancel, limits, move |req, _remote| {
        answer(req, registry.clone())
    })
    .await;
}

async fn answer(req: Request<Incoming>, registry: Arc<Registry>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, text: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
        *r.status_mut() = status;
        r
    };
    if req.uri().path() != "/metrics" {
        return reply(StatusCode::NOT_FOUND, "sluice serves GET /metrics only\n");
    }
    if req.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, "GET /metrics\n");
    }
    let text = blocking(move || {
        let mut s = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut s, &registry).map(|()| s)
    })
    .await;
    match text {
        Ok(text) => {
            let mut r = Response::new(Full::new(Bytes::from(text)));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                ),
            );
            r
        }
        Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, "encoding failed\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The series of an exposition: `name{labels}` → value.
    fn series(text: &str) -> HashMap<String, f64> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.rsplit_once(' '))
            .map(|(k, v)| (k.to_string(), v.parse().expect("a number")))
            .collect()
    }

    fn exposition(m: &Metrics) -> String {
        let mut s = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut s, &m.registry()).unwrap();
        s
    }

    #[test]
    fn the_names_and_labels_admins_query() {
        let m = Metrics::default();
        // A family whose labels are not known in advance is left out until its first series
        // (the registry skips empty metrics, through `AnyMetric` too).
        assert!(!exposition(&m).contains("sluice_failures_total"));
        m.part_uploaded(
            Duration::from_millis(1500),
            &Err(ArchiveError::Modified {
                tag: "t".into(),
                path: "p".into(),
            }),
        );
        m.refused("user_limit");
        m.restored(Some("step-1"), Duration::from_secs(3));
        m.restored(None, Duration::from_secs(1));
        let text = exposition(&m);
        let s = series(&text);
        let v = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no {k} in\n{text}"));
        let version = env!("CARGO_PKG_VERSION");
        assert_eq!(
            v(&format!(
                "sluice_build_info{{version=\"{version}\",protocol=\"1\"}}"
            )),
            1.0
        );
        for source in SOURCES {
            for name in [
                "sluice_stage_bytes_total",
                "sluice_stage_files_total",
                "sluice_origin_bytes_total",
                "sluice_peer_bytes_total",
            ] {
                assert_eq!(v(&format!("{name}{{source=\"{source}\"}}")), 0.0);
            }
            assert_eq!(
                v(&format!(
                    "sluice_stage_duration_seconds_count{{source=\"{source}\"}}"
                )),
                0.0
            );
        }
        assert_eq!(
            v("sluice_failures_total{operation=\"archive\",code=\"modified\"}"),
            1.0
        );
        assert_eq!(
            v("sluice_connections_refused_total{reason=\"user_limit\"}"),
            1.0
        );
        assert_eq!(v("sluice_connections_refused_total{reason=\"full\"}"), 0.0);
        assert_eq!(v("sluice_restore_duration_seconds_count"), 1.0);
        assert_eq!(v("sluice_restore_duration_seconds_sum"), 3.0);
        assert_eq!(v("sluice_archive_duration_seconds_count"), 0.0);
        assert_eq!(v("sluice_archive_bytes_total"), 0.0);
        m.ckpt_protected();
        m.restored_from_replicas(5, 7);
        let text = exposition(&m);
        let s = series(&text);
        let v = |k: &str| *s.get(k).unwrap_or_else(|| panic!("no {k} in\n{text}"));
        assert_eq!(v("sluice_ckpt_protected_total"), 1.0);
        assert_eq!(
            v("sluice_replica_restore_bytes_total{from=\"this_node\"}"),
            5.0
        );
        assert_eq!(
            v("sluice_replica_restore_bytes_total{from=\"other_nodes\"}"),
            7.0
        );
        assert!(
            text.contains("# TYPE sluice_stage_bytes_total counter\n")
                && text.contains("# TYPE sluice_restore_duration_seconds histogram\n"),
            "{text}"
        );
    }

    /// The cache's series as a scrape shows them, from its stats.
    #[derive(Debug)]
    struct CacheOnly(CacheStats);

    impl Collector for CacheOnly {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_cache(&mut enc, &self.0)
        }
    }

    #[test]
    fn the_caches_sizes_and_counters() {
        const GIB: u64 = 1 << 30;
        let stats = sluice_proto::testing::cache_stats();
        let mut r = Registry::with_prefix("sluice");
        r.register_collector(Box::new(CacheOnly(stats)));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &r).unwrap();
        let s = series(&text);
        let gib = GIB as f64;
        let want = [
            ("sluice_cache_capacity_bytes", 100.0 * gib, "gauge"),
            ("sluice_cache_high_water_bytes", 90.0 * gib, "gauge"),
            ("sluice_cache_low_water_bytes", 75.0 * gib, "gauge"),
            ("sluice_cache_used_bytes", 33.0 * gib, "gauge"),
            ("sluice_cache_entries", 3.0, "gauge"),
            ("sluice_cache_hits_total", 7.0, "counter"),
            ("sluice_cache_misses_total", 1.0, "counter"),
            ("sluice_cache_hit_bytes_total", 56.0 * gib, "counter"),
            ("sluice_cache_filled_bytes_total", 45.0 * gib, "counter"),
            ("sluice_cache_evictions_total", 2.0, "counter"),
            ("sluice_cache_evicted_bytes_total", 12.0 * gib, "counter"),
        ];
        for (name, value, kind) in want {
            assert_eq!(s.get(name), Some(&value), "{name} in\n{text}");
            assert!(
                text.contains(&format!("# TYPE {name} {kind}\n")),
                "{name} is not a {kind}:\n{text}"
            );
        }
        // Nothing else: no labels, so no series per entry, user or path.
        assert_eq!(s.len(), want.len(), "{text}");
        assert!(!text.contains("/hot/cache"), "{text}");
    }

    /// The workers' series as a scrape shows them, from their statuses.
    #[derive(Debug)]
    struct WorkersOnly(Vec<WorkerStatus>);

    impl Collector for WorkersOnly {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_workers(&mut enc, &self.0)
        }
    }

    #[test]
    fn workers_and_the_failing_ones() {
        let worker = |name: &str, job_id, last_error: Option<&str>| WorkerStatus {
            name: name.into(),
            job_id,
            state: "idle".into(),
            since: 1,
            turns: 3,
            last_error: last_error.map(String::from),
        };
        let workers = vec![
            worker("housekeeping", None, None),
            worker("ckpt job 42", Some(42), None),
            worker("ckpt job 43", Some(43), Some("s3://b/x: 503 Slow Down")),
        ];
        let mut r = Registry::with_prefix("sluice");
        r.register_collector(Box::new(WorkersOnly(workers)));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &r).unwrap();
        let s = series(&text);
        assert_eq!(s.get("sluice_workers"), Some(&3.0), "{text}");
        assert_eq!(s.get("sluice_workers_failing"), Some(&1.0), "{text}");
        assert!(
            text.contains("# TYPE sluice_workers_failing gauge\n"),
            "{text}"
        );
        // No series per worker: neither a job id nor an error in a label.
        assert_eq!(s.len(), 2, "{text}");
        assert!(!text.contains("43") && !text.contains("s3://"), "{text}");
    }

    #[test]
    fn bytes_from_peers_and_the_cache_are_not_the_origins() {
        let p = StageProgress {
            name: "ds".into(),
            source: "s3://b/ds".into(),
            state: StageState::Done,
            files_done: 3,
            files_total: Some(3),
            bytes_done: 100,
            bytes_total: Some(100),
            origin_bytes: 10,
            peer_bytes: 30,
            cache_bytes: 60,
            resumed_bytes: 0,
            elapsed_ms: 1,
            error: None,
        };
        assert_eq!(origin_bytes(&p), 10);
        let all_cached = StageProgress {
            peer_bytes: 0,
            cache_bytes: 100,
            resumed_bytes: 0,
            ..p.clone()
        };
        assert_eq!(origin_bytes(&all_cached), 0);
        let cold = StageProgress {
            peer_bytes: 0,
            cache_bytes: 0,
            resumed_bytes: 0,
            ..p
        };
        assert_eq!(origin_bytes(&cold), 100);
    }
}
