//! Expansion of Slurm hostlist expressions (`n[1-3]`, `gpu[01-04,07]`, `a[1-2]b[3-4]`).
//!
//! The plugin expands `SLURM_NODELIST` in `job_prolog` so that every agent of a job sees the same,
//! ordered node list (file ownership is decided by rendezvous hashing over it). Slurm hands us the
//! compressed form; expanding it here keeps the plugin free of libslurm's `hostlist_*` API.
//!
//! Semantics follow Slurm's `hostlist_create`: entries are separated by commas (or whitespace) outside
//! brackets; a bracket holds comma-separated numbers and `lo-hi` ranges; the width of `lo` sets the
//! zero padding (`[08-11]` gives `08 09 10 11`); several bracket groups in one entry multiply
//! (`a[1-2]b[3-4]` gives `a1b3 a1b4 a2b3 a2b4`). Order and duplicates are kept as written. The
//! expanded count is capped, so a hostile or corrupt expression cannot make root allocate without
//! bound.

/// Most host names one expression may expand to.
pub const MAX_HOSTS: usize = 65536;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostlistError {
    #[error("hostlist '{expr}': unbalanced '[' or ']'")]
    Unbalanced { expr: String },
    #[error("hostlist '{expr}': bad range '{range}' (expected N or LO-HI with LO <= HI)")]
    BadRange { expr: String, range: String },
    #[error("hostlist '{expr}' expands to more than {MAX_HOSTS} hosts")]
    TooMany { expr: String },
}

/// One piece of an entry: literal text, or the alternatives of one bracket group.
enum Part<'a> {
    Text(&'a str),
    Choices(Vec<String>),
}

/// Expands a hostlist expression into host names, in order.
///
/// An empty expression (or one made only of separators) expands to an empty list.
pub fn expand(expr: &str) -> Result<Vec<String>, HostlistError> {
    let mut hosts = Vec::new();
    for entry in split_top_level(expr)? {
        expand_entry(expr, entry, &mut hosts)?;
    }
    Ok(hosts)
}

/// Splits at commas and whitespace that are not inside brackets.
fn split_top_level(expr: &str) -> Result<Vec<&str>, HostlistError> {
    let unbalanced = || HostlistError::Unbalanced {
        expr: expr.to_string(),
    };
    let mut entries = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (i, c) in expr.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(unbalanced()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(unbalanced()),
            ',' | ' ' | '\t' | '\n' if depth == 0 => {
                entries.push(&expr[start..i]);
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(unbalanced());
    }
    entries.push(&expr[start..]);
    Ok(entries.into_iter().filter(|e| !e.is_empty()).collect())
}

fn expand_entry(expr: &str, entry: &str, out: &mut Vec<String>) -> Result<(), HostlistError> {
    let too_many = || HostlistError::TooMany {
        expr: expr.to_string(),
    };
    let mut parts = Vec::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        // split_top_level already checked that brackets pair up and do not nest.
        let close = open + rest[open..].find(']').expect("balanced brackets");
        if open > 0 {
            parts.push(Part::Text(&rest[..open]));
        }
        parts.push(Part::Choices(expand_ranges(expr, &rest[open + 1..close])?));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }

    // Count before building anything, so the cap holds for the allocation too.
    let count = parts.iter().try_fold(1usize, |n, p| match p {
        Part::Text(_) => Some(n),
        Part::Choices(c) => n.checked_mul(c.len()),
    });
    match count {
        Some(n) if n <= MAX_HOSTS - out.len() => {}
        _ => return Err(too_many()),
    }

    let mut names = vec![String::new()];
    for part in &parts {
        names = match part {
            Part::Text(t) => names.into_iter().map(|n| n + t).collect(),
            Part::Choices(choices) => names
                .iter()
                .flat_map(|n| choices.iter().map(move |c| format!("{n}{c}")))
                .collect(),
        };
    }
    out.extend(names);
    Ok(())
}

/// Expands the inside of one bracket group: `1-3,7,09-11`.
fn expand_ranges(expr: &str, inner: &str) -> Result<Vec<String>, HostlistError> {
    let mut out = Vec::new();
    for range in inner.split(',') {
        let bad = || HostlistError::BadRange {
            expr: expr.to_string(),
            range: range.to_string(),
        };
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(bad());
        }
        let (lo_n, hi_n): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if lo_n > hi_n {
            return Err(bad());
        }
        if hi_n - lo_n >= (MAX_HOSTS - out.len()) as u64 {
            return Err(HostlistError::TooMany {
                expr: expr.to_string(),
            });
        }
        let width = lo.len();
        out.extend((lo_n..=hi_n).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(expr: &str) -> Vec<String> {
        expand(expr).unwrap_or_else(|e| panic!("{expr}: {e}"))
    }

    #[test]
    fn plain_names_and_lists() {
        assert_eq!(ex("n1"), ["n1"]);
        assert_eq!(ex("n1,n2,login"), ["n1", "n2", "login"]);
        assert_eq!(ex("n1 n2"), ["n1", "n2"]);
        assert_eq!(ex(""), Vec::<String>::new());
        assert_eq!(ex("n1,,n2,"), ["n1", "n2"]);
    }

    #[test]
    fn ranges_keep_order_and_padding() {
        assert_eq!(ex("n[1-3]"), ["n1", "n2", "n3"]);
        assert_eq!(
            ex("gpu[01-04,07]"),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(ex("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(ex("n[08-11]"), ["n08", "n09", "n10", "n11"]);
        assert_eq!(ex("n[3,1]"), ["n3", "n1"]);
        assert_eq!(ex("rack1-n[1-2]-ib"), ["rack1-n1-ib", "rack1-n2-ib"]);
        assert_eq!(ex("n[1-2],gpu[1-2],x"), ["n1", "n2", "gpu1", "gpu2", "x"]);
    }

    #[test]
    fn several_bracket_groups_multiply() {
        assert_eq!(ex("a[1-2]b[3-4]"), ["a1b3", "a1b4", "a2b3", "a2b4"]);
        assert_eq!(ex("[1-2]"), ["1", "2"]);
    }

    #[test]
    fn malformed_expressions_are_refused() {
        for bad in [
            "n[1-3", "n1-3]", "n[[1]]", "n[]", "n[3-1]", "n[a-b]", "n[1-]", "n[-2]", "n[1,,2]",
        ] {
            assert!(expand(bad).is_err(), "{bad} should be refused");
        }
        assert!(matches!(
            expand("n[3-1]"),
            Err(HostlistError::BadRange { .. })
        ));
        assert!(matches!(
            expand("n[1"),
            Err(HostlistError::Unbalanced { .. })
        ));
        assert!(expand("n[99999999999999999999999-1]").is_err());
    }

    #[test]
    fn the_cap_holds_before_allocating() {
        assert_eq!(expand("n[1-65536]").unwrap().len(), MAX_HOSTS);
        let e = expand("n[1-65537]").unwrap_err();
        assert!(matches!(e, HostlistError::TooMany { .. }), "{e}");
        // Products and sums of ranges count too.
        assert!(matches!(
            expand("a[1-1000]b[1-1000]"),
            Err(HostlistError::TooMany { .. })
        ));
        assert!(matches!(
            expand("a[1-40000],b[1-40000]"),
            Err(HostlistError::TooMany { .. })
        ));
        assert!(matches!(
            expand("a[0-18446744073709551615]"),
            Err(HostlistError::TooMany { .. })
        ));
        assert!(matches!(
            expand("a[1-65536,1]"),
            Err(HostlistError::TooMany { .. })
        ));
    }
}
