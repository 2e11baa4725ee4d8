//! Stream transforms of DCP items (`_extensions=[ZStandard()]` -> `"stream.zstd/1"`).
//!
//! torch 2.13 wraps each item's output stream in `zstandard.ZstdCompressor().stream_writer`
//! (level 3, one frame, no content size in the header) and records the descriptor list in
//! `_StorageInfo.transform_descriptors`; without extensions the field is absent from the pickle
//! (its `__getstate__` drops `None` fields), not an empty list. Bytes items are transformed too.

use std::io::{self, Read, Write};

/// One stream transform, as named by a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    /// `stream.zstd/1`.
    Zstd,
}

impl Transform {
    /// The descriptor torch writes for this transform.
    pub fn descriptor(self) -> &'static str {
        match self {
            Transform::Zstd => "stream.zstd/1",
        }
    }

    /// Parses `name/version` as torch's `ExtensionRegistry` does (major version must be 1).
    pub fn from_descriptor(desc: &str) -> Result<Transform, String> {
        let (name, version) = desc.split_once('/').unwrap_or((desc, ""));
        match name {
            "stream.zstd" if version.split('.').next() == Some("1") => Ok(Transform::Zstd),
            "stream.zstd" => Err(format!("unsupported zstd transform version `{version}`")),
            _ => Err(format!(
                "unknown stream transform `{desc}` (only `stream.zstd/1` is supported)"
            )),
        }
    }
}

/// Parses a descriptor list (absent = no transforms).
pub fn parse_descriptors(descriptors: Option<&[String]>) -> Result<Vec<Transform>, String> {
    descriptors
        .unwrap_or(&[])
        .iter()
        .map(|d| Transform::from_descriptor(d))
        .collect()
}

/// Undoes `transforms` (in descriptor order, as torch's reader applies them) on `data`,
/// refusing output larger than `limit` bytes.
pub fn decode(data: &[u8], transforms: &[Transform], limit: u64) -> io::Result<Vec<u8>> {
    decode_with_hint(data, transforms, limit, 0)
}

/// [`decode`] with the expected output size, to allocate the output once.
pub fn decode_with_hint(
    data: &[u8],
    transforms: &[Transform],
    limit: u64,
    size_hint: u64,
) -> io::Result<Vec<u8>> {
    let mut current: Vec<u8> = Vec::new();
    let mut input: &[u8] = data;
    for t in transforms {
        let next = match t {
            Transform::Zstd => {
                let mut out = Vec::with_capacity(size_hint.min(limit).saturating_add(1) as usize);
                // `&[u8]` is already buffered: no extra copy through a BufReader.
                let decoder = zstd::stream::read::Decoder::with_buffer(input)?;
                // Read at most limit + 1 bytes so oversized output is detected, never allocated.
                decoder
                    .take(limit.saturating_add(1))
                    .read_to_end(&mut out)?;
                if out.len() as u64 > limit {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("zstd item decompresses to more than {limit} bytes"),
                    ));
                }
                out
            }
        };
        current = next;
        input = &current;
    }
    if transforms.is_empty() {
        return Ok(data.to_vec());
    }
    Ok(current)
}

/// A writer that applies `transforms` before bytes reach `out`; `finish` flushes the last
/// frame and returns `out`.
pub enum Encoder<W: Write> {
    Plain(W),
    Zstd(zstd::stream::write::Encoder<'static, W>),
}

impl<W: Write> Encoder<W> {
    /// Wraps `out`; `zstd_level` is `Some(level)` for `stream.zstd/1` (torch uses 3).
    pub fn new(out: W, zstd_level: Option<i32>) -> io::Result<Self> {
        Ok(match zstd_level {
            None => Encoder::Plain(out),
            Some(level) => Encoder::Zstd(zstd::stream::write::Encoder::new(out, level)?),
        })
    }

    pub fn finish(self) -> io::Result<W> {
        match self {
            Encoder::Plain(w) => Ok(w),
            Encoder::Zstd(e) => e.finish(),
        }
    }
}

impl<W: Write> Write for Encoder<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Encoder::Plain(w) => w.write(buf),
            Encoder::Zstd(e) => e.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Encoder::Plain(w) => w.flush(),
            Encoder::Zstd(e) => e.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_parse_like_torch() {
        assert_eq!(
            Transform::from_descriptor("stream.zstd/1"),
            Ok(Transform::Zstd)
        );
        assert_eq!(
            Transform::from_descriptor("stream.zstd/1.3"),
            Ok(Transform::Zstd)
        );
        assert!(Transform::from_descriptor("stream.zstd/2").is_err());
        assert!(Transform::from_descriptor("stream.gzip/1").is_err());
        assert_eq!(parse_descriptors(None), Ok(vec![]));
    }

    #[test]
    fn zstd_round_trip_and_limit() {
        let data = vec![42u8; 100_000];
        let mut e = Encoder::new(Vec::new(), Some(3)).unwrap();
        e.write_all(&data).unwrap();
        let z = e.finish().unwrap();
        assert!(z.len() < 1000);
        assert_eq!(decode(&z, &[Transform::Zstd], 100_000).unwrap(), data);
        assert!(decode(&z, &[Transform::Zstd], 99_999).is_err());
        assert!(decode(&z[..z.len() / 2], &[Transform::Zstd], 100_000).is_err());
        assert!(decode(b"not zstd at all", &[Transform::Zstd], 100).is_err());
    }
}
