//! The container format of one archived file, and the byte-grouping transform.
//!
//! # Data object
//!
//! Each checkpoint file is stored as one object, `BASE/TAG/data/<relpath>`: the concatenation of
//! its chunks' **frames**, in file order (an empty file is an empty object). The file is cut into
//! chunks of `chunk_size` raw bytes (the last one shorter); every chunk is encoded on its own, so
//! chunks compress on several threads and restore fetches them with parallel ranged GETs.
//!
//! A frame is a 16-byte header followed by its payload (integers little-endian):
//!
//! | bytes  | field       | meaning                                                          |
//! | ------ | ----------- | ---------------------------------------------------------------- |
//! | 0..4   | magic       | `SLZ1`                                                           |
//! | 4      | codec       | 0 = stored (payload is the raw bytes), 1 = one zstd frame,       |
//! |        |             | 2 = byte planes coded one by one (below)                         |
//! | 5      | transform   | applied before zstd: 0 = none, 2 / 4 = byte planes of width 2/4  |
//! | 6..8   | reserved    | zero                                                             |
//! | 8..12  | raw_len     | u32, bytes of file content in this chunk                         |
//! | 12..16 | payload_len | u32, bytes of payload that follow the header                     |
//!
//! A stored frame always has transform 0 and `payload_len == raw_len`. The MANIFEST records, per
//! chunk, the frame's offset in the object, its length, `raw_len`, codec, transform and the BLAKE3
//! hash of the whole frame (header and payload); per file, the raw size, mode, BLAKE3 of the raw
//! content and the compression chosen. Decoding checks all of them.
//!
//! # Byte grouping
//!
//! Floating-point tensors compress badly as they are: the mantissa bytes are noise, and the
//! low-entropy exponent bytes are interleaved with them. Grouping by byte position (all byte 0s of
//! the chunk's elements, then all byte 1s, ...) puts the exponents in one run that zstd's entropy
//! coder shrinks well: ~1.28× → ~1.46× on bf16 weights. Width 2 suits bf16/fp16, width 4 fp32. A
//! chunk length that is not a multiple of the width keeps its tail bytes, ungrouped, at the end.
//! Which transform a file gets is decided by compressing a sample of it each way
//! ([`choose_compression`]).
//!
//! # Plane-wise frames (codec 2)
//!
//! Some planes are noise (the low mantissa bytes): zstd spends most of its time on them for nothing.
//! Since manifest version 2 a grouped chunk is written with codec 2: each plane is coded on its own,
//! stored or zstd, and a plane is stored without being compressed when zstd does not shrink a
//! [`PROBE_LEN`] prefix of it by 2%. The payload starts with one 8-byte entry per plane (`width`
//! of them: codec u8 — 0 stored, 1 zstd —, three zero bytes, payload length u32), then the planes'
//! payloads in order, then the ungrouped tail bytes, stored. Each plane holds `raw_len / width`
//! bytes. Codec 1 with a grouping transform (one zstd frame of all planes, written by version 1)
//! is still read.

use serde::{Deserialize, Serialize};
use std::cell::RefCell;

pub const MAGIC: [u8; 4] = *b"SLZ1";
pub const HEADER_LEN: usize = 16;
/// Largest chunk the format allows (raw_len and payload_len are u32; keep well clear of that).
pub const MAX_CHUNK: usize = 64 << 20;
/// Bytes sampled from the middle of a file to choose its transform.
pub const SAMPLE_LEN: usize = 256 << 10;
/// Bytes of a plane that zstd tries first, to tell a noise plane from one worth compressing.
pub const PROBE_LEN: usize = 64 << 10;
/// Bytes of one plane entry in a plane-wise frame.
const PLANE_ENTRY: usize = 8;
/// Below this size a file is not sampled: it gets plain zstd.
const MIN_SAMPLED: u64 = 16 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// The discriminants are the codes in a frame's header.
#[repr(u8)]
pub enum Transform {
    #[default]
    None = 0,
    /// Byte planes of 2-byte elements (bf16, fp16).
    Bytegroup2 = 2,
    /// Byte planes of 4-byte elements (fp32).
    Bytegroup4 = 4,
}

impl Transform {
    pub const ALL: [Transform; 3] = [
        Transform::None,
        Transform::Bytegroup2,
        Transform::Bytegroup4,
    ];

    pub fn width(self) -> usize {
        match self {
            Transform::None => 1,
            Transform::Bytegroup2 => 2,
            Transform::Bytegroup4 => 4,
        }
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> Option<Transform> {
        Transform::ALL.into_iter().find(|t| t.code() == c)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// The discriminants are the codes in a frame's header and a plane entry.
#[repr(u8)]
pub enum Codec {
    /// The raw bytes, because compressing them did not make them smaller.
    Stored = 0,
    Zstd = 1,
    /// Byte planes coded one by one, each stored or zstd (chunks only; see the module doc).
    ZstdPlanes = 2,
}

impl Codec {
    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> Option<Codec> {
        [Codec::Stored, Codec::Zstd, Codec::ZstdPlanes]
            .into_iter()
            .find(|x| x.code() == c)
    }
}

/// How one file is compressed: recorded in the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileCompression {
    /// `Stored` when sampling showed the file does not compress (or compression is off): its
    /// chunks are then not even tried.
    pub codec: Codec,
    /// zstd level (0 when stored).
    pub level: i32,
    pub transform: Transform,
}

impl FileCompression {
    pub const STORED: FileCompression = FileCompression {
        codec: Codec::Stored,
        level: 0,
        transform: Transform::None,
    };
}

/// Splits `data` into `width` byte planes (see the module doc). `width` 1 copies.
pub fn group_bytes(data: &[u8], width: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len()];
    let n = data.len() / width.max(1);
    let (planes, tail) = out.split_at_mut(n * width.max(1));
    let mut planes: Vec<&mut [u8]> = if n == 0 {
        Vec::new()
    } else {
        planes.chunks_exact_mut(n).collect()
    };
    split_planes(&data[..n * width.max(1)], &mut planes);
    tail.copy_from_slice(&data[n * width.max(1)..]);
    out
}

/// The inverse of [`group_bytes`].
pub fn ungroup_bytes(data: &[u8], width: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len()];
    let w = width.max(1);
    let n = data.len() / w;
    let planes: Vec<&[u8]> = if n == 0 {
        Vec::new()
    } else {
        data[..n * w].chunks_exact(n).collect()
    };
    interleave(&planes, &mut out[..n * w]);
    out[n * w..].copy_from_slice(&data[n * w..]);
    out
}

// Byte (de)interleaving a word at a time: gathering every other byte of a 64-bit word and its
// inverse take three shift-and-mask steps, 2-3 times faster than a byte loop (which the compiler
// does not vectorise).

/// The even bytes of `x` (little-endian), packed into the low 4 bytes.
fn even_bytes(x: u64) -> u64 {
    let mut x = x & 0x00ff00ff00ff00ff;
    x = (x | (x >> 8)) & 0x0000ffff0000ffff;
    (x | (x >> 16)) & 0x00000000ffffffff
}

/// The inverse of [`even_bytes`]: the low 4 bytes of `x` at the even positions of a word.
fn spread_bytes(x: u64) -> u64 {
    let mut x = x & 0x00000000ffffffff;
    x = (x | (x << 16)) & 0x0000ffff0000ffff;
    (x | (x << 8)) & 0x00ff00ff00ff00ff
}

fn word(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

/// Scatters `data` (whole elements of `planes.len()` bytes) into the planes, each of
/// `data.len() / width` bytes.
fn split_planes(data: &[u8], planes: &mut [&mut [u8]]) {
    match planes {
        [] => {}
        [p0, p1] => {
            for ((s, d0), d1) in data
                .chunks_exact(16)
                .zip(p0.chunks_exact_mut(8))
                .zip(p1.chunks_exact_mut(8))
            {
                let (a, b) = (word(&s[..8]), word(&s[8..]));
                d0.copy_from_slice(&(even_bytes(a) | even_bytes(b) << 32).to_le_bytes());
                d1.copy_from_slice(&(even_bytes(a >> 8) | even_bytes(b >> 8) << 32).to_le_bytes());
            }
            let done = data.len() / 16 * 8;
            for (i, e) in data[done * 2..].chunks_exact(2).enumerate() {
                p0[done + i] = e[0];
                p1[done + i] = e[1];
            }
        }
        [p0, p1, p2, p3] => {
            for ((((s, d0), d1), d2), d3) in data
                .chunks_exact(32)
                .zip(p0.chunks_exact_mut(8))
                .zip(p1.chunks_exact_mut(8))
                .zip(p2.chunks_exact_mut(8))
                .zip(p3.chunks_exact_mut(8))
            {
                // Two halvings: bytes 0 and 2 of each element (e), 1 and 3 (o), then each split.
                let w: [u64; 4] = std::array::from_fn(|k| word(&s[k * 8..k * 8 + 8]));
                let halve = |x: u64, y: u64| {
                    (
                        even_bytes(x) | even_bytes(y) << 32,
                        even_bytes(x >> 8) | even_bytes(y >> 8) << 32,
                    )
                };
                let (e01, o01) = halve(w[0], w[1]);
                let (e23, o23) = halve(w[2], w[3]);
                let (b0, b2) = halve(e01, e23);
                let (b1, b3) = halve(o01, o23);
                d0.copy_from_slice(&b0.to_le_bytes());
                d1.copy_from_slice(&b1.to_le_bytes());
                d2.copy_from_slice(&b2.to_le_bytes());
                d3.copy_from_slice(&b3.to_le_bytes());
            }
            let done = data.len() / 32 * 8;
            for (i, e) in data[done * 4..].chunks_exact(4).enumerate() {
                p0[done + i] = e[0];
                p1[done + i] = e[1];
                p2[done + i] = e[2];
                p3[done + i] = e[3];
            }
        }
        planes => {
            let w = planes.len();
            for (k, plane) in planes.iter_mut().enumerate() {
                for (dst, src) in plane.iter_mut().zip(data.chunks_exact(w)) {
                    *dst = src[k];
                }
            }
        }
    }
}

/// Gathers planes of equal length into `out` (whole elements of `planes.len()` bytes).
fn interleave(planes: &[&[u8]], out: &mut [u8]) {
    // Two words whose low (`hi` false) or high halves' bytes alternate: x0 y0 x1 y1 ...
    let zip = |x: u64, y: u64, hi: bool| {
        let s = if hi { 32 } else { 0 };
        spread_bytes(x >> s) | spread_bytes(y >> s) << 8
    };
    match planes {
        [] => {}
        [p0, p1] => {
            for ((d, a), b) in out
                .chunks_exact_mut(16)
                .zip(p0.chunks_exact(8))
                .zip(p1.chunks_exact(8))
            {
                let (a, b) = (word(a), word(b));
                d[..8].copy_from_slice(&zip(a, b, false).to_le_bytes());
                d[8..].copy_from_slice(&zip(a, b, true).to_le_bytes());
            }
            let done = out.len() / 16 * 8;
            for (i, e) in out[done * 2..].chunks_exact_mut(2).enumerate() {
                e[0] = p0[done + i];
                e[1] = p1[done + i];
            }
        }
        [p0, p1, p2, p3] => {
            for ((((d, a), b), c), e) in out
                .chunks_exact_mut(32)
                .zip(p0.chunks_exact(8))
                .zip(p1.chunks_exact(8))
                .zip(p2.chunks_exact(8))
                .zip(p3.chunks_exact(8))
            {
                let (a, b, c, e) = (word(a), word(b), word(c), word(e));
                // Bytes 0 and 2 of each element, then 1 and 3, then the two interleaved.
                let (ac_lo, ac_hi) = (zip(a, c, false), zip(a, c, true));
                let (bd_lo, bd_hi) = (zip(b, e, false), zip(b, e, true));
                d[..8].copy_from_slice(&zip(ac_lo, bd_lo, false).to_le_bytes());
                d[8..16].copy_from_slice(&zip(ac_lo, bd_lo, true).to_le_bytes());
                d[16..24].copy_from_slice(&zip(ac_hi, bd_hi, false).to_le_bytes());
                d[24..].copy_from_slice(&zip(ac_hi, bd_hi, true).to_le_bytes());
            }
            let done = out.len() / 32 * 8;
            for (i, e) in out[done * 4..].chunks_exact_mut(4).enumerate() {
                e[0] = p0[done + i];
                e[1] = p1[done + i];
                e[2] = p2[done + i];
                e[3] = p3[done + i];
            }
        }
        planes => {
            let w = planes.len();
            for (k, plane) in planes.iter().enumerate() {
                for (dst, src) in out.chunks_exact_mut(w).zip(plane.iter()) {
                    dst[k] = *src;
                }
            }
        }
    }
}

/// One encoded chunk, ready to upload.
#[derive(Debug, Clone)]
pub struct Frame {
    /// Header and payload.
    pub bytes: bytes::Bytes,
    pub raw_len: u64,
    pub codec: Codec,
    pub transform: Transform,
    pub blake3: blake3::Hash,
}

fn header(codec: Codec, transform: Transform, raw_len: usize, payload_len: usize) -> [u8; 16] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = codec.code();
    h[5] = transform.code();
    h[8..12].copy_from_slice(&(raw_len as u32).to_le_bytes());
    h[12..16].copy_from_slice(&(payload_len as u32).to_le_bytes());
    h
}

/// Writes `raw` as a stored frame into `out` (cleared first).
fn stored_frame_into(raw: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(HEADER_LEN + raw.len());
    out.extend_from_slice(&header(
        Codec::Stored,
        Transform::None,
        raw.len(),
        raw.len(),
    ));
    out.extend_from_slice(raw);
}

thread_local! {
    /// Each blocking thread keeps its zstd contexts: creating one per chunk allocates (and faults
    /// in) its tables every time.
    /// Contexts for whole chunks and for byte planes ([`PLANE_TUNING`]).
    static COMPRESSOR: RefCell<[Option<(i32, zstd::bulk::Compressor<'static>)>; 2]> =
        const { RefCell::new([None, None]) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
    /// A chunk's planes, before they are compressed.
    static GROUPED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// Decoded planes of a plane-wise frame, before they are interleaved.
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// zstd settings for byte planes at the fast levels (1 and 2), where the gain is entropy coding,
/// not matches: a 64-entry match table and matches of 7 bytes at least. On exponent planes of bf16
/// and fp32 tensors (synthetic and all-MiniLM-L6-v2) this is 2-3× faster than level 1's defaults
/// and 5-8% smaller, because fewer poor matches leave more bytes to the Huffman coder.
const PLANE_TUNING: [zstd::zstd_safe::CParameter; 2] = [
    zstd::zstd_safe::CParameter::HashLog(6),
    zstd::zstd_safe::CParameter::MinMatch(7),
];

/// Appends `input` compressed at `level` to `out` (which must have room for zstd's bound); `None`
/// when zstd fails, which compressing into a large enough buffer only does on an invalid level
/// (refused by the config): callers then store the bytes. `plane`: `input` is a byte plane.
fn zstd_append(input: &[u8], level: i32, plane: bool, out: &mut Vec<u8>) -> Option<usize> {
    let tuned = plane && (1..=2).contains(&level);
    COMPRESSOR.with_borrow_mut(|slots| {
        let slot = &mut slots[tuned as usize];
        if slot.as_ref().is_none_or(|(l, _)| *l != level) {
            let mut c = zstd::bulk::Compressor::new(level).ok()?;
            if tuned {
                for p in PLANE_TUNING {
                    c.set_parameter(p).ok()?;
                }
            }
            *slot = Some((level, c));
        }
        let (_, c) = slot.as_mut().expect("just set");
        let at = out.len();
        let mut cursor = std::io::Cursor::new(&mut *out);
        cursor.set_position(at as u64);
        c.compress_to_buffer(input, &mut cursor).ok()
    })
}

/// Decompresses `input` into `out` (cleared first), which must come to exactly `len` bytes.
fn zstd_decode(input: &[u8], len: usize, out: &mut Vec<u8>) -> Result<(), String> {
    out.clear();
    zstd_decode_append(input, len, out)
}

/// Decompresses `input` into `out`, which it must fill exactly.
fn zstd_decode_to(input: &[u8], out: &mut [u8]) -> Result<(), String> {
    let n = DECOMPRESSOR.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?);
        }
        let d = slot.as_mut().expect("just set");
        d.decompress_to_buffer(input, out)
            .map_err(|e| format!("zstd: {e}"))
    })?;
    if n != out.len() {
        return Err(format!("decompressed to {n} bytes, expected {}", out.len()));
    }
    Ok(())
}

/// Decompresses `input`, which must come to exactly `len` bytes, at the end of `out`.
fn zstd_decode_append(input: &[u8], len: usize, out: &mut Vec<u8>) -> Result<(), String> {
    let at = out.len();
    out.reserve(len);
    let n = DECOMPRESSOR.with_borrow_mut(|slot| {
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?);
        }
        let d = slot.as_mut().expect("just set");
        let mut cursor = std::io::Cursor::new(&mut *out);
        cursor.set_position(at as u64);
        d.decompress_to_buffer(input, &mut cursor)
            .map_err(|e| format!("zstd: {e}"))
    })?;
    if n != len {
        out.truncate(at);
        return Err(format!("decompressed to {n} bytes, expected {len}"));
    }
    Ok(())
}

/// Encodes grouped planes one by one (codec 2) into `out` (cleared first): a plane whose
/// [`PROBE_LEN`] prefix zstd does not shrink by 2% is stored without compressing the rest. `grouped`
/// is scratch for the planes. `false` (and `out` unspecified) when the frame would not be smaller
/// than the raw chunk.
fn planes_frame_into(
    raw: &[u8],
    transform: Transform,
    level: i32,
    grouped: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> bool {
    let width = transform.width();
    let n = raw.len() / width;
    // Reused: no zeroing when it already has this length.
    grouped.truncate(n * width);
    grouped.resize(n * width, 0);
    let mut planes: Vec<&mut [u8]> = grouped.chunks_exact_mut(n.max(1)).collect();
    split_planes(&raw[..n * width], &mut planes);
    let bound = zstd::zstd_safe::compress_bound(n);
    out.clear();
    out.reserve(HEADER_LEN + width * (PLANE_ENTRY + bound) + width);
    out.resize(HEADER_LEN + width * PLANE_ENTRY, 0);
    for k in 0..width {
        let plane = &grouped[k * n..(k + 1) * n];
        // The probe is compressed into the spare room after `out`'s end, then dropped.
        let at = out.len();
        let noise = plane.len() > PROBE_LEN
            && zstd_append(&plane[..PROBE_LEN], level, true, out)
                .is_none_or(|len| len * 100 > PROBE_LEN * 98);
        out.truncate(at);
        let start = out.len();
        let mut codec = Codec::Stored;
        if !noise && let Some(len) = zstd_append(plane, level, true, out) {
            if len < plane.len() {
                codec = Codec::Zstd;
            } else {
                out.truncate(start);
            }
        }
        if codec == Codec::Stored {
            out.extend_from_slice(plane);
        }
        let entry = HEADER_LEN + k * PLANE_ENTRY;
        out[entry] = codec.code();
        let len = (out.len() - start) as u32;
        out[entry + 4..entry + 8].copy_from_slice(&len.to_le_bytes());
    }
    out.extend_from_slice(&raw[n * width..]);
    let payload = out.len() - HEADER_LEN;
    if payload >= raw.len() {
        return false;
    }
    out[..HEADER_LEN].copy_from_slice(&header(Codec::ZstdPlanes, transform, raw.len(), payload));
    true
}

/// Encodes one chunk as `compression` says; a chunk that zstd does not shrink is stored raw. A
/// grouping transform writes a plane-wise frame (codec 2). Blocking (zstd): call from a blocking
/// thread.
pub fn encode_chunk(raw: &[u8], compression: FileCompression) -> Frame {
    let mut out = Vec::new();
    let (codec, transform) =
        GROUPED.with_borrow_mut(|grouped| encode_chunk_into(raw, compression, grouped, &mut out));
    let blake3 = blake3::hash(&out);
    Frame {
        bytes: out.into(),
        raw_len: raw.len() as u64,
        codec,
        transform,
        blake3,
    }
}

/// [`encode_chunk`] into the caller's buffers, reused from chunk to chunk (a pipeline that
/// allocates a fresh frame per chunk makes the allocator's arenas grow): the frame (header and
/// payload) into `out`, cleared first; `grouped` is scratch for a grouping transform's planes.
/// Returns the frame's codec and transform; hashing the frame is the caller's.
pub fn encode_chunk_into(
    raw: &[u8],
    compression: FileCompression,
    grouped: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> (Codec, Transform) {
    assert!(
        raw.len() <= MAX_CHUNK,
        "chunk larger than the format allows"
    );
    if compression.codec != Codec::Stored && !raw.is_empty() {
        match compression.transform {
            Transform::None => {
                out.clear();
                out.reserve(HEADER_LEN + zstd::zstd_safe::compress_bound(raw.len()));
                out.resize(HEADER_LEN, 0);
                if let Some(n) = zstd_append(raw, compression.level, false, out)
                    && n < raw.len()
                {
                    out[..HEADER_LEN].copy_from_slice(&header(
                        Codec::Zstd,
                        Transform::None,
                        raw.len(),
                        n,
                    ));
                    return (Codec::Zstd, Transform::None);
                }
            }
            t => {
                if planes_frame_into(raw, t, compression.level, grouped, out) {
                    return (Codec::ZstdPlanes, t);
                }
            }
        }
    }
    stored_frame_into(raw, out);
    (Codec::Stored, Transform::None)
}

/// What the manifest says a frame must be.
#[derive(Debug, Clone, Copy)]
pub struct Expected {
    pub raw_len: u64,
    pub codec: Codec,
    pub transform: Transform,
    pub blake3: blake3::Hash,
}

/// Checks a frame against the manifest and decodes it to the chunk's raw bytes. The error says what
/// is wrong, for a message naming the file. Blocking (hash, zstd).
pub fn decode_chunk(frame: &[u8], expected: &Expected) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    decode_chunk_into(frame, expected, &mut out)?;
    Ok(out)
}

/// [`decode_chunk`] into `out` (its contents replaced), so a thread can reuse one buffer: a fresh
/// one per chunk costs page faults and zeroing.
pub fn decode_chunk_into(
    frame: &[u8],
    expected: &Expected,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let (codec, transform, payload) = check_frame(frame, expected)?;
    let raw_len = expected.raw_len as usize;
    match (codec, transform) {
        // Appended into the spare capacity, which is not zeroed first.
        (Codec::Stored, Transform::None) if payload.len() == raw_len => {
            out.clear();
            out.extend_from_slice(payload);
            Ok(())
        }
        (Codec::Zstd, Transform::None) => {
            out.clear();
            zstd_decode_append(payload, raw_len, out)
        }
        _ => {
            // A reused buffer of the same length is overwritten without being zeroed first.
            out.truncate(raw_len);
            out.resize(raw_len, 0);
            decode_checked(codec, transform, payload, out)
        }
    }
}

/// [`decode_chunk_into`] a buffer of exactly the chunk's raw length (`expected.raw_len`), such as
/// an aligned one for `O_DIRECT` writes: nothing is allocated or moved. A buffer of another length
/// is an error.
pub fn decode_chunk_to(frame: &[u8], expected: &Expected, out: &mut [u8]) -> Result<(), String> {
    let (codec, transform, payload) = check_frame(frame, expected)?;
    if out.len() as u64 != expected.raw_len {
        return Err(format!(
            "a buffer of {} bytes for a chunk of {}",
            out.len(),
            expected.raw_len
        ));
    }
    decode_checked(codec, transform, payload, out)
}

/// Checks a frame's checksum and header against the manifest; its codec, transform and payload.
fn check_frame<'a>(
    frame: &'a [u8],
    expected: &Expected,
) -> Result<(Codec, Transform, &'a [u8]), String> {
    if blake3::hash(frame) != expected.blake3 {
        return Err("checksum mismatch (the stored bytes were changed or damaged)".into());
    }
    if frame.len() < HEADER_LEN || frame[..4] != MAGIC {
        return Err("not a sluice chunk frame".into());
    }
    let codec = Codec::from_code(frame[4]).ok_or("unknown codec in frame header")?;
    let transform = Transform::from_code(frame[5]).ok_or("unknown transform in frame header")?;
    let raw_len = u32::from_le_bytes(frame[8..12].try_into().expect("4 bytes")) as u64;
    let payload_len = u32::from_le_bytes(frame[12..16].try_into().expect("4 bytes")) as usize;
    let payload = &frame[HEADER_LEN..];
    if payload.len() != payload_len
        || raw_len != expected.raw_len
        || codec != expected.codec
        || transform != expected.transform
    {
        return Err("frame header disagrees with the manifest".into());
    }
    Ok((codec, transform, payload))
}

/// Decodes the payload of a checked frame into `out`, the chunk's raw length.
fn decode_checked(
    codec: Codec,
    transform: Transform,
    payload: &[u8],
    out: &mut [u8],
) -> Result<(), String> {
    let raw_len = out.len();
    match (codec, transform) {
        (Codec::Stored, Transform::None) if payload.len() == raw_len => {
            out.copy_from_slice(payload);
            Ok(())
        }
        (Codec::Stored, _) => Err("malformed stored frame".into()),
        (Codec::Zstd, Transform::None) => zstd_decode_to(payload, out),
        // Written by manifest version 1: one zstd frame of all the planes.
        (Codec::Zstd, t) => SCRATCH.with_borrow_mut(|grouped| {
            zstd_decode(payload, raw_len, grouped)?;
            let w = t.width();
            let n = raw_len / w;
            let planes: Vec<&[u8]> = grouped[..n * w].chunks_exact(n.max(1)).collect();
            fill(out, &planes, &grouped[n * w..]);
            Ok(())
        }),
        (Codec::ZstdPlanes, Transform::None) => Err("plane-wise frame without planes".into()),
        (Codec::ZstdPlanes, t) => decode_planes(payload, raw_len, t.width(), out),
    }
}

/// Sets `out` to the interleaved `planes` followed by `tail`.
fn fill(out: &mut [u8], planes: &[&[u8]], tail: &[u8]) {
    let body = out.len() - tail.len();
    interleave(planes, &mut out[..body]);
    out[body..].copy_from_slice(tail);
}

/// Decodes the payload of a plane-wise frame (codec 2) of `raw_len` bytes.
fn decode_planes(
    payload: &[u8],
    raw_len: usize,
    width: usize,
    out: &mut [u8],
) -> Result<(), String> {
    let n = raw_len / width;
    let table_len = width * PLANE_ENTRY;
    if payload.len() < table_len {
        return Err("plane-wise frame shorter than its plane table".into());
    }
    let (table, mut rest) = payload.split_at(table_len);
    let mut segments = Vec::with_capacity(width);
    for entry in table.chunks_exact(PLANE_ENTRY) {
        let codec = Codec::from_code(entry[0]).filter(|c| *c != Codec::ZstdPlanes);
        let len = u32::from_le_bytes(entry[4..8].try_into().expect("4 bytes")) as usize;
        let (Some(codec), true, true) = (codec, entry[1..4] == [0; 3], len <= rest.len()) else {
            return Err("malformed plane table".into());
        };
        if codec == Codec::Stored && len != n {
            return Err("malformed plane table".into());
        }
        let (data, after) = rest.split_at(len);
        segments.push((codec, data));
        rest = after;
    }
    let tail = rest;
    if tail.len() != raw_len - n * width {
        return Err("plane-wise frame lengths do not add up".into());
    }
    SCRATCH.with_borrow_mut(|scratch| {
        // Compressed planes are decoded one after another into the scratch buffer.
        scratch.clear();
        let mut at = Vec::with_capacity(width);
        for (codec, data) in &segments {
            at.push(scratch.len());
            if *codec == Codec::Zstd {
                zstd_decode_append(data, n, scratch)?;
            }
        }
        let planes: Vec<&[u8]> = segments
            .iter()
            .zip(at)
            .map(|((codec, data), at)| match codec {
                Codec::Zstd => &scratch[at..at + n],
                _ => *data,
            })
            .collect();
        fill(out, &planes, tail);
        Ok(())
    })
}

/// Where in a file of `size` bytes the sample for [`choose_compression`] is read: from the middle
/// (headers at the start of a file are not representative), at an offset aligned to 4 KiB so
/// element boundaries match those of the chunks.
pub fn sample_range(size: u64) -> Option<std::ops::Range<u64>> {
    if size < MIN_SAMPLED {
        return None;
    }
    let len = (SAMPLE_LEN as u64).min(size);
    let start = ((size - len) / 2) & !4095;
    Some(start..start + len)
}

/// Chooses how to compress a file from a sample of it: zstd at `level` after each transform, keeping
/// the smallest (a wider transform only when it is 0.5% smaller); stored when nothing saves 1%.
/// `level` 0 means compression is off. `sample` None (a small file) gets plain zstd. Blocking.
pub fn choose_compression(sample: Option<&[u8]>, level: i32) -> FileCompression {
    if level == 0 {
        return FileCompression::STORED;
    }
    let plain = FileCompression {
        codec: Codec::Zstd,
        level,
        transform: Transform::None,
    };
    let Some(sample) = sample else {
        return plain;
    };
    // A wider grouping must win by a margin: on bf16 data, width 4 is width 2 with its planes split
    // by element parity, equally good, and the choice should not flip on noise.
    let mut best: Option<(usize, FileCompression)> = None;
    for transform in Transform::ALL {
        let c = FileCompression { transform, ..plain };
        let len = encode_chunk(sample, c).bytes.len();
        if best.is_none_or(|(b, _)| len * 1000 < b * 995) {
            best = Some((len, c));
        }
    }
    let best = best.expect("three candidates");
    if (best.0 - HEADER_LEN) as u64 * 100 > sample.len() as u64 * 99 {
        FileCompression::STORED
    } else {
        best.1
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::synth::{Rng, bf16_weights, fp32_values};

    #[test]
    fn byte_grouping_round_trips_every_width_and_tail() {
        let data: Vec<u8> = (0..1031u32).map(|i| (i * 7 + i / 3) as u8).collect();
        for width in [1, 2, 4] {
            for len in [0, 1, 2, 3, 4, 5, 7, 8, 1030, 1031] {
                let g = group_bytes(&data[..len], width);
                assert_eq!(
                    ungroup_bytes(&g, width),
                    &data[..len],
                    "w={width} len={len}"
                );
            }
        }
        // The planes really are planes: bytes 0 of every element first.
        assert_eq!(
            group_bytes(&[1, 2, 3, 4, 5, 6, 7], 2),
            vec![1, 3, 5, 2, 4, 6, 7]
        );
        assert_eq!(
            group_bytes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4),
            vec![1, 5, 2, 6, 3, 7, 4, 8, 9]
        );
    }

    /// A frame as manifest version 1 wrote it: one zstd frame of all the byte planes.
    pub fn v1_frame(raw: &[u8], compression: FileCompression) -> Frame {
        let grouped = group_bytes(raw, compression.transform.width());
        let z = zstd::bulk::compress(&grouped, compression.level).unwrap();
        assert!(z.len() < raw.len(), "test data must compress");
        let mut bytes = header(Codec::Zstd, compression.transform, raw.len(), z.len()).to_vec();
        bytes.extend_from_slice(&z);
        Frame {
            blake3: blake3::hash(&bytes),
            bytes: bytes.into(),
            raw_len: raw.len() as u64,
            codec: Codec::Zstd,
            transform: compression.transform,
        }
    }

    /// The plane transposition, a byte at a time: what the word-wise versions must equal.
    fn group_slowly(data: &[u8], width: usize) -> Vec<u8> {
        let n = data.len() / width;
        let mut out: Vec<u8> = (0..width)
            .flat_map(|k| (0..n).map(move |i| data[i * width + k]))
            .collect();
        out.extend_from_slice(&data[n * width..]);
        out
    }

    #[test]
    fn word_wise_grouping_matches_the_byte_loop() {
        let mut r = Rng::new(17);
        let data: Vec<u8> = (0..5000).map(|_| r.next_u64() as u8).collect();
        for width in [2, 4] {
            for len in [
                0, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 130, 1000, 4099, 5000,
            ] {
                let g = group_bytes(&data[..len], width);
                assert_eq!(g, group_slowly(&data[..len], width), "w={width} len={len}");
                assert_eq!(
                    ungroup_bytes(&g, width),
                    &data[..len],
                    "w={width} len={len}"
                );
            }
        }
    }

    #[test]
    fn noise_planes_are_stored_and_the_rest_compressed() {
        let bf16 = bf16_weights(1 << 20, 21);
        let c = FileCompression {
            codec: Codec::Zstd,
            level: 1,
            transform: Transform::Bytegroup2,
        };
        let f = encode_chunk(&bf16, c);
        assert_eq!(
            (f.codec, f.transform),
            (Codec::ZstdPlanes, Transform::Bytegroup2)
        );
        let table = &f.bytes[HEADER_LEN..HEADER_LEN + 2 * PLANE_ENTRY];
        let len = |k: usize| u32::from_le_bytes(table[k * 8 + 4..k * 8 + 8].try_into().unwrap());
        // Plane 0, the low mantissa bits, is noise: stored as it is. Plane 1 (sign, exponent)
        // compresses well.
        assert_eq!((table[0], len(0)), (0, 1 << 20));
        assert_eq!(table[8], 1);
        assert!(len(1) < (1 << 20) / 2, "{}", len(1));
        assert_eq!(decode_chunk(&f.bytes, &expected(&f)).unwrap(), bf16);
        // Not smaller than one zstd frame of all the planes (version 1), within 0.5%.
        let v1 = v1_frame(&bf16, c);
        assert!(
            f.bytes.len() * 1000 < v1.bytes.len() * 1005,
            "{} vs {}",
            f.bytes.len(),
            v1.bytes.len()
        );
    }

    #[test]
    fn version_1_frames_still_decode() {
        for (data, transform) in [
            (bf16_weights(50_001, 4), Transform::Bytegroup2),
            (fp32_values(30_000, 5), Transform::Bytegroup4),
        ] {
            let f = v1_frame(
                &data,
                FileCompression {
                    codec: Codec::Zstd,
                    level: 1,
                    transform,
                },
            );
            assert_eq!(decode_chunk(&f.bytes, &expected(&f)).unwrap(), data);
        }
    }

    #[test]
    fn malformed_plane_frames_are_errors_not_panics() {
        let data = fp32_values(20_003, 8);
        let c = choose_compression(Some(&data), 1);
        let f = encode_chunk(&data, c);
        assert_eq!(f.codec, Codec::ZstdPlanes);
        // Rewrite each byte of the header and plane table (and rehash, as an attacker who can
        // write the manifest would): every variant is refused or decodes, none panics.
        for pos in 0..HEADER_LEN + 4 * PLANE_ENTRY {
            for v in [0u8, 1, 2, 3, 0xff] {
                let mut bad = f.bytes.to_vec();
                bad[pos] = v;
                let exp = Expected {
                    blake3: blake3::hash(&bad),
                    ..expected(&f)
                };
                if let Ok(raw) = decode_chunk(&bad, &exp) {
                    assert_eq!(raw.len(), data.len());
                }
            }
        }
    }

    fn expected(f: &Frame) -> Expected {
        Expected {
            raw_len: f.raw_len,
            codec: f.codec,
            transform: f.transform,
            blake3: f.blake3,
        }
    }

    #[test]
    fn frames_round_trip_and_incompressible_chunks_are_stored() {
        let bf16 = bf16_weights(100_000, 7);
        for transform in Transform::ALL {
            let c = FileCompression {
                codec: Codec::Zstd,
                level: 3,
                transform,
            };
            let f = encode_chunk(&bf16, c);
            let codec = match transform {
                Transform::None => Codec::Zstd,
                _ => Codec::ZstdPlanes,
            };
            assert_eq!(f.codec, codec);
            assert!(f.bytes.len() < bf16.len());
            assert_eq!(&f.bytes[..4], b"SLZ1");
            assert_eq!(decode_chunk(&f.bytes, &expected(&f)).unwrap(), bf16);
        }
        // Random bytes do not compress: stored raw, one header of overhead.
        let mut r = Rng::new(99);
        let noise: Vec<u8> = (0..50_000).map(|_| r.next_u64() as u8).collect();
        let f = encode_chunk(
            &noise,
            FileCompression {
                codec: Codec::Zstd,
                level: 3,
                transform: Transform::Bytegroup2,
            },
        );
        assert_eq!((f.codec, f.transform), (Codec::Stored, Transform::None));
        assert_eq!(f.bytes.len(), noise.len() + HEADER_LEN);
        assert_eq!(decode_chunk(&f.bytes, &expected(&f)).unwrap(), noise);
        let empty = encode_chunk(&[], FileCompression::STORED);
        assert_eq!(decode_chunk(&empty.bytes, &expected(&empty)).unwrap(), b"");
    }

    #[test]
    fn every_codec_decodes_the_same_into_a_slice_and_into_a_reused_vec() {
        // An odd number of bf16 values: the 4-byte grouping leaves a tail.
        let bf16 = bf16_weights(100_003, 21);
        let mut r = Rng::new(5);
        let noise: Vec<u8> = (0..30_000).map(|_| r.next_u64() as u8).collect();
        let zstd = |transform| FileCompression {
            codec: Codec::Zstd,
            level: 1,
            transform,
        };
        let mut frames: Vec<(Frame, &[u8])> = Transform::ALL
            .into_iter()
            .map(|t| (encode_chunk(&bf16, zstd(t)), &bf16[..]))
            .collect();
        frames.push((v1_frame(&bf16, zstd(Transform::Bytegroup4)), &bf16));
        frames.push((encode_chunk(&noise, zstd(Transform::None)), &noise));
        let kinds: Vec<_> = frames.iter().map(|(f, _)| (f.codec, f.transform)).collect();
        for kind in [
            (Codec::Zstd, Transform::None),
            (Codec::ZstdPlanes, Transform::Bytegroup2),
            (Codec::Zstd, Transform::Bytegroup4),
            (Codec::Stored, Transform::None),
        ] {
            assert!(kinds.contains(&kind), "{kind:?} not covered: {kinds:?}");
        }
        let mut reused = vec![0xee; 100];
        for (f, raw) in &frames {
            let exp = expected(f);
            let mut out = vec![0xee; raw.len()];
            decode_chunk_to(&f.bytes, &exp, &mut out).unwrap();
            assert_eq!(&out, raw, "{:?} into a slice", (f.codec, f.transform));
            decode_chunk_into(&f.bytes, &exp, &mut reused).unwrap();
            assert_eq!(
                &reused,
                raw,
                "{:?} into a reused vec",
                (f.codec, f.transform)
            );
            let e = decode_chunk_to(&f.bytes, &exp, &mut out[1..]).unwrap_err();
            assert!(e.contains("buffer of"), "{e}");
        }
    }

    #[test]
    fn corruption_is_detected() {
        let data = fp32_values(20_000, 3);
        let c = choose_compression(Some(&data), 3);
        let f = encode_chunk(&data, c);
        let exp = expected(&f);
        // One flipped bit anywhere in the frame.
        for pos in [0, 5, 9, HEADER_LEN, f.bytes.len() / 2, f.bytes.len() - 1] {
            let mut bad = f.bytes.to_vec();
            bad[pos] ^= 0x10;
            let e = decode_chunk(&bad, &exp).unwrap_err();
            assert!(e.contains("checksum"), "{e}");
        }
        // Truncated, and a frame that matches its hash but not the manifest's other fields.
        assert!(decode_chunk(&f.bytes[..f.bytes.len() - 1], &exp).is_err());
        let e = decode_chunk(
            &f.bytes,
            &Expected {
                raw_len: exp.raw_len + 1,
                ..exp
            },
        )
        .unwrap_err();
        assert!(e.contains("disagrees"), "{e}");
    }

    #[test]
    fn sampling_picks_the_width_of_the_data() {
        let bf16 = bf16_weights(200_000, 11);
        let r = sample_range(bf16.len() as u64).unwrap();
        let c = choose_compression(Some(&bf16[r.start as usize..r.end as usize]), 3);
        assert_eq!((c.codec, c.transform), (Codec::Zstd, Transform::Bytegroup2));
        let fp32 = fp32_values(100_000, 12);
        let c = choose_compression(Some(&fp32[..SAMPLE_LEN]), 3);
        assert_eq!((c.codec, c.transform), (Codec::Zstd, Transform::Bytegroup4));
        let mut rng = Rng::new(5);
        let noise: Vec<u8> = (0..SAMPLE_LEN).map(|_| rng.next_u64() as u8).collect();
        assert_eq!(choose_compression(Some(&noise), 3), FileCompression::STORED);
        assert_eq!(choose_compression(Some(&bf16), 0), FileCompression::STORED);
        assert_eq!(sample_range(100), None);
        let r = sample_range(10 << 20).unwrap();
        assert_eq!((r.start % 4096, r.end - r.start), (0, SAMPLE_LEN as u64));
    }
}
