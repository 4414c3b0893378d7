//! Poisoned checkpoints: `BASE/TAG/POISON`, a small JSON beside the MANIFEST saying who marked
//! the checkpoint bad, when and why (a trainer that saw a NaN loss after restoring it). The rules:
//! - written once, create-only where the store can: a second poison finds the first mark and
//!   keeps it (its reason stands); nothing of the checkpoint's data or MANIFEST changes;
//! - a mark may be written before the MANIFEST (a tag committed and not archived yet): restore
//!   and listing never see a tag without MANIFEST, and see the mark as soon as it has one;
//! - a mark counts only when written by the checkpoint's owner (the MANIFEST's user) or root:
//!   anyone who can write the prefix can put an object there, and under a shared prefix a mark
//!   left on a reused tag must not poison another user's checkpoint;
//! - `latest` passes over a poisoned checkpoint ([`Archiver::latest_good`]), a named restore is
//!   refused unless forced (`sluice_archive::access`, the agent's `--ckpt-restore`).

use crate::{ArchiveError, Archiver, Manifest, check_name};
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use sluice_proto::msg::{MAX_POISON_REASON, PoisonMark};

/// The mark's object name below the tag.
pub const POISON: &str = "POISON";
const FORMAT: &str = "sluice-poison";
const VERSION: u32 = 1;
/// A mark larger than this is not one of ours.
const MAX_MARK_BYTES: u64 = 16 << 10;

/// The mark as stored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Stored {
    format: String,
    version: u32,
    tag: String,
    #[serde(flatten)]
    mark: PoisonMark,
}

/// What [`Archiver::poison`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poisoned {
    /// The mark is written now.
    Now(PoisonMark),
    /// The tag had a mark already, which stays.
    Already(PoisonMark),
}

/// Whether `mark` counts for a checkpoint whose MANIFEST names `owner`: written by them or root.
pub fn counts_for(mark: &PoisonMark, owner: &str) -> bool {
    mark.uid == 0 || mark.user == owner
}

/// A mark for people: "marked bad by alice (uid 1000) at 2025-01-02 03:04:05 UTC: loss is NaN".
pub fn describe(mark: &PoisonMark) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(mark.at_unix_ms);
    let at = humantime::format_rfc3339_seconds(at);
    format!(
        "marked bad by {} (uid {}) at {at}: {}",
        mark.user, mark.uid, mark.reason
    )
}

/// What a job's output (or `sluice ckpt restore`'s stderr) says of a poisoned checkpoint that
/// `latest` passed over.
pub fn skipped_note(url: &str, tag: &str, mark: &PoisonMark) -> String {
    format!(
        "checkpoint {tag} in {url} is poisoned ({}); skipped it for the next newest",
        describe(mark)
    )
}

/// What is said of a poisoned checkpoint restored because the restore was forced.
pub fn forced_note(url: &str, tag: &str, mark: &PoisonMark) -> String {
    format!(
        "checkpoint {tag} in {url} is poisoned ({}); restored anyway, as forced",
        describe(mark)
    )
}

/// Checks a reason before it is written: one line of text a listing can show.
pub fn check_reason(reason: &str) -> Result<(), String> {
    let r = reason.trim();
    if r.is_empty() {
        return Err(
            "give a reason (--reason \"...\"): it is what the next job's output shows".into(),
        );
    }
    if r.len() > MAX_POISON_REASON {
        return Err(format!(
            "the reason is {} bytes; keep it under {MAX_POISON_REASON}",
            r.len()
        ));
    }
    if r.chars().any(char::is_control) {
        return Err("the reason must be one line of text, without control characters".into());
    }
    Ok(())
}

impl Archiver {
    /// Writes `mark` as `tag`'s poison mark, unless it has one already (then that one is
    /// answered, unchanged). Needs no MANIFEST: who may poison is the caller's to check.
    pub async fn poison(&self, tag: &str, mark: PoisonMark) -> Result<Poisoned, ArchiveError> {
        check_name("checkpoint tag", tag)?;
        check_reason(&mark.reason).map_err(ArchiveError::BadConfig)?;
        if let Some(first) = self.poison_mark(tag).await? {
            return Ok(Poisoned::Already(first));
        }
        let key = self.key([tag, POISON]);
        let stored = Stored {
            format: FORMAT.into(),
            version: VERSION,
            tag: tag.into(),
            mark,
        };
        let body = PutPayload::from(serde_json::to_vec(&stored).expect("a mark serialises"));
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store.put_opts(&key, body.clone(), opts).await {
            Ok(_) => Ok(Poisoned::Now(stored.mark)),
            // Checked above: only a concurrent poison could have written it since.
            Err(object_store::Error::NotImplemented { .. }) => {
                self.store
                    .put(&key, body)
                    .await
                    .map_err(self.store_err("put", &key))?;
                Ok(Poisoned::Now(stored.mark))
            }
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => match self.poison_mark(tag).await? {
                Some(first) => Ok(Poisoned::Already(first)),
                None => Err(self.bad_mark(tag, "it exists and cannot be read".into())),
            },
            Err(e) => Err(self.store_err("put", &key)(e)),
        }
    }

    /// `tag`'s poison mark as stored, whoever wrote it (see [`Archiver::poisoned`]).
    pub async fn poison_mark(&self, tag: &str) -> Result<Option<PoisonMark>, ArchiveError> {
        check_name("checkpoint tag", tag)?;
        let key = self.key([tag, POISON]);
        let Some(bytes) = self.get_opt(&key, tag, POISON).await? else {
            return Ok(None);
        };
        if bytes.len() as u64 > MAX_MARK_BYTES {
            return Err(self.bad_mark(tag, format!("it is {} bytes", bytes.len())));
        }
        match serde_json::from_slice::<Stored>(&bytes) {
            Ok(s) if s.format == FORMAT && s.tag == tag => Ok(Some(s.mark)),
            Ok(s) => Err(self.bad_mark(tag, format!("format '{}' for tag '{}'", s.format, s.tag))),
            Err(e) => Err(self.bad_mark(tag, e.to_string())),
        }
    }

    /// The poison mark of the checkpoint `m` that counts ([`counts_for`]): its owner's or root's.
    /// An unreadable mark counts as a poison too (someone meant to mark it): its reason says so.
    pub async fn poisoned(&self, m: &Manifest) -> Result<Option<PoisonMark>, ArchiveError> {
        match self.poison_mark(&m.tag).await {
            Ok(mark) => Ok(mark.filter(|p| counts_for(p, &m.job.user))),
            Err(ArchiveError::BadManifest { reason, .. }) => Ok(Some(PoisonMark {
                user: "?".into(),
                uid: u32::MAX,
                at_unix_ms: 0,
                reason: format!("its POISON mark cannot be read ({reason})"),
            })),
            Err(e) => Err(e),
        }
    }

    /// The poison mark of checkpoint `tag` that counts, when it has a MANIFEST (one GET when it
    /// has no mark, the usual case).
    pub async fn poison_of(&self, tag: &str) -> Result<Option<PoisonMark>, ArchiveError> {
        match self.poison_mark(tag).await {
            Ok(None) => return Ok(None),
            Ok(Some(_)) | Err(ArchiveError::BadManifest { .. }) => {}
            Err(e) => return Err(e),
        }
        match self.manifest_opt(tag).await? {
            Some(m) => self.poisoned(&m).await,
            None => Ok(None),
        }
    }

    fn bad_mark(&self, tag: &str, reason: String) -> ArchiveError {
        ArchiveError::BadManifest {
            url: self.url.clone(),
            tag: tag.into(),
            what: POISON.into(),
            reason,
        }
    }
}
