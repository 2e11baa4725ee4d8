//! Where checkpoint bytes live: a local directory or an object store prefix.
//!
//! Reads are byte ranges (`pread` locally, ranged GETs on object stores). Writes go to a temporary
//! name that is renamed when complete (local) or to a multipart upload that is completed at the
//! end (object stores), so an output file only ever appears whole. Names that come from untrusted
//! index files or metadata are checked so they cannot leave the checkpoint root.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use object_store::buffered::BufWriter;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};

/// The tokio runtime that drives object store requests (created on first use).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("cannot start the tokio runtime for object store I/O")
    })
}

/// A checkpoint directory: local or an object store prefix.
#[derive(Clone)]
pub struct Root {
    kind: RootKind,
}

#[derive(Clone)]
enum RootKind {
    Local(PathBuf),
    Object {
        store: Arc<dyn ObjectStore>,
        prefix: ObjPath,
        url: String,
    },
}

impl std::fmt::Debug for Root {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Root({})", self.display())
    }
}

/// A location given on the command line: a root plus, when it named one file, that file.
#[derive(Debug, Clone)]
pub struct Location {
    pub root: Root,
    pub file: Option<String>,
}

fn is_url(s: &str) -> bool {
    s.contains("://")
}

impl Location {
    /// Parses a local path or a `s3://`, `gs://`, `az://`, `file://` URL. A path naming a file
    /// (locally: an existing file; on object stores: a name ending in `.safetensors` or `.json`)
    /// becomes its parent root plus the file name.
    pub fn parse(s: &str) -> Result<Location> {
        let root = Root::parse(s)?;
        match &root.kind {
            RootKind::Local(p) => {
                if p.is_file() {
                    let parent = p
                        .parent()
                        .filter(|d| !d.as_os_str().is_empty())
                        .unwrap_or(Path::new("."));
                    let name = p
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned();
                    Ok(Location {
                        root: Root {
                            kind: RootKind::Local(parent.to_path_buf()),
                        },
                        file: Some(name),
                    })
                } else {
                    Ok(Location { root, file: None })
                }
            }
            RootKind::Object { store, prefix, url } => {
                let last = prefix.filename().unwrap_or("");
                if last.ends_with(".safetensors") || last.ends_with(".json") {
                    let parent: ObjPath = prefix
                        .parts()
                        .take(prefix.parts().count().saturating_sub(1))
                        .collect();
                    let parent_url = url
                        .trim_end_matches('/')
                        .rsplit_once('/')
                        .map(|(a, _)| a.to_string())
                        .unwrap_or_else(|| url.clone());
                    Ok(Location {
                        root: Root {
                            kind: RootKind::Object {
                                store: store.clone(),
                                prefix: parent,
                                url: parent_url,
                            },
                        },
                        file: Some(last.to_string()),
                    })
                } else {
                    Ok(Location { root, file: None })
                }
            }
        }
    }
}

/// Checks that `name` (from an index file, metadata or a mapping) is a relative path that stays
/// inside the checkpoint root: no absolute paths, no `..`, no empty components.
pub fn check_relative(name: &str, origin: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::invalid(
            origin,
            format!(
                "path `{name}` {why}; checkpoint files must be relative paths inside the checkpoint directory"
            ),
        ))
    };
    if name.is_empty() {
        return bad("is empty");
    }
    if name.contains('\0') || name.contains('\\') {
        return bad("contains a NUL byte or backslash");
    }
    if name.starts_with('/') || Path::new(name).is_absolute() {
        return bad("is absolute");
    }
    for c in Path::new(name).components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return bad("leaves the checkpoint directory (`..`)"),
            _ => return bad("is not a plain relative path"),
        }
    }
    Ok(())
}

impl Root {
    /// Parses a local directory path or an object store URL.
    pub fn parse(s: &str) -> Result<Root> {
        if !is_url(s) {
            return Ok(Root {
                kind: RootKind::Local(PathBuf::from(s)),
            });
        }
        let url = url::Url::parse(s).map_err(|e| Error::usage(format!("bad URL `{s}`: {e}")))?;
        let store: Arc<dyn ObjectStore> = match url.scheme() {
            "file" => {
                let p = url
                    .to_file_path()
                    .map_err(|_| Error::usage(format!("bad file URL `{s}`")))?;
                return Ok(Root {
                    kind: RootKind::Local(p),
                });
            }
            "s3" | "s3a" => Arc::new(
                object_store::aws::AmazonS3Builder::from_env()
                    .with_url(s)
                    .build()
                    .map_err(|e| Error::usage(format!("cannot use `{s}`: {e}")))?,
            ),
            "gs" => Arc::new(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(s)
                    .build()
                    .map_err(|e| Error::usage(format!("cannot use `{s}`: {e}")))?,
            ),
            "az" | "azure" | "abfs" | "abfss" | "adl" => Arc::new(
                object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(s)
                    .build()
                    .map_err(|e| Error::usage(format!("cannot use `{s}`: {e}")))?,
            ),
            other => {
                return Err(Error::usage(format!(
                    "unsupported URL scheme `{other}` in `{s}` (use a local path, file://, s3://, gs:// or az://)"
                )));
            }
        };
        let prefix = ObjPath::from_url_path(url.path())
            .map_err(|e| Error::usage(format!("bad object path in `{s}`: {e}")))?;
        Ok(Root {
            kind: RootKind::Object {
                store,
                prefix,
                url: s.trim_end_matches('/').to_string(),
            },
        })
    }

    /// A root for a local directory.
    pub fn local(dir: impl Into<PathBuf>) -> Root {
        Root {
            kind: RootKind::Local(dir.into()),
        }
    }

    /// The local directory, when this root is local.
    pub fn local_dir(&self) -> Option<&Path> {
        match &self.kind {
            RootKind::Local(p) => Some(p),
            RootKind::Object { .. } => None,
        }
    }

    pub fn display(&self) -> String {
        match &self.kind {
            RootKind::Local(p) => p.display().to_string(),
            RootKind::Object { url, .. } => url.clone(),
        }
    }

    /// How to name `rel` in messages.
    pub fn display_file(&self, rel: &str) -> String {
        match &self.kind {
            RootKind::Local(p) => p.join(rel).display().to_string(),
            RootKind::Object { url, .. } => format!("{url}/{rel}"),
        }
    }

    /// A sub-directory root (`rel` is checked to stay inside).
    pub fn join(&self, rel: &str) -> Result<Root> {
        check_relative(rel, &self.display())?;
        Ok(match &self.kind {
            RootKind::Local(p) => Root::local(p.join(rel)),
            RootKind::Object { store, prefix, url } => Root {
                kind: RootKind::Object {
                    store: store.clone(),
                    prefix: rel.split('/').fold(prefix.clone(), |p, part| p.join(part)),
                    url: format!("{url}/{rel}"),
                },
            },
        })
    }

    fn obj_path(prefix: &ObjPath, rel: &str) -> ObjPath {
        rel.split('/')
            .filter(|p| !p.is_empty() && *p != ".")
            .fold(prefix.clone(), |p, part| p.join(part))
    }

    /// One delimited listing of an object store root (objects and common prefixes).
    fn object_listing(&self) -> Result<object_store::ListResult> {
        let RootKind::Object { store, prefix, url } = &self.kind else {
            return Err(Error::usage(
                "internal: listing a local root as an object store",
            ));
        };
        runtime()
            .block_on(store.list_with_delimiter(Some(prefix)))
            .map_err(|e| Error::Store {
                file: url.clone(),
                source: e,
            })
    }

    /// The files directly inside the root, with their sizes, sorted by name.
    pub fn list(&self) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        match &self.kind {
            RootKind::Local(p) => {
                let rd = std::fs::read_dir(p).map_err(|e| Error::io(p.display(), e))?;
                for entry in rd {
                    let entry = entry.map_err(|e| Error::io(p.display(), e))?;
                    let meta = entry.metadata().map_err(|e| Error::io(p.display(), e))?;
                    if meta.is_file() {
                        out.push((entry.file_name().to_string_lossy().into_owned(), meta.len()));
                    }
                }
            }
            RootKind::Object { .. } => {
                for o in self.object_listing()?.objects {
                    if let Some(name) = o.location.filename() {
                        out.push((name.to_string(), o.size));
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// The sub-directories (local) or common prefixes (object store) directly inside the root,
    /// sorted by name.
    pub fn list_dirs(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        match &self.kind {
            RootKind::Local(p) => {
                let rd = std::fs::read_dir(p).map_err(|e| Error::io(p.display(), e))?;
                for entry in rd {
                    let entry = entry.map_err(|e| Error::io(p.display(), e))?;
                    if entry.path().is_dir() {
                        out.push(entry.file_name().to_string_lossy().into_owned());
                    }
                }
            }
            RootKind::Object { .. } => {
                for d in self.object_listing()?.common_prefixes {
                    if let Some(name) = d.filename() {
                        out.push(name.to_string());
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Whether `rel` is a sub-directory (local) or a non-empty prefix (object store).
    pub fn has_dir(&self, rel: &str) -> bool {
        match &self.kind {
            RootKind::Local(p) => p.join(rel).is_dir(),
            RootKind::Object { .. } => self
                .join(rel)
                .and_then(|r| r.list())
                .is_ok_and(|l| !l.is_empty()),
        }
    }

    /// The size of `rel`, or None when it does not exist.
    pub fn size_of(&self, rel: &str) -> Result<Option<u64>> {
        check_relative(rel, &self.display())?;
        match &self.kind {
            RootKind::Local(p) => match std::fs::metadata(p.join(rel)) {
                Ok(m) => Ok(Some(m.len())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(self.display_file(rel), e)),
            },
            RootKind::Object { store, prefix, .. } => {
                match runtime().block_on(store.head(&Self::obj_path(prefix, rel))) {
                    Ok(m) => Ok(Some(m.size)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(Error::Store {
                        file: self.display_file(rel),
                        source: e,
                    }),
                }
            }
        }
    }

    /// Opens `rel` for ranged reads. `rel` must stay inside the root.
    pub fn open(&self, rel: &str) -> Result<InFile> {
        check_relative(rel, &self.display())?;
        let name = self.display_file(rel);
        match &self.kind {
            RootKind::Local(p) => {
                let path = p.join(rel);
                // A symlink inside the checkpoint must not lead outside it either.
                if let (Ok(root), Ok(real)) = (p.canonicalize(), path.canonicalize())
                    && !real.starts_with(&root)
                {
                    return Err(Error::invalid(
                        &name,
                        format!(
                            "resolves to {} outside the checkpoint directory",
                            real.display()
                        ),
                    ));
                }
                let file = File::open(&path).map_err(|e| Error::io(&name, e))?;
                let size = file.metadata().map_err(|e| Error::io(&name, e))?.len();
                Ok(InFile {
                    name,
                    size,
                    kind: InKind::Local(file),
                })
            }
            RootKind::Object { store, prefix, .. } => {
                let path = Self::obj_path(prefix, rel);
                let meta = runtime()
                    .block_on(store.head(&path))
                    .map_err(|e| Error::Store {
                        file: name.clone(),
                        source: e,
                    })?;
                Ok(InFile {
                    name,
                    size: meta.size,
                    kind: InKind::Object {
                        store: store.clone(),
                        path,
                    },
                })
            }
        }
    }

    /// Reads a whole (small) file, refusing files larger than `limit` bytes.
    pub fn read_small(&self, rel: &str, limit: u64) -> Result<Vec<u8>> {
        let f = self.open(rel)?;
        if f.size > limit {
            return Err(Error::invalid(
                &f.name,
                format!(
                    "is {} bytes, more than the {limit}-byte limit for this kind of file",
                    f.size
                ),
            ));
        }
        let mut buf = vec![0u8; f.size as usize];
        f.read_at(0, &mut buf)?;
        Ok(buf)
    }

    /// Creates the root directory (local; object stores need nothing).
    pub fn create_dir_all(&self) -> Result<()> {
        if let RootKind::Local(p) = &self.kind {
            std::fs::create_dir_all(p).map_err(|e| Error::io(p.display(), e))?;
        }
        Ok(())
    }

    /// Starts writing `rel`; it appears under its name only after [`OutFile::finish`].
    /// `size` (when known) preallocates local files.
    pub fn create(&self, rel: &str, size: Option<u64>) -> Result<OutFile> {
        check_relative(rel, &self.display())?;
        let name = self.display_file(rel);
        match &self.kind {
            RootKind::Local(p) => {
                let dest = p.join(rel);
                if let Some(parent) = dest.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| Error::io(parent.display(), e))?;
                }
                let file_name = dest
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                let tmp = dest.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
                let file = File::create(&tmp).map_err(|e| Error::io(tmp.display(), e))?;
                if let Some(n) = size {
                    file.set_len(n).map_err(|e| Error::io(tmp.display(), e))?;
                }
                Ok(OutFile {
                    name,
                    kind: OutKind::Local { file, tmp, dest },
                    done: false,
                })
            }
            RootKind::Object { store, prefix, .. } => {
                let path = Self::obj_path(prefix, rel);
                // 16 MiB parts, a few in flight: the object appears when the upload completes.
                let writer =
                    BufWriter::with_capacity(store.clone(), path, 16 << 20).with_max_concurrency(4);
                Ok(OutFile {
                    name,
                    kind: OutKind::Object(Mutex::new(ObjWriter { writer, pos: 0 })),
                    done: false,
                })
            }
        }
    }

    /// Copies every regular file of the local directory `dir` to this root under its own name,
    /// `last` (when present) after all others — for a DCP checkpoint that is `.metadata`, so a
    /// reader never finds metadata pointing at files not uploaded yet. Returns the bytes copied.
    pub fn upload_dir(&self, dir: &Path, last: &str) -> Result<u64> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir.display(), e))? {
            let entry = entry.map_err(|e| Error::io(dir.display(), e))?;
            let kind = entry.file_type().map_err(|e| Error::io(dir.display(), e))?;
            if kind.is_file() {
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        names.sort_by_key(|n| (n == last, n.clone()));
        let mut buf = vec![0u8; 8 << 20];
        let mut total = 0u64;
        for name in names {
            let path = dir.join(&name);
            let mut file = File::open(&path).map_err(|e| Error::io(path.display(), e))?;
            let len = file
                .metadata()
                .map_err(|e| Error::io(path.display(), e))?
                .len();
            let dest = self.create(&name, Some(len))?;
            let mut offset = 0u64;
            loop {
                let n = std::io::Read::read(&mut file, &mut buf)
                    .map_err(|e| Error::io(path.display(), e))?;
                if n == 0 {
                    break;
                }
                dest.write_at(offset, &buf[..n])?;
                offset += n as u64;
            }
            dest.finish()?;
            total += len;
        }
        Ok(total)
    }

    /// Writes a small file atomically.
    pub fn write_small(&self, rel: &str, bytes: &[u8]) -> Result<()> {
        let f = self.create(rel, None)?;
        f.write_at(0, bytes)?;
        f.finish()
    }

    /// Removes `rel` if it exists (used to clean up after a failed command).
    pub fn remove(&self, rel: &str) -> Result<()> {
        check_relative(rel, &self.display())?;
        match &self.kind {
            RootKind::Local(p) => match std::fs::remove_file(p.join(rel)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(Error::io(self.display_file(rel), e))
                }
                _ => Ok(()),
            },
            RootKind::Object { store, prefix, .. } => {
                match runtime().block_on(store.delete(&Self::obj_path(prefix, rel))) {
                    Err(e) if !matches!(e, object_store::Error::NotFound { .. }) => {
                        Err(Error::Store {
                            file: self.display_file(rel),
                            source: e,
                        })
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// Waits until every `(file, size)` exists with that size, polling; fails after `timeout`.
    pub fn wait_for(&self, files: &[(String, u64)], timeout: Duration) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            let mut missing = Vec::new();
            for (f, size) in files {
                if self.size_of(f)? != Some(*size) {
                    missing.push(f.as_str());
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Error::invalid(
                    self.display(),
                    format!(
                        "timed out after {:?} waiting for other ranks' output files: {}",
                        timeout,
                        missing.join(", ")
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// A file opened for ranged reads.
pub struct InFile {
    /// How to name this file in messages (full path or URL).
    pub name: String,
    pub size: u64,
    kind: InKind,
}

enum InKind {
    Local(File),
    Object {
        store: Arc<dyn ObjectStore>,
        path: ObjPath,
    },
}

impl InFile {
    /// Reads exactly `buf.len()` bytes at `offset`; a range past the end is a "truncated" error.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        if end > self.size {
            return Err(Error::invalid(
                &self.name,
                format!(
                    "truncated: needs bytes up to {end} but the file has {}",
                    self.size
                ),
            ));
        }
        if buf.is_empty() {
            return Ok(());
        }
        match &self.kind {
            InKind::Local(f) => f
                .read_exact_at(buf, offset)
                .map_err(|e| Error::io(&self.name, e)),
            InKind::Object { store, path } => {
                let bytes = runtime()
                    .block_on(store.get_range(path, offset..end))
                    .map_err(|e| Error::Store {
                        file: self.name.clone(),
                        source: e,
                    })?;
                if bytes.len() != buf.len() {
                    return Err(Error::invalid(
                        &self.name,
                        format!(
                            "short read: asked {} bytes at {offset}, got {}",
                            buf.len(),
                            bytes.len()
                        ),
                    ));
                }
                buf.copy_from_slice(&bytes);
                Ok(())
            }
        }
    }

    pub fn local_fd(&self) -> Option<RawFd> {
        match &self.kind {
            InKind::Local(f) => Some(f.as_raw_fd()),
            InKind::Object { .. } => None,
        }
    }
}

/// An output file that appears under its name only when [`OutFile::finish`] succeeds; dropped
/// unfinished, it leaves nothing behind.
pub struct OutFile {
    pub name: String,
    kind: OutKind,
    done: bool,
}

enum OutKind {
    Local {
        file: File,
        tmp: PathBuf,
        dest: PathBuf,
    },
    Object(Mutex<ObjWriter>),
}

struct ObjWriter {
    writer: BufWriter,
    pos: u64,
}

impl OutFile {
    /// Writes `data` at `offset`. Local files take positional writes in any order from any thread;
    /// object store uploads are sequential, so there `offset` must be where the last write ended.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        match &self.kind {
            OutKind::Local { file, .. } => file
                .write_all_at(data, offset)
                .map_err(|e| Error::io(&self.name, e)),
            OutKind::Object(w) => {
                let mut w = w.lock().expect("object writer lock");
                if offset != w.pos {
                    return Err(Error::invalid(
                        &self.name,
                        format!(
                            "internal: object store writes must be sequential (at {}, asked {offset})",
                            w.pos
                        ),
                    ));
                }
                runtime()
                    .block_on(w.writer.write_all(data))
                    .map_err(|e| Error::io(&self.name, e))?;
                w.pos += data.len() as u64;
                Ok(())
            }
        }
    }

    /// Whether positional writes may come in any order (local files).
    pub fn is_positional(&self) -> bool {
        matches!(self.kind, OutKind::Local { .. })
    }

    pub fn local_fd(&self) -> Option<RawFd> {
        match &self.kind {
            OutKind::Local { file, .. } => Some(file.as_raw_fd()),
            OutKind::Object(_) => None,
        }
    }

    /// Makes the file appear under its final name (rename / complete the multipart upload).
    pub fn finish(mut self) -> Result<()> {
        match &mut self.kind {
            OutKind::Local { file, tmp, dest } => {
                file.sync_data().map_err(|e| Error::io(tmp.display(), e))?;
                std::fs::rename(&*tmp, &*dest).map_err(|e| Error::io(dest.display(), e))?;
            }
            OutKind::Object(w) => {
                let w = w.get_mut().expect("object writer lock");
                runtime()
                    .block_on(w.writer.shutdown())
                    .map_err(|e| Error::io(&self.name, e))?;
            }
        }
        self.done = true;
        Ok(())
    }
}

impl Drop for OutFile {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        match &mut self.kind {
            OutKind::Local { tmp, .. } => {
                let _ = std::fs::remove_file(&*tmp);
            }
            OutKind::Object(w) => {
                if let Ok(w) = w.get_mut() {
                    let _ = runtime().block_on(w.writer.abort());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_must_stay_inside() {
        assert!(check_relative("model-00001-of-00002.safetensors", "idx").is_ok());
        assert!(check_relative("sub/x.safetensors", "idx").is_ok());
        for bad in [
            "../x.safetensors",
            "/etc/passwd",
            "a/../../b",
            "",
            "a\\..\\b",
        ] {
            let err = check_relative(bad, "index.json").unwrap_err().to_string();
            assert!(err.contains("index.json"), "{err}");
        }
    }

    #[test]
    fn unfinished_output_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::local(dir.path());
        let f = root.create("a.bin", Some(4)).unwrap();
        f.write_at(0, b"abcd").unwrap();
        drop(f);
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
        let f = root.create("a.bin", Some(4)).unwrap();
        f.write_at(2, b"cd").unwrap();
        f.write_at(0, b"ab").unwrap();
        f.finish().unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.bin")).unwrap(), b"abcd");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn reads_past_the_end_are_truncation_errors() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"0123").unwrap();
        let f = Root::local(dir.path()).open("f").unwrap();
        let mut buf = [0u8; 3];
        f.read_at(1, &mut buf).unwrap();
        assert_eq!(&buf, b"123");
        let err = f.read_at(2, &mut buf).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }
}
