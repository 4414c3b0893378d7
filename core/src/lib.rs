//! sluice-core: what every part of sluice stands on, and nothing of the archive engine, the agent or
//! the object stores.
//!
//! - [`config`]: the site's `sluice.toml`, parsed and validated once (for the agent, the CLI's URL
//!   mode and `sluice config check`), as plain data: the `[retry]` policy and the store profiles'
//!   data classes too; what they become in object_store's terms is sluice-archive's business.
//! - [`safefs`]: root-safe, fd-relative file access; [`durable`]: the one durable-write helper;
//!   [`iobuf`]: 4 KiB-aligned buffers for `O_DIRECT`; [`pagecache`]: writes that leave the page
//!   cache as they found it.
//! - [`rt`]: the clock, poison-free locks and, with `runtime`, blocking work off the async workers
//!   and contained panics.
//! - With `runtime`: [`worker`] (the shape of the agent's background loops) and [`backoff`] (when
//!   failed background work is tried again).
//!
//! **Feature `runtime`** (off by default) brings tokio, tokio-util and futures, and with them the
//! async half above. `libsluice_writer.so`, loaded into PyTorch processes, links this crate without
//! it, so the writer carries no tokio, object_store or zstd; the agent and the archive engine turn it
//! on. Feature `testing` gives the crates above their shared test helpers ([`testing`]).

// `deny`, not `forbid`: the aligned-buffer module alone is allowed `unsafe` (each block argued).
#![deny(unsafe_code)]

pub mod config;
pub mod durable;
#[allow(unsafe_code)]
pub mod iobuf;
pub mod pagecache;
pub mod rt;
pub mod safefs;
#[cfg(feature = "testing")]
pub mod testing;

#[cfg(feature = "runtime")]
pub mod backoff;
#[cfg(feature = "runtime")]
pub mod worker;
