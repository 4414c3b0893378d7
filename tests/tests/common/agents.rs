//! The nodes' agents and the faults tests inflict on them: the agent process as the harness started
//! it (kill it, start it again exactly so or with another configuration), requests to its socket (a
//! job's state, its checkpoints), the fault-injecting proxy and the byte-counting relay in front of
//! Garage, and a seeded source of random fault timing.

use super::cluster::{Cluster, run, run_dir, tail_of, unique, write_atomically};
use super::jobs::Job;
use super::trees::SplitMix64;
use sluice_e2e::agent_addrs;
use sluice_e2e::relay::CountingRelay;
use sluice_proto::msg::{CkptStatus, JobStatus, Request, Response, StageProgress};
use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

impl Cluster {
    /// One request to a node's agent, as root.
    pub fn agent_request(&self, node: &str, request: Request) -> Result<Response, String> {
        sluice_proto::client::call(&self.agent_socket(node), request, Duration::from_secs(10))
            .map_err(|e| e.to_string())
    }

    /// What the node's agent knows of a job (its state, stage progress, checkpoints).
    pub fn agent_job(&self, node: &str, job: &Job) -> Result<JobStatus, String> {
        match self.agent_request(node, Request::Job { job_id: job.id })? {
            Response::Job(status) => Ok(status),
            other => Err(format!("unexpected reply: {other:?}")),
        }
    }

    /// Waits (see [`Cluster::wait_for`]) until the node's agent answers for the job with a status
    /// that `done` accepts; `what` names that moment in the failure message.
    pub fn wait_agent_job(
        &self,
        node: &str,
        job: &Job,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&JobStatus) -> bool,
    ) {
        self.wait_for(what, timeout, Some(job), || {
            self.agent_job(node, job).is_ok_and(|s| done(&s))
        });
    }

    /// The node's agent's progress record of the job's first stage; panics when the agent does
    /// not answer.
    pub fn agent_stage(&self, node: &str, job: &Job) -> StageProgress {
        let status = self
            .agent_job(node, job)
            .unwrap_or_else(|e| panic!("the agent of {node} on job {}: {e}", job.id));
        status.stages[0].clone()
    }

    /// The job's checkpoints as the node's agent lists them (`ckpt_list`, asked as root).
    pub fn agent_ckpts(&self, node: &str, job: &Job) -> Result<Vec<CkptStatus>, String> {
        match self.agent_request(node, Request::CkptList { job_id: job.id }) {
            Ok(Response::Ckpts { ckpts }) => Ok(ckpts),
            other => Err(format!("ckpt_list for job {} on {node}: {other:?}", job.id)),
        }
    }

    /// One checkpoint as the node's agent lists it; None while the agent knows no such checkpoint
    /// (or job), or does not answer.
    pub fn agent_ckpt(&self, node: &str, job: &Job, tag: &str) -> Option<CkptStatus> {
        self.agent_ckpts(node, job)
            .ok()?
            .into_iter()
            .find(|c| c.tag == tag)
    }
}

/// The fault-injecting proxy (`tests/harness/faultproxy.py`) in front of Garage, on the port of the
/// agents' `s3://ckpt-faulty` store profile. Started by a test, stopped when dropped (also when the
/// test panics); it exits by itself after `MAX_LIFETIME` whatever happens to the test.
pub struct FaultProxy {
    child: std::process::Child,
    control: PathBuf,
    stats: PathBuf,
    log: PathBuf,
}

impl FaultProxy {
    /// Longest a proxy lives, even if its test hangs or is killed.
    pub const MAX_LIFETIME: Duration = Duration::from_secs(1500);

    /// Starts the proxy in `pass` mode and waits until it accepts connections.
    pub fn start(cluster: &Cluster) -> FaultProxy {
        cluster.require_s3();
        let (port, upstream) = cluster.s3_hop("SLUICE_TEST_FAULT_PROXY_PORT");
        let dir = run_dir();
        let control = dir.join("faultproxy.ctl");
        let stats = dir.join("faultproxy.stats.json");
        let log = PathBuf::from(cluster.var("SLUICE_TEST_SLUICE_LOG_DIR")).join("faultproxy.log");
        let _ = fs::remove_file(&stats);
        write_atomically(&control, "pass\n");
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "something already listens on 127.0.0.1:{port}, where the fault proxy should run \
             (a proxy left over from another test?)"
        );
        let log_file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("harness/faultproxy.py");
        let child = Command::new("/usr/bin/python3")
            .arg(&script)
            .args(["--port", &port.to_string(), "--upstream", &upstream])
            .arg("--control")
            .arg(&control)
            .arg("--stats")
            .arg(&stats)
            .args(["--max-lifetime", &Self::MAX_LIFETIME.as_secs().to_string()])
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("dup log"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", script.display()));
        let mut proxy = FaultProxy {
            child,
            control,
            stats,
            log,
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = proxy.child.try_wait() {
                panic!("the fault proxy exited ({status}):\n{}", proxy.log_tail());
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the fault proxy does not listen on {port} after 10 s:\n{}",
                proxy.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        proxy
    }

    /// Switches the mode: `pass`, `503`, `429`, `refuse`, `slow=SECONDS`, `fail-after=N`. The proxy
    /// picks it up within 0.2 s, or at the next request.
    pub fn set(&self, mode: &str) {
        write_atomically(&self.control, &format!("{mode}\n"));
        // Let the proxy's poll see it before the caller goes on (refuse closes the listener there).
        std::thread::sleep(Duration::from_millis(300));
    }

    /// The proxy's counters (see faultproxy.py): `requests`, `forwarded`, `injected.503`, ...
    pub fn stats(&self) -> serde_json::Value {
        fs::read_to_string(&self.stats)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(serde_json::Value::Null)
    }

    /// How many replies of `status` ("503", "429") the proxy made up.
    pub fn injected(&self, status: &str) -> u64 {
        self.stats()["injected"][status].as_u64().unwrap_or(0)
    }

    pub fn log_tail(&self) -> String {
        format!(
            "{}----- fault proxy stats -----\n{}\n",
            tail_of(&self.log),
            self.stats()
        )
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        write_atomically(&self.control, "exit\n");
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Cluster {
    /// The byte-counting relay (`sluice_e2e::relay`) in front of Garage, on the port of the
    /// agents' `s3://datasets-relayed` store profile: what it counts is what the origin served.
    /// A hop in front of Garage: the port the env file gives it (`port_var`), and Garage's
    /// `host:port`, where it forwards to.
    fn s3_hop(&self, port_var: &str) -> (u16, String) {
        let port: u16 = self.var(port_var).parse().expect(port_var);
        let upstream = self
            .var("SLUICE_TEST_S3_ENDPOINT")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        (port, upstream)
    }

    pub fn origin_relay(&self) -> CountingRelay {
        let (port, upstream) = self.s3_hop("SLUICE_TEST_ORIGIN_RELAY_PORT");
        CountingRelay::start(port, &upstream).unwrap_or_else(|e| {
            panic!(
                "cannot listen on 127.0.0.1:{port} for the origin relay (a relay left over?): {e}"
            )
        })
    }
}

/// A small random number source for fault timing, seeded from the clock; tests print the seed, and
/// `SLUICE_TEST_SEED` replays one.
pub struct Dice(SplitMix64);

impl Dice {
    pub fn new() -> (Dice, u64) {
        let seed = std::env::var("SLUICE_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        (Dice(SplitMix64(seed)), seed)
    }

    /// A duration uniformly between `lo` and `hi`.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = (hi - lo).as_millis().max(1) as u64;
        lo + Duration::from_millis(self.0.next() % span)
    }
}

// ---------------------------------------------------------------------------------------- agents

/// A node's agent as the harness started it: its pid, command line and environment, read from
/// `/proc` so a test can kill it and start it again exactly as `cluster.sh up` did.
#[derive(Debug, Clone)]
pub struct AgentProcess {
    pub node: String,
    pub pid: u32,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl AgentProcess {
    /// The index of the agent's configuration file in its command line.
    pub fn config_arg(&self) -> usize {
        1 + self
            .argv
            .iter()
            .position(|a| a == "--config")
            .expect("the agent runs with --config")
    }

    /// The same agent started with another configuration file.
    pub fn with_config(&self, config: &Path) -> AgentProcess {
        let mut changed = self.clone();
        changed.argv[self.config_arg()] = config.display().to_string();
        changed
    }
}

impl Cluster {
    /// `sluiced-<node>.pid` next to the env file (the harness's run directory).
    pub fn agent_pid_file(&self, node: &str) -> PathBuf {
        run_dir().join(format!("sluiced-{node}.pid"))
    }

    /// The pid the harness recorded for the agent of `node` (alive or not).
    pub fn agent_pid(&self, node: &str) -> u32 {
        let pid_file = self.agent_pid_file(node);
        fs::read_to_string(&pid_file)
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", pid_file.display()))
    }

    /// The agent socket of one node (`SLUICE_TEST_SOCKET` with `%n` expanded).
    pub fn agent_socket(&self, node: &str) -> PathBuf {
        PathBuf::from(self.var("SLUICE_TEST_SOCKET").replace("%n", node))
    }

    /// The running agent of `node`; panics unless its pid file names a live `sluiced`.
    pub fn agent_process(&self, node: &str) -> AgentProcess {
        let pid = self.agent_pid(node);
        let split = |bytes: Vec<u8>| -> Vec<String> {
            bytes
                .split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let argv = split(
            fs::read(format!("/proc/{pid}/cmdline"))
                .unwrap_or_else(|e| panic!("agent of {node} (pid {pid}) is not running: {e}")),
        );
        assert!(
            argv.iter().any(|a| a.contains("sluiced")),
            "pid {pid} from {} is not sluiced: {argv:?}",
            self.agent_pid_file(node).display()
        );
        let env = split(fs::read(format!("/proc/{pid}/environ")).expect("agent environ"))
            .into_iter()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect();
        AgentProcess {
            node: node.into(),
            pid,
            argv,
            env,
        }
    }

    /// SIGKILLs the agent of `node` (by the pid the harness recorded) and waits until it is gone.
    /// Returns how it was started, for [`Cluster::start_agent`].
    pub fn kill_agent(&self, node: &str) -> AgentProcess {
        let agent = self.agent_process(node);
        run(Command::new("kill")
            .args(["-KILL", &agent.pid.to_string()])
            .stderr(Stdio::piped()));
        let proc_dir = PathBuf::from(format!("/proc/{}", agent.pid));
        // Gone, or a zombie of ours (an agent this test process restarted earlier) whose other
        // threads are gone too: until the last thread exits, the process still holds its
        // listeners, and a restart could not bind them.
        let gone = || {
            let zombie = fs::read_to_string(proc_dir.join("stat"))
                .map(|s| {
                    s.rsplit_once(')')
                        .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                })
                .unwrap_or(true);
            let threads = fs::read_dir(proc_dir.join("task")).map_or(0, |d| d.count());
            zombie && threads <= 1
        };
        self.wait_for(
            &format!("the agent of {node} (pid {}) to die", agent.pid),
            Duration::from_secs(10),
            None,
            gone,
        );
        agent
    }

    /// [`Cluster::kill_agent`], then waits until the agent's peer and metrics ports are closed, so
    /// an agent started at once can bind them: a SIGKILLed agent this test process started is a
    /// zombie until reaped, and its last threads may still hold its listeners.
    pub fn kill_agent_and_its_ports(&self, node: &str) -> AgentProcess {
        let agent = self.kill_agent(node);
        let ports = agent_addrs(|v| self.var(v).to_string(), node);
        self.wait_for(
            &format!("the ports {ports:?} of {node}'s killed agent to close"),
            Duration::from_secs(20),
            None,
            || {
                ports
                    .iter()
                    .all(|a| std::net::TcpStream::connect(a).is_err())
            },
        );
        agent
    }

    /// Starts an agent again as the harness did (same command line and environment, its own session,
    /// output appended to the node's agent log), records its pid in the harness's pid file, and
    /// waits until it answers on its socket.
    pub fn start_agent(&self, agent: &AgentProcess) -> u32 {
        let pid = self.spawn_agent(agent);
        self.wait_agent_answers(agent);
        pid
    }

    /// [`start_agent`](Self::start_agent) for several agents at once: all are started before any is
    /// waited for, so that none stages for long while another's peer port is still closed (which
    /// would route that node around).
    pub fn start_agents(&self, agents: &[AgentProcess]) {
        for agent in agents {
            self.spawn_agent(agent);
        }
        for agent in agents {
            self.wait_agent_answers(agent);
        }
    }

    fn spawn_agent(&self, agent: &AgentProcess) -> u32 {
        let log = self.agent_log(&agent.node);
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let child = Command::new("setsid")
            .args(&agent.argv)
            .env_clear()
            .envs(agent.env.iter().map(|(k, v)| (k, v)))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot restart {:?}: {e}", agent.argv));
        let pid = child.id();
        // Reap it if it exits while the tests run (it outlives them otherwise, like the harness's).
        std::thread::spawn(move || {
            let mut child = child;
            let _ = child.wait();
        });
        fs::write(self.agent_pid_file(&agent.node), format!("{pid}\n")).expect("write pid file");
        pid
    }

    fn wait_agent_answers(&self, agent: &AgentProcess) {
        let socket = self.agent_socket(&agent.node);
        self.wait_for(
            &format!(
                "the restarted agent of {} to answer on {}",
                agent.node,
                socket.display()
            ),
            Duration::from_secs(30),
            None,
            || {
                sluice_proto::client::call(
                    &socket,
                    sluice_proto::msg::Request::Status,
                    Duration::from_secs(2),
                )
                .is_ok()
            },
        );
    }
}

/// The cluster's agents restarted with a configuration a test changed ([`Cluster::reconfigure_agents`]);
/// dropped (also when the test panics), the agents are started again as the harness started them.
pub struct ReconfiguredAgents {
    cluster: Cluster,
    originals: Vec<AgentProcess>,
    config: PathBuf,
}

impl Cluster {
    /// Restarts every node's agent with its configuration file changed by `change` (the harness's
    /// text in, the test's out), written root-only under the harness's root as `e2e-NAME-*.toml`.
    pub fn reconfigure_agents(
        &self,
        name: &str,
        change: impl FnOnce(&str) -> String,
    ) -> ReconfiguredAgents {
        let originals: Vec<AgentProcess> =
            self.nodes.iter().map(|n| self.agent_process(n)).collect();
        let original = PathBuf::from(&originals[0].argv[originals[0].config_arg()]);
        let text =
            fs::read_to_string(&original).unwrap_or_else(|e| panic!("{}: {e}", original.display()));
        let config = PathBuf::from(self.var("SLUICE_TEST_ROOT"))
            .join(format!("e2e-{name}-{}.toml", unique()));
        // Root-only from its creation: it holds the stores' credentials.
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&config)
            .unwrap_or_else(|e| panic!("{}: {e}", config.display()));
        file.write_all(change(&text).as_bytes()).unwrap();
        for agent in &originals {
            self.kill_agent_and_its_ports(&agent.node);
        }
        let changed: Vec<AgentProcess> = originals.iter().map(|a| a.with_config(&config)).collect();
        self.start_agents(&changed);
        ReconfiguredAgents {
            cluster: self.clone(),
            originals,
            config,
        }
    }
}

impl Drop for ReconfiguredAgents {
    fn drop(&mut self) {
        for agent in &self.originals {
            self.cluster.kill_agent_and_its_ports(&agent.node);
        }
        self.cluster.start_agents(&self.originals);
        let _ = fs::remove_file(&self.config);
    }
}
