//! [`Root`]: a local directory or an object store prefix, and what can be done with the files in it.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use object_store::buffered::BufWriter;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, ObjectStoreScheme};

use crate::error::{Result, StorageError};
use crate::file::{InFile, OutFile};
use crate::path::check_relative;
use crate::runtime;

/// A directory: local, or a prefix in an object store.
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

/// Whether `s` names an object store (or file://) URL rather than a local path.
pub fn is_url(s: &str) -> bool {
    s.contains("://")
}

/// What a directory listing holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Entries {
    Files,
    Dirs,
}

impl Root {
    /// Parses a local directory path or a URL: `file://`, `s3://` (`s3a://`), `gs://`,
    /// `az://` (`azure://`, `abfs[s]://`, `adl://`) or `memory://` (an in-process store, one per
    /// host name, shared by every `Root` of the process — for tests).
    ///
    /// Credentials and endpoints come from the environment the way each store documents it
    /// (e.g. `AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP=true` for a local S3).
    pub fn parse(s: &str) -> Result<Root> {
        if !is_url(s) {
            return Ok(Root::local(s));
        }
        let url =
            url::Url::parse(s).map_err(|e| StorageError::Usage(format!("bad URL `{s}`: {e}")))?;
        let unsupported = || {
            StorageError::Usage(format!(
                "unsupported URL `{s}` (use a local path, file://, s3://, gs://, az:// or memory://)"
            ))
        };
        // object_store's parser takes `memory:///path` only; titan also names in-process stores
        // by host (`memory://bucket/path`).
        let (scheme, path) = if url.scheme() == "memory" {
            let path = ObjPath::from_url_path(url.path())
                .map_err(|e| StorageError::Usage(format!("bad object path in `{s}`: {e}")))?;
            (ObjectStoreScheme::Memory, path)
        } else {
            ObjectStoreScheme::parse(&url).map_err(|_| unsupported())?
        };
        let cannot = |e: object_store::Error| StorageError::Usage(format!("cannot use `{s}`: {e}"));
        if matches!(
            scheme,
            ObjectStoreScheme::AmazonS3
                | ObjectStoreScheme::GoogleCloudStorage
                | ObjectStoreScheme::MicrosoftAzure
        ) {
            install_tls_provider();
        }
        let store: Arc<dyn ObjectStore> = match scheme {
            ObjectStoreScheme::Local => {
                let p = url
                    .to_file_path()
                    .map_err(|_| StorageError::Usage(format!("bad file URL `{s}`")))?;
                return Ok(Root::local(p));
            }
            ObjectStoreScheme::Memory => memory_store(url.host_str().unwrap_or("")),
            ObjectStoreScheme::AmazonS3 => Arc::new(
                object_store::aws::AmazonS3Builder::from_env()
                    .with_url(s)
                    .build()
                    .map_err(cannot)?,
            ),
            ObjectStoreScheme::GoogleCloudStorage => Arc::new(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(s)
                    .build()
                    .map_err(cannot)?,
            ),
            ObjectStoreScheme::MicrosoftAzure => Arc::new(
                object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(s)
                    .build()
                    .map_err(cannot)?,
            ),
            _ => return Err(unsupported()),
        };
        Ok(Root {
            kind: RootKind::Object {
                store,
                prefix: path,
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

    /// The object store and the prefix inside it, when this root is not local.
    pub fn object_store(&self) -> Option<(&Arc<dyn ObjectStore>, &ObjPath)> {
        match &self.kind {
            RootKind::Local(_) => None,
            RootKind::Object { store, prefix, .. } => Some((store, prefix)),
        }
    }

    /// How to name this root in messages (path or URL).
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
                    prefix: obj_path(prefix, rel),
                    url: format!("{url}/{rel}"),
                },
            },
        })
    }

    /// When this root names a file — locally an existing regular file, on an object store a
    /// last component that `is_file` accepts — its parent root and the file name.
    pub fn split_file(&self, is_file: impl Fn(&str) -> bool) -> Option<(Root, String)> {
        match &self.kind {
            RootKind::Local(p) => {
                let name = p.file_name()?.to_string_lossy().into_owned();
                if !p.is_file() {
                    return None;
                }
                let parent = p
                    .parent()
                    .filter(|d| !d.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                Some((Root::local(parent), name))
            }
            RootKind::Object { store, prefix, url } => {
                let last = prefix.filename()?;
                if !is_file(last) {
                    return None;
                }
                let parent: ObjPath = prefix
                    .parts()
                    .take(prefix.parts().count().saturating_sub(1))
                    .collect();
                let parent_url = url
                    .rsplit_once('/')
                    .map(|(a, _)| a.to_string())
                    .unwrap_or_else(|| url.clone());
                let root = Root {
                    kind: RootKind::Object {
                        store: store.clone(),
                        prefix: parent,
                        url: parent_url,
                    },
                };
                Some((root, last.to_string()))
            }
        }
    }

    /// The files (with sizes) or the sub-directories directly inside the root, sorted by name.
    fn entries(&self, want: Entries) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        match &self.kind {
            RootKind::Local(p) => {
                let io = |e| StorageError::io(p.display(), e);
                for entry in std::fs::read_dir(p).map_err(io)? {
                    let entry = entry.map_err(io)?;
                    // Follows symlinks, as `Path::is_dir` / `is_file` do.
                    let meta = std::fs::metadata(entry.path()).map_err(io)?;
                    let keep = match want {
                        Entries::Files => meta.is_file(),
                        Entries::Dirs => meta.is_dir(),
                    };
                    if keep {
                        out.push((entry.file_name().to_string_lossy().into_owned(), meta.len()));
                    }
                }
            }
            RootKind::Object { store, prefix, url } => {
                let listing = runtime()
                    .block_on(store.list_with_delimiter(Some(prefix)))
                    .map_err(|e| StorageError::store(url, e))?;
                match want {
                    Entries::Files => {
                        for o in listing.objects {
                            if let Some(name) = o.location.filename() {
                                out.push((name.to_string(), o.size));
                            }
                        }
                    }
                    Entries::Dirs => {
                        for d in listing.common_prefixes {
                            if let Some(name) = d.filename() {
                                out.push((name.to_string(), 0));
                            }
                        }
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// The files directly inside the root, with their sizes, sorted by name.
    pub fn list(&self) -> Result<Vec<(String, u64)>> {
        self.entries(Entries::Files)
    }

    /// The sub-directories (local) or common prefixes (object store) directly inside the root,
    /// sorted by name.
    pub fn list_dirs(&self) -> Result<Vec<String>> {
        Ok(self
            .entries(Entries::Dirs)?
            .into_iter()
            .map(|(n, _)| n)
            .collect())
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
                Err(e) => Err(StorageError::io(self.display_file(rel), e)),
            },
            RootKind::Object { store, prefix, .. } => {
                match runtime().block_on(store.head(&obj_path(prefix, rel))) {
                    Ok(m) => Ok(Some(m.size)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(StorageError::store(self.display_file(rel), e)),
                }
            }
        }
    }

    /// Opens `rel` for ranged reads. `rel` must stay inside the root; locally, a symlink must
    /// not lead outside it either.
    pub fn open(&self, rel: &str) -> Result<InFile> {
        check_relative(rel, &self.display())?;
        let name = self.display_file(rel);
        match &self.kind {
            RootKind::Local(p) => {
                let path = p.join(rel);
                if let (Ok(root), Ok(real)) = (p.canonicalize(), path.canonicalize())
                    && !real.starts_with(&root)
                {
                    return Err(StorageError::invalid(
                        &name,
                        format!(
                            "resolves to {} outside the checkpoint or run directory",
                            real.display()
                        ),
                    ));
                }
                let file = File::open(&path).map_err(|e| StorageError::io(&name, e))?;
                InFile::local(name, file)
            }
            RootKind::Object { store, prefix, .. } => {
                let path = obj_path(prefix, rel);
                let meta = runtime()
                    .block_on(store.head(&path))
                    .map_err(|e| StorageError::store(&name, e))?;
                Ok(InFile::object(name, meta.size, store.clone(), path))
            }
        }
    }

    /// Reads a whole (small) file, refusing files larger than `limit` bytes.
    pub fn read_small(&self, rel: &str, limit: u64) -> Result<Vec<u8>> {
        let f = self.open(rel)?;
        if f.size > limit {
            return Err(StorageError::invalid(
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
            std::fs::create_dir_all(p).map_err(|e| StorageError::io(p.display(), e))?;
        }
        Ok(())
    }

    /// Starts writing `rel`; it appears under its name only after [`OutFile::finish`]
    /// (local: a temporary name renamed; object store: a multipart upload completed, or one PUT
    /// for small files). `size` (when known) preallocates local files.
    pub fn create(&self, rel: &str, size: Option<u64>) -> Result<OutFile> {
        check_relative(rel, &self.display())?;
        let name = self.display_file(rel);
        match &self.kind {
            RootKind::Local(p) => OutFile::local(name, p.join(rel), size),
            RootKind::Object { store, prefix, .. } => {
                // 16 MiB parts, a few in flight: the object appears when the upload completes.
                let writer =
                    BufWriter::with_capacity(store.clone(), obj_path(prefix, rel), 16 << 20)
                        .with_max_concurrency(4);
                Ok(OutFile::object(name, writer))
            }
        }
    }

    /// Copies every regular file of the local directory `dir` to this root under its own name,
    /// `last` (when present) after all others — for a DCP checkpoint that is `.metadata`, so a
    /// reader never finds metadata pointing at files not uploaded yet. Returns the bytes copied.
    pub fn upload_dir(&self, dir: &Path, last: &str) -> Result<u64> {
        let io = |e| StorageError::io(dir.display(), e);
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            if entry.file_type().map_err(io)?.is_file() {
                names.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        names.sort_by_key(|n| (n == last, n.clone()));
        let mut buf = vec![0u8; 8 << 20];
        let mut total = 0u64;
        for name in names {
            let path = dir.join(&name);
            let io = |e| StorageError::io(path.display(), e);
            let mut file = File::open(&path).map_err(io)?;
            let len = file.metadata().map_err(io)?.len();
            let dest = self.create(&name, Some(len))?;
            let mut offset = 0u64;
            loop {
                let n = std::io::Read::read(&mut file, &mut buf).map_err(io)?;
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
                    Err(StorageError::io(self.display_file(rel), e))
                }
                _ => Ok(()),
            },
            RootKind::Object { store, prefix, .. } => {
                match runtime().block_on(store.delete(&obj_path(prefix, rel))) {
                    Err(e) if !matches!(e, object_store::Error::NotFound { .. }) => {
                        Err(StorageError::store(self.display_file(rel), e))
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
                return Err(StorageError::invalid(
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

fn obj_path(prefix: &ObjPath, rel: &str) -> ObjPath {
    rel.split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .fold(prefix.clone(), |p, part| p.join(part))
}

/// Makes ring the process's rustls crypto provider, once, before the first HTTP client is built:
/// the object stores' reqwest client is built without a provider of its own (the workspace
/// builds rustls on ring alone, not aws-lc-rs), and would panic without one. A provider the
/// program installed first stays.
fn install_tls_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// `memory://` stores are process-global per host name so a writer and a reader in one
/// process (tests) see the same objects.
fn memory_store(host: &str) -> Arc<dyn ObjectStore> {
    static STORES: LazyLock<Mutex<HashMap<String, Arc<dyn ObjectStore>>>> =
        LazyLock::new(Default::default);
    STORES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(host.to_string())
        .or_insert_with(|| Arc::new(object_store::memory::InMemory::new()))
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The S3 and GCS clients (HTTPS through rustls) build: without a crypto provider of its
    /// own reqwest panics building them, so this fails if ring is not installed first. (No
    /// request is made; the moto tests in tests/ talk to a store over plain HTTP.)
    #[test]
    fn https_object_store_clients_build() {
        for url in ["s3://bucket/run", "gs://bucket/run"] {
            let root = Root::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert!(root.local_dir().is_none(), "{url}");
        }
    }

    #[test]
    fn memory_roots_share_objects_per_host() {
        let a = Root::parse("memory://bucket-a/run").unwrap();
        a.write_small("x/f.bin", b"abc").unwrap();
        let again = Root::parse("memory://bucket-a/run/x").unwrap();
        assert_eq!(again.list().unwrap(), vec![("f.bin".to_string(), 3)]);
        assert_eq!(again.read_small("f.bin", 10).unwrap(), b"abc");
        let other = Root::parse("memory://bucket-b/run/x").unwrap();
        assert!(other.list().unwrap().is_empty());
        assert_eq!(a.list_dirs().unwrap(), vec!["x".to_string()]);
        assert!(a.has_dir("x"));
    }

    #[test]
    fn urls_are_parsed_or_refused_by_name() {
        assert!(Root::parse("/tmp/x").unwrap().local_dir().is_some());
        assert_eq!(
            Root::parse("file:///tmp/x").unwrap().local_dir(),
            Some(Path::new("/tmp/x"))
        );
        let err = Root::parse("ftp://host/x").unwrap_err();
        assert!(matches!(err, StorageError::Usage(_)));
        assert!(err.to_string().contains("ftp://host/x"), "{err}");
    }

    #[test]
    fn split_file_names_the_parent() {
        let r = Root::parse("memory://b/ckpt/model.safetensors").unwrap();
        let (parent, file) = r.split_file(|n| n.ends_with(".safetensors")).unwrap();
        assert_eq!(file, "model.safetensors");
        assert_eq!(parent.display(), "memory://b/ckpt");
        assert!(
            Root::parse("memory://b/ckpt")
                .unwrap()
                .split_file(|_| false)
                .is_none()
        );
    }

    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"s").unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("link")).unwrap();
        let err = Root::local(dir.path())
            .open("link")
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("outside"), "{err}");
    }
}
