//! End-to-end tests live in `tests/tests/`; this crate hosts them, and holds what several test files
//! share that needs nothing of the cluster's description: the byte- and request-counting relay in
//! front of an origin and the plain relay under it (see [`relay`]), and what a store itself says of
//! an object's storage class (see [`storage_class`]), which the archive crate's conformance suite
//! reads too, and what the agent's and the CLI's tests of their binaries' man pages, shell
//! completions and `--help` share (see [`pages`]), and how the harness's env file names an agent's
//! ports, which the bench reads too (see [`agent_addrs`]), and the `key=value` / `key value` lists
//! that commands and the env file print, as maps (see [`split_pairs`]), a process's CPU time and
//! peak memory from `/proc` (see [`procfs`]), and a fleet of agents driven as the plugin drives
//! them, without Slurm, for more nodes than the test cluster has (see [`fleet`]).

pub mod fleet;
pub mod pages;
#[cfg(test)]
#[path = "../../agent/tests/support/ports.rs"]
mod ports;
pub mod procfs;

use std::collections::BTreeMap;

/// Each of `items` split at its first `sep` into key → value (an item without `sep` is skipped, a
/// later key replaces an earlier one): `n1=127.0.0.1:7001 …` or `find -printf` lines as a map.
pub fn split_pairs<'a>(
    items: impl IntoIterator<Item = &'a str>,
    sep: char,
) -> BTreeMap<String, String> {
    items
        .into_iter()
        .filter_map(|item| item.split_once(sep))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
#[test]
fn split_pairs_keeps_what_follows_the_first_separator() {
    let map = split_pairs("d0/f 17 1.5\nno-separator\nb 2\nb 3".lines(), ' ');
    assert_eq!(
        map.into_iter().collect::<Vec<_>>(),
        [("b".into(), "3".into()), ("d0/f".into(), "17 1.5".into())]
    );
    let addrs = split_pairs("n1=h:1 n2=h:2 ".split_whitespace(), '=');
    assert_eq!(addrs["n2"], "h:2");
}

/// The mount points strictly below `root` in this process's mount table, deepest first: the order
/// to unmount them in (a lost node's RAM-tier tmpfs mounts, which the replicas test and bench case
/// remove as if the node were replaced).
pub fn mounts_below(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let table = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut mounts: Vec<std::path::PathBuf> = table
        .lines()
        .filter_map(|l| l.split(' ').nth(1).map(std::path::PathBuf::from))
        .filter(|p| p.starts_with(root) && p != root)
        .collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    mounts
}

/// The addresses `node`'s agent listens on, its peer and its metrics port, from the harness's env
/// file (`tests/harness/cluster.sh up`), whose variables `var` reads: each lists every node's
/// `node=host:port`, separated by spaces.
pub fn agent_addrs(var: impl Fn(&str) -> String, node: &str) -> Vec<String> {
    ["SLUICE_TEST_PEER_ADDRS", "SLUICE_TEST_METRICS_ADDRS"]
        .iter()
        .flat_map(|v| {
            var(v)
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .filter(|(n, _)| *n == node)
                .map(|(_, a)| a.to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

#[cfg(test)]
#[test]
fn agent_addrs_reads_the_nodes_entries() {
    let var = |v: &str| match v {
        "SLUICE_TEST_PEER_ADDRS" => "n1=127.0.0.1:7001 n2=127.0.0.1:7002 ".to_string(),
        "SLUICE_TEST_METRICS_ADDRS" => "n1=127.0.0.1:9001 n2=127.0.0.1:9002 ".to_string(),
        _ => String::new(),
    };
    assert_eq!(agent_addrs(var, "n2"), ["127.0.0.1:7002", "127.0.0.1:9002"]);
    assert!(agent_addrs(var, "n3").is_empty());
}

pub mod relay {
    //! TCP relays in front of a server, stopping (and cutting their connections) when dropped.
    //! [`CountingRelay`] stands in front of an object store (Garage), on the port the agents'
    //! `s3://datasets-relayed` store profile points at: it counts the bytes the store sends back
    //! (object bodies, listings, headers), which is what the origin served, and the requests the
    //! clients sent it by kind (listings, GETs, HEADs: see [`Requests`]), counted on the origin's
    //! side rather than by the agents. It can pace the origin: all its connections together then
    //! carry at most a set number of bytes a second, so a transfer lasts long enough for a test to
    //! act while it runs. [`Relay`] is the plain relay under it, for a test that changes what the
    //! server answers.

    mod requests;
    pub use requests::Requests;
    use requests::{Counters, Framer};

    use std::io::{self, Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    /// A TCP relay from a listener to `upstream`: each connection's requests pass as they are, its
    /// answers go through `back(server, client)`.
    pub struct Relay {
        stop: Arc<AtomicBool>,
        conns: Arc<Mutex<Vec<TcpStream>>>,
        port: u16,
        accept: Option<JoinHandle<()>>,
    }

    impl Relay {
        /// Relays every connection `listener` accepts to `upstream` (`host:port`); `back` copies
        /// the upstream's answers to the client until either side closes.
        pub fn start(
            listener: TcpListener,
            upstream: &str,
            back: impl Fn(TcpStream, TcpStream) + Clone + Send + 'static,
        ) -> io::Result<Relay> {
            Relay::start_watching(listener, upstream, || |_: &[u8]| {}, back)
        }

        /// [`Relay::start`], each connection's requests also shown as they pass, in the chunks
        /// they arrive in, to a watcher of its own that `watcher` makes.
        pub fn start_watching<W: FnMut(&[u8]) + Send + 'static>(
            listener: TcpListener,
            upstream: &str,
            watcher: impl Fn() -> W + Send + 'static,
            back: impl Fn(TcpStream, TcpStream) + Clone + Send + 'static,
        ) -> io::Result<Relay> {
            let port = listener.local_addr()?.port();
            let upstream = upstream.to_string();
            let stop = Arc::new(AtomicBool::new(false));
            let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
            let (st, c) = (stop.clone(), conns.clone());
            let accept = std::thread::spawn(move || {
                for client in listener.incoming() {
                    if st.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(&upstream) else {
                        continue;
                    };
                    let (Ok(c1), Ok(s1), Ok(c2), Ok(s2)) = (
                        client.try_clone(),
                        server.try_clone(),
                        client.try_clone(),
                        server.try_clone(),
                    ) else {
                        continue;
                    };
                    c.lock().unwrap().extend([c1, s1]);
                    let watch = watcher();
                    std::thread::spawn(move || pipe(c2, s2, watch));
                    let back = back.clone();
                    std::thread::spawn(move || back(server, client));
                }
            });
            Ok(Relay {
                stop,
                conns,
                port,
                accept: Some(accept),
            })
        }

        /// The port it listens on (`127.0.0.1`).
        pub fn port(&self) -> u16 {
            self.port
        }
    }

    impl Drop for Relay {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::SeqCst);
            for c in self.conns.lock().unwrap().drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
            // Wake the accept loop so it sees the flag.
            let _ = TcpStream::connect(("127.0.0.1", self.port));
            if let Some(t) = self.accept.take() {
                let _ = t.join();
            }
        }
    }

    /// A [`Relay`] that counts, and can pace, what the upstream sends back, and counts the
    /// requests sent to it.
    pub struct CountingRelay {
        served: Arc<AtomicU64>,
        requests: Arc<Counters>,
        pace: Arc<Pace>,
        relay: Relay,
    }

    impl CountingRelay {
        /// Listens on `127.0.0.1:port` and relays every connection to `upstream` (`host:port`).
        pub fn start(port: u16, upstream: &str) -> io::Result<CountingRelay> {
            let listener = TcpListener::bind(("127.0.0.1", port))?;
            let served = Arc::new(AtomicU64::new(0));
            let requests = Arc::new(Counters::default());
            let pace = Arc::new(Pace::default());
            let (s, p, r) = (served.clone(), pace.clone(), requests.clone());
            let relay = Relay::start_watching(
                listener,
                upstream,
                move || {
                    let r = r.clone();
                    let mut framer = Framer::new();
                    move |bytes: &[u8]| framer.feed(&r, bytes)
                },
                move |server, client| {
                    pipe(server, client, |bytes| {
                        s.fetch_add(bytes.len() as u64, Ordering::SeqCst);
                        p.wait(bytes.len());
                    })
                },
            )?;
            Ok(CountingRelay {
                served,
                requests,
                pace,
                relay,
            })
        }

        /// Bytes the upstream sent back since the relay started.
        pub fn served(&self) -> u64 {
            self.served.load(Ordering::SeqCst)
        }

        /// Bytes the upstream sent back since the relay started or this was last asked.
        pub fn take_served(&self) -> u64 {
            self.served.swap(0, Ordering::SeqCst)
        }

        /// The requests sent to the upstream since the relay started, by kind; what came after
        /// an earlier reading is [`Requests::since`] it.
        pub fn requests(&self) -> Requests {
            self.requests.get()
        }

        /// At most `bytes_per_sec` from the upstream, over all connections together (0: unpaced).
        pub fn set_pace(&self, bytes_per_sec: u64) {
            self.pace.rate.store(bytes_per_sec, Ordering::SeqCst);
            *self.pace.next.lock().unwrap() = None;
        }

        pub fn port(&self) -> u16 {
            self.relay.port()
        }
    }

    /// The relay's one bandwidth limit: each chunk relayed back waits for its slot in one timeline.
    #[derive(Default)]
    struct Pace {
        rate: AtomicU64,
        next: Mutex<Option<Instant>>,
    }

    impl Pace {
        fn wait(&self, n: usize) {
            let rate = self.rate.load(Ordering::SeqCst);
            if rate == 0 {
                return;
            }
            let until = {
                let mut next = self.next.lock().unwrap();
                let start = next.map_or_else(Instant::now, |t| t.max(Instant::now()));
                let end = start + Duration::from_secs_f64(n as f64 / rate as f64);
                *next = Some(end);
                end
            };
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
        }
    }

    /// Copies `from` to `to` until either side closes, showing each chunk to `each` before it
    /// is written on.
    fn pipe(mut from: TcpStream, mut to: TcpStream, mut each: impl FnMut(&[u8])) {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            each(&buf[..n]);
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// Through a real relay: the requests one client writes in pieces (split inside a request
        /// line) and those of a second connection are counted by kind, and the server's answer
        /// as bytes served.
        #[test]
        fn a_counting_relay_counts_the_requests_in_and_the_bytes_out() {
            let server = TcpListener::bind("127.0.0.1:0").unwrap();
            let upstream = server.local_addr().unwrap().to_string();
            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
            std::thread::spawn(move || {
                for conn in server.incoming().take(2) {
                    let mut conn = conn.unwrap();
                    conn.write_all(answer).unwrap();
                    std::thread::spawn(move || io::copy(&mut conn, &mut io::sink()));
                }
            });
            let port = crate::ports::free_port();
            let relay = CountingRelay::start(port, &upstream).unwrap();
            let mut a = TcpStream::connect(("127.0.0.1", port)).unwrap();
            for piece in [
                &b"GET /datasets-relayed?list-"[..],
                b"type=2&prefix=x HTTP/1.1\r\n\r\nGET /datasets-relayed/x/f HTTP/1.1\r\n",
                b"range: bytes=0-9\r\n\r\nHEAD /datasets-relayed/x/f HTTP/1.1\r\n\r\n",
            ] {
                a.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            let mut b = TcpStream::connect(("127.0.0.1", port)).unwrap();
            b.write_all(b"GET /?list-type=2 HTTP/1.1\r\n\r\n").unwrap();
            let want = Requests {
                lists: 2,
                gets: 1,
                heads: 1,
                ..Requests::default()
            };
            let t = Instant::now();
            while (relay.requests(), relay.served()) != (want, 2 * answer.len() as u64) {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "after 10 s the relay counted {:?} and {} bytes served",
                    relay.requests(),
                    relay.served()
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

pub mod storage_class {
    //! What a store itself says the storage class of an object is, read behind object_store's back
    //! (object_store does not report it).

    use std::process::Command;

    /// The `x-amz-storage-class` header of a HEAD of `url` (`ENDPOINT/BUCKET/KEY`), signed by curl
    /// with the key `key_id`/`secret` for `region`. `None`: the store names no class.
    pub fn s3(url: &str, region: &str, key_id: &str, secret: &str) -> Option<String> {
        let head = run_ok(
            Command::new("curl")
                .args(["--fail-with-body", "-sS", "-I", "--aws-sigv4"])
                .arg(format!("aws:amz:{region}:s3"))
                .arg("--user")
                .arg(format!("{key_id}:{secret}"))
                .args(["-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD"])
                .arg(url),
        );
        head.lines().find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("x-amz-storage-class")
                .then(|| value.trim().to_string())
        })
    }

    /// Runs `cmd` (without `AWS_CA_BUNDLE`: the test stores speak plain HTTP), which must succeed;
    /// its stdout.
    pub fn run_ok(cmd: &mut Command) -> String {
        let out = cmd
            .env_remove("AWS_CA_BUNDLE")
            .output()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}
