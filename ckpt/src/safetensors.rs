//! The safetensors container: header parsing with limits, and header writing.
//!
//! Layout: 8-byte little-endian header length N, N bytes of JSON (may be space padded), data.
//! Parsing checks everything the data copy relies on: the header fits the file and the 100 MB
//! limit, every dtype is known, each entry's byte length matches its shape, entries tile the data
//! section with no hole or overlap, and the data section ends exactly at the end of the file.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::plan::{Chunk, ChunkSource, Encoding, numel};
use crate::storage::InFile;
use titan_dcp::Dtype;

/// Headers larger than this are refused (the limit the safetensors library uses).
pub const MAX_HEADER_BYTES: u64 = 100 * 1000 * 1000;

/// One tensor entry of a safetensors header.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Absolute byte range in the file (header offsets + data start).
    pub begin: u64,
    pub end: u64,
}

impl Entry {
    /// The entry's bytes (in the `file`-th file of a plan) as the chunk at `offsets` of its
    /// tensor: all zeros for a whole tensor, the shard's place for a shard.
    pub fn chunk(&self, file: usize, offsets: Vec<u64>) -> Chunk {
        Chunk {
            offsets,
            sizes: self.shape.clone(),
            source: ChunkSource {
                file,
                begin: self.begin,
                end: self.end,
                encoding: Encoding::Raw,
            },
        }
    }
}

/// A parsed safetensors header.
#[derive(Debug, Clone)]
pub struct Header {
    /// Entries in data order.
    pub entries: Vec<Entry>,
    /// The `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
    pub data_start: u64,
}

/// Reads and validates the header of `file`.
pub fn read_header(file: &InFile) -> Result<Header> {
    let name = &file.name;
    if file.size < 8 {
        return Err(Error::invalid(
            name,
            format!(
                "truncated: {} bytes is too short for a safetensors header",
                file.size
            ),
        ));
    }
    let mut len = [0u8; 8];
    file.read_at(0, &mut len)?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER_BYTES {
        return Err(Error::invalid(
            name,
            format!(
                "header length {n} is over the {MAX_HEADER_BYTES}-byte limit (corrupt or not a safetensors file)"
            ),
        ));
    }
    if 8 + n > file.size {
        return Err(Error::invalid(
            name,
            format!(
                "header length {n} runs past the end of the file ({} bytes): truncated or corrupt",
                file.size
            ),
        ));
    }
    let mut json = vec![0u8; n as usize];
    file.read_at(8, &mut json)?;
    parse_header_json(name, &json, 8 + n, file.size)
}

/// Parses header JSON of a file whose data starts at `data_start` and which is `file_size` long.
pub fn parse_header_json(
    name: &str,
    json: &[u8],
    data_start: u64,
    file_size: u64,
) -> Result<Header> {
    let value: Value = serde_json::from_slice(json)
        .map_err(|e| Error::invalid(name, format!("malformed safetensors header JSON: {e}")))?;
    let Value::Object(map) = value else {
        return Err(Error::invalid(
            name,
            "safetensors header is not a JSON object",
        ));
    };
    let mut entries = Vec::with_capacity(map.len());
    let mut metadata = BTreeMap::new();
    for (key, v) in map {
        if key == "__metadata__" {
            let Value::Object(m) = v else {
                return Err(Error::invalid(name, "`__metadata__` is not a JSON object"));
            };
            for (k, v) in m {
                match v {
                    Value::String(s) => {
                        metadata.insert(k, s);
                    }
                    _ => {
                        return Err(Error::invalid(
                            name,
                            format!("`__metadata__.{k}` is not a string"),
                        ));
                    }
                }
            }
            continue;
        }
        entries.push(parse_entry(name, &key, &v, data_start)?);
    }
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut pos = data_start;
    for e in &entries {
        if e.begin < pos {
            return Err(Error::tensor(
                name,
                &e.name,
                format!(
                    "data_offsets overlap the previous tensor (starts at {}, previous ends at {})",
                    e.begin - data_start,
                    pos - data_start
                ),
            ));
        }
        if e.begin > pos {
            return Err(Error::tensor(
                name,
                &e.name,
                format!(
                    "hole in the data before this tensor (bytes {}..{})",
                    pos - data_start,
                    e.begin - data_start
                ),
            ));
        }
        pos = e.end;
        if e.end > file_size {
            return Err(Error::tensor(
                name,
                &e.name,
                format!(
                    "data_offsets end at {} but the file has only {} data bytes: truncated or offsets out of range",
                    e.end - data_start,
                    file_size.saturating_sub(data_start)
                ),
            ));
        }
    }
    if pos != file_size {
        return Err(Error::invalid(
            name,
            format!(
                "the data section holds {} bytes but the tensors use {}: trailing bytes or a truncated file",
                file_size - data_start,
                pos - data_start
            ),
        ));
    }
    Ok(Header {
        entries,
        metadata,
        data_start,
    })
}

fn parse_entry(file: &str, key: &str, v: &Value, data_start: u64) -> Result<Entry> {
    let bad = |why: &str| Error::tensor(file, key, why.to_string());
    let obj = v
        .as_object()
        .ok_or_else(|| bad("entry is not a JSON object"))?;
    let dtype_s = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("missing `dtype`"))?;
    let dtype = Dtype::from_safetensors_name(dtype_s)
        .ok_or_else(|| bad(&format!("unknown dtype `{dtype_s}`")))?;
    let shape = u64_list(obj.get("shape"))
        .ok_or_else(|| bad("`shape` is not a list of non-negative integers"))?;
    let offs = u64_list(obj.get("data_offsets"))
        .filter(|o| o.len() == 2)
        .ok_or_else(|| bad("`data_offsets` is not [begin, end]"))?;
    let (b, e) = (offs[0], offs[1]);
    if b > e {
        return Err(bad(&format!(
            "data_offsets [{b}, {e}] end before they begin"
        )));
    }
    let n = numel(&shape)
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .ok_or_else(|| bad("shape overflows"))?;
    if e - b != n {
        return Err(bad(&format!(
            "data_offsets [{b}, {e}] hold {} bytes but shape {shape:?} of {dtype} needs {n}",
            e - b
        )));
    }
    let begin = data_start
        .checked_add(b)
        .ok_or_else(|| bad("offset overflows"))?;
    let end = data_start
        .checked_add(e)
        .ok_or_else(|| bad("offset overflows"))?;
    Ok(Entry {
        name: key.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

fn u64_list(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_array()?.iter().map(Value::as_u64).collect()
}

/// One tensor of a header being written: name, dtype, shape (data follows in the given order).
#[derive(Debug, Clone)]
pub struct OutEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// Builds a header for `entries` stored back to back in that order; returns the full prefix
/// (length + JSON padded with spaces to a multiple of 8) and each entry's offset in the data.
pub fn build_header(
    entries: &[OutEntry],
    metadata: &BTreeMap<String, String>,
) -> (Vec<u8>, Vec<u64>) {
    let mut map = Map::new();
    if !metadata.is_empty() {
        let m: Map<String, Value> = metadata
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        map.insert("__metadata__".into(), Value::Object(m));
    }
    let mut offsets = Vec::with_capacity(entries.len());
    let mut pos = 0u64;
    for e in entries {
        let n = numel(&e.shape).unwrap_or(0) * e.dtype.size() as u64;
        offsets.push(pos);
        let mut obj = Map::new();
        obj.insert(
            "dtype".into(),
            Value::String(e.dtype.safetensors_name().into()),
        );
        obj.insert("shape".into(), Value::from(e.shape.clone()));
        obj.insert("data_offsets".into(), Value::from(vec![pos, pos + n]));
        map.insert(e.name.clone(), Value::Object(obj));
        pos += n;
    }
    let mut json = serde_json::to_vec(&Value::Object(map)).expect("header JSON");
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    (out, offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, dtype: Dtype, shape: &[u64]) -> OutEntry {
        OutEntry {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn header_round_trips() {
        let e = vec![
            entry("b", Dtype::BF16, &[2, 3]),
            entry("a", Dtype::I64, &[4]),
        ];
        let mut md = BTreeMap::new();
        md.insert("format".to_string(), "pt".to_string());
        let (prefix, offs) = build_header(&e, &md);
        assert_eq!(prefix.len() % 8, 0);
        assert_eq!(offs, vec![0, 12]);
        let n = prefix.len() as u64;
        let h = parse_header_json("f", &prefix[8..], n, n + 12 + 32).unwrap();
        assert_eq!(h.metadata["format"], "pt");
        assert_eq!(h.entries[0].name, "b");
        assert_eq!(h.entries[1].begin, n + 12);
    }

    #[test]
    fn rejects_overlaps_holes_and_bad_lengths() {
        let j = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        let err = parse_header_json("f.safetensors", j, 8, 8 + 12)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("f.safetensors") && err.contains("`b`") && err.contains("overlap"),
            "{err}"
        );
        // (header JSON, data start, file size, what the error says)
        let bad: [(&[u8], u64, u64, &str); 5] = [
            (
                br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#,
                8,
                8 + 20,
                "hole",
            ),
            (br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, 8, 16, "needs 12"),
            (br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 8, 12, "truncated"),
            (br#"{"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}"#, 8, 16, "unknown dtype"),
            (b"{\"a\":", 8, 16, "malformed"),
        ];
        for (json, start, size, says) in bad {
            let err = parse_header_json("f", json, start, size)
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{err}");
        }
    }
}
