//! A brief, deterministic fuzz run of everything in `sluice-proto` that parses untrusted bytes, as
//! part of the normal test suite (the coverage-guided targets live in `fuzz/`; they need nightly).
//!
//! Inputs come from a seed corpus of valid frames and option values, mutated by a small xorshift
//! generator with a fixed seed, so a failure reproduces exactly (the panic message names the input).
//! What is asserted, for every input:
//!
//! - **no panic** in the frame decoder ([`wire::read_frame`], [`wire::frame_len`],
//!   [`wire::decode_request`], [`wire::decode_response`]), the option parser
//!   ([`options::parse_job_options`], [`options::parse_stage_entry`], [`options::validate_option`])
//!   or the hostlist expander;
//! - **bounded allocation**: no single allocation while reading and decoding one frame is larger
//!   than the frame limit (plus slack), however large its length header claims to be — an oversized
//!   header is refused after reading the 4 header bytes and nothing else;
//! - **every accepted option value is safe and stable**: no `..` path segment, no control character,
//!   no over-long value or name; the submit-time check (`validate_option`, the plugin) and the
//!   root-side parse (`parse_job_options`, the agent) agree; the normalised result parses again to
//!   itself (round trip).

use sluice_proto::PROTO_VERSION;
use sluice_proto::hostlist;
use sluice_proto::msg::{JobStart, Request, Response};
use sluice_proto::options::{self, MAX_NAME_LEN, MAX_OPTION_LEN, MAX_STAGE_SOURCES, Source, names};
use sluice_proto::wire::{self, Envelope, FrameError, MAX_FRAME};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Read;

// ------------------------------------------------------------------------------- allocation probe

/// Records, per thread, the largest single allocation made while armed. Per thread, because the
/// test harness runs the tests of this file on several threads at once.
struct Probe;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = ARMED.try_with(|armed| {
        if armed.get() {
            let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
        }
    });
}

// SAFETY: every method forwards its arguments unchanged to the system allocator, so `Probe` keeps
// `GlobalAlloc`'s contract as `System` does; `note` only reads and sets `const` thread-locals (no
// allocation, no destructor) and never panics.
unsafe impl GlobalAlloc for Probe {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Probe = Probe;

/// Runs `f` and returns its result with the largest single allocation it made on this thread.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    ARMED.with(|a| a.set(true));
    let out = f();
    ARMED.with(|a| a.set(false));
    (out, LARGEST.with(|l| l.get()))
}

// ------------------------------------------------------------------------------------ generator

/// xorshift64*: tiny, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Byte strings that tend to matter to these parsers.
const TOKENS: &[&[u8]] = &[
    b"..",
    b"/..",
    b"../",
    b"/./",
    b".",
    b"/",
    b"//",
    b"\0",
    b"\n",
    b"\r",
    b"\t",
    b"\x1b[2J",
    b"\x7f",
    "\u{0085}".as_bytes(),
    "\u{202e}".as_bytes(),
    "\u{ff0e}\u{ff0e}".as_bytes(),
    b",",
    b"=",
    b":",
    b"://",
    b"s3://",
    b"file://",
    b"az://",
    b"gs://",
    b"ftp://",
    b"%2F..%2F",
    b"\\..\\",
    b"[",
    b"]",
    b"-",
    b"{",
    b"}",
    b"\"",
    b"\\u0000",
    b"\\ud800",
    b"4294967295",
    b"4294967296",
    b"18446744073709551616",
    b"-1",
    b"1e400",
    b"null",
    b"true",
    br#""op":"job_start""#,
    br#""op":"job_end""#,
    br#""op":"ckpt_commit""#,
    br#""version":1"#,
    br#""version":2"#,
    br#""uid":0"#,
    b"latest",
    b"\xff\xfe",
    b"\xc0\xaf",
];

/// One random edit of `data`.
fn mutate(rng: &mut Rng, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    match rng.below(9) {
        0 if !data.is_empty() => {
            let i = rng.below(data.len());
            data[i] ^= 1 << rng.below(8);
        }
        1 if !data.is_empty() => {
            let i = rng.below(data.len());
            data[i] = rng.next() as u8;
        }
        2 => {
            let i = rng.below(data.len() + 1);
            data.splice(i..i, rng.pick(TOKENS).iter().copied());
        }
        3 if !data.is_empty() => {
            let i = rng.below(data.len());
            let n = 1 + rng.below((data.len() - i).min(16));
            data.drain(i..i + n);
        }
        4 if !data.is_empty() => {
            data.truncate(rng.below(data.len()));
        }
        5 if !data.is_empty() => {
            // Duplicate a slice (grows repeated structures: nested brackets, long names).
            let i = rng.below(data.len());
            let n = 1 + rng.below((data.len() - i).min(64));
            let piece: Vec<u8> = data[i..i + n].to_vec();
            let at = rng.below(data.len() + 1);
            data.splice(at..at, piece);
        }
        6 => {
            // Splice in part of another seed.
            let other = rng.pick(corpus);
            if !other.is_empty() {
                let i = rng.below(other.len());
                let n = 1 + rng.below(other.len() - i);
                let at = rng.below(data.len() + 1);
                data.splice(at..at, other[i..i + n].iter().copied());
            }
        }
        7 => {
            // A long run of one byte (over-length values, deep nesting).
            let b = *rng.pick(b"a[{/.,0\0");
            let max = if rng.chance(8) { 8192 } else { 256 };
            let n = 1 + rng.below(max);
            let at = rng.below(data.len() + 1);
            data.splice(at..at, std::iter::repeat_n(b, n));
        }
        _ if !data.is_empty() => {
            let i = rng.below(data.len());
            let j = rng.below(data.len());
            data.swap(i, j);
        }
        _ => {
            let t: &[u8] = rng.pick::<&[u8]>(TOKENS);
            data.extend_from_slice(t)
        }
    }
}

fn show(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    if s.len() > 300 {
        let cut = (0..=300)
            .rev()
            .find(|&i| s.is_char_boundary(i))
            .unwrap_or(0);
        format!("{:?}... ({} bytes)", &s[..cut], bytes.len())
    } else {
        format!("{s:?}")
    }
}

// -------------------------------------------------------------------------------------- frames

fn seed_requests() -> Vec<Request> {
    vec![
        Request::Status,
        Request::Job { job_id: 42 },
        Request::JobEnd { job_id: 7 },
        Request::WaitStaged {
            job_id: 42,
            timeout_ms: 120_000,
            step: None,
        },
        Request::CkptCommit {
            job_id: 42,
            tag: "step-100".into(),
        },
        Request::CkptList { job_id: 42 },
        Request::JobStart(JobStart {
            job_id: 42,
            uid: 1000,
            gid: 1000,
            user: "alice".into(),
            node: "n1".into(),
            nodes: vec!["n1".into(), "n2".into()],
            job_name: "train".into(),
            options: vec![
                (
                    names::STAGE_IN.into(),
                    "ds=s3://datasets/x,/lustre/y".into(),
                ),
                (names::CKPT_ARCHIVE.into(), "s3://ckpt/alice/run".into()),
                (names::CKPT_RESTORE.into(), "latest".into()),
            ],
        }),
    ]
}

/// A reader that serves `data` and then, if `endless`, zeros forever, counting what was read: an
/// oversized header must be refused having read the header and nothing more.
struct Feed<'a> {
    data: &'a [u8],
    pos: usize,
    endless: bool,
}

impl Read for Feed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.pos < self.data.len() {
            let n = buf.len().min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        } else if self.endless {
            buf.fill(0);
            self.pos += buf.len();
            Ok(buf.len())
        } else {
            Ok(0)
        }
    }
}

/// Reads and decodes one frame the way the agent does; checks the invariants; returns whether the
/// request was accepted.
fn check_frame(frame: &[u8], endless: bool) -> bool {
    let (accepted, largest) = largest_allocation(|| {
        let mut src = Feed {
            data: frame,
            pos: 0,
            endless,
        };
        match wire::read_frame(&mut src) {
            Ok(body) => {
                assert!(body.len() <= MAX_FRAME, "a body over the limit was read");
                let req = wire::decode_request(&body);
                let _ = wire::decode_response(&body);
                req.is_ok()
            }
            Err(FrameError::TooLarge(n)) => {
                assert!(n > MAX_FRAME);
                assert_eq!(
                    src.pos, 4,
                    "an oversized frame must be refused after its header"
                );
                false
            }
            Err(_) => false,
        }
    });
    assert!(
        largest <= MAX_FRAME + 64 * 1024,
        "decoding a frame made a {largest}-byte allocation: {}",
        show(frame)
    );
    accepted
}

fn frame_of(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// A mutated string (lossily UTF-8), for value-level fuzzing.
fn hostile_string(rng: &mut Rng, corpus: &[Vec<u8>]) -> String {
    let mut v = rng
        .pick(&[&b"step-100"[..], b"alice", b"n1", b"s3://ckpt/alice", b""])
        .to_vec();
    for _ in 0..rng.below(4) {
        mutate(rng, &mut v, corpus);
    }
    String::from_utf8_lossy(&v).into_owned()
}

fn hostile_request(rng: &mut Rng, corpus: &[Vec<u8>]) -> Request {
    let r = rng.next();
    let id = *rng.pick(&[0, 1, 42, u32::MAX, r as u32]);
    match rng.below(7) {
        0 => Request::Status,
        1 => Request::Job { job_id: id },
        2 => Request::JobEnd { job_id: id },
        3 => Request::WaitStaged {
            job_id: id,
            timeout_ms: *rng.pick(&[0, u64::MAX, r]),
            step: None,
        },
        4 => Request::CkptCommit {
            job_id: id,
            tag: hostile_string(rng, corpus),
        },
        5 => Request::CkptList { job_id: id },
        _ => Request::JobStart(JobStart {
            job_id: id,
            uid: *rng.pick(&[0, 1000, u32::MAX]),
            gid: rng.next() as u32,
            user: hostile_string(rng, corpus),
            node: hostile_string(rng, corpus),
            nodes: (0..rng.below(4))
                .map(|_| hostile_string(rng, corpus))
                .collect(),
            job_name: hostile_string(rng, corpus),
            options: (0..rng.below(4))
                .map(|_| {
                    (
                        rng.pick(&names::ALL).to_string(),
                        hostile_string(rng, corpus),
                    )
                })
                .collect(),
        }),
    }
}

#[test]
fn frame_decoder_survives_mutated_frames() {
    let bodies: Vec<Vec<u8>> = seed_requests()
        .into_iter()
        .map(|r| serde_json::to_vec(&Envelope::new(r)).unwrap())
        .collect();
    // Every seed decodes (otherwise the mutations start from garbage).
    for b in &bodies {
        assert!(check_frame(&frame_of(b), false), "seed {}", show(b));
    }
    let mut rng = Rng::new(0x5_1u64 << 32 | 0xC0FFEE);
    let mut accepted = 0;
    const ROUNDS: usize = 10_000;
    for round in 0..ROUNDS {
        let body = if round % 2 == 0 {
            // Byte-level: mutated JSON, mostly broken.
            let mut body = rng.pick(&bodies).clone();
            for _ in 0..1 + rng.below(3) {
                mutate(&mut rng, &mut body, &bodies);
            }
            body
        } else {
            // Value-level: well-formed frames carrying hostile values (ids at the limits, tags
            // and names with traversal and control characters, huge and empty strings).
            serde_json::to_vec(&Envelope::new(hostile_request(&mut rng, &bodies))).unwrap()
        };
        let mut frame = frame_of(&body);
        // Sometimes lie in the header: random, huge, just over the limit, too short.
        match rng.below(12) {
            0 => frame[..4].copy_from_slice(&(rng.next() as u32).to_be_bytes()),
            1 => frame[..4].copy_from_slice(&u32::MAX.to_be_bytes()),
            2 => frame[..4].copy_from_slice(&((MAX_FRAME as u32) + 1).to_be_bytes()),
            3 if body.len() > 1 => {
                let short = rng.below(body.len()) as u32;
                frame[..4].copy_from_slice(&short.to_be_bytes())
            }
            _ => {}
        }
        if check_frame(&frame, round % 2 == 0) {
            accepted += 1;
        }
    }
    // The mutations must not be so wild that nothing gets past the parser.
    assert!(
        accepted > ROUNDS / 50,
        "only {accepted} of {ROUNDS} mutated frames decoded; the fuzz run is not exercising requests"
    );
}

#[test]
fn frame_headers_are_checked_before_anything_is_allocated() {
    let mut rng = Rng::new(7);
    for _ in 0..20_000 {
        let header = (rng.next() as u32).to_be_bytes();
        let n = u32::from_be_bytes(header) as usize;
        match wire::frame_len(header) {
            Ok(len) => assert!(len == n && len <= MAX_FRAME),
            Err(FrameError::TooLarge(len)) => assert!(len == n && len > MAX_FRAME),
            Err(e) => panic!("unexpected {e}"),
        }
    }
    for bad in [u32::MAX, (MAX_FRAME + 1) as u32, 0x8000_0000] {
        let mut frame = bad.to_be_bytes().to_vec();
        frame.extend_from_slice(b"{}");
        let (r, largest) = largest_allocation(|| {
            wire::read_frame(&mut Feed {
                data: &frame,
                pos: 0,
                endless: true,
            })
        });
        assert!(matches!(r, Err(FrameError::TooLarge(_))), "{r:?}");
        assert!(
            largest < 4096,
            "refusing a {bad}-byte header allocated {largest} bytes"
        );
    }
    // The largest legal frame is read; one byte more is refused.
    assert_eq!(
        wire::frame_len((MAX_FRAME as u32).to_be_bytes()).unwrap(),
        MAX_FRAME
    );
    // A reply too large to send is refused on the sending side too.
    let huge = Response::Error(sluice_proto::msg::ErrorReply::new(
        sluice_proto::msg::ErrorCode::Internal,
        "x".repeat(MAX_FRAME),
    ));
    assert!(matches!(wire::encode(&huge), Err(FrameError::TooLarge(_))));
}

/// Hostile shapes that a byte-level mutator finds only by luck: deep nesting (serde_json's
/// recursion limit must hold, on a thread with a runtime worker's 2 MiB stack), version games,
/// identity fields a user might hope the agent trusts.
#[test]
fn hostile_frame_shapes_are_refused_cleanly() {
    let nested = |open: &str, n: usize| {
        format!(
            r#"{{"version":1,"extra":{},"request":{{"op":"status"}}}}"#,
            open.repeat(n)
        )
    };
    let cases: Vec<(String, &str)> = vec![
        (nested("[", 200_000), "malformed"),
        (nested("{\"a\":", 100_000), "malformed"),
        (
            format!(r#"{{"version":1,"request":{}}}"#, "[".repeat(500_000)),
            "malformed",
        ),
        (
            r#"{"version":2,"request":{"op":"status"}}"#.into(),
            "version 2 is not supported",
        ),
        (
            r#"{"version":0,"request":{"op":"status"}}"#.into(),
            "version 0 is not supported",
        ),
        (
            r#"{"version":-1,"request":{"op":"status"}}"#.into(),
            "malformed",
        ),
        (
            r#"{"version":4294967297,"request":{"op":"status"}}"#.into(),
            "malformed",
        ),
        (r#"{"request":{"op":"status"}}"#.into(), "malformed"),
        (r#"{"version":1}"#.into(), "malformed"),
        (
            r#"{"version":1,"request":{"op":"job","job_id":-1}}"#.into(),
            "malformed",
        ),
        (
            r#"{"version":1,"request":{"op":"job","job_id":4294967296}}"#.into(),
            "malformed",
        ),
        (
            r#"{"version":1,"request":{"op":"job","job_id":"1"}}"#.into(),
            "malformed",
        ),
        (
            r#"{"version":1,"request":{"op":"ckpt_commit","job_id":1}}"#.into(),
            "malformed",
        ),
        (
            r#"{"version":1,"request":{"op":"shutdown"}}"#.into(),
            "malformed",
        ),
        ("\u{feff}{}".into(), "malformed"),
        (String::new(), "malformed"),
    ];
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            for (body, want) in &cases {
                let e = wire::decode_request(body.as_bytes()).unwrap_err();
                let text = e.to_string();
                assert!(
                    text.contains(want),
                    "{}: expected '{want}', got {text}",
                    show(body.as_bytes())
                );
                let _ = wire::decode_response(body.as_bytes());
            }
        })
        .unwrap()
        .join()
        .expect("decoding hostile frames on a 2 MiB stack must not crash");

    // Fields the agent never reads from a user's request are ignored, not trusted: a "uid" next to
    // a request decodes to the same request (authorisation is from SO_PEERCRED, server.rs/agent.rs).
    let with_uid = wire::decode_request(
        br#"{"version":1,"uid":0,"request":{"op":"job","job_id":5,"uid":0,"user":"root"}}"#,
    )
    .unwrap();
    assert_eq!(with_uid, Request::Job { job_id: 5 });
    // A duplicate "version" key is refused rather than resolved either way.
    assert!(
        wire::decode_request(br#"{"version":2,"version":1,"request":{"op":"status"}}"#).is_err()
    );
}

// ------------------------------------------------------------------------------------- options

const OPTION_SEEDS: &[(&str, &str)] = &[
    (names::STAGE_IN, "/lustre/proj/imagenet"),
    (names::STAGE_IN, "train=s3://datasets/imagenet/train"),
    (names::STAGE_IN, "a=/data/a,b=az://c/p/q,gs://b"),
    (names::STAGE_IN, "file:///scratch/x/"),
    (names::STAGE_IN, "w=azure://models/llama/7b,s3://b/k=v/x"),
    (names::STAGE_TIER, "local"),
    (names::STAGE_TIER, "shared"),
    (names::STAGE_MODE, "replicate"),
    (names::STAGE_MODE, "shard"),
    (names::CKPT_ARCHIVE, "s3://ckpt/alice/run1"),
    (names::CKPT_ARCHIVE, "file:///lustre/ckpt/alice"),
    (names::CKPT_ARCHIVE, "/lustre/ckpt/alice/"),
    (names::CKPT_KEEP, "2"),
    (names::CKPT_KEEP, "1000"),
    (names::CKPT_RESTORE, "latest"),
    (names::CKPT_RESTORE, "global_step100"),
    (names::CKPT_RESTORE, "iter_0000200"),
    // Whitespace around segments and "://" in a path: what broke normalisation (F8).
    (names::STAGE_IN, "d=/data/with space/, e=s3://b/p /"),
    (names::STAGE_IN, "x=/data/a://b,y=file:///.. /"),
    (names::CKPT_ARCHIVE, "s3://ckpt/alice/.. /"),
];

// The properties of accepted options, shared with the `job_options` fuzz target.
#[path = "../../fuzz/props/options.rs"]
mod props;
use props::{check_accepted, no_dotdot};

#[test]
fn option_parser_survives_mutated_values() {
    let corpus: Vec<Vec<u8>> = OPTION_SEEDS
        .iter()
        .map(|(_, v)| v.as_bytes().to_vec())
        .collect();
    let mut rng = Rng::new(0xD15EA5E);
    let (mut accepted, mut refused) = (0usize, 0usize);
    const ROUNDS: usize = 20_000;
    for _ in 0..ROUNDS {
        // One to three options of one job, each a mutated seed (or a seed of another option).
        let mut values: Vec<(&str, String)> = Vec::new();
        for _ in 0..1 + rng.below(3) {
            let (name, seed) = *rng.pick(OPTION_SEEDS);
            let name = if rng.chance(6) {
                *rng.pick(&names::ALL)
            } else {
                name
            };
            let mut v = seed.as_bytes().to_vec();
            for _ in 0..rng.below(4) {
                mutate(&mut rng, &mut v, &corpus);
            }
            // Option values reach the plugin as C strings: no interior NUL survives that hop, but
            // the agent must not rely on it, so NULs stay in.
            values.push((name, String::from_utf8_lossy(&v).into_owned()));
        }
        let lookup = |n: &str| props::last_value(&values, n);
        match options::parse_job_options(lookup) {
            Ok(opts) => {
                accepted += 1;
                check_accepted(&opts);
                // The plugin's submit-time check accepts what the agent accepts ...
                for name in names::ALL {
                    if let Some(v) = lookup(name) {
                        assert!(
                            options::validate_option(name, &v).is_ok(),
                            "the agent accepts --{name}={v:?} but the plugin refuses it"
                        );
                    }
                }
            }
            Err(e) => {
                refused += 1;
                assert!(
                    e.to_string().starts_with(&format!("--{}: ", e.option)),
                    "an option error names its option: {e}"
                );
                // ... and refuses what the agent refuses (no value slips past the submit check
                // only to fail, or worse, on the root side).
                if let Some(v) = lookup(e.option) {
                    assert!(
                        options::validate_option(e.option, &v).is_err(),
                        "the plugin accepts --{}={v:?} but the agent refuses it: {e}",
                        e.option
                    );
                }
            }
        }
        // One entry alone, as the agent's stage-in code receives it.
        if let Some((_, v)) = values.iter().find(|(k, _)| *k == names::STAGE_IN) {
            for entry in v.split(',') {
                if let Ok(spec) = options::parse_stage_entry(entry) {
                    assert!(options::validate_name(&spec.name).is_ok());
                    if let Source::Posix { path } = &spec.source {
                        no_dotdot("POSIX source (one entry)", path);
                    }
                }
            }
        }
    }
    assert!(
        accepted > ROUNDS / 20,
        "only {accepted} accepted; mutations too wild"
    );
    assert!(
        refused > ROUNDS / 20,
        "only {refused} refused; mutations too tame"
    );
}

/// Values an attacker would try first, each refused with a message naming the option.
#[test]
fn oversized_and_control_character_options_are_refused() {
    let long_path = format!("/{}", "a".repeat(MAX_OPTION_LEN));
    let many = (0..=MAX_STAGE_SOURCES)
        .map(|i| format!("d{i}=/data/{i}"))
        .collect::<Vec<_>>()
        .join(",");
    let long_name = format!("{}=/data/x", "n".repeat(MAX_NAME_LEN + 1));
    let long_archive = format!("s3://ckpt/{}", "a".repeat(MAX_OPTION_LEN));
    let long_mode = "x".repeat(MAX_OPTION_LEN + 1);
    // (option, [(value, what the refusal says)]).
    let cases: [(&str, Vec<(&str, &str)>); 6] = [
        (
            names::STAGE_IN,
            vec![
                (&long_path, "at most 4096"),
                (&many, "more than 64 sources"),
                (&long_name, "longer than 128"),
                ("/data/a\nb", "control character"),
                ("/data/a\0b", "control character"),
                ("/data/\x1b[31mred", "control character"),
                ("/data/a\u{85}b", "control character"),
                ("/data/../etc/shadow", "'..' is not allowed"),
                ("s3://b/../x", "'..' segments"),
                ("s3://b/a/./x", "'..' segments"),
                ("x=s3://b\\..\\/p", "not a valid bucket"),
                ("..=/data/x", "is not allowed"),
                ("a/b=/data/x", "relative path"),
            ],
        ),
        (
            names::CKPT_ARCHIVE,
            vec![
                (&long_archive, "at most 4096"),
                ("s3://ckpt/alice/../bob", "'..' segments"),
                ("s3://ckpt/al\nice", "control character"),
                ("/lustre/../etc", "'..' is not allowed"),
            ],
        ),
        (
            names::CKPT_RESTORE,
            vec![
                ("../../etc", "not a valid checkpoint tag"),
                (".hidden", "not a valid checkpoint tag"),
                ("a/b", "may only hold"),
                ("t\u{0}", "control character"),
            ],
        ),
        (
            names::CKPT_KEEP,
            vec![
                ("0", "out of range"),
                ("1001", "out of range"),
                ("99999999999999999999", "not a number"),
                ("2\n", "control character"),
            ],
        ),
        (names::STAGE_TIER, vec![("local\0", "control character")]),
        (names::STAGE_MODE, vec![(&long_mode, "at most 4096")]),
    ];
    let cases = cases
        .iter()
        .flat_map(|(name, values)| values.iter().map(move |(v, needle)| (*name, *v, *needle)));
    for (name, value, needle) in cases {
        let shown = show(value.as_bytes());
        let plugin = options::validate_option(name, value)
            .err()
            .unwrap_or_else(|| panic!("the plugin accepts --{name}={shown}"));
        let agent = options::parse_job_options(|n| (n == name).then(|| value.to_string()))
            .err()
            .unwrap_or_else(|| panic!("the agent accepts --{name}={shown}"));
        assert_eq!(plugin, agent, "--{name}: plugin and agent disagree");
        let text = agent.to_string();
        assert!(
            text.starts_with(&format!("--{name}: ")) && text.contains(needle),
            "--{name}={}: expected '{needle}', got: {text}",
            show(value.as_bytes())
        );
        // The error message itself is bounded (it quotes the value, which is already bounded by
        // the frame and option limits; it never echoes more than the value).
        assert!(
            text.len() <= 2 * MAX_OPTION_LEN + 512,
            "--{name}: error of {} bytes",
            text.len()
        );
    }
}

// ------------------------------------------------------------------------------------ hostlist

#[test]
fn hostlist_expansion_survives_mutated_expressions() {
    let seeds: Vec<Vec<u8>> = [
        "n[1-3]",
        "gpu[01-04,07],login",
        "a[1-2]b[3-4]",
        "n1 n2,n3",
        "x[08-11]",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let mut rng = Rng::new(0xB0A710AD);
    for _ in 0..8000 {
        let mut e = rng.pick(&seeds).clone();
        for _ in 0..1 + rng.below(3) {
            mutate(&mut rng, &mut e, &seeds);
        }
        // The count, each name's length and the names' total bytes are capped (F6), so long
        // expressions may be fed as well.
        e.truncate(512);
        let expr = String::from_utf8_lossy(&e);
        if let Ok(hosts) = hostlist::expand(&expr) {
            assert!(hosts.len() <= hostlist::MAX_HOSTS, "{expr:?}");
            assert!(
                hosts.iter().all(|h| h.len() <= hostlist::MAX_NAME_BYTES),
                "{expr:?}"
            );
            let bytes: usize = hosts.iter().map(String::len).sum();
            assert!(
                bytes <= hostlist::MAX_TOTAL_BYTES,
                "{expr:?}: {bytes} bytes"
            );
        }
    }
}

#[test]
fn protocol_version_is_the_one_in_every_envelope() {
    for r in seed_requests() {
        let body = serde_json::to_vec(&Envelope::new(r.clone())).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["version"], PROTO_VERSION);
        assert_eq!(wire::decode_request(&body).unwrap(), r);
    }
}
