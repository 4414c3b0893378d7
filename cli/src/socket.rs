//! Which socket the CLI talks to: `--socket`, else `$SLUICE_SOCKET`, else `/run/sluice/%n.sock`.
//!
//! `%n` is the node's Slurm name, the same convention as the agent's `socket =` and the plugin's
//! `socket=` (slurm-conf/), so one path template serves every node — and the several virtual nodes
//! of one host in the test cluster, where `SLURMD_NODENAME` differs from the hostname. The
//! resolution is a pure function of its inputs; `main` passes the real environment.

use anyhow::{Context, bail};
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

/// The agent's socket when neither `--socket` nor `SLUICE_SOCKET` says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/sluice/%n.sock";
/// Overrides [`DEFAULT_SOCKET`].
pub const SOCKET_ENV: &str = "SLUICE_SOCKET";
/// Set by Slurm in job environments; names this node as Slurm knows it.
pub const NODENAME_ENV: &str = "SLURMD_NODENAME";

/// Where a socket path came from, so an error can say which knob to turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Env,
    Default,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Socket {
    pub path: PathBuf,
    pub origin: Origin,
}

impl fmt::Display for Socket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origin = match self.origin {
            Origin::Flag => "from --socket",
            Origin::Env => "from $SLUICE_SOCKET",
            Origin::Default => "the default",
        };
        write!(f, "{} ({origin})", self.path.display())
    }
}

/// Resolves the socket path. `env` looks up environment variables (empty values count as unset);
/// `hostname` is asked only when `%n` must be expanded and `SLURMD_NODENAME` is not set.
pub fn resolve(
    flag: Option<&OsStr>,
    env: impl Fn(&str) -> Option<OsString>,
    hostname: impl FnOnce() -> Option<String>,
) -> anyhow::Result<Socket> {
    let env = |name: &str| env(name).filter(|v| !v.is_empty());
    let (template, origin) = match (flag, env(SOCKET_ENV)) {
        (Some(flag), _) => (flag.to_os_string(), Origin::Flag),
        (None, Some(var)) => (var, Origin::Env),
        (None, None) => (OsString::from(DEFAULT_SOCKET), Origin::Default),
    };
    if template.is_empty() {
        bail!("--socket is empty; give the agent's socket path, e.g. {DEFAULT_SOCKET}");
    }
    if !template.as_bytes().windows(2).any(|w| w == b"%n") {
        return Ok(Socket {
            path: template.into(),
            origin,
        });
    }
    let node = match env(NODENAME_ENV) {
        Some(node) => node,
        None => hostname().map(|h| OsString::from(short_hostname(&h))).filter(|h| !h.is_empty()).with_context(|| {
            format!(
                "cannot tell this node's name to expand %n in {}: set {NODENAME_ENV} or pass --socket PATH",
                PathBuf::from(&template).display()
            )
        })?,
    };
    Ok(Socket {
        path: expand_node(&template, &node).into(),
        origin,
    })
}

/// The hostname up to its first dot, as Slurm names nodes by default.
pub fn short_hostname(hostname: &str) -> &str {
    hostname.split('.').next().unwrap_or(hostname)
}

/// Replaces every `%n` with `node`; byte-wise, so non-UTF-8 paths survive.
fn expand_node(template: &OsStr, node: &OsStr) -> OsString {
    let (mut rest, mut out) = (template.as_bytes(), Vec::new());
    while let Some(i) = rest.windows(2).position(|w| w == b"%n") {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(node.as_bytes());
        rest = &rest[i + 2..];
    }
    out.extend_from_slice(rest);
    OsString::from_vec(out)
}

/// This machine's hostname, if the OS tells it and it is UTF-8.
pub fn system_hostname() -> Option<String> {
    nix::unistd::gethostname().ok()?.into_string().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn resolve_with(
        flag: Option<&str>,
        vars: &[(&str, &str)],
        host: Option<&str>,
    ) -> anyhow::Result<Socket> {
        let vars: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect();
        resolve(
            flag.map(OsStr::new),
            |k| vars.get(k).cloned(),
            || host.map(str::to_string),
        )
    }

    fn path_of(flag: Option<&str>, vars: &[(&str, &str)], host: Option<&str>) -> (String, Origin) {
        let s = resolve_with(flag, vars, host).unwrap();
        (s.path.to_str().unwrap().to_string(), s.origin)
    }

    #[test]
    fn default_uses_slurm_node_name_over_hostname() {
        assert_eq!(
            path_of(
                None,
                &[("SLURMD_NODENAME", "gpu07")],
                Some("login1.cluster.example")
            ),
            ("/run/sluice/gpu07.sock".into(), Origin::Default)
        );
    }

    #[test]
    fn default_falls_back_to_short_hostname() {
        assert_eq!(
            path_of(None, &[], Some("gpu07.cluster.example")),
            ("/run/sluice/gpu07.sock".into(), Origin::Default)
        );
        // An empty SLURMD_NODENAME is as good as none.
        assert_eq!(
            path_of(None, &[("SLURMD_NODENAME", "")], Some("n3")).0,
            "/run/sluice/n3.sock"
        );
    }

    #[test]
    fn env_and_flag_override_in_order_and_expand_too() {
        let vars = [
            ("SLUICE_SOCKET", "/tmp/vc/%n/agent.sock"),
            ("SLURMD_NODENAME", "n2"),
        ];
        assert_eq!(
            path_of(None, &vars, None),
            ("/tmp/vc/n2/agent.sock".into(), Origin::Env)
        );
        assert_eq!(
            path_of(Some("/x/%n-%n.sock"), &vars, None),
            ("/x/n2-n2.sock".into(), Origin::Flag)
        );
        assert_eq!(
            path_of(Some("/x/plain.sock"), &vars, None),
            ("/x/plain.sock".into(), Origin::Flag)
        );
        assert_eq!(
            path_of(None, &[("SLUICE_SOCKET", "")], Some("h")),
            ("/run/sluice/h.sock".into(), Origin::Default)
        );
    }

    #[test]
    fn hostname_is_needed_only_for_percent_n() {
        // No node name anywhere, but none needed: the hostname closure must not be consulted.
        let s = resolve(
            Some(OsStr::new("/a.sock")),
            |_| None,
            || panic!("hostname asked"),
        )
        .unwrap();
        assert_eq!(s.path, PathBuf::from("/a.sock"));
        let e = resolve_with(None, &[], None).unwrap_err().to_string();
        assert!(
            e.contains("SLURMD_NODENAME") && e.contains("--socket"),
            "{e}"
        );
        assert!(
            resolve_with(Some(""), &[], Some("h"))
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
    }

    #[test]
    fn describes_where_the_path_came_from() {
        let s = resolve_with(None, &[("SLUICE_SOCKET", "/s.sock")], None).unwrap();
        assert_eq!(s.to_string(), "/s.sock (from $SLUICE_SOCKET)");
    }
}
