//! The agent's Unix socket: accepts connections, reads one framed request each, authorises it from
//! the peer credentials and answers.
//!
//! A request runs in a task of its own, so a client that disconnects mid-request (an epilog that hit
//! its timeout, a killed task) never cancels half-done work that changes state (job start and end, a
//! commit); the answer is simply dropped. A request that only waits or reads ends with its client,
//! so the work a user keeps in the agent is bounded by the connections admission lets them hold.
//!
//! The socket is open to every local user, so no user may starve the others (docs/SECURITY.md, F4).
//! Each connection's peer credentials are read right after `accept`, before a byte is read, and the
//! connection is admitted to a slot ([`Admission`]) or closed at once: a non-root uid holds at most
//! [`MAX_PER_USER`] connections, non-root users together at most `MAX_CONNECTIONS - ROOT_RESERVED`,
//! and the last [`ROOT_RESERVED`] slots are root's (slurmd's prolog and epilog, the admin). The
//! accept loop never waits for a slot, so refused connections never queue in the kernel's backlog
//! in front of anyone else's; and a client has [`HEADER_TIMEOUT`] to start its request. A refused
//! client sees the connection closed without an answer, which the plugin's `task_init` retries
//! (a node running more than [`MAX_PER_USER`] tasks of one user gets through in turns).

use crate::agent::Agent;
use crate::identity::Peer;
use sluice_proto::msg::{ErrorCode, ErrorReply, Request, Response};
use sluice_proto::wire;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// How long a client may take to send the 4-byte header of its request. Every sluice client writes
/// its whole request right after connecting, so only a silent (hostile or hung) client waits this long.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a client may take to send its whole request (up to 1 MiB).
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once, all users together (root's reserved slots included).
pub const MAX_CONNECTIONS: usize = 1024;
/// Slots only root may use, so the prolog and epilog always get through.
pub const ROOT_RESERVED: usize = 64;
/// Connections one non-root uid may hold at once (idle, reading, or waiting for its answer).
pub const MAX_PER_USER: usize = 64;
/// At most one "refused" warning per this interval, with the count since the last one.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Serves `listener` until `shutdown` is cancelled.
pub async fn run(agent: Arc<Agent>, listener: UnixListener, shutdown: CancellationToken) {
    let admission = Arc::new(Admission::new(Limits::DEFAULT));
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // EMFILE/ENFILE: the connection stays in the backlog until a descriptor frees.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.cancelled() => break,
        };
        let peer = match stream.peer_cred() {
            Ok(c) => Peer {
                uid: c.uid(),
                gid: c.gid(),
            },
            Err(e) => {
                tracing::warn!("no peer credentials: {e}");
                continue;
            }
        };
        // Decided here, in the accept loop, so the next accept already counts this connection.
        let slot = match admission.admit(peer.uid) {
            Ok(slot) => slot,
            Err(refused) => {
                admission.note_refusal(refused);
                agent.metrics.refused(refused.reason());
                continue; // dropping the stream closes it: the client reads end-of-file
            }
        };
        let served = agent.clone();
        drop(agent.spawn(async move {
            serve(served, peer, stream).await;
            drop(slot);
        }));
    }
}

/// How many connections may be served at once (see the module's documentation).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// All connections together, root's included.
    pub total: usize,
    /// Of `total`, the slots only root may use.
    pub root_reserved: usize,
    /// Connections of one non-root uid.
    pub per_user: usize,
}

impl Limits {
    pub const DEFAULT: Limits = Limits {
        total: MAX_CONNECTIONS,
        root_reserved: ROOT_RESERVED,
        per_user: MAX_PER_USER,
    };
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// This uid already holds its `per_user` connections.
    UserLimit { uid: u32 },
    /// Every slot open to this peer is taken.
    Full { uid: u32 },
}

impl Refused {
    /// A stable word for the reason, for the `sluice_connections_refused_total{reason}` label (one
    /// of [`crate::metrics::REFUSAL_REASONS`]). Dashboards and alerts query these words: keep them.
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::UserLimit { .. } => "user_limit",
            Refused::Full { .. } => "full",
        }
    }
}

/// The connection slots: who holds how many. A [`Slot`] gives its place back when dropped.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    held: usize,
    per_uid: HashMap<u32, usize>,
    refused_since_log: u64,
    last_log: Option<Instant>,
}

impl Admission {
    pub fn new(limits: Limits) -> Admission {
        Admission {
            limits,
            state: Mutex::new(State::default()),
        }
    }

    /// A slot for a connection of `uid`, or why there is none. Never waits.
    pub fn admit(self: &Arc<Self>, uid: u32) -> Result<Slot, Refused> {
        let mut st = self.lock();
        let l = self.limits;
        if uid == 0 {
            if st.held >= l.total {
                return Err(Refused::Full { uid });
            }
        } else {
            if st.per_uid.get(&uid).copied().unwrap_or(0) >= l.per_user {
                return Err(Refused::UserLimit { uid });
            }
            if st.held >= l.total.saturating_sub(l.root_reserved) {
                return Err(Refused::Full { uid });
            }
        }
        st.held += 1;
        *st.per_uid.entry(uid).or_insert(0) += 1;
        Ok(Slot {
            admission: self.clone(),
            uid,
        })
    }

    /// Connections held now: (all, of `uid`).
    pub fn held(&self, uid: u32) -> (usize, usize) {
        let st = self.lock();
        (st.held, st.per_uid.get(&uid).copied().unwrap_or(0))
    }

    /// Logs a refusal, at most once per [`REFUSAL_LOG_INTERVAL`] (a user hammering the socket must
    /// not flood the log either).
    fn note_refusal(&self, refused: Refused) {
        let mut st = self.lock();
        st.refused_since_log += 1;
        let now = Instant::now();
        if st
            .last_log
            .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        let count = std::mem::take(&mut st.refused_since_log);
        st.last_log = Some(now);
        let (total, per_user) = (self.limits.total, self.limits.per_user);
        match refused {
            Refused::UserLimit { uid } => tracing::warn!(
                uid,
                refused = count,
                "connection refused: uid {uid} already holds {per_user} connections to the agent \
                 ({count} refused since the last warning)"
            ),
            Refused::Full { uid } => tracing::warn!(
                uid,
                refused = count,
                "connection refused: all {total} connection slots open to uid {uid} are taken \
                 ({count} refused since the last warning)"
            ),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a few counters, consistent after every statement: a panic elsewhere while
        // the lock was held leaves nothing half-done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One admitted connection's place; given back when dropped.
#[derive(Debug)]
pub struct Slot {
    admission: Arc<Admission>,
    uid: u32,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.admission.lock();
        st.held -= 1;
        if let Some(n) = st.per_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                st.per_uid.remove(&self.uid);
            }
        }
    }
}

async fn serve(agent: Arc<Agent>, peer: Peer, mut stream: UnixStream) {
    let (request, passed_fd) = match read_request(&mut stream).await {
        Ok(r) => r,
        Err(ReadError::Frame(e)) => {
            let _ = write_response(
                &mut stream,
                &Response::Error(ErrorReply::new(ErrorCode::BadRequest, e.to_string())),
            )
            .await;
            return;
        }
        Err(ReadError::TimedOut) => return,
    };
    tracing::debug!(uid = peer.uid, ?request, "request");
    // A request that only waits or reads ends with its client (issue 10, item 9: a user looping
    // "wait_staged, hang up" piled up 48-hour waits in the root agent, beyond what admission counts);
    // one that changes state runs to its end, so a hang-up never leaves it half done.
    let ends_with_client = matches!(
        request,
        Request::WaitStaged { .. }
            | Request::Status
            | Request::Job { .. }
            | Request::CkptList { .. }
            // Archive requests read, or write into the caller's own directory: a hang-up cancels
            // them (a restore stops where it is).
            | Request::ArchiveList { .. }
            | Request::ArchiveVerify { .. }
            | Request::ArchiveRestore { .. }
    );
    let mut work = {
        let agent = agent.clone();
        agent.clone().spawn(async move {
            match request {
                // The restore directory travels beside the request, not in it: these go to their
                // module with it (`Agent::handle` sends them there without one).
                r @ (Request::ArchiveList { .. }
                | Request::ArchiveVerify { .. }
                | Request::ArchiveRestore { .. }) => {
                    agent.archive_access.handle(peer, r, passed_fd).await
                }
                r => agent.handle(peer, r).await,
            }
        })
    };
    // Answer when the work is done; stop waiting if the client goes away (it sends nothing more, so
    // any readable event is its hang-up).
    let (mut rd, mut wr) = stream.into_split();
    let mut probe = [0u8; 1];
    tokio::select! {
        r = &mut work => {
            let response = r.unwrap_or_else(|e| Response::Error(ErrorReply::new(ErrorCode::Internal, format!("request failed: {e}"))));
            let frame = match wire::encode(&response) {
                Ok(f) => f,
                Err(e) => wire::encode(&Response::Error(ErrorReply::new(ErrorCode::Internal, e.to_string()))).expect("small frame"),
            };
            let _ = wr.write_all(&frame).await;
        }
        _ = rd.read(&mut probe) => {
            if ends_with_client {
                work.abort();
            } else {
                // Runs to its end, still holding the connection's admission slot: a uid's work in
                // flight stays within its per-user cap, hang-ups or not.
                let _ = work.await;
            }
        }
    }
}

enum ReadError {
    /// The client sent nothing (or not all) within its time: closed without an answer.
    TimedOut,
    Frame(wire::FrameError),
}

/// Reads one request, and the descriptor its client passed with it, if any: its header within
/// [`HEADER_TIMEOUT`], all of it within [`READ_TIMEOUT`].
async fn read_request(stream: &mut UnixStream) -> Result<(Request, Option<OwnedFd>), ReadError> {
    let started = tokio::time::Instant::now();
    let mut header = [0u8; 4];
    let first = async {
        let (n, fd) = recv_with_fd(stream, &mut header).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        stream.read_exact(&mut header[n..]).await?;
        Ok::<_, std::io::Error>(fd)
    };
    let passed_fd = match tokio::time::timeout(HEADER_TIMEOUT, first).await {
        Ok(r) => r.map_err(|e| ReadError::Frame(e.into()))?,
        Err(_) => return Err(ReadError::TimedOut),
    };
    let len = wire::frame_len(header).map_err(ReadError::Frame)?;
    let mut body = vec![0u8; len];
    match tokio::time::timeout_at(started + READ_TIMEOUT, stream.read_exact(&mut body)).await {
        Ok(r) => r.map_err(|e| ReadError::Frame(e.into()))?,
        Err(_) => return Err(ReadError::TimedOut),
    };
    let request = wire::decode_request(&body).map_err(ReadError::Frame)?;
    Ok((request, passed_fd))
}

/// The first bytes of a request, with `recvmsg`: a client passes a descriptor (the directory of
/// `sluice ckpt restore`) attached to the first byte of its request, and a plain read would let
/// the kernel drop it. One descriptor is kept; the kernel closes any beyond the buffer's room
/// (`MSG_CTRUNC`), and any passed with later bytes (plain reads take no ancillary data).
async fn recv_with_fd(
    stream: &UnixStream,
    buf: &mut [u8],
) -> std::io::Result<(usize, Option<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    loop {
        stream.readable().await?;
        let received = stream.try_io(tokio::io::Interest::READABLE, || {
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [std::io::IoSliceMut::new(buf)];
            let msg = rustix::net::recvmsg(stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
                .map_err(std::io::Error::from)?;
            let mut fds: Vec<OwnedFd> = Vec::new();
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(passed) = m {
                    fds.extend(passed);
                }
            }
            // More than one is no sluice client: none is used (dropping them closes them).
            let fd = if fds.len() == 1 { fds.pop() } else { None };
            Ok((msg.bytes, fd))
        });
        match received {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

async fn write_response(
    stream: &mut UnixStream,
    response: &Response,
) -> Result<(), wire::FrameError> {
    stream.write_all(&wire::encode(response)?).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Limits = Limits {
        total: 10,
        root_reserved: 3,
        per_user: 4,
    };

    fn admit_n(a: &Arc<Admission>, uid: u32, n: usize) -> Vec<Slot> {
        (0..n)
            .map(|i| {
                a.admit(uid)
                    .unwrap_or_else(|e| panic!("connection {i} of uid {uid}: {e:?}"))
            })
            .collect()
    }

    #[test]
    fn one_user_is_capped_and_the_others_still_get_in() {
        let a = Arc::new(Admission::new(SMALL));
        let hog = admit_n(&a, 1000, 4);
        assert_eq!(a.admit(1000).unwrap_err(), Refused::UserLimit { uid: 1000 });
        assert_eq!(a.held(1000), (4, 4));
        // Another user and root are not affected by the hog's refusals.
        let _other = admit_n(&a, 1001, 2);
        let _root = a.admit(0).unwrap();
        assert_eq!(a.held(1001), (7, 2));
        drop(hog);
        assert_eq!(a.held(1000), (3, 0));
        let _again = admit_n(&a, 1000, 4);
    }

    #[test]
    fn root_keeps_its_reserved_slots_when_users_fill_the_rest() {
        let a = Arc::new(Admission::new(SMALL));
        // Two users fill the 7 slots open to non-root peers (4 + 3).
        let _u1 = admit_n(&a, 1000, 4);
        let _u2 = admit_n(&a, 1001, 3);
        assert_eq!(a.admit(1001).unwrap_err(), Refused::Full { uid: 1001 });
        assert_eq!(a.admit(1002).unwrap_err(), Refused::Full { uid: 1002 });
        // Root gets the 3 reserved ones, and no more.
        let roots = admit_n(&a, 0, 3);
        assert_eq!(a.admit(0).unwrap_err(), Refused::Full { uid: 0 });
        assert_eq!(a.held(0), (10, 3));
        // Root's slots given back do not open the reserve to users.
        drop(roots);
        assert_eq!(a.admit(1002).unwrap_err(), Refused::Full { uid: 1002 });
        let _r = a.admit(0).unwrap();
    }

    #[test]
    fn refusal_reasons_are_the_metrics_words() {
        let reasons = [
            Refused::UserLimit { uid: 1000 }.reason(),
            Refused::Full { uid: 1000 }.reason(),
        ];
        assert_eq!(reasons, ["user_limit", "full"]);
        assert_eq!(reasons, crate::metrics::REFUSAL_REASONS);
    }

    #[test]
    fn root_is_not_capped_per_user() {
        let a = Arc::new(Admission::new(SMALL));
        let roots = admit_n(&a, 0, 10);
        assert_eq!(a.admit(0).unwrap_err(), Refused::Full { uid: 0 });
        drop(roots);
        assert_eq!(a.held(0), (0, 0));
    }

    #[test]
    fn slots_are_given_back_whatever_order_they_are_dropped_in() {
        let a = Arc::new(Admission::new(Limits::DEFAULT));
        let mut slots: Vec<Slot> = (0..MAX_PER_USER as u32)
            .flat_map(|uid| admit_n(&a, 1000 + uid, 3))
            .collect();
        assert_eq!(a.held(1000).0, 3 * MAX_PER_USER);
        // Interleaved drops (odd positions first, then the rest from the end).
        let mut i = 0;
        slots.retain(|_| {
            i += 1;
            i % 2 == 0
        });
        while slots.pop().is_some() {}
        assert_eq!(a.held(1000), (0, 0));
        assert!(
            a.lock().per_uid.is_empty(),
            "uids with no connection are forgotten"
        );
    }

    #[test]
    fn the_defaults_leave_every_class_room() {
        let l = Limits::DEFAULT;
        assert!(l.root_reserved >= 1 && l.root_reserved < l.total);
        assert!(l.per_user < l.total - l.root_reserved);
        assert!(HEADER_TIMEOUT <= Duration::from_secs(2) && HEADER_TIMEOUT < READ_TIMEOUT);
    }

    /// A client that connects and stays silent is closed after the header timeout, holding its
    /// slot no longer; one that starts its request in time gets the full read timeout.
    #[tokio::test]
    async fn a_silent_client_is_closed_after_the_header_timeout() {
        let (mut server, _client) = UnixStream::pair().unwrap();
        let started = std::time::Instant::now();
        let r = read_request(&mut server).await;
        assert!(matches!(r, Err(ReadError::TimedOut)));
        let waited = started.elapsed();
        assert!(
            waited >= HEADER_TIMEOUT && waited < HEADER_TIMEOUT + Duration::from_secs(1),
            "{waited:?}"
        );
        // The header in time, the body a little later than the header timeout: still read.
        let (mut server, client2) = UnixStream::pair().unwrap();
        let body = br#"{"version":1,"request":{"op":"status"}}"#;
        let writer = tokio::spawn(async move {
            let mut c = client2;
            c.write_all(&(body.len() as u32).to_be_bytes())
                .await
                .unwrap();
            tokio::time::sleep(HEADER_TIMEOUT + Duration::from_millis(300)).await;
            c.write_all(body).await.unwrap();
            c
        });
        let r = read_request(&mut server).await;
        assert!(r.is_ok(), "a request that started in time was dropped");
        drop(writer.await.unwrap());
    }

    /// `sluice ckpt restore` through the agent: the directory the client passes with its request
    /// (SCM_RIGHTS on its first byte) arrives as a descriptor of that same directory; a request
    /// sent without one brings none.
    #[tokio::test]
    async fn a_descriptor_passed_with_a_request_is_received() {
        use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
        use std::os::fd::AsRawFd;
        let tmp = tempfile::tempdir().unwrap();
        let dir = std::fs::File::open(tmp.path()).unwrap();
        let frame = wire::encode(&wire::Envelope::new(Request::ArchiveRestore {
            url: "file:///a".into(),
            tag: "t".into(),
            dry_run: false,
            force: false,
        }))
        .unwrap();
        let (client, server) = std::os::unix::net::UnixStream::pair().unwrap();
        let fds = [dir.as_raw_fd()];
        let sent = sendmsg::<()>(
            client.as_raw_fd(),
            &[std::io::IoSlice::new(&frame)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(sent, frame.len());
        server.set_nonblocking(true).unwrap();
        let mut server = UnixStream::from_std(server).unwrap();
        let Ok((request, Some(fd))) = read_request(&mut server).await else {
            panic!("no request with a descriptor");
        };
        assert!(matches!(request, Request::ArchiveRestore { .. }));
        let (a, b) = (
            nix::sys::stat::fstat(&fd).unwrap(),
            nix::sys::stat::fstat(&dir).unwrap(),
        );
        assert_eq!((a.st_dev, a.st_ino), (b.st_dev, b.st_ino));
        // The same request without a descriptor.
        let (mut client, mut server) = UnixStream::pair().unwrap();
        client.write_all(&frame).await.unwrap();
        let Ok((_, fd)) = read_request(&mut server).await else {
            panic!("request not read");
        };
        assert!(fd.is_none());
    }

    /// Issue 10, item 9: a client that asks to wait for staging and hangs up leaves no waiting
    /// task behind (before, each such request waited up to 48 hours in the agent).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs root, like sluiced (the hot tier's jobs directory is root's); run as root with --ignored, as tests/harness/run-e2e.sh does"]
    async fn a_wait_ends_when_its_client_hangs_up() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root");
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path().display();
        // Staging from a store nobody answers, retried for minutes: the job stays staging.
        let cfg = format!(
            "[agent]\nsocket = '{r}/s.sock'\nstate_dir = '{r}/state'\nsqueue = ''\n\
             [hot_tier]\nroot = '{r}/hot'\n[stage]\ntimeout = '10min'\n\
             [[stage.allow]]\nprefix = 's3://b/'\n\
             [[store]]\nprefix = 's3://'\nendpoint = 'http://127.0.0.1:9'\nallow_http = true\n\
             region = 'x'\naccess_key_id = 'k'\nsecret_access_key = 's'\n\
             [retry]\nmax_retries = 100\ntimeout = '15min'\n"
        );
        let cfg = Arc::new(
            sluice_core::config::Config::parse(&cfg, "n1", sluice_archive::upload_memory).unwrap(),
        );
        let (cancel, tracker) = (
            CancellationToken::new(),
            tokio_util::task::TaskTracker::new(),
        );
        let agent = Agent::new(
            cfg.clone(),
            "/bin/false".into(),
            cancel.clone(),
            tracker.clone(),
        )
        .unwrap();
        agent.recover().unwrap();
        let start = sluice_proto::testing::nobody_job(
            5,
            "n1",
            "j",
            vec![("stage-in".into(), "s3://b/ds".into())],
        );
        let root = Peer { uid: 0, gid: 0 };
        assert_eq!(
            agent.handle(root, Request::JobStart(start)).await,
            Response::Ok
        );
        let listener = tokio::net::UnixListener::bind(&cfg.socket).unwrap();
        let server = tokio::spawn(run(agent.clone(), listener, cancel.clone()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = agent.tasks_in_flight();
        let wait = wire::encode(&wire::Envelope::new(Request::WaitStaged {
            job_id: 5,
            timeout_ms: 3_600_000,
            step: None,
        }))
        .unwrap();
        for _ in 0..20 {
            let mut c = UnixStream::connect(&cfg.socket).await.unwrap();
            c.write_all(&wait).await.unwrap();
            drop(c);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            agent.tasks_in_flight(),
            before,
            "requests whose clients hung up are still waiting in the agent"
        );
        cancel.cancel();
        server.await.unwrap();
    }
}
