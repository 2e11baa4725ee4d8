//! titan-storage: where titan's files live — a local directory or an object store prefix
//! (`s3://`, `gs://`, `az://`, `memory://`, `file://`) — behind one API, for checkpoints
//! (titan-ckpt, titan-train) and observability runs (titan-obs).
//!
//! Main types: [`Root`] (parse a path or URL; list, open, create, remove files in it),
//! [`InFile`] (ranged reads: `pread` locally, ranged GETs remotely, small ones served from
//! cached 8 MiB blocks during a run of nearby reads), [`OutFile`] (writes that
//! appear under their name only when complete: temporary name + rename locally, a multipart
//! upload completed at the end remotely; dropped unfinished, nothing is left behind),
//! [`check_relative`] / [`relative_path_problem`] (the one rule that keeps names read from
//! untrusted files inside their root, titan-dcp's too) and
//! [`StorageError`] (every error names the file or URL). One tokio runtime, [`runtime`], drives
//! every object store request of the process.

mod block_cache;
mod error;
mod file;
mod path;
mod root;

use std::sync::OnceLock;

pub use error::{Result, StorageError};
pub use file::{InFile, OutFile};
pub use path::{check_relative, relative_path_problem};
pub use root::{Root, is_url};

/// The tokio runtime that drives object store requests (created on first use, shared by every
/// titan crate in the process).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("titan-storage")
            .enable_all()
            .build()
            .expect("cannot start the tokio runtime for object store I/O")
    })
}
