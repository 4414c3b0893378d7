//! The job options as the agent (root) parses them from a JobStart, and as the plugin checks them at
//! submit time (`sluice_proto::options`). The input is split at 0xFF bytes into option values, each
//! assigned to one option name by its first byte.
//!
//! Properties: never panics; the plugin's check and the agent's parse agree on every value; whatever
//! is accepted holds no `..` segment, no control character, no over-long value, and only one-
//! component dataset names; accepted values round-trip through their normalised form.
//!
//! The round trip is exact: F8 of docs/SECURITY.md (whitespace around segments, `/.. /`, a `://`
//! inside a POSIX path) made it hold only up to trailing whitespace; those inputs are now refused
//! or parsed as paths.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::options::{self, MAX_OPTION_LEN, Restore, Source, names};

fuzz_target!(|data: &[u8]| {
    let mut values: Vec<(&str, String)> = Vec::new();
    for piece in data.split(|b| *b == 0xFF).take(8) {
        let Some((first, rest)) = piece.split_first() else {
            continue;
        };
        let name = names::ALL[*first as usize % names::ALL.len()];
        values.push((name, String::from_utf8_lossy(rest).into_owned()));
    }
    let lookup = |n: &str| {
        values
            .iter()
            .rev()
            .find(|(k, _)| *k == n)
            .map(|(_, v)| v.clone())
    };
    // The plugin's submit-time check and the agent's root-side parse agree, value by value.
    for name in names::ALL {
        if let Some(v) = lookup(name) {
            let plugin_ok = options::validate_option(name, &v).is_ok();
            let agent_ok = options::parse_job_options(|n| (n == name).then(|| v.clone())).is_ok();
            assert_eq!(
                plugin_ok, agent_ok,
                "--{name}={v:?}: plugin and agent disagree"
            );
        }
    }
    let parsed = options::parse_job_options(lookup);
    let Ok(opts) = parsed else { return };
    let clean = |what: &str, s: &str| {
        assert!(!s.split('/').any(|x| x == ".."), "{what}: '..' in {s:?}");
        assert!(
            !s.chars().any(char::is_control),
            "{what}: control char in {s:?}"
        );
        assert!(s.len() <= MAX_OPTION_LEN, "{what}: {} bytes", s.len());
    };
    for spec in &opts.stage_in {
        options::validate_name(&spec.name).expect("accepted name validates");
        match &spec.source {
            Source::Posix { path } => {
                assert!(path.starts_with('/'));
                clean("posix", path);
            }
            Source::Object { prefix, .. } => {
                clean("prefix", prefix);
                assert!(prefix.is_empty() || !prefix.split('/').any(|s| s.is_empty() || s == "."));
            }
        }
    }
    if !opts.stage_in.is_empty() {
        // The sources' own display (used in messages and the allow-list check) parses back.
        let rendered: Vec<String> = opts
            .stage_in
            .iter()
            .map(|s| format!("{}={}", s.name, s.source))
            .collect();
        let joined = rendered.join(",");
        match options::parse_stage_in([joined.as_str()]) {
            Ok(again) => assert_eq!(again, opts.stage_in, "via {joined:?}"),
            Err(e) => panic!("the accepted stage-in re-parsed as {joined:?}: {e}"),
        }
    }
    if let Some(url) = &opts.ckpt_archive {
        clean("ckpt-archive", url);
        // Normalised: parsing the result gives the result.
        match options::parse_ckpt_archive(url) {
            Ok(again) => assert_eq!(&again, url, "--ckpt-archive does not round-trip"),
            Err(e) => {
                panic!("the accepted --ckpt-archive {url:?} is refused when parsed again: {e}")
            }
        }
    }
    if let Some(Restore::Tag(t)) = &opts.ckpt_restore {
        options::validate_tag("ckpt-restore", t).expect("accepted tag validates");
    }
});
