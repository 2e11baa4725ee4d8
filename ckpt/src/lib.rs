//! titan-ckpt: read, write and transform PyTorch Distributed Checkpoint (DCP) and Hugging Face
//! safetensors checkpoints without libtorch.
//!
//! Every input format is read into a [`CheckpointPlan`] (`formats`): tensor name -> dtype, global
//! shape and chunks, each chunk a box of the tensor plus where its bytes are. Commands work on
//! plans: `consolidate` and `convert` plan output files and run the copy engine (`write`), which
//! streams chunk bytes through bounded buffers (`assemble`, `cast`); `inspect`, `verify` and
//! `diff` report on plans. The DCP format itself is the `titan-dcp` crate (read through
//! `dcp_store`); files live wherever `titan-storage` reaches (`storage`). Block-quantized float8
//! weights carry their scales on their plan and are dequantized by the copy engine (`fp8`).

pub mod adapter;
pub mod assemble;
pub mod cast;
pub mod consolidate;
pub mod dcp_store;
pub mod error;
pub mod experts;
pub mod formats;
pub mod fp8;
pub mod inspect;
pub mod plan;
pub mod safetensors;
pub mod storage;
pub mod write;

pub use error::{Error, Result};
pub use plan::{CheckpointPlan, Chunk, ChunkSource, Encoding, Format, TensorPlan};
pub use titan_dcp::Dtype;
