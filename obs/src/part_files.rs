//! The part files of a titan run wherever it lives (a local folder or an object store, see
//! [`crate::location`]), for readers that open parts one at a time instead of loading the
//! run: [`list`] lists every rank's parts once, a [`PartFile`] reads its part, a file beside
//! it (`part-<N>.lod`) or only its footer, and [`keep_run`] keeps the parts of one run of a
//! folder that holds several.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use object_store::path::Path as StorePath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::footer::Footer;
use crate::location::{Location, ObsFolder, parse_part_file_name};

/// Where a part file is.
#[derive(Clone)]
enum Place {
    Local(PathBuf),
    Object {
        store: Arc<dyn ObjectStore>,
        path: StorePath,
        /// `<url>/obs/rank-<R>/part-<N>.parquet`, for messages.
        shown: String,
        /// From the listing; `None` for a part known from its node's timeline (not listed).
        len: Option<u64>,
    },
}

/// One part of one rank.
#[derive(Clone)]
pub struct PartFile {
    pub rank: u32,
    /// The `N` of `part-<N>.parquet`.
    pub index: u64,
    place: Place,
}

impl std::fmt::Debug for PartFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown())
    }
}

impl PartFile {
    /// A local part of `rank` (its index from its file name, 0 when it has none).
    pub fn local(path: PathBuf, rank: u32) -> PartFile {
        let index = path
            .file_name()
            .and_then(|n| parse_part_file_name(n.to_str()?))
            .unwrap_or(0);
        PartFile {
            rank,
            index,
            place: Place::Local(path),
        }
    }

    /// Part `index` of `rank` in the object store `store` whose run is at `base` (`url`), not
    /// listed: its size is learnt when it is read.
    pub fn stored(
        store: Arc<dyn ObjectStore>,
        base: &StorePath,
        url: &str,
        rank: u32,
        index: u64,
    ) -> PartFile {
        let name = crate::location::part_file_name(index);
        PartFile {
            rank,
            index,
            place: Place::Object {
                store,
                path: crate::location::stored_rank_dir(base, rank).join(name.as_str()),
                shown: format!("{url}/obs/rank-{rank}/{name}"),
                len: None,
            },
        }
    }

    /// The part's path or URL, for messages.
    pub fn shown(&self) -> String {
        match &self.place {
            Place::Local(p) => p.display().to_string(),
            Place::Object { shown, .. } => shown.clone(),
        }
    }

    /// The local path of the part; `None` in an object store.
    pub fn local_path(&self) -> Option<&std::path::Path> {
        match &self.place {
            Place::Local(p) => Some(p),
            Place::Object { .. } => None,
        }
    }

    /// The part's size in bytes (a local part's is read now; an object's came with the listing).
    pub fn byte_len(&self) -> Result<u64> {
        match &self.place {
            Place::Local(p) => Ok(std::fs::metadata(p)
                .with_context(|| format!("reading {}", p.display()))?
                .len()),
            Place::Object { len: Some(len), .. } => Ok(*len),
            Place::Object {
                store, path, shown, ..
            } => Ok(titan_storage::runtime()
                .block_on(store.head(path))
                .with_context(|| format!("reading {shown}"))?
                .size),
        }
    }

    /// The whole part.
    pub fn read(&self) -> Result<Bytes> {
        match &self.place {
            Place::Local(p) => Ok(std::fs::read(p)
                .with_context(|| format!("reading {}", p.display()))?
                .into()),
            Place::Object {
                store, path, shown, ..
            } => titan_storage::runtime()
                .block_on(async { store.get(path).await?.bytes().await })
                .with_context(|| format!("reading {shown}")),
        }
    }

    /// Bytes `range` of the part.
    fn read_range(&self, range: std::ops::Range<u64>) -> Result<Bytes> {
        match &self.place {
            Place::Local(p) => {
                use std::io::{Read, Seek, SeekFrom};
                let mut f =
                    std::fs::File::open(p).with_context(|| format!("reading {}", p.display()))?;
                f.seek(SeekFrom::Start(range.start))
                    .with_context(|| format!("reading {}", p.display()))?;
                let mut buf = Vec::new();
                f.take(range.end - range.start)
                    .read_to_end(&mut buf)
                    .with_context(|| format!("reading {}", p.display()))?;
                Ok(buf.into())
            }
            Place::Object {
                store, path, shown, ..
            } => titan_storage::runtime()
                .block_on(store.get_range(path, range))
                .with_context(|| format!("reading {shown}")),
        }
    }

    /// Where the file `part-<N>.<extension>` beside the part is, for messages.
    pub fn beside_shown(&self, extension: &str) -> String {
        match &self.place {
            Place::Local(p) => p.with_extension(extension).display().to_string(),
            Place::Object { shown, .. } => beside_name(shown, extension),
        }
    }

    /// The file `part-<N>.<extension>` beside the part; `Ok(None)` when there is none.
    pub fn read_beside(&self, extension: &str) -> Result<Option<Bytes>> {
        match &self.place {
            Place::Local(p) => {
                Ok(crate::sidecar::read_if_present(&p.with_extension(extension))?.map(Into::into))
            }
            Place::Object { store, path, .. } => {
                let beside = StorePath::from(beside_name(path.as_ref(), extension));
                let got = titan_storage::runtime()
                    .block_on(async { store.get(&beside).await?.bytes().await });
                match got {
                    Ok(b) => Ok(Some(b)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => {
                        Err(e).with_context(|| format!("reading {}", self.beside_shown(extension)))
                    }
                }
            }
        }
    }

    /// The part's footer (rank, run id, clock offset, ...), reading only the end of the file.
    pub fn footer(&self) -> Result<Footer> {
        Footer::parse(&self.footer_kv()?)
            .with_context(|| format!("reading the footer of {}", self.shown()))
    }

    /// The key-value metadata of the part's footer, reading only the end of the file.
    pub fn footer_kv(&self) -> Result<std::collections::HashMap<String, String>> {
        use crate::footer::{FOOTER_READ, Tail};
        let (len, mut tail) = match &self.place {
            // Not listed: its size comes with the first read of its end.
            Place::Object {
                store,
                path,
                shown,
                len: None,
            } => {
                let opts = object_store::GetOptions {
                    range: Some(object_store::GetRange::Suffix(FOOTER_READ)),
                    ..Default::default()
                };
                let got = titan_storage::runtime()
                    .block_on(async {
                        let r = store.get_opts(path, opts).await?;
                        let len = r.meta.size;
                        Ok::<_, object_store::Error>((len, r.bytes().await?))
                    })
                    .with_context(|| format!("reading {shown}"))?;
                (got.0, Some(got.1))
            }
            _ => (self.byte_len()?, None),
        };
        let mut want = len.min(FOOTER_READ);
        loop {
            let tail = match tail.take() {
                Some(t) => t,
                None => self.read_range(len - want..len)?,
            };
            match crate::footer::parse_tail(&tail, len)
                .with_context(|| format!("{}: invalid Parquet footer", self.shown()))?
            {
                Tail::Footer(kv) => return Ok(kv),
                Tail::NeedMore(n) if n > want && n <= len => want = n,
                Tail::NeedMore(n) => bail!("{}: invalid Parquet footer ({n} bytes)", self.shown()),
            }
        }
    }
}

/// `.../part-<N>.parquet` -> `.../part-<N>.<extension>`.
fn beside_name(part: &str, extension: &str) -> String {
    let stem = part.strip_suffix(".parquet").unwrap_or(part);
    format!("{stem}.{extension}")
}

/// Rank folders of an object store listed at once.
const LISTINGS_AT_ONCE: usize = 32;

/// Every rank's parts, by rank and part index. A local part's size is read when asked for
/// ([`PartFile::byte_len`]): listing a day-long run's folders stays cheap.
pub fn list(location: &Location) -> Result<BTreeMap<u32, Vec<PartFile>>> {
    let mut ranks: BTreeMap<u32, Vec<PartFile>> = BTreeMap::new();
    match location {
        Location::Local(run) => {
            for (rank, dir) in ObsFolder::list(&run.join("obs"))?.rank_dirs {
                ranks
                    .entry(rank)
                    .or_default()
                    .extend(list_local_rank(&dir, rank)?);
            }
        }
        Location::Object { url, store, base } => {
            // The rank folders first, then each folder's objects, a few folders at a time: a
            // day-long run holds hundreds of thousands of objects, which one listing pages
            // through a thousand at a time.
            let folders = crate::location::ObjectObs::list(store, base, url)?.ranks;
            ranks = list_object_ranks(store, base, url, &folders)?;
        }
    }
    for parts in ranks.values_mut() {
        parts.sort_by_key(|p| p.index);
    }
    Ok(ranks)
}

/// The parts of the object-store ranks `ranks` (run at `base`, `url` for messages), each
/// folder listed, `LISTINGS_AT_ONCE` at a time; by rank and part index.
pub fn list_object_ranks(
    store: &Arc<dyn ObjectStore>,
    base: &StorePath,
    url: &str,
    ranks: &[u32],
) -> Result<BTreeMap<u32, Vec<PartFile>>> {
    use futures::{StreamExt, TryStreamExt};
    let listed: Vec<(u32, Vec<object_store::ObjectMeta>)> = titan_storage::runtime()
        .block_on(
            futures::stream::iter(ranks.iter().map(|&rank| {
                let folder = crate::location::stored_rank_dir(base, rank);
                async move {
                    let metas = store.list(Some(&folder)).try_collect().await;
                    metas.map(|m| (rank, m))
                }
            }))
            .buffer_unordered(LISTINGS_AT_ONCE)
            .try_collect(),
        )
        .with_context(|| format!("listing {url}/obs"))?;
    let mut out: BTreeMap<u32, Vec<PartFile>> = BTreeMap::new();
    for (rank, metas) in listed {
        let parts = out.entry(rank).or_default();
        for m in metas {
            let Some(file) = m.location.filename() else {
                continue;
            };
            let Some(index) = parse_part_file_name(file) else {
                continue;
            };
            parts.push(PartFile {
                rank,
                index,
                place: Place::Object {
                    store: store.clone(),
                    shown: format!("{url}/obs/rank-{rank}/{file}"),
                    path: m.location,
                    len: Some(m.size),
                },
            });
        }
        parts.sort_by_key(|p| p.index);
    }
    Ok(out)
}

/// Whether the run's parts hold at least `bytes` in all: summed rank folder by rank folder
/// (listing page by listing page on an object store) until they do, so a day-long run is
/// told after a few folders, not after a stat of each of its millions of parts.
pub fn hold_at_least(location: &Location, bytes: u64) -> Result<bool> {
    let mut sum = 0u64;
    match location {
        Location::Local(run) => {
            for (rank, dir) in ObsFolder::list(&run.join("obs"))?.rank_dirs {
                for p in list_local_rank(&dir, rank)? {
                    sum = sum.saturating_add(p.byte_len().unwrap_or(0));
                    if sum >= bytes {
                        return Ok(true);
                    }
                }
            }
        }
        Location::Object { url, store, base } => {
            use futures::StreamExt;
            let obs = base.clone().join("obs");
            let rt = titan_storage::runtime();
            let mut objects = store.list(Some(&obs));
            while let Some(m) = rt.block_on(objects.next()) {
                let m = m.with_context(|| format!("listing {url}/obs"))?;
                if m.location
                    .filename()
                    .and_then(parse_part_file_name)
                    .is_some()
                {
                    sum = sum.saturating_add(m.size);
                    if sum >= bytes {
                        return Ok(true);
                    }
                }
            }
        }
    }
    Ok(false)
}

/// The parts in rank `rank`'s local folder `dir`, by part index.
pub fn list_local_rank(dir: &std::path::Path, rank: u32) -> Result<Vec<PartFile>> {
    let mut parts = Vec::new();
    for f in std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .flatten()
    {
        let name = f.file_name();
        if let Some(index) = name.to_str().and_then(parse_part_file_name) {
            parts.push(PartFile {
                rank,
                index,
                place: Place::Local(f.path()),
            });
        }
    }
    parts.sort_by_key(|p| p.index);
    Ok(parts)
}

/// Keeps the parts of one run of a folder that may hold several (see [`crate::runs`]): run
/// `id`, or the newest (the run of the lowest rank's last part). Returns the id kept
/// (`None`: no part could tell). Fails, naming the runs there are, when no part is of `id`.
///
/// A rank writes its parts in order and a run's parts are contiguous, so a rank whose first
/// and last part are of one run holds only that run: only ranks whose ends differ have
/// every footer read. Parts whose footer cannot be read stay (they are named when read).
pub fn keep_run(
    run: &str,
    ranks: &mut BTreeMap<u32, Vec<PartFile>>,
    id: Option<&str>,
) -> Result<Option<String>> {
    use rayon::prelude::*;
    let run_of = |p: &PartFile| p.footer().ok().map(|f| f.header.run_id);
    let ends: Vec<(u32, Option<String>, Option<String>)> = ranks
        .par_iter()
        .map(|(&rank, parts)| {
            let first = parts.first().and_then(run_of);
            let last = if parts.len() > 1 {
                parts.last().and_then(run_of)
            } else {
                first.clone()
            };
            (rank, first, last)
        })
        .collect();
    let mut seen: Vec<String> = Vec::new();
    let mut mixed: Vec<u32> = Vec::new();
    for (rank, first, last) in &ends {
        for r in [first, last].into_iter().flatten() {
            if !seen.contains(r) {
                seen.push(r.clone());
            }
        }
        if first != last {
            mixed.push(*rank);
        }
    }
    // Per mixed rank, every part's run.
    let runs_of: BTreeMap<u32, Vec<Option<String>>> = mixed
        .par_iter()
        .map(|rank| (*rank, ranks[rank].par_iter().map(run_of).collect()))
        .collect();
    for r in runs_of.values().flatten().flatten() {
        if !seen.contains(r) {
            seen.push(r.clone());
        }
    }
    let newest = ends.iter().find_map(|(_, _, last)| last.clone());
    let wanted = match id {
        Some(id) if seen.iter().any(|s| s == id) => id.to_string(),
        Some(id) => {
            return Err(crate::location::NotARun(format!(
                "{run} holds no run `{id}`; its runs: {}",
                if seen.is_empty() {
                    "none".to_string()
                } else {
                    seen.join(", ")
                }
            ))
            .into());
        }
        None => match newest {
            Some(n) => n,
            None => return Ok(None),
        },
    };
    if seen.len() <= 1 {
        return Ok(Some(wanted));
    }
    for (rank, first, _) in &ends {
        let parts = ranks.get_mut(rank).expect("listed");
        match runs_of.get(rank) {
            Some(runs) => {
                let mut of = runs.iter();
                parts.retain(|_| {
                    of.next()
                        .is_some_and(|r| r.as_deref().is_none_or(|r| r == wanted))
                });
            }
            None if first.as_deref().is_some_and(|f| f != wanted) => parts.clear(),
            None => {}
        }
    }
    ranks.retain(|_, parts| !parts.is_empty());
    Ok(Some(wanted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::footer::PartHeader;
    use crate::part::{PartBuilder, PartSink, Row, encode};

    /// A part whose footer is larger than the first read from its end (a big run config in
    /// its metadata): the footer is still read whole, from the end only.
    #[test]
    fn reads_a_footer_larger_than_the_first_read() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let config: String = "x".repeat(40 << 10);
        let header = PartHeader {
            run_id: "big-footer".into(),
            source: "trainer".into(),
            rank: 2,
            world_size: 4,
            run_metadata: serde_json::Map::from_iter([(
                "config".to_string(),
                serde_json::Value::String(config.clone()),
            )]),
            ..Default::default()
        };
        let mut b = PartBuilder::new();
        b.push(&Row::span(1, "step", 1, 0, 10, 0));
        let batch = b.finish(&header).unwrap();
        let location = Location::parse(run.to_str().unwrap()).unwrap();
        let sink = PartSink::new(location.clone(), 2).unwrap();
        sink.put(7, encode(&batch, &header, 7).unwrap()).unwrap();

        let listed = list(&location).unwrap();
        let part = &listed[&2][0];
        assert_eq!((part.rank, part.index), (2, 7));
        let footer = part.footer().unwrap();
        assert_eq!(footer.header.run_id, "big-footer");
        assert_eq!(footer.header.run_metadata["config"], config.as_str());
        // Its summary and detail levels are in that footer, none beside it (issue 42).
        let kv = part.footer_kv().unwrap();
        assert!(crate::digest::from_footer(&kv).unwrap().is_some());
        assert!(crate::lod::from_footer(&kv).unwrap().is_some());
        assert!(part.read_beside("lod").unwrap().is_none());
        assert!(part.read_beside("summary").unwrap().is_none());
    }
}
