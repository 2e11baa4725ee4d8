//! The error type: every failure names the file (and the tensor, when there is one) at fault.

use std::fmt;

/// A titan-ckpt failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing `file` failed.
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// Reaching a file through titan-storage failed (local or object store; the message names
    /// the file or URL).
    #[error(transparent)]
    Storage(titan_storage::StorageError),
    /// The checkpoint's bytes or metadata are not what the format requires.
    #[error("{file}{tensor}: {reason}", tensor = TensorSuffix(tensor))]
    Invalid {
        file: String,
        tensor: Option<String>,
        reason: String,
    },
    /// A DCP native checkpoint is unreadable (the message names file and item).
    #[error(transparent)]
    Dcp(Box<titan_dcp::DcpError>),
    /// The command line or its arguments are wrong (exit code 2).
    #[error("{0}")]
    Usage(String),
}

struct TensorSuffix<'a>(&'a Option<String>);

impl fmt::Display for TensorSuffix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(t) => write!(f, ": tensor `{t}`"),
            None => Ok(()),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<titan_dcp::DcpError> for Error {
    fn from(e: titan_dcp::DcpError) -> Error {
        Error::Dcp(Box::new(e))
    }
}

impl From<titan_storage::StorageError> for Error {
    fn from(e: titan_storage::StorageError) -> Error {
        match e {
            // A location the user typed is a usage error (exit 2), whichever layer found it.
            titan_storage::StorageError::Usage(msg) => Error::Usage(msg),
            other => Error::Storage(other),
        }
    }
}

impl Error {
    /// An invalid-checkpoint error about `file` as a whole.
    pub fn invalid(file: impl fmt::Display, reason: impl Into<String>) -> Error {
        Error::Invalid {
            file: file.to_string(),
            tensor: None,
            reason: reason.into(),
        }
    }

    /// An invalid-checkpoint error about one tensor in `file`.
    pub fn tensor(file: impl fmt::Display, tensor: &str, reason: impl Into<String>) -> Error {
        Error::Invalid {
            file: file.to_string(),
            tensor: Some(tensor.to_string()),
            reason: reason.into(),
        }
    }

    pub fn io(file: impl fmt::Display, source: std::io::Error) -> Error {
        Error::Io {
            file: file.to_string(),
            source,
        }
    }

    pub fn usage(msg: impl Into<String>) -> Error {
        Error::Usage(msg.into())
    }
}
