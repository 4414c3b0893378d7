//! `sluice doctor`'s clock check: this node's clock against each object store's. S3 and Azure
//! refuse requests signed more than 15 minutes off their clock (`RequestTimeTooSkewed`,
//! `AuthenticationFailed`), so a drifting node stops staging and archiving with errors that name
//! the credentials, not the clock; and retention compares the agent's times with the store's.
//!
//! The store's time is the `Date` header of one unauthenticated `HEAD` of its endpoint (every
//! HTTP server sends one, whatever it answers the request itself), taken at the middle of the
//! round trip.

use super::{Finding, Status};
use sluice_core::config::StoreProfile;
use std::time::{Duration, SystemTime};

/// Beyond this the clock is worth a look (and retention ages are off by it).
pub const WARN_AFTER: Duration = Duration::from_secs(30);
/// Beyond this the stores' 15-minute signature window is near: requests start failing soon.
pub const FAIL_AFTER: Duration = Duration::from_secs(5 * 60);

/// The endpoint whose clock speaks for `profile`'s store: its `endpoint`, or the service's own.
pub fn endpoint_of(profile: &StoreProfile) -> Option<String> {
    if let Some(e) = &profile.endpoint {
        return Some(e.trim_end_matches('/').to_string());
    }
    let scheme = profile.prefix.split_once("://")?.0;
    match scheme {
        "s3" => Some(format!(
            "https://s3.{}.amazonaws.com",
            profile.region.as_deref().unwrap_or("us-east-1")
        )),
        "az" | "azure" if profile.use_emulator => Some("http://127.0.0.1:10000".into()),
        "az" | "azure" => profile
            .account
            .as_ref()
            .map(|a| format!("https://{a}.blob.core.windows.net")),
        "gs" => Some("https://storage.googleapis.com".into()),
        _ => None,
    }
}

/// The skew of this node's clock against the server's at `endpoint`: positive when this node is
/// ahead.
pub async fn skew(endpoint: &str, timeout: Duration) -> Result<f64, String> {
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| e.to_string())?;
    let sent = SystemTime::now();
    let response = client
        .head(endpoint)
        .send()
        .await
        .map_err(|e| format!("HEAD {endpoint}: {e}"))?;
    let received = SystemTime::now();
    let date = response
        .headers()
        .get(reqwest::header::DATE)
        .ok_or_else(|| format!("{endpoint} sent no Date header"))?
        .to_str()
        .map_err(|_| format!("{endpoint} sent an unreadable Date header"))?;
    let theirs = httpdate::parse_http_date(date)
        .map_err(|e| format!("{endpoint} sent Date {date:?}: {e}"))?;
    let rtt = received.duration_since(sent).unwrap_or_default();
    let ours = sent + rtt / 2;
    Ok(match ours.duration_since(theirs) {
        Ok(ahead) => ahead.as_secs_f64(),
        Err(behind) => -behind.duration().as_secs_f64(),
    })
}

/// The finding for one endpoint. The `Date` header has whole seconds, so up to a second of skew is
/// noise.
pub fn judge_clock(endpoint: &str, skew: Result<f64, String>) -> Finding {
    let check = format!("clock vs {endpoint}");
    let fix_sync = "sync this node's clock (chronyc tracking / timedatectl; enable chrony or ntpd)";
    match skew {
        Err(e) => Finding::new(
            &check,
            Status::Warn,
            format!("could not read the store's clock: {e}"),
            Some(
                "check that the endpoint is reachable (the store check says more); the clock was not compared"
                    .into(),
            ),
        ),
        Ok(s) => {
            let off = Duration::from_secs_f64(s.abs());
            let way = if s > 0.0 { "ahead of" } else { "behind" };
            let text = format!("this node's clock is {:.0} s {way} the store's", s.abs());
            if off > FAIL_AFTER {
                Finding::new(
                    &check,
                    Status::Fail,
                    format!(
                        "{text}: S3 and Azure refuse requests signed more than 15 minutes off, so staging and archiving will fail"
                    ),
                    Some(fix_sync.into()),
                )
            } else if off > WARN_AFTER {
                Finding::new(
                    &check,
                    Status::Warn,
                    format!("{text}: retention and archive ages are off by as much"),
                    Some(fix_sync.into()),
                )
            } else {
                Finding::new(&check, Status::Pass, format!("{text} (within {} s)", WARN_AFTER.as_secs()), None)
            }
        }
    }
}

/// One clock finding per distinct endpoint of the profiles.
pub async fn check_clocks(profiles: &[StoreProfile], timeout: Duration) -> Vec<Finding> {
    let mut seen: Vec<String> = Vec::new();
    for p in profiles {
        if let Some(e) = endpoint_of(p)
            && !seen.contains(&e)
        {
            seen.push(e);
        }
    }
    let mut out = Vec::new();
    for e in seen {
        out.push(judge_clock(&e, skew(&e, timeout).await));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_skew_decides_pass_warn_or_fail_with_the_fix() {
        let f = judge_clock("http://127.0.0.1:3900", Ok(1.4));
        assert_eq!(f.status, Status::Pass);
        assert!(f.detail.contains("1 s ahead of"), "{}", f.detail);
        let f = judge_clock("http://s", Ok(-95.0));
        assert_eq!(f.status, Status::Warn);
        assert!(f.detail.contains("95 s behind"), "{}", f.detail);
        assert!(f.fix.as_deref().unwrap().contains("chrony"));
        let f = judge_clock("http://s", Ok(16.0 * 60.0));
        assert_eq!(f.status, Status::Fail);
        assert!(f.detail.contains("refuse requests"), "{}", f.detail);
        let f = judge_clock("http://s", Err("HEAD http://s: refused".into()));
        assert_eq!(f.status, Status::Warn);
        assert!(f.detail.contains("could not read the store's clock"));
    }

    #[test]
    fn each_profile_has_the_endpoint_its_store_answers_on() {
        let p = |prefix: &str| StoreProfile {
            prefix: prefix.into(),
            ..StoreProfile::default()
        };
        assert_eq!(
            endpoint_of(&p("s3://b")).as_deref(),
            Some("https://s3.us-east-1.amazonaws.com")
        );
        let mut own = p("s3://b");
        own.endpoint = Some("http://127.0.0.1:3900/".into());
        assert_eq!(endpoint_of(&own).as_deref(), Some("http://127.0.0.1:3900"));
        let mut az = p("az://");
        az.account = Some("acct".into());
        assert_eq!(
            endpoint_of(&az).as_deref(),
            Some("https://acct.blob.core.windows.net")
        );
        az.use_emulator = true;
        assert_eq!(endpoint_of(&az).as_deref(), Some("http://127.0.0.1:10000"));
        assert_eq!(
            endpoint_of(&p("gs://b")).as_deref(),
            Some("https://storage.googleapis.com")
        );
    }

    /// A local HTTP server whose Date is an hour behind: the real request path reads it.
    #[tokio::test]
    async fn the_stores_date_header_is_read_over_http() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let hour_ago = SystemTime::now() - Duration::from_secs(3600);
            let reply = format!(
                "HTTP/1.1 403 Forbidden\r\nDate: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                httpdate::fmt_http_date(hour_ago)
            );
            s.write_all(reply.as_bytes()).await.unwrap();
        });
        let s = skew(&format!("http://{addr}"), Duration::from_secs(5))
            .await
            .unwrap();
        assert!((3590.0..3610.0).contains(&s), "{s}");
        assert_eq!(
            judge_clock("x", Ok(s)).status,
            Status::Fail,
            "an hour ahead fails"
        );
    }
}
