//! `titan-train --nproc-per-node N ...`: a torchrun-like launcher. It hosts the rendezvous store
//! (on node 0), starts N ranks of the same program with torchrun's environment variables,
//! prefixes their output lines with `[rankN]:`, and supervises them: when one exits non-zero or
//! dies, the others get SIGTERM, then SIGKILL after a grace period, and the launcher exits
//! non-zero naming the rank that failed first.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use super::store::{StoreOptions, TcpStore};

/// Which ranks' output is shown.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogRanks {
    All,
    Only(Vec<usize>),
}

impl LogRanks {
    fn shows(&self, rank: usize) -> bool {
        match self {
            LogRanks::All => true,
            LogRanks::Only(r) => r.contains(&rank),
        }
    }
}

/// The launcher's flags (torchrun's static rendezvous).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchArgs {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// None: pick a free port (single node only).
    pub master_port: Option<u16>,
    pub log_ranks: LogRanks,
    /// Time between SIGTERM and SIGKILL when stopping the ranks.
    pub grace: Duration,
}

/// Help text for the launcher flags (appended to `titan-train --help`).
pub const LAUNCH_HELP: &str = "\
Multi-process launch (like torchrun; without these flags titan-train reads RANK/WORLD_SIZE/...
from torchrun, srun or the environment, or runs as one process):
  --nproc-per-node N        start N ranks on this node and supervise them
  --nnodes N                number of nodes (default 1)
  --node-rank I             this node's index, 0..nnodes (default 0; node 0 hosts the store)
  --master-addr HOST        host of node 0 (default 127.0.0.1)
  --master-port PORT        rendezvous port on node 0 (default: a free port; required with nnodes > 1)
  --log-ranks 0,1|all       which ranks' output to show (default all); lines are prefixed [rankN]:
  --stop-grace-seconds S    SIGTERM-to-SIGKILL grace when a rank fails (default 5)";

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.parse::<T>()
        .map_err(|_| format!("{flag}: {v:?} is not a valid number"))
}

/// Removes the launcher flags from `args` (program name excluded). Returns the launch request
/// when `--nproc-per-node` is present, and the remaining arguments for the ranks.
pub fn split_args(args: Vec<OsString>) -> Result<(Option<LaunchArgs>, Vec<OsString>), String> {
    let mut nproc = None;
    let mut nnodes = 1usize;
    let mut node_rank = 0usize;
    let mut master_addr = "127.0.0.1".to_string();
    let mut master_port = None;
    let mut log_ranks = LogRanks::All;
    let mut grace = Duration::from_secs(5);
    let mut seen_launcher_flag = None;
    let mut rest = Vec::new();
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let Some(s) = arg.to_str().map(str::to_string) else {
            rest.push(arg);
            continue;
        };
        if s == "--" {
            rest.push(arg);
            rest.extend(it);
            break;
        }
        let (flag, inline) = match s.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (s.clone(), None),
        };
        let norm = flag.replace('_', "-");
        let known = [
            "--nproc-per-node",
            "--nnodes",
            "--node-rank",
            "--master-addr",
            "--master-port",
            "--log-ranks",
            "--stop-grace-seconds",
        ];
        if !known.contains(&norm.as_str()) {
            rest.push(arg);
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| format!("{flag} needs a value"))?,
        };
        seen_launcher_flag = Some(flag.clone());
        match norm.as_str() {
            "--nproc-per-node" => {
                let n: usize = parse_num(&flag, &value)?;
                if n == 0 {
                    return Err(format!("{flag} must be at least 1"));
                }
                nproc = Some(n);
            }
            "--nnodes" => {
                nnodes = parse_num(&flag, &value)?;
                if nnodes == 0 {
                    return Err(format!("{flag} must be at least 1"));
                }
            }
            "--node-rank" => node_rank = parse_num(&flag, &value)?,
            "--master-addr" => master_addr = value,
            "--master-port" => {
                let p: u16 = parse_num(&flag, &value)?;
                if p == 0 {
                    return Err(format!("{flag} must be a port between 1 and 65535"));
                }
                master_port = Some(p);
            }
            "--log-ranks" => {
                log_ranks = if value == "all" {
                    LogRanks::All
                } else {
                    LogRanks::Only(
                        value
                            .split(',')
                            .map(|r| parse_num::<usize>(&flag, r.trim()))
                            .collect::<Result<_, _>>()?,
                    )
                }
            }
            "--stop-grace-seconds" => grace = Duration::from_secs_f64(parse_num(&flag, &value)?),
            _ => unreachable!(),
        }
    }
    let Some(nproc_per_node) = nproc else {
        if let Some(flag) = seen_launcher_flag {
            return Err(format!(
                "{flag} only applies together with --nproc-per-node"
            ));
        }
        return Ok((None, rest));
    };
    if node_rank >= nnodes {
        return Err(format!(
            "--node-rank {node_rank} must be below --nnodes {nnodes}"
        ));
    }
    if nnodes > 1 && master_port.is_none() {
        return Err(
            "--master-port is required with --nnodes > 1 (every node must agree on it)".into(),
        );
    }
    Ok((
        Some(LaunchArgs {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            log_ranks,
            grace,
        }),
        rest,
    ))
}

/// How the job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOutcome {
    /// The process exit code the launcher should use.
    pub exit_code: i32,
    /// The first rank that failed and how, if any.
    pub failure: Option<String>,
}

static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => {
            let name = match s {
                libc::SIGKILL => "SIGKILL",
                libc::SIGTERM => "SIGTERM",
                libc::SIGSEGV => "SIGSEGV",
                libc::SIGABRT => "SIGABRT",
                libc::SIGINT => "SIGINT",
                libc::SIGBUS => "SIGBUS",
                _ => "",
            };
            format!("was killed by signal {s} {name}")
                .trim_end()
                .to_string()
        }
        _ => format!("ended ({status})"),
    }
}

/// Copies `from` line by line to our stdout or stderr with a `[rankN]:` prefix (when shown),
/// keeping the last lines for the failure report.
fn pump(
    from: impl Read,
    rank: usize,
    show: bool,
    to_stderr: bool,
    tail: Arc<Mutex<VecDeque<String>>>,
) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim_end_matches(['\n', '\r']);
        // Rank 0's step counter, reported to be drawn here (console::STEP_EVENTS_ENV).
        if rank == 0 && to_stderr && crate::console::follow_step_event(text) {
            continue;
        }
        if show {
            crate::console::write_above(to_stderr, format!("[rank{rank}]:{text}\n").as_bytes());
        }
        if to_stderr {
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == 20 {
                t.pop_front();
            }
            t.push_back(text.to_string());
        }
    }
}

/// Runs `program args` as this node's ranks and supervises them until all exit.
pub fn run(
    launch: &LaunchArgs,
    program: &Path,
    args: &[OsString],
) -> anyhow::Result<LaunchOutcome> {
    let world_size = launch.nproc_per_node * launch.nnodes;
    // Node 0 hosts the store (like torchrun's agent): it outlives any rank, so surviving ranks
    // can still read failure notices when rank 0 dies.
    let store = if launch.node_rank == 0 {
        let s = TcpStore::connect(&StoreOptions {
            host: launch.master_addr.clone(),
            port: launch.master_port.unwrap_or(0),
            is_server: true,
            num_workers: None,
            timeout: Duration::from_secs(60),
        })
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot host the rendezvous store on {}:{}: {e}",
                launch.master_addr,
                launch.master_port.unwrap_or(0)
            )
        })?;
        Some(s)
    } else {
        None
    };
    let port = store
        .as_ref()
        .map(|s| s.port())
        .or(launch.master_port)
        .expect("port known");

    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    let (done_tx, done_rx) = mpsc::channel::<(usize, ExitStatus)>();
    let mut pids = Vec::new();
    let mut tails = Vec::new();
    let mut pumps = Vec::new();
    for local_rank in 0..launch.nproc_per_node {
        let rank = launch.node_rank * launch.nproc_per_node + local_rank;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", launch.nproc_per_node.to_string())
            .env("GROUP_RANK", launch.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("MASTER_ADDR", &launch.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("TITAN_LAUNCHED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if rank == 0 && std::io::stderr().is_terminal() {
            // Its stderr is our pipe: it reports its step counter for us to draw.
            cmd.env(crate::console::STEP_EVENTS_ENV, "1");
        }
        if std::env::var_os("OMP_NUM_THREADS").is_none() && launch.nproc_per_node > 1 {
            // As torchrun: N ranks on one node should not each use every core.
            let cores = std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1);
            cmd.env(
                "OMP_NUM_THREADS",
                (cores / launch.nproc_per_node).max(1).to_string(),
            );
        }
        // SAFETY: prctl is async-signal-safe; the rank dies with the launcher instead of
        // lingering as an orphan.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let mut alive = vec![true; pids.len()];
                stop_all(&pids, &mut alive, launch.grace, &done_rx);
                anyhow::bail!("cannot start rank {rank} ({}): {e}", program.display());
            }
        };
        pids.push(child.id() as libc::pid_t);
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        tails.push(tail.clone());
        let show = launch.log_ranks.shows(rank);
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let t2 = tail.clone();
        pumps.push(std::thread::spawn(move || {
            pump(out, rank, show, false, tail)
        }));
        pumps.push(std::thread::spawn(move || pump(err, rank, show, true, t2)));
        let tx = done_tx.clone();
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = tx.send((local_rank, status));
            }
        });
    }
    drop(done_tx);

    let mut alive = vec![true; launch.nproc_per_node];
    let mut outcome = LaunchOutcome {
        exit_code: 0,
        failure: None,
    };
    while alive.iter().any(|&a| a) {
        match done_rx.recv_timeout(Duration::from_millis(50)) {
            Ok((local_rank, status)) => {
                alive[local_rank] = false;
                let rank = launch.node_rank * launch.nproc_per_node + local_rank;
                if !status.success() && outcome.failure.is_none() {
                    let msg = format!(
                        "rank {rank} (local rank {local_rank}, pid {}) {}",
                        pids[local_rank],
                        describe(status)
                    );
                    outcome.exit_code = status.code().filter(|&c| c != 0).unwrap_or(1);
                    outcome.failure = Some(msg);
                    stop_all(&pids, &mut alive, launch.grace, &done_rx);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let sig = SIGNALLED.swap(0, Ordering::SeqCst);
                if sig != 0 {
                    outcome.exit_code = 128 + sig;
                    outcome.failure = Some(format!("the launcher received signal {sig}"));
                    stop_all(&pids, &mut alive, launch.grace, &done_rx);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    for p in pumps {
        let _ = p.join();
    }
    if let Some(msg) = &outcome.failure {
        let failed_local = msg
            .strip_prefix("rank ")
            .and_then(|r| r.split(' ').next())
            .and_then(|r| r.parse::<usize>().ok())
            .and_then(|r| r.checked_sub(launch.node_rank * launch.nproc_per_node));
        let mut err = std::io::stderr().lock();
        let _ = writeln!(err, "titan-train launcher: {msg}; stopped the other ranks");
        if let Some(tail) = failed_local.and_then(|l| tails.get(l)) {
            let tail = tail.lock().unwrap_or_else(|e| e.into_inner());
            if !tail.is_empty()
                && !launch
                    .log_ranks
                    .shows(launch.node_rank * launch.nproc_per_node + failed_local.unwrap_or(0))
            {
                let _ = writeln!(err, "last lines of its stderr:");
                for l in tail.iter() {
                    let _ = writeln!(err, "  {l}");
                }
            }
        }
    }
    drop(store);
    Ok(outcome)
}

/// SIGTERM to every rank still running, SIGKILL to those left after `grace`.
fn stop_all(
    pids: &[libc::pid_t],
    alive: &mut [bool],
    grace: Duration,
    done_rx: &mpsc::Receiver<(usize, ExitStatus)>,
) {
    let signal_alive = |alive: &[bool], sig| {
        for (i, &pid) in pids.iter().enumerate() {
            if alive[i] {
                // SAFETY: signalling our own child. Only ranks not yet reported as exited are
                // signalled, so a reaped pid is not reused under us (barring the instant between
                // a waiter's reap and its report, when the child is gone and nothing is lost).
                unsafe { libc::kill(pid, sig) };
            }
        }
    };
    signal_alive(alive, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while alive.iter().any(|&a| a) {
        let left = deadline.saturating_duration_since(Instant::now());
        match done_rx.recv_timeout(left) {
            Ok((local, _)) => alive[local] = false,
            Err(_) => break,
        }
    }
    if alive.iter().any(|&a| a) {
        signal_alive(alive, libc::SIGKILL);
        while alive.iter().any(|&a| a) {
            match done_rx.recv_timeout(Duration::from_secs(5)) {
                Ok((local, _)) => alive[local] = false,
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn launcher_flags_are_split_from_trainer_flags() {
        let (l, rest) = split_args(os(&[
            "--nproc-per-node",
            "4",
            "--training.steps",
            "10",
            "--log-ranks=0,2",
            "--master_port",
            "29501",
        ]))
        .unwrap();
        let l = l.unwrap();
        assert_eq!(l.nproc_per_node, 4);
        assert_eq!(l.log_ranks, LogRanks::Only(vec![0, 2]));
        assert_eq!(l.master_port, Some(29501));
        assert_eq!(rest, os(&["--training.steps", "10"]));
        let (l, rest) = split_args(os(&["--training.steps=3"])).unwrap();
        assert!(l.is_none());
        assert_eq!(rest, os(&["--training.steps=3"]));
    }

    #[test]
    fn bad_launcher_flags_are_named() {
        for (args, want) in [
            (vec!["--nproc-per-node", "x"], "--nproc-per-node: \"x\""),
            (vec!["--nproc-per-node", "0"], "at least 1"),
            (
                vec!["--nnodes", "2"],
                "only applies together with --nproc-per-node",
            ),
            (
                vec!["--nproc-per-node", "2", "--nnodes", "2"],
                "--master-port is required",
            ),
            (
                vec![
                    "--nproc-per-node",
                    "2",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "2",
                    "--master-port",
                    "1",
                ],
                "must be below --nnodes 2",
            ),
            (vec!["--nproc-per-node"], "needs a value"),
        ] {
            let err = split_args(os(&args)).unwrap_err();
            assert!(err.contains(want), "{args:?}: {err}");
        }
    }
}
