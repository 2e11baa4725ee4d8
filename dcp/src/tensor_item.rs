//! One DCP tensor item: a complete `torch.save(tensor)` zip.
//!
//! `data.pkl` is, at protocol 2,
//! `torch._utils._rebuild_tensor_v2(persistent_load(("storage", torch.<Type>Storage, "0",
//! "cpu", numel)), storage_offset, size, stride, requires_grad, collections.OrderedDict())`,
//! and the storage's raw bytes are the record `data/0`. DCP saves each chunk as its own tensor,
//! so the storage usually holds exactly the chunk, but torch.save keeps the whole storage of a
//! view (and a transposed chunk keeps its strides), so reading gathers through the strides.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use super::pickle::{self, Global, Limits, Object, PickleError, Protocol, Value};
use super::source::ReadAt;
use super::torch_zip::{TorchZip, ZipError, ZipRecord, check_crc};
use crate::Dtype;

/// Why an item could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ItemError {
    #[error(transparent)]
    Zip(#[from] ZipError),
    #[error("data.pkl: {0}")]
    Pickle(#[from] PickleError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

fn invalid(msg: impl Into<String>) -> ItemError {
    ItemError::Invalid(msg.into())
}

/// Largest `data.pkl` accepted (a tensor's is ~150 bytes; bytes items hold user objects).
const MAX_DATA_PKL: u64 = 256 << 20;

/// Where a tensor item's values are and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorItemLayout {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Element strides into the storage.
    pub stride: Vec<u64>,
    /// Element offset of the tensor's first value in the storage.
    pub storage_offset: u64,
    /// Elements in the storage.
    pub storage_numel: u64,
    /// The storage record (`data/<key>`) inside the item.
    pub storage: ZipRecord,
    /// `byteorder` record says `big`.
    pub big_endian: bool,
}

impl TensorItemLayout {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }

    /// The item-relative byte range of the values when they are stored row-major, contiguous and
    /// little-endian, so callers can copy them without decoding (`None` otherwise).
    pub fn contiguous_range(&self) -> Option<(u64, u64)> {
        if self.big_endian || !is_contiguous(&self.shape, &self.stride) {
            return None;
        }
        let es = self.dtype.size() as u64;
        Some((
            self.storage.data_offset + self.storage_offset * es,
            self.nbytes(),
        ))
    }

    /// Like [`TensorItemLayout::read_data`] on a whole in-memory item, reusing its buffer when
    /// the values are stored contiguously (no second allocation).
    pub fn take_data(&self, mut item: Vec<u8>) -> Result<Vec<u8>, ItemError> {
        let whole_storage = self.storage_offset == 0 && self.numel() == self.storage_numel;
        match self.contiguous_range() {
            Some((start, len)) if self.numel() > 0 => {
                let end = start
                    .checked_add(len)
                    .filter(|e| *e <= item.len() as u64)
                    .ok_or_else(|| invalid("tensor data runs past the end of the item"))?;
                if whole_storage {
                    check_crc(&self.storage, &item[start as usize..end as usize])?;
                }
                item.truncate(end as usize);
                item.drain(..start as usize);
                Ok(item)
            }
            _ => self.read_data(&item),
        }
    }

    /// Reads the values as contiguous little-endian bytes (gathering strided views).
    pub fn read_data<S: ReadAt + ?Sized>(&self, src: &S) -> Result<Vec<u8>, ItemError> {
        let es = self.dtype.size() as u64;
        let numel = self.numel();
        if numel == 0 {
            return Ok(Vec::new());
        }
        let whole_storage = self.storage_offset == 0 && numel == self.storage_numel;
        let mut out = if let Some((offset, len)) = self.contiguous_range() {
            let data = src.read_vec(offset, len)?;
            if whole_storage {
                check_crc(&self.storage, &data)?;
            }
            data
        } else {
            // Read the span of the storage the view touches, then gather.
            let last: u64 = self.storage_offset
                + self
                    .shape
                    .iter()
                    .zip(&self.stride)
                    .map(|(s, st)| (s - 1) * st)
                    .sum::<u64>();
            let span_start = self.storage_offset * es;
            let span = src.read_vec(
                self.storage.data_offset + span_start,
                (last + 1) * es - span_start,
            )?;
            gather(&span, &self.shape, &self.stride, es as usize)
        };
        if self.big_endian && es > 1 {
            for v in out.chunks_exact_mut(es as usize) {
                v.reverse();
            }
        }
        Ok(out)
    }
}

/// Row-major contiguity (dimensions of size 1 may have any stride).
pub fn is_contiguous(shape: &[u64], stride: &[u64]) -> bool {
    let mut expected = 1u64;
    for (s, st) in shape.iter().zip(stride).rev() {
        if *s != 1 && *st != expected {
            return false;
        }
        expected *= s;
    }
    true
}

/// Row-major strides of `shape`.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// Copies a strided view (`span` starts at the view's first element) into row-major order.
fn gather(span: &[u8], shape: &[u64], stride: &[u64], es: usize) -> Vec<u8> {
    let numel: u64 = shape.iter().product();
    let mut out = Vec::with_capacity(numel as usize * es);
    let ndim = shape.len();
    let mut idx = vec![0u64; ndim];
    loop {
        let off: u64 = idx.iter().zip(stride).map(|(i, s)| i * s).sum();
        let at = off as usize * es;
        out.extend_from_slice(&span[at..at + es]);
        // Advance the multi-index, last dimension fastest.
        let mut d = ndim;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

fn as_u64s(v: &Value, what: &str) -> Result<Vec<u64>, ItemError> {
    let items = v
        .as_seq()
        .or_else(|| {
            // torch.Size(...) pickles as a REDUCE of a tuple.
            v.as_object()
                .filter(|o| o.class == Global::TORCH_SIZE)
                .and_then(|o| o.args.first())
                .and_then(|a| a.as_seq())
        })
        .ok_or_else(|| invalid(format!("{what} is a {}, not a tuple", v.kind())))?;
    items
        .iter()
        .map(|i| {
            i.as_int()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| invalid(format!("{what} holds a non-integer or negative value")))
        })
        .collect()
}

/// Parses a tensor item's zip and `data.pkl` (reads only the directory and small records).
pub fn parse_tensor_item<S: ReadAt + ?Sized>(src: &S) -> Result<TensorItemLayout, ItemError> {
    let zip = TorchZip::parse(src)?;
    let pkl = zip.read_record(src, "data.pkl", MAX_DATA_PKL)?;
    let value = pickle::unpickle_with_limits(&pkl, &Limits::default())?;
    let big_endian = match zip.record("byteorder") {
        None => false,
        Some(_) => match zip.read_record(src, "byteorder", 16)?.as_slice() {
            b"little" => false,
            b"big" => true,
            other => {
                return Err(invalid(format!(
                    "unknown byteorder `{}`",
                    String::from_utf8_lossy(other)
                )));
            }
        },
    };
    let mut obj = value
        .as_object()
        .ok_or_else(|| invalid(format!("data.pkl holds a {}, not a tensor", value.kind())))?;
    // nn.Parameter: _rebuild_parameter(tensor, requires_grad, hooks).
    if obj.class == Global::REBUILD_PARAMETER {
        obj = obj
            .args
            .first()
            .and_then(|t| t.as_object())
            .ok_or_else(|| invalid("_rebuild_parameter without a tensor"))?;
    }
    if obj.class != Global::REBUILD_TENSOR_V2 {
        return Err(invalid(format!(
            "data.pkl builds `{}`, not a tensor (_rebuild_tensor_v2)",
            obj.class
        )));
    }
    if obj.args.len() < 4 {
        return Err(invalid("_rebuild_tensor_v2 with fewer than 4 arguments"));
    }
    let Value::PersistentId(pid) = &obj.args[0] else {
        return Err(invalid("tensor without a storage reference"));
    };
    let pid = pid
        .as_seq()
        .filter(|p| p.len() == 5 && p[0].as_str() == Some("storage"))
        .ok_or_else(|| {
            invalid("storage reference is not ('storage', type, key, location, numel)")
        })?;
    let dtype = match &pid[1] {
        Value::Global(g) => g.storage_dtype(),
        _ => None,
    }
    .ok_or_else(|| invalid("storage type is not a torch storage class"))?;
    let key = pid[2]
        .as_str()
        .ok_or_else(|| invalid("storage key is not a string"))?;
    let storage_numel = pid[4]
        .as_int()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| invalid("storage numel is not a non-negative integer"))?;
    let storage_offset = obj.args[1]
        .as_int()
        .and_then(|n| u64::try_from(n).ok())
        .ok_or_else(|| invalid("storage offset is not a non-negative integer"))?;
    let shape = as_u64s(&obj.args[2], "size")?;
    let stride = as_u64s(&obj.args[3], "stride")?;
    if shape.len() != stride.len() {
        return Err(invalid(format!(
            "size has {} dimensions but stride has {}",
            shape.len(),
            stride.len()
        )));
    }
    let storage = zip
        .record(&format!("data/{key}"))
        .cloned()
        .ok_or_else(|| ZipError::MissingRecord(format!("{}/data/{key}", zip.prefix)))?;
    let es = dtype.size() as u64;
    if storage_numel.checked_mul(es) != Some(storage.size) {
        return Err(invalid(format!(
            "storage record has {} bytes but {storage_numel} {} elements need {}",
            storage.size,
            dtype.torch_name(),
            storage_numel.saturating_mul(es)
        )));
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |a, s| a.checked_mul(*s))
        .ok_or_else(|| invalid("tensor size overflows"))?;
    if numel > 0 {
        let last = shape
            .iter()
            .zip(&stride)
            .try_fold(storage_offset, |a, (s, st)| {
                (s - 1).checked_mul(*st).and_then(|x| a.checked_add(x))
            })
            .ok_or_else(|| invalid("tensor view overflows"))?;
        if last >= storage_numel {
            return Err(invalid(format!(
                "tensor view (offset {storage_offset}, size {shape:?}, stride {stride:?}) reaches \
                 element {last} of a {storage_numel}-element storage"
            )));
        }
    }
    Ok(TensorItemLayout {
        dtype,
        shape,
        stride,
        storage_offset,
        storage_numel,
        storage,
        big_endian,
    })
}

/// Unpickles the Python object of a torch.save zip holding no tensors (a DCP bytes item such
/// as a step counter or a list), with the allow-list.
pub fn decode_torch_save_object<S: ReadAt + ?Sized>(src: &S) -> Result<Value, ItemError> {
    let zip = TorchZip::parse(src)?;
    let pkl = zip.read_record(src, "data.pkl", MAX_DATA_PKL)?;
    Ok(pickle::unpickle(&pkl)?)
}

/// The `data.pkl` torch.save writes for a contiguous CPU tensor.
pub fn tensor_data_pkl(dtype: Dtype, shape: &[u64]) -> Vec<u8> {
    let numel: u64 = shape.iter().product();
    let ints = |v: &[u64]| Value::Tuple(v.iter().map(|&x| Value::Int(x as i64)).collect());
    let storage = Value::PersistentId(Box::new(Value::Tuple(vec![
        Value::str("storage"),
        Value::Global(Global::storage_for_dtype(dtype)),
        Value::str("0"),
        Value::str("cpu"),
        Value::Int(numel as i64),
    ])));
    let value = Value::Object(Box::new(Object::reduce(
        Global::REBUILD_TENSOR_V2,
        vec![
            storage,
            Value::Int(0),
            ints(shape),
            ints(&contiguous_strides(shape)),
            Value::Bool(false),
            Value::Object(Box::new(Object::reduce(Global::ORDERED_DICT, vec![]))),
        ],
    )));
    pickle::pickle(&value, Protocol::TORCH_SAVE)
}

/// A 40-digit id like the one torch records in `.data/serialization_id` (unique per process
/// and call; torch.load only reports it).
fn serialization_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mix =
        (nanos ^ (std::process::id() as u64).rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    format!("{:020}{:020}", mix % 10u64.pow(19), n)
}

/// Writes `torch.save(tensor)` for a contiguous little-endian tensor, in torch's record order;
/// returns the stream and the number of bytes written.
pub fn write_tensor_item<W: Write>(
    out: W,
    dtype: Dtype,
    shape: &[u64],
    data: &[u8],
) -> io::Result<(W, u64)> {
    let numel: u64 = shape.iter().product();
    if numel * dtype.size() as u64 != data.len() as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} bytes given for a {shape:?} {} tensor that needs {}",
                data.len(),
                dtype.torch_name(),
                numel * dtype.size() as u64
            ),
        ));
    }
    let mut z = super::torch_zip::ZipWriter::new(out, "archive");
    z.add_record("data.pkl", &tensor_data_pkl(dtype, shape))?;
    z.add_record(".format_version", b"1")?;
    z.add_record(".storage_alignment", b"64")?;
    z.add_record("byteorder", b"little")?;
    z.add_record("data/0", data)?;
    z.add_record("version", b"3\n")?;
    z.add_record(".data/serialization_id", serialization_id().as_bytes())?;
    z.finish()
}

/// Writes `torch.save(obj)` for a plain Python object (a DCP bytes item payload).
pub fn write_object_item<W: Write>(out: W, value: &Value) -> io::Result<(W, u64)> {
    let mut z = super::torch_zip::ZipWriter::new(out, "archive");
    z.add_record("data.pkl", &pickle::pickle(value, Protocol::TORCH_SAVE))?;
    z.add_record(".format_version", b"1")?;
    z.add_record(".storage_alignment", b"64")?;
    z.add_record("byteorder", b"little")?;
    z.add_record("version", b"3\n")?;
    z.add_record(".data/serialization_id", serialization_id().as_bytes())?;
    z.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_items_round_trip() {
        let data: Vec<u8> = (0..24u8).collect();
        let (bytes, n) = write_tensor_item(Vec::new(), Dtype::F32, &[2, 3], &data).unwrap();
        assert_eq!(n as usize, bytes.len());
        let layout = parse_tensor_item(&bytes).unwrap();
        assert_eq!(layout.dtype, Dtype::F32);
        assert_eq!(layout.shape, vec![2, 3]);
        assert_eq!(layout.stride, vec![3, 1]);
        assert_eq!(layout.read_data(&bytes).unwrap(), data);
        assert!(write_tensor_item(Vec::new(), Dtype::F32, &[2, 2], &data).is_err());
    }

    #[test]
    fn scalar_and_empty_tensors() {
        let (bytes, _) =
            write_tensor_item(Vec::new(), Dtype::I64, &[], &7i64.to_le_bytes()).unwrap();
        let l = parse_tensor_item(&bytes).unwrap();
        assert_eq!(l.shape, Vec::<u64>::new());
        assert_eq!(l.read_data(&bytes).unwrap(), 7i64.to_le_bytes());
        let (bytes, _) = write_tensor_item(Vec::new(), Dtype::BF16, &[0, 4], &[]).unwrap();
        assert_eq!(
            parse_tensor_item(&bytes)
                .unwrap()
                .read_data(&bytes)
                .unwrap(),
            Vec::<u8>::new()
        );
    }

    #[test]
    fn gathers_strided_views() {
        // A 2x3 transposed view of a 3x2 storage: element (i, j) at j*2 + i.
        let span: Vec<u8> = (0..6u8).collect();
        assert_eq!(gather(&span, &[2, 3], &[1, 2], 1), vec![0, 2, 4, 1, 3, 5]);
        assert!(is_contiguous(&[2, 1, 3], &[3, 99, 1]));
        assert!(!is_contiguous(&[2, 3], &[1, 2]));
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    }

    #[test]
    fn object_items_round_trip() {
        let v = Value::List(vec![
            Value::Int(1),
            Value::str("x"),
            Value::Bytes(vec![1, 2]),
        ]);
        let (bytes, _) = write_object_item(Vec::new(), &v).unwrap();
        assert_eq!(decode_torch_save_object(&bytes).unwrap(), v);
    }
}
