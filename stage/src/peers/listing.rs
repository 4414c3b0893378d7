//! One listing pass per job: an object-store dataset is listed from the origin by one node of the
//! job, and its other nodes take the listing from it (`sluice_peer::listing` carries the pages),
//! so the origin sees one listing (and, for a dataset named by a key, one `HEAD`) per job, not one
//! per node. Listing costs more than reading at scale: a `LIST` of 1,000 keys costs ten `GET`s,
//! and N nodes listing a dataset of 100,000 keys each is N × 100 sequential requests.
//!
//! - **Who lists.** The nodes this node still counts, itself included, ranked by the rendezvous
//!   hash of the dataset's name: every node agrees on the ranking without a word. The first lists
//!   the origin. Every other node takes the listing from its parent in a tree of that ranking, the
//!   node at rank `(r - 1) / LISTING_FANOUT` for rank `r` ([`listing_parent`]): in a job of up to
//!   nine nodes that is the first one; in a job of 1,024, no node passes it on to more than
//!   [`LISTING_FANOUT`] others, and it is four hops from the origin.
//! - **Every node answers for what it listed or was passed** ([`Book`]), in the order it passed
//!   the objects on to its own staging, and as soon as it did. A node asks only a node ranked
//!   before it, so waiting for a listing never closes a cycle; and every object a node stages is
//!   in its book before any of its units is asked for, so no node waits for a listing behind a
//!   unit that needs it.
//! - **Pages** are asked for by the index of their first object; an answer holds what the node has
//!   from there, up to [`PAGE_OBJECTS`], lingering [`LINGER`] for more while its own listing goes
//!   on, so a follower asks about once per S3 page rather than once per object.
//! - **Fallback**, by the rules units follow. A page that does not check (its hash, its MAC, its
//!   JSON) or a connection closed unanswered: the same node is asked once more. Then, or at once
//!   when it is unreachable, died or ended the job, the node is routed around for the rest of the
//!   job ([`JobPeers::lose`], with the job's note), and the next node of the hash is asked from the
//!   first object again, the keys already passed on skipped (or this node lists the origin, when it
//!   is next). A node that
//!   says its listing failed (the dataset is missing, access denied, the store is down), that it
//!   does not stage this dataset from this source, or whose agent predates listings: this node
//!   lists the origin itself, so the job gets the origin's own answer.
//! - **What a page is trusted with.** It comes from an agent of the job (MAC'd under the job key,
//!   its hash checked), and its keys go through the same `map_key` as the origin's: a page can
//!   name objects, never paths outside the dataset. The versions (ETag, version id) are the
//!   lister's, so every node stages the same version of each object and asks for it with
//!   `If-Match`: an object overwritten during the job fails its staging on every node alike.
//!   An object's modification time is not passed on (staging does not use it).

use super::{JobPeers, Trouble, error_chain};
use crate::StageError;
use crate::object::origin_error;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path as ObjPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use sluice_core::rt::lock;
use sluice_peer::listing::PageRequest;
use sluice_peer::{PeerError, UnitError, ranked};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The most nodes one node passes a listing on to.
pub(crate) const LISTING_FANOUT: usize = 8;

/// The most objects one page holds (an S3 listing page's).
pub(crate) const PAGE_OBJECTS: usize = 1000;
/// How long a node holds a page request it could answer with fewer than [`PAGE_OBJECTS`] while its
/// own listing goes on, for more to come.
pub(crate) const LINGER: Duration = Duration::from_millis(200);

/// One object as a page carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    key: String,
    size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    e_tag: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<String>,
}

impl Entry {
    fn of(meta: &ObjectMeta) -> Entry {
        Entry {
            key: meta.location.to_string(),
            size: meta.size,
            e_tag: meta.e_tag.clone(),
            version: meta.version.clone(),
        }
    }

    /// The object as the origin listed it (as `object_store` parses a listed key), without its
    /// modification time.
    fn meta(&self) -> Result<ObjectMeta, object_store::path::Error> {
        Ok(ObjectMeta {
            location: ObjPath::parse(&self.key)?,
            last_modified: Default::default(),
            size: self.size,
            e_tag: self.e_tag.clone(),
            version: self.version.clone(),
        })
    }
}

/// What a page answer holds.
#[derive(Debug, Serialize, Deserialize)]
struct Page {
    /// The dataset is the one object `objects[0]` (its name is the object's key, found by `HEAD`).
    #[serde(default)]
    single: bool,
    objects: Vec<Entry>,
    /// Whether objects follow the last of these.
    more: bool,
}

/// One dataset's listing on this node, as its peers are answered from it.
#[derive(Debug)]
pub(super) struct Book {
    /// The URL this node stages it from: a node asking about another source is not answered.
    source: String,
    single: bool,
    objects: Vec<Entry>,
    /// `None` while objects may still come; why no more will, if it did not end whole.
    end: Option<Result<(), String>>,
}

impl Book {
    pub(super) fn close(&mut self, why: &str) {
        self.end
            .get_or_insert_with(|| Err(format!("staging ended on this node: {why}")));
    }
}

/// The index in `nodes` of the node `me` takes the listing of dataset `name` from: its parent in
/// the tree of the nodes ranked by the rendezvous hash of the name (see the module header);
/// `None` for the first, which lists the origin.
pub(crate) fn listing_parent(name: &str, nodes: &[String], me: &str) -> Option<usize> {
    let order = ranked(&format!("\0listing/{name}"), nodes);
    let rank = order
        .iter()
        .position(|&i| nodes[i] == me)
        .expect("a node counts itself");
    (rank > 0).then(|| order[(rank - 1) / LISTING_FANOUT])
}

/// What a node can answer about a page now.
enum PageNow {
    Final(Result<Bytes, UnitError>),
    /// Some objects, fewer than a page, and the listing goes on.
    Some,
    Nothing,
}

impl JobPeers {
    /// The node to take the listing of dataset `name` from, or `None` when this node lists the
    /// origin.
    pub(crate) fn lister_of(&self, name: &str) -> Option<String> {
        let alive = self.alive_nodes();
        listing_parent(name, &alive, &self.node).map(|i| alive[i].clone())
    }

    fn book(&self, name: &str, change: impl FnOnce(&mut Book)) {
        if let Some(book) = lock(&self.state).listings.get_mut(name) {
            change(book);
        }
        self.bump();
    }

    fn page_now(&self, asked: &PageRequest, lingered: bool) -> PageNow {
        let st = lock(&self.state);
        let Some(book) = st.listings.get(&asked.dataset) else {
            // Not begun here: it may still be, while this node stages the job's datasets.
            return if st.listing > 0 && st.closed.is_none() {
                PageNow::Nothing
            } else {
                PageNow::Final(Err(UnitError::NotOwner))
            };
        };
        if book.source != asked.source {
            return PageNow::Final(Err(UnitError::NotOwner));
        }
        let (len, from) = (book.objects.len() as u64, asked.from);
        let whole = from.saturating_add(PAGE_OBJECTS as u64) <= len;
        match &book.end {
            Some(Err(why)) => return PageNow::Final(Err(UnitError::Failed(why.clone()))),
            Some(Ok(())) if from > len => {
                return PageNow::Final(Err(UnitError::Failed(format!(
                    "the listing has {len} objects; object {from} was asked for"
                ))));
            }
            Some(Ok(())) => {}
            None if whole || (lingered && from < len) => {}
            None if from < len => return PageNow::Some,
            None => return PageNow::Nothing,
        }
        let to = len.min(from + PAGE_OBJECTS as u64);
        let page = Page {
            single: book.single,
            objects: book.objects[from as usize..to as usize].to_vec(),
            more: book.end.is_none() || to < len,
        };
        drop(st);
        PageNow::Final(
            serde_json::to_vec(&page)
                .map(Bytes::from)
                .map_err(|e| UnitError::Failed(format!("encoding a listing page: {e}"))),
        )
    }

    /// The answer to a peer's page request: waits while this node has nothing from the page's
    /// first object on, and up to [`LINGER`] while it has less than a page.
    pub(super) async fn wait_page(&self, asked: &PageRequest) -> Result<Bytes, UnitError> {
        let mut changes = self.changed.subscribe();
        let mut since: Option<Instant> = None;
        loop {
            let lingered = since.is_some_and(|t| t.elapsed() >= LINGER);
            let waited = match self.page_now(asked, lingered) {
                PageNow::Final(answer) => return answer,
                PageNow::Some => {
                    let t = *since.get_or_insert_with(Instant::now);
                    tokio::time::timeout_at(t + LINGER, changes.changed()).await
                }
                PageNow::Nothing => Ok(changes.changed().await),
            };
            if let Ok(Err(_)) = waited {
                return Err(UnitError::Gone);
            }
        }
    }

    async fn fetch_page(
        &self,
        node: &str,
        name: &str,
        source: &str,
        from: u64,
    ) -> Result<Page, PeerError> {
        let asked = PageRequest {
            dataset: name.to_string(),
            source: source.to_string(),
            from,
        };
        let addr = self.cfg.addr_of(node);
        let bytes = self.client.fetch_listing(&addr, &self.key, &asked).await?;
        serde_json::from_slice(&bytes).map_err(|e| PeerError::Corrupt {
            addr,
            unit: format!("the listing of {name}"),
            what: format!("a page that does not parse: {e}"),
        })
    }

    /// Where the listing goes after asking `node` failed with `e`, by the rules units follow
    /// ([`JobPeers::next_after`]): the same node once more after a page that does not check or a
    /// connection closed unanswered (`retried` remembers it); another node (or this one,
    /// `Ok(None)`) when `node` was routed around; else `Err`: list the origin here.
    fn after_page_error(
        &self,
        node: &str,
        name: &str,
        e: &PeerError,
        retried: &mut Option<String>,
    ) -> Result<Option<String>, ()> {
        let why = error_chain(e);
        match e {
            PeerError::Corrupt { .. } | PeerError::Dropped { .. }
                if retried.as_deref() != Some(node) =>
            {
                tracing::warn!("{name}: the listing from node {node}: {why}; asking it again");
                *retried = Some(node.to_string());
                Ok(Some(node.to_string()))
            }
            PeerError::Corrupt { .. } => {
                self.lose(node, Trouble::Corrupt, &why);
                Ok(self.lister_of(name))
            }
            // An agent of a release without listings answers "no such resource".
            PeerError::Refused { status: 404, .. }
            | PeerError::NotOwner { .. }
            | PeerError::Failed { .. } => {
                tracing::info!(
                    job_id = self.job,
                    "{name}: the listing from node {node}: {why}; this node lists the origin itself"
                );
                Err(())
            }
            _ => {
                self.lose(node, Trouble::Lost, &why);
                Ok(self.lister_of(name))
            }
        }
    }
}

/// A dataset as [`Listing::open`] finds it.
pub(crate) enum Listed {
    /// Its name is one object's key.
    Single(ObjectMeta),
    /// The objects under its prefix, as they come.
    Objects(Listing),
}

/// Where a [`Listing`] takes its objects from now.
enum Reading {
    Origin(BoxStream<'static, object_store::Result<ObjectMeta>>),
    Peer { node: String, next: u64, more: bool },
    Done,
}

/// An object-store dataset's listing on this node: from the origin, or passed on by another node
/// of the job (see the module header). Each object it yields is in this node's book first.
pub(crate) struct Listing {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    source: String,
    name: String,
    peers: Option<Arc<JobPeers>>,
    reading: Reading,
    queue: VecDeque<ObjectMeta>,
    /// Keys yielded so far, with peers (after a change of lister, the new one's listing is taken
    /// from its first object, and what was yielded already is skipped).
    seen: HashSet<String>,
    /// The node asked again after a page of it did not check (once per node, as for units).
    retried: Option<String>,
}

impl Listing {
    /// The dataset `name` (from `source`, the objects under `prefix` of `store`), listed by the
    /// origin or taken from the job's lister when `peers` share the job's datasets.
    pub(crate) async fn open(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        source: &str,
        name: &str,
        peers: Option<Arc<JobPeers>>,
    ) -> Result<Listed, StageError> {
        let mut listing = Listing {
            store,
            prefix: prefix.to_string(),
            source: source.to_string(),
            name: name.to_string(),
            peers,
            reading: Reading::Done,
            queue: VecDeque::new(),
            seen: HashSet::new(),
            retried: None,
        };
        let mut lister = None;
        if let Some(p) = &listing.peers {
            lock(&p.state).listings.insert(
                name.to_string(),
                Book {
                    source: source.to_string(),
                    single: false,
                    objects: Vec::new(),
                    end: None,
                },
            );
            lister = p.lister_of(name);
        }
        while let Some(node) = lister.take() {
            let peers = listing
                .peers
                .clone()
                .expect("a lister comes from the peers");
            let e = match peers.fetch_page(&node, name, source, 0).await {
                Ok(page) if page.single => match page.objects.first().map(Entry::meta) {
                    Some(Ok(meta)) => {
                        listing.publish_single(&meta);
                        return Ok(Listed::Single(meta));
                    }
                    _ => listing.corrupt(&node, "a one-object page without its object"),
                },
                Ok(page) => match listing.take_page(&node, 0, page) {
                    Ok(()) => return Ok(Listed::Objects(listing)),
                    Err(e) => e,
                },
                Err(e) => e,
            };
            lister = peers
                .after_page_error(&node, name, &e, &mut listing.retried)
                .ok()
                .flatten();
        }
        listing.open_origin().await
    }

    /// Lists the origin: `HEAD` of the prefix first (a dataset may be one object), then the
    /// objects under it.
    async fn open_origin(mut self) -> Result<Listed, StageError> {
        if !self.prefix.is_empty() && self.seen.is_empty() {
            match self.store.head(&ObjPath::from(self.prefix.as_str())).await {
                Ok(meta) => {
                    self.publish_single(&meta);
                    return Ok(Listed::Single(meta));
                }
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => {
                    let e = origin_error(&self.source, e);
                    self.end(Err(e.to_string()));
                    return Err(e);
                }
            }
        }
        self.list_origin();
        Ok(Listed::Objects(self))
    }

    fn list_origin(&mut self) {
        let prefix = (!self.prefix.is_empty()).then(|| ObjPath::from(self.prefix.as_str()));
        self.reading = Reading::Origin(self.store.list(prefix.as_ref()));
    }

    /// The next object of the dataset, `None` after the last one.
    pub(crate) async fn next(&mut self) -> Option<Result<ObjectMeta, StageError>> {
        loop {
            while let Some(meta) = self.queue.pop_front() {
                if self.peers.is_none() || self.seen.insert(meta.location.to_string()) {
                    self.publish(&meta);
                    return Some(Ok(meta));
                }
            }
            match &mut self.reading {
                Reading::Done => return None,
                Reading::Origin(stream) => match stream.next().await {
                    Some(Ok(meta)) => self.queue.push_back(meta),
                    Some(Err(e)) => {
                        let e = origin_error(&self.source, e);
                        self.end(Err(e.to_string()));
                        self.reading = Reading::Done;
                        return Some(Err(e));
                    }
                    None => {
                        self.end(Ok(()));
                        self.reading = Reading::Done;
                    }
                },
                Reading::Peer { more: false, .. } => {
                    self.end(Ok(()));
                    self.reading = Reading::Done;
                }
                Reading::Peer { node, next, .. } => {
                    let (node, from) = (node.clone(), *next);
                    let peers = self.peers.clone().expect("a lister comes from the peers");
                    let taken = match peers
                        .fetch_page(&node, &self.name, &self.source, from)
                        .await
                    {
                        Ok(page) if !page.single => self.take_page(&node, from, page),
                        Ok(_) => Err(self.corrupt(&node, "a one-object page past the first")),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = taken {
                        self.switch(&peers, &node, from, &e);
                    }
                }
            }
        }
    }

    /// Queues the objects of `page` (from object `from` on), taken from `node`; a page that does
    /// not check is refused whole.
    fn take_page(&mut self, node: &str, from: u64, page: Page) -> Result<(), PeerError> {
        if page.more && page.objects.is_empty() {
            // More to come but nothing sent: not a node to wait on.
            return Err(self.corrupt(node, "an empty page with more to come"));
        }
        let metas = page
            .objects
            .iter()
            .map(Entry::meta)
            .collect::<Result<Vec<_>, _>>()
            // The origin's listing fails on a key `object_store` does not parse.
            .map_err(|_| self.corrupt(node, "a key the origin could not have listed"))?;
        self.reading = Reading::Peer {
            node: node.to_string(),
            next: from + metas.len() as u64,
            more: page.more,
        };
        self.queue.extend(metas);
        Ok(())
    }

    /// The listing goes on after `node` failed with `e` at object `from`: from the same node at
    /// the same object, from the first object of the next lister, or from the origin.
    fn switch(&mut self, peers: &Arc<JobPeers>, node: &str, from: u64, e: &PeerError) {
        match peers.after_page_error(node, &self.name, e, &mut self.retried) {
            Ok(Some(next)) => {
                let next_from = if next == node { from } else { 0 };
                self.reading = Reading::Peer {
                    node: next,
                    next: next_from,
                    more: true,
                }
            }
            Ok(None) | Err(()) => self.list_origin(),
        }
    }

    fn corrupt(&self, node: &str, what: &str) -> PeerError {
        PeerError::Corrupt {
            addr: node.to_string(),
            unit: format!("the listing of {}", self.name),
            what: what.to_string(),
        }
    }

    fn publish(&self, meta: &ObjectMeta) {
        if let Some(p) = &self.peers {
            p.book(&self.name, |b| b.objects.push(Entry::of(meta)));
        }
    }

    fn publish_single(&self, meta: &ObjectMeta) {
        if let Some(p) = &self.peers {
            p.book(&self.name, |b| {
                b.single = true;
                b.objects = vec![Entry::of(meta)];
                b.end = Some(Ok(()));
            });
        }
    }

    fn end(&self, how: Result<(), String>) {
        if let Some(p) = &self.peers {
            p.book(&self.name, |b| {
                b.end.get_or_insert(how);
            });
        }
    }
}

impl Drop for Listing {
    /// A listing dropped before its end (the staging failed or was cancelled): nodes waiting for
    /// more of it are told to list the origin themselves.
    fn drop(&mut self) {
        self.end(Err("this node stopped listing the dataset".into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The listing tree of a job: one root, which lists the origin; every other node's parent is
    /// ranked before it (so no wait closes a cycle); no node has more than LISTING_FANOUT
    /// children; a 1,024-node job is four hops deep; and a job of nine nodes or fewer takes it
    /// from the root alone.
    #[test]
    fn a_listing_passes_down_a_tree_of_bounded_fan_out() {
        for n in [2usize, 3, 9, 10, 32, 1024] {
            let nodes: Vec<String> = (0..n).map(|i| format!("node{i:04}")).collect();
            let order = ranked("\0listing/train", &nodes);
            let rank = |i: usize| order.iter().position(|&j| j == i).unwrap();
            let mut children = vec![0usize; n];
            let mut roots = 0;
            let mut deepest = 0;
            for (i, node) in nodes.iter().enumerate() {
                let mut depth = 0;
                let mut at = i;
                while let Some(p) = listing_parent("train", &nodes, &nodes[at]) {
                    assert!(
                        rank(p) < rank(at),
                        "{n} nodes: a parent ranked after its child"
                    );
                    depth += 1;
                    at = p;
                }
                deepest = deepest.max(depth);
                match listing_parent("train", &nodes, node) {
                    Some(p) => children[p] += 1,
                    None => roots += 1,
                }
            }
            assert_eq!(roots, 1, "{n} nodes");
            assert!(children.iter().all(|&c| c <= LISTING_FANOUT), "{n} nodes");
            let want = match n {
                ..=9 => 1,
                1024 => 4,
                _ => deepest,
            };
            assert_eq!(deepest, want, "{n} nodes");
        }
    }
}
