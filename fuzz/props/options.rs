//! What must hold for every set of job options the agent accepts (it acts on them as root): one
//! definition of the properties, checked by the coverage-guided `job_options` target here in `fuzz/`
//! and by the brief deterministic run in `proto/tests/fuzz_smoke.rs`, which include this file.

use sluice_proto::options::{
    self, JobOptions, MAX_CKPT_KEEP, MAX_NAME_LEN, MAX_OPTION_LEN, MAX_STAGE_SOURCES, Restore,
    Source,
};

/// The value of option `name` among `values` (in the order given): the last one wins, as with Slurm.
pub fn last_value(values: &[(&str, String)], name: &str) -> Option<String> {
    values
        .iter()
        .rev()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.clone())
}

pub fn no_dotdot(what: &str, s: &str) {
    assert!(
        !s.split('/').any(|seg| seg == ".."),
        "{what} accepted with a '..' segment: {s:?}"
    );
}

pub fn plain_text(what: &str, s: &str) {
    assert!(
        !s.chars().any(char::is_control),
        "{what} accepted with a control character: {s:?}"
    );
    assert!(
        s.len() <= MAX_OPTION_LEN,
        "{what} accepted at {} bytes",
        s.len()
    );
}

/// Everything that must hold for options the agent accepted (it acts on them as root).
pub fn check_accepted(opts: &JobOptions) {
    assert!(opts.stage_in.len() <= MAX_STAGE_SOURCES);
    let mut names_seen = std::collections::BTreeSet::new();
    for spec in &opts.stage_in {
        let n = &spec.name;
        assert!(
            options::validate_name(n).is_ok(),
            "accepted dataset name {n:?} fails validate_name"
        );
        assert!(!n.is_empty() && n.len() <= MAX_NAME_LEN && n != "." && n != "..");
        assert!(
            !n.contains(['/', '\0']),
            "dataset name {n:?} is not one component"
        );
        assert!(
            names_seen.insert(n.clone()),
            "dataset name {n:?} accepted twice"
        );
        match &spec.source {
            Source::Posix { path } => {
                assert!(path.starts_with('/'), "relative POSIX source {path:?}");
                no_dotdot("POSIX source", path);
                plain_text("POSIX source", path);
            }
            Source::Object { bucket, prefix, .. } => {
                assert!(
                    !bucket.is_empty()
                        && bucket
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')),
                    "bucket {bucket:?}"
                );
                assert!(
                    prefix.is_empty()
                        || !prefix
                            .split('/')
                            .any(|s| s.is_empty() || s == "." || s == ".."),
                    "object prefix {prefix:?}"
                );
                plain_text("object prefix", prefix);
            }
        }
    }
    if let Some(url) = &opts.ckpt_archive {
        no_dotdot("--ckpt-archive", url);
        plain_text("--ckpt-archive", url);
        // Normalised: parsing the result gives the result (F8: whitespace around segments is
        // refused, so the trimming of the whole value cannot change a segment the second time).
        match options::parse_ckpt_archive(url) {
            Ok(again) => assert_eq!(&again, url, "--ckpt-archive does not round-trip"),
            Err(e) => {
                panic!("the accepted --ckpt-archive {url:?} is refused when parsed again: {e}")
            }
        }
    }
    if let Some(k) = opts.ckpt_keep {
        assert!((1..=MAX_CKPT_KEEP).contains(&k));
    }
    if let Some(t) = opts.ckpt_restore.as_ref().and_then(Restore::tag) {
        assert!(
            options::validate_tag("ckpt-restore", t).is_ok(),
            "restore tag {t:?}"
        );
        assert!(!t.starts_with('.') && !t.contains('/'));
    }
    // Round trip of the stage-in set: rendering NAME=SOURCE (the sources' own display, which is
    // what messages and the allow-list check use) and parsing again gives the same specs.
    if !opts.stage_in.is_empty() {
        let rendered: Vec<String> = opts
            .stage_in
            .iter()
            .map(|s| format!("{}={}", s.name, s.source))
            .collect();
        let joined = rendered.join(",");
        match options::parse_stage_in([joined.as_str()]) {
            Ok(again) => assert_eq!(
                again, opts.stage_in,
                "stage-in does not round-trip via {joined:?}"
            ),
            Err(e) => panic!("re-parsing the accepted stage-in as {joined:?}: {e}"),
        }
    }
}
