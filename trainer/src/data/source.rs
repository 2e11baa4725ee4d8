//! Where documents come from: the embedded default dataset or local `.txt` / `.jsonl` / `.parquet`
//! files (a `text` field), read as a stream in a fixed order.
//!
//! As Hugging Face `datasets` does for these formats: a `.txt` line, a `.jsonl` line or a parquet
//! row is one sample.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use arrow_array::Array;
use arrow_array::cast::AsArray;
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

const EMBEDDED_TRAIN: &str = include_str!("../../assets/default_train.jsonl");
const EMBEDDED_VALIDATION: &str = include_str!("../../assets/default_validation.jsonl");

/// Where torchtitan's `c4_test` dataset lives when no path is given (its `DATASETS` entry).
pub const C4_TEST_PATH: &str = "tests/assets/c4_test";

/// A dataset: an ordered list of document sources.
#[derive(Debug, Clone, PartialEq)]
pub enum Dataset {
    /// The embedded default training split.
    DefaultTrain,
    /// The embedded default validation split.
    DefaultValidation,
    /// Local files, read in this order.
    Files(Vec<PathBuf>),
}

impl Dataset {
    /// Resolves a dataset name and optional path (torchtitan's `dataset` / `dataset_path`);
    /// `key` names the config section for errors.
    pub fn resolve(name: &str, path: Option<&str>, section: &str) -> Result<Self> {
        if let Some(path) = path {
            return Ok(Self::Files(
                list_files(Path::new(path))
                    .with_context(|| format!("{section}.dataset_path `{path}`"))?,
            ));
        }
        match name {
            "default" => Ok(Self::DefaultTrain),
            "default_validation" => Ok(Self::DefaultValidation),
            // torchtitan's local test set: its registry's default path, relative to the working
            // directory as in torchtitan.
            "c4_test" => Self::resolve(name, Some(C4_TEST_PATH), section),
            "c4" | "c4_validation" => bail!(
                "{section}.dataset `{name}` is allenai/c4 on the Hugging Face Hub, which titan-train \
                 does not download: fetch its .json.gz/.parquet files and set the dataset_path key \
                 to them (--dataloader.dataset_path, or {section}.dataset_path)"
            ),
            other => bail!(
                "{section}.dataset `{other}` is not built in: use `default` / `default_validation` or set {section}.dataset_path to .txt/.jsonl/.parquet files"
            ),
        }
    }

    /// How many documents the dataset has (what Hugging Face `datasets` calls its length):
    /// data-parallel ranks split it into contiguous shards by this count.
    pub fn count_docs(&self) -> Result<u64> {
        let mut total = 0u64;
        for spec in self.sources() {
            total += count_source(&spec)?;
        }
        Ok(total)
    }

    fn sources(&self) -> Vec<SourceSpec> {
        match self {
            Self::DefaultTrain => vec![SourceSpec::EmbeddedJsonl("default", EMBEDDED_TRAIN)],
            Self::DefaultValidation => vec![SourceSpec::EmbeddedJsonl(
                "default_validation",
                EMBEDDED_VALIDATION,
            )],
            Self::Files(files) => files.iter().cloned().map(SourceSpec::File).collect(),
        }
    }

    /// Opens the stream at its first document.
    pub fn open(&self) -> Result<DocStream> {
        Ok(DocStream {
            sources: self.sources(),
            next_source: 0,
            current: None,
        })
    }

    /// Every document, in order (for tests: a real dataset does not fit in memory).
    #[cfg(test)]
    pub(crate) fn read_all(&self) -> Result<Vec<String>> {
        let mut stream = self.open()?;
        let mut out = Vec::new();
        while let Some(doc) = stream.next_doc()? {
            out.push(doc);
        }
        Ok(out)
    }
}

fn is_data_file(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("txt" | "jsonl" | "parquet")
    )
}

fn list_files(path: &Path) -> Result<Vec<PathBuf>> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.is_file() {
        if !is_data_file(path) {
            bail!("{} is not a .txt, .jsonl or .parquet file", path.display());
        }
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in
        std::fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))?
    {
        let p = entry?.path();
        if p.is_file() && is_data_file(&p) {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        bail!("{} holds no .txt, .jsonl or .parquet files", path.display());
    }
    Ok(files)
}

#[derive(Debug, Clone)]
enum SourceSpec {
    EmbeddedJsonl(&'static str, &'static str),
    File(PathBuf),
}

type Docs = Box<dyn Iterator<Item = Result<String>> + Send>;

/// Documents of a dataset in order; `None` at the end of the last source.
pub struct DocStream {
    sources: Vec<SourceSpec>,
    next_source: usize,
    current: Option<Docs>,
}

impl DocStream {
    /// The next document, `Ok(None)` when the dataset is exhausted.
    pub fn next_doc(&mut self) -> Result<Option<String>> {
        loop {
            if let Some(docs) = &mut self.current {
                if let Some(doc) = docs.next() {
                    return doc.map(Some);
                }
                self.current = None;
            }
            let Some(spec) = self.sources.get(self.next_source).cloned() else {
                return Ok(None);
            };
            self.next_source += 1;
            self.current = Some(open_source(spec)?);
        }
    }
}

fn open_source(spec: SourceSpec) -> Result<Docs> {
    match spec {
        SourceSpec::EmbeddedJsonl(name, text) => {
            let name = name.to_string();
            Ok(Box::new(text.lines().enumerate().filter_map(
                move |(i, line)| jsonl_text(line, &name, i + 1).transpose(),
            )))
        }
        SourceSpec::File(path) => {
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            match ext {
                "txt" => {
                    let f = File::open(&path)
                        .with_context(|| format!("cannot open {}", path.display()))?;
                    let shown = path.display().to_string();
                    Ok(Box::new(BufReader::new(f).lines().map(move |l| {
                        l.with_context(|| format!("reading {shown}"))
                    })))
                }
                "jsonl" => {
                    let f = File::open(&path)
                        .with_context(|| format!("cannot open {}", path.display()))?;
                    let shown = path.display().to_string();
                    Ok(Box::new(BufReader::new(f).lines().enumerate().filter_map(
                        move |(i, l)| match l {
                            Ok(line) => jsonl_text(&line, &shown, i + 1).transpose(),
                            Err(e) => Some(Err(
                                anyhow::Error::new(e).context(format!("reading {shown}")),
                            )),
                        },
                    )))
                }
                "parquet" => parquet_texts(&path),
                _ => bail!("{} is not a .txt, .jsonl or .parquet file", path.display()),
            }
        }
    }
}

/// The number of documents in one source without decoding them: lines of a `.txt`, non-blank
/// lines of a `.jsonl` (as [`jsonl_text`] skips blank ones), rows of a `.parquet` (its footer).
fn count_source(spec: &SourceSpec) -> Result<u64> {
    let non_blank = |line: &str| !line.trim().is_empty();
    match spec {
        SourceSpec::EmbeddedJsonl(_, text) => {
            Ok(text.lines().filter(|l| non_blank(l)).count() as u64)
        }
        SourceSpec::File(path) => {
            let shown = path.display().to_string();
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if ext == "parquet" {
                let file = File::open(path).with_context(|| format!("cannot open {shown}"))?;
                let builder = ParquetRecordBatchReaderBuilder::try_new(file)
                    .with_context(|| format!("{shown} is not a readable parquet file"))?;
                return Ok(builder.metadata().file_metadata().num_rows().max(0) as u64);
            }
            let f = File::open(path).with_context(|| format!("cannot open {shown}"))?;
            let mut n = 0u64;
            for line in BufReader::new(f).lines() {
                let line = line.with_context(|| format!("reading {shown}"))?;
                if ext == "txt" || non_blank(&line) {
                    n += 1;
                }
            }
            Ok(n)
        }
    }
}

/// The `text` field of one JSON line; blank lines are skipped.
fn jsonl_text(line: &str, file: &str, line_no: usize) -> Result<Option<String>> {
    if line.trim().is_empty() {
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("{file} line {line_no} is not valid JSON"))?;
    match value.get("text") {
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        _ => bail!("{file} line {line_no} has no string field `text`"),
    }
}

/// The `text` column of a parquet file, batch by batch.
fn parquet_texts(path: &Path) -> Result<Docs> {
    let shown = path.display().to_string();
    let file = File::open(path).with_context(|| format!("cannot open {shown}"))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .with_context(|| format!("{shown} is not a readable parquet file"))?;
    let schema = builder.parquet_schema();
    let Some(col) = (0..schema.num_columns()).find(|&i| schema.column(i).path().string() == "text")
    else {
        bail!("{shown} has no column `text`");
    };
    let mask = parquet::arrow::ProjectionMask::leaves(schema, [col]);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(1024)
        .build()
        .with_context(|| format!("reading {shown}"))?;
    Ok(Box::new(reader.flat_map(move |batch| {
        let rows: Vec<Result<String>> = match batch {
            Err(e) => vec![Err(
                anyhow::Error::new(e).context(format!("reading {shown}"))
            )],
            Ok(batch) => {
                let column = batch.column(0);
                let strings: Result<Vec<String>> = match column.data_type() {
                    DataType::Utf8 => Ok(column
                        .as_string::<i32>()
                        .iter()
                        .flatten()
                        .map(str::to_string)
                        .collect()),
                    DataType::LargeUtf8 => Ok(column
                        .as_string::<i64>()
                        .iter()
                        .flatten()
                        .map(str::to_string)
                        .collect()),
                    DataType::Utf8View => Ok(column
                        .as_string_view()
                        .iter()
                        .flatten()
                        .map(str::to_string)
                        .collect()),
                    other => Err(anyhow::anyhow!(
                        "{shown}: column `text` has type {other}, expected a string"
                    )),
                };
                match strings {
                    Ok(v) => v.into_iter().map(Ok).collect(),
                    Err(e) => vec![Err(e)],
                }
            }
        };
        rows
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_splits_are_disjoint_and_nonempty() {
        let train = Dataset::DefaultTrain.read_all().unwrap();
        let valid = Dataset::DefaultValidation.read_all().unwrap();
        assert!(train.len() > 1000 && valid.len() > 50);
        assert!(train.iter().all(|d| !d.is_empty()));
    }

    #[test]
    fn reads_txt_and_jsonl_folders_in_order() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), "first line\nsecond line\n").unwrap();
        std::fs::write(
            dir.path().join("b.jsonl"),
            "{\"text\": \"third\"}\n\n{\"text\": \"fourth\", \"id\": 1}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("ignored.md"), "x").unwrap();
        let ds = Dataset::resolve("mine", Some(dir.path().to_str().unwrap()), "training").unwrap();
        assert_eq!(
            ds.read_all().unwrap(),
            ["first line", "second line", "third", "fourth"]
        );
    }

    #[test]
    fn bad_jsonl_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.jsonl");
        std::fs::write(&f, "{\"text\": \"ok\"}\n{\"body\": 1}\n").unwrap();
        let ds = Dataset::resolve("x", Some(f.to_str().unwrap()), "training").unwrap();
        let mut s = ds.open().unwrap();
        assert_eq!(s.next_doc().unwrap().unwrap(), "ok");
        let err = s.next_doc().unwrap_err().to_string();
        assert!(err.contains("bad.jsonl line 2"), "{err}");
    }
}
