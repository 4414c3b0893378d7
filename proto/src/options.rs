//! Parsing and validation of the job options (the README's "Job options" table).
//!
//! The plugin calls these at submit time for a friendly error, and the agent calls them again on the
//! root side, because anything that arrives through the job environment is user-controlled.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Longest accepted value of one option (bytes). Anything longer is refused, not truncated.
pub const MAX_OPTION_LEN: usize = 4096;
/// Most `--stage-in` sources one job may name.
pub const MAX_STAGE_SOURCES: usize = 64;
/// Longest dataset name (one path component).
pub const MAX_NAME_LEN: usize = 128;
/// Highest `--ckpt-keep`.
pub const MAX_CKPT_KEEP: u32 = 1000;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{option}: {message}")]
pub struct OptionError {
    pub option: &'static str,
    pub message: String,
}

fn err(option: &'static str, message: impl Into<String>) -> OptionError {
    OptionError {
        option,
        message: message.into(),
    }
}

/// Where a dataset comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// A POSIX directory or file (Lustre, NFS, GPFS, local), read with the job user's identity.
    Posix { path: String },
    /// An object-store prefix. `url` is normalised: `s3://bucket/prefix`, `az://container/prefix`,
    /// `gs://bucket/prefix`, without a trailing slash.
    Object {
        scheme: ObjectScheme,
        bucket: String,
        prefix: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectScheme {
    S3,
    Azure,
    Gcs,
}

impl ObjectScheme {
    pub fn url_scheme(self) -> &'static str {
        match self {
            ObjectScheme::S3 => "s3",
            ObjectScheme::Azure => "az",
            ObjectScheme::Gcs => "gs",
        }
    }
}

impl Source {
    /// `s3://bucket` of an object-store source (its objects' URLs are this, `/` and their key).
    pub fn bucket_url(&self) -> Option<String> {
        match self {
            Source::Posix { .. } => None,
            Source::Object { scheme, bucket, .. } => {
                Some(format!("{}://{bucket}", scheme.url_scheme()))
            }
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Posix { path } => f.write_str(path),
            Source::Object {
                scheme,
                bucket,
                prefix,
            } if prefix.is_empty() => {
                write!(f, "{}://{bucket}", scheme.url_scheme())
            }
            Source::Object {
                scheme,
                bucket,
                prefix,
            } => {
                write!(f, "{}://{bucket}/{prefix}", scheme.url_scheme())
            }
        }
    }
}

/// One `--stage-in` entry: lands in `$SLUICE_STAGE_DIR/NAME`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpec {
    pub name: String,
    pub source: Source,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageTier {
    #[default]
    Local,
    Shared,
}

/// Where `$SLUICE_CKPT_DIR` lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CkptTier {
    /// The node-local NVMe hot tier.
    #[default]
    Local,
    /// The admin's RAM tier (`[fast_tier]`): committed checkpoints are flushed to the hot tier,
    /// then archived.
    Ram,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageMode {
    /// Every node gets the whole dataset (with `[peer]`, read from the origin once per job).
    #[default]
    Replicate,
    /// Each node gets the files it owns (rendezvous hashing over the job's nodes), read from the
    /// origin by it alone, plus `$SLUICE_STAGE_DIR/NAME.shard.json` saying which node holds what.
    Shard,
}

/// The suffix of a shard manifest's file name, next to its dataset: no dataset may be named so.
pub const SHARD_MANIFEST_SUFFIX: &str = ".shard.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "tag", rename_all = "snake_case")]
pub enum Restore {
    Latest,
    Tag(String),
    /// `TAG!`: this tag even though it is poisoned (marked bad with `sluice ckpt poison`).
    Forced(String),
}

impl Restore {
    /// The tag a named restore asks for (`None` for `latest`).
    pub fn tag(&self) -> Option<&str> {
        match self {
            Restore::Latest => None,
            Restore::Tag(t) | Restore::Forced(t) => Some(t),
        }
    }
}

/// Everything a job asked of sluice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOptions {
    pub stage_in: Vec<StageSpec>,
    pub stage_tier: StageTier,
    pub stage_mode: StageMode,
    pub ckpt_archive: Option<String>,
    pub ckpt_keep: Option<u32>,
    pub ckpt_restore: Option<Restore>,
    /// An older plugin sends none: the hot tier.
    #[serde(default, skip_serializing_if = "is_local")]
    pub ckpt_tier: CkptTier,
    /// `--ckpt-replicas`: other nodes that hold a copy of each node's part of a RAM-tier
    /// checkpoint, instead of the site's `[fast_tier] replicas` (within its `max_replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ckpt_replicas: Option<u8>,
}

fn is_local(t: &CkptTier) -> bool {
    *t == CkptTier::Local
}

impl JobOptions {
    /// True when the job used no sluice option: then sluice must stay out of its way entirely.
    pub fn is_empty(&self) -> bool {
        *self == JobOptions::default()
    }
}

/// The option names, as typed after `--`. The plugin registers exactly these.
pub mod names {
    pub const STAGE_IN: &str = "stage-in";
    pub const STAGE_TIER: &str = "stage-tier";
    pub const STAGE_MODE: &str = "stage-mode";
    pub const CKPT_ARCHIVE: &str = "ckpt-archive";
    pub const CKPT_KEEP: &str = "ckpt-keep";
    pub const CKPT_RESTORE: &str = "ckpt-restore";
    pub const CKPT_TIER: &str = "ckpt-tier";
    pub const CKPT_REPLICAS: &str = "ckpt-replicas";
    pub const ALL: [&str; 8] = [
        STAGE_IN,
        STAGE_TIER,
        STAGE_MODE,
        CKPT_ARCHIVE,
        CKPT_KEEP,
        CKPT_RESTORE,
        CKPT_TIER,
        CKPT_REPLICAS,
    ];
}

fn check_text(option: &'static str, value: &str) -> Result<(), OptionError> {
    if value.len() > MAX_OPTION_LEN {
        return Err(err(
            option,
            format!(
                "value is {} bytes; at most {MAX_OPTION_LEN} are accepted",
                value.len()
            ),
        ));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(err(
            option,
            format!("value contains the control character {c:?}; remove it"),
        ));
    }
    Ok(())
}

const SOURCE_HELP: &str = "accepted: an absolute path (/lustre/data), file:///path, s3://bucket/prefix, \
az://container/prefix (or azure://), gs://bucket/prefix, optionally preceded by NAME=";

/// Validates a dataset name: one path component, portable characters only.
pub fn validate_name(name: &str) -> Result<(), OptionError> {
    if name.is_empty() {
        return Err(err(
            names::STAGE_IN,
            format!("empty dataset NAME before '='; {SOURCE_HELP}"),
        ));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(err(
            names::STAGE_IN,
            format!("dataset NAME '{name}' is longer than {MAX_NAME_LEN} characters"),
        ));
    }
    if name == "." || name == ".." {
        return Err(err(
            names::STAGE_IN,
            format!("dataset NAME '{name}' is not allowed"),
        ));
    }
    if name.ends_with(SHARD_MANIFEST_SUFFIX) {
        return Err(err(
            names::STAGE_IN,
            format!(
                "dataset NAME '{name}' ends in '{SHARD_MANIFEST_SUFFIX}', which is kept for shard \
                 manifests; choose another NAME"
            ),
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+'))
    {
        return Err(err(
            names::STAGE_IN,
            format!("dataset NAME '{name}' may only hold letters, digits, '.', '_', '-' and '+'"),
        ));
    }
    Ok(())
}

fn parse_source(src: &str) -> Result<Source, OptionError> {
    if src.is_empty() {
        return Err(err(names::STAGE_IN, format!("empty source; {SOURCE_HELP}")));
    }
    // An absolute path is a path, even when it holds "://" (so a POSIX source's `Display` parses
    // back to itself).
    let (scheme, rest) = match src.split_once("://") {
        Some((s, r)) if !src.starts_with('/') => (Some(s), r),
        _ => (None, src),
    };
    match scheme {
        None => parse_posix(src),
        Some("file") => {
            if !rest.starts_with('/') {
                return Err(err(
                    names::STAGE_IN,
                    format!(
                        "'{src}': a file:// URL needs an absolute path, as in file:///lustre/data"
                    ),
                ));
            }
            parse_posix(rest)
        }
        Some(s) => {
            let scheme = match s {
                "s3" => ObjectScheme::S3,
                "az" | "azure" | "abfs" => ObjectScheme::Azure,
                "gs" => ObjectScheme::Gcs,
                other => {
                    return Err(err(
                        names::STAGE_IN,
                        format!("unknown URL scheme '{other}://' in '{src}'; {SOURCE_HELP}"),
                    ));
                }
            };
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() || bucket.chars().all(|c| c == '.') {
                return Err(err(
                    names::STAGE_IN,
                    format!("'{src}' names no bucket or container"),
                ));
            }
            if !bucket
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            {
                return Err(err(
                    names::STAGE_IN,
                    format!("'{bucket}' is not a valid bucket or container name"),
                ));
            }
            let prefix = prefix.trim_matches('/');
            check_segments(src, prefix)?;
            if prefix
                .split('/')
                .any(|seg| seg == ".." || seg == "." || (seg.is_empty() && !prefix.is_empty()))
            {
                return Err(err(
                    names::STAGE_IN,
                    format!("'{src}': the prefix may not hold empty, '.' or '..' segments"),
                ));
            }
            Ok(Source::Object {
                scheme,
                bucket: bucket.to_string(),
                prefix: prefix.to_string(),
            })
        }
    }
}

fn parse_posix(path: &str) -> Result<Source, OptionError> {
    if !path.starts_with('/') {
        return Err(err(
            names::STAGE_IN,
            format!(
                "'{path}' is a relative path; the job's nodes need an absolute one (e.g. /lustre/project/data) — {SOURCE_HELP}"
            ),
        ));
    }
    if path.split('/').any(|seg| seg == "..") {
        return Err(err(
            names::STAGE_IN,
            format!("'{path}': '..' is not allowed in a source path; give the resolved path"),
        ));
    }
    check_segments(path, path)?;
    let trimmed = path.trim_end_matches('/');
    Ok(Source::Posix {
        path: if trimmed.is_empty() {
            "/".to_string()
        } else {
            trimmed.to_string()
        },
    })
}

/// Refuses a path or prefix segment that begins or ends with whitespace. Those are almost always
/// typos, and they make normalisation ambiguous: the whole value is trimmed, so `/data/x /` would
/// name `x ` once and `x` when its normalised form is parsed again (and `/.. /` would become `..`).
fn check_segments(src: &str, path: &str) -> Result<(), OptionError> {
    let padded =
        |seg: &&str| seg.starts_with(char::is_whitespace) || seg.ends_with(char::is_whitespace);
    match path.split('/').find(padded) {
        Some(seg) => Err(err(
            names::STAGE_IN,
            format!(
                "'{src}': the path segment {seg:?} begins or ends with whitespace; remove it \
                 (sluice does not accept names with leading or trailing spaces)"
            ),
        )),
        None => Ok(()),
    }
}

fn default_name(source: &Source) -> Option<String> {
    let last = match source {
        Source::Posix { path } => path.rsplit('/').next().unwrap_or(""),
        Source::Object { bucket, prefix, .. } if prefix.is_empty() => bucket.as_str(),
        Source::Object { prefix, .. } => prefix.rsplit('/').next().unwrap_or(""),
    };
    (!last.is_empty()).then(|| last.to_string())
}

/// Parses one `[NAME=]SRC` entry.
pub fn parse_stage_entry(entry: &str) -> Result<StageSpec, OptionError> {
    let entry = entry.trim();
    // NAME= is recognised only before any '/' or ':', so `s3://b/k=v` stays a plain source.
    let (name, src) = match entry.find('=') {
        Some(i) if !entry[..i].contains(['/', ':']) => (Some(&entry[..i]), &entry[i + 1..]),
        _ => (None, entry),
    };
    let source = parse_source(src)?;
    let name = match name {
        Some(n) => n.to_string(),
        None => default_name(&source).ok_or_else(|| {
            err(
                names::STAGE_IN,
                format!("cannot derive a dataset name from '{src}'; write NAME={src}"),
            )
        })?,
    };
    validate_name(&name)?;
    Ok(StageSpec { name, source })
}

/// Parses every `--stage-in` value given (each may be comma-separated) and checks the set as a whole.
pub fn parse_stage_in<'a>(
    values: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<StageSpec>, OptionError> {
    let mut specs: Vec<StageSpec> = Vec::new();
    for value in values {
        check_text(names::STAGE_IN, value)?;
        for entry in value.split(',') {
            if entry.trim().is_empty() {
                return Err(err(
                    names::STAGE_IN,
                    format!("empty entry in '{value}'; {SOURCE_HELP}"),
                ));
            }
            let spec = parse_stage_entry(entry)?;
            if let Some(prev) = specs.iter().find(|s| s.name == spec.name) {
                return Err(err(
                    names::STAGE_IN,
                    format!(
                        "dataset NAME '{}' is used twice ({} and {}); give each a distinct NAME=",
                        spec.name, prev.source, spec.source
                    ),
                ));
            }
            specs.push(spec);
            if specs.len() > MAX_STAGE_SOURCES {
                return Err(err(
                    names::STAGE_IN,
                    format!("more than {MAX_STAGE_SOURCES} sources"),
                ));
            }
        }
    }
    Ok(specs)
}

pub fn parse_stage_tier(value: &str) -> Result<StageTier, OptionError> {
    match value.trim() {
        "local" => Ok(StageTier::Local),
        "shared" => Ok(StageTier::Shared),
        other => Err(err(
            names::STAGE_TIER,
            format!("unknown tier '{other}'; accepted: local (default), shared"),
        )),
    }
}

pub fn parse_ckpt_tier(value: &str) -> Result<CkptTier, OptionError> {
    match value.trim() {
        "local" => Ok(CkptTier::Local),
        "ram" => Ok(CkptTier::Ram),
        other => Err(err(
            names::CKPT_TIER,
            format!("unknown tier '{other}'; accepted: local (the NVMe hot tier, default), ram"),
        )),
    }
}

pub fn parse_stage_mode(value: &str) -> Result<StageMode, OptionError> {
    match value.trim() {
        "replicate" => Ok(StageMode::Replicate),
        "shard" => Ok(StageMode::Shard),
        other => Err(err(
            names::STAGE_MODE,
            format!("unknown mode '{other}'; accepted: replicate (the default), shard"),
        )),
    }
}

pub fn parse_ckpt_keep(value: &str) -> Result<u32, OptionError> {
    let v = value.trim();
    match v.parse::<u32>() {
        Ok(n) if (1..=MAX_CKPT_KEEP).contains(&n) => Ok(n),
        Ok(n) => Err(err(
            names::CKPT_KEEP,
            format!("{n} is out of range; give a number from 1 to {MAX_CKPT_KEEP}"),
        )),
        Err(_) => Err(err(
            names::CKPT_KEEP,
            format!("'{v}' is not a number; give how many checkpoints to keep, e.g. --ckpt-keep=2"),
        )),
    }
}

/// The most replicas a job may ask for (`--ckpt-replicas`); a site may allow fewer.
pub const MAX_CKPT_REPLICAS: u8 = 3;

pub fn parse_ckpt_replicas(value: &str) -> Result<u8, OptionError> {
    let v = value.trim();
    match v.parse::<u8>() {
        Ok(n) if n <= MAX_CKPT_REPLICAS => Ok(n),
        _ => Err(err(
            names::CKPT_REPLICAS,
            format!(
                "'{v}' is not a number from 0 to {MAX_CKPT_REPLICAS}; give how many other nodes of \
                 the job should hold a copy of each node's checkpoint part, e.g. --ckpt-replicas=1 \
                 (0: none)"
            ),
        )),
    }
}

/// Checkpoint tags are single path components: they name directories and object prefixes.
pub fn validate_tag(option: &'static str, tag: &str) -> Result<(), OptionError> {
    if tag.is_empty()
        || tag.len() > MAX_NAME_LEN
        || tag == "."
        || tag == ".."
        || tag.starts_with('.')
    {
        return Err(err(
            option,
            format!("'{tag}' is not a valid checkpoint tag"),
        ));
    }
    if !tag
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+'))
    {
        return Err(err(
            option,
            format!("checkpoint tag '{tag}' may only hold letters, digits, '.', '_', '-' and '+'"),
        ));
    }
    Ok(())
}

pub fn parse_ckpt_restore(value: &str) -> Result<Restore, OptionError> {
    let v = value.trim();
    check_text(names::CKPT_RESTORE, v)?;
    if v == "latest" {
        return Ok(Restore::Latest);
    }
    // `TAG!` forces a poisoned checkpoint ('!' is never part of a tag).
    let (tag, forced) = match v.strip_suffix('!') {
        Some(t) => (t, true),
        None => (v, false),
    };
    if tag == "latest" {
        return Err(err(
            names::CKPT_RESTORE,
            "'latest!' forces nothing: latest never restores a poisoned checkpoint; name the tag to force (TAG!)",
        ));
    }
    validate_tag(names::CKPT_RESTORE, tag).map_err(|e| {
        err(
            names::CKPT_RESTORE,
            format!(
                "{}; or give 'latest' (or TAG! to restore a poisoned checkpoint)",
                e.message
            ),
        )
    })?;
    Ok(if forced {
        Restore::Forced(tag.to_string())
    } else {
        Restore::Tag(tag.to_string())
    })
}

pub fn parse_ckpt_archive(value: &str) -> Result<String, OptionError> {
    let v = value.trim();
    check_text(names::CKPT_ARCHIVE, v)?;
    let spec = parse_source(v).map_err(|e| err(names::CKPT_ARCHIVE, e.message))?;
    Ok(match spec {
        // Archives are URLs throughout (object keys, manifests): a plain path becomes file://.
        Source::Posix { path } => format!("file://{path}"),
        other => other.to_string(),
    })
}

/// Builds [`JobOptions`] from raw values looked up by option name (`None` = not given).
/// Several `--stage-in` values travel joined by ',' (the same as one comma-separated value).
pub fn parse_job_options(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<JobOptions, OptionError> {
    let mut opts = JobOptions::default();
    if let Some(v) = lookup(names::STAGE_IN) {
        opts.stage_in = parse_stage_in([v.as_str()])?;
    }
    if let Some(v) = lookup(names::STAGE_TIER) {
        check_text(names::STAGE_TIER, &v)?;
        opts.stage_tier = parse_stage_tier(&v)?;
    }
    if let Some(v) = lookup(names::STAGE_MODE) {
        check_text(names::STAGE_MODE, &v)?;
        opts.stage_mode = parse_stage_mode(&v)?;
    }
    if let Some(v) = lookup(names::CKPT_ARCHIVE) {
        opts.ckpt_archive = Some(parse_ckpt_archive(&v)?);
    }
    if let Some(v) = lookup(names::CKPT_KEEP) {
        check_text(names::CKPT_KEEP, &v)?;
        opts.ckpt_keep = Some(parse_ckpt_keep(&v)?);
    }
    if let Some(v) = lookup(names::CKPT_RESTORE) {
        opts.ckpt_restore = Some(parse_ckpt_restore(&v)?);
    }
    if let Some(v) = lookup(names::CKPT_TIER) {
        check_text(names::CKPT_TIER, &v)?;
        opts.ckpt_tier = parse_ckpt_tier(&v)?;
    }
    if let Some(v) = lookup(names::CKPT_REPLICAS) {
        check_text(names::CKPT_REPLICAS, &v)?;
        opts.ckpt_replicas = Some(parse_ckpt_replicas(&v)?);
    }
    Ok(opts)
}

/// Checks one option value as the plugin's option callback sees it.
pub fn validate_option(name: &str, value: &str) -> Result<(), OptionError> {
    match name {
        names::STAGE_IN => parse_stage_in([value]).map(drop),
        names::STAGE_TIER => {
            check_text(names::STAGE_TIER, value).and_then(|_| parse_stage_tier(value).map(drop))
        }
        names::STAGE_MODE => {
            check_text(names::STAGE_MODE, value).and_then(|_| parse_stage_mode(value).map(drop))
        }
        names::CKPT_ARCHIVE => parse_ckpt_archive(value).map(drop),
        names::CKPT_KEEP => {
            check_text(names::CKPT_KEEP, value).and_then(|_| parse_ckpt_keep(value).map(drop))
        }
        names::CKPT_RESTORE => parse_ckpt_restore(value).map(drop),
        names::CKPT_TIER => {
            check_text(names::CKPT_TIER, value).and_then(|_| parse_ckpt_tier(value).map(drop))
        }
        names::CKPT_REPLICAS => check_text(names::CKPT_REPLICAS, value)
            .and_then(|_| parse_ckpt_replicas(value).map(drop)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(entry: &str) -> StageSpec {
        parse_stage_entry(entry).unwrap()
    }

    /// Asserts that `parsed` is refused with a message that says `says`.
    #[track_caller]
    fn assert_refused<T: std::fmt::Debug>(parsed: Result<T, OptionError>, says: &str) {
        let e = parsed.unwrap_err();
        assert!(e.message.contains(says), "{e}");
    }

    #[test]
    fn names_default_to_last_component() {
        assert_eq!(one("/lustre/proj/imagenet/").name, "imagenet");
        assert_eq!(one("s3://bucket/a/b").name, "b");
        assert_eq!(one("s3://bucket").name, "bucket");
        assert_eq!(
            one("file:///data/x").source,
            Source::Posix {
                path: "/data/x".into()
            }
        );
        assert_eq!(
            one("azure://c/p").source,
            Source::Object {
                scheme: ObjectScheme::Azure,
                bucket: "c".into(),
                prefix: "p".into()
            }
        );
    }

    #[test]
    fn explicit_names_and_equals_in_keys() {
        assert_eq!(one("train=s3://b/x").name, "train");
        // '=' after a '/' belongs to the key, not to a NAME; the derived name is then not portable.
        assert_eq!(
            one("ds=s3://b/k=v").source,
            Source::Object {
                scheme: ObjectScheme::S3,
                bucket: "b".into(),
                prefix: "k=v".into()
            }
        );
        assert_refused(parse_stage_entry("s3://b/k=v"), "may only hold");
    }

    #[test]
    fn bad_input_is_refused_with_a_useful_message() {
        let cases = [
            ("ftp://x/y", "unknown URL scheme"),
            ("data/x", "relative path"),
            ("=s3://b/x", "empty dataset NAME"),
            ("a/../b", "relative path"),
            ("/a/../b", "'..' is not allowed"),
            ("s3:///x", "names no bucket"),
            ("s3://b/../x", "'..' segments"),
            ("x y=/data", "may only hold"),
            ("file://rel", "absolute path"),
        ];
        for (input, needle) in cases {
            let e = parse_stage_in([input]).unwrap_err();
            assert!(e.to_string().contains(needle), "{input}: {e}");
            assert!(e.to_string().starts_with("--stage-in: "), "{e}");
        }
    }

    #[test]
    fn duplicates_and_limits() {
        let e = parse_stage_in(["/a/data,/b/data"]).unwrap_err();
        assert!(e.message.contains("used twice"), "{e}");
        assert!(parse_stage_in(["/a/data", "x=/b/data"]).is_ok());
        let long = format!("/{}", "a".repeat(MAX_OPTION_LEN));
        assert_refused(parse_stage_in([long.as_str()]), "at most");
        assert_refused(parse_stage_in(["/a\nb"]), "control character");
        assert_refused(parse_stage_in(["/a,,/b"]), "empty entry");
    }

    #[test]
    fn scalar_options() {
        assert_eq!(parse_ckpt_replicas(" 2 "), Ok(2));
        assert_eq!(parse_ckpt_replicas("0"), Ok(0));
        assert_refused(parse_ckpt_replicas("4"), "from 0 to 3");
        assert_refused(parse_ckpt_replicas("-1"), "e.g. --ckpt-replicas=1");
        assert_eq!(parse_ckpt_keep("3"), Ok(3));
        assert_refused(parse_ckpt_keep("two"), "not a number");
        assert_refused(parse_ckpt_keep("0"), "out of range");
        assert_refused(parse_stage_tier("nvme"), "local (default), shared");
        assert_eq!(parse_ckpt_tier(" ram ").unwrap(), CkptTier::Ram);
        assert!(
            parse_ckpt_tier("gpu")
                .unwrap_err()
                .to_string()
                .contains("--ckpt-tier")
        );
        let o = parse_job_options(|n| (n == names::CKPT_TIER).then(|| "ram".to_string())).unwrap();
        assert_eq!(o.ckpt_tier, CkptTier::Ram);
        assert!(validate_option(names::CKPT_TIER, "tmpfs").is_err());
        assert_refused(
            parse_stage_mode("stripe"),
            "accepted: replicate (the default), shard",
        );
        assert_eq!(parse_stage_mode("shard"), Ok(StageMode::Shard));
        assert_refused(
            parse_stage_entry("ds.shard.json=s3://b/ds"),
            "kept for shard manifests",
        );
        assert_eq!(parse_ckpt_restore("latest"), Ok(Restore::Latest));
        assert_eq!(
            parse_ckpt_restore("step-100"),
            Ok(Restore::Tag("step-100".into()))
        );
        assert!(parse_ckpt_restore("../x").is_err());
        assert_eq!(
            parse_ckpt_restore("step-100!"),
            Ok(Restore::Forced("step-100".into()))
        );
        assert_eq!(
            parse_ckpt_restore("step-100!").unwrap().tag(),
            Some("step-100")
        );
        for bad in ["!", "latest!", "step!!", "st!ep"] {
            assert!(parse_ckpt_restore(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_ckpt_archive("s3://ckpt/alice/").unwrap(),
            "s3://ckpt/alice"
        );
    }

    #[test]
    fn job_options_from_lookup() {
        let opts = parse_job_options(|n| match n {
            "stage-in" => Some("/a/x,name=s3://b/p".into()),
            "ckpt-keep" => Some("2".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(opts.stage_in.len(), 2);
        assert_eq!(opts.ckpt_keep, Some(2));
        assert!(!opts.is_empty());
        assert!(parse_job_options(|_| None).unwrap().is_empty());
        // --ckpt-replicas is of RAM-tier checkpoints only.
        let ram = parse_job_options(|n| match n {
            "ckpt-tier" => Some("ram".into()),
            "ckpt-replicas" => Some("2".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(ram.ckpt_replicas, Some(2));
        // Its absence is not sent, so that an agent of the release before reads the options.
        let json = serde_json::to_string(&parse_job_options(|_| None).unwrap()).unwrap();
        assert!(!json.contains("ckpt_replicas"), "{json}");
    }

    /// F8 in docs/SECURITY.md: the normalised form of an accepted value parses back to itself.
    #[test]
    fn whitespace_around_segments_is_refused_so_normalising_is_a_fixpoint() {
        for bad in [
            "s3://b/p /",
            "s3://b/p /q",
            "s3://b/ p",
            "/.. /",
            "/data/x /",
            "/data/ x",
            "file:///data/x\u{a0}/",
            "d=az://c/.. /x",
        ] {
            let e = parse_stage_in([bad]).unwrap_err();
            assert!(
                e.message.contains("begins or ends with whitespace"),
                "{bad:?}: {e}"
            );
        }
        let e = parse_ckpt_archive("s3://ckpt/alice /").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--ckpt-archive: 's3://ckpt/alice /': the path segment \"alice \" begins or ends with \
             whitespace; remove it (sluice does not accept names with leading or trailing spaces)"
        );
        // Around the whole value, whitespace is still trimmed; inside a segment it is kept.
        assert_eq!(
            parse_ckpt_archive(" s3://ckpt/a b/ ").unwrap(),
            "s3://ckpt/a b"
        );
        assert_eq!(one("d=/data/my set").source.to_string(), "/data/my set");

        // A POSIX path holding "://" is a path, and its display parses back to it.
        let spec = one("x=/data/a://b/");
        assert_eq!(
            spec.source,
            Source::Posix {
                path: "/data/a://b".into()
            }
        );
        assert_eq!(one(&format!("x={}", spec.source)), spec);
        assert_eq!(
            parse_ckpt_archive("/data/a://b").unwrap(),
            "file:///data/a://b"
        );

        for input in [
            "s3://b/p/",
            "abfs://c//p/q/",
            "/lustre//x/./y/",
            "root=file:///",
            "gs://b",
            "n=s3://b/k=v",
        ] {
            let first = one(input);
            let again = one(&format!("{}={}", first.name, first.source));
            assert_eq!(again, first, "{input:?} does not round-trip");
            let url = parse_ckpt_archive(&first.source.to_string()).unwrap();
            assert_eq!(parse_ckpt_archive(&url).unwrap(), url, "{input:?}");
        }
    }
}
