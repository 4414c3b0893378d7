//! The job-wide budget for origin reads of units whose owner could not serve them: its agent was
//! lost (the unit's next owner by the hash reads it), or it answered that its own read failed or
//! that it does not hold that version (the asker reads it). Losing nodes must not turn into a
//! storm at the origin (Dragonfly's "back-to-source" storms on large clusters): however many nodes
//! a job has and however many it loses, those reads go at most `peer.fallback_concurrency` at a
//! time and `peer.fallback_rate` bytes a second, over the whole job.
//!
//! No node asks another for room: each takes its share, the budget divided by the nodes it still
//! counts (at least one request, so every node can finish), and its share grows as nodes are
//! routed around. A job of more nodes than `fallback_concurrency` makes at most one such request
//! per node at a time. A node's own units, read from the origin as they would be without any
//! loss, take nothing from this budget, only from the node's stage budget, as before.
//!
//! Reads wait here without holding anything another node waits on (no unit, no stage buffer), so
//! the budget adds no edge to the job's wait graph.

use super::JobPeers;
use sluice_core::config::PeerConfig;
use sluice_core::rt::lock;
use sluice_peer::Unit;
use std::sync::Arc;
use std::sync::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Duration, Instant};

/// This node's share of its job's fallback budget.
pub(super) struct Fallback {
    /// The job's `peer.fallback_concurrency`, and rate.
    concurrency: usize,
    rate: Option<u64>,
    /// This node's slots: its share of `concurrency`, grown as nodes are routed around.
    slots: Arc<Semaphore>,
    /// Its share now, and the nodes it was computed over.
    share: Mutex<Share>,
}

struct Share {
    slots: usize,
    nodes: usize,
    /// When this node's share of the rate lets its next read start.
    next: Option<Instant>,
}

impl Fallback {
    pub(super) fn new(cfg: &PeerConfig, nodes: usize) -> Fallback {
        let slots = share_of(cfg.fallback_concurrency, nodes);
        Fallback {
            concurrency: cfg.fallback_concurrency,
            rate: cfg.fallback_rate,
            slots: Arc::new(Semaphore::new(slots)),
            share: Mutex::new(Share {
                slots,
                nodes,
                next: None,
            }),
        }
    }

    /// The job's nodes this node counts are now `nodes`: its share grows to match.
    pub(super) fn reshare(&self, nodes: usize) {
        let mut share = lock(&self.share);
        let slots = share_of(self.concurrency, nodes);
        share.nodes = nodes;
        if slots > share.slots {
            self.slots.add_permits(slots - share.slots);
            share.slots = slots;
        }
    }

    /// This node's slots now (a test reads them).
    #[cfg(test)]
    pub(super) fn slots(&self) -> usize {
        lock(&self.share).slots
    }

    /// Waits for a slot, then for this node's share of the rate to let `len` bytes go.
    async fn admit(&self, len: u64) -> OwnedSemaphorePermit {
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the fallback semaphore is never closed");
        if let Some(rate) = self.rate {
            let start = {
                let mut share = lock(&self.share);
                let per_node = (rate / share.nodes.max(1) as u64).max(1);
                let now = Instant::now();
                let start = share.next.map_or(now, |t| t.max(now));
                share.next = Some(start + Duration::from_secs_f64(len as f64 / per_node as f64));
                start
            };
            tokio::time::sleep_until(start).await;
        }
        permit
    }
}

/// A node's share of `concurrency` over `nodes`: at least one.
fn share_of(concurrency: usize, nodes: usize) -> usize {
    (concurrency / nodes.max(1)).max(1)
}

impl JobPeers {
    /// Whether this node reading `unit` from the origin is a fallback: its owner among all of the
    /// job's nodes is another node.
    pub(crate) fn is_fallback(&self, unit: &Unit) -> bool {
        self.owner_among_all(&unit.key()) != self.node
    }

    /// Holds an origin read of `unit` (of `len` bytes) back within the job's fallback budget
    /// when it is a fallback; the read goes ahead once this returns, and holds the permit until
    /// it ends. `None`: this node's own unit, not held back.
    pub(crate) async fn fallback(&self, unit: &Unit) -> Option<OwnedSemaphorePermit> {
        if !self.is_fallback(unit) {
            return None;
        }
        Some(self.fallback.admit(unit.len).await)
    }

    /// Called when a node is routed around: the survivors' shares grow.
    pub(super) fn reshare_fallback(&self) {
        self.fallback.reshare(self.alive_nodes().len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(concurrency: usize, rate: Option<u64>) -> PeerConfig {
        let text = format!(
            "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n\
             [peer]\nfallback_concurrency = {concurrency}\nfallback_rate = '{}'\n",
            rate.unwrap_or(0)
        );
        sluice_core::config::Config::parse(&text, "n1", |_| 1 << 20)
            .unwrap()
            .peer
            .unwrap()
    }

    #[test]
    fn each_node_takes_its_share_of_the_job_and_more_as_nodes_are_lost() {
        let f = Fallback::new(&cfg(16, None), 16);
        assert_eq!(f.slots(), 1);
        f.reshare(11);
        assert_eq!(f.slots(), 1, "16 / 11 is still one each");
        f.reshare(4);
        assert_eq!(f.slots(), 4);
        f.reshare(8);
        assert_eq!(f.slots(), 4, "a share never shrinks under reads holding it");
        // More nodes than the budget: one request per node, so that every node can finish.
        assert_eq!(Fallback::new(&cfg(4, None), 32).slots(), 1);
        assert_eq!(Fallback::new(&cfg(64, None), 3).slots(), 21);
    }

    #[tokio::test(start_paused = true)]
    async fn a_nodes_share_of_the_rate_spaces_its_reads() {
        // 8 MiB/s for a job of 4 nodes: 2 MiB/s here, so four 1 MiB reads take 1.5 s to start.
        let f = Fallback::new(&cfg(16, Some(8 << 20)), 4);
        let t = Instant::now();
        for _ in 0..4 {
            drop(f.admit(1 << 20).await);
        }
        assert_eq!(t.elapsed(), Duration::from_millis(1500));
        // Half the nodes lost: the rest go twice as fast.
        f.reshare(2);
        let t = Instant::now();
        drop(f.admit(4 << 20).await); // starts when the last one's 0.5 s are over
        drop(f.admit(1 << 20).await);
        assert_eq!(t.elapsed(), Duration::from_millis(500 + 1000));
    }
}
