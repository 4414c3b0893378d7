//! The job options as the agent (root) parses them from a JobStart, and as the plugin checks them at
//! submit time (`sluice_proto::options`). The input is split at 0xFF bytes into option values, each
//! assigned to one option name by its first byte.
//!
//! Properties: never panics; the plugin's check and the agent's parse agree on every value; whatever
//! is accepted holds no `..` segment, no control character, no over-long value, and only one-
//! component dataset names; accepted values round-trip through their normalised form (all of it in
//! `props/options.rs`, which proto/tests/fuzz_smoke.rs checks on its own mutated inputs too).
//!
//! The round trip is exact: F8 of docs/SECURITY.md (whitespace around segments, `/.. /`, a `://`
//! inside a POSIX path) made it hold only up to trailing whitespace; those inputs are now refused
//! or parsed as paths.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::options::{self, names};

#[path = "../props/options.rs"]
mod props;

fuzz_target!(|data: &[u8]| {
    let mut values: Vec<(&str, String)> = Vec::new();
    for piece in data.split(|b| *b == 0xFF).take(8) {
        let Some((first, rest)) = piece.split_first() else {
            continue;
        };
        let name = names::ALL[*first as usize % names::ALL.len()];
        values.push((name, String::from_utf8_lossy(rest).into_owned()));
    }
    let lookup = |n: &str| props::last_value(&values, n);
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
    if let Ok(opts) = options::parse_job_options(lookup) {
        props::check_accepted(&opts);
    }
});
