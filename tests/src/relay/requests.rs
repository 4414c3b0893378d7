//! The HTTP requests in one connection's client → server bytes, counted by kind: what the agents
//! asked the origin (S3) for, seen on the origin's side of the relay.
//!
//! A relay sees a connection's bytes in whatever chunks the kernel hands it: a request line may
//! be split anywhere, and a PUT's body may hold text that looks like a request. So the bytes are
//! framed as HTTP/1.1 (RFC 9112) is: a request head up to its empty line, then a body of its
//! `Content-Length`, or in `chunked` coding, skipped unread. object_store speaks HTTP/1.1 to a
//! plain-HTTP endpoint (no h2c without `with_http2_only`), which is what the test stores are.
//!
//! Kinds, from the request line: a **listing** is a `GET` whose query has a `list-type`
//! parameter — S3's ListObjectsV2, `GET /bucket?list-type=2&prefix=…` (path-style, as
//! object_store sends it to a custom endpoint; `continuation-token` or `delimiter` may come
//! first) or `GET /?list-type=2…` (virtual-hosted); each page is one request. Any other `GET`
//! is an object read (whole or ranged), a `HEAD` an object's metadata; the rest (PUT, POST,
//! DELETE) is counted as other.

use std::sync::atomic::{AtomicU64, Ordering};

/// Requests a relay passed to the server, by kind (see the module doc).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Requests {
    /// Listing requests (ListObjectsV2 pages).
    pub lists: u64,
    /// Object GETs (not listings).
    pub gets: u64,
    pub heads: u64,
    /// Every other method.
    pub others: u64,
    /// Connections whose bytes stopped being HTTP/1.1 the framer knows (a head over
    /// [`MAX_HEAD`], a bad chunk size): nothing after that point of them is counted.
    pub unframed: u64,
}

impl Requests {
    /// What was counted after `earlier` (a snapshot of the same counters).
    pub fn since(self, earlier: Requests) -> Requests {
        Requests {
            lists: self.lists - earlier.lists,
            gets: self.gets - earlier.gets,
            heads: self.heads - earlier.heads,
            others: self.others - earlier.others,
            unframed: self.unframed - earlier.unframed,
        }
    }
}

/// The counters every connection of one relay adds to.
#[derive(Debug, Default)]
pub(super) struct Counters {
    lists: AtomicU64,
    gets: AtomicU64,
    heads: AtomicU64,
    others: AtomicU64,
    unframed: AtomicU64,
}

impl Counters {
    pub(super) fn get(&self) -> Requests {
        let v = |a: &AtomicU64| a.load(Ordering::SeqCst);
        Requests {
            lists: v(&self.lists),
            gets: v(&self.gets),
            heads: v(&self.heads),
            others: v(&self.others),
            unframed: v(&self.unframed),
        }
    }

    fn add(&self, kind: Kind) {
        let counter = match kind {
            Kind::List => &self.lists,
            Kind::Get => &self.gets,
            Kind::Head => &self.heads,
            Kind::Other => &self.others,
        };
        counter.fetch_add(1, Ordering::SeqCst);
    }
}

/// The longest request head (request line and headers) the framer reads; S3 requests' heads are
/// well under 8 KiB.
pub const MAX_HEAD: usize = 64 << 10;
/// The longest chunk-size or trailer line.
const MAX_LINE: usize = 4 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    List,
    Get,
    Head,
    Other,
}

/// Where in the connection's bytes the framer is.
#[derive(Debug)]
enum At {
    /// In a request head (the bytes so far in `Framer::buf`).
    Head,
    /// In a body of known length: this many bytes left.
    Body(u64),
    /// In a chunked body: a chunk-size line (in `buf`).
    ChunkSize,
    /// In a chunk's data: this many bytes left, then its CRLF.
    ChunkData(u64),
    /// The CRLF after a chunk's data: this many bytes of it left.
    ChunkEnd(u8),
    /// The trailer section after the last chunk, up to its empty line (a line in `buf`).
    Trailer,
    /// Not HTTP the framer knows: the rest of the connection is not counted.
    Lost,
}

/// One connection's framer: [`Framer::feed`] it the client's bytes in any chunks.
pub(super) struct Framer {
    at: At,
    buf: Vec<u8>,
}

impl Framer {
    pub(super) fn new() -> Framer {
        Framer {
            at: At::Head,
            buf: Vec::new(),
        }
    }

    /// The next bytes the client sent; the requests they complete go to `counters`.
    pub(super) fn feed(&mut self, counters: &Counters, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match self.at {
                At::Lost => return,
                At::Body(left) => {
                    let n = skip(&mut bytes, left);
                    self.at = if n == left {
                        At::Head
                    } else {
                        At::Body(left - n)
                    };
                }
                At::ChunkData(left) => {
                    let n = skip(&mut bytes, left);
                    self.at = if n == left {
                        At::ChunkEnd(2)
                    } else {
                        At::ChunkData(left - n)
                    };
                }
                At::ChunkEnd(left) => {
                    let n = skip(&mut bytes, u64::from(left)) as u8;
                    self.at = if n == left {
                        At::ChunkSize
                    } else {
                        At::ChunkEnd(left - n)
                    };
                }
                At::Head => {
                    let b = take_byte(&mut bytes);
                    // Empty lines before a request line are allowed (RFC 9112, 2.2).
                    if self.buf.is_empty() && (b == b'\r' || b == b'\n') {
                        continue;
                    }
                    self.buf.push(b);
                    if self.buf.ends_with(b"\r\n\r\n") || self.buf.ends_with(b"\n\n") {
                        let head = std::mem::take(&mut self.buf);
                        self.at = self.request(counters, &head);
                    } else if self.buf.len() > MAX_HEAD {
                        self.lose(counters);
                    }
                }
                At::ChunkSize | At::Trailer => {
                    let b = take_byte(&mut bytes);
                    self.buf.push(b);
                    if b == b'\n' {
                        let line = std::mem::take(&mut self.buf);
                        self.at = self.line_done(counters, &line);
                    } else if self.buf.len() > MAX_LINE {
                        self.lose(counters);
                    }
                }
            }
        }
    }

    /// Counts the request whose head is `head`; where its body (if any) ends.
    fn request(&mut self, counters: &Counters, head: &[u8]) -> At {
        let text = String::from_utf8_lossy(head);
        let mut lines = text.lines();
        let mut words = lines.next().unwrap_or_default().split(' ');
        let (Some(method), Some(target)) = (words.next(), words.next()) else {
            return self.lose(counters);
        };
        counters.add(kind(method, target));
        let mut length = 0u64;
        let mut chunked = false;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                match value.parse() {
                    Ok(n) => length = n,
                    Err(_) => return self.lose(counters),
                }
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value
                    .rsplit(',')
                    .next()
                    .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
            }
        }
        // Transfer-Encoding wins over Content-Length (RFC 9112, 6.3).
        if chunked {
            At::ChunkSize
        } else if length > 0 {
            At::Body(length)
        } else {
            At::Head
        }
    }

    /// A chunk-size or trailer line ended (`line` with its LF).
    fn line_done(&mut self, counters: &Counters, line: &[u8]) -> At {
        let text = String::from_utf8_lossy(line);
        let text = text.trim_end_matches(['\r', '\n']);
        if let At::Trailer = self.at {
            return if text.is_empty() {
                At::Head
            } else {
                At::Trailer
            };
        }
        let size = text.split(';').next().unwrap_or_default().trim();
        match u64::from_str_radix(size, 16) {
            Ok(0) => At::Trailer,
            Ok(n) => At::ChunkData(n),
            Err(_) => self.lose(counters),
        }
    }

    /// The connection is no HTTP the framer knows: counted as such, and nothing more of it.
    fn lose(&mut self, counters: &Counters) -> At {
        self.at = At::Lost;
        self.buf = Vec::new();
        counters.unframed.fetch_add(1, Ordering::SeqCst);
        At::Lost
    }
}

/// Drops up to `n` bytes from the front of `bytes`; how many it dropped.
fn skip(bytes: &mut &[u8], n: u64) -> u64 {
    let k = usize::try_from(n).unwrap_or(usize::MAX).min(bytes.len());
    *bytes = &bytes[k..];
    k as u64
}

fn take_byte(bytes: &mut &[u8]) -> u8 {
    let b = bytes[0];
    *bytes = &bytes[1..];
    b
}

/// A request's kind from its method and request-target.
fn kind(method: &str, target: &str) -> Kind {
    match method {
        "GET" => {
            let query = target.split_once('?').map_or("", |(_, q)| q);
            let listing = query
                .split('&')
                .any(|p| p.split('=').next() == Some("list-type"));
            if listing { Kind::List } else { Kind::Get }
        }
        "HEAD" => Kind::Head,
        _ => Kind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One connection's requests as object_store and a client with a chunked upload send them:
    /// listings of both styles (one with `list-type` after a continuation token), ranged and whole
    /// GETs, a HEAD, a PUT and a chunked PUT whose bodies hold request-like text and a `\r\n\r\n`,
    /// and a GET whose target names `list-type` in its key, not its query.
    fn conversation() -> Vec<u8> {
        let put_body = b"GET /datasets?list-type=2 HTTP/1.1\r\n\r\nHEAD /x HTTP/1.1\r\n\r\n";
        let mut c = Vec::new();
        c.extend_from_slice(
            b"GET /datasets-relayed?list-type=2&prefix=bench%2Fscale%2F HTTP/1.1\r\n\
              host: 127.0.0.1:3912\r\nx-amz-date: 20261206T030000Z\r\n\r\n",
        );
        c.extend_from_slice(
            b"GET /datasets-relayed?continuation-token=abc%3D&list-type=2&prefix=p HTTP/1.1\r\n\
              host: 127.0.0.1:3912\r\n\r\n",
        );
        c.extend_from_slice(b"GET /?list-type=2&prefix=p HTTP/1.1\r\nhost: b.s3\r\n\r\n");
        c.extend_from_slice(
            b"\r\nGET /datasets-relayed/bench/f00 HTTP/1.1\r\nrange: bytes=0-99\r\n\r\n",
        );
        c.extend_from_slice(b"GET /datasets-relayed/list-type=2/f HTTP/1.1\r\n\r\n");
        c.extend_from_slice(b"HEAD /datasets-relayed/bench/f01 HTTP/1.1\r\n\r\n");
        c.extend_from_slice(
            format!(
                "PUT /ckpt/x HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
                put_body.len()
            )
            .as_bytes(),
        );
        c.extend_from_slice(put_body);
        c.extend_from_slice(b"PUT /ckpt/y HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
        c.extend_from_slice(format!("{:x};ext=1\r\n", put_body.len()).as_bytes());
        c.extend_from_slice(put_body);
        c.extend_from_slice(b"\r\n0\r\nx-trailer: 1\r\n\r\n");
        c.extend_from_slice(b"GET /datasets-relayed?list-type=2 HTTP/1.1\r\n\r\n");
        c
    }

    const WANT: Requests = Requests {
        lists: 4,
        gets: 2,
        heads: 1,
        others: 2,
        unframed: 0,
    };

    fn count(chunks: &[&[u8]]) -> Requests {
        let counters = Counters::default();
        let mut framer = Framer::new();
        for c in chunks {
            framer.feed(&counters, c);
        }
        counters.get()
    }

    #[test]
    fn requests_are_counted_by_kind_wherever_the_chunks_split_them() {
        let conv = conversation();
        assert_eq!(count(&[&conv]), WANT, "in one chunk");
        let bytes: Vec<&[u8]> = conv.chunks(1).collect();
        assert_eq!(count(&bytes), WANT, "a byte at a time");
        for at in 1..conv.len() {
            let (a, b) = conv.split_at(at);
            assert_eq!(count(&[a, b]), WANT, "split at byte {at}");
        }
    }

    #[test]
    fn bytes_that_are_not_http_stop_the_count_and_say_so() {
        let mut conv =
            b"GET /b/k HTTP/1.1\r\nContent-Length: x\r\n\r\nGET /b/k HTTP/1.1\r\n\r\n".to_vec();
        let got = count(&[&conv]);
        assert_eq!((got.gets, got.unframed), (1, 1), "{got:?}");
        conv = vec![b'A'; MAX_HEAD + 1];
        assert_eq!(count(&[&conv]).unframed, 1);
    }
}
