//! A fleet of N `sluiced` agents on this machine, driven the way the SPANK plugin drives them but
//! without Slurm: how staging behaves at more nodes than the test cluster has (issue 29).
//!
//! The test cluster (`tests/harness/cluster.sh`) has three virtual nodes, a `slurmd` and an agent
//! each; 32 `slurmd` do not fit a 2-core machine well. Slurm takes part in a job's staging only
//! through the plugin's requests to each node's agent socket, as root: `JobStart` from
//! `job_prolog` (the job's id, user, node list and raw sluice options), `WaitStaged` from
//! `task_init`, `JobEnd` from `job_epilog`. A [`Fleet`] sends exactly those to agents of its own,
//! nodes `s01`, `s02`, …, so everything the agents do for a job — listing the dataset, each
//! file's owner reading it from the origin, peer transfers, routing around a lost node — runs as
//! in an N-node job. What is not here: Slurm's scheduling and the spread of its prologs over the
//! nodes, the job's tasks, and `WaitStaged` being retried while an agent restarts (a waiter here
//! asks once; a killed agent's waiter ends with the error).
//!
//! Each agent has its own socket, state directory, log, peer port and metrics port, and its part
//! of one tmpfs the fleet mounts as their hot tiers (the disk is not what is measured); its
//! configuration is written like the test cluster's, and all share one fresh cluster secret.
//! Their object-store origin is the test cluster's Garage (the endpoint and key from the
//! harness's env file), reached through a [`CountingRelay`] the fleet owns: every `s3://` URL of
//! the agents goes through it, so it sees, and can pace, all the origin's traffic.
//!
//! **Each node its own address.** A peer server takes at most `2 × concurrency + 16` connections
//! from one address (one node's fetches and probes; more is a flood). Agents that all connect
//! from 127.0.0.1 look like one node to each other: from 8 nodes on, the servers refuse the
//! excess and the nodes route around each other. So node `i` gets a loopback address of its own,
//! `127.0.213.i` (added to `lo` as a /32, whose local route makes it the source of connections *to*
//! it), and its configuration names every peer at that address, on the peer's port: its
//! connections to peers then come from `127.0.213.i`, as a real node's come from its own address,
//! and the peer servers listen on every address (`0.0.0.0:port`) to take them.
//!
//! Nothing stays behind: dropping the fleet stops its agents (SIGTERM, then SIGKILL), unmounts the
//! tmpfs and removes everything under its root but the agents' logs. The agents stay in the
//! driver's process group (a Ctrl-C reaches them too), and their pids are kept in files: a fleet
//! started on the same root after a driver died without dropping its own kills those agents first,
//! and `tests/harness/cluster.sh down` stops what any such fleet left (agents, tmpfs, addresses).

use crate::mounts_below;
use crate::procfs;
use crate::relay::CountingRelay;
use nix::mount::{MntFlags, MsFlags};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sluice_proto::client::{call, call_with};
use sluice_proto::msg::{JobDirs, JobStart, JobStatus, Request, Response};
use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The fleet's ports, clear of the test cluster's (Garage 3900-3903, the fault proxy 3911, the
/// origin relay 3912, the agents' peer ports 7071-7073 and metrics 9464 and 9470-9473, Azurite
/// 10000, slurmd 17001-17003) and below the kernel's ephemeral range: its relay listens on
/// [`RELAY_PORT`], node `i` (from 1) on `PEER_BASE + i` for peers and `METRICS_BASE + i` for
/// Prometheus.
pub const RELAY_PORT: u16 = 7200;
const PEER_BASE: u16 = 7200;
const METRICS_BASE: u16 = 7300;
/// The most nodes a fleet has (two-digit names, ports below the next base).
pub const MAX_NODES: usize = 99;
/// Node `i`'s own address is `127.0.213.i`: in 127.0.0.0/8, which `lo` holds, and far from
/// 127.0.1.1, which Debian's /etc/hosts gives the host name (`cluster.sh`'s `stop_fleets` knows it).
const NODE_NET: [u8; 3] = [127, 0, 213];
/// The agents' `[stage] timeout`, and the longest a waiter waits for a node's staging.
pub const STAGE_TIMEOUT: Duration = Duration::from_secs(600);
/// A request that answers at once (a job's start or end, a status).
const QUICK: Duration = Duration::from_secs(10);
/// How long an agent may take to start, or to clean up an ended job.
const SETTLE: Duration = Duration::from_secs(60);
/// The job name the fleet's jobs have (`SLURM_JOB_NAME` in a real one).
const JOB_NAME: &str = "fleet";

/// The test cluster's Garage, as the harness's env file describes it.
#[derive(Debug, Clone)]
pub struct Garage {
    /// `host:port`.
    pub endpoint: String,
    pub region: String,
    pub key_id: String,
    pub secret: String,
}

impl Garage {
    /// From the env file of `tests/harness/cluster.sh up`, whose variables `var` reads.
    pub fn from_env(var: impl Fn(&str) -> String) -> Garage {
        Garage {
            endpoint: var("SLUICE_TEST_S3_ENDPOINT")
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string(),
            region: var("SLUICE_TEST_S3_REGION"),
            key_id: var("SLUICE_TEST_S3_KEY_ID"),
            secret: var("SLUICE_TEST_S3_SECRET"),
        }
    }
}

/// What fleet to start.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// How many agents: nodes `s01` to `sNN`, at most [`MAX_NODES`].
    pub nodes: usize,
    /// The fleet's directory (configuration, sockets, state, logs; the hot tiers' tmpfs is
    /// mounted below it). Every directory above it must let the job user through.
    pub root: PathBuf,
    /// The agent binary.
    pub sluiced: PathBuf,
    /// The tmpfs of every node's hot tier together, bytes.
    pub hot_tier_size: u64,
    /// The jobs' user (an unprivileged one: `sluiceuser` of the test cluster).
    pub user: String,
    pub garage: Garage,
    /// The agents' log filter (`SLUICE_LOG`), e.g. `warn`.
    pub log_filter: String,
}

/// One agent of the fleet.
struct Agent {
    node: String,
    socket: PathBuf,
    /// `host:port` of its peer listener.
    peer: String,
    pid_file: PathBuf,
    log: PathBuf,
    /// `None` once killed or stopped.
    child: Option<Child>,
}

/// The fleet: its agents, its tmpfs and its origin relay, all stopped when dropped.
pub struct Fleet {
    root: PathBuf,
    hot: PathBuf,
    mounted: bool,
    /// The nodes' own addresses this fleet added to `lo`.
    addresses: Vec<Ipv4Addr>,
    agents: Vec<Agent>,
    relay: CountingRelay,
    user: String,
    uid: u32,
    gid: u32,
    next_job: AtomicU32,
}

/// One job on (some of) the fleet's nodes, started by [`Fleet::start_job`]; every node's waiter
/// (`WaitStaged`, as `task_init` sends it) runs from its start.
pub struct FleetJob {
    pub id: u32,
    pub nodes: Vec<String>,
    /// When the fleet began to tell the nodes that the job starts.
    pub started: Instant,
    waiters: Vec<JoinHandle<Staged>>,
}

/// How one node's staging of a job ended, as its waiter saw it.
#[derive(Debug, Clone)]
pub struct Staged {
    pub node: String,
    /// From the job's start to the agent's answer.
    pub after: Duration,
    /// The job's directories (with the notes for the job output), or the agent's error (or why
    /// it could not be asked).
    pub dirs: Result<JobDirs, String>,
}

/// What one agent used so far.
#[derive(Debug, Clone)]
pub struct Usage {
    pub node: String,
    /// Peak resident memory (since the last [`Fleet::reset_peaks`]), KiB.
    pub vm_hwm_kib: u64,
    /// CPU seconds, user + system, since the agent started.
    pub cpu_s: f64,
}

/// Node `i`'s name (from 1).
pub fn node_name(i: usize) -> String {
    format!("s{i:02}")
}

/// Node `i`'s own address (see the module doc).
fn node_ip(i: usize) -> Ipv4Addr {
    let [a, b, c] = NODE_NET;
    Ipv4Addr::new(a, b, c, i as u8)
}

impl Fleet {
    /// Starts the fleet that `spec` describes and waits until every agent answers on its socket
    /// and its peer port.
    pub fn start(spec: &FleetSpec) -> Result<Fleet, String> {
        if !(1..=MAX_NODES).contains(&spec.nodes) {
            return Err(format!(
                "a fleet has 1 to {MAX_NODES} nodes, not {}",
                spec.nodes
            ));
        }
        let (uid, gid) = (id_of(&spec.user, "-u")?, id_of(&spec.user, "-g")?);
        let root = spec.root.clone();
        make_dir(&root, 0o755)?;
        stop_leftovers(&root);
        let nodes: Vec<String> = (1..=spec.nodes).map(node_name).collect();
        let ports: Vec<(String, u16)> =
            std::iter::once(("the fleet's origin relay".into(), RELAY_PORT))
                .chain((1..=spec.nodes).flat_map(|i| {
                    let n = node_name(i);
                    [
                        (format!("the peer port of {n}"), PEER_BASE + i as u16),
                        (format!("the metrics port of {n}"), METRICS_BASE + i as u16),
                    ]
                }))
                .collect();
        for (what, port) in &ports {
            if TcpStream::connect(("127.0.0.1", *port)).is_ok() {
                return Err(format!(
                    "port {port} (for {what}) is in use: another fleet, or something else (ss -ltnp 'sport = :{port}')"
                ));
            }
        }
        let relay = CountingRelay::start(RELAY_PORT, &spec.garage.endpoint)
            .map_err(|e| format!("the fleet's origin relay on 127.0.0.1:{RELAY_PORT}: {e}"))?;
        let hot = root.join("hot");
        let mut fleet = Fleet {
            hot: hot.clone(),
            root: root.clone(),
            mounted: false,
            addresses: Vec::new(),
            agents: Vec::new(),
            relay,
            user: spec.user.clone(),
            uid,
            gid,
            next_job: AtomicU32::new(1),
        };
        for d in ["run", "logs"] {
            make_dir(&root.join(d), 0o755)?;
        }
        for d in ["state", "config"] {
            make_dir(&root.join(d), 0o700)?;
        }
        make_dir(&hot, 0o755)?;
        nix::mount::mount(
            Some("sluice-fleet"),
            &hot,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(format!("size={},mode=0755", spec.hot_tier_size).as_str()),
        )
        .map_err(|e| format!("mounting a tmpfs on {}: {e}", hot.display()))?;
        fleet.mounted = true;
        for n in &nodes {
            make_dir(&hot.join(n), 0o755)?;
        }
        let secret = root.join("peer.key");
        let mut key = [0u8; 32];
        fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut key))
            .map_err(|e| format!("reading /dev/urandom: {e}"))?;
        write_private(&secret, &key)?;
        for i in 1..=spec.nodes {
            let ip = node_ip(i);
            ip_addr("add", ip)?;
            fleet.addresses.push(ip);
            let config = root.join("config").join(format!("{}.toml", node_name(i)));
            write_private(&config, config_text(spec, &root, &secret, i).as_bytes())?;
            let agent = fleet.spawn(spec, &config, i)?;
            fleet.agents.push(agent);
        }
        for i in 0..fleet.agents.len() {
            fleet.wait_answers(i)?;
        }
        Ok(fleet)
    }

    /// Starts node `i`'s agent with its configuration file `config`.
    fn spawn(&self, spec: &FleetSpec, config: &Path, i: usize) -> Result<Agent, String> {
        let node = node_name(i);
        let node = node.as_str();
        let log = self.root.join("logs").join(format!("{node}.log"));
        let out = fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let child = Command::new(&spec.sluiced)
            .arg("--config")
            .arg(config)
            .args(["--node", node])
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("LANG", "C.UTF-8")
            .envs(agent_service_env())
            .env("SLUICE_LOG", &spec.log_filter)
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", spec.sluiced.display()))?;
        let pid_file = self.root.join("run").join(format!("{node}.pid"));
        fs::write(&pid_file, format!("{}\n", child.id()))
            .map_err(|e| format!("{}: {e}", pid_file.display()))?;
        Ok(Agent {
            node: node.to_string(),
            socket: self.root.join("run").join(format!("{node}.sock")),
            peer: format!("{}:{}", node_ip(i), PEER_BASE + i as u16),
            pid_file,
            log,
            child: Some(child),
        })
    }

    /// Waits until agent `i` answers a status request and accepts connections on its peer port
    /// (an agent whose peer port cannot be bound stages alone, which would be a broken fleet).
    fn wait_answers(&mut self, i: usize) -> Result<(), String> {
        let t = Instant::now();
        loop {
            let a = &mut self.agents[i];
            let answers = call(&a.socket, Request::Status, Duration::from_secs(2)).is_ok();
            if answers && TcpStream::connect(&a.peer).is_ok() {
                return Ok(());
            }
            let exited = a.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                return Err(format!(
                    "the agent of {} exited ({status}) before answering:\n{}",
                    a.node,
                    tail(&a.log)
                ));
            }
            if t.elapsed() > SETTLE {
                return Err(format!(
                    "the agent of {} does not answer on {} and {} after {} s:\n{}",
                    a.node,
                    a.socket.display(),
                    a.peer,
                    SETTLE.as_secs(),
                    tail(&a.log)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every node's name, `s01` first.
    pub fn nodes(&self) -> Vec<String> {
        self.agents.iter().map(|a| a.node.clone()).collect()
    }

    /// The relay in front of Garage that all the agents' `s3://` requests pass.
    pub fn relay(&self) -> &CountingRelay {
        &self.relay
    }

    fn agent(&self, node: &str) -> Result<&Agent, String> {
        self.agents
            .iter()
            .find(|a| a.node == node)
            .ok_or_else(|| format!("the fleet has no node {node}"))
    }

    /// Starts a job of the fleet's user on `nodes` (its node list, in this order) with the sluice
    /// `options` exactly as the plugin passes them (option name without `--`, raw value, e.g.
    /// `("stage-mode", "replicate")`): each node's `JobStart`, sent to all of them at once as
    /// their prologs would, then each node's `WaitStaged`, whose answers
    /// [`FleetJob::wait_staged`] collects.
    pub fn start_job(
        &self,
        nodes: &[String],
        options: &[(String, String)],
    ) -> Result<FleetJob, String> {
        let id = self.next_job.fetch_add(1, Ordering::SeqCst);
        let sockets: Vec<PathBuf> = nodes
            .iter()
            .map(|n| Ok(self.agent(n)?.socket.clone()))
            .collect::<Result<_, String>>()?;
        let started = Instant::now();
        let refused: Vec<String> = std::thread::scope(|s| {
            let starts: Vec<_> = nodes
                .iter()
                .zip(&sockets)
                .map(|(node, socket)| {
                    let start = JobStart {
                        job_id: id,
                        uid: self.uid,
                        gid: self.gid,
                        user: self.user.clone(),
                        node: node.clone(),
                        nodes: nodes.to_vec(),
                        job_name: JOB_NAME.into(),
                        options: options.to_vec(),
                    };
                    s.spawn(
                        move || match call(socket, Request::JobStart(start), QUICK) {
                            Ok(Response::Ok) => None,
                            other => Some(format!("{node}: {other:?}")),
                        },
                    )
                })
                .collect();
            starts
                .into_iter()
                .filter_map(|h| h.join().expect("a job start thread panicked"))
                .collect()
        });
        if !refused.is_empty() {
            return Err(format!("job {id} did not start: {}", refused.join("; ")));
        }
        let waiters = nodes
            .iter()
            .zip(sockets)
            .map(|(node, socket)| {
                let node = node.clone();
                std::thread::spawn(move || {
                    let wait = Request::WaitStaged {
                        job_id: id,
                        timeout_ms: STAGE_TIMEOUT.as_millis() as u64,
                        step: None,
                    };
                    let answer = call_with(&socket, wait, None, QUICK, STAGE_TIMEOUT + QUICK);
                    let after = started.elapsed();
                    let dirs = match answer {
                        Ok(Response::Ready(dirs)) => Ok(dirs),
                        Ok(other) => Err(format!("unexpected answer {other:?}")),
                        Err(e) => Err(e.to_string()),
                    };
                    Staged { node, after, dirs }
                })
            })
            .collect();
        Ok(FleetJob {
            id,
            nodes: nodes.to_vec(),
            started,
            waiters,
        })
    }

    /// What `node`'s agent knows of job `job` (its stages' progress: bytes from the origin, from
    /// peers, elapsed time).
    pub fn job_status(&self, node: &str, job: &FleetJob) -> Result<JobStatus, String> {
        match call(
            &self.agent(node)?.socket,
            Request::Job { job_id: job.id },
            QUICK,
        ) {
            Ok(Response::Job(status)) => Ok(status),
            other => Err(format!("the agent of {node} on job {}: {other:?}", job.id)),
        }
    }

    /// SIGKILLs the agents of `nodes` and reaps them (their sockets and ports are then dead).
    pub fn kill(&mut self, nodes: &[String]) -> Result<(), String> {
        for node in nodes {
            let a = self
                .agents
                .iter_mut()
                .find(|a| &a.node == node)
                .ok_or_else(|| format!("the fleet has no node {node}"))?;
            let mut child = a
                .child
                .take()
                .ok_or_else(|| format!("the agent of {node} is not running"))?;
            child
                .kill()
                .and_then(|()| child.wait().map(drop))
                .map_err(|e| format!("killing the agent of {node}: {e}"))?;
            let _ = fs::remove_file(&a.pid_file);
        }
        Ok(())
    }

    /// Ends the job on each of its nodes whose agent runs (`JobEnd`, as `job_epilog` sends it)
    /// and waits until each has removed the job's directory from its hot tier.
    pub fn end_job(&self, job: &FleetJob) -> Result<(), String> {
        let live: Vec<&Agent> = job
            .nodes
            .iter()
            .filter_map(|n| self.agent(n).ok())
            .filter(|a| a.child.is_some())
            .collect();
        for a in &live {
            match call(&a.socket, Request::JobEnd { job_id: job.id }, QUICK) {
                Ok(Response::Ok) => {}
                other => return Err(format!("ending job {} on {}: {other:?}", job.id, a.node)),
            }
        }
        let t = Instant::now();
        for a in &live {
            let dir = self.job_dir(&a.node, job);
            while dir.exists() {
                if t.elapsed() > SETTLE {
                    return Err(format!(
                        "{} is still there {} s after the job ended",
                        dir.display(),
                        SETTLE.as_secs()
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// `<hot tier>/jobs/<id>` of `node`: where its agent keeps the job's directories.
    pub fn job_dir(&self, node: &str, job: &FleetJob) -> PathBuf {
        self.hot.join(node).join("jobs").join(job.id.to_string())
    }

    /// Peak memory and CPU time of every running agent.
    pub fn usage(&self) -> Result<Vec<Usage>, String> {
        self.running()
            .map(|(a, pid)| {
                let e = |e: std::io::Error| format!("the agent of {} (pid {pid}): {e}", a.node);
                Ok(Usage {
                    node: a.node.clone(),
                    vm_hwm_kib: procfs::vm_hwm_kib(pid).map_err(e)?,
                    cpu_s: procfs::cpu_s(pid).map_err(e)?,
                })
            })
            .collect()
    }

    /// Resets every running agent's peak memory to what it holds now.
    pub fn reset_peaks(&self) -> Result<(), String> {
        for (a, pid) in self.running() {
            procfs::reset_hwm(pid)
                .map_err(|e| format!("the agent of {} (pid {pid}): {e}", a.node))?;
        }
        Ok(())
    }

    fn running(&self) -> impl Iterator<Item = (&Agent, u32)> {
        self.agents
            .iter()
            .filter_map(|a| Some((a, a.child.as_ref()?.id())))
    }

    /// The last lines of `node`'s agent log, for a failure message.
    pub fn log_tail(&self, node: &str) -> String {
        self.agent(node).map_or_else(|e| e, |a| tail(&a.log))
    }
}

impl FleetJob {
    /// Every node's staging outcome, in the job's node order, once each node's agent answered.
    /// Later calls return nothing.
    pub fn wait_staged(&mut self) -> Vec<Staged> {
        self.waiters
            .drain(..)
            .map(|h| h.join().expect("a staging waiter panicked"))
            .collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let running: Vec<_> = self
            .agents
            .iter_mut()
            .filter_map(|a| Some((a.child.take()?, a.pid_file.clone())))
            .collect();
        for (child, _) in &running {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        }
        let t = Instant::now();
        for (mut child, pid_file) in running {
            while !matches!(child.try_wait(), Ok(Some(_)) | Err(_)) {
                if t.elapsed() > Duration::from_secs(10) {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = fs::remove_file(pid_file);
        }
        if self.mounted {
            unmount(&self.hot);
        }
        for ip in &self.addresses {
            let _ = ip_addr("del", *ip);
        }
        for p in ["run", "state", "hot", "config", "peer.key"] {
            let p = self.root.join(p);
            let _ = if p.is_dir() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
        }
    }
}

/// Node `i`'s configuration, written like the test cluster's (`tests/harness/cluster.sh`,
/// `write_agent_config`): the same stage and peer tunables, so that the figures compare with its
/// 3-node jobs'. Its peers are named at this node's own address (see the module doc).
fn config_text(spec: &FleetSpec, root: &Path, secret: &Path, i: usize) -> String {
    let g = &spec.garage;
    let node = node_name(i);
    let mut t = format!(
        r#"# Written by sluice_e2e::fleet — node {node} of {n} agents on one host.
[agent]
socket = "{root}/run/{node}.sock"
state_dir = "{root}/state/{node}"
# No Slurm here: the agent never asks squeue about a job.
squeue = ""

[hot_tier]
root = "{root}/hot/{node}"

[stage]
concurrency = 16
part_size = "16MiB"
timeout = "{timeout}s"

[[stage.allow]]
prefix = "s3://datasets/"

[[stage.allow]]
prefix = "s3://datasets-relayed/"

# Every s3:// URL reaches Garage through the fleet's counting relay.
[[store]]
prefix = "s3://"
endpoint = "http://127.0.0.1:{relay}"
region = "{region}"
access_key_id = "{key}"
secret_access_key = "{secret_key}"
allow_http = true

[metrics]
listen = "127.0.0.1:{metrics}"

# Every peer at this node's own address {ip}, on the peer's port: connections to them come from
# {ip}, and each agent listens on every address to take them.
[peer]
secret_file = "{secret}"
unit_size = "16MiB"
listen = "0.0.0.0:{peer}"

[peer.nodes]
"#,
        n = spec.nodes,
        root = root.display(),
        timeout = STAGE_TIMEOUT.as_secs(),
        relay = RELAY_PORT,
        region = g.region,
        key = g.key_id,
        secret_key = g.secret,
        metrics = METRICS_BASE + i as u16,
        ip = node_ip(i),
        secret = secret.display(),
        peer = PEER_BASE + i as u16,
    );
    for j in 1..=spec.nodes {
        t += &format!(
            "{} = \"{}:{}\"\n",
            node_name(j),
            node_ip(i),
            PEER_BASE + j as u16
        );
    }
    t
}

/// The `Environment=` settings of the agent's systemd unit, as shipped (its allocator settings
/// shape the agent's speed and peak memory).
pub fn agent_service_env() -> Vec<(&'static str, &'static str)> {
    include_str!("../../slurm-conf/sluiced.service")
        .lines()
        .filter_map(|l| l.strip_prefix("Environment="))
        .filter_map(|kv| kv.split_once('='))
        .collect()
}

/// Whether every file below `source` is below `staged` with the same bytes, and nothing else is
/// there; the first differences otherwise. Returns the bytes compared.
pub fn compare_trees(source: &Path, staged: &Path) -> Result<u64, String> {
    let (want, got) = (files(source)?, files(staged)?);
    let missing: Vec<&String> = want.iter().filter(|p| !got.contains(p)).take(5).collect();
    let extra: Vec<&String> = got.iter().filter(|p| !want.contains(p)).take(5).collect();
    if !missing.is_empty() || !extra.is_empty() {
        return Err(format!(
            "{} holds {} files, {} has {}; missing e.g. {missing:?}, unexpected e.g. {extra:?}",
            staged.display(),
            got.len(),
            source.display(),
            want.len()
        ));
    }
    let mut bytes = 0;
    for rel in &want {
        let (a, b) = (source.join(rel), staged.join(rel));
        let read = |p: &Path| fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let (a, b) = (read(&a)?, read(&b)?);
        if a != b {
            let at = a.iter().zip(&b).position(|(x, y)| x != y);
            return Err(format!(
                "{} differs from its source: {} bytes instead of {}, first difference at {at:?}",
                staged.join(rel).display(),
                b.len(),
                a.len()
            ));
        }
        bytes += a.len() as u64;
    }
    Ok(bytes)
}

/// Every regular file below `dir`, relative, sorted; an error for anything else there.
fn files(dir: &Path) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))? {
            let e = e.map_err(|e| format!("{}: {e}", d.display()))?;
            let t = e
                .file_type()
                .map_err(|err| format!("{}: {err}", e.path().display()))?;
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                out.push(rel);
            } else {
                return Err(format!("{} is a {t:?}", e.path().display()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn id_of(user: &str, flag: &str) -> Result<u32, String> {
    let out = Command::new("id")
        .args([flag, user])
        .output()
        .map_err(|e| format!("id {flag} {user}: {e}"))?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| format!("no user {user} (tests/harness/install.sh creates it)"))
}

fn make_dir(dir: &Path, mode: u32) -> Result<(), String> {
    fs::create_dir_all(dir)
        .and_then(|()| fs::set_permissions(dir, fs::Permissions::from_mode(mode)))
        .map_err(|e| format!("{}: {e}", dir.display()))
}

/// Writes `bytes` to a fresh file only root may read (it holds the store's key or the secret).
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let _ = fs::remove_file(path);
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// SIGKILLs the agents an earlier fleet on `root` left running (its pid files name them, and
/// their command lines name its configuration directory), then unmounts what it left mounted and
/// takes the nodes' addresses off `lo`.
fn stop_leftovers(root: &Path) {
    let configs = root.join("config").display().to_string();
    for e in fs::read_dir(root.join("run"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let path = e.path();
        if path.extension().is_none_or(|x| x != "pid") {
            continue;
        }
        let pid: Option<i32> = fs::read_to_string(&path)
            .ok()
            .and_then(|p| p.trim().parse().ok());
        let ours = pid.is_some_and(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&configs))
        });
        if let (true, Some(pid)) = (ours, pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            let t = Instant::now();
            while Path::new(&format!("/proc/{pid}")).exists() && t.elapsed() < SETTLE {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = fs::remove_file(&path);
    }
    for m in mounts_below(root) {
        unmount(&m);
    }
    let held = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "dev", "lo"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for word in held.split_whitespace() {
        if let Some(Ok(ip)) = word.strip_suffix("/32").map(str::parse::<Ipv4Addr>)
            && ip.octets()[..3] == NODE_NET
        {
            let _ = ip_addr("del", ip);
        }
    }
}

/// `ip addr add|del IP/32 dev lo`.
fn ip_addr(verb: &str, ip: Ipv4Addr) -> Result<(), String> {
    let out = Command::new("ip")
        .args(["addr", verb, &format!("{ip}/32"), "dev", "lo"])
        .output()
        .map_err(|e| format!("ip addr {verb} {ip}/32 dev lo: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ip addr {verb} {ip}/32 dev lo: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Unmounts `path`, lazily if something still holds it.
fn unmount(path: &Path) {
    if nix::mount::umount(path).is_err() {
        let _ = nix::mount::umount2(path, MntFlags::MNT_DETACH);
    }
}

/// The last 30 lines of a log file.
fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "----- tail of {} -----\n{}",
        path.display(),
        lines[lines.len().saturating_sub(30)..].join("\n")
    )
}
