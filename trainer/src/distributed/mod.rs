//! Multi-process training: launcher, rendezvous, collectives and the device mesh's groups.
//!
//! - [`launch`]: `titan-train --nproc-per-node N` starts and supervises ranks like torchrun.
//! - [`env`]: [`env::LaunchEnv`], this process's rank/world from torchrun, srun or by-hand variables.
//! - [`store`]: [`store::TcpStore`], libtorch's c10d TCPStore through a C++ shim (torchrun's
//!   agent store speaks the same protocol).
//! - [`runtime`]: [`runtime::Dist`] joins the job (store, clock offset to rank 0) and creates
//!   groups implementing [`comm::Collectives`]: [`cpu::CpuGroup`] (TCP ring, gloo-style
//!   chunked and pipelined) or `nccl::NcclGroup` (feature `nccl`).
//! - [`failure`]: [`failure::FailureBoard`], the first failure posted to the store so every
//!   rank's error names the root cause.
//! - [`recorded`]: every collective of a multi-rank group recorded as a titan-obs span.
//! - [`mesh`]: [`mesh::DeviceMesh`], this rank's process group per mesh dimension
//!   ([`mesh::Group`]), shared with the autograd functions of [`crate::parallelize`].
pub mod clock;
pub mod comm;
pub mod connect;
pub mod cpu;
pub mod elem;
pub mod env;
pub mod failure;
pub mod launch;
pub mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod recorded;
pub mod ring;
pub mod runtime;
pub mod store;

pub use comm::{Collectives, CommError, P2pOp, ReduceOp};
pub use env::{EnvError, LaunchEnv};
pub use mesh::{DeviceMesh, Group, Pending};
pub use runtime::{Backend, CommOptions, Dist};
