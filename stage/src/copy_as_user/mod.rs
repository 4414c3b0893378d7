//! `sluiced copy-as-user`: copies a POSIX dataset with the job user's identity. This is the helper
//! process; the agent's side (starting it, reading its messages, classifying its exit) is
//! [`super::posix`].
//!
//! The agent starts this helper as root; before touching any file it takes the job user's
//! identity for good ([`identity`]). Then one of the [`modes`] walks the source ([`walk`]) and
//! copies it ([`copy`]), telling the agent what it does in the messages of [`protocol`]; a failure
//! ends it with an exit code that classifies it and its message ([`HelperError`]) on stderr.

mod args;
mod copy;
mod error;
mod identity;
mod modes;
pub mod protocol;
mod walk;

pub use args::{PeerCopy, Shard, ShardArgs};
pub use copy::piece_hashes_hash;
pub use error::HelperError;
pub use identity::{IdentityError, JobUser, become_user};
pub use modes::{
    copies_unit, copy_shard, copy_tree, copy_tree_cached, copy_tree_resumable, peer_unit_file,
};
pub use protocol::{Event, Failure, FileIdent};
