//! titan-train: a lean Llama-3 trainer on libtorch (through tch).
//!
//! Foundation skeleton; issue 2 builds the model, config, data, optimizer and training loop.

pub mod dist;
