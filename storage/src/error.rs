//! The error type: every failure names the file (path or URL) at fault.

/// A storage failure.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// Reading or writing a local `file` failed.
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// An object store request for `file` failed.
    #[error("{file}: {source}")]
    Store {
        file: String,
        #[source]
        source: object_store::Error,
    },
    /// A file or name is not acceptable (too large, truncated, leaves its root).
    #[error("{file}: {reason}")]
    Invalid { file: String, reason: String },
    /// A location given by the user cannot be used (bad URL, unsupported scheme).
    #[error("{0}")]
    Usage(String),
}

pub type Result<T, E = StorageError> = std::result::Result<T, E>;

impl StorageError {
    pub(crate) fn io(file: impl std::fmt::Display, source: std::io::Error) -> StorageError {
        StorageError::Io {
            file: file.to_string(),
            source,
        }
    }

    pub(crate) fn store(file: impl std::fmt::Display, source: object_store::Error) -> StorageError {
        StorageError::Store {
            file: file.to_string(),
            source,
        }
    }

    pub(crate) fn invalid(file: impl std::fmt::Display, reason: impl Into<String>) -> StorageError {
        StorageError::Invalid {
            file: file.to_string(),
            reason: reason.into(),
        }
    }

    /// Whether the file simply does not exist.
    pub fn is_not_found(&self) -> bool {
        match self {
            StorageError::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            StorageError::Store { source, .. } => {
                matches!(source, object_store::Error::NotFound { .. })
            }
            _ => false,
        }
    }
}
