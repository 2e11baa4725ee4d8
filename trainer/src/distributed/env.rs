//! Who am I in the job: rank, world size and rendezvous address from the launcher's environment.
//!
//! Sources, in order: torchrun or variables set by hand (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, torchrun's `TORCHELASTIC_USE_AGENT_STORE`),
//! then SLURM `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE` /
//! `SLURM_TASKS_PER_NODE`, first host of `SLURM_NODELIST`), else a single process.

use std::collections::HashMap;

/// Which launcher the environment came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// No launcher variables: one process.
    Single,
    /// `RANK`/`WORLD_SIZE` (torchrun, titan-train's own launcher, or set by hand).
    Torchrun,
    Slurm,
}

/// The process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// A store already runs at master_addr:master_port (torchrun's agent or titan-train's
    /// launcher): every rank connects as a client; otherwise rank 0 hosts it.
    pub use_agent_store: bool,
    pub source: EnvSource,
}

/// Inconsistent or malformed launcher variables (a usage error: exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("invalid launch environment: {0}")]
pub struct EnvError(pub String);

const DEFAULT_MASTER_PORT: u16 = 29500;

impl LaunchEnv {
    /// A single process (no launcher).
    pub fn single() -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            use_agent_store: false,
            source: EnvSource::Single,
        }
    }

    /// Reads the process environment.
    pub fn from_process_env() -> Result<LaunchEnv, EnvError> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        Self::from_vars(&vars)
    }

    /// Reads launcher variables from `vars` (the process environment, or a test's map).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<LaunchEnv, EnvError> {
        let get = |k: &str| vars.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            return Self::from_torchrun(&get);
        }
        if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
            return Self::from_slurm(&get);
        }
        for k in ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
            if get(k).is_some() {
                // Harmless on its own, but usually a half-configured launch: say so.
                tracing::warn!("{k} is set but RANK/WORLD_SIZE are not: running as one process");
            }
        }
        Ok(Self::single())
    }

    fn from_torchrun<'a>(get: &dyn Fn(&str) -> Option<&'a str>) -> Result<LaunchEnv, EnvError> {
        let (Some(rank), Some(world)) = (get("RANK"), get("WORLD_SIZE")) else {
            return Err(EnvError(
                "RANK and WORLD_SIZE must be set together (found only one of them)".into(),
            ));
        };
        let rank = parse_usize("RANK", rank)?;
        let world_size = parse_usize("WORLD_SIZE", world)?;
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse_usize("LOCAL_RANK", v)?,
            None if world_size == 1 => 0,
            None => {
                return Err(EnvError(
                    "LOCAL_RANK is not set (needed with WORLD_SIZE > 1 to pick this process's device)"
                        .into(),
                ));
            }
        };
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(v) => parse_usize("LOCAL_WORLD_SIZE", v)?,
            // By hand without LOCAL_WORLD_SIZE: assume one node.
            None => world_size,
        };
        let (master_addr, master_port) = master(get, world_size, None)?;
        let use_agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
            .map(|v| v.eq_ignore_ascii_case("true") || v == "1")
            .unwrap_or(false);
        let env = LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            use_agent_store,
            source: EnvSource::Torchrun,
        };
        env.validate()
    }

    fn from_slurm<'a>(get: &dyn Fn(&str) -> Option<&'a str>) -> Result<LaunchEnv, EnvError> {
        let rank = parse_usize("SLURM_PROCID", get("SLURM_PROCID").unwrap_or_default())?;
        let world_size = parse_usize("SLURM_NTASKS", get("SLURM_NTASKS").unwrap_or_default())?;
        let local_rank = match get("SLURM_LOCALID") {
            Some(v) => parse_usize("SLURM_LOCALID", v)?,
            None => 0,
        };
        let local_world_size = match (get("SLURM_NTASKS_PER_NODE"), get("SLURM_TASKS_PER_NODE")) {
            (Some(v), _) => parse_usize("SLURM_NTASKS_PER_NODE", v)?,
            // "4(x2),3": tasks on each node; ours is not known by index, the first is typical.
            (None, Some(v)) => parse_tasks_per_node(v)?,
            (None, None) => world_size,
        };
        let first_host = match get("SLURM_JOB_NODELIST").or(get("SLURM_NODELIST")) {
            Some(list) => Some(first_host(list)?),
            None => None,
        };
        // A port derived from the job id keeps two jobs sharing a node apart.
        let job_port = get("SLURM_JOB_ID")
            .and_then(|j| j.parse::<u64>().ok())
            .map(|j| 20000 + (j % 10000) as u16);
        let (mut master_addr, master_port) = master(get, world_size, job_port)?;
        if get("MASTER_ADDR").is_none() {
            master_addr = first_host.ok_or_else(|| {
                EnvError("SLURM: neither MASTER_ADDR nor SLURM_NODELIST is set".into())
            })?;
        }
        let env = LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            use_agent_store: false,
            source: EnvSource::Slurm,
        };
        env.validate()
    }

    fn validate(self) -> Result<LaunchEnv, EnvError> {
        if self.world_size == 0 {
            return Err(EnvError("world size is 0".into()));
        }
        if self.rank >= self.world_size {
            return Err(EnvError(format!(
                "rank {} is not below the world size {}",
                self.rank, self.world_size
            )));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return Err(EnvError(format!(
                "local world size {} must be between 1 and the world size {}",
                self.local_world_size, self.world_size
            )));
        }
        if self.local_rank >= self.local_world_size {
            return Err(EnvError(format!(
                "local rank {} is not below the local world size {}",
                self.local_rank, self.local_world_size
            )));
        }
        Ok(self)
    }

    /// Whether this is a multi-process job.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

fn parse_usize(name: &str, v: &str) -> Result<usize, EnvError> {
    v.parse::<usize>()
        .map_err(|_| EnvError(format!("{name}={v:?} is not a non-negative integer")))
}

fn master<'a>(
    get: &dyn Fn(&str) -> Option<&'a str>,
    world_size: usize,
    default_port: Option<u16>,
) -> Result<(String, u16), EnvError> {
    let addr = get("MASTER_ADDR");
    let port = get("MASTER_PORT");
    if world_size > 1 && addr.is_none() && default_port.is_none() {
        return Err(EnvError(
            "MASTER_ADDR is not set (needed with WORLD_SIZE > 1: the host of rank 0 or of the store)"
                .into(),
        ));
    }
    if world_size > 1 && port.is_none() && default_port.is_none() {
        return Err(EnvError(
            "MASTER_PORT is not set (needed with WORLD_SIZE > 1: the rendezvous store's port)"
                .into(),
        ));
    }
    let port = match port {
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => {
                return Err(EnvError(format!(
                    "MASTER_PORT={p:?} is not a port (1-65535)"
                )));
            }
        },
        None => default_port.unwrap_or(DEFAULT_MASTER_PORT),
    };
    Ok((addr.unwrap_or("127.0.0.1").to_string(), port))
}

/// `4(x2),3` -> 4: the task count of the first node.
fn parse_tasks_per_node(v: &str) -> Result<usize, EnvError> {
    let first = v.split(',').next().unwrap_or_default();
    let count = first.split('(').next().unwrap_or_default();
    parse_usize("SLURM_TASKS_PER_NODE", count)
}

/// The first host of a SLURM hostlist: `gpu[003-005,9],login1` -> `gpu003`.
pub fn first_host(list: &str) -> Result<String, EnvError> {
    let bad = || EnvError(format!("SLURM_NODELIST={list:?} is not a hostlist"));
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1).ok_or_else(bad)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    if entry.is_empty() {
        return Err(bad());
    }
    let Some(open) = entry.find('[') else {
        return Ok(entry.to_string());
    };
    let close = entry.find(']').ok_or_else(bad)?;
    if close < open {
        return Err(bad());
    }
    let prefix = &entry[..open];
    let suffix = &entry[close + 1..];
    let first_range = entry[open + 1..close].split(',').next().ok_or_else(bad)?;
    // Keep the zero padding: "003-005" -> "003".
    let first = first_range.split('-').next().ok_or_else(bad)?;
    if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
        return Err(bad());
    }
    let host = format!("{prefix}{first}{suffix}");
    // Several bracket groups ("rack[1-2]-n[1-4]"): expand the next one.
    if suffix.contains('[') {
        return first_host(&host);
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn no_launcher_variables_means_one_process() {
        let env = LaunchEnv::from_vars(&vars(&[("PATH", "/bin")])).unwrap();
        assert_eq!(env, LaunchEnv::single());
    }

    #[test]
    fn torchrun_variables() {
        let env = LaunchEnv::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (3, 8, 1, 2)
        );
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("node7", 29400)
        );
        assert!(env.use_agent_store);
        assert_eq!(env.source, EnvSource::Torchrun);
    }

    #[test]
    fn inconsistent_torchrun_variables_are_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[
                    ("RANK", "2"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "rank 2 is not below the world size 2",
            ),
            (&[("RANK", "0")], "RANK and WORLD_SIZE must be set together"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")],
                "MASTER_ADDR is not set",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT=\"70000\"",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "local rank 2 is not below the local world size 2",
            ),
        ];
        for (v, want) in cases {
            let err = LaunchEnv::from_vars(&vars(v)).unwrap_err().to_string();
            assert!(err.contains(want), "{v:?}: {err}");
        }
    }

    #[test]
    fn slurm_variables() {
        let env = LaunchEnv::from_vars(&vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_NODELIST", "gpu[003-004,010]"),
            ("SLURM_JOB_ID", "123456"),
        ]))
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(env.master_addr, "gpu003");
        assert_eq!(env.master_port, 23456);
        assert_eq!(env.source, EnvSource::Slurm);
        // Explicit MASTER_* win over the derived ones.
        let env = LaunchEnv::from_vars(&vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODELIST", "a,b"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (env.master_addr.as_str(), env.master_port),
            ("10.0.0.1", 1234)
        );
    }

    #[test]
    fn slurm_hostlists() {
        assert_eq!(first_host("node1").unwrap(), "node1");
        assert_eq!(first_host("node1,node2").unwrap(), "node1");
        assert_eq!(first_host("gpu[07-09,12],cpu1").unwrap(), "gpu07");
        assert_eq!(first_host("rack[2]-n[1-4]").unwrap(), "rack2-n1");
        assert!(first_host("gpu[a-b]").is_err());
        assert!(first_host("").is_err());
        assert!(first_host("gpu]1[").is_err());
    }
}
