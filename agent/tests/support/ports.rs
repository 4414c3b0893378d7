//! A free port for a test's listener (shared by the agent's tests and the end-to-end suite).

/// A port on 127.0.0.1 that nothing listens on right now, taken below the kernel's ephemeral range:
/// a port the kernel hands out (`bind(0)`) can be taken again as the source port of any outgoing
/// connection (srun's, an agent's) before the test's listener binds it, which then fails with
/// EADDRINUSE (seen in CI, in a gloo rendezvous).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, span) = (
        ephemeral_from.saturating_sub(8192),
        8192u16.min(ephemeral_from),
    );
    // Start where this process's id points so that two test binaries at once do not walk the
    // same ports in the same order.
    let start = std::process::id() % u32::from(span);
    for _ in 0..span {
        let step = u32::from(NEXT.fetch_add(1, Ordering::Relaxed));
        let port = low + ((start + step) % u32::from(span)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 in {low}..{}", low + span)
}
