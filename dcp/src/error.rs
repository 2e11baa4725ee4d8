//! The error of the DCP reader and writer: every variant names the file, and the item when
//! there is one.

use std::io;

use super::pickle::PickleError;
use super::tensor_item::ItemError;

#[derive(Debug, thiserror::Error)]
pub enum DcpError {
    /// Reading or writing `file` failed.
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: io::Error,
    },
    /// `.metadata` is not a pickle we accept (disallowed global, truncated, hostile).
    #[error("{file}: {source}")]
    Pickle {
        file: String,
        #[source]
        source: PickleError,
    },
    /// `.metadata` unpickled but does not describe a DCP checkpoint.
    #[error("{file}: {msg}")]
    Metadata { file: String, msg: String },
    /// An item (tensor chunk or bytes) could not be read.
    #[error("{file}: {item}: {source}")]
    Item {
        file: String,
        item: String,
        #[source]
        source: ItemError,
    },
    /// The request or the checkpoint is inconsistent (unknown tensor, coverage gap, ...).
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = DcpError> = std::result::Result<T, E>;

pub(crate) fn io_err(file: impl std::fmt::Display) -> impl FnOnce(io::Error) -> DcpError {
    let file = file.to_string();
    move |source| DcpError::Io { file, source }
}
