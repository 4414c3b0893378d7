//! Scraping an in-process agent's Prometheus endpoint as Prometheus does (`agent/tests/metrics.rs`,
//! `replicas.rs`).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

/// `GET /metrics` as Prometheus sends it: (status line, content type, body).
pub fn get(port: u16, path: &str) -> (String, String, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connecting to the metrics port {port}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type: ")
                .map(String::from)
        })
        .unwrap_or_default();
    (
        head.lines().next().unwrap().to_string(),
        content_type,
        body.to_string(),
    )
}

/// The series of a scrape: `name{labels}` → value.
pub async fn scrape(port: u16) -> (BTreeMap<String, f64>, String) {
    let (status, content_type, body) = tokio::task::spawn_blocking(move || get(port, "/metrics"))
        .await
        .unwrap();
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let series = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("bad line {l:?}"));
            (
                k.to_string(),
                v.parse().unwrap_or_else(|_| panic!("bad value in {l:?}")),
            )
        })
        .collect();
    (series, body)
}
