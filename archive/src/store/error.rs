//! What an object-store error means for sluice, decided from object_store's own types: the error's
//! variant (`NotFound`, `PermissionDenied`, ...) and the transport error in its source chain
//! ([`HttpError`] and its [`HttpErrorKind`]: connect, request, timeout, ...). [`classify`] is what
//! callers decide on (fail the job, retry later, tell the user the store is down); [`describe`] is
//! what they show people.
//!
//! One gap in object_store 0.14: the HTTP status of an error that is not mapped to a variant (a
//! listing of a missing bucket answers 404 but arrives as `Generic`, as does a 503 `SlowDown` once
//! the retries are spent) sits in a crate-private type (`client::retry::RetryError`) that cannot
//! be downcast to from outside (apache/arrow-rs-object-store#737 asks for it). For those, the
//! decision reads the store's machine-readable error code — the `<Code>` element of the S3, GCS
//! XML or Azure error body (`NoSuchBucket`, `ContainerNotFound`, `SlowDown`, ...) — compared
//! exactly against the codes in `STORE_CODES`, never a search of the message for words.

use object_store::client::{HttpError, HttpErrorKind};
use std::error::Error as StdError;

/// What went wrong with an object-store request, as far as a caller must tell cases apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// No such object, prefix, bucket or container: the user's path is wrong.
    NotFound,
    /// Missing, wrong or insufficient credentials (HTTP 401/403 and the stores' denial codes).
    Denied,
    /// The store asked for fewer requests (`SlowDown`, `ServerBusy`, ...) and object_store's retries
    /// are spent.
    Throttled,
    /// No HTTP answer: the connection could not be made (refused, DNS, TLS) or broke before the
    /// answer was complete, after object_store's retries. The store is down or not reachable.
    Unreachable,
    /// The store did not answer within the client's timeout, after object_store's retries.
    TimedOut,
    /// Anything else (a store's 5xx, an invalid path, an unsupported operation, a local I/O
    /// error, ...): [`describe`] says what.
    Other,
}

/// The stores' error codes that decide a kind on their own, for errors object_store leaves
/// `Generic` (see the module doc). Exact matches only.
const STORE_CODES: &[(&str, StoreErrorKind)] = &[
    // S3 and GCS (XML API); Azure Blob.
    ("NoSuchBucket", StoreErrorKind::NotFound),
    ("NoSuchKey", StoreErrorKind::NotFound),
    ("ContainerNotFound", StoreErrorKind::NotFound),
    ("BlobNotFound", StoreErrorKind::NotFound),
    ("NoSuchContainer", StoreErrorKind::NotFound),
    ("AccessDenied", StoreErrorKind::Denied),
    ("InvalidAccessKeyId", StoreErrorKind::Denied),
    ("SignatureDoesNotMatch", StoreErrorKind::Denied),
    ("ExpiredToken", StoreErrorKind::Denied),
    ("InvalidToken", StoreErrorKind::Denied),
    ("AuthenticationFailed", StoreErrorKind::Denied),
    ("AuthorizationFailure", StoreErrorKind::Denied),
    ("AuthorizationPermissionMismatch", StoreErrorKind::Denied),
    ("InsufficientAccountPermissions", StoreErrorKind::Denied),
    ("SlowDown", StoreErrorKind::Throttled),
    ("ServerBusy", StoreErrorKind::Throttled),
    ("TooManyRequests", StoreErrorKind::Throttled),
    ("RequestLimitExceeded", StoreErrorKind::Throttled),
    ("Throttling", StoreErrorKind::Throttled),
];

/// The stores' answers to a read of an object whose data is in an offline storage class (see
/// [`crate::store::is_offline_class`]): S3's 403 `InvalidObjectState` (GLACIER, DEEP_ARCHIVE), Azure's
/// 409 `BlobArchived` (the Archive tier). object_store makes them `PermissionDenied` and
/// `AlreadyExists`, neither of which is what happened.
const OFFLINE_CODES: &[&str] = &["InvalidObjectState", "BlobArchived"];

/// The store refused to read the object because its data is offline (archived): it must be
/// restored (rehydrated) in the store first.
fn offline(e: &object_store::Error) -> Option<StoreReply> {
    store_reply(e).filter(|r| OFFLINE_CODES.contains(&r.code.as_str()))
}

/// What `e` means for sluice: from its variant, then the transport error in its source chain,
/// then the store's error code (see the module doc). Data in an offline class is `Other`, not
/// denied: the credentials are fine.
pub fn classify(e: &object_store::Error) -> StoreErrorKind {
    if offline(e).is_some() {
        return StoreErrorKind::Other;
    }
    match e {
        object_store::Error::NotFound { .. } => return StoreErrorKind::NotFound,
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => return StoreErrorKind::Denied,
        _ => {}
    }
    if let Some(kind) = transport_kind(e) {
        return match kind {
            HttpErrorKind::Connect | HttpErrorKind::Request | HttpErrorKind::Interrupted => {
                StoreErrorKind::Unreachable
            }
            HttpErrorKind::Timeout => StoreErrorKind::TimedOut,
            _ => StoreErrorKind::Other,
        };
    }
    store_reply(e)
        .and_then(|reply| {
            STORE_CODES
                .iter()
                .find(|(code, _)| *code == reply.code)
                .map(|(_, kind)| *kind)
        })
        .unwrap_or(StoreErrorKind::Other)
}

/// `e` for people: object_store's message with the store's error code and message in place of the
/// raw XML body, and without the retry bookkeeping ("after 3 retries, max_retries: 10, ...").
/// For data in an offline class, what to do instead of object_store's reading of the status.
pub fn describe(e: &object_store::Error) -> String {
    if let Some(StoreReply { code, message }) = offline(e) {
        let message = message.map(|m| format!(": {m}")).unwrap_or_default();
        return format!(
            "its data is in an offline storage class (an archive tier) and cannot be read until \
             the store restores (rehydrates) it ({code}{message})"
        );
    }
    let text = e.to_string();
    let mut head = match ["<?xml", "<Error"]
        .iter()
        .filter_map(|t| text.find(t))
        .min()
    {
        Some(xml) => text[..xml].to_string(),
        None => text.clone(),
    };
    // RetryError writes "in 1.2s, after 3 retries, max_retries: 10, retry_timeout: 180s  - <why>".
    while let Some(start) = head.find(", after ") {
        let Some(end) = head[start..].find(" - ").map(|i| start + i) else {
            head.truncate(start);
            break;
        };
        head.replace_range(start..end, "");
    }
    // Azure's body starts with a byte-order mark.
    let head = head.trim_end_matches([' ', ':', '-', '\u{feff}']);
    match store_reply(e) {
        Some(StoreReply {
            code,
            message: Some(m),
        }) => format!("{head}: {code}: {m}"),
        Some(StoreReply {
            code,
            message: None,
        }) => format!("{head}: {code}"),
        // A transport error displays as "HTTP error: error sending request"; why it failed
        // ("Connection refused", "operation timed out") is the innermost cause.
        None => match innermost(e).to_string() {
            cause if !head.contains(&cause) => format!("{head} ({cause})"),
            _ => head.to_string(),
        },
    }
}

/// The last error of `e`'s source chain (`e` itself if it has no source).
fn innermost(e: &object_store::Error) -> &(dyn StdError + 'static) {
    let mut last: &(dyn StdError + 'static) = e;
    while let Some(next) = last.source() {
        last = next;
    }
    last
}

/// The [`HttpErrorKind`] of the transport error in `e`'s source chain, if the request failed
/// without an HTTP answer.
fn transport_kind(e: &object_store::Error) -> Option<HttpErrorKind> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(http) = err.downcast_ref::<HttpError>() {
            return Some(http.kind());
        }
        cur = err.source();
    }
    None
}

/// The error code and message of a store's error body.
struct StoreReply {
    code: String,
    message: Option<String>,
}

/// The store's error body, if `e` carries one. object_store hands the body over only as the text
/// of the innermost error of the chain ("Server returned non-2xx status code: 404 Not Found:
/// <?xml ...><Error><Code>NoSuchBucket</Code>..."); the URL and path above it are never read.
fn store_reply(e: &object_store::Error) -> Option<StoreReply> {
    let text = innermost(e).to_string();
    let body = &text[text.find("<Error>")?..];
    let element = |tag: &str| {
        let open = format!("<{tag}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find("</")? + start;
        // Azure appends "\nRequestId:...\nTime:..." to its message.
        let value = body[start..end].lines().next().unwrap_or_default().trim();
        (!value.is_empty()).then(|| value.to_string())
    };
    Some(StoreReply {
        code: element("Code")?,
        message: element("Message"),
    })
}

#[cfg(test)]
mod tests {
    //! Real object_store errors, from real clients talking to loopback servers that answer what
    //! S3 and Azure answer (or nothing at all).

    use super::*;
    use object_store::path::Path as ObjPath;
    use object_store::{ObjectStore, ObjectStoreExt};
    use sluice_core::config::Config;
    use sluice_proto::options::ObjectScheme;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A loopback HTTP server answering every request with `status` and `body`; counts requests.
    struct Canned {
        port: u16,
        requests: Arc<AtomicUsize>,
    }

    impl Canned {
        fn start(status: impl Into<String>, body: impl Into<String>) -> Canned {
            let (status, body) = (status.into(), body.into());
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let requests = Arc::new(AtomicUsize::new(0));
            let count = requests.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    let Ok(mut conn) = conn else { return };
                    if read_request(&mut conn) {
                        count.fetch_add(1, Ordering::SeqCst);
                        let _ = write!(
                            conn,
                            "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n\
                             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                }
            });
            Canned { port, requests }
        }

        /// What Azure (and Azurite) answer to a request that fails with `status` and `code`: the
        /// message as the status line's reason phrase, and an XML body behind a byte-order mark
        /// with the message, a request id and the time.
        fn azure_error(status: u16, code: &str, message: &str) -> Canned {
            Canned::start(
                format!("{status} {message}"),
                format!(
                    "\u{feff}<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>{code}</Code>\
                     <Message>{message}\nRequestId:8d5f\nTime:2024-01-01T00:00:00.0000000Z</Message></Error>"
                ),
            )
        }

        fn requests(&self) -> usize {
            self.requests.load(Ordering::SeqCst)
        }
    }

    /// Reads one request's head (the tests only send GETs); false if the client went away.
    fn read_request(conn: &mut TcpStream) -> bool {
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match conn.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => return false,
            }
        }
        true
    }

    /// A loopback port nothing listens on.
    fn closed_port() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }

    /// The site config an admin would write for a store at `port`, with few, fast retries.
    fn config(port: u16, max_retries: u32) -> Config {
        let text = format!(
            "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n\
             [retry]\nmax_retries={max_retries}\ntimeout='30s'\ninitial_backoff='1ms'\nmax_backoff='2ms'\n\
             [[store]]\nprefix='s3://'\nendpoint='http://127.0.0.1:{port}'\nregion='test'\n\
             access_key_id='AKIDTEST'\nsecret_access_key='not-a-secret'\nallow_http=true\n\
             [[store]]\nprefix='az://'\nendpoint='http://127.0.0.1:{port}'\naccount='sluicetest'\n\
             access_key='bm90LWEtc2VjcmV0'\nallow_http=true\n"
        );
        Config::parse(&text, "n1", crate::upload_memory).unwrap()
    }

    fn s3(port: u16, max_retries: u32) -> Arc<dyn ObjectStore> {
        crate::store::open(&config(port, max_retries), ObjectScheme::S3, "data").unwrap()
    }

    fn azure(port: u16, max_retries: u32) -> Arc<dyn ObjectStore> {
        crate::store::open(&config(port, max_retries), ObjectScheme::Azure, "data").unwrap()
    }

    async fn list_error(store: &dyn ObjectStore) -> object_store::Error {
        use futures::TryStreamExt;
        store
            .list(Some(&ObjPath::from("ds")))
            .try_collect::<Vec<_>>()
            .await
            .expect_err("the listing cannot succeed")
    }

    async fn get_error(store: &dyn ObjectStore) -> object_store::Error {
        store
            .get(&ObjPath::from("ds/a.bin"))
            .await
            .expect_err("the GET cannot succeed")
    }

    const NO_SUCH_BUCKET: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message><BucketName>data</BucketName></Error>";
    const ACCESS_DENIED: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>";
    const SLOW_DOWN: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";

    #[tokio::test]
    async fn a_refused_connection_is_unreachable_after_the_configured_retries() {
        let e = get_error(&*s3(closed_port(), 2)).await;
        assert_eq!(classify(&e), StoreErrorKind::Unreachable, "{e}");
        let text = e.to_string();
        assert!(text.contains("after 2 retries"), "{text}");
        let d = describe(&e);
        assert!(
            !d.contains("retries") && !d.contains("retry_timeout"),
            "{d}"
        );
        assert!(d.contains("(Connection refused"), "{d}");

        // The archive's error keeps it as its source and says the same.
        let archive = crate::ArchiveError::Store {
            url: "s3://data".into(),
            op: "get",
            key: "ds/a.bin".into(),
            error: Box::new(e),
        };
        assert_eq!(archive.store_kind(), Some(StoreErrorKind::Unreachable));
        assert_eq!(
            archive.describe(),
            format!("s3://data: get 'ds/a.bin': {d}")
        );
        let source = StdError::source(&archive).expect("the store error is the source");
        assert_eq!(source.to_string(), text);
        let other = crate::ArchiveError::Stopped { tag: "t".into() };
        assert_eq!(other.store_kind(), None);
        assert_eq!(other.describe(), other.to_string());
    }

    #[tokio::test]
    async fn a_missing_bucket_is_not_found_for_listings_and_gets() {
        let server = Canned::start("404 Not Found", NO_SUCH_BUCKET);
        let store = s3(server.port, 3);
        let e = list_error(&*store).await;
        assert!(matches!(e, object_store::Error::Generic { .. }), "{e:?}");
        assert_eq!(classify(&e), StoreErrorKind::NotFound, "{e}");
        let d = describe(&e);
        assert!(
            d.ends_with("404 Not Found: NoSuchBucket: The specified bucket does not exist"),
            "{d}"
        );
        assert!(!d.contains('<'), "{d}");
        let e = get_error(&*store).await;
        assert_eq!(classify(&e), StoreErrorKind::NotFound, "{e}");
        assert_eq!(server.requests(), 2, "a 404 is not retried");
    }

    #[tokio::test]
    async fn a_missing_azure_container_is_not_found() {
        let server = Canned::azure_error(
            404,
            "ContainerNotFound",
            "The specified container does not exist.",
        );
        let store = azure(server.port, 1);
        let e = list_error(&*store).await;
        assert_eq!(classify(&e), StoreErrorKind::NotFound, "{e}");
        let d = describe(&e);
        assert!(
            d.ends_with(
                "404 Not Found: ContainerNotFound: The specified container does not exist."
            ),
            "{d}"
        );
    }

    #[tokio::test]
    async fn forbidden_is_denied_for_gets_and_listings() {
        let server = Canned::start("403 Forbidden", ACCESS_DENIED);
        let store = s3(server.port, 3);
        let e = get_error(&*store).await;
        assert!(
            matches!(e, object_store::Error::PermissionDenied { .. }),
            "{e:?}"
        );
        assert_eq!(classify(&e), StoreErrorKind::Denied);
        let e = list_error(&*store).await;
        assert_eq!(classify(&e), StoreErrorKind::Denied, "{e}");
        assert!(describe(&e).ends_with("AccessDenied: Access Denied"));
        let server = Canned::start("401 Unauthorized", "");
        let e = get_error(&*s3(server.port, 3)).await;
        assert_eq!(classify(&e), StoreErrorKind::Denied, "{e}");
    }

    #[tokio::test]
    async fn slow_down_is_throttled_once_the_configured_retries_are_spent() {
        let server = Canned::start("503 Slow Down", SLOW_DOWN);
        let e = get_error(&*s3(server.port, 2)).await;
        assert_eq!(classify(&e), StoreErrorKind::Throttled, "{e}");
        assert_eq!(
            server.requests(),
            3,
            "one request and max_retries = 2 retries"
        );
        let d = describe(&e);
        assert!(
            d.ends_with("503 Service Unavailable: SlowDown: Please reduce your request rate."),
            "{d}"
        );
        assert!(!d.contains("retries") && !d.contains("<?xml"), "{d}");
    }

    /// Reads of data in S3's GLACIER / DEEP_ARCHIVE or Azure's Archive tier say what it takes,
    /// not "permission denied" or "already exists" (object_store's readings of 403 and 409).
    #[tokio::test]
    async fn data_in_an_offline_class_says_it_must_be_restored_first() {
        let server = Canned::start(
            "403 Forbidden",
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>InvalidObjectState</Code><Message>The operation is not valid for the object's storage class</Message><StorageClass>GLACIER</StorageClass></Error>",
        );
        let e = get_error(&*s3(server.port, 1)).await;
        assert_eq!(classify(&e), StoreErrorKind::Other, "{e}");
        assert_eq!(
            describe(&e),
            "its data is in an offline storage class (an archive tier) and cannot be read until \
             the store restores (rehydrates) it (InvalidObjectState: The operation is not valid \
             for the object's storage class)"
        );
        let server = Canned::azure_error(
            409,
            "BlobArchived",
            "This operation is not permitted on an archived blob.",
        );
        let store = azure(server.port, 1);
        let e = get_error(&*store).await;
        assert_eq!(classify(&e), StoreErrorKind::Other, "{e}");
        let d = describe(&e);
        assert!(
            d.starts_with("its data is in an offline storage class")
                && d.ends_with(
                    "(BlobArchived: This operation is not permitted on an archived blob.)"
                ),
            "{d}"
        );
    }

    #[tokio::test]
    async fn a_server_error_without_a_known_code_is_other() {
        let server = Canned::start(
            "500 Internal Server Error",
            "<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>",
        );
        let e = get_error(&*s3(server.port, 1)).await;
        assert_eq!(classify(&e), StoreErrorKind::Other, "{e}");
        assert_eq!(server.requests(), 2);
        assert!(
            describe(&e).ends_with("InternalError: We encountered an internal error."),
            "{}",
            describe(&e)
        );
    }

    #[tokio::test]
    async fn a_store_that_never_answers_times_out() {
        // Accepts connections and reads requests, never answers.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for mut conn in listener.incoming().flatten() {
                read_request(&mut conn);
                held.push(conn);
            }
        });
        let store = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(format!("http://127.0.0.1:{port}"))
            .with_bucket_name("data")
            .with_region("test")
            .with_access_key_id("AKIDTEST")
            .with_secret_access_key("not-a-secret")
            .with_client_options(
                object_store::ClientOptions::new()
                    .with_allow_http(true)
                    .with_timeout(Duration::from_millis(200)),
            )
            .with_retry(object_store::RetryConfig {
                max_retries: 0,
                ..Default::default()
            })
            .build()
            .unwrap();
        let e = get_error(&store).await;
        assert_eq!(classify(&e), StoreErrorKind::TimedOut, "{e}");
        let d = describe(&e);
        assert!(d.ends_with("(operation timed out)"), "{d}");
    }

    #[tokio::test]
    async fn local_files_not_found_and_other_errors() {
        let dir = tempfile::tempdir().unwrap();
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap();
        let e = get_error(&fs).await;
        assert_eq!(classify(&e), StoreErrorKind::NotFound, "{e}");
        let e = object_store::Error::NotImplemented {
            operation: "copy".into(),
            implementer: "test".into(),
        };
        assert_eq!(classify(&e), StoreErrorKind::Other);
        assert_eq!(describe(&e), e.to_string());
    }
}
