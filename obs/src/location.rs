//! Where a run lives: a local directory or an object_store URL (`s3://`, `gs://`, `az://`,
//! `memory://`, `file://`). Parts live under `<run>/obs/rank-<R>/part-<N>.parquet`; the open
//! journal of a local run next to them as `journal-<N>.arrows` (N = the part it becomes).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use object_store::ObjectStore;
use object_store::path::Path as StorePath;

/// A run location, parsed once.
#[derive(Clone)]
pub enum Location {
    Local(PathBuf),
    Object {
        url: String,
        store: Arc<dyn ObjectStore>,
        base: StorePath,
    },
}

impl std::fmt::Debug for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Object { url, .. } => f.write_str(url),
        }
    }
}

impl Location {
    /// Parses `run` with titan-storage's rules (one set of URL schemes for every titan tool):
    /// anything with `scheme://` is an object store URL (`s3://`, `gs://`, `az://`,
    /// `memory://`), `file://` and the rest are local paths.
    ///
    /// Credentials and endpoints come from the environment the way each store documents it
    /// (e.g. `AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP=true` for a local S3).
    pub fn parse(run: &str) -> Result<Location> {
        let root = titan_storage::Root::parse(run).map_err(|e| anyhow::anyhow!("{e}"))?;
        if let Some(dir) = root.local_dir() {
            return Ok(Location::Local(dir.to_path_buf()));
        }
        let (store, base) = root
            .object_store()
            .ok_or_else(|| anyhow::anyhow!("`{run}`: neither a local path nor an object store"))?;
        Ok(Location::Object {
            url: root.display(),
            store: store.clone(),
            base: base.clone(),
        })
    }

    /// The directory (or prefix) holding one rank's parts, for messages.
    pub fn rank_display(&self, rank: u32) -> String {
        match self {
            Location::Local(p) => rank_dir(p, rank).display().to_string(),
            Location::Object { url, .. } => format!("{url}/obs/rank-{rank}"),
        }
    }
}

/// `<run>/obs/rank-<R>`.
pub fn rank_dir(run: &Path, rank: u32) -> PathBuf {
    run.join("obs").join(format!("rank-{rank}"))
}

/// `<base>/obs/rank-<R>`: a rank's folder of the object-store run at `base`.
pub fn stored_rank_dir(base: &StorePath, rank: u32) -> StorePath {
    base.clone().join("obs").join(format!("rank-{rank}"))
}

/// File name of part `index`: zero-padded so a plain listing sorts in time order.
pub fn part_file_name(index: u64) -> String {
    format!("part-{index:06}.parquet")
}

/// Parses `part-<N>.parquet` into N.
pub fn parse_part_file_name(name: &str) -> Option<u64> {
    name.strip_prefix("part-")?
        .strip_suffix(".parquet")?
        .parse()
        .ok()
}

/// File name of the journal that will be compacted into part `index`.
pub fn journal_file_name(index: u64) -> String {
    format!("journal-{index:06}.arrows")
}

/// Parses `journal-<N>.arrows` into N.
pub fn parse_journal_file_name(name: &str) -> Option<u64> {
    name.strip_prefix("journal-")?
        .strip_suffix(".arrows")?
        .parse()
        .ok()
}

/// A rank's journal folder for an object-store run: object stores cannot be appended to, so
/// the journal lives on local disk under `spool` (one folder per run URL and rank) and only
/// compacted parts are uploaded.
pub fn spool_rank_dir(spool: &Path, run_url: &str, rank: u32) -> PathBuf {
    let run: String = run_url
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    spool.join(run).join(format!("rank-{rank}"))
}

/// Parses `rank-<R>` into R.
pub fn parse_rank_dir_name(name: &str) -> Option<u32> {
    name.strip_prefix("rank-")?.parse().ok()
}

/// A local run's `obs/` folder, listed once: its rank folders and its other files (node
/// rollups, figures, timelines, locks).
#[derive(Debug, Default)]
pub struct ObsFolder {
    /// By rank.
    pub rank_dirs: Vec<(u32, PathBuf)>,
    /// (name, path) of every other entry with a UTF-8 name.
    pub files: Vec<(String, PathBuf)>,
}

impl ObsFolder {
    /// Lists `obs` (the `obs/` folder of a local run).
    pub fn list(obs: &Path) -> Result<ObsFolder> {
        use anyhow::Context as _;
        let mut out = ObsFolder::default();
        for e in std::fs::read_dir(obs).with_context(|| format!("listing {}", obs.display()))? {
            let e = e.with_context(|| format!("listing {}", obs.display()))?;
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            match parse_rank_dir_name(&name) {
                Some(rank) => out.rank_dirs.push((rank, e.path())),
                None => out.files.push((name, e.path())),
            }
        }
        out.rank_dirs.sort_unstable();
        Ok(out)
    }

    /// The paths of the other files whose name passes `keep`.
    pub fn files_named(&self, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
        (self.files.iter())
            .filter(|(n, _)| keep(n))
            .map(|(_, p)| p.clone())
            .collect()
    }
}

/// An object-store run's `obs/` prefix, listed once with a delimiter: its rank folders and
/// the objects beside them (node figures and timelines), not the parts inside the folders
/// (a 16 384-rank run is ~17 LIST pages so, against thousands to list every part).
#[derive(Debug, Default)]
pub struct ObjectObs {
    /// The rank folders (`rank-<R>/` prefixes), by rank.
    pub ranks: Vec<u32>,
    /// (name, path) of every object beside them.
    pub files: Vec<(String, StorePath)>,
}

/// Rank folders checked at once ([`ObjectObs::next_parts_absent`]).
const CHECKS_AT_ONCE: usize = 64;

impl ObjectObs {
    /// Lists `<base>/obs/` of the store (`url` for messages).
    pub fn list(store: &Arc<dyn ObjectStore>, base: &StorePath, url: &str) -> Result<ObjectObs> {
        use anyhow::Context as _;
        let obs = base.clone().join("obs");
        let listed = titan_storage::runtime()
            .block_on(store.list_with_delimiter(Some(&obs)))
            .with_context(|| format!("listing {url}/obs/"))?;
        let mut ranks: Vec<u32> = (listed.common_prefixes.iter())
            .filter_map(|p| parse_rank_dir_name(p.filename()?))
            .collect();
        ranks.sort_unstable();
        let files = (listed.objects.into_iter())
            .filter_map(|m| Some((m.location.filename()?.to_string(), m.location)))
            .collect();
        Ok(ObjectObs { ranks, files })
    }

    /// The objects whose name passes `keep`.
    pub fn files_named(&self, keep: impl Fn(&str) -> bool) -> Vec<StorePath> {
        (self.files.iter())
            .filter(|(n, _)| keep(n))
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// For each (rank, last part) whether the rank's folder holds no part after `last` (one
    /// HEAD a rank, `CHECKS_AT_ONCE` at a time): the object-store form of a local folder's
    /// unchanged mtime, as a rank's writer adds parts in index order. An error other than
    /// "not found" counts as a part there (the rank is then read from its folder).
    pub async fn next_parts_absent(
        store: &Arc<dyn ObjectStore>,
        base: &StorePath,
        ranks: &[(u32, Option<u64>)],
    ) -> Vec<bool> {
        use futures::StreamExt;
        use object_store::ObjectStoreExt as _;
        let checks = ranks.iter().map(|&(rank, last)| {
            let path = stored_rank_dir(base, rank)
                .join(part_file_name(last.map_or(0, |l| l + 1)).as_str());
            async move {
                matches!(
                    store.head(&path).await,
                    Err(object_store::Error::NotFound { .. })
                )
            }
        });
        futures::stream::iter(checks)
            .buffered(CHECKS_AT_ONCE)
            .collect()
            .await
    }
}

/// The error of a location that holds no run titan-obs can read (a README, a checkpoint, a
/// run's `obs/` folder): the command line named the wrong thing, so the CLI exits with its
/// usage code. The message says what was found and what to pass instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotARun(pub String);

impl std::fmt::Display for NotARun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NotARun {}

/// Whether `e` (or an error it wraps) is [`NotARun`].
pub fn is_not_a_run(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<NotARun>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(part_file_name(7), "part-000007.parquet");
        assert_eq!(parse_part_file_name("part-000007.parquet"), Some(7));
        assert_eq!(parse_part_file_name("part-12.parquet"), Some(12));
        assert_eq!(parse_part_file_name(".part-1.parquet.tmp"), None);
        assert_eq!(parse_rank_dir_name("rank-31"), Some(31));
        assert_eq!(journal_file_name(3), "journal-000003.arrows");
        assert_eq!(parse_journal_file_name("journal-000003.arrows"), Some(3));
        assert_eq!(parse_journal_file_name("part-000003.parquet"), None);
        assert_eq!(
            spool_rank_dir(Path::new("/s"), "s3://b/runs/x", 2),
            Path::new("/s/s3___b_runs_x/rank-2")
        );
        assert_eq!(parse_rank_dir_name("rank-x"), None);
    }

    #[test]
    fn parses_local_and_urls() {
        assert!(matches!(
            Location::parse("/tmp/run").unwrap(),
            Location::Local(_)
        ));
        assert!(matches!(
            Location::parse("file:///tmp/run").unwrap(),
            Location::Local(_)
        ));
        assert!(matches!(
            Location::parse("memory://t/run").unwrap(),
            Location::Object { .. }
        ));
        assert!(Location::parse("ftp://x/y").is_err());
    }
}
