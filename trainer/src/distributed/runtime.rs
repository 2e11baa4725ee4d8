//! Joining the job: connect to (or host) the rendezvous store, build the world group of the
//! chosen backend, measure the clock offset to rank 0, and create sub-groups.

use std::sync::Arc;
use std::time::Duration;

use super::clock;
use super::comm::{Collectives, CommError};
use super::connect::SocketOptions;
use super::cpu::CpuGroup;
use super::env::LaunchEnv;
use super::failure::{FailureBoard, Posted};
use super::store::{StoreOptions, TcpStore};
use crate::parallel::RankSync;

/// A barrier on the store: every rank adds to a counter; the last one sets a done key that all
/// wait for.
struct StoreBarrier {
    store: Arc<TcpStore>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl RankSync for StoreBarrier {
    fn barrier(&self, name: &str) -> anyhow::Result<()> {
        let count = format!("titan/barrier/{name}/count");
        let done = format!("titan/barrier/{name}/done");
        let store_err = |source| CommError::Store {
            rank: self.rank,
            source,
        };
        let arrived = self.store.add(&count, 1).map_err(store_err)?;
        if arrived as usize == self.world_size {
            self.store.set(&done, b"1").map_err(store_err)?;
        }
        self.store.wait(&[&done], self.timeout).map_err(|e| {
            anyhow::anyhow!(
                "rank {}: waited {:?} at barrier `{name}` for the other ranks ({}): {e}",
                self.rank,
                self.timeout,
                "a rank died or is stuck; raise comm.init_timeout_seconds if it is just slow"
            )
        })?;
        Ok(())
    }
}

/// Which collective backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// TCP ring on CPU tensors.
    Cpu,
    /// NCCL on CUDA tensors (feature `nccl`).
    Nccl,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" | "gloo" => Ok(Backend::Cpu),
            "nccl" => Ok(Backend::Nccl),
            other => Err(format!(
                "unknown comm backend {other:?} (expected cpu or nccl)"
            )),
        }
    }
}

/// Settings of the distributed runtime (torchtitan's `[comm]` section).
#[derive(Debug, Clone)]
pub struct CommOptions {
    pub backend: Backend,
    /// Rendezvous and connection setup must finish within this.
    pub init_timeout: Duration,
    /// A collective whose peer makes no progress for this long fails.
    pub timeout: Duration,
    pub socket: SocketOptions,
    /// This rank's CUDA device when it is not its local rank (ranks sharing GPUs over the cpu
    /// backend: `train::select_device`).
    pub cuda_device: Option<usize>,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            backend: Backend::Cpu,
            init_timeout: Duration::from_secs(300),
            timeout: Duration::from_secs(100),
            socket: SocketOptions::default(),
            cuda_device: None,
        }
    }
}

/// This process's membership in a job.
pub struct Dist {
    pub env: LaunchEnv,
    /// The rendezvous store and the job's failure notices on it; None for a single process.
    pub failures: Option<Arc<FailureBoard>>,
    pub opts: CommOptions,
    /// Rank 0's wall clock minus ours (ns); 0 on rank 0 and single processes.
    pub clock_offset_ns: i64,
    /// Round trip of the clock sample used (ns): the offset is good to half of it.
    pub clock_rtt_ns: i64,
    /// CUDA device index of this rank (the local rank unless ranks share GPUs).
    pub device_index: usize,
}

impl Dist {
    /// Joins the job described by `env`. A single-process env needs no store.
    pub fn init(env: LaunchEnv, opts: CommOptions) -> Result<Dist, CommError> {
        let rank = env.rank;
        let mut dist = Dist {
            device_index: opts.cuda_device.unwrap_or(env.local_rank),
            env,
            failures: None,
            opts,
            clock_offset_ns: 0,
            clock_rtt_ns: 0,
        };
        if !dist.env.is_distributed() {
            return Ok(dist);
        }
        // torchrun's agent or titan-train's launcher already hosts the store; otherwise rank 0
        // does (torch's env:// rendezvous).
        let is_server = !dist.env.use_agent_store && rank == 0;
        let store = TcpStore::connect(&StoreOptions {
            host: dist.env.master_addr.clone(),
            port: dist.env.master_port,
            is_server,
            num_workers: None,
            timeout: dist.opts.init_timeout,
        })
        .map_err(|source| CommError::Store { rank, source })?;
        let store = Arc::new(store);
        dist.failures = Some(Arc::new(FailureBoard::new(
            store.clone(),
            dist.env.world_size,
            is_server,
            dist.opts.timeout,
        )));
        let (offset, rtt) = clock::measure_offset(
            &store,
            &dist.env.master_addr,
            rank,
            dist.env.world_size,
            dist.opts.init_timeout,
        )?;
        dist.clock_offset_ns = offset;
        dist.clock_rtt_ns = rtt;
        store
            .set_timeout(dist.opts.timeout)
            .map_err(|source| CommError::Store { rank, source })?;
        Ok(dist)
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// A group of `members` (global ranks, this rank among them). Every member must call this
    /// with the same `name` and `members`, in the same order relative to other group creations.
    /// The collectives of a group of two or more ranks are recorded as titan-obs spans.
    pub fn new_group(
        &self,
        name: &str,
        members: Vec<usize>,
    ) -> Result<Box<dyn Collectives>, CommError> {
        let group = self.connect_group(name, members)?;
        Ok(if group.size() > 1 {
            Box::new(super::recorded::Recorded(group))
        } else {
            group
        })
    }

    fn connect_group(
        &self,
        name: &str,
        members: Vec<usize>,
    ) -> Result<Box<dyn Collectives>, CommError> {
        let rank = self.rank();
        let me = members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| CommError::Setup {
                rank,
                message: format!("rank {rank} is not a member of group {name} {members:?}"),
            })?;
        let key = format!("titan/pg/{name}");
        match self.opts.backend {
            Backend::Cpu => {
                let group = match &self.failures {
                    Some(failures) => {
                        let mut socket = self.opts.socket.clone();
                        socket.timeout = self.opts.init_timeout;
                        let mut g = CpuGroup::connect(
                            failures.clone(),
                            &self.env.master_addr,
                            &key,
                            members,
                            me,
                            &socket,
                        )?;
                        g.set_timeout(self.opts.timeout)
                            .map_err(|e| CommError::Setup {
                                rank,
                                message: e.to_string(),
                            })?;
                        g
                    }
                    None => CpuGroup::single(),
                };
                Ok(Box::new(group))
            }
            Backend::Nccl => self.new_nccl_group(&key, members, me),
        }
    }

    #[cfg(feature = "nccl")]
    fn new_nccl_group(
        &self,
        key: &str,
        members: Vec<usize>,
        me: usize,
    ) -> Result<Box<dyn Collectives>, CommError> {
        let group = super::nccl::NcclGroup::connect(
            self.failures.clone(),
            key,
            members,
            me,
            self.device_index,
            self.opts.init_timeout,
        )?;
        Ok(Box::new(group))
    }

    #[cfg(not(feature = "nccl"))]
    fn new_nccl_group(
        &self,
        _key: &str,
        _members: Vec<usize>,
        _me: usize,
    ) -> Result<Box<dyn Collectives>, CommError> {
        Err(CommError::Setup {
            rank: self.rank(),
            message: "this titan-train was built without the nccl backend; rebuild with \
                      its default features (`nccl`), or set comm.backend = \"cpu\" (host-staged collectives) or \
                      training.device = \"cpu\""
                .into(),
        })
    }

    /// Barriers over the rendezvous store (usable from any thread), for multi-rank checkpoint
    /// commits; `None` for a single process. Each waits at most `comm.init_timeout_seconds`.
    pub fn store_barrier(&self) -> Option<Arc<dyn RankSync>> {
        let store = self.failures.as_ref()?.store.clone();
        Some(Arc::new(StoreBarrier {
            store,
            rank: self.rank(),
            world_size: self.world_size(),
            timeout: self.opts.init_timeout,
        }))
    }

    /// The world group (all ranks).
    pub fn world_group(&self) -> Result<Box<dyn Collectives>, CommError> {
        self.new_group("world", (0..self.world_size()).collect())
    }

    /// Posts a failure notice to the store (first writer wins) so other ranks can name the
    /// root cause; returns the notice that is in the store afterwards.
    pub fn post_failure(&self, message: &str) -> Option<String> {
        match self.failures.as_ref()?.post(message) {
            Posted::First => Some(message.to_string()),
            Posted::After(first) => Some(first),
            Posted::Unreachable(_) => None,
        }
    }

    /// The first failure any rank posted, if one did.
    pub fn first_failure(&self) -> Option<String> {
        self.failures.as_ref()?.first()
    }
}
