//! Which sluice release each peer runs, as its requests say (`x-sluice-version`), and one line in
//! the agent's log for each peer node of another release: a rolling upgrade puts agents of two
//! releases in one job, and the admin reading a node's log should see which peers are not upgraded
//! yet and what the two speak together.
//!
//! Both speak peer protocol v1 (the path's `/v1/`), the only one there is. Within it, a newer
//! agent adds only what an older one ignores or answers `404` to without a MAC (e.g. the `cached`
//! resource, see the crate's docs), so the two fall back to what the older one knows by
//! themselves. A request without the header comes from an agent before release 0.2.0, which
//! introduced it.

use std::collections::HashSet;
use std::sync::Mutex;

/// Request header: the sending agent's release (`CARGO_PKG_VERSION`).
pub const VERSION_HEADER: &str = "x-sluice-version";
/// This agent's release.
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");

/// The peer nodes met, each with the release it said (`None`: it said none), so that each is
/// logged once per agent run.
#[derive(Debug, Default)]
pub(crate) struct Releases {
    met: Mutex<HashSet<(String, Option<String>)>>,
}

impl Releases {
    /// Notes that `node` (authenticated) said `version`. Returns the line logged, the first time a
    /// node says a release other than this agent's; `None` otherwise.
    pub(crate) fn met(&self, node: &str, version: Option<&str>) -> Option<String> {
        if version == Some(RELEASE) {
            return None;
        }
        let first = self
            .met
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((node.to_string(), version.map(str::to_string)));
        if !first {
            return None;
        }
        let theirs = match version {
            Some(v) => format!("sluice {v}"),
            None => "a sluice release before 0.2.0 (its requests carry no version)".to_string(),
        };
        let line = format!(
            "peer {node} runs {theirs}, this agent sluice {RELEASE}: the two speak peer protocol v1, \
             the one both know"
        );
        tracing::info!("{line}");
        Some(line)
    }
}

#[cfg(test)]
impl Releases {
    /// The (node, release) pairs noted so far, sorted.
    pub(crate) fn noted(&self) -> Vec<(String, Option<String>)> {
        let mut v: Vec<_> = self
            .met
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_of_another_release_is_logged_once_and_one_of_this_release_never() {
        let r = Releases::default();
        assert_eq!(r.met("n2", Some(RELEASE)), None);
        let line = r
            .met("n2", None)
            .expect("a peer without a version is logged");
        assert!(
            line.starts_with("peer n2 runs a sluice release before 0.2.0"),
            "{line}"
        );
        assert!(
            line.contains(&format!("this agent sluice {RELEASE}")),
            "{line}"
        );
        assert_eq!(r.met("n2", None), None, "logged once per node and release");
        let line = r
            .met("n3", Some("9.9.9"))
            .expect("another node, another release");
        assert!(line.starts_with("peer n3 runs sluice 9.9.9,"), "{line}");
        assert!(
            r.met("n2", Some("9.9.9")).is_some(),
            "the same node upgraded since"
        );
    }
}
