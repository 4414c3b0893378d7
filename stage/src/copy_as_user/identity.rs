//! The switch to the job user's identity, for good, before the helper touches any file:
//! `initgroups`, `setresgid`, `setresuid` in this order, then a check that root cannot be
//! regained, then `PR_SET_PDEATHSIG` (which the switch clears). Credentials are per process here,
//! not per thread, so no async runtime thread ever changes identity. Security-critical: any
//! failure ends the helper before it opens anything.

use nix::unistd::{Gid, Uid, geteuid, initgroups, setresgid, setresuid};
use std::ffi::CString;

/// The identity the helper takes: `--uid --gid --user`, as the agent passes them (and as the
/// benchmark's driver takes them for the same work).
#[derive(Debug, Clone, clap::Args)]
pub struct JobUser {
    #[arg(long)]
    pub uid: u32,
    #[arg(long)]
    pub gid: u32,
    #[arg(long)]
    pub user: String,
}

/// Why the helper could not take the job user's identity; it exits before touching a file.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("bad user name {0:?}")]
    BadName(String),
    #[error("{call}: {errno}")]
    Call {
        call: String,
        errno: nix::errno::Errno,
    },
    #[error("could not drop root privileges")]
    StillRoot,
    #[error("the agent exited before the copy started")]
    Orphaned,
}

fn call(call: String) -> impl FnOnce(nix::errno::Errno) -> IdentityError {
    move |errno| IdentityError::Call { call, errno }
}

/// Drops to the user's identity for good. Fails closed: any error ends the helper.
pub fn become_user(uid: u32, gid: u32, user: &str) -> Result<(), IdentityError> {
    if geteuid().as_raw() == uid && uid != 0 {
        return die_with_parent(); // already the user (agent running unprivileged, e.g. in unit tests)
    }
    let name = CString::new(user).map_err(|_| IdentityError::BadName(user.into()))?;
    initgroups(&name, Gid::from_raw(gid)).map_err(call(format!("initgroups({user})")))?;
    setresgid(Gid::from_raw(gid), Gid::from_raw(gid), Gid::from_raw(gid))
        .map_err(call(format!("setresgid({gid})")))?;
    setresuid(Uid::from_raw(uid), Uid::from_raw(uid), Uid::from_raw(uid))
        .map_err(call(format!("setresuid({uid})")))?;
    if uid != 0
        && (setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).is_ok()
            || geteuid().as_raw() != uid)
    {
        return Err(IdentityError::StillRoot);
    }
    die_with_parent()
}

/// The helper must not outlive the agent (a `kill -9`ed agent restarts and re-stages): ask for
/// SIGKILL when the parent dies. Set after the identity change, which clears it.
fn die_with_parent() -> Result<(), IdentityError> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
        .map_err(call("prctl(PR_SET_PDEATHSIG)".into()))?;
    if nix::unistd::getppid().as_raw() == 1 {
        return Err(IdentityError::Orphaned);
    }
    Ok(())
}
