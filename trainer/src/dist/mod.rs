//! Multi-process data parallelism: launcher, rendezvous, collectives and data-parallel training.
//!
//! - [`launch`]: `titan-train --nproc-per-node N` starts and supervises ranks like torchrun.
//! - [`env`]: [`env::LaunchEnv`], this process's rank/world from torchrun, srun or by-hand variables.
//! - [`store`]: [`store::TcpStore`], libtorch's c10d TCPStore through a C++ shim (torchrun's
//!   agent store speaks the same protocol).
//! - [`runtime`]: [`runtime::Dist`] joins the job (store, clock offset to rank 0) and creates
//!   groups implementing [`comm::Collectives`]: [`cpu::CpuGroup`] (TCP ring, gloo-style
//!   chunked and pipelined) or `nccl::NcclGroup` (feature `nccl`).
//! - [`recorded`]: every collective of a multi-rank group recorded as a titan-obs span.
//! - [`dp`]: [`dp::DataParallel`], DDP bucketed all-reduce, ZeRO-2 sharded AdamW and HSDP.
//! - [`hook`]: [`hook::DistributedDp`], the training loop's [`crate::parallel::DataParallel`]
//!   on top of [`dp`].
pub mod clock;
pub mod comm;
pub mod connect;
pub mod cpu;
pub mod dp;
pub mod elem;
pub mod env;
pub mod hook;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod recorded;
pub mod ring;
pub mod runtime;
pub mod store;

pub use comm::{Collectives, CommError, ReduceOp};
pub use dp::{AdamWStep, DataParallel, DpDegrees};
pub use env::{EnvError, LaunchEnv};
pub use hook::DistributedDp;
pub use runtime::{Backend, CommOptions, Dist};
