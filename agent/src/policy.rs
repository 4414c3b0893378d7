//! The site's policy: who may stage what, and where a job's checkpoints are archived.
//!
//! The agent reads object stores with the site's credentials, so `[[stage.allow]]` is what keeps one
//! user from staging another's data; `[[ckpt.allow]]` restricts archive URLs the same way. POSIX
//! sources need no rule: they are read with the job user's own permissions. A rule applies to a user
//! by name or through one of their groups; the groups are looked up once per job ([`Requester`]).

use crate::identity::JobIdentity;
use sluice_core::config::{AllowRule, CkptConfig, Config};
use sluice_proto::options::{JobOptions, Source};

/// A request the policy refuses. The message is what the job's output shows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "--stage-in={url} is not allowed by the site's policy for user {user} (sluice reads object stores with the site's credentials); ask your admin to allow that prefix"
    )]
    StageNotAllowed { url: String, user: String },
    #[error("archive URL {url} may not hold '..'")]
    ArchiveDotDot { url: String },
    #[error("--ckpt-archive={url} is not allowed by the site's policy; allowed for you: {allowed}")]
    ArchiveNotAllowed { url: String, allowed: String },
    #[error(
        "--ckpt-archive={url} is not allowed: this site allows no archive location yet (no [[ckpt.allow]] rule); ask your admin"
    )]
    NoArchiveRule { url: String },
    /// The job's own `--ckpt-archive` value does not parse.
    #[error("{0}")]
    BadArchive(String),
}

/// The job, as the policy sees it: its user (and their groups, looked up once), id and name.
#[derive(Debug, Clone)]
pub struct Requester {
    pub user: String,
    pub groups: Vec<String>,
    pub job_id: u32,
    pub job_name: String,
}

impl Requester {
    /// Job `job_id` of the verified user `id`; looks the user's groups up (blocking: NSS may ask a
    /// directory server).
    pub fn of(id: &JobIdentity, job_id: u32) -> Requester {
        Requester {
            user: id.user().to_string(),
            groups: user_groups(id.user(), id.gid()),
            job_id,
            job_name: id.job_name().to_string(),
        }
    }

    /// A user outside any job (`sluice ckpt list|verify|restore URL` through the agent): in allow
    /// prefixes, `{job_id}` and `{job_name}` then stand for any one path segment.
    pub fn user(user: &str, gid: u32) -> Requester {
        Requester {
            user: user.to_string(),
            groups: user_groups(user, gid),
            job_id: 0,
            job_name: String::new(),
        }
    }

    fn is_named_by(&self, rule: &AllowRule) -> bool {
        (rule.users.is_empty() && rule.groups.is_empty())
            || rule.users.contains(&self.user)
            || rule.groups.iter().any(|g| self.groups.contains(g))
    }

    /// The rule's prefix with `{user}`, `{job_id}`, `{job_name}` filled in for this job.
    fn prefix(&self, rule: &AllowRule) -> String {
        expand(&rule.prefix, &self.user, self.job_id, &self.job_name)
    }

    /// Whether `url` lies under a rule of `rules` that applies to this job. A rule whose prefix is
    /// [`ANY_URL`] admits every URL: the admin's explicit choice, never a default.
    fn allowed(&self, rules: &[AllowRule], url: &str) -> bool {
        let with_slash = format!("{}/", url.trim_end_matches('/'));
        rules.iter().any(|r| {
            self.is_named_by(r) && (r.prefix == ANY_URL || with_slash.starts_with(&self.prefix(r)))
        })
    }
}

/// The prefix of an allow rule that admits any URL.
pub const ANY_URL: &str = "*";

#[derive(Debug, Clone)]
pub struct Policy {
    stage_allow: Vec<AllowRule>,
    ckpt: CkptConfig,
}

impl Policy {
    pub fn new(cfg: &Config) -> Policy {
        Policy {
            stage_allow: cfg.stage.allow.clone(),
            ckpt: cfg.ckpt.clone(),
        }
    }

    /// Every object-store source of the job must be allowed for its user by `[[stage.allow]]`.
    pub fn check_stage(&self, who: &Requester, opts: &JobOptions) -> Result<(), PolicyError> {
        for spec in &opts.stage_in {
            if !matches!(spec.source, Source::Object { .. }) {
                continue;
            }
            let url = spec.source.to_string();
            if !who.allowed(&self.stage_allow, &url) {
                return Err(PolicyError::StageNotAllowed {
                    url,
                    user: who.user.clone(),
                });
            }
        }
        Ok(())
    }

    /// The job's archive URL: its `--ckpt-archive` (`requested`), else the admin default, checked
    /// against `[[ckpt.allow]]`. `None`: no archive configured anywhere.
    pub fn archive_url(
        &self,
        who: &Requester,
        requested: Option<&str>,
    ) -> Result<Option<String>, PolicyError> {
        let url = match (requested, &self.ckpt.default_archive) {
            (Some(u), _) => u.trim_end_matches('/').to_string(),
            (None, Some(t)) => expand(t, &who.user, who.job_id, &sanitize_name(&who.job_name))
                .trim_end_matches('/')
                .to_string(),
            (None, None) => return Ok(None),
        };
        if url.split('/').any(|seg| seg == "..") {
            return Err(PolicyError::ArchiveDotDot { url });
        }
        // Fails closed, like [[stage.allow]]: without a rule no archive URL is allowed (the agent
        // writes archives as root, with the site's credentials).
        if self.ckpt.allow.is_empty() {
            return Err(PolicyError::NoArchiveRule { url });
        }
        if who.allowed(&self.ckpt.allow, &url) {
            return Ok(Some(url));
        }
        let yours: Vec<String> = self
            .ckpt
            .allow
            .iter()
            .filter(|r| who.is_named_by(r))
            .map(|r| who.prefix(r))
            .collect();
        Err(PolicyError::ArchiveNotAllowed {
            url,
            allowed: if yours.is_empty() {
                "none (ask your admin)".to_string()
            } else {
                yours.join(", ")
            },
        })
    }
}

impl Policy {
    /// Whether user `who` may read the archive at `url` through the agent: it must be a URL a job
    /// of theirs could archive to under `[[ckpt.allow]]` (the same rules, `{job_id}` and
    /// `{job_name}` matching any one segment). Which of its checkpoints they see is decided by
    /// their owners, apart from this.
    pub fn check_archive_read(&self, who: &Requester, url: &str) -> Result<(), PolicyError> {
        let url = url.trim_end_matches('/');
        if url.split('/').any(|seg| seg == "..") {
            return Err(PolicyError::ArchiveDotDot { url: url.into() });
        }
        if self.ckpt.allow.is_empty() {
            return Err(PolicyError::NoArchiveRule { url: url.into() });
        }
        let with_slash = format!("{url}/");
        let mine: Vec<&AllowRule> = self
            .ckpt
            .allow
            .iter()
            .filter(|r| who.is_named_by(r))
            .collect();
        let admits = |r: &AllowRule| {
            r.prefix == ANY_URL
                || prefix_matches(&r.prefix.replace("{user}", &who.user), &with_slash)
        };
        if mine.iter().any(|r| admits(r)) {
            return Ok(());
        }
        Err(PolicyError::ArchiveNotAllowed {
            url: url.into(),
            allowed: if mine.is_empty() {
                "none (ask your admin)".to_string()
            } else {
                let shown: Vec<String> = mine
                    .iter()
                    .map(|r| r.prefix.replace("{user}", &who.user))
                    .collect();
                shown.join(", ")
            },
        })
    }
}

/// Whether `s` starts with `prefix`, where `{job_id}` and `{job_name}` in `prefix` each match one
/// non-empty run of characters without `/`.
fn prefix_matches(prefix: &str, s: &str) -> bool {
    let next = ["{job_id}", "{job_name}"]
        .iter()
        .filter_map(|p| prefix.find(p).map(|i| (i, p.len())))
        .min();
    let Some((at, len)) = next else {
        return s.starts_with(prefix);
    };
    let (literal, rest) = (&prefix[..at], &prefix[at + len..]);
    let Some(tail) = s.strip_prefix(literal) else {
        return false;
    };
    let segment = tail.find('/').unwrap_or(tail.len());
    (1..=segment).any(|n| tail.is_char_boundary(n) && prefix_matches(rest, &tail[n..]))
}

/// Replaces `{user}`, `{job_id}`, `{job_name}` in an archive URL template or an allow prefix.
fn expand(template: &str, user: &str, job_id: u32, job_name: &str) -> String {
    template
        .replace("{user}", user)
        .replace("{job_id}", &job_id.to_string())
        .replace("{job_name}", job_name)
}

/// Job names become one object-key segment.
fn sanitize_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(128)
        .collect();
    if s.is_empty() || s == "." || s == ".." {
        "job".into()
    } else {
        s
    }
}

/// Names of the groups `user` belongs to. Empty if unknown.
fn user_groups(user: &str, gid: u32) -> Vec<String> {
    let Ok(name) = std::ffi::CString::new(user) else {
        return Vec::new();
    };
    nix::unistd::getgrouplist(&name, nix::unistd::Gid::from_raw(gid))
        .unwrap_or_default()
        .into_iter()
        .filter_map(|g| {
            nix::unistd::Group::from_gid(g)
                .ok()
                .flatten()
                .map(|g| g.name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_proto::options::parse_stage_in;

    const BASE: &str = "[agent]\nsocket='/s'\nstate_dir='/st'\n[hot_tier]\nroot='/h'\n";

    fn who(user: &str, groups: &[&str]) -> Requester {
        Requester {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            job_id: 7,
            job_name: "my run".into(),
        }
    }

    /// A `[[ckpt.allow]]` rule for `prefix`, for members of `groups` (none: everyone).
    fn rule(prefix: &str, groups: &[&str]) -> AllowRule {
        AllowRule {
            prefix: prefix.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            ..Default::default()
        }
    }

    fn policy(allow: Vec<AllowRule>) -> Policy {
        let mut cfg = Config::parse(BASE, "n1", sluice_archive::upload_memory).unwrap();
        cfg.ckpt.allow = allow;
        cfg.ckpt.default_archive = Some("s3://ckpt/{user}/{job_name}".into());
        Policy::new(&cfg)
    }

    #[test]
    fn archive_policy() {
        let p = policy(vec![
            rule("s3://ckpt/{user}/", &[]),
            rule("s3://team/", &["ml"]),
        ]);
        let alice = who("alice", &[]);
        assert_eq!(
            p.archive_url(&alice, None).unwrap().unwrap(),
            "s3://ckpt/alice/my_run"
        );
        assert!(p.archive_url(&alice, Some("s3://ckpt/alice/x/")).is_ok());
        let e = p
            .archive_url(&alice, Some("s3://ckpt/bob/x"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not allowed") && e.contains("s3://ckpt/alice/"),
            "{e}"
        );
        assert!(
            p.archive_url(&who("alice", &["ml"]), Some("s3://team/x"))
                .is_ok()
        );
        assert!(p.archive_url(&alice, Some("s3://team/x")).is_err());
        // "s3://ckpt/alice" must not admit "s3://ckpt/alice2".
        assert!(p.archive_url(&alice, Some("s3://ckpt/alice2/x")).is_err());
        assert_eq!(
            p.archive_url(&alice, Some("s3://ckpt/alice/../bob")),
            Err(PolicyError::ArchiveDotDot {
                url: "s3://ckpt/alice/../bob".into()
            })
        );
        // No rule at all: nothing is allowed (issue 10: it used to allow any URL, file:// too).
        let none = policy(Vec::new());
        let e = none.archive_url(&alice, Some("file:///var/x")).unwrap_err();
        assert!(e.to_string().contains("no [[ckpt.allow]] rule"), "{e}");
        assert!(
            none.archive_url(&alice, None).is_err(),
            "nor the default archive"
        );
        // Any URL only where the admin says so.
        let any = policy(vec![rule(ANY_URL, &[])]);
        assert!(any.archive_url(&alice, Some("file:///var/x")).is_ok());
    }

    #[test]
    fn reading_an_archive_outside_a_job_takes_the_same_rules() {
        let p = policy(vec![
            rule("s3://ckpt/{user}/", &[]),
            rule("s3://runs/{user}/{job_id}-{job_name}/", &[]),
            rule("s3://team/", &["ml"]),
        ]);
        let alice = who("alice", &[]);
        assert!(p.check_archive_read(&alice, "s3://ckpt/alice/run1").is_ok());
        assert!(
            p.check_archive_read(&alice, "s3://ckpt/alice/run1/")
                .is_ok()
        );
        assert!(
            p.check_archive_read(&alice, "s3://runs/alice/7-train")
                .is_ok()
        );
        // The placeholders are one segment each, not a way to widen the prefix.
        assert!(p.check_archive_read(&alice, "s3://runs/alice/").is_err());
        assert!(p.check_archive_read(&alice, "s3://runs/alice/7").is_err());
        let e = p
            .check_archive_read(&alice, "s3://ckpt/bob/run1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("not allowed") && e.contains("s3://ckpt/alice/"),
            "{e}"
        );
        assert!(p.check_archive_read(&alice, "s3://ckpt/alice2/x").is_err());
        assert!(p.check_archive_read(&alice, "s3://team/x").is_err());
        assert!(
            p.check_archive_read(&who("alice", &["ml"]), "s3://team/x")
                .is_ok()
        );
        assert!(matches!(
            p.check_archive_read(&alice, "s3://ckpt/alice/../bob"),
            Err(PolicyError::ArchiveDotDot { .. })
        ));
        let none = policy(Vec::new());
        assert!(matches!(
            none.check_archive_read(&alice, "s3://ckpt/alice/x"),
            Err(PolicyError::NoArchiveRule { .. })
        ));
    }

    /// The example config's `[[stage.allow]]` rules, as the admin reads them.
    #[test]
    fn example_stage_rules() {
        let text = include_str!("../../slurm-conf/sluice.toml");
        let p = Policy::new(&Config::parse(text, "n2", sluice_archive::upload_memory).unwrap());
        let opts = |url: &str| JobOptions {
            stage_in: parse_stage_in([url]).unwrap(),
            ..Default::default()
        };
        let alice = who("alice", &[]);
        assert!(p.check_stage(&alice, &opts("s3://ckpt/alice/run1")).is_ok());
        let e = p
            .check_stage(&alice, &opts("s3://ckpt/bob/run1"))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("not allowed by the site's policy for user alice")
        );
        assert!(
            p.check_stage(&who("alice", &["vision"]), &opts("s3://vision-data/x"))
                .is_ok()
        );
        assert!(p.check_stage(&alice, &opts("s3://vision-data/x")).is_err());
        // POSIX sources are read as the user: no rule needed.
        assert!(p.check_stage(&alice, &opts("/lustre/x")).is_ok());
    }
}
