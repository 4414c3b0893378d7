//! The peer layer in process: real servers on 127.0.0.1 ports, the real client, in-memory unit
//! sources standing in for the stager, and small TCP relays and fake servers for the attacks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sluice_core::rt::{lock, now_secs};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use super::server::unit_query;
use super::*;

const JOB: u32 = 4242;
const UNIT: u64 = 4096;

fn names(n: &[&str]) -> Vec<String> {
    n.iter().map(|s| s.to_string()).collect()
}

fn secret() -> ClusterSecret {
    ClusterSecret::from_bytes(*b"0123456789abcdef0123456789abcdef")
}

/// Bytes no refusal may contain: every test file is made of them.
const MARK: &[u8] = b"SLUICE-UNIT-DATA";

fn content(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| MARK[i % MARK.len()].wrapping_add(seed * ((i / MARK.len()) % 2) as u8))
        .collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The stager's stand-in: units put in as "read from the origin", waited for until then.
#[derive(Default)]
struct MemSource {
    units: Mutex<HashMap<Unit, Result<UnitData, UnitError>>>,
    arrived: Notify,
    /// When set, `unit()` waits for a permit of it (the test opens the gate).
    gate: Option<Arc<Semaphore>>,
    /// Requests that reached `ready()`.
    asked: AtomicUsize,
    entered: AtomicUsize,
    active: AtomicUsize,
    max_active: AtomicUsize,
    /// Listing pages by (dataset, source, first object).
    pages: Mutex<HashMap<(String, String, u64), Bytes>>,
}

impl MemSource {
    fn put(&self, unit: &Unit, bytes: Bytes) {
        assert_eq!(bytes.len() as u64, unit.len);
        let data = UnitData {
            hash: blake3::hash(&bytes),
            bytes,
            from: HashFrom::Origin,
        };
        lock(&self.units).insert(unit.clone(), Ok(data));
        self.arrived.notify_waiters();
    }

    fn fail(&self, unit: &Unit, e: UnitError) {
        lock(&self.units).insert(unit.clone(), Err(e));
        self.arrived.notify_waiters();
    }
}

#[async_trait::async_trait]
impl UnitSource for MemSource {
    async fn ready(&self, unit: &Unit) -> Result<(), UnitError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            match lock(&self.units).get(unit) {
                Some(Ok(_)) => return Ok(()),
                Some(Err(e)) => return Err(e.clone()),
                None => {}
            }
            arrived.await;
        }
    }

    async fn unit(&self, unit: &Unit) -> Result<UnitData, UnitError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_active.fetch_max(now, Ordering::SeqCst);
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        self.active.fetch_sub(1, Ordering::SeqCst);
        lock(&self.units)
            .get(unit)
            .cloned()
            .unwrap_or(Err(UnitError::NotOwner))
    }

    async fn listing_page(&self, asked: &listing::PageRequest) -> Result<Bytes, UnitError> {
        let key = (asked.dataset.clone(), asked.source.clone(), asked.from);
        lock(&self.pages)
            .get(&key)
            .cloned()
            .ok_or(UnitError::NotOwner)
    }
}

fn server_cfg() -> ServerConfig {
    ServerConfig {
        concurrency: 4,
        max_unit: UNIT,
        max_skew: Duration::from_secs(120),
        poll: Duration::from_millis(200),
        max_connections: 64,
        max_per_source: 8,
        idle_timeout: Duration::from_secs(5),
    }
}

fn client_cfg() -> ClientConfig {
    ClientConfig {
        concurrency: 8,
        max_unit: UNIT,
        connect_timeout: Duration::from_secs(1),
        read_timeout: Duration::from_secs(2),
        poll: Duration::from_millis(200),
        join_grace: Duration::from_millis(600),
        max_wait: Duration::from_secs(20),
    }
}

/// A running peer server; stops when dropped.
struct Running {
    server: PeerServer,
    addr: String,
    _stop: tokio_util::sync::DropGuard,
}

async fn start(cfg: ServerConfig) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = PeerServer::new(secret(), cfg);
    let stop = CancellationToken::new();
    let s = server.clone();
    let token = stop.clone();
    tokio::spawn(async move { s.serve(listener, token).await });
    Running {
        server,
        addr,
        _stop: stop.drop_guard(),
    }
}

/// Registers job JOB (nodes n1, n2) on `server`, its units from `src`.
fn register(server: &PeerServer, src: &Arc<MemSource>) {
    server.register(
        JOB,
        &names(&["n1", "n2"]),
        src.clone() as Arc<dyn UnitSource>,
    );
}

/// A server started with `cfg`, serving job JOB (nodes n1, n2) from a fresh source.
async fn serving(cfg: ServerConfig) -> (Running, Arc<MemSource>) {
    let r = start(cfg).await;
    let src = Arc::new(MemSource::default());
    register(&r.server, &src);
    (r, src)
}

/// One server serving one unit of job JOB (nodes n1, n2) from a fresh source.
async fn one_unit() -> (Running, Arc<MemSource>, Unit, Bytes) {
    let (r, src) = serving(server_cfg()).await;
    let unit = Unit::new("train/shard 0.bin", 0, 3000);
    let bytes = content(3000, 1);
    src.put(&unit, bytes.clone());
    (r, src, unit, bytes)
}

fn key() -> JobKey {
    secret().job_key(JOB, &names(&["n1", "n2"]))
}

/// A GET sent by hand, as any process on the node could; returns the status and the body.
async fn raw_get(addr: &str, path_and_query: &str, headers: &[(&str, String)]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut req = format!("GET {path_and_query} HTTP/1.1\r\nhost: {addr}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .expect("the server closes the connection")
        .unwrap();
    let end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let status = std::str::from_utf8(&out[9..12]).unwrap().parse().unwrap();
    (status, out[end + 4..].to_vec())
}

fn signed_headers(key: &JobKey, pq: &str, node: &str, time: u64) -> Vec<(&'static str, String)> {
    vec![
        ("x-sluice-node", node.to_string()),
        ("x-sluice-time", time.to_string()),
        (
            "x-sluice-mac",
            key.request_mac("GET", pq, node, time).to_hex().to_string(),
        ),
    ]
}

fn unit_path(unit: &Unit) -> String {
    format!("/v1/jobs/{JOB}/units?{}", unit_query(unit))
}

#[tokio::test]
async fn two_nodes_serve_their_own_units_and_every_node_gets_identical_bytes() {
    let nodes = names(&["n1", "n2"]);
    let servers = [start(server_cfg()).await, start(server_cfg()).await];
    let sources = [
        Arc::new(MemSource::default()),
        Arc::new(MemSource::default()),
    ];
    for (r, s) in servers.iter().zip(&sources) {
        r.server
            .register(JOB, &nodes, s.clone() as Arc<dyn UnitSource>);
    }
    // Files of every shape: empty, one byte, one unit, many units with a short tail; names that
    // need percent-encoding.
    let files: Vec<(String, Bytes)> = [
        ("empty", 0),
        ("one", 1),
        ("exact.bin", UNIT as usize),
        ("dir with space/ü+%&=?.tar", 3 * UNIT as usize + 5),
        ("big@1/x", 9 * UNIT as usize + 77),
    ]
    .iter()
    .enumerate()
    .map(|(i, (f, len))| (f.to_string(), content(*len, i as u8)))
    .collect();
    // Each owner "reads the origin" for its units only.
    let mut owned = [0usize; 2];
    for (f, bytes) in &files {
        for u in units_of(f, bytes.len() as u64, UNIT) {
            let o = owner_of(&u.key(), &nodes);
            owned[o] += 1;
            let range = u.offset as usize..(u.offset + u.len) as usize;
            sources[o].put(&u, bytes.slice(range));
        }
    }
    assert!(
        owned[0] > 0 && owned[1] > 0,
        "both nodes own units: {owned:?}"
    );
    // Each node assembles every file from the owners (itself included, over the wire too).
    for me in &nodes {
        let client = PeerClient::new(me.clone(), client_cfg());
        let key = secret().job_key(JOB, &nodes);
        for (f, bytes) in &files {
            let mut got = Vec::new();
            for u in units_of(f, bytes.len() as u64, UNIT) {
                let owner = owner_of(&u.key(), &nodes);
                let b = client.fetch(&servers[owner].addr, &key, &u).await.unwrap();
                assert_eq!(b.len() as u64, u.len);
                got.extend_from_slice(&b);
            }
            assert!(got == bytes.as_ref(), "{me}: {f} differs");
        }
    }
}

#[tokio::test]
async fn a_unit_is_served_as_soon_as_its_owner_has_read_it() {
    let mut cfg = server_cfg();
    cfg.poll = Duration::from_secs(1);
    let (r, src) = serving(cfg).await;
    let unit = Unit::new("later.bin", UNIT * 5, UNIT);
    let mut ccfg = client_cfg();
    ccfg.poll = Duration::from_secs(1);
    let client = Arc::new(PeerClient::new("n2", ccfg));
    let (c, a, u) = (client.clone(), r.addr.clone(), unit.clone());
    let fetch = tokio::spawn(async move { c.fetch(&a, &key(), &u).await });
    // Two long-poll windows pass while the owner is still reading; it reads the unit halfway
    // through the third.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!fetch.is_finished(), "the fetch waits for the owner");
    assert!(
        src.asked.load(Ordering::SeqCst) >= 3,
        "asked again after each window"
    );
    let bytes = content(UNIT as usize, 9);
    let arrived = tokio::time::Instant::now();
    src.put(&unit, bytes.clone());
    let got = fetch.await.unwrap().unwrap();
    assert_eq!(got, bytes);
    assert!(
        arrived.elapsed() < Duration::from_millis(400),
        "sent when it arrived, not at the next poll: {:?}",
        arrived.elapsed()
    );
}

#[tokio::test]
async fn requests_without_the_job_key_get_refusals_and_no_data() {
    let (r, _src, unit, _) = one_unit().await;
    let pq = unit_path(&unit);
    let now = now_secs();
    // A user process that knows the protocol but not the secret.
    let (status, body) = raw_get(&r.addr, &pq, &[]).await;
    assert_eq!(status, 401);
    assert!(!contains(&body, MARK) && body.len() < 200, "{body:?}");
    let forged = ClusterSecret::from_bytes([9u8; 32]).job_key(JOB, &names(&["n1", "n2"]));
    let mut bad_mac = signed_headers(&key(), &pq, "n2", now);
    bad_mac[2].1 = blake3::hash(b"guess").to_hex().to_string();
    let stale = signed_headers(&key(), &pq, "n2", now - 1000);
    let other_unit = Unit {
        offset: 4096,
        ..unit.clone()
    };
    for (what, pq, headers, want, reason) in [
        (
            "another secret",
            pq.clone(),
            signed_headers(&forged, &pq, "n2", now),
            401,
            "does not verify",
        ),
        ("a guessed MAC", pq.clone(), bad_mac, 401, "does not verify"),
        ("a stale timestamp", pq.clone(), stale, 401, "clock"),
        (
            "a MAC for another unit",
            unit_path(&other_unit),
            signed_headers(&key(), &pq, "n2", now),
            401,
            "does not verify",
        ),
        (
            "a node outside the job",
            pq.clone(),
            signed_headers(&key(), &pq, "n9", now),
            403,
            "not a node of job",
        ),
        (
            "the job key of another node list",
            pq.clone(),
            signed_headers(
                &secret().job_key(JOB, &names(&["n1", "n2", "n9"])),
                &pq,
                "n9",
                now,
            ),
            401,
            "does not verify",
        ),
    ] {
        let (status, body) = raw_get(&r.addr, &pq, &headers).await;
        let text = String::from_utf8_lossy(&body);
        assert_eq!(status, want, "{what}: {text}");
        assert!(text.contains(reason), "{what}: {text}");
        assert!(!contains(&body, MARK), "{what}: data in a refusal");
    }
    // The same through the client: a refusal, not data and not a retry.
    let c = PeerClient::new("n2", client_cfg());
    let e = c.fetch(&r.addr, &forged, &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 401, .. }), "{e}");
    let outsider = PeerClient::new("n9", client_cfg());
    let e = outsider.fetch(&r.addr, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 403, .. }), "{e}");
    // And the right key, for comparison, gets the data.
    assert!(c.fetch(&r.addr, &key(), &unit).await.is_ok());
}

/// The release a request names is noted (and logged) only once the request authenticated as a
/// node of the job: a user process, another cluster's agent or a node outside the job cannot
/// write into the agent's log through it.
#[tokio::test]
async fn a_peers_release_is_noted_only_from_an_authenticated_node_of_the_job() {
    let (r, _src, unit, _) = one_unit().await;
    let pq = unit_path(&unit);
    let now = now_secs();
    let forged = ClusterSecret::from_bytes([9u8; 32]).job_key(JOB, &names(&["n1", "n2"]));
    let version = |v: &str| ("x-sluice-version", v.to_string());
    let mut anonymous = vec![version("from-a-user")];
    anonymous.push(("x-sluice-node", "n2".into()));
    let mut other_secret = signed_headers(&forged, &pq, "n2", now);
    other_secret.push(version("from-another-secret"));
    let mut outsider = signed_headers(&key(), &pq, "n9", now);
    outsider.push(version("from-outside-the-job"));
    for (what, headers, want) in [
        ("no MAC", anonymous, 401),
        ("another secret", other_secret, 401),
        ("a node outside the job", outsider, 403),
    ] {
        let (status, _) = raw_get(&r.addr, &pq, &headers).await;
        assert_eq!(status, want, "{what}");
    }
    assert_eq!(
        r.server.releases_noted(),
        vec![],
        "refused requests note nothing"
    );
    let mut job_peer = signed_headers(&key(), &pq, "n2", now);
    job_peer.push(version("9.9.9"));
    let (status, _) = raw_get(&r.addr, &pq, &job_peer).await;
    assert_eq!(status, 200);
    assert_eq!(
        r.server.releases_noted(),
        vec![("n2".to_string(), Some("9.9.9".to_string()))]
    );
}

#[tokio::test]
async fn another_jobs_key_never_gets_this_jobs_data() {
    let (r, _src, unit, _) = one_unit().await;
    let other = secret().job_key(JOB + 1, &names(&["n1", "n2"]));
    let c = PeerClient::new("n2", client_cfg());
    // Job JOB+1 is not served here at all...
    let e = c.fetch(&r.addr, &other, &unit).await.unwrap_err();
    assert!(
        matches!(e, PeerError::UnknownJob { job, .. } if job == JOB + 1),
        "{e}"
    );
    // ...and its key on JOB's path is refused.
    let pq = unit_path(&unit);
    let (status, body) =
        raw_get(&r.addr, &pq, &signed_headers(&other, &pq, "n2", now_secs())).await;
    assert_eq!(status, 401);
    assert!(!contains(&body, MARK));
}

#[tokio::test]
async fn an_unknown_job_waits_for_a_late_registration_then_gives_up() {
    let r = start(server_cfg()).await;
    let unit = Unit::new("f", 0, 10);
    let c = Arc::new(PeerClient::new("n2", client_cfg()));
    // Never registered: UnknownJob after the join grace (0.6 s).
    let t = tokio::time::Instant::now();
    let e = c.fetch(&r.addr, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::UnknownJob { job: JOB, .. }), "{e}");
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    // Registered 0.3 s after the first request (the owner's prolog ran later): served.
    let (cc, a, u) = (c.clone(), r.addr.clone(), unit.clone());
    let fetch = tokio::spawn(async move { cc.fetch(&a, &key(), &u).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let src = Arc::new(MemSource::default());
    src.put(&unit, content(10, 0));
    register(&r.server, &src);
    assert_eq!(fetch.await.unwrap().unwrap(), content(10, 0));
}

#[tokio::test]
async fn an_ended_job_is_gone_and_its_waiting_requests_end_at_once() {
    let (r, _src) = serving(server_cfg()).await;
    let unit = Unit::new("never", 0, 10);
    let c = Arc::new(PeerClient::new("n2", client_cfg()));
    let (cc, a, u) = (c.clone(), r.addr.clone(), unit.clone());
    let fetch = tokio::spawn(async move { cc.fetch(&a, &key(), &u).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    r.server.unregister(JOB);
    let e = tokio::time::timeout(Duration::from_secs(2), fetch)
        .await
        .expect("the waiting fetch ends with the job")
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, PeerError::Gone { job: JOB, .. }), "{e}");
    let e = c.fetch(&r.addr, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Gone { job: JOB, .. }), "{e}");
}

#[tokio::test]
async fn the_owners_failures_reach_the_requester_authenticated() {
    let (r, src, unit, _) = one_unit().await;
    let c = PeerClient::new("n2", client_cfg());
    src.fail(&unit, UnitError::Failed("s3://b/x: 503 Slow Down".into()));
    let e = c.fetch(&r.addr, &key(), &unit).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Failed { reason, .. } if reason.contains("Slow Down")),
        "{e}"
    );
    src.fail(&unit, UnitError::NotOwner);
    let e = c.fetch(&r.addr, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::NotOwner { .. }), "{e}");
    // A unit larger than the server's unit size is refused, not allocated.
    let mut big = client_cfg();
    big.max_unit = 1 << 30;
    let c = PeerClient::new("n2", big);
    let huge = Unit {
        len: 1 << 30,
        ..unit.clone()
    };
    let e = c.fetch(&r.addr, &key(), &huge).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Refused { status: 400, reason, .. } if reason.contains("larger")),
        "{e}"
    );
    // The client's own limit holds before anything is sent.
    let c = PeerClient::new("n2", client_cfg());
    let e = c.fetch(&r.addr, &key(), &huge).await.unwrap_err();
    assert!(matches!(e, PeerError::TooLarge { .. }), "{e}");
}

/// What a relay between the nodes changes in the server's answers.
#[derive(Clone, Copy)]
enum Tamper {
    /// One bit of the 11th body byte.
    BodyByte,
    /// One hex digit of the unit hash header.
    HashHeader,
    /// The read-back mark's header name (so the answer no longer carries the mark).
    ReadBackMark,
}

/// A TCP relay to `upstream` that changes one byte of the first answer on each connection.
async fn tampering_relay(upstream: String, how: Tamper) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (down, _) = l.accept().await.unwrap();
            let up = TcpStream::connect(&upstream).await.unwrap();
            let (mut down_r, mut down_w) = down.into_split();
            let (mut up_r, mut up_w) = up.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut down_r, &mut up_w).await });
            tokio::spawn(async move {
                let (mut head, mut target, mut pos, mut buf) =
                    (Vec::new(), None::<usize>, 0usize, vec![0u8; 64 << 10]);
                loop {
                    let n = match up_r.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let mut data = if target.is_none() {
                        head.extend_from_slice(&buf[..n]);
                        let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        target = Some(match how {
                            Tamper::BodyByte => end + 4 + 10,
                            Tamper::HashHeader => {
                                head.windows(17)
                                    .position(|w| w == b"x-sluice-blake3: ")
                                    .unwrap()
                                    + 17
                            }
                            Tamper::ReadBackMark => {
                                head.windows(18)
                                    .position(|w| w == b"x-sluice-read-back")
                                    .unwrap()
                                    + 17
                            }
                        });
                        std::mem::take(&mut head)
                    } else {
                        buf[..n].to_vec()
                    };
                    if let Some(t) = target.filter(|t| (pos..pos + data.len()).contains(t)) {
                        let b = &mut data[t - pos];
                        *b = match how {
                            Tamper::BodyByte => *b ^ 1,
                            Tamper::HashHeader if *b == b'0' => b'1',
                            Tamper::HashHeader => b'0',
                            Tamper::ReadBackMark => b'x',
                        };
                    }
                    pos += data.len();
                    if down_w.write_all(&data).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_relay_that_changes_a_byte_is_detected() {
    let (r, _src, unit, bytes) = one_unit().await;
    let c = PeerClient::new("n2", client_cfg());
    let relay = tampering_relay(r.addr.clone(), Tamper::BodyByte).await;
    let e = c.fetch(&relay, &key(), &unit).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Corrupt { what, .. } if what.contains("BLAKE3")),
        "{e}"
    );
    // Changing the hash to match the changed body needs the job key: the MAC catches it.
    let relay = tampering_relay(r.addr.clone(), Tamper::HashHeader).await;
    let e = c.fetch(&relay, &key(), &unit).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Corrupt { what, .. } if what.contains("MAC")),
        "{e}"
    );
    // Re-fetched directly, the unit is intact.
    assert_eq!(c.fetch(&r.addr, &key(), &unit).await.unwrap(), bytes);
}

/// Where [`PeerClient::fetch_into`] puts a unit in these tests: memory.
#[derive(Default)]
struct VecSink(Vec<u8>);

#[async_trait::async_trait]
impl UnitSink for VecSink {
    async fn write(
        &mut self,
        bytes: Bytes,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.extend_from_slice(&bytes);
        Ok(())
    }

    async fn finish(&mut self) -> Result<blake3::Hash, Box<dyn std::error::Error + Send + Sync>> {
        Ok(blake3::hash(&self.0))
    }
}

/// Issue 24: a unit whose hash its owner read back from a staged copy (a node whose agent
/// restarted serves what it kept so) arrives marked as such, which keeps it out of the
/// requester's cache; the mark cannot be taken off on the way (the MAC covers it).
#[tokio::test]
async fn a_read_back_unit_arrives_marked_and_the_mark_cannot_be_stripped() {
    let (r, src, unit, bytes) = one_unit().await;
    let c = PeerClient::new("n2", client_cfg());
    let fetched = || async {
        let mut sink = VecSink::default();
        let from = c.fetch_into(&r.addr, &key(), &unit, &mut sink).await;
        (from.unwrap(), sink.0)
    };
    assert_eq!(fetched().await, (HashFrom::Origin, bytes.to_vec()));
    let data = UnitData {
        hash: blake3::hash(&bytes),
        bytes: bytes.clone(),
        from: HashFrom::ReadBack,
    };
    lock(&src.units).insert(unit.clone(), Ok(data));
    assert_eq!(fetched().await, (HashFrom::ReadBack, bytes.to_vec()));
    let relay = tampering_relay(r.addr.clone(), Tamper::ReadBackMark).await;
    let e = c
        .fetch_into(&relay, &key(), &unit, &mut VecSink::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, PeerError::Corrupt { what, .. } if what.contains("MAC")),
        "{e}"
    );
}

/// A `200 OK` whose head says `len` bytes hashing to `hash` under the MAC `mac` (hex), then
/// `body` (which a fake may cut short).
fn ok_response(len: usize, hash: &str, mac: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {len}\r\nx-sluice-blake3: {hash}\r\nx-sluice-mac: {mac}\r\n\r\n"
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// A process that is not an agent listening where a peer should be: answers every request with
/// `answer(request head)` and closes.
async fn fake_server(answer: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            let answer = answer.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = s.write_all(&answer(&String::from_utf8_lossy(&head))).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_forged_server_on_the_peer_port_cannot_plant_data_or_stall_a_fetch() {
    let unit = Unit::new("f", 0, 16);
    let c = PeerClient::new("n2", client_cfg());
    // Plausible data with its true hash, but without the job key for the MAC.
    let evil = b"EVIL-EVIL-EVIL!!".to_vec();
    let hash = blake3::hash(&evil).to_hex().to_string();
    let mac = blake3::hash(b"guess").to_hex().to_string();
    let addr = fake_server(move |_| ok_response(16, &hash, &mac, &evil)).await;
    let e = c.fetch(&addr, &key(), &unit).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Corrupt { what, .. } if what.contains("MAC")),
        "{e}"
    );
    // "Pending" without a MAC would keep the fetch waiting: it is refused as corrupt at once.
    let addr = fake_server(|_| {
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 7\r\n\r\npending".to_vec()
    })
    .await;
    let t = tokio::time::Instant::now();
    let e = c.fetch(&addr, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Corrupt { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn a_peer_that_dies_mid_transfer_is_unreachable_not_corrupt() {
    let unit = Unit::new("f", 0, 4000);
    let c = PeerClient::new("n2", client_cfg());
    // The agent of the job (it has the key) sends a correct head, then half the body, and dies.
    let body = content(4000, 3);
    let hash = blake3::hash(&body);
    let addr = fake_server(move |head| {
        let line = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap()
                .trim()
                .to_string()
        };
        let pq = head.split(' ').nth(1).unwrap().to_string();
        let req_mac = key().request_mac(
            "GET",
            &pq,
            &line("x-sluice-node:"),
            line("x-sluice-time:").parse().unwrap(),
        );
        let u = super::server::parse_query(pq.split_once('?').unwrap().1).unwrap();
        let mac = key().response_mac(200, &u, Some(&hash), b"", &req_mac);
        ok_response(4000, &hash.to_hex(), &mac.to_hex(), &body[..2000])
    })
    .await;
    let e = c.fetch(&addr, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Unreachable { .. }), "{e}");
    // Nobody listening at all.
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().to_string()
    };
    let e = c.fetch(&closed, &key(), &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Unreachable { .. }), "{e}");
}

async fn wait_until(what: &str, f: impl Fn() -> bool) {
    let t = tokio::time::Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn the_server_holds_at_most_concurrency_unit_responses() {
    let mut cfg = server_cfg();
    cfg.concurrency = 2;
    let r = start(cfg).await;
    let gate = Arc::new(Semaphore::new(0));
    let src = Arc::new(MemSource {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    register(&r.server, &src);
    let units: Vec<Unit> = units_of("many", 6 * UNIT, UNIT);
    for (i, u) in units.iter().enumerate() {
        src.put(u, content(UNIT as usize, i as u8));
    }
    let c = Arc::new(PeerClient::new("n2", client_cfg()));
    let fetches: Vec<_> = units
        .iter()
        .map(|u| {
            let (c, a, u) = (c.clone(), r.addr.clone(), u.clone());
            tokio::spawn(async move { c.fetch(&a, &key(), &u).await })
        })
        .collect();
    wait_until("two responses start", || {
        src.entered.load(Ordering::SeqCst) == 2
    })
    .await;
    // Several poll windows later, the other four still wait for a slot.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(src.entered.load(Ordering::SeqCst), 2);
    assert_eq!(r.server.responses_in_flight(), 2);
    gate.add_permits(units.len());
    for (i, f) in fetches.into_iter().enumerate() {
        assert_eq!(f.await.unwrap().unwrap(), content(UNIT as usize, i as u8));
    }
    assert_eq!(src.max_active.load(Ordering::SeqCst), 2);
    wait_until("every slot returned", || {
        r.server.responses_in_flight() == 0
    })
    .await;
}

#[tokio::test]
async fn the_client_holds_at_most_concurrency_fetches() {
    let (r, src) = serving(server_cfg()).await;
    let mut cfg = client_cfg();
    cfg.concurrency = 1;
    let c = Arc::new(PeerClient::new("n2", cfg));
    let slow = Unit::new("slow", 0, 100);
    let ready = Unit::new("ready", 0, 100);
    src.put(&ready, content(100, 1));
    let (c1, a1, u1) = (c.clone(), r.addr.clone(), slow.clone());
    let first = tokio::spawn(async move { c1.fetch(&a1, &key(), &u1).await });
    wait_until("the first fetch waits at the server", || {
        src.asked.load(Ordering::SeqCst) == 1
    })
    .await;
    let (c2, a2, u2) = (c.clone(), r.addr.clone(), ready.clone());
    let second = tokio::spawn(async move { c2.fetch(&a2, &key(), &u2).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!second.is_finished(), "the one fetch slot is taken");
    src.put(&slow, content(100, 2));
    assert_eq!(first.await.unwrap().unwrap(), content(100, 2));
    assert_eq!(second.await.unwrap().unwrap(), content(100, 1));
}

#[tokio::test]
async fn a_unit_of_many_slices_arrives_whole() {
    let big = (3 << 20) + 5;
    let mut cfg = server_cfg();
    cfg.max_unit = 4 << 20;
    let (r, src) = serving(cfg).await;
    let unit = Unit::new("big", 4 << 20, big);
    let bytes = content(big as usize, 5);
    src.put(&unit, bytes.clone());
    let mut ccfg = client_cfg();
    ccfg.max_unit = 4 << 20;
    let c = PeerClient::new("n1", ccfg);
    assert_eq!(c.fetch(&r.addr, &key(), &unit).await.unwrap(), bytes);
    wait_until("the response slot is back", || {
        r.server.responses_in_flight() == 0
    })
    .await;
}

#[tokio::test]
async fn the_peer_service_runs_and_stops_as_an_agent_worker() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = PeerServer::new(secret(), server_cfg());
    let src = Arc::new(MemSource::default());
    let unit = Unit::new("f", 0, 5);
    src.put(&unit, content(5, 0));
    register(&server, &src);
    let (tracker, cancel) = (
        tokio_util::task::TaskTracker::new(),
        CancellationToken::new(),
    );
    let workers = sluice_core::worker::Workers::new(tracker.clone(), cancel.clone());
    workers.spawn(PeerService {
        server: server.clone(),
        listener,
    });
    let c = PeerClient::new("n2", client_cfg());
    // The node's own key for the job comes from the server's secret.
    let k = server.job_key(JOB, &names(&["n2", "n1"]));
    assert_eq!(c.fetch(&addr, &k, &unit).await.unwrap(), content(5, 0));
    let s = workers.statuses();
    assert_eq!(s[0].name, format!("peer server {addr}"));
    assert_eq!(s[0].state, "serving");
    cancel.cancel();
    tracker.close();
    tokio::time::timeout(Duration::from_secs(2), tracker.wait())
        .await
        .expect("the peer server stops with the agent");
    let e = c.fetch(&addr, &k, &unit).await.unwrap_err();
    assert!(matches!(e, PeerError::Unreachable { .. }), "{e}");
}

#[test]
fn the_peer_section_configures_both_sides() {
    let text = "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n\
                [peer]\nunit_size='32MiB'\nconcurrency=4\nread_timeout='10s'\n";
    let cfg =
        sluice_core::config::Config::parse(text, "n1", sluice_archive::upload_memory).unwrap();
    let p = cfg.peer.as_ref().unwrap();
    let s = ServerConfig::from_config(p);
    assert_eq!((s.concurrency, s.max_unit), (4, 32 << 20));
    let c = ClientConfig::from_config(p, cfg.stage.timeout);
    assert_eq!((c.concurrency, c.max_unit), (4, 32 << 20));
    assert_eq!(c.read_timeout, Duration::from_secs(10));
    assert_eq!(c.max_wait, cfg.stage.timeout);
    assert_eq!(
        c.poll, s.poll,
        "the client waits as long as the server holds a poll"
    );
}

/// Reads from `s` until the server closes it; panics unless that happens within `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) {
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(within, s.read(&mut buf))
        .await
        .expect("the server closes the connection")
        .unwrap_or(0);
    assert_eq!(n, 0, "nothing is sent on a connection without a request");
}

#[tokio::test]
async fn idle_and_excess_connections_are_closed() {
    let mut cfg = server_cfg();
    cfg.idle_timeout = Duration::from_secs(1);
    cfg.max_connections = 2;
    let r = start(cfg).await;
    let mut idle = [
        TcpStream::connect(&r.addr).await.unwrap(),
        TcpStream::connect(&r.addr).await.unwrap(),
    ];
    // Both slots taken: a third connection is closed at once.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut third = TcpStream::connect(&r.addr).await.unwrap();
    closed_within(&mut third, Duration::from_millis(500)).await;
    // Connections that send no request are closed after the idle timeout, freeing the slots.
    for s in &mut idle {
        closed_within(s, Duration::from_secs(3)).await;
    }
    let (status, _) = raw_get(&r.addr, "/v1/jobs/1/units", &[]).await;
    assert_eq!(status, 401, "a slot is free again");
}

/// What an admin warm on the fake node does: the URL it was asked, answered with a report, or a
/// failure for a URL under `fail/`.
struct FakeWarm {
    asked: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl AdminSource for FakeWarm {
    async fn warm(&self, url: &str) -> Result<sluice_proto::msg::CacheWarmed, String> {
        lock(&self.asked).push(url.to_string());
        if url.contains("/fail/") {
            return Err(format!("dataset {url} not found"));
        }
        Ok(sluice_proto::msg::CacheWarmed {
            node: "n2".into(),
            url: url.into(),
            files: 3,
            bytes: 300,
            cached_files: 1,
            cached_bytes: 100,
            filled_files: 2,
            filled_bytes: 200,
            skipped: Vec::new(),
        })
    }
}

/// An admin warm under the cluster secret's admin key reaches the agent's warm and brings back its
/// report or its reason; a job's key, another secret, a user's raw request or a GET warm nothing.
#[tokio::test]
async fn admin_warms_need_the_admin_key_and_bring_back_the_report() {
    let r = start(server_cfg()).await;
    let client = PeerClient::new("n1", client_cfg());
    let wait = Duration::from_secs(5);
    let url = "s3://b/ds & more";
    // No admin source yet: refused, nothing run.
    let e = client
        .admin_warm(&r.addr, &secret().admin_key(), url, wait)
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 404, .. }), "{e}");
    let fake = Arc::new(FakeWarm {
        asked: Mutex::new(Vec::new()),
    });
    r.server.serve_admin(fake.clone());
    let w = client
        .admin_warm(&r.addr, &secret().admin_key(), url, wait)
        .await
        .unwrap();
    assert_eq!((w.url.as_str(), w.filled_bytes), (url, 200));
    let e = client
        .admin_warm(&r.addr, &secret().admin_key(), "s3://b/fail/x", wait)
        .await
        .unwrap_err();
    assert!(
        matches!(&e, PeerError::Failed { reason, .. } if reason == "dataset s3://b/fail/x not found"),
        "{e}"
    );
    let other = ClusterSecret::from_bytes(*b"another secret, 32 bytes long!!!").admin_key();
    let e = client
        .admin_warm(&r.addr, &other, url, wait)
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 401, .. }), "{e}");
    assert_eq!(
        *lock(&fake.asked),
        [url.to_string(), "s3://b/fail/x".to_string()],
        "only the requests under the admin key were run"
    );
    // A job key's MAC on the admin path, and a GET, by hand.
    let job = secret().job_key(JOB, &names(&["n1", "n2"]));
    let pq = "/v1/admin/cache/warm?url=s3%3A%2F%2Fb%2Fds";
    for (method, mac) in [
        ("POST", job.request_mac("POST", pq, "n1", now_secs())),
        (
            "GET",
            secret()
                .admin_key()
                .request_mac("GET", pq, "n1", now_secs()),
        ),
    ] {
        let mut s = TcpStream::connect(&r.addr).await.unwrap();
        let req = format!(
            "{method} {pq} HTTP/1.1\r\nhost: x\r\nx-sluice-node: n1\r\nx-sluice-time: {}\r\n\
             x-sluice-mac: {}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            now_secs(),
            mac.to_hex()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        let want = if method == "GET" { "405" } else { "401" };
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {want}")),
            "{method}: {answer}"
        );
    }
    assert_eq!(lock(&fake.asked).len(), 2);
}

/// The shared tier's liveness probe: an agent that serves the job answers it (whatever it is
/// still reading), and only no agent at all reads as unreachable; an ended job reads as gone.
#[tokio::test]
async fn a_liveness_probe_tells_a_live_agent_from_a_dead_one() {
    let (r, _src) = serving(server_cfg()).await;
    let c = PeerClient::new("n2", client_cfg());
    let wait = Duration::from_secs(2);
    // The source never holds the probe's unit: the server's long poll ends in "pending", alive.
    c.probe_alive(&r.addr, &key(), wait).await.unwrap();
    // Another node list is another key: refused, which is an agent and not a dead one.
    let other = secret().job_key(JOB, &names(&["n1", "n3"]));
    let e = c.probe_alive(&r.addr, &other, wait).await.unwrap_err();
    assert!(matches!(e, PeerError::Refused { .. }), "{e}");
    r.server.unregister(JOB);
    let e = c.probe_alive(&r.addr, &key(), wait).await.unwrap_err();
    assert!(matches!(e, PeerError::Gone { job: JOB, .. }), "{e}");
    // The agent gone: nothing listens on its port.
    let addr = r.addr.clone();
    drop(r);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let e = c.probe_alive(&addr, &key(), wait).await.unwrap_err();
    assert!(matches!(e, PeerError::Unreachable { .. }), "{e}");
}

/// "The job ended here" takes a node out of the shared tier's count of the living: only a 410
/// MAC'd for the probe says so. Anyone who can reach the port (a user's process that took it, a
/// relay) can send a bare 410.
#[tokio::test]
async fn an_unsigned_gone_is_no_evidence_that_an_agent_is_dead() {
    let c = PeerClient::new("n2", client_cfg());
    let wait = Duration::from_secs(2);
    let forged =
        fake_server(|_| b"HTTP/1.1 410 Gone\r\ncontent-length: 8\r\n\r\njob gone".to_vec()).await;
    let e = c.probe_alive(&forged, &key(), wait).await.unwrap_err();
    assert!(
        matches!(e, PeerError::Refused { status: 410, .. }),
        "a bare 410 is a refusal, not the job's end: {e}"
    );
    assert!(!e.proves_gone(), "{e}");
    // A real agent's 410 for a job that ended there is MAC'd for the request: believed.
    let (r, _src) = serving(server_cfg()).await;
    r.server.unregister(JOB);
    let e = c.probe_alive(&r.addr, &key(), wait).await.unwrap_err();
    assert!(
        matches!(e, PeerError::Gone { job: JOB, .. }) && e.proves_gone(),
        "{e}"
    );
    // Asked under another key (another node list), the ended job's 410 cannot be MAC'd for it.
    let other = secret().job_key(JOB, &names(&["n1", "n3"]));
    let e = c.probe_alive(&r.addr, &other, wait).await.unwrap_err();
    assert!(!e.proves_gone(), "{e}");
}

/// Opens `n` connections to `addr` from `source` (another loopback address stands for another
/// node) and holds them, sending nothing: a user's flood of the peer port.
async fn flood(addr: &str, source: &str, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{source}:0").parse().unwrap()).unwrap();
        held.push(s.connect(addr.parse().unwrap()).await.unwrap());
    }
    // Let the server's accept loop take them all.
    tokio::time::sleep(Duration::from_millis(200)).await;
    held
}

/// More connections than the server takes in all, from one address: the job's agents on other
/// addresses still get in, and one on the flooding address finds its connection closed, which is
/// no evidence that the agent is gone.
#[tokio::test]
async fn a_flood_of_connections_from_one_address_does_not_make_a_live_agent_look_dead() {
    let (r, _src) = serving(server_cfg()).await;
    let wait = Duration::from_secs(2);
    let _flood = flood(&r.addr, "127.0.0.2", 2 * server_cfg().max_connections).await;
    PeerClient::new("n2", client_cfg())
        .probe_alive(&r.addr, &key(), wait)
        .await
        .expect("the agent is alive and answers a node the flood does not come from");
    // From the flooding address itself (a user on the prober's node) the probe is turned away,
    // and that does not read as a dead agent.
    let _more = flood(&r.addr, "127.0.0.1", server_cfg().max_per_source).await;
    let e = PeerClient::new("n2", client_cfg())
        .probe_alive(&r.addr, &key(), wait)
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Dropped { .. }), "{e}");
    assert!(!e.proves_gone(), "{e}");
}

/// A flood of unauthenticated requests costs the log one line per period, which counts the rest.
#[tokio::test]
async fn refusals_are_logged_at_a_bounded_rate() {
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let lines = Lines::default();
    let w = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || w.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    // This test's runtime has one thread: the server's tasks log through this subscriber.
    let _log = tracing::subscriber::set_default(subscriber);
    let r = start(server_cfg()).await;
    for _ in 0..50 {
        let (status, _) = raw_get(
            &r.addr,
            &format!("/v1/jobs/{JOB}/units?file=f&offset=0&len=1"),
            &[],
        )
        .await;
        assert_eq!(status, 401);
    }
    let text = String::from_utf8(lock(&lines.0).clone()).unwrap();
    let refused: Vec<&str> = text.lines().filter(|l| l.contains("refused")).collect();
    assert_eq!(refused.len(), 1, "{text}");
    assert!(refused[0].contains("unauthenticated"), "{text}");
}

/// An agent whose peer port another process took at start does not give peers up: it serves as
/// soon as the port is free, and says in its status why it does not yet.
#[tokio::test]
async fn an_agent_whose_port_was_taken_serves_once_it_is_free() {
    let squatter = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = squatter.local_addr().unwrap().to_string();
    let error = crate::PeerServerError::Listen {
        addr: addr.clone(),
        source: TcpListener::bind(&addr).await.unwrap_err(),
    };
    let server = PeerServer::new(secret(), server_cfg());
    let src = Arc::new(MemSource::default());
    register(&server, &src);
    let (tracker, cancel) = (
        tokio_util::task::TaskTracker::new(),
        CancellationToken::new(),
    );
    let workers = sluice_core::worker::Workers::new(tracker.clone(), cancel.clone());
    workers.spawn(PeerWorker::Rebinding(PeerRebind {
        server,
        listen: addr.clone(),
        error,
        every: Duration::from_millis(100),
    }));
    tokio::time::sleep(Duration::from_millis(250)).await;
    let s = workers.statuses();
    assert_eq!(s[0].state, "port taken, retrying");
    assert!(
        s[0].last_error
            .as_deref()
            .unwrap_or("")
            .contains("cannot listen for peers"),
        "{s:?}"
    );
    drop(squatter);
    let c = PeerClient::new("n2", client_cfg());
    let t = tokio::time::Instant::now();
    while c
        .probe_alive(&addr, &key(), Duration::from_secs(1))
        .await
        .is_err()
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the port was never bound"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(workers.statuses()[0].state, "serving");
    cancel.cancel();
    tracker.close();
    tracker.wait().await;
}

// ---- Replicas (issue 26): a node's part of a checkpoint, pushed to another node of the job ----

/// The agent's replica area in memory: files stored per part, parts sealed with their lists,
/// `room` bytes in all. Checks what a [`ReplicaStore`] must check (tag, path, size, hash).
struct MemReplicas {
    room: u64,
    state: Mutex<ReplicaState>,
}

#[derive(Default)]
struct ReplicaState {
    stored: HashMap<PartKey, HashMap<String, (ReplicaFile, Bytes)>>,
    sealed: HashMap<PartKey, ReplicaSeal>,
}

impl MemReplicas {
    fn new(room: u64) -> Arc<MemReplicas> {
        Arc::new(MemReplicas {
            room,
            state: Mutex::new(ReplicaState::default()),
        })
    }

    fn used(&self) -> u64 {
        lock(&self.state)
            .stored
            .values()
            .flat_map(|files| files.values())
            .map(|(f, _)| f.size)
            .sum()
    }

    /// Every file stored, sealed or not, as `from/tag/path`.
    fn held(&self) -> Vec<String> {
        let st = lock(&self.state);
        let mut held: Vec<String> = st
            .stored
            .iter()
            .flat_map(|(k, files)| {
                files
                    .keys()
                    .map(move |p| format!("{}/{}/{p}", k.from, k.tag))
            })
            .collect();
        held.sort();
        held
    }
}

#[async_trait::async_trait]
impl ReplicaStore for MemReplicas {
    async fn put_file(
        &self,
        part: &PartKey,
        file: &ReplicaFile,
        mut body: replica::Incoming,
    ) -> Result<(), ReplicaRefusal> {
        use futures::StreamExt;
        replica::check_tag(&part.tag)?;
        replica::check_path(&file.path)?;
        let free = self.room - self.used();
        if file.size > free {
            return Err(ReplicaRefusal::NoRoom {
                need: file.size,
                free,
            });
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| ReplicaRefusal::Mismatch(format!("cut short: {e}")))?;
            bytes.extend_from_slice(&chunk);
        }
        if bytes.len() as u64 != file.size {
            return Err(ReplicaRefusal::Mismatch(format!(
                "{} bytes came, {} were announced",
                bytes.len(),
                file.size
            )));
        }
        if blake3::hash(&bytes).to_hex().as_str() != file.blake3 {
            return Err(ReplicaRefusal::Mismatch(
                "the bytes do not hash to the announced BLAKE3".into(),
            ));
        }
        lock(&self.state)
            .stored
            .entry(part.clone())
            .or_default()
            .insert(file.path.clone(), (file.clone(), bytes.into()));
        Ok(())
    }

    async fn seal(&self, part: &PartKey, seal: &ReplicaSeal) -> Result<(), ReplicaRefusal> {
        replica::check_seal(&part.from, &seal.files, &seal.nodes)?;
        let files = &seal.files;
        let mut st = lock(&self.state);
        let stored = st.stored.entry(part.clone()).or_default();
        for f in files {
            if stored.get(&f.path).map(|(s, _)| s) != Some(f) {
                return Err(ReplicaRefusal::Mismatch(format!(
                    "{} was not stored",
                    f.path
                )));
            }
        }
        stored.retain(|p, _| files.iter().any(|f| &f.path == p));
        st.sealed.insert(part.clone(), seal.clone());
        Ok(())
    }

    async fn index(&self, job: sluice_proto::msg::JobId) -> Vec<ReplicaPart> {
        let mut parts: Vec<ReplicaPart> = lock(&self.state)
            .sealed
            .iter()
            .filter(|(k, _)| k.job == job)
            .map(|(k, seal)| ReplicaPart {
                from: k.from.clone(),
                tag: k.tag.clone(),
                files: seal.files.clone(),
                nodes: seal.nodes.clone(),
                committed_at: seal.committed_at,
                archived: false,
            })
            .collect();
        parts.sort_by(|a, b| (&a.from, &a.tag).cmp(&(&b.from, &b.tag)));
        parts
    }

    fn room(&self) -> (u64, u64) {
        (self.room.saturating_sub(self.used()), self.room)
    }

    async fn file(&self, part: &PartKey, path: &str) -> Option<UnitStream> {
        let st = lock(&self.state);
        st.sealed.get(part)?;
        let (_, bytes) = st.stored.get(part)?.get(path)?;
        Some(UnitStream::from(UnitData {
            hash: blake3::hash(bytes),
            bytes: bytes.clone(),
            from: HashFrom::Origin,
        }))
    }

    async fn free(&self, part: &PartKey) {
        let mut st = lock(&self.state);
        st.stored.remove(part);
        st.sealed.remove(part);
    }
}

/// The nodes of the replica tests' job.
const REPLICA_NODES: &[&str] = &["n1", "n2", "n3"];

fn rkey() -> JobKey {
    secret().job_key(JOB, &names(REPLICA_NODES))
}

/// A server of job JOB on n1, n2, n3 that keeps no replicas and takes no job events.
async fn bare() -> Running {
    let r = start(server_cfg()).await;
    r.server.register(
        JOB,
        &names(REPLICA_NODES),
        Arc::new(MemSource::default()) as Arc<dyn UnitSource>,
    );
    r
}

/// A server of job JOB on n1, n2, n3 that keeps replicas in a store of `room` bytes.
async fn holding(room: u64) -> (Running, Arc<MemReplicas>) {
    let r = bare().await;
    let store = MemReplicas::new(room);
    r.server.serve_replicas(store.clone());
    (r, store)
}

/// When the replica tests' checkpoints were committed.
const COMMITTED_AT: u64 = 1_750_000_000;

/// The seal of a part of `files`, committed by a run of the replica tests' job.
fn seal_of(files: &[ReplicaFile]) -> ReplicaSeal {
    ReplicaSeal {
        files: files.to_vec(),
        nodes: names(REPLICA_NODES),
        committed_at: COMMITTED_AT,
    }
}

/// A file of a part, described as its sender would.
fn replica_file(path: &str, bytes: &Bytes) -> ReplicaFile {
    ReplicaFile {
        path: path.into(),
        size: bytes.len() as u64,
        blake3: blake3::hash(bytes).to_hex().to_string(),
    }
}

/// `bytes` as a push body, in slices of at most 1000 bytes.
fn chunks(bytes: Bytes) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let slices: Vec<_> = (0..bytes.len())
        .step_by(1000)
        .map(|at| Ok(bytes.slice(at..(at + 1000).min(bytes.len()))))
        .collect();
    futures::stream::iter(slices)
}

/// `node` pushes each of `files` to `addr` as its part of `tag`, and seals the part with them.
async fn push_and_seal(node: &str, addr: &str, tag: &str, files: &[(ReplicaFile, Bytes)]) {
    let c = PeerClient::new(node, client_cfg());
    for (f, b) in files {
        c.push_replica(addr, &rkey(), tag, f, chunks(b.clone()))
            .await
            .unwrap();
    }
    let list: Vec<ReplicaFile> = files.iter().map(|(f, _)| f.clone()).collect();
    c.seal_replica(addr, &rkey(), tag, &seal_of(&list))
        .await
        .unwrap();
}

/// A holder (1 MiB of room) of `s1`'s part `model.pt` (`len` bytes of `content(len, seed)`) of
/// each of `nodes`, pushed and sealed; with that file and its bytes.
async fn holding_s1(
    nodes: &[&str],
    len: usize,
    seed: u8,
) -> (Running, Arc<MemReplicas>, ReplicaFile, Bytes) {
    let (r, store) = holding(1 << 20).await;
    let bytes = content(len, seed);
    let f = replica_file("model.pt", &bytes);
    for node in nodes {
        push_and_seal(node, &r.addr, "s1", &[(f.clone(), bytes.clone())]).await;
    }
    (r, store, f, bytes)
}

/// A signed request sent by hand (`method`, `pq`, extra headers, `body`), as the node `node`
/// under `key`; returns the status and the body of the answer.
async fn raw_signed(
    addr: &str,
    key: &JobKey,
    node: &str,
    method: &str,
    pq: &str,
    extra: &[(&str, String)],
    body: &[u8],
) -> (u16, Vec<u8>) {
    let time = now_secs();
    let mac = key.request_mac(method, pq, node, time);
    let mut head = format!(
        "{method} {pq} HTTP/1.1\r\nhost: {addr}\r\nx-sluice-node: {node}\r\nx-sluice-time: {time}\r\nx-sluice-mac: {}\r\n",
        mac.to_hex()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("connection: close\r\n\r\n");
    let s = TcpStream::connect(addr).await.unwrap();
    let (mut read, mut write) = s.into_split();
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    // Written apart from the read: the server may answer before it read the whole body.
    let writer = tokio::spawn(async move {
        let _ = write.write_all(&out).await;
        write
    });
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut answer))
        .await
        .expect("the server answers and closes")
        .unwrap();
    drop(writer.await);
    let end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let status = std::str::from_utf8(&answer[9..12])
        .unwrap()
        .parse()
        .unwrap();
    (status, answer[end + 4..].to_vec())
}

/// A request of n2's under the job key that the server must refuse as malformed (`400`), saying
/// `says`.
async fn assert_bad_request(
    r: &Running,
    method: &str,
    pq: &str,
    headers: &[(&str, String)],
    body: &[u8],
    says: &str,
) {
    let (status, body) = raw_signed(&r.addr, &rkey(), "n2", method, pq, headers, body).await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 400, "{method} {pq}: {text}");
    assert!(text.contains(says), "{method} {pq}: {text}");
}

/// Issue 26: n2 pushes its part of checkpoint s1 to n1 and seals it, n3 seals an empty part;
/// any node reads n1's index and takes the files back, whole; n2 frees its part.
#[tokio::test]
async fn replicas_are_pushed_sealed_listed_fetched_and_freed() {
    let (r, store) = holding(1 << 20).await;
    let (n2, n3, n1) = (
        PeerClient::new("n2", client_cfg()),
        PeerClient::new("n3", client_cfg()),
        PeerClient::new("n1", client_cfg()),
    );
    let files: Vec<(ReplicaFile, Bytes)> = [
        ("model.pt", content(5000, 1)),
        ("sub/dir/optim state.pt", content(0, 0)),
        (".metadata", content(10, 2)),
    ]
    .into_iter()
    .map(|(p, b)| (replica_file(p, &b), b))
    .collect();
    for (f, b) in &files {
        n2.push_replica(&r.addr, &rkey(), "s1", f, chunks(b.clone()))
            .await
            .unwrap();
    }
    assert_eq!(
        n1.replica_index(&r.addr, &rkey()).await.unwrap(),
        vec![],
        "an unsealed part is not listed"
    );
    let list: Vec<ReplicaFile> = files.iter().map(|(f, _)| f.clone()).collect();
    n2.seal_replica(&r.addr, &rkey(), "s1", &seal_of(&list))
        .await
        .unwrap();
    n3.seal_replica(&r.addr, &rkey(), "s1", &seal_of(&[]))
        .await
        .unwrap();
    let index = n1.replica_index(&r.addr, &rkey()).await.unwrap();
    assert_eq!(
        index,
        vec![
            ReplicaPart {
                from: "n2".into(),
                tag: "s1".into(),
                files: list.clone(),
                nodes: names(REPLICA_NODES),
                committed_at: COMMITTED_AT,
                archived: false,
            },
            ReplicaPart {
                from: "n3".into(),
                tag: "s1".into(),
                files: vec![],
                nodes: names(REPLICA_NODES),
                committed_at: COMMITTED_AT,
                archived: false,
            },
        ]
    );
    let part = PartKey {
        job: JOB,
        from: "n2".into(),
        tag: "s1".into(),
    };
    for (f, b) in &files {
        let mut sink = VecSink::default();
        let got = n1
            .fetch_replica_into(&r.addr, &rkey(), &part, f, &mut sink)
            .await
            .unwrap();
        assert_eq!((got, sink.0.as_slice()), (b.len() as u64, b.as_ref()));
    }
    n2.free_replica(&r.addr, &rkey(), "s1").await.unwrap();
    let index = n1.replica_index(&r.addr, &rkey()).await.unwrap();
    assert_eq!(
        index.iter().map(|p| p.from.as_str()).collect::<Vec<_>>(),
        ["n3"]
    );
    assert_eq!(store.held(), Vec::<String>::new(), "n2's files are gone");
    let e = n1
        .fetch_replica_into(&r.addr, &rkey(), &part, &list[0], &mut VecSink::default())
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::NotHeld { .. }), "{e}");
    // Freeing what is not held is no error.
    n2.free_replica(&r.addr, &rkey(), "s1").await.unwrap();
}

/// A node outside the job (even with the job's key) and an agent under another cluster secret
/// can neither push, seal, list, fetch nor free; the store keeps nothing of them.
#[tokio::test]
async fn replica_requests_without_the_job_key_or_from_outside_the_job_are_refused() {
    let (r, store, f, bytes) = holding_s1(&["n2"], 100, 3).await;
    let other = ClusterSecret::from_bytes([9u8; 32]).job_key(JOB, &names(REPLICA_NODES));
    let part = PartKey {
        job: JOB,
        from: "n2".into(),
        tag: "s1".into(),
    };
    for (who, client, key, want) in [
        (
            "n9, outside the job",
            PeerClient::new("n9", client_cfg()),
            rkey(),
            403,
        ),
        (
            "n3 under another secret",
            PeerClient::new("n3", client_cfg()),
            other,
            401,
        ),
    ] {
        let refused = |e: PeerError| {
            assert!(
                matches!(e, PeerError::Refused { status, .. } if status == want),
                "{who}: {e}"
            );
        };
        refused(
            client
                .push_replica(&r.addr, &key, "s2", &f, chunks(bytes.clone()))
                .await
                .unwrap_err(),
        );
        refused(
            client
                .seal_replica(&r.addr, &key, "s2", &seal_of(&[]))
                .await
                .unwrap_err(),
        );
        refused(client.replica_index(&r.addr, &key).await.unwrap_err());
        refused(client.replica_room(&r.addr, &key).await.unwrap_err());
        let mut sink = VecSink::default();
        refused(
            client
                .fetch_replica_into(&r.addr, &key, &part, &f, &mut sink)
                .await
                .unwrap_err(),
        );
        assert!(sink.0.is_empty(), "{who}: data in a refusal");
        refused(client.free_replica(&r.addr, &key, "s1").await.unwrap_err());
    }
    assert_eq!(store.held(), ["n2/s1/model.pt"], "nothing changed");
    assert_eq!(
        PeerClient::new("n1", client_cfg())
            .replica_index(&r.addr, &rkey())
            .await
            .unwrap()
            .len(),
        1
    );
}

/// `from` of a push, seal or free is the authenticated node: n2 freeing s1 frees n2's part and
/// never n3's, and a `from` parameter is no way around it.
#[tokio::test]
async fn a_node_frees_only_its_own_part() {
    let (r, store) = holding(1 << 20).await;
    let bytes = content(50, 4);
    let f = replica_file("f", &bytes);
    for node in ["n2", "n3"] {
        push_and_seal(node, &r.addr, "s1", &[(f.clone(), bytes.clone())]).await;
    }
    for (method, pq) in [
        ("DELETE", format!("/v1/jobs/{JOB}/replicas?tag=s1&from=n3")),
        (
            "POST",
            format!("/v1/jobs/{JOB}/replicas/seal?tag=s1&from=n3"),
        ),
    ] {
        let (status, body) = raw_signed(&r.addr, &rkey(), "n2", method, &pq, &[], b"[]").await;
        let text = String::from_utf8_lossy(&body);
        assert_eq!(status, 400, "{method} {pq}: {text}");
        assert!(text.contains("unknown query parameter 'from'"), "{text}");
    }
    PeerClient::new("n2", client_cfg())
        .free_replica(&r.addr, &rkey(), "s1")
        .await
        .unwrap();
    assert_eq!(store.held(), ["n3/s1/f"]);
    let index = PeerClient::new("n1", client_cfg())
        .replica_index(&r.addr, &rkey())
        .await
        .unwrap();
    assert_eq!(
        index.iter().map(|p| p.from.as_str()).collect::<Vec<_>>(),
        ["n3"]
    );
}

/// A push whose body is shorter or longer than its `size`, or does not hash to its `blake3`, is
/// refused, and the holder keeps nothing of it.
#[tokio::test]
async fn pushes_that_lie_about_their_bytes_are_refused_and_nothing_is_kept() {
    let (r, store) = holding(1 << 20).await;
    let n2 = PeerClient::new("n2", client_cfg());
    let bytes = content(3000, 5);
    let f = replica_file("model.pt", &bytes);
    for (what, body) in [
        ("shorter", bytes.slice(..2999)),
        ("longer", content(3001, 5)),
    ] {
        let e = n2
            .push_replica(&r.addr, &rkey(), "s1", &f, chunks(body))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, PeerError::PushSource { source, .. } if source.to_string().contains("3000")),
            "{what}: {e}"
        );
    }
    // An empty file whose source is not empty: nothing goes out.
    let e = n2
        .push_replica(
            &r.addr,
            &rkey(),
            "s1",
            &replica_file("empty", &Bytes::new()),
            chunks(content(1, 0)),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::PushSource { .. }), "{e}");
    let mut changed = bytes.to_vec();
    changed[1234] ^= 1;
    let e = n2
        .push_replica(&r.addr, &rkey(), "s1", &f, chunks(changed.into()))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, PeerError::ReplicaRefused { status: 409, reason, .. } if reason.contains("BLAKE3")),
        "{e}"
    );
    // By hand: a content-length that is not the size, and a body cut short of its length.
    let pq = format!(
        "/v1/jobs/{JOB}/replicas/file?tag=s1&file=model.pt&size=3000&blake3={}",
        f.blake3
    );
    let (status, body) = raw_signed(
        &r.addr,
        &rkey(),
        "n2",
        "PUT",
        &pq,
        &[("content-length", "2000".into())],
        &bytes[..2000],
    )
    .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    let time = now_secs();
    let mac = rkey().request_mac("PUT", &pq, "n2", time);
    let mut s = TcpStream::connect(&r.addr).await.unwrap();
    let head = format!(
        "PUT {pq} HTTP/1.1\r\nhost: x\r\nx-sluice-node: n2\r\nx-sluice-time: {time}\r\nx-sluice-mac: {}\r\ncontent-length: 3000\r\n\r\n",
        mac.to_hex()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&bytes[..1500]).await.unwrap();
    s.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert_eq!(store.held(), Vec::<String>::new(), "nothing kept");
    // The honest push, for comparison, is stored.
    n2.push_replica(&r.addr, &rkey(), "s1", &f, chunks(bytes))
        .await
        .unwrap();
    assert_eq!(store.held(), ["n2/s1/model.pt"]);
}

/// A holder without room says how much it lacks, and the sender hears it as `NoRoom` (the body it
/// had started to send is read and dropped, so the answer arrives).
#[tokio::test]
async fn a_holder_without_room_answers_no_room() {
    let (r, store) = holding(1000).await;
    let bytes = content(2 << 20, 6);
    let f = replica_file("big.pt", &bytes);
    let e = PeerClient::new("n2", client_cfg())
        .push_replica(&r.addr, &rkey(), "s1", &f, chunks(bytes))
        .await
        .unwrap_err();
    assert!(
        matches!(e, PeerError::NoRoom { need, free: 1000, .. } if need == 2 << 20),
        "{e}"
    );
    assert!(e.to_string().contains("no room"), "{e}");
    assert_eq!(store.held(), Vec::<String>::new());
}

/// A tag or path that could leave its directory, a malformed hash, an oversized or overlong seal
/// list: 400, and nothing reaches the store.
#[tokio::test]
async fn bad_tags_paths_and_seal_lists_are_refused() {
    let (r, store) = holding(1 << 20).await;
    let n2 = PeerClient::new("n2", client_cfg());
    let bytes = content(10, 7);
    for (tag, path) in [
        ("s1", "../escape"),
        ("s1", "/etc/passwd"),
        ("a/b", "f"),
        ("..", "f"),
    ] {
        let e = n2
            .push_replica(
                &r.addr,
                &rkey(),
                tag,
                &replica_file(path, &bytes),
                chunks(bytes.clone()),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(e, PeerError::Refused { status: 400, .. }),
            "{tag} {path}: {e}"
        );
    }
    let e = n2
        .seal_replica(&r.addr, &rkey(), "../s1", &seal_of(&[]))
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 400, .. }), "{e}");
    let e = n2
        .seal_replica(
            &r.addr,
            &rkey(),
            "s1",
            &seal_of(&[replica_file("a/../../b", &bytes)]),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, PeerError::ReplicaRefused { status: 400, .. }),
        "{e}"
    );
    // A node list that does not name its sender, is not sorted, names a node that could leave
    // its directory or one not of the job.
    for (nodes, why) in [
        (names(&["n1", "n3"]), "does not name its sender"),
        (names(&["n2", "n1"]), "not sorted"),
        (names(&["n1", "n2", "n2"]), "not sorted"),
        (names(&["../n1", "n2"]), "not a node name"),
        (names(&["n2", "n9"]), "not a node of job"),
    ] {
        let seal = ReplicaSeal {
            nodes: nodes.clone(),
            ..seal_of(&[])
        };
        let e = n2
            .seal_replica(&r.addr, &rkey(), "s1", &seal)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, PeerError::ReplicaRefused { status: 400, reason, .. } if reason.contains(why)),
            "{nodes:?}: {e}"
        );
    }
    // A file list longer than a seal body may be, refused from its content-length.
    let pq = format!("/v1/jobs/{JOB}/replicas/seal?tag=s1");
    assert_bad_request(
        &r,
        "POST",
        &pq,
        &[("content-length", (replica::MAX_SEAL_BODY + 1).to_string())],
        b"",
        "at most",
    )
    .await;
    // More files than a part may have, within the body's bound.
    let one = serde_json::to_string(&replica_file("f", &bytes)).unwrap();
    let list = format!(
        r#"{{"files":[{}],"nodes":["n1","n2","n3"],"committed_at":1}}"#,
        vec![one; replica::MAX_FILES + 1].join(",")
    );
    assert!(list.len() < replica::MAX_SEAL_BODY);
    assert_bad_request(
        &r,
        "POST",
        &pq,
        &[("content-length", list.len().to_string())],
        list.as_bytes(),
        "more than",
    )
    .await;
    // A bare file list (a seal without its nodes and commit time) is no seal.
    assert_bad_request(
        &r,
        "POST",
        &pq,
        &[("content-length", "2".into())],
        b"[]",
        "does not parse",
    )
    .await;
    // Methods a resource does not answer.
    let (status, _) = raw_signed(
        &r.addr,
        &rkey(),
        "n2",
        "PUT",
        &format!("/v1/jobs/{JOB}/units?file=a&offset=0&len=1"),
        &[("content-length", "0".into())],
        b"",
    )
    .await;
    assert_eq!(status, 405);
    assert_eq!(store.held(), Vec::<String>::new());
    assert_eq!(lock(&store.state).sealed.len(), 0);
}

/// A job not registered here is unknown (404) to replica requests as to units; a node whose
/// agent keeps no replicas answers 501, MAC'd.
#[tokio::test]
async fn replicas_of_an_unknown_job_or_on_a_node_without_a_store() {
    let (r, _store) = holding(1 << 20).await;
    let c = PeerClient::new("n2", client_cfg());
    let other = secret().job_key(JOB + 1, &names(REPLICA_NODES));
    let e = c.replica_index(&r.addr, &other).await.unwrap_err();
    assert!(
        matches!(e, PeerError::UnknownJob { job, .. } if job == JOB + 1),
        "{e}"
    );
    let bytes = content(10, 8);
    let e = c
        .push_replica(
            &r.addr,
            &other,
            "s1",
            &replica_file("f", &bytes),
            chunks(bytes.clone()),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::UnknownJob { .. }), "{e}");
    let bare = bare().await;
    let e = c.replica_index(&bare.addr, &rkey()).await.unwrap_err();
    assert!(
        matches!(&e, PeerError::Refused { status: 501, reason, .. } if reason.contains("no replicas")),
        "{e}"
    );
    // An ended job's replica requests are gone, MAC'd.
    r.server.unregister(JOB);
    let e = c.replica_index(&r.addr, &rkey()).await.unwrap_err();
    assert!(matches!(e, PeerError::Gone { job: JOB, .. }), "{e}");
}

/// The archive may hold a checkpoint only after its job ended on the holder: the sender still
/// frees its own part then (the one request an ended job is answered), and nothing else is
/// answered; under another secret, not even that.
#[tokio::test]
async fn a_node_frees_its_part_after_the_job_ended_on_the_holder() {
    let (r, store, _, _) = holding_s1(&["n2", "n3"], 100, 4).await;
    r.server.unregister(JOB);
    let forged = ClusterSecret::from_bytes([9u8; 32]).job_key(JOB, &names(REPLICA_NODES));
    let n2 = PeerClient::new("n2", client_cfg());
    assert!(n2.free_replica(&r.addr, &forged, "s1").await.is_err());
    let held = |from: &str| {
        let part = PartKey {
            job: JOB,
            from: from.into(),
            tag: "s1".into(),
        };
        store.state.lock().unwrap().sealed.contains_key(&part)
    };
    assert!(held("n2"), "a request under another secret freed n2's part");
    n2.free_replica(&r.addr, &rkey(), "s1").await.unwrap();
    assert!(!held("n2"), "n2's part is still held after its free");
    assert!(held("n3"), "n2's free freed n3's part");
    let e = n2.replica_index(&r.addr, &rkey()).await.unwrap_err();
    assert!(matches!(e, PeerError::Gone { job: JOB, .. }), "{e}");
}

/// A relay that changes a byte of the index, or of a fetched file, is caught: the index's MAC
/// covers its JSON, and a file must hash to what its part was sealed with.
#[tokio::test]
async fn a_relay_that_changes_a_replica_answer_is_detected() {
    let (r, _store, f, bytes) = holding_s1(&["n2"], 3000, 9).await;
    let n1 = PeerClient::new("n1", client_cfg());
    let relay = tampering_relay(r.addr.clone(), Tamper::BodyByte).await;
    let e = n1.replica_index(&relay, &rkey()).await.unwrap_err();
    assert!(matches!(e, PeerError::Corrupt { .. }), "{e}");
    // (The relay changes the first answer of each connection: a new one for each request.)
    let relay = tampering_relay(r.addr.clone(), Tamper::BodyByte).await;
    let part = PartKey {
        job: JOB,
        from: "n2".into(),
        tag: "s1".into(),
    };
    let e = n1
        .fetch_replica_into(&relay, &rkey(), &part, &f, &mut VecSink::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, PeerError::Corrupt { what, .. } if what.contains("BLAKE3")),
        "{e}"
    );
    let relay = tampering_relay(r.addr.clone(), Tamper::HashHeader).await;
    let e = n1
        .fetch_replica_into(&relay, &rkey(), &part, &f, &mut VecSink::default())
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Corrupt { .. }), "{e}");
    // A part of a node outside the job is nothing to ask the store about.
    let outside = PartKey {
        from: "../n2".into(),
        ..part.clone()
    };
    let e = n1
        .fetch_replica_into(&r.addr, &rkey(), &outside, &f, &mut VecSink::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, PeerError::ReplicaRefused { status: 400, reason, .. } if reason.contains("not a node")),
        "{e}"
    );
    // A file listed with another hash than the holder's copy is not taken.
    let mut wrong = f.clone();
    wrong.blake3 = blake3::hash(b"other").to_hex().to_string();
    let e = n1
        .fetch_replica_into(&r.addr, &rkey(), &part, &wrong, &mut VecSink::default())
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Corrupt { .. }), "{e}");
    // Directly, everything is intact.
    let mut sink = VecSink::default();
    n1.fetch_replica_into(&r.addr, &rkey(), &part, &f, &mut sink)
        .await
        .unwrap();
    assert_eq!(sink.0, bytes.to_vec());
    assert_eq!(n1.replica_index(&r.addr, &rkey()).await.unwrap().len(), 1);
}

/// Issue 26: a holder's free room, read before a push, falls as another node's part comes and
/// rises as it is freed; it is MAC'd like any answer.
#[tokio::test]
async fn a_holders_room_is_read_before_a_push_and_follows_pushes_and_frees() {
    let (r, _store) = holding(10_000).await;
    let (n1, n3) = (
        PeerClient::new("n1", client_cfg()),
        PeerClient::new("n3", client_cfg()),
    );
    assert_eq!(
        n1.replica_room(&r.addr, &rkey()).await.unwrap(),
        (10_000, 10_000)
    );
    let bytes = content(3000, 10);
    push_and_seal("n3", &r.addr, "s1", &[(replica_file("f", &bytes), bytes)]).await;
    assert_eq!(
        n1.replica_room(&r.addr, &rkey()).await.unwrap(),
        (7000, 10_000),
        "n3's part takes its room"
    );
    n3.free_replica(&r.addr, &rkey(), "s1").await.unwrap();
    assert_eq!(
        n1.replica_room(&r.addr, &rkey()).await.unwrap(),
        (10_000, 10_000)
    );
    let relay = tampering_relay(r.addr.clone(), Tamper::BodyByte).await;
    let e = n1.replica_room(&relay, &rkey()).await.unwrap_err();
    assert!(matches!(e, PeerError::Corrupt { .. }), "{e}");
    // Only GET, no parameter.
    let pq = format!("/v1/jobs/{JOB}/replicas/room");
    let (status, _) = raw_signed(
        &r.addr,
        &rkey(),
        "n1",
        "DELETE",
        &pq,
        &[("content-length", "0".into())],
        b"",
    )
    .await;
    assert_eq!(status, 405);
    let (status, body) = raw_signed(
        &r.addr,
        &rkey(),
        "n1",
        "GET",
        &format!("{pq}?x=1"),
        &[],
        b"",
    )
    .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    // A node without a replica area has no room to say.
    let bare = bare().await;
    let e = n1.replica_room(&bare.addr, &rkey()).await.unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 501, .. }), "{e}");
}

// ---- Commit notices (issue 26): a node tells the others it committed a checkpoint ----

/// The agent's job events: every commit notice, as the server handed it over.
#[derive(Default)]
struct Notices(Mutex<Vec<(sluice_proto::msg::JobId, String, String)>>);

#[async_trait::async_trait]
impl JobEvents for Notices {
    async fn committed(&self, job: sluice_proto::msg::JobId, from: &str, tag: &str) {
        lock(&self.0).push((job, from.into(), tag.into()));
    }
}

impl Notices {
    fn taken(&self) -> Vec<(sluice_proto::msg::JobId, String, String)> {
        lock(&self.0).clone()
    }
}

/// A server of job JOB on n1, n2, n3 that hands commit notices to a fresh [`Notices`].
async fn noticing() -> (Running, Arc<Notices>) {
    let r = bare().await;
    let notices = Arc::new(Notices::default());
    r.server.serve_events(notices.clone());
    (r, notices)
}

/// n2 tells n1 it committed s1: n1's events have it, from n2, for the job.
#[tokio::test]
async fn a_commit_notice_reaches_the_nodes_events() {
    let (r, notices) = noticing().await;
    PeerClient::new("n2", client_cfg())
        .notify_commit(&r.addr, &rkey(), "s1")
        .await
        .unwrap();
    PeerClient::new("n3", client_cfg())
        .notify_commit(&r.addr, &rkey(), "global_step100")
        .await
        .unwrap();
    assert_eq!(
        notices.taken(),
        [
            (JOB, "n2".to_string(), "s1".to_string()),
            (JOB, "n3".to_string(), "global_step100".to_string())
        ]
    );
    // A process on the peer port that says "queued" without the job key is not believed.
    let fake = fake_server(|_| {
        let mac = blake3::hash(b"guess").to_hex();
        format!("HTTP/1.1 202 Accepted\r\ncontent-length: 6\r\nx-sluice-mac: {mac}\r\n\r\nqueued")
            .into_bytes()
    })
    .await;
    let e = PeerClient::new("n2", client_cfg())
        .notify_commit(&fake, &rkey(), "s2")
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Corrupt { .. }), "{e}");
    assert_eq!(notices.taken().len(), 2);
}

/// A node outside the job (even with the job's key), an agent under another cluster secret, a
/// tag that is not a checkpoint's, a `from` that is not the sender, a body: refused, and the
/// node's events hear of none of them.
#[tokio::test]
async fn commit_notices_from_outside_the_job_or_malformed_are_refused() {
    let (r, notices) = noticing().await;
    let other = ClusterSecret::from_bytes([9u8; 32]).job_key(JOB, &names(REPLICA_NODES));
    for (who, node, key, want) in [
        ("n9, outside the job", "n9", rkey(), 403),
        ("n3 under another secret", "n3", other, 401),
    ] {
        let e = PeerClient::new(node, client_cfg())
            .notify_commit(&r.addr, &key, "s1")
            .await
            .unwrap_err();
        assert!(
            matches!(e, PeerError::Refused { status, .. } if status == want),
            "{who}: {e}"
        );
    }
    let n2 = PeerClient::new("n2", client_cfg());
    for tag in ["../s1", "a/b", ".hidden", ""] {
        let e = n2.notify_commit(&r.addr, &rkey(), tag).await.unwrap_err();
        assert!(
            matches!(e, PeerError::Refused { status: 400, .. }),
            "{tag:?}: {e}"
        );
    }
    // By hand: a `from` that is not the sender, a body.
    let pq = format!("/v1/jobs/{JOB}/commits?tag=s1");
    for (query, body, why) in [
        ("&from=n3", &b""[..], "unknown query parameter 'from'"),
        ("", &b"abc"[..], "no body"),
    ] {
        let (status, answer) = raw_signed(
            &r.addr,
            &rkey(),
            "n2",
            "POST",
            &format!("{pq}{query}"),
            &[("content-length", body.len().to_string())],
            body,
        )
        .await;
        let text = String::from_utf8_lossy(&answer);
        assert_eq!(status, 400, "{text}");
        assert!(text.contains(why), "{text}");
    }
    let (status, _) = raw_signed(&r.addr, &rkey(), "n2", "GET", &pq, &[], b"").await;
    assert_eq!(status, 405);
    assert_eq!(notices.taken(), [], "no notice was handed over");
}

/// A notice for a job not registered here is unknown (404); a node that takes no job events
/// answers 501, and one where the job ended 410, both MAC'd.
#[tokio::test]
async fn commit_notices_for_an_unknown_job_or_to_a_node_without_events() {
    let (r, notices) = noticing().await;
    let n2 = PeerClient::new("n2", client_cfg());
    let other = secret().job_key(JOB + 1, &names(REPLICA_NODES));
    let e = n2.notify_commit(&r.addr, &other, "s1").await.unwrap_err();
    assert!(
        matches!(e, PeerError::UnknownJob { job, .. } if job == JOB + 1),
        "{e}"
    );
    let (bare, _store) = holding(1 << 20).await;
    let e = n2
        .notify_commit(&bare.addr, &rkey(), "s1")
        .await
        .unwrap_err();
    assert!(
        matches!(&e, PeerError::Refused { status: 501, reason, .. } if reason.contains("no job events")),
        "{e}"
    );
    r.server.unregister(JOB);
    let e = n2.notify_commit(&r.addr, &rkey(), "s1").await.unwrap_err();
    assert!(matches!(e, PeerError::Gone { job: JOB, .. }), "{e}");
    assert_eq!(notices.taken(), []);
}

/// A dataset's listing passes whole to an agent of the job, checked; a user process without the
/// job key, a node outside the job, or another cluster's agent gets a refusal and none of it; a
/// page of another source is not this node's to give; and an agent that predates listings is
/// told from one that does not know the job yet at once, so the asker lists the origin itself
/// without waiting out the join grace.
#[tokio::test]
async fn a_listing_passes_only_to_agents_of_the_job() {
    let (r, src) = serving(server_cfg()).await;
    let page = Bytes::from(format!(
        "{{\"objects\":[\"{}\"]}}",
        String::from_utf8_lossy(MARK)
    ));
    let asked = listing::PageRequest {
        dataset: "train".into(),
        source: "s3://bucket/train".into(),
        from: 1000,
    };
    lock(&src.pages).insert(
        (asked.dataset.clone(), asked.source.clone(), asked.from),
        page.clone(),
    );
    let c = PeerClient::new("n2", client_cfg());
    assert_eq!(
        c.fetch_listing(&r.addr, &key(), &asked).await.unwrap(),
        page
    );
    let elsewhere = listing::PageRequest {
        source: "s3://other/train".into(),
        ..asked.clone()
    };
    let e = c
        .fetch_listing(&r.addr, &key(), &elsewhere)
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::NotOwner { .. }), "{e}");

    let pq = format!("/v1/jobs/{JOB}/listing?{}", asked.query());
    let (status, body) = raw_get(&r.addr, &pq, &[]).await;
    assert_eq!(status, 401);
    assert!(!contains(&body, MARK), "a listing in a refusal");
    let now = now_secs();
    let (status, body) = raw_get(&r.addr, &pq, &signed_headers(&key(), &pq, "n9", now)).await;
    assert_eq!(status, 403);
    assert!(!contains(&body, MARK), "a listing in a refusal");
    let forged = ClusterSecret::from_bytes([9u8; 32]).job_key(JOB, &names(&["n1", "n2"]));
    let e = c.fetch_listing(&r.addr, &forged, &asked).await.unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 401, .. }), "{e}");
    let outsider = PeerClient::new("n9", client_cfg());
    let e = outsider
        .fetch_listing(&r.addr, &key(), &asked)
        .await
        .unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 403, .. }), "{e}");

    // An agent of a release without listings, as 0.1.0 answers a path it does not serve.
    let old = fake_server(|_| {
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 16\r\n\r\nno such resource".to_vec()
    })
    .await;
    let t = tokio::time::Instant::now();
    let e = c.fetch_listing(&old, &key(), &asked).await.unwrap_err();
    assert!(matches!(e, PeerError::Refused { status: 404, .. }), "{e}");
    assert!(t.elapsed() < client_cfg().join_grace, "{:?}", t.elapsed());
}

/// A listing is fetched outside the fetch slots: with every slot held by a fetch that waits for a
/// unit its owner has not read (which may wait for this very listing to learn of it), a page
/// still comes.
#[tokio::test]
async fn a_listing_page_comes_while_every_fetch_slot_waits_for_a_unit() {
    let (r, src) = serving(server_cfg()).await;
    let asked = listing::PageRequest {
        dataset: "train".into(),
        source: "s3://bucket/train".into(),
        from: 0,
    };
    let page = Bytes::from_static(b"{\"objects\":[],\"more\":false}");
    lock(&src.pages).insert(
        (asked.dataset.clone(), asked.source.clone(), 0),
        page.clone(),
    );
    let c = Arc::new(PeerClient::new(
        "n2",
        ClientConfig {
            concurrency: 1,
            ..client_cfg()
        },
    ));
    let (c2, addr) = (c.clone(), r.addr.clone());
    let waiting = tokio::spawn(async move {
        c2.fetch(&addr, &key(), &Unit::new("never/read", 0, 10))
            .await
    });
    wait_until("the unit fetch to hold the one slot", || {
        src.asked.load(Ordering::SeqCst) > 0
    })
    .await;
    let got = tokio::time::timeout(
        Duration::from_secs(5),
        c.fetch_listing(&r.addr, &key(), &asked),
    )
    .await
    .expect("the page came within 5 s");
    assert_eq!(got.unwrap(), page);
    waiting.abort();
}
