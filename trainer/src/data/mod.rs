//! Training and validation data: tokenizer, document sources, and the packing loader.

pub mod loader;
pub mod shuffle;
pub mod source;
pub mod tokenizer;

pub use loader::{Batch, LoaderState, TextLoader};
pub use source::Dataset;
pub use tokenizer::TextTokenizer;
