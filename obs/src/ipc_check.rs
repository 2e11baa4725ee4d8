//! Checks one Arrow IPC stream message before it is handed to arrow's decoder.
//!
//! arrow's IPC reader trusts the message header: a buffer whose offset or length points
//! past the message body panics inside arrow-buffer (`the offset of the new Buffer cannot
//! exceed the existing length`), and a compressed buffer's declared length is allocated
//! before it is decompressed (a flipped high bit asks for exabytes). A journal damaged on
//! disk must cost the damaged batch, not the process, so every message is framed and its
//! header verified here first: the flatbuffer (with the flatbuffers verifier), the message
//! type, and every buffer and compressed length against the body and fixed limits.

use arrow_ipc::{CompressionType, MessageHeader, MetadataVersion, root_as_message};

/// Largest message header accepted (a record batch of our schema needs a few KB).
const MAX_METADATA: usize = 64 << 20;
/// Largest message body accepted: far above one flush interval of a busy rank.
const MAX_BODY: i64 = 4 << 30;
/// Largest decompressed buffer accepted (it is allocated before decompression).
const MAX_DECOMPRESSED: i64 = 1 << 30;
/// Largest row or value count accepted in a field node.
const MAX_LENGTH: i64 = 1 << 32;

/// What the bytes at the start of a buffer hold.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message {
    /// Not all of the message is there yet (a writer mid-append, or a torn tail).
    Incomplete,
    /// A well-formed message of `len` bytes (prefix, header and body).
    Complete { len: usize, kind: MessageKind },
    /// The end-of-stream marker.
    End { len: usize },
    /// Not a message that can be decoded safely; what is wrong with it.
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MessageKind {
    Schema,
    /// A dictionary batch for dictionary id `id`.
    Dictionary {
        id: i64,
    },
    /// A record batch of `rows` rows.
    Batch {
        rows: i64,
    },
}

fn word(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

/// Frames and checks the message at the start of `buf`.
pub(crate) fn next_message(buf: &[u8]) -> Message {
    let Some(first) = word(buf, 0) else {
        return Message::Incomplete;
    };
    // A continuation marker then the header length (format >= 0.15), or the length alone.
    let (prefix, meta_len) = if first == 0xFFFF_FFFF {
        match word(buf, 4) {
            Some(n) => (8, n as usize),
            None => return Message::Incomplete,
        }
    } else {
        (4, first as usize)
    };
    if meta_len == 0 {
        return Message::End { len: prefix };
    }
    if meta_len > MAX_METADATA {
        return Message::Invalid(format!(
            "a message header of {meta_len} bytes (at most {MAX_METADATA} expected)"
        ));
    }
    let Some(meta) = buf.get(prefix..prefix + meta_len) else {
        return Message::Incomplete;
    };
    let message = match root_as_message(meta) {
        Ok(m) => m,
        Err(e) => return Message::Invalid(format!("unreadable message header ({e})")),
    };
    if !matches!(message.version(), MetadataVersion::V4 | MetadataVersion::V5) {
        return Message::Invalid(format!(
            "unsupported metadata version {:?}",
            message.version()
        ));
    }
    let body = message.bodyLength();
    if !(0..=MAX_BODY).contains(&body) {
        return Message::Invalid(format!("a message body of {body} bytes"));
    }
    let len = prefix + meta_len + body as usize;
    let (kind, batch) = match message.header_type() {
        MessageHeader::Schema => {
            if message.header_as_schema().is_none() || body != 0 {
                return Message::Invalid("a schema message with a body or no schema".into());
            }
            (MessageKind::Schema, None)
        }
        MessageHeader::DictionaryBatch => match message.header_as_dictionary_batch() {
            Some(d) => match d.data() {
                Some(b) => (MessageKind::Dictionary { id: d.id() }, Some(b)),
                None => return Message::Invalid("a dictionary batch without data".into()),
            },
            None => return Message::Invalid("a dictionary message without its header".into()),
        },
        MessageHeader::RecordBatch => match message.header_as_record_batch() {
            Some(b) => (MessageKind::Batch { rows: b.length() }, Some(b)),
            None => return Message::Invalid("a record batch message without its header".into()),
        },
        other => return Message::Invalid(format!("unexpected message type {other:?}")),
    };
    let Some(bytes) = buf.get(..len) else {
        return Message::Incomplete;
    };
    if let Some(batch) = batch
        && let Err(e) = check_batch(&batch, &bytes[prefix + meta_len..])
    {
        return Message::Invalid(e);
    }
    Message::Complete { len, kind }
}

/// Every length, buffer and compressed size of a record (or dictionary) batch against `body`.
fn check_batch(batch: &arrow_ipc::RecordBatch<'_>, body: &[u8]) -> Result<(), String> {
    let rows = batch.length();
    if !(0..=MAX_LENGTH).contains(&rows) {
        return Err(format!("a batch of {rows} rows"));
    }
    for node in batch.nodes().iter().flatten() {
        let (n, nulls) = (node.length(), node.null_count());
        if !(0..=MAX_LENGTH).contains(&n) || !(0..=n).contains(&nulls) {
            return Err(format!("a column of {n} values with {nulls} nulls"));
        }
    }
    let compressed = match batch.compression() {
        None => false,
        Some(c)
            if matches!(
                c.codec(),
                CompressionType::ZSTD | CompressionType::LZ4_FRAME
            ) =>
        {
            true
        }
        Some(c) => return Err(format!("unknown compression {:?}", c.codec())),
    };
    for b in batch.buffers().iter().flatten() {
        let (offset, length) = (b.offset(), b.length());
        let end = offset.checked_add(length);
        // The format puts every buffer at a multiple of 8 (arrow-rs writes 64).
        if offset % 8 != 0 {
            return Err(format!("a buffer at the unaligned offset {offset}"));
        }
        if offset < 0 || length < 0 || end.is_none_or(|e| e as u64 > body.len() as u64) {
            return Err(format!(
                "a buffer at {offset}+{length} outside the {}-byte body",
                body.len()
            ));
        }
        if compressed && length > 0 {
            // Each compressed buffer starts with its decompressed length (-1: stored as is).
            let at = offset as usize;
            let Some(prefix) = body.get(at..at + 8) else {
                return Err(format!("a compressed buffer of {length} bytes"));
            };
            let n = i64::from_le_bytes(prefix.try_into().expect("8 bytes"));
            if n != -1 && !(0..=MAX_DECOMPRESSED).contains(&n) {
                return Err(format!("a buffer that decompresses to {n} bytes"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::RecordBatch;
    use arrow_array::{Int64Array, StringArray};
    use arrow_ipc::writer::{IpcWriteOptions, StreamWriter};
    use arrow_schema::{DataType, Field, Schema};
    use std::sync::Arc;

    fn stream() -> Vec<u8> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from_iter_values(0..100)),
                Arc::new(StringArray::from_iter(
                    (0..100).map(|i| Some(i.to_string())),
                )),
            ],
        )
        .unwrap();
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(CompressionType::ZSTD))
            .unwrap();
        let mut w = StreamWriter::try_new_with_options(Vec::new(), &schema, options).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        w.into_inner().unwrap()
    }

    #[test]
    fn frames_a_stream_message_by_message() {
        let s = stream();
        let Message::Complete { len: a, kind } = next_message(&s) else {
            panic!()
        };
        assert_eq!(kind, MessageKind::Schema);
        let Message::Complete { len: b, kind } = next_message(&s[a..]) else {
            panic!()
        };
        assert_eq!(kind, MessageKind::Batch { rows: 100 });
        assert_eq!(next_message(&s[a + b..]), Message::End { len: 8 });
        for cut in [0, 3, 7, a + 9, a + b - 1] {
            assert_eq!(next_message(&s[cut.min(a)..cut]), Message::Incomplete);
        }
    }

    #[test]
    fn a_buffer_past_the_body_or_a_huge_length_is_invalid() {
        let s = stream();
        let Message::Complete { len: a, .. } = next_message(&s) else {
            panic!()
        };
        let Message::Complete { len: b, .. } = next_message(&s[a..]) else {
            panic!()
        };
        // Every single-bit flip of the batch message is either still valid, invalid, or
        // incomplete (a length grown past the data): never a panic here.
        let mut invalid = 0;
        for i in a..a + b {
            for bit in 0..8 {
                let mut m = s[a..a + b].to_vec();
                m[i - a] ^= 1 << bit;
                if matches!(next_message(&m), Message::Invalid(_)) {
                    invalid += 1;
                }
            }
        }
        assert!(invalid > 0);
        // Body shorter than a buffer says.
        let mut short = s[a..a + b].to_vec();
        let body_len_at = short.len() - 1;
        short.truncate(body_len_at);
        assert_eq!(next_message(&short), Message::Incomplete);
    }
}
