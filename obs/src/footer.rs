//! A part's footer: the Parquet key-value metadata that says who wrote its records
//! ([`PartHeader`]), which part it is and what journal damage was dropped when it was
//! compacted ([`Footer`]), and the part's embedded summary and detail levels (`titan.summary`,
//! `titan.lod`: standard base64, since key-value values are strings; see `embedded.rs`). A
//! journal's schema metadata is the same footer. Read from a part in memory
//! (`key_values_of`) or from the end of a part file ([`parse_tail`]).

use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use parquet::file::metadata::{KeyValue, ParquetMetaDataReader};

use crate::schema::{SCHEMA_VERSION, meta};

/// Who wrote a part: constant columns plus footer metadata.
#[derive(Debug, Clone, Default)]
pub struct PartHeader {
    pub run_id: String,
    pub source: String,
    pub host: String,
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub pid: u32,
    /// Add to this rank's start_ns to get rank 0's clock.
    pub clock_offset_ns: i64,
    pub threads: BTreeMap<u32, String>,
    /// Free-form run metadata (JSON object), e.g. the config the run was started with.
    pub run_metadata: serde_json::Map<String, serde_json::Value>,
}

impl PartHeader {
    /// The footer as Parquet key-value metadata (also the journal's schema metadata).
    pub fn key_values(&self, part: u64) -> Vec<KeyValue> {
        let threads: serde_json::Map<String, serde_json::Value> = self
            .threads
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::String(v.clone())))
            .collect();
        [
            (meta::SCHEMA_VERSION, SCHEMA_VERSION.to_string()),
            (meta::RUN_ID, self.run_id.clone()),
            (meta::SOURCE, self.source.clone()),
            (meta::HOST, self.host.clone()),
            (meta::RANK, self.rank.to_string()),
            (meta::LOCAL_RANK, self.local_rank.to_string()),
            (meta::WORLD_SIZE, self.world_size.to_string()),
            (meta::PID, self.pid.to_string()),
            (meta::PART, part.to_string()),
            (meta::CLOCK_OFFSET_NS, self.clock_offset_ns.to_string()),
            (
                meta::THREADS,
                serde_json::Value::Object(threads).to_string(),
            ),
            (
                meta::RUN_METADATA,
                serde_json::Value::Object(self.run_metadata.clone()).to_string(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| KeyValue::new(k.to_string(), v))
        .collect()
    }
}

/// A damaged range of the journal a part was compacted from, recorded in the part's footer
/// (`titan.damage`): its records are not in the part.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CompactedDamage {
    pub offset: u64,
    pub bytes: u64,
    pub lost: String,
    pub error: String,
}

/// A footer parsed from key-value metadata: who wrote the records and which part they are.
#[derive(Debug, Clone)]
pub struct Footer {
    pub header: PartHeader,
    /// `titan.part`, when present.
    pub part: Option<u64>,
    /// Journal damage dropped at compaction (`titan.damage`; empty when absent).
    pub damage: Vec<CompactedDamage>,
}

impl Footer {
    /// Parses a part footer (or journal schema metadata). Required: rank, run id, source and
    /// world size; the rest default when absent or unreadable (older writers).
    pub fn parse(kv: &HashMap<String, String>) -> Result<Footer> {
        fn required<'a>(kv: &'a HashMap<String, String>, key: &str) -> Result<&'a str> {
            kv.get(key).map(String::as_str).with_context(|| {
                format!("footer metadata key `{key}` is missing (not a titan part?)")
            })
        }
        fn number<T: std::str::FromStr>(kv: &HashMap<String, String>, key: &str) -> Result<T> {
            required(kv, key)?
                .parse()
                .map_err(|_| anyhow::anyhow!("footer `{key}` is not a number"))
        }
        fn optional<T: std::str::FromStr + Default>(kv: &HashMap<String, String>, key: &str) -> T {
            kv.get(key).and_then(|v| v.parse().ok()).unwrap_or_default()
        }
        if let Some(v) = kv.get(meta::SCHEMA_VERSION)
            && v.parse::<u32>().is_ok_and(|v| v > SCHEMA_VERSION)
        {
            bail!("schema version {v} is newer than this titan-obs reads ({SCHEMA_VERSION})");
        }
        let header = PartHeader {
            run_id: required(kv, meta::RUN_ID)?.to_string(),
            source: required(kv, meta::SOURCE)?.to_string(),
            host: kv.get(meta::HOST).cloned().unwrap_or_default(),
            rank: number(kv, meta::RANK)?,
            local_rank: optional(kv, meta::LOCAL_RANK),
            world_size: number(kv, meta::WORLD_SIZE)?,
            pid: optional(kv, meta::PID),
            clock_offset_ns: optional(kv, meta::CLOCK_OFFSET_NS),
            threads: kv
                .get(meta::THREADS)
                .and_then(|v| serde_json::from_str::<BTreeMap<String, String>>(v).ok())
                .map(|m| {
                    m.into_iter()
                        .filter_map(|(k, v)| Some((k.parse().ok()?, v)))
                        .collect()
                })
                .unwrap_or_default(),
            run_metadata: kv
                .get(meta::RUN_METADATA)
                .and_then(|v| serde_json::from_str(v).ok())
                .unwrap_or_default(),
        };
        let damage = match kv.get(meta::DAMAGE) {
            None => Vec::new(),
            Some(v) => serde_json::from_str(v).unwrap_or_else(|e| {
                // The record of the damage is itself unreadable: still name it.
                vec![CompactedDamage {
                    offset: 0,
                    bytes: 0,
                    lost: "unknown (the footer's record of it is unreadable)".into(),
                    error: format!("`{}` does not parse: {e}", meta::DAMAGE),
                }]
            }),
        };
        Ok(Footer {
            header,
            part: kv.get(meta::PART).and_then(|v| v.parse().ok()),
            damage,
        })
    }
}

/// The footer entry `key` embedding `bytes` (a summary or detail levels encoded for a part of
/// length 0: the file that holds them).
pub(crate) fn embed(key: &str, bytes: &[u8]) -> KeyValue {
    KeyValue::new(key.to_string(), STANDARD.encode(bytes))
}

/// The bytes embedded as footer entry `key`; `Ok(None)` when the footer has none.
pub(crate) fn embedded(kv: &HashMap<String, String>, key: &str) -> Result<Option<Vec<u8>>> {
    kv.get(key)
        .map(|v| {
            STANDARD
                .decode(v)
                .with_context(|| format!("its footer's `{key}` is not base64"))
        })
        .transpose()
}

/// The footer key-values of an encoded part held in memory.
pub(crate) fn key_values_of(part: &bytes::Bytes) -> Result<HashMap<String, String>> {
    let meta = crate::guard::guarded(|| {
        ParquetMetaDataReader::new()
            .parse_and_finish(part)
            .context("invalid Parquet footer")
    })
    .unwrap_or_else(|panic| anyhow::bail!("the Parquet reader failed on it ({panic})"))?;
    Ok(kv_map(meta.file_metadata()))
}

/// How much of the end of a part a footer read asks for first: footers are a few kB plus the
/// embedded summary and detail levels (~10 kB in the benchmark's parts; more with a large run
/// config), so one read usually holds the whole of it.
pub const FOOTER_READ: u64 = 64 << 10;

/// The end of a part, parsed.
pub enum Tail {
    /// The footer's key-values.
    Footer(HashMap<String, String>),
    /// The footer needs this many bytes from the end.
    NeedMore(u64),
}

/// Parses the footer in `tail`, the last bytes of a part of `len` bytes.
pub fn parse_tail(tail: &bytes::Bytes, len: u64) -> Result<Tail> {
    use parquet::errors::ParquetError;
    let mut reader = ParquetMetaDataReader::new();
    match crate::guard::guarded(|| reader.try_parse_sized(tail, len))
        .unwrap_or_else(|p| Err(ParquetError::General(p)))
    {
        Ok(()) => Ok(Tail::Footer(kv_map(reader.finish()?.file_metadata()))),
        Err(ParquetError::NeedMoreData(n)) => Ok(Tail::NeedMore(n as u64)),
        Err(e) => Err(e.into()),
    }
}

/// A footer's key-value metadata as a map (entries without a value left out).
pub(crate) fn kv_map(meta: &parquet::file::metadata::FileMetaData) -> HashMap<String, String> {
    meta.key_value_metadata()
        .map(|kvs| {
            kvs.iter()
                .filter_map(|k| Some((k.key.clone(), k.value.clone()?)))
                .collect()
        })
        .unwrap_or_default()
}
