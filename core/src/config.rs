//! The site's configuration (`sluice.toml`, read by the agent and by the CLI's URL mode): TOML into a
//! raw serde struct (unknown keys refused), then validated into
//! [`Config`]. `%n` in paths becomes the node name, so one file serves every node.
//!
//! Plain data only: the `[retry]` section is sluice's [`RetryPolicy`] (sluice-archive builds
//! object_store's retry configuration from it), a store profile's `data_class` is checked and
//! spelled here ([`check_data_class`]), and the one figure that depends on the archive engine, how
//! many bytes of buffers a checkpoint upload holds, is asked of the caller at parse time
//! ([`Config::parse`]'s `upload_memory`: `sluice_archive::upload_memory`).

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    agent: RawAgent,
    hot_tier: RawHotTier,
    #[serde(default)]
    stage: RawStage,
    #[serde(default)]
    ckpt: RawCkpt,
    #[serde(default)]
    retry: RawRetry,
    #[serde(default)]
    store: Vec<StoreProfile>,
    peer: Option<RawPeer>,
    metrics: Option<RawMetrics>,
    shared_tier: Option<RawSharedTier>,
    cache: Option<RawCache>,
    fast_tier: Option<RawFastTier>,
}

/// `[fast_tier]`: the RAM tier for `--ckpt-tier=ram`; off without the section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFastTier {
    root: String,
    capacity: String,
    job_share: String,
    #[serde(default)]
    flush_block: Option<String>,
    #[serde(default)]
    mount: Option<bool>,
    #[serde(default)]
    replicas: Option<u8>,
    #[serde(default)]
    max_replicas: Option<u8>,
    #[serde(default)]
    replica_room: Option<String>,
    #[serde(default)]
    topology: Option<String>,
}

/// `[cache]`: the cross-job cache on the hot tier; off without the section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCache {
    #[serde(default)]
    size: Option<String>,
    high_water: Option<u8>,
    low_water: Option<u8>,
    min_free: Option<u8>,
    link_hits: Option<bool>,
}

/// `[metrics]`: the Prometheus endpoint; off without the section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    listen: String,
    #[serde(default)]
    nodes: BTreeMap<String, String>,
}

/// `[peer]`: transfers between the agents of a job's nodes; off without the section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPeer {
    listen: Option<String>,
    secret_file: Option<String>,
    unit_size: Option<String>,
    concurrency: Option<usize>,
    addr: Option<String>,
    connect_timeout: Option<String>,
    read_timeout: Option<String>,
    fallback_concurrency: Option<usize>,
    fallback_rate: Option<String>,
    #[serde(default)]
    nodes: BTreeMap<String, String>,
}

/// The retry policy of every object-store request; unset keys keep object_store's defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    max_retries: Option<usize>,
    timeout: Option<String>,
    initial_backoff: Option<String>,
    max_backoff: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCkpt {
    default_archive: Option<String>,
    keep: Option<u32>,
    scan_interval: Option<String>,
    epilog_wait: Option<String>,
    publish_wait: Option<String>,
    retry_pause_max: Option<String>,
    part_size: Option<String>,
    concurrency: Option<usize>,
    zstd_level: Option<i32>,
    bandwidth_limit: Option<String>,
    high_water: Option<u8>,
    #[serde(default)]
    allow: Vec<AllowRule>,
}

/// An archive prefix some users or groups may write to. `{user}` is replaced by the job's user.
/// With no `users` and no `groups`, the rule applies to everyone.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AllowRule {
    pub prefix: String,
    #[serde(default)]
    pub users: Vec<String>,
    #[serde(default)]
    pub groups: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    socket: String,
    state_dir: String,
    squeue: Option<String>,
    drain_timeout: Option<String>,
    housekeeping_interval: Option<String>,
    log_format: Option<String>,
    memory: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHotTier {
    root: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStage {
    concurrency: Option<usize>,
    part_size: Option<String>,
    memory: Option<String>,
    timeout: Option<String>,
    #[serde(default)]
    allow: Vec<AllowRule>,
}

/// Endpoint and credentials for the object-store URLs that start with `prefix`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StoreProfile {
    /// `s3://`, `s3://bucket`, `az://container/prefix`, ... — the longest matching prefix wins.
    pub prefix: String,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    #[serde(default)]
    pub allow_http: bool,
    /// Azure: use Azurite's well-known development account.
    #[serde(default)]
    pub use_emulator: bool,
    /// Azure storage account and key.
    pub account: Option<String>,
    pub access_key: Option<String>,
    /// GCS: path of a service-account JSON file.
    pub service_account_path: Option<String>,
    /// The storage class (S3: `STANDARD_IA`, `GLACIER_IR`, ...; GCS: `NEARLINE`, ...) or access
    /// tier (Azure: `Hot`, `Cool`, `Cold`, `Archive`) of the checkpoint data objects written to
    /// archives in this profile's buckets; MANIFESTs stay in the default class. Checked against
    /// the prefix's store and spelled as the store spells it once parsed ([`check_data_class`]).
    pub data_class: Option<String>,
}

#[derive(Debug, Clone)]
pub struct StageConfig {
    /// Object-store requests in flight on this node, over every dataset of every job.
    pub concurrency: usize,
    /// Objects larger than this are fetched as parallel ranged GETs of this size.
    pub part_size: u64,
    /// Bytes of download buffers on this node, over every request: each request streams its body
    /// through one buffer of `memory / concurrency` bytes (the agent's stage budget).
    pub memory: u64,
    pub timeout: Duration,
    /// Object-store prefixes users may stage from (`{user}` = the job's user). The agent reads
    /// object stores with its own credentials, so without a matching rule an object-store source is
    /// refused. POSIX sources need no rule: they are read with the job user's own permissions.
    pub allow: Vec<AllowRule>,
}

/// Checkpoint archiving and retention.
#[derive(Debug, Clone)]
pub struct CkptConfig {
    /// Archive URL for jobs without `--ckpt-archive`; `{user}`, `{job_id}`, `{job_name}` are replaced.
    pub default_archive: Option<String>,
    /// Prefixes archives may use; empty = none (every archive URL is refused).
    pub allow: Vec<AllowRule>,
    /// Default `--ckpt-keep`.
    pub keep: u32,
    /// How often checkpoint directories are rescanned for frameworks' completion signals.
    pub scan_interval: Duration,
    /// How long job end waits for pending archives before leaving them to the agent.
    pub epilog_wait: Duration,
    /// How long a node whose part is archived waits for the parts of the job's other nodes before
    /// it gives the checkpoint up as incomplete (kept on the hot tier, never trimmed).
    pub publish_wait: Duration,
    /// The longest pause before a failed archive (or flush) of a checkpoint is attempted again:
    /// the pause doubles from 2 s after each failed attempt up to this.
    pub retry_pause_max: Duration,
    pub part_size: u64,
    pub concurrency: usize,
    pub zstd_level: i32,
    /// Bytes per second for archive uploads on this node; `None` = unlimited.
    pub bandwidth_limit: Option<u64>,
    /// Percent of the hot tier's size above which archived checkpoints of ended jobs are trimmed.
    pub high_water: u8,
}

/// How `sluiced` writes its log (`[agent] log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub node: String,
    pub log_format: LogFormat,
    /// `squeue`, asked after a restart whether journaled jobs still run; `None` = never ask.
    pub squeue: Option<PathBuf>,
    /// How long a stopping agent waits for its requests and background work to return (they resume
    /// from the journal on the next start).
    pub drain_timeout: Duration,
    /// How often housekeeping runs: ends jobs learnt of from a step once Slurm no longer runs
    /// them, prunes old upload resume logs, trims the hot tier above its high-water mark.
    pub housekeeping_interval: Duration,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub hot_root: PathBuf,
    pub stage: StageConfig,
    pub ckpt: CkptConfig,
    pub stores: Vec<StoreProfile>,
    /// How every object-store client built from this config retries a failed request (5xx, 429,
    /// connection errors, timeouts of idempotent requests): the one retry policy of the agent and
    /// the CLI. Work re-queued after a request finally failed waits on top of it, never in a loop
    /// around it.
    pub retry: RetryPolicy,
    /// Peer transfers between the agents of a job; `None` = off (every node reads the origin).
    pub peer: Option<PeerConfig>,
    /// The Prometheus endpoint; `None` = off (no listener).
    pub metrics: Option<MetricsConfig>,
    /// The shared fast tier for `--stage-tier=shared`; `None` = none on this node (such jobs are
    /// refused).
    pub shared_tier: Option<SharedTierConfig>,
    /// The cross-job cache on the hot tier; `None` = off (every job stages from the origin).
    pub cache: Option<CacheConfig>,
    /// The RAM tier for `--ckpt-tier=ram`; `None` = none on this node (such jobs are refused).
    pub fast_tier: Option<FastTierConfig>,
    /// `[agent] memory`: the node's budget of data buffers, which stage-in's download buffers
    /// (`stage.memory`) and a checkpoint archive's in-flight buffers (chunks being compressed,
    /// parts being uploaded: `sluice_archive::upload_memory`) are both drawn from; parsing refuses a
    /// `[stage]`/`[ckpt]` whose sum exceeds it. `None` = not set (no check).
    pub memory: Option<u64>,
}

impl Config {
    /// How many checkpoint uploads may run at once on the node, over all jobs: as many as
    /// `[agent] memory` holds beside the stage-in budget, each holding `upload_memory` bytes of
    /// buffers (`sluice_archive::upload_memory`), at least one (parsing refuses a budget that holds
    /// less); `None` (no limit) without a budget.
    pub fn upload_slots(&self, upload_memory: u64) -> Option<usize> {
        let budget = self.memory?;
        Some((budget.saturating_sub(self.stage.memory) / upload_memory.max(1)).max(1) as usize)
    }
}

/// The `[retry]` section: how every object-store client built from the config retries a failed
/// request. Unset keys keep object_store's defaults ([`RetryPolicy::default`], which
/// sluice-archive's tests hold to object_store's own); sluice-archive turns it into object_store's
/// `RetryConfig` (exponential backoff, base 2, with jitter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// `max_retries`: retries after the first attempt.
    pub max_retries: usize,
    /// `timeout`: no retry starts later than this after the first attempt.
    pub timeout: Duration,
    /// `initial_backoff`: the first pause between attempts.
    pub initial_backoff: Duration,
    /// `max_backoff`: the longest pause between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    /// object_store's defaults.
    fn default() -> Self {
        RetryPolicy {
            max_retries: 10,
            timeout: Duration::from_secs(3 * 60),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
        }
    }
}

/// `[fast_tier]`: checkpoints saved at memory speed. Each `--ckpt-tier=ram` job gets its own
/// tmpfs of `job_share` bytes at `<root>/jobs/<id>` (`$SLUICE_CKPT_DIR` is its `ckpt`), as long as
/// the node's jobs together stay within `capacity`; committed checkpoints are flushed to the NVMe
/// hot tier and archived from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FastTierConfig {
    pub root: PathBuf,
    pub capacity: u64,
    pub job_share: u64,
    /// The flush's read/write block (four of them per flush, 4 KiB-aligned).
    pub flush_block: u64,
    /// Mount a tmpfs per job (the share is then a hard limit); `false`: `root` is already a
    /// tmpfs the admin mounted, and the share is not enforced by the kernel.
    pub mount: bool,
    /// Other nodes of the job each committed checkpoint's files are copied to (0: none), for a
    /// job that does not say (`--ckpt-replicas`).
    pub replicas: u8,
    /// The most a job may ask for with `--ckpt-replicas` (at least `replicas`).
    pub max_replicas: u8,
    /// The bytes of RAM this node gives to other nodes' replicas, beside `capacity` (its own tmpfs
    /// at `<root>/replicas` when `mount`); 0 when `max_replicas` is 0.
    pub replica_room: u64,
    /// Slurm's `topology.conf`, whose leaf switches (or blocks) replicas are placed apart by;
    /// `None`: placed by rendezvous hashing alone.
    pub topology: Option<PathBuf>,
}

/// Where Slurm keeps `topology.conf` in Debian's and SchedMD's packages.
pub const SLURM_TOPOLOGY: &str = "/etc/slurm/topology.conf";

/// The most replicas `fast_tier.replicas` and `max_replicas` may ask for (the most a job's
/// `--ckpt-replicas` may give, `sluice_proto::options::MAX_CKPT_REPLICAS`).
pub const MAX_REPLICAS: u8 = 3;

fn fast_tier_config(raw: &RawFastTier, node: &str) -> Result<FastTierConfig, String> {
    let root = substitute(&raw.root, node);
    if !root.is_absolute() {
        return Err(format!(
            "fast_tier.root must be an absolute path (e.g. \"/dev/shm/sluice/%n\"), got '{}'",
            root.display()
        ));
    }
    let size = |what: &str, v: &str| parse_size(v).map_err(|e| format!("fast_tier.{what}: {e}"));
    let c = FastTierConfig {
        root,
        capacity: size("capacity", &raw.capacity)?,
        job_share: size("job_share", &raw.job_share)?,
        flush_block: match raw.flush_block.as_deref() {
            Some(b) => size("flush_block", b)?,
            None => 8 << 20,
        },
        mount: raw.mount.unwrap_or(true),
        replicas: raw.replicas.unwrap_or(0),
        max_replicas: raw.max_replicas.or(raw.replicas).unwrap_or(0),
        replica_room: 0,
        topology: match raw.topology.as_deref() {
            None => Some(PathBuf::from(SLURM_TOPOLOGY)),
            Some("") => None,
            Some(p) if Path::new(p).is_absolute() => Some(PathBuf::from(p)),
            Some(p) => {
                return Err(format!(
                    "fast_tier.topology must be an absolute path (Slurm's topology.conf) or \"\" for none, got '{p}'"
                ));
            }
        },
    };
    if c.replicas > MAX_REPLICAS {
        return Err(format!(
            "fast_tier.replicas must be between 0 and {MAX_REPLICAS}, got {}",
            c.replicas
        ));
    }
    if c.max_replicas > MAX_REPLICAS || c.max_replicas < c.replicas {
        return Err(format!(
            "fast_tier.max_replicas must be between fast_tier.replicas ({}) and {MAX_REPLICAS}, got {}",
            c.replicas, c.max_replicas
        ));
    }
    let c = FastTierConfig {
        replica_room: match (c.max_replicas, raw.replica_room.as_deref()) {
            (0, _) => 0,
            (_, None) => c.job_share,
            (_, Some(r)) => match size("replica_room", r)? {
                0 => return Err("fast_tier.replica_room must be more than 0 bytes when fast_tier.replicas or max_replicas is set (say how much RAM other nodes' replicas may take, e.g. \"64GiB\")".into()),
                room => room,
            },
        },
        ..c
    };
    if c.job_share == 0 || c.job_share > c.capacity {
        return Err(format!(
            "fast_tier.job_share must be between 1 byte and fast_tier.capacity ({} bytes), got {}",
            c.capacity, c.job_share
        ));
    }
    if c.flush_block < 1 << 20 || c.flush_block > 256 << 20 || !c.flush_block.is_multiple_of(4096) {
        return Err(format!(
            "fast_tier.flush_block must be a multiple of 4KiB between 1MiB and 256MiB, got {}",
            c.flush_block
        ));
    }
    Ok(c)
}

/// `[cache]`: datasets staged on this node are kept in `<hot_tier.root>/cache` for later jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    pub size: CacheSize,
    /// Percent of the size: a fill that would pass `high_water` first evicts the least recently
    /// used entries down to `low_water`.
    pub high_water: u8,
    pub low_water: u8,
    /// Percent of the hot tier's file system the cache always leaves free (for staging and
    /// checkpoints): a fill that would take it below evicts, or is not cached.
    pub min_free: u8,
    /// A hit of a job that stages alone on the node's hot tier is a hard link to the entry, made
    /// read-only and root's, rather than a copy (`stage::cache`).
    pub link_hits: bool,
}

/// How large the cache may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSize {
    /// Bytes.
    Bytes(u64),
    /// Percent of the hot tier's file-system size.
    Percent(u8),
}

impl CacheConfig {
    /// The size limit in bytes, on a hot tier of `fs_bytes`.
    pub fn capacity(&self, fs_bytes: u64) -> u64 {
        match self.size {
            CacheSize::Bytes(b) => b,
            CacheSize::Percent(p) => fs_bytes / 100 * p as u64,
        }
    }
}

fn cache_config(raw: &RawCache) -> Result<CacheConfig, String> {
    let size = match raw.size.as_deref().map(str::trim) {
        None => CacheSize::Percent(50),
        Some(s) => match s.strip_suffix('%') {
            Some(p) => {
                let p: u8 = p.trim().parse().map_err(|_| {
                    format!("cache.size must be a percent of the hot tier (\"50%\") or a size (\"200GiB\"), got '{s}'")
                })?;
                within(
                    p,
                    1..=95,
                    "cache.size in percent of the hot tier must be 1%..=95%",
                )?;
                CacheSize::Percent(p)
            }
            None => {
                let b = parse_size(s).map_err(|e| format!("cache.size: {e}"))?;
                if b < 1 << 20 {
                    return Err(format!("cache.size must be at least 1MiB, got '{s}'"));
                }
                CacheSize::Bytes(b)
            }
        },
    };
    let c = CacheConfig {
        size,
        high_water: raw.high_water.unwrap_or(90),
        low_water: raw.low_water.unwrap_or(75),
        min_free: raw.min_free.unwrap_or(5),
        link_hits: raw.link_hits.unwrap_or(false),
    };
    within(
        c.high_water,
        1..=100,
        "cache.high_water must be 1..=100 (percent of cache.size)",
    )?;
    if c.low_water >= c.high_water {
        return Err(format!(
            "cache.low_water ({}) must be below cache.high_water ({}): eviction goes from the high watermark down to the low one",
            c.low_water, c.high_water
        ));
    }
    within(
        c.min_free,
        0..=50,
        "cache.min_free must be 0..=50 (percent of the hot tier)",
    )?;
    Ok(c)
}

/// `[metrics]`: where this node's agent serves `GET /metrics` (Prometheus text format).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// `listen`, or this node's entry of `[metrics.nodes]` (several agents on one host).
    pub listen: std::net::SocketAddr,
}

fn metrics_config(raw: &RawMetrics, node: &str) -> Result<MetricsConfig, String> {
    let (what, addr) = match raw.nodes.get(node) {
        Some(a) => (format!("metrics.nodes.{node}"), a.as_str()),
        None => ("metrics.listen".to_string(), raw.listen.as_str()),
    };
    let listen: std::net::SocketAddr = addr.parse().map_err(|_| {
        format!("{what} must be IP:port (e.g. \"0.0.0.0:9464\" or \"[::]:9464\"), got '{addr}'")
    })?;
    if listen.port() == 0 {
        return Err(format!(
            "{what} needs a fixed port for Prometheus to scrape, got '{addr}'"
        ));
    }
    Ok(MetricsConfig { listen })
}

/// `[peer]`: how this node's agent serves and fetches units of a job's datasets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    /// `host:port` this node's agent listens on for peers; by default this node's own peer address.
    pub listen: String,
    /// The cluster secret: root's, mode 0600, the same file on every node.
    pub secret_file: PathBuf,
    /// Files are split into units of this size, each read from the origin by one owner node.
    pub unit_size: u64,
    /// Unit transfers at once on each side (served, fetched); each holds up to `unit_size` bytes.
    pub concurrency: usize,
    pub connect_timeout: Duration,
    /// The longest silence while a unit's bytes arrive.
    pub read_timeout: Duration,
    /// Origin requests at once, over all of a job's nodes, for units whose owner could not serve
    /// them (its agent lost, its own read failed): each node takes its share, at least one.
    pub fallback_concurrency: usize,
    /// Bytes a second, over all of a job's nodes, of those reads; `None`: not paced.
    pub fallback_rate: Option<u64>,
    /// `host:port` of a node's agent, `%n` for the node name.
    addr: String,
    /// Addresses of named nodes, taking precedence over `addr`.
    nodes: BTreeMap<String, String>,
}

impl PeerConfig {
    /// Where the agent of `node` listens for peers.
    pub fn addr_of(&self, node: &str) -> String {
        self.nodes
            .get(node)
            .cloned()
            .unwrap_or_else(|| self.addr.replace("%n", node))
    }
}

/// Checks that `addr` is `host:port` (a `[v6]` host in brackets), the shape every peer address has.
fn check_host_port(what: &str, addr: &str) -> Result<(), String> {
    let port = addr
        .rsplit_once(':')
        .filter(|(host, _)| !host.is_empty() && !host.contains(char::is_whitespace))
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .filter(|p| *p > 0);
    match port {
        Some(_) => Ok(()),
        None => Err(format!(
            "{what} must be host:port (e.g. \"%n:7070\" or \"127.0.0.1:7071\"), got '{addr}'"
        )),
    }
}

fn peer_config(raw: &RawPeer, node: &str) -> Result<PeerConfig, String> {
    let addr = raw.addr.clone().unwrap_or_else(|| "%n:7070".to_string());
    check_host_port("peer.addr", &addr.replace("%n", node))?;
    for (name, a) in &raw.nodes {
        check_host_port(&format!("peer.nodes.{name}"), a)?;
    }
    let mut cfg = PeerConfig {
        listen: String::new(),
        secret_file: substitute(
            raw.secret_file.as_deref().unwrap_or("/etc/sluice/peer.key"),
            node,
        ),
        unit_size: size(raw.unit_size.as_deref(), 64 << 20)?,
        concurrency: raw.concurrency.unwrap_or(8),
        connect_timeout: duration(
            "peer.connect_timeout",
            raw.connect_timeout.as_deref(),
            Duration::from_secs(5),
        )?,
        read_timeout: duration(
            "peer.read_timeout",
            raw.read_timeout.as_deref(),
            Duration::from_secs(30),
        )?,
        fallback_concurrency: raw.fallback_concurrency.unwrap_or(16),
        fallback_rate: match size(raw.fallback_rate.as_deref(), 0)? {
            0 => None,
            rate => Some(rate),
        },
        addr,
        nodes: raw.nodes.clone(),
    };
    cfg.listen = match &raw.listen {
        Some(l) => l.replace("%n", node),
        None => cfg.addr_of(node),
    };
    check_host_port("peer.listen", &cfg.listen)?;
    if !cfg.secret_file.is_absolute() {
        return Err(format!(
            "peer.secret_file must be an absolute path, got '{}'",
            cfg.secret_file.display()
        ));
    }
    within(
        cfg.unit_size,
        1 << 20..=1 << 30,
        "peer.unit_size must be between 1MiB and 1GiB",
    )?;
    within(cfg.concurrency, 1..=256, "peer.concurrency must be 1..=256")?;
    within(
        cfg.fallback_concurrency,
        1..=4096,
        "peer.fallback_concurrency must be 1..=4096",
    )?;
    if let Some(rate) = cfg.fallback_rate {
        within(
            rate,
            1 << 20..=1 << 40,
            "peer.fallback_rate must be between 1MiB and 1TiB (a second), or 0 for no pacing",
        )?;
    }
    if cfg.unit_size * cfg.concurrency as u64 > 16 << 30 {
        return Err(format!(
            "peer.unit_size × peer.concurrency is the memory peer transfers may hold on each side and must be at most 16GiB, got {} × {}",
            cfg.unit_size, cfg.concurrency
        ));
    }
    if !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&cfg.connect_timeout) {
        return Err(format!(
            "peer.connect_timeout must be between 100ms and 1min, got {}",
            humantime::format_duration(cfg.connect_timeout)
        ));
    }
    if !(Duration::from_secs(1)..=Duration::from_secs(600)).contains(&cfg.read_timeout) {
        return Err(format!(
            "peer.read_timeout must be between 1s and 10min, got {}",
            humantime::format_duration(cfg.read_timeout)
        ));
    }
    Ok(cfg)
}

/// `[shared_tier]`: a directory every node of a job sees (Lustre, BeeOND), for
/// `--stage-tier=shared`; none without the section.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSharedTier {
    job_dir: String,
    lfs: Option<String>,
    #[serde(default)]
    stripe: Vec<RawStripe>,
}

/// `[[shared_tier.stripe]]`: one file-size class's Lustre layout.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStripe {
    min_size: String,
    count: i64,
    size: String,
}

/// `[shared_tier]`: where `--stage-tier=shared` jobs get their datasets. Each file is written once,
/// by its owner node, into the job's directory, which all of the job's nodes see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedTierConfig {
    /// As written: an absolute path whose last component holds `%j` (the job id), e.g.
    /// `/lustre/scratch/sluice/%j`. sluice creates the job's directory and removes it at job end.
    pub job_dir: String,
    /// `lfs`, run as the job user to give each staged file its Lustre stripe layout; a bare name is
    /// looked up on PATH when it runs.
    pub lfs: PathBuf,
    /// Stripe layouts by file size, `min_size` strictly increasing. Empty: every file keeps the
    /// job directory's default layout (also the only choice off Lustre).
    pub stripes: Vec<StripeClass>,
}

impl SharedTierConfig {
    /// The job's directory: `job_dir` with `%j` replaced by the job id.
    pub fn job_dir_for(&self, job_id: u32) -> PathBuf {
        self.root().join(self.job_dir_name(job_id))
    }

    /// The directory the jobs' directories are made in (`job_dir` without its last component):
    /// the admin's, shared by every node; it must exist.
    pub fn root(&self) -> &Path {
        Path::new(&self.job_dir).parent().unwrap_or(Path::new("/"))
    }

    /// The job's directory's name in [`root`](Self::root): one path component, `%j` replaced.
    pub fn job_dir_name(&self, job_id: u32) -> String {
        let name = Path::new(&self.job_dir)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        name.replace("%j", &job_id.to_string())
    }
}

/// One `[[shared_tier.stripe]]`: files of at least `min_size` bytes (and below the next class's)
/// are striped over `count` OSTs in stripes of `size` bytes (`lfs setstripe -c COUNT -S SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeClass {
    pub min_size: u64,
    /// OSTs to stripe over: 1..=2000, or -1 for all of them.
    pub count: i32,
    /// Bytes per stripe: a multiple of 64 KiB below 4 GiB (Lustre's rule).
    pub size: u64,
}

impl StripeClass {
    /// The class for a file of `size` bytes: the one with the largest `min_size` ≤ `size`. `None`
    /// for a file smaller than every class's `min_size` (it keeps the directory's default layout).
    pub fn for_size(classes: &[StripeClass], size: u64) -> Option<&StripeClass> {
        classes
            .iter()
            .filter(|c| c.min_size <= size)
            .max_by_key(|c| c.min_size)
    }
}

fn shared_tier_config(raw: &RawSharedTier) -> Result<SharedTierConfig, String> {
    let j = &raw.job_dir;
    let path = Path::new(j);
    let example = "e.g. \"/lustre/scratch/sluice/%j\"";
    if !path.is_absolute() {
        return Err(format!(
            "shared_tier.job_dir must be an absolute path ({example}), got '{j}'"
        ));
    }
    if path
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return Err(format!(
            "shared_tier.job_dir must not contain '..' ({example}), got '{j}'"
        ));
    }
    if j.contains("%n") {
        return Err(format!(
            "shared_tier.job_dir is one directory for all of a job's nodes, so it cannot contain %n: write the path every node sees it at ({example}), got '{j}'"
        ));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let parent = path.parent().unwrap_or(Path::new("/"));
    if !name.contains("%j") || parent.to_string_lossy().contains("%j") {
        return Err(format!(
            "shared_tier.job_dir must end in a directory per job: %j (the job id) in its last component and nowhere else ({example}); sluice creates that directory for each job and removes it at job end. Got '{j}'"
        ));
    }
    if parent == Path::new("/") {
        return Err(format!(
            "shared_tier.job_dir must be in a directory of the shared file system, not in / ({example}), got '{j}'"
        ));
    }
    let lfs = PathBuf::from(raw.lfs.as_deref().unwrap_or("lfs"));
    let bare = lfs.components().count() == 1 && !lfs.is_absolute();
    if lfs.as_os_str().is_empty() || !(bare || lfs.is_absolute()) {
        return Err(format!(
            "shared_tier.lfs must be an absolute path (e.g. \"/usr/bin/lfs\") or a command name looked up on PATH (\"lfs\"), got '{}'",
            lfs.display()
        ));
    }
    let mut stripes = Vec::with_capacity(raw.stripe.len());
    for s in &raw.stripe {
        let what = format!("[[shared_tier.stripe]] with min_size = \"{}\"", s.min_size);
        let min_size = parse_size(&s.min_size).map_err(|e| format!("{what}: min_size {e}"))?;
        let count = i32::try_from(s.count)
            .ok()
            .filter(|c| *c == -1 || (1..=2000).contains(c))
            .ok_or_else(|| {
                format!(
                    "{what}: count must be -1 (all OSTs) or a number of OSTs 1..=2000, got {}",
                    s.count
                )
            })?;
        let size = parse_size(&s.size).map_err(|e| format!("{what}: size {e}"))?;
        if size == 0 || size % (64 << 10) != 0 || size >= 4 << 30 {
            return Err(format!(
                "{what}: size must be a multiple of 64KiB below 4GiB (Lustre's rule), e.g. \"1MiB\" or \"4MiB\", got '{}' ({size} bytes)",
                s.size
            ));
        }
        stripes.push(StripeClass {
            min_size,
            count,
            size,
        });
    }
    stripes.sort_by_key(|c| c.min_size);
    if let Some(w) = stripes.windows(2).find(|w| w[0].min_size == w[1].min_size) {
        return Err(format!(
            "two [[shared_tier.stripe]] classes have min_size {} bytes: give each class its own min_size",
            w[0].min_size
        ));
    }
    Ok(SharedTierConfig {
        job_dir: j.clone(),
        lfs,
        stripes,
    })
}

fn duration(what: &str, v: Option<&str>, default: Duration) -> Result<Duration, String> {
    v.map(|t| humantime::parse_duration(t).map_err(|e| format!("{what} '{t}': {e}")))
        .transpose()
        .map(|d| d.unwrap_or(default))
}

/// A size setting ([`parse_size`]), `default` when unset.
fn size(v: Option<&str>, default: u64) -> Result<u64, String> {
    v.map(parse_size).transpose().map(|s| s.unwrap_or(default))
}

/// `Err("{what}, got {v}")` unless `v` lies in `range`: the one shape of every range check of the
/// configuration and the archive settings.
pub fn within<T: PartialOrd + std::fmt::Display>(
    v: T,
    range: std::ops::RangeInclusive<T>,
    what: &str,
) -> Result<(), String> {
    if range.contains(&v) {
        Ok(())
    } else {
        Err(format!("{what}, got {v}"))
    }
}

/// Parses a size such as `16MiB`, `1GB`, `4096`.
/// A size as this file writes sizes, in MiB (fractions to 0.1 MiB).
fn mib(bytes: u64) -> String {
    let m = bytes as f64 / (1u64 << 20) as f64;
    if m.fract() == 0.0 {
        format!("{m:.0}MiB")
    } else {
        format!("{m:.1}MiB")
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 4096, 16MiB, 2GiB)"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "KB" => 1000,
        "M" | "MiB" => 1 << 20,
        "MB" => 1_000_000,
        "G" | "GiB" => 1 << 30,
        "GB" => 1_000_000_000,
        "T" | "TiB" => 1 << 40,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit '{other}' in '{s}' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

/// The `[retry]` section, checked. At least one retry, and a timeout no shorter than
/// object_store's 30 s request timeout, so that an error reported as "after retries" was retried (a
/// request that timed out after the retry timeout is not retried); at most 15 minutes, because
/// retries reuse the signed request and S3 refuses a signature older than that (object_store
/// advises staying under 5 minutes).
fn retry_policy(raw: &RawRetry) -> Result<RetryPolicy, String> {
    let d = RetryPolicy::default();
    let r = RetryPolicy {
        max_retries: raw.max_retries.unwrap_or(d.max_retries),
        timeout: duration("retry.timeout", raw.timeout.as_deref(), d.timeout)?,
        initial_backoff: duration(
            "retry.initial_backoff",
            raw.initial_backoff.as_deref(),
            d.initial_backoff,
        )?,
        max_backoff: duration(
            "retry.max_backoff",
            raw.max_backoff.as_deref(),
            d.max_backoff,
        )?,
    };
    within(r.max_retries, 1..=100, "retry.max_retries must be 1..=100")?;
    if !(Duration::from_secs(30)..=Duration::from_secs(15 * 60)).contains(&r.timeout) {
        return Err(format!(
            "retry.timeout must be between 30s (a request's own timeout) and 15min (retries reuse the signed request), got {}",
            humantime::format_duration(r.timeout)
        ));
    }
    if r.initial_backoff < Duration::from_millis(1)
        || r.initial_backoff > r.max_backoff
        || r.max_backoff > r.timeout
    {
        return Err(format!(
            "retry backoff must satisfy 1ms <= retry.initial_backoff ({}) <= retry.max_backoff ({}) <= retry.timeout ({})",
            humantime::format_duration(r.initial_backoff),
            humantime::format_duration(r.max_backoff),
            humantime::format_duration(r.timeout)
        ));
    }
    Ok(r)
}

/// Checks each profile's `data_class` for the store its prefix names, spelling it as the store does.
fn with_data_classes(mut stores: Vec<StoreProfile>) -> Result<Vec<StoreProfile>, String> {
    for s in &mut stores {
        if let Some(class) = &s.data_class {
            s.data_class = Some(check_data_class(&s.prefix, class)?);
        }
    }
    Ok(stores)
}

/// S3's storage classes (PutObject's `x-amz-storage-class`).
const S3_CLASSES: &[&str] = &[
    "STANDARD",
    "STANDARD_IA",
    "ONEZONE_IA",
    "INTELLIGENT_TIERING",
    "GLACIER_IR",
    "GLACIER",
    "DEEP_ARCHIVE",
    "REDUCED_REDUNDANCY",
    "EXPRESS_ONEZONE",
    "OUTPOSTS",
    "SNOW",
];
/// Azure Blob's access tiers for block blobs (Put Blob's and Put Block List's `x-ms-access-tier`).
const AZURE_TIERS: &[&str] = &["Hot", "Cool", "Cold", "Archive"];
/// Google Cloud Storage's storage classes.
const GCS_CLASSES: &[&str] = &["STANDARD", "NEARLINE", "COLDLINE", "ARCHIVE"];

/// Checks a store profile's `data_class` against the classes the store of its `prefix` (`s3://`,
/// `az://`, `gs://`) knows, ignoring case, and returns it spelled as the store spells it
/// (`standard_ia` → `STANDARD_IA`, `cool` → `Cool`). The error names the profile and the key.
pub fn check_data_class(prefix: &str, class: &str) -> Result<String, String> {
    let scheme = prefix.split_once("://").map_or("", |(s, _)| s);
    let (store, known) = match scheme {
        "s3" => ("an S3 storage class", S3_CLASSES),
        "az" | "azure" | "abfs" => ("an Azure access tier", AZURE_TIERS),
        "gs" => ("a GCS storage class", GCS_CLASSES),
        _ => {
            return Err(format!(
                "[[store]] prefix '{prefix}': data_class applies to object stores only (s3://, az://, gs://)"
            ));
        }
    };
    known
        .iter()
        .find(|k| k.eq_ignore_ascii_case(class))
        .map(|k| k.to_string())
        .ok_or_else(|| {
            format!(
                "[[store]] prefix '{prefix}': data_class '{class}' is not {store}; use one of {}",
                known.join(", ")
            )
        })
}

fn substitute(s: &str, node: &str) -> PathBuf {
    PathBuf::from(s.replace("%n", node))
}

/// The node name when none is given: the short host name.
pub fn default_node_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .map(|h| h.split('.').next().unwrap_or_default().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// The bytes of buffers one checkpoint upload holds at once under a `[ckpt]` section: the archive
/// engine's figure (`sluice_archive::upload_memory`), which [`Config::parse`] checks the node's
/// memory budget against.
pub type UploadMemory = fn(&CkptConfig) -> u64;

impl Config {
    /// Reads and parses `path` for `node` (see [`Config::parse`]).
    pub fn load(
        path: &Path,
        node: &str,
        upload_memory: UploadMemory,
    ) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Config::parse(&text, node, upload_memory).map_err(|message| ConfigError::Invalid {
            path: path.into(),
            message,
        })
    }

    /// Parses and checks `text` for `node`. `upload_memory` is what one checkpoint upload holds
    /// under a `[ckpt]` section (`sluice_archive::upload_memory`): `[agent] memory` must hold it
    /// beside `[stage] memory`, which, unset, defaults to what it leaves.
    pub fn parse(text: &str, node: &str, upload_memory: UploadMemory) -> Result<Config, String> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        if node.is_empty() || node.contains('/') {
            return Err(format!("node name '{node}' is not usable in paths"));
        }
        let abs = |what: &str, p: PathBuf| {
            if p.is_absolute() {
                Ok(p)
            } else {
                Err(format!(
                    "{what} must be an absolute path, got '{}'",
                    p.display()
                ))
            }
        };
        let mut stage = StageConfig {
            concurrency: raw.stage.concurrency.unwrap_or(16),
            part_size: size(raw.stage.part_size.as_deref(), 8 << 20)?,
            memory: size(raw.stage.memory.as_deref(), 32 << 20)?,
            timeout: duration(
                "stage.timeout",
                raw.stage.timeout.as_deref(),
                Duration::from_secs(7200),
            )?,
            allow: raw.stage.allow.clone(),
        };
        within(
            stage.concurrency,
            1..=1024,
            "stage.concurrency must be 1..=1024",
        )?;
        within(
            stage.part_size,
            64 << 10..=5 << 30,
            "stage.part_size must be between 64KiB and 5GiB",
        )?;
        if stage.memory < stage.concurrency as u64 * (64 << 10) || stage.memory > 64 << 30 {
            return Err(format!(
                "stage.memory must be at least 64KiB per request in flight ({} for stage.concurrency = {}) and at most 64GiB, got {}",
                stage.concurrency as u64 * (64 << 10),
                stage.concurrency,
                stage.memory
            ));
        }
        for s in &raw.store {
            if !s.prefix.contains("://") {
                return Err(format!(
                    "store prefix '{}' must be a URL prefix such as s3:// or az://container",
                    s.prefix
                ));
            }
        }
        let c = &raw.ckpt;
        let ckpt = CkptConfig {
            default_archive: c.default_archive.clone(),
            allow: c.allow.clone(),
            keep: c.keep.unwrap_or(2),
            scan_interval: duration(
                "ckpt.scan_interval",
                c.scan_interval.as_deref(),
                Duration::from_secs(2),
            )?,
            epilog_wait: duration(
                "ckpt.epilog_wait",
                c.epilog_wait.as_deref(),
                Duration::from_secs(20),
            )?,
            publish_wait: duration(
                "ckpt.publish_wait",
                c.publish_wait.as_deref(),
                Duration::from_secs(3600),
            )?,
            retry_pause_max: duration(
                "ckpt.retry_pause_max",
                c.retry_pause_max.as_deref(),
                Duration::from_secs(120),
            )?,
            part_size: size(c.part_size.as_deref(), 16 << 20)?,
            concurrency: c.concurrency.unwrap_or(8),
            zstd_level: c.zstd_level.unwrap_or(1),
            bandwidth_limit: c
                .bandwidth_limit
                .as_deref()
                .map(parse_size)
                .transpose()?
                .filter(|b| *b > 0),
            high_water: c.high_water.unwrap_or(90),
        };
        within(ckpt.keep, 1..=1000, "ckpt.keep must be 1..=1000")?;
        if !(Duration::from_secs(2)..=Duration::from_secs(3600)).contains(&ckpt.retry_pause_max) {
            return Err(format!(
                "ckpt.retry_pause_max must be 2s..=1h, got {}",
                humantime::format_duration(ckpt.retry_pause_max)
            ));
        }
        within(
            ckpt.part_size,
            5 << 20..=5 << 30,
            "ckpt.part_size must be between 5MiB (S3's minimum part) and 5GiB",
        )?;
        within(
            ckpt.concurrency,
            1..=256,
            "ckpt.concurrency must be 1..=256",
        )?;
        within(ckpt.zstd_level, 1..=22, "ckpt.zstd_level must be 1..=22")?;
        within(
            ckpt.high_water,
            1..=100,
            "ckpt.high_water must be a percentage 1..=100",
        )?;
        for rule in &ckpt.allow {
            if !rule.prefix.contains("://") && rule.prefix != "*" {
                return Err(format!(
                    "ckpt.allow prefix '{}' must be a URL prefix such as s3://ckpt/{{user}}/ (or \"*\" for any URL)",
                    rule.prefix
                ));
            }
        }
        let memory = raw.agent.memory.as_deref().map(parse_size).transpose()?;
        if let Some(budget) = memory {
            let archive = upload_memory(&ckpt);
            // Unset, stage.memory takes its default from what the archive leaves of the budget.
            if raw.stage.memory.is_none() {
                stage.memory = stage
                    .memory
                    .min(budget.saturating_sub(archive))
                    .max(stage.concurrency as u64 * (64 << 10));
            }
            if stage.memory + archive > budget {
                return Err(format!(
                    "agent.memory ({}) is the node's budget of data buffers and must hold stage.memory ({}) \
                     plus a checkpoint upload's buffers ({} for ckpt.part_size = {} and ckpt.concurrency = {}): \
                     raise agent.memory, or lower stage.memory, ckpt.part_size or ckpt.concurrency",
                    mib(budget),
                    mib(stage.memory),
                    mib(archive),
                    mib(ckpt.part_size),
                    ckpt.concurrency,
                ));
            }
        }
        let retry = retry_policy(&raw.retry)?;
        let config = Config {
            memory,
            node: node.to_string(),
            log_format: match raw.agent.log_format.as_deref() {
                None | Some("text") => LogFormat::Text,
                Some("json") => LogFormat::Json,
                Some(other) => {
                    return Err(format!(
                        "agent.log_format must be \"text\" or \"json\", got '{other}'"
                    ));
                }
            },
            drain_timeout: duration(
                "agent.drain_timeout",
                raw.agent.drain_timeout.as_deref(),
                Duration::from_secs(5),
            )?,
            housekeeping_interval: match duration(
                "agent.housekeeping_interval",
                raw.agent.housekeeping_interval.as_deref(),
                Duration::from_secs(60),
            )? {
                d if (Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&d) => d,
                d => {
                    return Err(format!(
                        "agent.housekeeping_interval must lie between 1s and 1h, got {}",
                        humantime::format_duration(d)
                    ));
                }
            },
            squeue: match raw.agent.squeue.as_deref() {
                None => Some(PathBuf::from("squeue")),
                Some("") => None,
                Some(p) => Some(PathBuf::from(p)),
            },
            socket: abs("agent.socket", substitute(&raw.agent.socket, node))?,
            state_dir: abs("agent.state_dir", substitute(&raw.agent.state_dir, node))?,
            hot_root: abs("hot_tier.root", substitute(&raw.hot_tier.root, node))?,
            stage,
            ckpt,
            stores: with_data_classes(raw.store)?,
            retry,
            peer: raw
                .peer
                .as_ref()
                .map(|p| peer_config(p, node))
                .transpose()?,
            metrics: raw
                .metrics
                .as_ref()
                .map(|m| metrics_config(m, node))
                .transpose()?,
            shared_tier: raw
                .shared_tier
                .as_ref()
                .map(shared_tier_config)
                .transpose()?,
            cache: raw.cache.as_ref().map(cache_config).transpose()?,
            fast_tier: raw
                .fast_tier
                .as_ref()
                .map(|f| fast_tier_config(f, node))
                .transpose()?,
        };
        if config.peer.is_none()
            && config
                .fast_tier
                .as_ref()
                .is_some_and(|f| f.max_replicas > 0)
        {
            return Err(
                "fast_tier.replicas (and max_replicas) copy checkpoints to the job's other nodes over the peer port: add a [peer] section, or set them to 0"
                    .into(),
            );
        }
        Ok(config)
    }

    /// The profile for an object URL: the one with the longest matching prefix.
    pub fn store_for(&self, url: &str) -> Option<&StoreProfile> {
        let normalise = |u: &str| u.replacen("azure://", "az://", 1);
        let url = normalise(url);
        self.stores
            .iter()
            .filter(|s| url.starts_with(&normalise(&s.prefix)))
            .max_by_key(|s| s.prefix.len())
    }
}

/// docs/config.md and slurm-conf/sluice.toml checked against the keys of [`RawConfig`].
#[cfg(test)]
mod docs_match;

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for the archive engine's figure (`sluice_archive::upload_memory`, whose tests
    /// check the memory budget against the real one): the part buffers alone.
    fn upload_memory(c: &CkptConfig) -> u64 {
        c.part_size * c.concurrency as u64
    }

    pub(super) fn parse(text: &str, node: &str) -> Result<Config, String> {
        Config::parse(text, node, upload_memory)
    }

    /// The smallest valid configuration.
    const BASE: &str = "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n";
    const EXAMPLE: &str = include_str!("../../slurm-conf/sluice.toml");

    /// [`BASE`] with `rest` after it, for node n1.
    fn base_with(rest: &str) -> Result<Config, String> {
        parse(&format!("{BASE}{rest}"), "n1")
    }

    /// Why [`BASE`] with `[section]` holding `body` is refused.
    fn bad(section: &str, body: &str) -> String {
        base_with(&format!("[{section}]\n{body}\n")).unwrap_err()
    }

    /// The example with its commented `# [section]` block switched on: the block's TOML lines
    /// (`# [table]`, `# key = value`) uncommented, its prose left as it is.
    fn example_with(section: &str) -> String {
        let start = EXAMPLE
            .find(&format!("# [{section}]\n"))
            .unwrap_or_else(|| panic!("the example has a [{section}] section"));
        let block = &EXAMPLE[start..start + EXAMPLE[start..].find("\n\n").unwrap()];
        let toml: Vec<&str> = block
            .lines()
            .filter_map(|l| {
                l.strip_prefix("# ").filter(|t| {
                    t.starts_with('[') || t.split_once(" = ").is_some_and(|(k, _)| !k.contains(' '))
                })
            })
            .collect();
        EXAMPLE.replace(block, &toml.join("\n"))
    }

    #[test]
    fn example_config_parses() {
        let c = parse(EXAMPLE, "n2").unwrap();
        assert_eq!(c.socket, PathBuf::from("/run/sluice/n2.sock"));
        assert_eq!(c.drain_timeout, Duration::from_secs(5));
        assert_eq!(c.housekeeping_interval, Duration::from_secs(60));
        assert_eq!(c.log_format, LogFormat::Text);
        assert_eq!(c.hot_root, PathBuf::from("/var/lib/sluice/n2/hot"));
        assert_eq!(c.stage.part_size, 8 << 20);
        assert_eq!(c.stage.timeout, Duration::from_secs(7200));
        assert_eq!(
            c.store_for("s3://datasets/x").unwrap().region.as_deref(),
            Some("garage")
        );
        assert!(c.store_for("azure://c/x").unwrap().use_emulator);
        assert!(c.store_for("gs://b").is_none());
        assert_eq!(c.stage.allow.len(), 3);
        // The example spells out object_store's defaults.
        assert_eq!(c.retry, RetryPolicy::default());
    }

    #[test]
    fn bad_config_says_what_is_wrong() {
        let e = bad("stage", "part_size='16 parsecs'");
        assert!(e.contains("unknown size unit"), "{e}");
        let c = base_with("").unwrap();
        assert_eq!((c.stage.concurrency, c.stage.memory), (16, 32 << 20));
        let with_format = |f: &str| {
            BASE.replace(
                "state_dir='/st'\n",
                &format!("state_dir='/st'\nlog_format='{f}'\n"),
            )
        };
        assert_eq!(
            parse(&with_format("json"), "n1").unwrap().log_format,
            LogFormat::Json
        );
        let e = parse(&with_format("xml"), "n1").unwrap_err();
        assert!(
            e.contains("agent.log_format must be \"text\" or \"json\", got 'xml'"),
            "{e}"
        );
        let c = base_with("[ckpt]\nretry_pause_max='8s'\n").unwrap();
        assert_eq!(c.ckpt.retry_pause_max, Duration::from_secs(8));
        assert_eq!(
            base_with("").unwrap().ckpt.retry_pause_max,
            Duration::from_secs(120)
        );
        let e = bad("ckpt", "retry_pause_max='500ms'");
        assert!(
            e.contains("ckpt.retry_pause_max must be 2s..=1h, got 500ms"),
            "{e}"
        );
        let e = bad("stage", "concurrency=64\nmemory='1MiB'");
        assert!(e.contains("stage.memory must be at least"), "{e}");
        let e = base_with("bogus=1\n").unwrap_err();
        assert!(e.contains("unknown field"), "{e}");
        let e = parse(&BASE.replace("'/h'", "'h'"), "n1").unwrap_err();
        assert!(e.contains("absolute"), "{e}");
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("x").is_err());
    }

    #[test]
    fn metrics_are_off_unless_configured_and_each_node_may_have_its_port() {
        assert!(base_with("").unwrap().metrics.is_none());
        let text = format!(
            "{BASE}[metrics]\nlisten='0.0.0.0:9464'\n[metrics.nodes]\nn2='127.0.0.1:9472'\n"
        );
        let listen = |node| parse(&text, node).unwrap().metrics.unwrap().listen;
        assert_eq!(listen("n1"), "0.0.0.0:9464".parse().unwrap());
        assert_eq!(listen("n2"), "127.0.0.1:9472".parse().unwrap());
        for (m, want) in [
            ("listen='localhost:9464'", "metrics.listen must be IP:port"),
            ("listen='9464'", "metrics.listen must be IP:port"),
            ("listen='127.0.0.1:0'", "needs a fixed port"),
            (
                "listen='[::]:9464'\n[metrics.nodes]\nn1='x'",
                "metrics.nodes.n1 must be IP:port",
            ),
            ("port=9464", "unknown field"),
            ("", "missing field `listen`"),
        ] {
            let e = bad("metrics", m);
            assert!(e.contains(want), "{m}: {e}");
        }
    }

    #[test]
    fn the_example_metrics_section_parses_once_uncommented() {
        let uncommented = example_with("metrics");
        let listen = |node| parse(&uncommented, node).unwrap().metrics.unwrap().listen;
        assert_eq!(listen("n9"), "0.0.0.0:9464".parse().unwrap());
        assert_eq!(listen("n2"), "127.0.0.1:9472".parse().unwrap());
    }

    #[test]
    fn peer_transfers_are_off_unless_configured_and_checked() {
        assert!(base_with("").unwrap().peer.is_none());
        // The test cluster: three agents on one host, each on its own port.
        let c = parse(
            &format!("{BASE}[peer]\nsecret_file='/etc/sluice/peer.key'\nunit_size='16MiB'\n[peer.nodes]\nn1='127.0.0.1:7071'\nn2='127.0.0.1:7072'\n"),
            "n2",
        )
        .unwrap();
        let p = c.peer.unwrap();
        assert_eq!(
            p.listen, "127.0.0.1:7072",
            "listens where its peers reach it"
        );
        assert_eq!(p.addr_of("n1"), "127.0.0.1:7071");
        assert_eq!(p.addr_of("n9"), "n9:7070", "other nodes by the %n pattern");
        assert_eq!((p.unit_size, p.concurrency), (16 << 20, 8));
        assert_eq!(p.read_timeout, Duration::from_secs(30));
        assert_eq!((p.fallback_concurrency, p.fallback_rate), (16, None));
        let c = base_with("[peer]\nfallback_concurrency=4\nfallback_rate='200MiB'\n").unwrap();
        let p = c.peer.unwrap();
        assert_eq!(
            (p.fallback_concurrency, p.fallback_rate),
            (4, Some(200 << 20))
        );
        let c = base_with("[peer]\naddr='%n-ib:7000'\nlisten='0.0.0.0:7000'\n").unwrap();
        let p = c.peer.unwrap();
        assert_eq!(
            (p.listen.as_str(), p.addr_of("n3")),
            ("0.0.0.0:7000", "n3-ib:7000".into())
        );
        assert_eq!(p.unit_size, 64 << 20);
        assert_eq!(p.secret_file, PathBuf::from("/etc/sluice/peer.key"));
        // The example's commented [peer] section, switched on, is valid as written.
        let on = parse(&example_with("peer"), "n2").unwrap();
        let p = on.peer.unwrap();
        assert_eq!(
            (p.listen.as_str(), p.addr_of("n3")),
            ("0.0.0.0:7070", "127.0.0.1:7073".into())
        );
        assert_eq!(p.secret_file, PathBuf::from("/etc/sluice/peer.key"));
        for (peer, want) in [
            (
                "unit_size='4KiB'",
                "peer.unit_size must be between 1MiB and 1GiB, got 4096",
            ),
            ("concurrency=0", "peer.concurrency must be 1..=256"),
            (
                "fallback_concurrency=0",
                "peer.fallback_concurrency must be 1..=4096",
            ),
            (
                "fallback_rate='4KiB'",
                "peer.fallback_rate must be between 1MiB",
            ),
            ("unit_size='1GiB'\nconcurrency=64", "must be at most 16GiB"),
            ("addr='%n'", "peer.addr must be host:port"),
            ("addr='%n:0'", "peer.addr must be host:port"),
            ("listen='7070'", "peer.listen must be host:port"),
            (
                "[peer.nodes]\nn2='127.0.0.1'",
                "peer.nodes.n2 must be host:port",
            ),
            (
                "secret_file='peer.key'",
                "peer.secret_file must be an absolute path",
            ),
            (
                "connect_timeout='5min'",
                "peer.connect_timeout must be between 100ms and 1min",
            ),
            (
                "read_timeout='0s'",
                "peer.read_timeout must be between 1s and 10min",
            ),
            ("port=7070", "unknown field"),
        ] {
            let e = bad("peer", peer);
            assert!(e.contains(want), "{peer}: {e}");
        }
    }

    #[test]
    fn data_classes_are_checked_for_the_profiles_store_and_spelled_as_it_spells_them() {
        let ok = |prefix, class| check_data_class(prefix, class).unwrap();
        assert_eq!(ok("s3://", "STANDARD_IA"), "STANDARD_IA");
        assert_eq!(ok("s3://ckpt", "glacier_ir"), "GLACIER_IR");
        assert_eq!(ok("az://", "cool"), "Cool");
        assert_eq!(ok("azure://ckpt", "ARCHIVE"), "Archive");
        assert_eq!(ok("gs://b", "Nearline"), "NEARLINE");
        let bad = |prefix, class| check_data_class(prefix, class).unwrap_err();
        let e = bad("s3://", "Cool");
        assert!(
            e.contains("[[store]] prefix 's3://': data_class 'Cool' is not an S3 storage class")
                && e.contains("STANDARD_IA, ONEZONE_IA"),
            "{e}"
        );
        let e = bad("az://", "STANDARD_IA");
        assert!(
            e.contains("data_class 'STANDARD_IA' is not an Azure access tier; use one of Hot, Cool, Cold, Archive"),
            "{e}"
        );
        let e = bad("gs://", "GLACIER");
        assert!(e.contains("not a GCS storage class"), "{e}");
        let e = bad("file:///lustre", "Cool");
        assert!(
            e.contains("data_class applies to object stores only"),
            "{e}"
        );
    }

    #[test]
    fn a_store_profile_may_name_the_class_of_checkpoint_data() {
        let c = base_with("[[store]]\nprefix='s3://'\n[[store]]\nprefix='s3://cold'\ndata_class='standard_ia'\n[[store]]\nprefix='az://'\nuse_emulator=true\ndata_class='cool'\n").unwrap();
        let class = |url| c.store_for(url).and_then(|p| p.data_class.as_deref());
        // Spelled as the store spells it once parsed.
        assert_eq!(class("s3://cold/alice"), Some("STANDARD_IA"));
        assert_eq!(class("az://ckpt/alice"), Some("Cool"));
        assert_eq!(class("s3://ckpt/alice"), None);
        let bad = |store: &str| bad("[store]", store);
        let e = bad("prefix='az://'\ndata_class='STANDARD_IA'");
        assert!(
            e.contains("[[store]] prefix 'az://': data_class 'STANDARD_IA' is not an Azure access tier; use one of Hot, Cool, Cold, Archive"),
            "{e}"
        );
        let e = bad("prefix='s3://'\ndata_class='COOL'");
        assert!(e.contains("is not an S3 storage class"), "{e}");
        let e = bad("prefix='s3://'\ndata_class=3");
        assert!(e.contains("data_class"), "{e}");
        // The example's commented data_class lines are valid once uncommented.
        let example = EXAMPLE.replace("# data_class = ", "data_class = ");
        let c = parse(&example, "n1").unwrap();
        assert_eq!(
            c.store_for("s3://ckpt/").unwrap().data_class.as_deref(),
            Some("STANDARD_IA")
        );
        assert_eq!(
            c.store_for("az://ckpt/").unwrap().data_class.as_deref(),
            Some("Cool")
        );
    }

    #[test]
    fn the_retry_policy_defaults_to_object_stores_and_is_checked() {
        assert_eq!(base_with("").unwrap().retry, RetryPolicy::default());
        let c = base_with(
            "[retry]\nmax_retries=3\ntimeout='1min'\ninitial_backoff='50ms'\nmax_backoff='5s'\n",
        )
        .unwrap();
        assert_eq!(
            c.retry,
            RetryPolicy {
                max_retries: 3,
                timeout: Duration::from_secs(60),
                initial_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(5),
            }
        );
        let bad = |retry: &str| bad("retry", retry);
        let e = bad("max_retries=0");
        assert!(e.contains("retry.max_retries must be 1..=100"), "{e}");
        for timeout in ["1h", "10s"] {
            let e = bad(&format!("timeout='{timeout}'"));
            assert!(e.contains("retry.timeout must be between 30s"), "{e}");
        }
        let e = bad("initial_backoff='20s'");
        assert!(
            e.contains("retry.initial_backoff (20s) <= retry.max_backoff (15s)"),
            "{e}"
        );
        let e = bad("timeout='30s'\nmax_backoff='1min'");
        assert!(
            e.contains("retry.max_backoff (1m) <= retry.timeout (30s)"),
            "{e}"
        );
        let e = bad("timeout='soon'");
        assert!(e.contains("retry.timeout 'soon'"), "{e}");
        let e = bad("max_retry=3");
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn the_ram_tier_is_off_unless_configured_and_its_share_fits() {
        assert!(base_with("").unwrap().fast_tier.is_none());
        let c = parse(
            &format!("{BASE}[fast_tier]\nroot='/dev/shm/sluice/%n'\ncapacity='64GiB'\njob_share='16GiB'\n"),
            "n2",
        )
        .unwrap()
        .fast_tier
        .unwrap();
        assert_eq!(c.root, PathBuf::from("/dev/shm/sluice/n2"));
        assert_eq!(
            (c.capacity, c.job_share, c.flush_block, c.mount),
            (64 << 30, 16 << 30, 8 << 20, true)
        );
        let bad = |t: &str| bad("fast_tier", t);
        assert!(bad("root='/r'\ncapacity='1GiB'\njob_share='2GiB'").contains("job_share must be"));
        assert!(bad("root='r'\ncapacity='1GiB'\njob_share='1GiB'").contains("fast_tier.root"));
        assert!(
            bad("root='/r'\ncapacity='1GiB'\njob_share='1GiB'\nflush_block='5000'")
                .contains("flush_block")
        );
        assert!(
            bad("root='/r'\ncapacity='1GiB'\njob_share='1GiB'\nreplicas=4")
                .contains("between 0 and 3")
        );
        assert!(
            bad("root='/r'\ncapacity='1GiB'\njob_share='1GiB'\nreplicas=1\nreplica_room='0'")
                .contains("replica_room must be more than 0")
        );
    }

    #[test]
    fn replicas_take_their_own_room_and_need_the_peer_port() {
        let ft = "[fast_tier]\nroot='/r'\ncapacity='8GiB'\njob_share='2GiB'\n";
        let c = base_with(ft).unwrap().fast_tier.unwrap();
        assert_eq!((c.replicas, c.replica_room), (0, 0), "off unless asked for");
        let e = base_with(&format!("{ft}replicas=1\n")).unwrap_err();
        assert!(e.contains("add a [peer] section"), "{e}");
        let with_peer = |extra: &str| {
            parse(&format!("{BASE}[peer]\naddr='%n:7000'\n{ft}{extra}"), "n1")
                .unwrap()
                .fast_tier
                .unwrap()
        };
        let c = with_peer("replicas=1\n");
        assert_eq!(
            (c.replicas, c.replica_room),
            (1, 2 << 30),
            "one job's share by default"
        );
        let c = with_peer("replicas=2\nreplica_room='16GiB'\n");
        assert_eq!(
            (c.replicas, c.max_replicas, c.replica_room),
            (2, 2, 16 << 30),
            "jobs may ask for up to the site's count unless max_replicas says more"
        );
        // Off by default, but a job may ask for up to two: the room is there.
        let c = with_peer("max_replicas=2\n");
        assert_eq!(
            (c.replicas, c.max_replicas, c.replica_room),
            (0, 2, 2 << 30)
        );
        let e = base_with(&format!("{ft}max_replicas=1\n")).unwrap_err();
        assert!(e.contains("add a [peer] section"), "{e}");
        for bad in ["replicas=2\nmax_replicas=1\n", "max_replicas=4\n"] {
            let e = parse(&format!("{BASE}[peer]\naddr='%n:7000'\n{ft}{bad}"), "n1").unwrap_err();
            assert!(e.contains("max_replicas must be between"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_cache_is_off_unless_configured_and_its_watermarks_are_ordered() {
        assert!(base_with("").unwrap().cache.is_none());
        let c = base_with("[cache]\n").unwrap().cache.unwrap();
        assert_eq!(
            c,
            CacheConfig {
                size: CacheSize::Percent(50),
                high_water: 90,
                low_water: 75,
                min_free: 5,
                link_hits: false,
            }
        );
        assert!(
            base_with("[cache]\nlink_hits = true\n")
                .unwrap()
                .cache
                .unwrap()
                .link_hits
        );
        assert_eq!(c.capacity(1000), 500);
        let c = base_with("[cache]\nsize='64MiB'\n").unwrap();
        assert_eq!(c.cache.unwrap().capacity(1 << 40), 64 << 20);
        let bad = |t: &str| bad("cache", t);
        assert!(bad("low_water=90").contains("must be below cache.high_water"));
        assert!(bad("size='99%'").contains("1%..=95%"));
        assert!(bad("size='lots'").contains("cache.size"));
        assert!(bad("size='4KiB'").contains("at least 1MiB"));
        assert!(bad("min_free=60").contains("cache.min_free"));
    }

    #[test]
    fn the_shared_tier_is_off_unless_configured_and_its_job_dir_is_per_job() {
        assert!(base_with("").unwrap().shared_tier.is_none());
        let c = base_with("[shared_tier]\njob_dir='/lustre/scratch/sluice/job-%j'\n").unwrap();
        let t = c.shared_tier.unwrap();
        assert_eq!(
            t.job_dir_for(4242),
            PathBuf::from("/lustre/scratch/sluice/job-4242")
        );
        assert_eq!(t.root(), Path::new("/lustre/scratch/sluice"));
        assert_eq!(t.job_dir_name(7), "job-7");
        assert_eq!(t.lfs, PathBuf::from("lfs"), "looked up on PATH by default");
        assert!(t.stripes.is_empty(), "the directory's default layout");
        let lfs = |l: &str| {
            base_with(&format!("[shared_tier]\njob_dir='/beeond/%j'\nlfs='{l}'\n"))
                .map(|c| c.shared_tier.unwrap().lfs)
        };
        assert_eq!(lfs("/usr/bin/lfs"), Ok(PathBuf::from("/usr/bin/lfs")));
        let bad = |t: &str| bad("shared_tier", t);
        for (t, want) in [
            (
                "job_dir='lustre/%j'",
                "shared_tier.job_dir must be an absolute path (e.g. \"/lustre/scratch/sluice/%j\"), got 'lustre/%j'",
            ),
            (
                "job_dir='/lustre/../etc/%j'",
                "shared_tier.job_dir must not contain '..'",
            ),
            (
                "job_dir='/lustre/sluice'",
                "shared_tier.job_dir must end in a directory per job: %j (the job id) in its last component",
            ),
            (
                "job_dir='/lustre/%j/stage'",
                "shared_tier.job_dir must end in a directory per job",
            ),
            (
                "job_dir='/lustre/%j/%j'",
                "shared_tier.job_dir must end in a directory per job",
            ),
            (
                "job_dir='/lustre/%n/%j'",
                "shared_tier.job_dir is one directory for all of a job's nodes, so it cannot contain %n",
            ),
            (
                "job_dir='/%j'",
                "must be in a directory of the shared file system, not in /",
            ),
            ("", "missing field `job_dir`"),
            ("job_dir='/l/%j'\nstripe_count=1", "unknown field"),
        ] {
            let e = bad(t);
            assert!(e.contains(want), "{t}: {e}");
        }
        for l in ["bin/lfs", ""] {
            let e = lfs(l).unwrap_err();
            assert!(
                e.contains("shared_tier.lfs must be an absolute path (e.g. \"/usr/bin/lfs\") or a command name"),
                "{l}: {e}"
            );
        }
    }

    #[test]
    fn stripe_classes_are_checked_sorted_and_chosen_by_file_size() {
        let base = format!("{BASE}[shared_tier]\njob_dir='/lustre/sluice/%j'\n");
        let class = |min: &str, count: i64, size: &str| {
            format!("[[shared_tier.stripe]]\nmin_size='{min}'\ncount={count}\nsize='{size}'\n")
        };
        // Written out of order: sorted by min_size.
        let text = format!(
            "{base}{}{}{}",
            class("1GiB", -1, "4MiB"),
            class("0", 1, "1MiB"),
            class("64MiB", 4, "1MiB")
        );
        let stripes = parse(&text, "n1").unwrap().shared_tier.unwrap().stripes;
        let want = |min_size, count, size| StripeClass {
            min_size,
            count,
            size,
        };
        assert_eq!(
            stripes,
            vec![
                want(0, 1, 1 << 20),
                want(64 << 20, 4, 1 << 20),
                want(1 << 30, -1, 4 << 20)
            ]
        );
        let pick = |size| StripeClass::for_size(&stripes, size).map(|c| c.count);
        assert_eq!(pick(0), Some(1));
        assert_eq!(pick((64 << 20) - 1), Some(1));
        assert_eq!(pick(64 << 20), Some(4), "min_size itself is in the class");
        assert_eq!(pick(200 << 30), Some(-1));
        // Below the smallest class: the directory's default layout.
        assert_eq!(StripeClass::for_size(&stripes[1..], 4096), None);
        assert_eq!(StripeClass::for_size(&[], 4096), None);

        let bad = |classes: &str| parse(&format!("{base}{classes}"), "n1").unwrap_err();
        for (classes, want) in [
            (
                class("0", 0, "1MiB"),
                "[[shared_tier.stripe]] with min_size = \"0\": count must be -1 (all OSTs) or a number of OSTs 1..=2000, got 0",
            ),
            (class("0", -2, "1MiB"), "count must be -1 (all OSTs)"),
            (class("0", 2001, "1MiB"), "count must be -1 (all OSTs)"),
            (class("0", 1 << 40, "1MiB"), "count must be -1 (all OSTs)"),
            (
                class("1GiB", 1, "100000"),
                "[[shared_tier.stripe]] with min_size = \"1GiB\": size must be a multiple of 64KiB below 4GiB (Lustre's rule), e.g. \"1MiB\" or \"4MiB\", got '100000' (100000 bytes)",
            ),
            (class("0", 1, "0"), "size must be a multiple of 64KiB"),
            (class("0", 1, "4GiB"), "size must be a multiple of 64KiB"),
            (class("0", 1, "1 furlong"), "size unknown size unit"),
            (class("big", 1, "1MiB"), "min_size 'big' is not a size"),
            (
                format!(
                    "{}{}",
                    class("1GiB", 1, "1MiB"),
                    class("1024MiB", 2, "1MiB")
                ),
                "two [[shared_tier.stripe]] classes have min_size 1073741824 bytes: give each class its own min_size",
            ),
            (
                "[[shared_tier.stripe]]\nmin_size='0'\ncount=1\n".to_string(),
                "missing field `size`",
            ),
            (
                format!("{}pool='flash'\n", class("0", 1, "1MiB")),
                "unknown field",
            ),
        ] {
            let e = bad(&classes);
            assert!(e.contains(want), "{classes}: {e}");
        }
        // Lustre's largest stripe below 4GiB is accepted.
        assert!(parse(&format!("{base}{}", class("0", 1, "4194240KiB")), "n1").is_ok());
    }

    #[test]
    fn the_example_shared_tier_section_parses_once_uncommented() {
        let t = parse(&example_with("shared_tier"), "n2")
            .unwrap()
            .shared_tier
            .unwrap();
        assert_eq!(
            t.job_dir_for(12),
            PathBuf::from("/lustre/scratch/sluice/12")
        );
        assert_eq!(t.lfs, PathBuf::from("/usr/bin/lfs"));
        assert_eq!(
            t.stripes,
            vec![
                StripeClass {
                    min_size: 0,
                    count: 1,
                    size: 1 << 20
                },
                StripeClass {
                    min_size: 1 << 30,
                    count: -1,
                    size: 4 << 20
                }
            ]
        );
    }
}
