//! The zip container of `torch.save` (PyTorchStreamWriter over miniz), read and written.
//!
//! What torch 2.13 writes, byte for byte (found by dumping real DCP items):
//! * records in this order: `archive/data.pkl`, `archive/.format_version` (`1`),
//!   `archive/.storage_alignment` (`64`), `archive/byteorder` (`little`), `archive/data/0`...,
//!   `archive/version` (`3\n`), `archive/.data/serialization_id` (40 decimal digits);
//! * every record stored (method 0), flags `0x0808` (UTF-8 names + data descriptor), DOS time and
//!   date 0, version fields 0; the local header carries crc/sizes 0 and is followed by the data
//!   and a data descriptor `PK\x07\x08 crc csize usize` (64-bit sizes when the record or its
//!   offset reach 4 GiB);
//! * each local header's extra field ends with a `FB` field of `Z` padding that puts the record's
//!   data at a multiple of 64 bytes (after a zip64 extra field when one is needed);
//! * a zip64 end-of-central-directory record and locator are always written, then the classic one.
//!
//! The reader follows the central directory (zip64 aware), never trusts local sizes (they are 0),
//! and bounds-checks every offset against the source length.

use std::io::{self, Write};

use super::source::ReadAt;

/// Why a zip container was refused.
#[derive(Debug, thiserror::Error)]
pub enum ZipError {
    #[error("not a torch.save zip: {0}")]
    Malformed(String),
    #[error("record `{0}` is missing from the torch.save zip")]
    MissingRecord(String),
    #[error(
        "record `{name}` is compressed (method {method}); torch.save stores records uncompressed"
    )]
    Compressed { name: String, method: u16 },
    #[error("record `{name}` is corrupt: CRC32 {actual:08x} != {expected:08x}")]
    Crc {
        name: String,
        expected: u32,
        actual: u32,
    },
    #[error("record `{name}` has {size} bytes, more than the limit of {limit}")]
    TooLarge { name: String, size: u64, limit: u64 },
    #[error("reading the zip: {0}")]
    Io(#[from] io::Error),
}

/// One stored record: where its bytes are inside the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZipRecord {
    /// Full name, e.g. `archive/data/0`.
    pub name: String,
    /// Offset of the first data byte in the source.
    pub data_offset: u64,
    pub size: u64,
    pub crc32: u32,
}

/// The directory of a torch.save zip.
#[derive(Debug, Clone)]
pub struct TorchZip {
    /// The archive folder every record lives in (`archive` for DCP items).
    pub prefix: String,
    pub records: Vec<ZipRecord>,
}

const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const U32_MAX: u64 = 0xFFFF_FFFF;
/// A torch.save zip has a handful of records per storage; this bounds the directory we parse.
const MAX_RECORDS: u64 = 1 << 20;
const MAX_CENTRAL_DIR: u64 = 256 << 20;

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn bad(msg: impl Into<String>) -> ZipError {
    ZipError::Malformed(msg.into())
}

impl TorchZip {
    /// Parses the directory of the zip in `src`.
    pub fn parse<S: ReadAt + ?Sized>(src: &S) -> Result<TorchZip, ZipError> {
        let len = src.size();
        if len < 22 {
            return Err(bad(format!(
                "{len} bytes is too short for a zip (truncated?)"
            )));
        }
        // The end-of-central-directory record is within the last 22 + 65535 bytes.
        let tail_len = len.min(22 + 0xFFFF);
        let tail = src.read_vec(len - tail_len, tail_len)?;
        let eocd_at = (0..=tail.len() - 22)
            .rev()
            .find(|&i| {
                le32(&tail, i) == EOCD_SIG && i + 22 + le16(&tail, i + 20) as usize <= tail.len()
            })
            .ok_or_else(|| bad("no end-of-central-directory record (truncated file?)"))?;
        let eocd_pos = len - tail_len + eocd_at as u64;
        let e = &tail[eocd_at..eocd_at + 22];
        let mut entries = le16(e, 10) as u64;
        let mut cd_size = le32(e, 12) as u64;
        let mut cd_offset = le32(e, 16) as u64;

        // torch always writes the zip64 records; use them when present.
        if eocd_pos >= 20 {
            let loc = src.read_vec(eocd_pos - 20, 20)?;
            if le32(&loc, 0) == ZIP64_LOCATOR_SIG {
                let z64_pos = le64(&loc, 8);
                if z64_pos
                    .checked_add(56)
                    .is_none_or(|end| end > eocd_pos - 20)
                {
                    return Err(bad("zip64 end-of-central-directory offset out of range"));
                }
                let z = src.read_vec(z64_pos, 56)?;
                if le32(&z, 0) != ZIP64_EOCD_SIG {
                    return Err(bad("bad zip64 end-of-central-directory signature"));
                }
                entries = le64(&z, 32);
                cd_size = le64(&z, 40);
                cd_offset = le64(&z, 48);
            }
        }
        if entries > MAX_RECORDS || cd_size > MAX_CENTRAL_DIR {
            return Err(bad(format!(
                "central directory of {entries} records / {cd_size} bytes is implausible"
            )));
        }
        if cd_offset
            .checked_add(cd_size)
            .is_none_or(|end| end > eocd_pos)
        {
            return Err(bad("central directory lies outside the file (truncated?)"));
        }
        let cd = src.read_vec(cd_offset, cd_size)?;
        let mut records = Vec::with_capacity(entries as usize);
        let mut at = 0usize;
        for _ in 0..entries {
            if at + 46 > cd.len() || le32(&cd, at) != CENTRAL_SIG {
                return Err(bad(
                    "central directory entry is cut short or has a bad signature",
                ));
            }
            let method = le16(&cd, at + 10);
            let crc32 = le32(&cd, at + 16);
            let mut csize = le32(&cd, at + 20) as u64;
            let mut usize_ = le32(&cd, at + 24) as u64;
            let name_len = le16(&cd, at + 28) as usize;
            let extra_len = le16(&cd, at + 30) as usize;
            let comment_len = le16(&cd, at + 32) as usize;
            let mut local_offset = le32(&cd, at + 42) as u64;
            let end = at + 46 + name_len + extra_len + comment_len;
            if end > cd.len() {
                return Err(bad("central directory entry runs past the directory"));
            }
            let name = std::str::from_utf8(&cd[at + 46..at + 46 + name_len])
                .map_err(|_| bad("record name is not UTF-8"))?
                .to_string();
            // zip64 extended information: the 8-byte fields present are those set to 0xFFFFFFFF.
            let mut extra = &cd[at + 46 + name_len..at + 46 + name_len + extra_len];
            while extra.len() >= 4 {
                let id = le16(extra, 0);
                let n = le16(extra, 2) as usize;
                if 4 + n > extra.len() {
                    return Err(bad(format!("extra field of `{name}` is cut short")));
                }
                if id == 1 {
                    let mut f = &extra[4..4 + n];
                    for field in [&mut usize_, &mut csize, &mut local_offset] {
                        if *field == U32_MAX {
                            if f.len() < 8 {
                                return Err(bad(format!("zip64 field of `{name}` is cut short")));
                            }
                            *field = le64(f, 0);
                            f = &f[8..];
                        }
                    }
                }
                extra = &extra[4 + n..];
            }
            at = end;

            if method != 0 {
                return Err(ZipError::Compressed { name, method });
            }
            if csize != usize_ {
                return Err(bad(format!("stored record `{name}` has different sizes")));
            }
            if local_offset.checked_add(30).is_none_or(|e| e > len) {
                return Err(bad(format!("local header of `{name}` is outside the file")));
            }
            let lh = src.read_vec(local_offset, 30)?;
            if le32(&lh, 0) != LOCAL_SIG {
                return Err(bad(format!("local header of `{name}` has a bad signature")));
            }
            let data_offset = local_offset + 30 + le16(&lh, 26) as u64 + le16(&lh, 28) as u64;
            if data_offset.checked_add(usize_).is_none_or(|e| e > len) {
                return Err(bad(format!(
                    "record `{name}` ({usize_} bytes at {data_offset}) runs past the end of the \
                     {len}-byte item (truncated?)"
                )));
            }
            records.push(ZipRecord {
                name,
                data_offset,
                size: usize_,
                crc32,
            });
        }
        let prefix = records
            .first()
            .and_then(|r| r.name.split_once('/'))
            .map(|(p, _)| p.to_string())
            .ok_or_else(|| bad("no records in an archive folder"))?;
        Ok(TorchZip { prefix, records })
    }

    /// The record `{prefix}/{name}` (`name` like `data.pkl` or `data/0`).
    pub fn record(&self, name: &str) -> Option<&ZipRecord> {
        let full_len = self.prefix.len() + 1 + name.len();
        self.records.iter().find(|r| {
            r.name.len() == full_len
                && r.name.starts_with(&self.prefix)
                && r.name.as_bytes()[self.prefix.len()] == b'/'
                && r.name.ends_with(name)
        })
    }

    /// Reads a whole record (at most `limit` bytes) and checks its CRC.
    pub fn read_record<S: ReadAt + ?Sized>(
        &self,
        src: &S,
        name: &str,
        limit: u64,
    ) -> Result<Vec<u8>, ZipError> {
        let r = self
            .record(name)
            .ok_or_else(|| ZipError::MissingRecord(format!("{}/{name}", self.prefix)))?;
        if r.size > limit {
            return Err(ZipError::TooLarge {
                name: r.name.clone(),
                size: r.size,
                limit,
            });
        }
        let data = src.read_vec(r.data_offset, r.size)?;
        check_crc(r, &data)?;
        Ok(data)
    }
}

/// Checks `data` (the whole record) against the CRC32 in the directory.
pub fn check_crc(r: &ZipRecord, data: &[u8]) -> Result<(), ZipError> {
    let actual = crc32fast::hash(data);
    if actual != r.crc32 {
        return Err(ZipError::Crc {
            name: r.name.clone(),
            expected: r.crc32,
            actual,
        });
    }
    Ok(())
}

/// Writes a torch.save-style zip to a stream, one record at a time.
pub struct ZipWriter<W: Write> {
    out: W,
    pos: u64,
    prefix: String,
    central: Vec<CentralEntry>,
}

struct CentralEntry {
    name: String,
    crc32: u32,
    size: u64,
    local_offset: u64,
}

const ALIGNMENT: u64 = 64;

impl<W: Write> ZipWriter<W> {
    /// A writer whose records live in the folder `prefix` (torch uses `archive`).
    pub fn new(out: W, prefix: &str) -> Self {
        ZipWriter {
            out,
            pos: 0,
            prefix: prefix.to_string(),
            central: Vec::new(),
        }
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Appends the record `{prefix}/{name}` holding `data`.
    pub fn add_record(&mut self, name: &str, data: &[u8]) -> io::Result<()> {
        let full = format!("{}/{}", self.prefix, name);
        let size = data.len() as u64;
        let offset = self.pos;
        let big = size >= U32_MAX || offset >= U32_MAX;

        // zip64 extra in the local header (miniz writes it when the size or offset is large).
        let mut zip64 = Vec::new();
        if big {
            let mut fields = Vec::new();
            if size >= U32_MAX {
                fields.extend_from_slice(&size.to_le_bytes());
                fields.extend_from_slice(&size.to_le_bytes());
            }
            if offset >= U32_MAX {
                fields.extend_from_slice(&offset.to_le_bytes());
            }
            zip64.extend_from_slice(&1u16.to_le_bytes());
            zip64.extend_from_slice(&(fields.len() as u16).to_le_bytes());
            zip64.extend_from_slice(&fields);
        }
        // `FB` padding so the data starts at a multiple of 64 (torch's getPadding).
        let start = offset + 30 + full.len() as u64 + zip64.len() as u64 + 4;
        let pad = (ALIGNMENT - start % ALIGNMENT) % ALIGNMENT;
        let extra_len = zip64.len() + 4 + pad as usize;

        let mut h = Vec::with_capacity(30 + full.len() + extra_len);
        h.extend_from_slice(&LOCAL_SIG.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // version needed
        h.extend_from_slice(&0x0808u16.to_le_bytes()); // UTF-8 + data descriptor
        h.extend_from_slice(&[0u8; 2 + 2 + 2 + 4 + 4 + 4]); // method, time, date, crc, sizes
        h.extend_from_slice(&(full.len() as u16).to_le_bytes());
        h.extend_from_slice(&(extra_len as u16).to_le_bytes());
        h.extend_from_slice(full.as_bytes());
        h.extend_from_slice(&zip64);
        h.extend_from_slice(b"FB");
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad as usize, b'Z');
        self.put(&h)?;

        let crc32 = crc32fast::hash(data);
        self.put(data)?;

        let mut d = Vec::with_capacity(24);
        d.extend_from_slice(&DESCRIPTOR_SIG.to_le_bytes());
        d.extend_from_slice(&crc32.to_le_bytes());
        if big {
            d.extend_from_slice(&size.to_le_bytes());
            d.extend_from_slice(&size.to_le_bytes());
        } else {
            d.extend_from_slice(&(size as u32).to_le_bytes());
            d.extend_from_slice(&(size as u32).to_le_bytes());
        }
        self.put(&d)?;
        self.central.push(CentralEntry {
            name: full,
            crc32,
            size,
            local_offset: offset,
        });
        Ok(())
    }

    /// Writes the central directory and end records; returns the stream and the zip's length.
    pub fn finish(mut self) -> io::Result<(W, u64)> {
        let cd_offset = self.pos;
        let entries = std::mem::take(&mut self.central);
        for e in &entries {
            let mut fields = Vec::new();
            if e.size >= U32_MAX {
                fields.extend_from_slice(&e.size.to_le_bytes());
                fields.extend_from_slice(&e.size.to_le_bytes());
            }
            if e.local_offset >= U32_MAX {
                fields.extend_from_slice(&e.local_offset.to_le_bytes());
            }
            let mut h = Vec::with_capacity(46 + e.name.len() + 28);
            h.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // version made by
            h.extend_from_slice(&0u16.to_le_bytes()); // version needed
            h.extend_from_slice(&0x0808u16.to_le_bytes());
            h.extend_from_slice(&[0u8; 6]); // method, time, date
            h.extend_from_slice(&e.crc32.to_le_bytes());
            let size32 = e.size.min(U32_MAX) as u32;
            h.extend_from_slice(&size32.to_le_bytes());
            h.extend_from_slice(&size32.to_le_bytes());
            h.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            let extra_len = if fields.is_empty() {
                0
            } else {
                4 + fields.len()
            };
            h.extend_from_slice(&(extra_len as u16).to_le_bytes());
            h.extend_from_slice(&[0u8; 2 + 2 + 2 + 4]); // comment, disk, int attr, ext attr
            h.extend_from_slice(&(e.local_offset.min(U32_MAX) as u32).to_le_bytes());
            h.extend_from_slice(e.name.as_bytes());
            if !fields.is_empty() {
                h.extend_from_slice(&1u16.to_le_bytes());
                h.extend_from_slice(&(fields.len() as u16).to_le_bytes());
                h.extend_from_slice(&fields);
            }
            self.put(&h)?;
        }
        let cd_size = self.pos - cd_offset;
        let n = entries.len() as u64;
        let z64_offset = self.pos;
        let mut z = Vec::with_capacity(56 + 20 + 22);
        z.extend_from_slice(&ZIP64_EOCD_SIG.to_le_bytes());
        z.extend_from_slice(&44u64.to_le_bytes());
        z.extend_from_slice(&0x031eu16.to_le_bytes()); // made by (as miniz)
        z.extend_from_slice(&0x002du16.to_le_bytes()); // needed: 4.5
        z.extend_from_slice(&[0u8; 8]); // disk numbers
        z.extend_from_slice(&n.to_le_bytes());
        z.extend_from_slice(&n.to_le_bytes());
        z.extend_from_slice(&cd_size.to_le_bytes());
        z.extend_from_slice(&cd_offset.to_le_bytes());
        z.extend_from_slice(&ZIP64_LOCATOR_SIG.to_le_bytes());
        z.extend_from_slice(&0u32.to_le_bytes());
        z.extend_from_slice(&z64_offset.to_le_bytes());
        z.extend_from_slice(&1u32.to_le_bytes());
        z.extend_from_slice(&EOCD_SIG.to_le_bytes());
        z.extend_from_slice(&[0u8; 4]); // disk numbers
        let n16 = n.min(0xFFFF) as u16;
        z.extend_from_slice(&n16.to_le_bytes());
        z.extend_from_slice(&n16.to_le_bytes());
        z.extend_from_slice(&(cd_size.min(U32_MAX) as u32).to_le_bytes());
        z.extend_from_slice(&(cd_offset.min(U32_MAX) as u32).to_le_bytes());
        z.extend_from_slice(&0u16.to_le_bytes());
        self.put(&z)?;
        Ok((self.out, self.pos))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_aligned_records_and_reads_them_back() {
        let mut w = ZipWriter::new(Vec::new(), "archive");
        w.add_record("data.pkl", b"pickle").unwrap();
        w.add_record("data/0", &[7u8; 100]).unwrap();
        let (bytes, len) = w.finish().unwrap();
        assert_eq!(len as usize, bytes.len());
        let z = TorchZip::parse(&bytes).unwrap();
        assert_eq!(z.prefix, "archive");
        let d = z.record("data/0").unwrap();
        assert_eq!(d.data_offset % 64, 0);
        assert_eq!(
            z.read_record(&bytes, "data/0", 1000).unwrap(),
            vec![7u8; 100]
        );
        assert_eq!(z.read_record(&bytes, "data.pkl", 1000).unwrap(), b"pickle");
        assert!(matches!(
            z.read_record(&bytes, "data/1", 1000),
            Err(ZipError::MissingRecord(_))
        ));
    }

    #[test]
    fn corrupt_and_truncated_zips_are_errors() {
        let mut w = ZipWriter::new(Vec::new(), "archive");
        w.add_record("data/0", &[1u8; 64]).unwrap();
        let (mut bytes, _) = w.finish().unwrap();
        for cut in [0, 10, 64, bytes.len() / 2, bytes.len() - 1] {
            assert!(TorchZip::parse(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let z = TorchZip::parse(&bytes).unwrap();
        let at = z.record("data/0").unwrap().data_offset as usize;
        bytes[at] ^= 0xff;
        assert!(matches!(
            z.read_record(&bytes, "data/0", 1000),
            Err(ZipError::Crc { .. })
        ));
    }
}
