//! Peer transfers: the agents of one job's nodes share the dataset so that each byte is read
//! from the origin once per job, however many nodes the job has.
//!
//! This crate owns the peer layer; the stager (`sluice-stage`) decides what to fetch from whom.
//!
//! - [`owner`]: units (ranges of a file) and who owns each — rendezvous hashing over the job's
//!   node list, the same answer on every node;
//! - [`pieces`]: a unit its owner reads from the origin as several pieces at once, hashed as one;
//! - [`auth`]: the root-only cluster secret, the per-job key derived from it, the MACs on requests
//!   and responses;
//! - [`server`]: [`PeerServer`] serves this node's units of each registered job from the
//!   stager's [`UnitSource`], waiting for units the owner is still reading;
//! - [`client`]: [`PeerClient::fetch`] takes one unit from its owner and checks its length, hash
//!   and MAC before returning it;
//! - [`replica`]: replicas of a node's part of a checkpoint on other nodes of the job — the
//!   types, the [`ReplicaStore`] the agent keeps them in, and the wire; the server and client
//!   halves are [`PeerServer::serve_replicas`] and `PeerClient::{push,seal,free}_replica`,
//!   [`PeerClient::replica_index`], [`PeerClient::replica_room`],
//!   [`PeerClient::fetch_replica_into`];
//! - [`listing`]: a dataset's listing passed from the node that listed the origin to the job's
//!   other nodes, page by page (one listing pass per job);
//! - [`events`]: what an agent tells the other agents of its job — that it committed a
//!   checkpoint ([`PeerClient::notify_commit`]), handed to the node's [`JobEvents`]
//!   ([`PeerServer::serve_events`]);
//! - [`release`]: which sluice release each peer runs (`x-sluice-version`), logged once per peer of
//!   another release (a rolling upgrade);
//! - [`http`]: the accept loop the peer port and the agent's Prometheus endpoint share (connection
//!   bounds, header timeout), and [`http::bind_tcp`] that binds their ports.
//!
//! # On the wire
//!
//! HTTP/1.1 over TCP (hyper), on the address `[peer]` gives each node:
//!
//! ```text
//! GET /v1/jobs/{job}/units?file={percent-encoded}&offset={n}&len={n}
//! x-sluice-node: n2                  the requesting node, as the job's node list names it
//! x-sluice-time: 1718000000          its clock, seconds since the epoch
//! x-sluice-mac:  {hex}               keyed BLAKE3 (job key) over method, path+query, job, node, time
//! x-sluice-version: 0.2.0            the sender's release (none before 0.2.0; not MAC'd: only logged)
//!
//! 200  content-length: {len}, x-sluice-blake3: {hex}, x-sluice-mac: {hex}, body: the unit's bytes
//! 503  pending     the owner has not read the unit within the poll window; ask again
//! 409  not owner   502  the owner's origin read failed   410  the job ended here
//!      (each MAC'd over status, job, unit, hash or reason, and the request's MAC)
//! 401  unauthenticated (no or bad MAC, clock skew)   403  node not in the job
//! 404  unknown job   400  malformed   405  a method the resource does not answer
//!      (no MAC, no data, connection closed)
//!
//! GET /v1/jobs/{job}/cached?url={..}&etag={..}&version={..}&size={n}&offset={n}&len={n}
//!     (same headers; etag and version as listed, each only if the listing had one)
//!
//! 200  as above: the range read from this node's cross-job cache, hashed from that copy
//!      (len=0: the entry is here)
//! 404  not cached (MAC'd, with the unit's file being the URL)   503  busy (no response slot)
//! 501  this node has no cache (MAC'd; not asked again for the job)
//!
//! POST /v1/admin/cache/warm?url={percent-encoded}
//!     (same headers, the MAC under the cluster secret's admin key, no job)
//!
//! 200  body: the warm's report (JSON `CacheWarmed`)   502  body: why it failed
//!      (both MAC'd with the admin key over status, body and the request's MAC)
//! 401  unauthenticated   400  malformed   404  this agent serves no admin requests
//!
//! PUT    /v1/jobs/{job}/replicas/file?tag={t}&file={path}&size={n}&blake3={hex}   body: the file
//! POST   /v1/jobs/{job}/replicas/seal?tag={t}      body: JSON ReplicaSeal (files, nodes, committed_at)
//! GET    /v1/jobs/{job}/replicas                                     the index, JSON
//! GET    /v1/jobs/{job}/replicas/room                                JSON {"free":n,"room":n}
//! GET    /v1/jobs/{job}/replicas/file?from={node}&tag={t}&file={path} the bytes, as a unit's
//! DELETE /v1/jobs/{job}/replicas?tag={t}
//!     (same headers, same admission; a push, seal or free is about the requester's own part)
//!
//! 201/200  done   507 no room   409 mismatch   400 invalid   500 failed   503 busy
//! 404 not held   501 this node keeps no replicas   (all MAC'd, see `replica`)
//!
//! GET    /v1/jobs/{job}/listing?dataset={name}&source={url}&from={n}
//!     (same headers, same admission; see `listing`)
//!
//! 200  a page of the dataset's listing from object n on, hashed and MAC'd as a unit's answer
//! 503  pending   409 not this node's (another source)   502 its listing failed   410 ended
//!
//! POST   /v1/jobs/{job}/commits?tag={t}    no body: the requester committed checkpoint t
//!     (same headers, same admission; the committer is the requester)
//!
//! 202  queued   501 this node takes no job events   (MAC'd, see `events`)
//! 400  a tag check_tag refuses (bare, as a malformed query)
//! ```
//!
//! The admin resource is how `sluice cache warm URL --nodes LIST`, asked of one agent by root,
//! reaches the other nodes' agents. It is the only request not scoped to a job: its key is derived
//! from the cluster secret under its own context, and what it may ask is one thing, to warm the
//! node's cache with a dataset as `sluice cache warm` on that node would.
//!
//! The `cached` resource is how a node that misses its own cache takes the units it owns from a
//! job peer's cache before the origin (`sluice_stage::object`). It never waits for staging, so it adds no
//! edge to the wait graph of units; a node serves from its cache only objects under the job's own
//! datasets (as its own policy admitted them at job start). An agent that predates it answers
//! `404` without a MAC, which the requester takes as "nothing cached there" for the rest of the job.
//!
//! A liveness probe (`client::PeerClient::probe_alive`, for `--stage-tier=shared`: is the agent of
//! a node that has not written its share still there?) is a `units` request for the file
//! `client::ALIVE_PROBE`, which no job has: an agent that knows the job answers `409 not owner` at
//! once, MAC'd. What counts as dead is only what a process without the job key cannot fake: no
//! connection, no answer in time, or a `410` MAC'd for the probe. An unsigned answer (a `410`
//! included) or a connection accepted then closed unanswered (what a server over its per-source or
//! total connection limit does) is an agent, or its port, still there.
//!
//! A unit's `file` is the dataset path; for an object listed with an ETag (or a version id), the
//! path, a NUL and that version ([`versioned`]): nodes that listed two versions of an overwritten
//! object never take each other's bytes, and a node asked for a version it did not list answers
//! `409 not owner` at once, so the asker reads its own version from the origin.
//!
//! A unit's hash is the owner's, computed when it read the unit from the origin; the requester
//! compares it with the bytes it received, so a unit is checked end to end. The one exception is
//! marked: a node whose agent restarted serves the files it kept with hashes read back from them
//! (`sluice_stage::resume`), and says so with `x-sluice-read-back: 1` (covered by the response MAC,
//! [`HashFrom::ReadBack`]); the requester uses such a unit for the job's copy only, never for its
//! cross-job cache, and serves it on under the same mark. (An agent that predates the mark fails
//! the MAC of a marked answer, as a corrupt unit, and takes the unit elsewhere.) Peer traffic is
//! authenticated and integrity-checked, not encrypted (docs/SECURITY.md, "Peer transfers").

#![forbid(unsafe_code)]

pub mod auth;
pub mod client;
pub mod events;
pub mod http;
pub mod listing;
pub mod owner;
pub mod pieces;
pub mod release;
pub mod replica;
pub mod server;

#[cfg(test)]
mod tests;

use std::time::Duration;

pub use auth::{AdminKey, ClusterSecret, JobKey, RequestKey, SecretError};
pub use client::{ClientConfig, PeerClient, PeerError, UnitSink};
pub use events::JobEvents;
pub use owner::{Unit, owner_of, ranked, unit_path, units_of, versioned};
pub use pieces::UnitPieces;
pub use replica::{PartKey, ReplicaFile, ReplicaPart, ReplicaRefusal, ReplicaSeal, ReplicaStore};
pub use server::{
    AdminSource, CachedObject, HashFrom, PeerRebind, PeerServer, PeerServerError, PeerService,
    PeerWorker, ServerConfig, UnitData, UnitError, UnitSource, UnitStream,
};

/// How long the server holds a request for a unit the owner is still reading before it answers
/// `pending`; the client's wait for an answer is this plus its read timeout.
pub const LONG_POLL: Duration = Duration::from_secs(20);
/// The largest difference between a request's clock and the server's.
pub const MAX_SKEW: Duration = Duration::from_secs(120);
