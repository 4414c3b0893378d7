//! Expansion of Slurm hostlist expressions (`n[1-3]`, `gpu[01-04,07]`, `a[1-2]b[3-4]`).
//!
//! The plugin expands `SLURM_NODELIST` in `job_prolog` so that every agent of a job sees the same,
//! ordered node list (file ownership is decided by rendezvous hashing over it). Slurm hands us the
//! compressed form; expanding it here keeps the plugin free of libslurm's `hostlist_*` API.
//!
//! Semantics follow Slurm's `hostlist_create`: entries are separated by commas (or whitespace) outside
//! brackets; a bracket holds comma-separated numbers and `lo-hi` ranges; the width of `lo` sets the
//! zero padding (`[08-11]` gives `08 09 10 11`); several bracket groups in one entry multiply
//! (`a[1-2]b[3-4]` gives `a1b3 a1b4 a2b3 a2b4`). Order and duplicates are kept as written.
//!
//! The expression runs in root's prolog, so everything it can make us allocate is bounded before it
//! is allocated: the expression's length, the count of names, each name's length and their total
//! bytes. A count cap alone is not enough: the zero padding is the written width of a range's low
//! bound, so `n[` + 100 zeros + `-65535]` is 200 bytes that would expand to 6.7 MB.

/// Most host names one expression may expand to.
pub const MAX_HOSTS: usize = 65536;
/// Longest expression accepted (Slurm's compressed node list of a very large, fragmented job fits).
pub const MAX_EXPR_BYTES: usize = 64 * 1024;
/// Longest host name (as the agent accepts in `JobStart`).
pub const MAX_NAME_BYTES: usize = 255;
/// Most bytes all names together may have: the expanded list travels in one `JobStart` frame, which
/// is at most 1 MiB, so a larger list could never reach the agent anyway.
pub const MAX_TOTAL_BYTES: usize = 1024 * 1024;

/// Errors name the expression shortened to its first [`SHOWN_BYTES`] bytes: it may be 64 KiB.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostlistError {
    #[error("hostlist '{expr}': unbalanced '[' or ']'")]
    Unbalanced { expr: String },
    #[error("hostlist '{expr}': bad range '{range}' (expected N or LO-HI with LO <= HI)")]
    BadRange { expr: String, range: String },
    #[error("hostlist '{expr}' expands to more than {MAX_HOSTS} hosts")]
    TooMany { expr: String },
    #[error("hostlist of {len} bytes is longer than {MAX_EXPR_BYTES} bytes")]
    TooLong { len: usize },
    #[error(
        "hostlist '{expr}' expands to a host name longer than {MAX_NAME_BYTES} bytes \
         or to more than {MAX_TOTAL_BYTES} bytes of names"
    )]
    TooBig { expr: String },
}

/// How much of an expression an error repeats.
const SHOWN_BYTES: usize = 80;

fn shown(expr: &str) -> String {
    if expr.len() <= SHOWN_BYTES {
        return expr.to_string();
    }
    let mut end = SHOWN_BYTES;
    while !expr.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &expr[..end])
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
    if expr.len() > MAX_EXPR_BYTES {
        return Err(HostlistError::TooLong { len: expr.len() });
    }
    let mut out = Expansion::default();
    for entry in split_top_level(expr)? {
        expand_entry(expr, entry, &mut out)?;
    }
    Ok(out.hosts)
}

/// The names so far and their total bytes, which the caps are checked against.
#[derive(Default)]
struct Expansion {
    hosts: Vec<String>,
    bytes: usize,
}

/// Splits at commas and whitespace that are not inside brackets.
fn split_top_level(expr: &str) -> Result<Vec<&str>, HostlistError> {
    let unbalanced = || HostlistError::Unbalanced { expr: shown(expr) };
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

fn expand_entry(expr: &str, entry: &str, out: &mut Expansion) -> Result<(), HostlistError> {
    let too_many = || HostlistError::TooMany { expr: shown(expr) };
    let too_big = || HostlistError::TooBig { expr: shown(expr) };
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

    // Count names, the longest name and the total bytes before building anything, so the caps hold
    // for the allocation too. A part's bytes appear once in every name the other parts make.
    let count = parts.iter().try_fold(1usize, |n, p| match p {
        Part::Text(_) => Some(n),
        Part::Choices(c) => n.checked_mul(c.len()),
    });
    let count = match count {
        Some(n) if n <= MAX_HOSTS - out.hosts.len() => n,
        _ => return Err(too_many()),
    };
    if count == 0 {
        return Ok(());
    }
    let longest: usize = parts.iter().map(Part::longest).sum();
    let bytes = parts.iter().try_fold(0usize, |total, p| {
        let others = count / p.len();
        total.checked_add(p.bytes().checked_mul(others)?)
    });
    match bytes {
        Some(b) if longest <= MAX_NAME_BYTES && b <= MAX_TOTAL_BYTES - out.bytes => out.bytes += b,
        _ => return Err(too_big()),
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
    out.hosts.extend(names);
    Ok(())
}

impl Part<'_> {
    /// How many alternatives this part offers (1 for text).
    fn len(&self) -> usize {
        match self {
            Part::Text(_) => 1,
            Part::Choices(c) => c.len(),
        }
    }

    /// The bytes of all alternatives together.
    fn bytes(&self) -> usize {
        match self {
            Part::Text(t) => t.len(),
            Part::Choices(c) => c.iter().map(String::len).sum(),
        }
    }

    fn longest(&self) -> usize {
        match self {
            Part::Text(t) => t.len(),
            Part::Choices(c) => c.iter().map(String::len).max().unwrap_or(0),
        }
    }
}

/// Expands the inside of one bracket group: `1-3,7,09-11`. Each alternative is at most
/// [`MAX_NAME_BYTES`] long and all together at most [`MAX_TOTAL_BYTES`], checked as they are made.
fn expand_ranges(expr: &str, inner: &str) -> Result<Vec<String>, HostlistError> {
    let mut out = Vec::new();
    let mut bytes = 0usize;
    for range in inner.split(',') {
        let bad = || HostlistError::BadRange {
            expr: shown(expr),
            range: shown(range),
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
            return Err(HostlistError::TooMany { expr: shown(expr) });
        }
        // The padding is the written width of `lo`, so a long run of zeros makes every name long.
        let width = lo.len();
        if width > MAX_NAME_BYTES {
            return Err(HostlistError::TooBig { expr: shown(expr) });
        }
        for n in lo_n..=hi_n {
            let name = format!("{n:0width$}");
            bytes += name.len();
            if bytes > MAX_TOTAL_BYTES {
                return Err(HostlistError::TooBig { expr: shown(expr) });
            }
            out.push(name);
        }
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
        // One range past the cap; products and sums of ranges count too.
        for many in [
            "n[1-65537]",
            "a[1-1000]b[1-1000]",
            "a[1-40000],b[1-40000]",
            "a[0-18446744073709551615]",
            "a[1-65536,1]",
        ] {
            let e = expand(many).unwrap_err();
            assert!(matches!(e, HostlistError::TooMany { .. }), "{many}: {e}");
        }
    }

    /// F6 in docs/SECURITY.md: 206 bytes that used to expand to 65536 names of 102 bytes (6.7 MB).
    #[test]
    fn the_bytes_of_the_names_are_capped_too() {
        let expr = format!("n[{}0-{}65535]", "0".repeat(100), "0".repeat(96));
        assert_eq!(expr.len(), 206);
        let e = expand(&expr).unwrap_err();
        assert!(matches!(e, HostlistError::TooBig { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("more than 1048576 bytes of names"), "{msg}");
        assert!(
            msg.len() < 300,
            "the error repeats the whole expression: {msg}"
        );

        // One name longer than a host name can be, from padding or from text.
        let e = expand(&format!("n[{}1-2]", "0".repeat(300))).unwrap_err();
        assert!(matches!(e, HostlistError::TooBig { .. }), "{e}");
        let e = expand(&format!("{}[1-2]", "x".repeat(300))).unwrap_err();
        assert!(matches!(e, HostlistError::TooBig { .. }), "{e}");
        // Text multiplied by a range: 65536 names of 200 bytes.
        let e = expand(&format!("{}[1-65536]", "x".repeat(200))).unwrap_err();
        assert!(matches!(e, HostlistError::TooBig { .. }), "{e}");
        // A text part after a range counts as well as one before it.
        let e = expand(&format!("n[1-65536]{}", "x".repeat(200))).unwrap_err();
        assert!(matches!(e, HostlistError::TooBig { .. }), "{e}");
        // Many entries add up.
        let many = vec![format!("{}[1-5000]", "y".repeat(60)); 4].join(",");
        let e = expand(&many).unwrap_err();
        assert!(matches!(e, HostlistError::TooBig { .. }), "{e}");

        // What a real cluster writes still expands: 65536 names of 12 bytes.
        let hosts = ex("gpu-node[00001-65536]");
        assert_eq!(hosts.len(), MAX_HOSTS);
        assert_eq!(hosts[0], "gpu-node00001");
        assert_eq!(ex(&format!("{}[1-2]", "h".repeat(254))).len(), 2);
    }

    #[test]
    fn the_expression_length_is_capped() {
        let long = "n1,".repeat(MAX_EXPR_BYTES / 3 + 1);
        let e = expand(&long).unwrap_err();
        assert_eq!(e, HostlistError::TooLong { len: long.len() });
        assert!(e.to_string().len() < 100, "{e}");
        // Errors about long expressions do not repeat them whole.
        let e = expand(&format!("{}[1", "n".repeat(5000))).unwrap_err();
        assert!(e.to_string().len() < 200, "{e}");
    }
}
