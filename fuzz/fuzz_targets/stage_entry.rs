//! One `--stage-in` entry (`[NAME=]SRC`), parsed alone and as a whole option value.
//!
//! Properties: never panics; an accepted entry has a one-component name and no `..` segment in its
//! path or prefix, and its source's display parses back to it. `parse_stage_entry` alone does not
//! check control characters or the length limit: that is `parse_stage_in`'s job (every caller goes
//! through it), asserted here on the same input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_proto::options::{self, MAX_OPTION_LEN, Source};

fuzz_target!(|data: &[u8]| {
    let Ok(entry) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(spec) = options::parse_stage_entry(entry) {
        options::validate_name(&spec.name).expect("accepted name validates");
        let path = match &spec.source {
            Source::Posix { path } => path,
            Source::Object { prefix, .. } => prefix,
        };
        assert!(
            !path.split('/').any(|s| s == ".."),
            "'..' accepted in {entry:?}"
        );
    }
    if let Ok(specs) = options::parse_stage_in([entry]) {
        for spec in specs {
            let text = spec.source.to_string();
            assert!(
                !text.chars().any(char::is_control),
                "control char accepted: {entry:?}"
            );
            assert!(text.len() <= MAX_OPTION_LEN + 8);
            // The display parses back to the same spec (F8).
            let again = options::parse_stage_entry(&format!("{}={text}", spec.name));
            assert_eq!(again.as_ref(), Ok(&spec), "{entry:?} via {text:?}");
        }
    }
});
