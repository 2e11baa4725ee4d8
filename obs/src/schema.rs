//! The typed record schema shared by the writer, the reader and `obs/SCHEMA.md`.
//!
//! One Parquet row is one record. Columns that are constant within a part (run_id, source,
//! host, rank, local_rank, pid) are dictionary/RLE encoded and cost next to nothing on disk.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, LazyLock};

use arrow_schema::{DataType, Field, Schema, SchemaRef};

/// Version of the column layout written into every footer (`titan.schema_version`).
/// Version 2 added the nullable `microbatch` and `stage` span columns; version-1 files read as
/// if both were null.
pub const SCHEMA_VERSION: u32 = 2;

/// Which program produced the records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    Trainer,
    Validator,
    Ckpt,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Trainer => "trainer",
            Source::Validator => "validator",
            Source::Ckpt => "ckpt",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Source {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "trainer" => Ok(Source::Trainer),
            "validator" => Ok(Source::Validator),
            "ckpt" => Ok(Source::Ckpt),
            other => Err(format!(
                "unknown source `{other}` (expected trainer, validator or ckpt)"
            )),
        }
    }
}

/// How a scalar is reduced across ranks when metrics are aggregated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reduce {
    Mean,
    Max,
    Min,
    Sum,
}

impl Reduce {
    pub fn as_str(self) -> &'static str {
        match self {
            Reduce::Mean => "mean",
            Reduce::Max => "max",
            Reduce::Min => "min",
            Reduce::Sum => "sum",
        }
    }

    /// Combines one step's per-rank values (NaN for no values, except sum = 0).
    pub fn apply(self, values: &[f64]) -> f64 {
        match self {
            Reduce::Mean if values.is_empty() => f64::NAN,
            Reduce::Mean => values.iter().sum::<f64>() / values.len() as f64,
            Reduce::Max => values.iter().copied().reduce(f64::max).unwrap_or(f64::NAN),
            Reduce::Min => values.iter().copied().reduce(f64::min).unwrap_or(f64::NAN),
            Reduce::Sum => values.iter().sum(),
        }
    }
}

impl fmt::Display for Reduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Reduce {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mean" => Ok(Reduce::Mean),
            "max" => Ok(Reduce::Max),
            "min" => Ok(Reduce::Min),
            "sum" => Ok(Reduce::Sum),
            other => Err(format!(
                "unknown reduce `{other}` (expected mean, max, min or sum)"
            )),
        }
    }
}

/// Where a span sits in a pipeline-parallel schedule: the microbatch it ran and the (virtual)
/// pipeline stage that ran it. Only the passes of a pipeline schedule carry one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PipelineSlot {
    pub microbatch: u16,
    pub stage: u16,
}

/// What a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A timed region with a start and a duration.
    Span,
    /// A point event (also written for every step tag).
    Instant,
    /// A metric value with its cross-rank reduction.
    Scalar,
    /// An error raised inside a span, with its message.
    Error,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Span => "span",
            Kind::Instant => "instant",
            Kind::Scalar => "scalar",
            Kind::Error => "error",
        }
    }
}

impl FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "span" => Ok(Kind::Span),
            "instant" => Ok(Kind::Instant),
            "scalar" => Ok(Kind::Scalar),
            "error" => Ok(Kind::Error),
            other => Err(format!("unknown record kind `{other}`")),
        }
    }
}

/// Column names, in file order.
pub mod col {
    pub const RUN_ID: &str = "run_id";
    pub const SOURCE: &str = "source";
    pub const HOST: &str = "host";
    pub const RANK: &str = "rank";
    pub const LOCAL_RANK: &str = "local_rank";
    pub const PID: &str = "pid";
    pub const THREAD: &str = "thread";
    pub const THREAD_NAME: &str = "thread_name";
    pub const SEQ: &str = "seq";
    pub const KIND: &str = "kind";
    pub const NAME: &str = "name";
    pub const STEP: &str = "step";
    pub const START_NS: &str = "start_ns";
    pub const DUR_NS: &str = "dur_ns";
    pub const VALUE: &str = "value";
    pub const REDUCE: &str = "reduce";
    pub const DEPTH: &str = "depth";
    pub const PARENT: &str = "parent";
    pub const TAGS: &str = "tags";
    pub const MESSAGE: &str = "message";
    pub const MICROBATCH: &str = "microbatch";
    pub const STAGE: &str = "stage";
}

/// Footer key-value metadata keys.
pub mod meta {
    pub const SCHEMA_VERSION: &str = "titan.schema_version";
    pub const RUN_ID: &str = "titan.run_id";
    pub const SOURCE: &str = "titan.source";
    pub const HOST: &str = "titan.host";
    pub const RANK: &str = "titan.rank";
    pub const LOCAL_RANK: &str = "titan.local_rank";
    pub const WORLD_SIZE: &str = "titan.world_size";
    pub const PID: &str = "titan.pid";
    pub const PART: &str = "titan.part";
    /// Add this to a start_ns of this rank to get rank 0's clock.
    pub const CLOCK_OFFSET_NS: &str = "titan.clock_offset_ns";
    /// JSON object of thread id -> thread name.
    pub const THREADS: &str = "titan.threads";
    /// JSON object of free-form run metadata (config hash, command line, ...).
    pub const RUN_METADATA: &str = "titan.run_metadata";
    /// JSON array of the damaged journal ranges dropped when the part was compacted from its
    /// journal (`[{offset, bytes, lost, error}]`), so readers of the part still name them.
    pub const DAMAGE: &str = "titan.damage";
    /// The part's summary (`obs/SCHEMA.md` "Per-part summaries", describing a part of length
    /// 0: the file holding it), standard base64: a part is one file (issue 42).
    pub const SUMMARY: &str = "titan.summary";
    /// The part's detail levels (`obs/SCHEMA.md` "Detail levels", part length 0), base64.
    pub const DETAIL: &str = "titan.lod";
}

fn dict_utf8() -> DataType {
    DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))
}

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new(col::RUN_ID, dict_utf8(), false),
        Field::new(col::SOURCE, dict_utf8(), false),
        Field::new(col::HOST, dict_utf8(), false),
        Field::new(col::RANK, DataType::UInt32, false),
        Field::new(col::LOCAL_RANK, DataType::UInt32, false),
        Field::new(col::PID, DataType::UInt32, false),
        Field::new(col::THREAD, DataType::UInt32, false),
        Field::new(col::THREAD_NAME, dict_utf8(), false),
        Field::new(col::SEQ, DataType::UInt64, false),
        Field::new(col::KIND, dict_utf8(), false),
        Field::new(col::NAME, dict_utf8(), false),
        Field::new(col::STEP, DataType::UInt64, true),
        Field::new(col::START_NS, DataType::Int64, false),
        Field::new(col::DUR_NS, DataType::Int64, true),
        Field::new(col::VALUE, DataType::Float64, true),
        Field::new(col::REDUCE, dict_utf8(), true),
        Field::new(col::DEPTH, DataType::UInt16, false),
        Field::new(col::PARENT, DataType::UInt64, true),
        Field::new(
            col::TAGS,
            DataType::List(Arc::new(Field::new("item", DataType::Utf8, false))),
            false,
        ),
        Field::new(col::MESSAGE, DataType::Utf8, true),
        Field::new(col::MICROBATCH, DataType::UInt16, true),
        Field::new(col::STAGE, DataType::UInt16, true),
    ]))
});

/// The Arrow schema of every part file.
pub fn arrow_schema() -> SchemaRef {
    SCHEMA.clone()
}
