//! The plugin's arguments from its `plugstack.conf` line.
//!
//! Slurm hands them to every callback, and they are parsed in every callback that needs them: the
//! job_script context is a fresh process per call, so nothing parsed earlier survives.

use std::path::PathBuf;
use std::time::Duration;

pub const DEFAULT_SOCKET: &str = "/run/sluice/%n.sock";
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_STAGE_TIMEOUT: Duration = Duration::from_secs(3600);
pub const DEFAULT_EPILOG_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest accepted timeout: a week. Anything longer is a typo.
pub const MAX_TIMEOUT_SECS: u64 = 7 * 24 * 3600;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Args {
    /// Agent socket path; `%n` stands for the node name.
    pub socket: String,
    /// Bound on each agent call from prolog and epilog, and the margin on top of `stage_timeout`.
    pub connect_timeout: Duration,
    /// How long a job's tasks wait for staging on a node.
    pub stage_timeout: Duration,
    /// How long job_epilog waits for the agent's cleanup.
    pub epilog_timeout: Duration,
}

impl Default for Args {
    fn default() -> Self {
        Args {
            socket: DEFAULT_SOCKET.to_string(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            stage_timeout: DEFAULT_STAGE_TIMEOUT,
            epilog_timeout: DEFAULT_EPILOG_TIMEOUT,
        }
    }
}

impl Args {
    /// Parses `key=value` arguments. A bad or unknown argument does not stop the plugin (that would
    /// fail every job on the node): it is reported in the returned list and the default stays.
    pub fn parse<S: AsRef<str>>(argv: &[S]) -> (Args, Vec<String>) {
        let mut args = Args::default();
        let mut problems = Vec::new();
        for arg in argv.iter().map(AsRef::as_ref) {
            let Some((key, value)) = arg.split_once('=') else {
                problems.push(format!(
                    "ignoring plugin argument '{arg}': expected key=value"
                ));
                continue;
            };
            let timeout = |problems: &mut Vec<String>| match parse_secs(value) {
                Some(d) => Some(d),
                None => {
                    problems.push(format!(
                        "ignoring plugin argument '{arg}': give whole seconds from 1 to {MAX_TIMEOUT_SECS}"
                    ));
                    None
                }
            };
            match key {
                "socket" if value.starts_with('/') => args.socket = value.to_string(),
                "socket" => problems.push(format!("ignoring plugin argument '{arg}': the socket path must be absolute")),
                "connect_timeout" => args.connect_timeout = timeout(&mut problems).unwrap_or(args.connect_timeout),
                "stage_timeout" => args.stage_timeout = timeout(&mut problems).unwrap_or(args.stage_timeout),
                "epilog_timeout" => args.epilog_timeout = timeout(&mut problems).unwrap_or(args.epilog_timeout),
                _ => problems.push(format!(
                    "ignoring unknown plugin argument '{arg}' (known: socket, connect_timeout, stage_timeout, epilog_timeout)"
                )),
            }
        }
        (args, problems)
    }

    /// The agent socket of `node`: `%n` in the configured path replaced by the node name.
    pub fn socket_path(&self, node: &str) -> PathBuf {
        PathBuf::from(self.socket.replace("%n", node))
    }
}

fn parse_secs(value: &str) -> Option<Duration> {
    match value.parse::<u64>() {
        Ok(secs) if (1..=MAX_TIMEOUT_SECS).contains(&secs) => Some(Duration::from_secs(secs)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_plugstack_conf() {
        let (args, problems) = Args::parse::<&str>(&[]);
        assert!(problems.is_empty());
        assert_eq!(args.socket, "/run/sluice/%n.sock");
        assert_eq!(args.connect_timeout, Duration::from_secs(10));
        assert_eq!(args.stage_timeout, Duration::from_secs(3600));
        assert_eq!(args.epilog_timeout, Duration::from_secs(30));
        // The comments in the example plugstack.conf document these defaults; keep them in step.
        let conf = include_str!("../../slurm-conf/plugstack.conf");
        assert!(conf.contains("(default /run/sluice/%n.sock)"), "{conf}");
        assert!(
            conf.contains("(default 10)")
                && conf.contains("(default 3600)")
                && conf.contains("(default 30)")
        );
    }

    #[test]
    fn the_example_plugstack_line_parses_cleanly() {
        let conf = include_str!("../../slurm-conf/plugstack.conf");
        let line = conf
            .lines()
            .find(|l| l.starts_with("required"))
            .expect("a plugin line");
        let argv: Vec<&str> = line.split_whitespace().skip(2).collect();
        let (args, problems) = Args::parse(&argv);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(args.socket_path("n2"), PathBuf::from("/run/sluice/n2.sock"));
    }

    #[test]
    fn known_arguments_override_defaults() {
        let (args, problems) = Args::parse(&[
            "socket=/tmp/t/%n/agent.sock",
            "connect_timeout=3",
            "stage_timeout=120",
            "epilog_timeout=45",
        ]);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            args.socket_path("gpu07"),
            PathBuf::from("/tmp/t/gpu07/agent.sock")
        );
        assert_eq!(args.connect_timeout, Duration::from_secs(3));
        assert_eq!(args.stage_timeout, Duration::from_secs(120));
        assert_eq!(args.epilog_timeout, Duration::from_secs(45));
    }

    #[test]
    fn every_n_is_replaced_and_other_percents_stay() {
        let (args, _) = Args::parse(&["socket=/run/%n/%n-100%.sock"]);
        assert_eq!(
            args.socket_path("n1"),
            PathBuf::from("/run/n1/n1-100%.sock")
        );
        let (args, _) = Args::parse(&["socket=/run/sluice/agent.sock"]);
        assert_eq!(
            args.socket_path("n1"),
            PathBuf::from("/run/sluice/agent.sock")
        );
    }

    #[test]
    fn bad_and_unknown_arguments_are_reported_and_ignored() {
        let (args, problems) = Args::parse(&[
            "sockett=/x",
            "stage_timeout=1h",
            "connect_timeout=0",
            "epilog_timeout=99999999",
            "socket=relative.sock",
            "verbose",
        ]);
        assert_eq!(args, Args::default());
        assert_eq!(problems.len(), 6, "{problems:?}");
        assert!(
            problems[0].contains("unknown plugin argument 'sockett=/x'"),
            "{}",
            problems[0]
        );
        assert!(
            problems[1].contains("'stage_timeout=1h'") && problems[1].contains("whole seconds")
        );
        assert!(problems[4].contains("must be absolute"));
        assert!(problems[5].contains("expected key=value"));
    }
}
