//! titan-ckpt: read, write and transform PyTorch Distributed Checkpoint (DCP) and Hugging Face
//! safetensors checkpoints without libtorch.
//!
//! Foundation skeleton; issue 3 builds the formats and commands.

pub mod dcp;
pub mod dtype;

pub use dtype::Dtype;
