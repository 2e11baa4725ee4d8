//! Training and validation data: tokenizer, document sources, and the packing loader.

pub mod loader;
pub mod prefetch;
pub mod shuffle;
pub mod source;
pub mod tokenizer;

pub use loader::{Batch, HostBatch, LoaderState, TextLoader};
pub use prefetch::PrefetchLoader;
pub use source::Dataset;
pub use tokenizer::TextTokenizer;
