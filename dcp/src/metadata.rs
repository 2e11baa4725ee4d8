//! The typed model of DCP's `.metadata` pickle, parsed from and written to [`Value`]s.
//!
//! Layout torch 2.13 writes (`pickle.dump`, protocol 4): a `Metadata` instance (NEWOBJ + BUILD of
//! a dict) with `state_dict_metadata` (fqn -> `TensorStorageMetadata` | `BytesStorageMetadata`),
//! `planner_data` (fqn -> tuple of the nested state-dict keys, strings or list indices),
//! `storage_data` (`MetadataIndex` -> `_StorageInfo`), `storage_meta` (`StorageMeta` whose
//! `checkpoint_id` is a `pathlib.PosixPath`) and `version` (`"1.0.0"`). `MetadataIndex`'s state
//! is `{fqn, index, offset}` for tensor chunks and `{fqn, index: None}` (no `offset` key) for
//! bytes items; `BytesStorageMetadata` has no BUILD at all; `TensorProperties` has a 5-tuple state
//! `(dtype, layout, requires_grad, memory_format, pin_memory)`. torch 2.15 appends `strides` (a
//! tuple of ints or None) to make a 6-tuple; torch 2.13 unpacks exactly five fields, so titan
//! writes the 5-tuple both versions read, and reads 5, 6 or more (later fields ignored).

use super::pickle::{Global, Object, Value};
use crate::Dtype;

/// A parsed `.metadata`.
#[derive(Debug, Clone, PartialEq)]
pub struct Metadata {
    /// Every saved item by fully qualified name, in file order.
    pub state_dict_metadata: Vec<(String, ItemMetadata)>,
    pub planner_data: PlannerData,
    /// Where each tensor chunk / bytes item is stored, in file order.
    pub storage_data: Vec<(MetadataIndex, StorageInfo)>,
    pub storage_meta: Option<StorageMeta>,
    pub version: Option<String>,
}

/// What one fqn holds.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemMetadata {
    Tensor(TensorStorageMetadata),
    /// A non-tensor value, torch.save'd into a bytes item.
    Bytes,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorStorageMetadata {
    pub properties: TensorProperties,
    /// Global shape.
    pub size: Vec<u64>,
    pub chunks: Vec<ChunkStorageMetadata>,
}

/// `TensorProperties`; only `dtype` matters to readers (the rest is deprecated in torch).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorProperties {
    pub dtype: Dtype,
    pub requires_grad: bool,
    pub pin_memory: bool,
    pub memory_format: MemoryFormat,
    /// torch 2.15's `strides` of the saved tensor (None in older files and when torch stored
    /// None). Informational: each item's own torch.save record carries the strides readers use.
    pub strides: Option<Vec<u64>>,
}

impl TensorProperties {
    pub fn new(dtype: Dtype) -> Self {
        TensorProperties {
            dtype,
            requires_grad: false,
            pin_memory: false,
            memory_format: MemoryFormat::Contiguous,
            strides: None,
        }
    }
}

/// `_MEM_FORMAT_ENCODING`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryFormat {
    Contiguous = 0,
    ChannelsLast = 1,
    Preserve = 2,
}

/// One saved piece of a tensor: the box `offsets .. offsets + sizes` of the global tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChunkStorageMetadata {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

impl ChunkStorageMetadata {
    pub fn numel(&self) -> u64 {
        self.sizes.iter().product()
    }
}

/// The key of `storage_data`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MetadataIndex {
    pub fqn: String,
    /// The chunk's offsets for tensors, `None` for bytes items.
    pub offset: Option<Vec<u64>>,
    /// Position of the chunk in `chunks` (a lookup hint).
    pub index: Option<u64>,
}

/// Where an item's bytes are: `relative_path[offset .. offset + length]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageInfo {
    pub relative_path: String,
    pub offset: u64,
    pub length: u64,
    /// `Some(["stream.zstd/1"])` with the zstd extension; absent (`None`) without.
    pub transform_descriptors: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct StorageMeta {
    pub checkpoint_id: Option<CheckpointId>,
    pub save_id: Option<String>,
    pub load_id: Option<String>,
    pub modules: Vec<String>,
}

/// `StorageMeta.checkpoint_id`: a string or a `pathlib` path (kept as its parts).
#[derive(Debug, Clone, PartialEq)]
pub enum CheckpointId {
    Str(String),
    Path { class: Global, parts: Vec<String> },
}

/// `Metadata.planner_data`.
#[derive(Debug, Clone, PartialEq)]
pub enum PlannerData {
    None,
    /// DefaultSavePlanner's flattening map: fqn -> the keys leading to it in the nested state dict.
    Flatten(Vec<(String, Vec<PathPart>)>),
    /// Anything a custom planner stored.
    Other(Value),
}

/// One step of a nested state-dict path: a dict key or a list index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathPart {
    Key(String),
    Index(i64),
}

/// Why `.metadata` does not describe a DCP checkpoint.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MetadataError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, MetadataError> {
    Err(MetadataError(msg.into()))
}

fn object<'a>(v: &'a Value, class: Global, what: &str) -> Result<&'a Object, MetadataError> {
    match v.as_object() {
        Some(o) if o.class == class => Ok(o),
        Some(o) => err(format!("{what} is a `{}`, expected `{class}`", o.class)),
        None => err(format!("{what} is a {}, expected `{class}`", v.kind())),
    }
}

fn attr<'a>(o: &'a Object, name: &str) -> Option<&'a Value> {
    o.attr(name).filter(|v| !matches!(v, Value::None))
}

fn u64s(v: &Value, what: &str) -> Result<Vec<u64>, MetadataError> {
    let items = match v {
        Value::Object(o) if o.class == Global::TORCH_SIZE => {
            o.args.first().and_then(|a| a.as_seq())
        }
        other => other.as_seq(),
    };
    let Some(items) = items else {
        return err(format!("{what} is a {}, expected torch.Size", v.kind()));
    };
    items
        .iter()
        .map(|i| {
            i.as_int()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or_else(|| {
                    MetadataError(format!("{what} holds a negative or non-integer value"))
                })
        })
        .collect()
}

fn u64_of(v: Option<&Value>, what: &str) -> Result<u64, MetadataError> {
    v.and_then(|v| v.as_int())
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| MetadataError(format!("{what} is missing or not a non-negative integer")))
}

fn opt_str(v: Option<&Value>, what: &str) -> Result<Option<String>, MetadataError> {
    match v {
        None | Some(Value::None) => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s.clone())),
        Some(other) => err(format!("{what} is a {}, expected str", other.kind())),
    }
}

impl Metadata {
    /// Interprets an unpickled `.metadata`.
    pub fn from_value(v: &Value) -> Result<Metadata, MetadataError> {
        let root = object(v, Global::METADATA, "the .metadata root")?;
        let Some(Value::Dict(sdm)) = root.attr("state_dict_metadata") else {
            return err("Metadata.state_dict_metadata is missing or not a dict");
        };
        let mut state_dict_metadata = Vec::with_capacity(sdm.len());
        for (k, v) in sdm {
            let fqn = k
                .as_str()
                .ok_or_else(|| MetadataError("a state_dict_metadata key is not a string".into()))?;
            let item =
                parse_item(v).map_err(|e| MetadataError(format!("tensor `{fqn}`: {}", e.0)))?;
            state_dict_metadata.push((fqn.to_string(), item));
        }
        let planner_data = match root.attr("planner_data") {
            None | Some(Value::None) => PlannerData::None,
            Some(v) => parse_planner_data(v).unwrap_or_else(|| PlannerData::Other(v.clone())),
        };
        let storage_data = match root.attr("storage_data") {
            Some(Value::Dict(items)) => items
                .iter()
                .map(|(k, v)| {
                    let index = parse_index(k)?;
                    let info = parse_storage_info(v).map_err(|e| {
                        MetadataError(format!("storage of `{}`: {}", index.fqn, e.0))
                    })?;
                    Ok((index, info))
                })
                .collect::<Result<Vec<_>, MetadataError>>()?,
            Some(other) => {
                return err(format!(
                    "Metadata.storage_data is a {} (not a FileSystemWriter checkpoint?)",
                    other.kind()
                ));
            }
            None => return err("Metadata.storage_data is missing"),
        };
        let storage_meta = match root.attr("storage_meta") {
            None | Some(Value::None) => None,
            Some(v) => Some(parse_storage_meta(v)?),
        };
        let version = opt_str(root.attr("version"), "Metadata.version")?;
        let md = Metadata {
            state_dict_metadata,
            planner_data,
            storage_data,
            storage_meta,
            version,
        };
        md.check_shapes()?;
        Ok(md)
    }

    /// Every chunk has the tensor's rank and lies inside the tensor.
    fn check_shapes(&self) -> Result<(), MetadataError> {
        for (fqn, item) in &self.state_dict_metadata {
            let ItemMetadata::Tensor(t) = item else {
                continue;
            };
            for (i, c) in t.chunks.iter().enumerate() {
                if c.offsets.len() != t.size.len() || c.sizes.len() != t.size.len() {
                    return err(format!(
                        "tensor `{fqn}`: chunk {i} has {}/{} dims, the tensor has {}",
                        c.offsets.len(),
                        c.sizes.len(),
                        t.size.len()
                    ));
                }
                for d in 0..t.size.len() {
                    if c.offsets[d]
                        .checked_add(c.sizes[d])
                        .is_none_or(|e| e > t.size[d])
                    {
                        return err(format!(
                            "tensor `{fqn}`: chunk {i} (offsets {:?}, sizes {:?}) lies outside the \
                             tensor's size {:?}",
                            c.offsets, c.sizes, t.size
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The item metadata of `fqn`.
    pub fn item(&self, fqn: &str) -> Option<&ItemMetadata> {
        self.state_dict_metadata
            .iter()
            .find(|(k, _)| k == fqn)
            .map(|(_, v)| v)
    }

    /// The `Value` tree torch's unpickler turns into this `Metadata`.
    pub fn to_value(&self) -> Value {
        let s = |x: &str| Value::Str(x.to_string());
        let dict = |pairs: Vec<(&str, Value)>| {
            Value::Dict(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
        };
        let obj = |class: Global, state: Value| {
            Value::Object(Box::new(Object::new_with_state(class, state)))
        };
        let size = |v: &[u64]| {
            Value::Object(Box::new(Object::reduce(
                Global::TORCH_SIZE,
                vec![Value::Tuple(
                    v.iter().map(|&x| Value::Int(x as i64)).collect(),
                )],
            )))
        };
        let sdm = self
            .state_dict_metadata
            .iter()
            .map(|(fqn, item)| {
                let v = match item {
                    ItemMetadata::Bytes => Value::Object(Box::new(Object {
                        state: None,
                        ..Object::new_with_state(Global::BYTES_STORAGE_METADATA, Value::None)
                    })),
                    ItemMetadata::Tensor(t) => {
                        let p = &t.properties;
                        let props = obj(
                            Global::TENSOR_PROPERTIES,
                            Value::Tuple(vec![
                                Value::Global(Global::for_dtype(p.dtype)),
                                Value::Global(Global::TORCH_STRIDED),
                                Value::Bool(p.requires_grad),
                                Value::Object(Box::new(Object::reduce(
                                    Global::MEM_FORMAT_ENCODING,
                                    vec![Value::Int(p.memory_format as i64)],
                                ))),
                                Value::Bool(p.pin_memory),
                            ]),
                        );
                        let chunks = t
                            .chunks
                            .iter()
                            .map(|c| {
                                obj(
                                    Global::CHUNK_STORAGE_METADATA,
                                    dict(vec![
                                        ("offsets", size(&c.offsets)),
                                        ("sizes", size(&c.sizes)),
                                    ]),
                                )
                            })
                            .collect();
                        obj(
                            Global::TENSOR_STORAGE_METADATA,
                            dict(vec![
                                ("properties", props),
                                ("size", size(&t.size)),
                                ("chunks", Value::List(chunks)),
                            ]),
                        )
                    }
                };
                (s(fqn), v)
            })
            .collect();
        let planner = match &self.planner_data {
            PlannerData::None => Value::None,
            PlannerData::Other(v) => v.clone(),
            PlannerData::Flatten(map) => Value::Dict(
                map.iter()
                    .map(|(fqn, path)| {
                        let parts = path
                            .iter()
                            .map(|p| match p {
                                PathPart::Key(k) => s(k),
                                PathPart::Index(i) => Value::Int(*i),
                            })
                            .collect();
                        (s(fqn), Value::Tuple(parts))
                    })
                    .collect(),
            ),
        };
        let storage = self
            .storage_data
            .iter()
            .map(|(idx, info)| {
                let mut key = vec![
                    ("fqn", s(&idx.fqn)),
                    (
                        "index",
                        idx.index.map_or(Value::None, |i| Value::Int(i as i64)),
                    ),
                ];
                if let Some(off) = &idx.offset {
                    key.push(("offset", size(off)));
                }
                let mut val = vec![
                    ("relative_path", s(&info.relative_path)),
                    ("offset", Value::Int(info.offset as i64)),
                    ("length", Value::Int(info.length as i64)),
                ];
                if let Some(t) = &info.transform_descriptors {
                    val.push((
                        "transform_descriptors",
                        Value::List(t.iter().map(|x| s(x)).collect()),
                    ));
                }
                (
                    obj(Global::METADATA_INDEX, dict(key)),
                    obj(Global::STORAGE_INFO, dict(val)),
                )
            })
            .collect();
        let storage_meta = match &self.storage_meta {
            None => Value::None,
            Some(m) => obj(
                Global::STORAGE_META,
                dict(vec![
                    (
                        "checkpoint_id",
                        match &m.checkpoint_id {
                            None => Value::None,
                            Some(CheckpointId::Str(x)) => s(x),
                            Some(CheckpointId::Path { class, parts }) => Value::Object(Box::new(
                                Object::reduce(*class, parts.iter().map(|x| s(x)).collect()),
                            )),
                        },
                    ),
                    ("save_id", m.save_id.as_deref().map_or(Value::None, s)),
                    ("load_id", m.load_id.as_deref().map_or(Value::None, s)),
                    (
                        "modules",
                        Value::List(m.modules.iter().map(|x| s(x)).collect()),
                    ),
                ]),
            ),
        };
        obj(
            Global::METADATA,
            dict(vec![
                ("state_dict_metadata", Value::Dict(sdm)),
                ("planner_data", planner),
                ("storage_data", Value::Dict(storage)),
                ("storage_meta", storage_meta),
                ("version", self.version.as_deref().map_or(Value::None, s)),
            ]),
        )
    }
}

fn parse_item(v: &Value) -> Result<ItemMetadata, MetadataError> {
    let o = v
        .as_object()
        .ok_or_else(|| MetadataError(format!("metadata is a {}", v.kind())))?;
    if o.class == Global::BYTES_STORAGE_METADATA {
        return Ok(ItemMetadata::Bytes);
    }
    if o.class != Global::TENSOR_STORAGE_METADATA {
        return err(format!("metadata is a `{}`", o.class));
    }
    let props = attr(o, "properties").ok_or_else(|| MetadataError("no properties".into()))?;
    let properties = parse_properties(props)?;
    let size = u64s(attr(o, "size").unwrap_or(&Value::None), "size")?;
    let Some(Value::List(chunks)) = attr(o, "chunks") else {
        return err("chunks is missing or not a list");
    };
    let chunks = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let c = object(c, Global::CHUNK_STORAGE_METADATA, &format!("chunk {i}"))?;
            Ok(ChunkStorageMetadata {
                offsets: u64s(attr(c, "offsets").unwrap_or(&Value::None), "chunk offsets")?,
                sizes: u64s(attr(c, "sizes").unwrap_or(&Value::None), "chunk sizes")?,
            })
        })
        .collect::<Result<Vec<_>, MetadataError>>()?;
    Ok(ItemMetadata::Tensor(TensorStorageMetadata {
        properties,
        size,
        chunks,
    }))
}

fn parse_properties(v: &Value) -> Result<TensorProperties, MetadataError> {
    let o = object(v, Global::TENSOR_PROPERTIES, "properties")?;
    // torch 2.x pickles a tuple via __getstate__: 5 fields up to torch 2.14, 6 (`strides`
    // appended) from 2.15; fields a later torch appends are ignored. Older files may carry the
    // attribute dict.
    let none = Value::None;
    let (dtype, requires_grad, mem, pin, strides) = match &o.state {
        Some(Value::Tuple(t)) if t.len() >= 5 => {
            (&t[0], &t[2], &t[3], &t[4], t.get(5).unwrap_or(&none))
        }
        Some(Value::Tuple(t)) => {
            return err(format!(
                "TensorProperties state is a {}-tuple, expected (dtype, layout, requires_grad, \
                 memory_format, pin_memory[, strides])",
                t.len()
            ));
        }
        Some(Value::Dict(_)) => (
            o.attr("dtype").unwrap_or(&Value::None),
            o.attr("requires_grad").unwrap_or(&Value::Bool(false)),
            o.attr("memory_format").unwrap_or(&Value::None),
            o.attr("pin_memory").unwrap_or(&Value::Bool(false)),
            o.attr("strides").unwrap_or(&Value::None),
        ),
        Some(other) => {
            return err(format!(
                "TensorProperties state is a {}, expected a tuple",
                other.kind()
            ));
        }
        None => return err("TensorProperties has no state"),
    };
    let dtype = match dtype {
        Value::Global(g) => g.dtype().ok_or_else(|| {
            MetadataError(format!(
                "dtype `{g}` is not supported (no complex or quantized types)"
            ))
        })?,
        other => return err(format!("dtype is a {}", other.kind())),
    };
    let memory_format = match mem
        .as_object()
        .filter(|o| o.class == Global::MEM_FORMAT_ENCODING)
        .and_then(|o| o.args.first())
        .and_then(|a| a.as_int())
    {
        Some(1) => MemoryFormat::ChannelsLast,
        Some(2) => MemoryFormat::Preserve,
        _ => MemoryFormat::Contiguous,
    };
    let strides = match strides {
        Value::None => None,
        v => Some(u64s(v, "TensorProperties.strides")?),
    };
    Ok(TensorProperties {
        dtype,
        requires_grad: requires_grad.as_bool().unwrap_or(false),
        pin_memory: pin.as_bool().unwrap_or(false),
        memory_format,
        strides,
    })
}

fn parse_index(v: &Value) -> Result<MetadataIndex, MetadataError> {
    let o = object(v, Global::METADATA_INDEX, "a storage_data key")?;
    let fqn = opt_str(o.attr("fqn"), "MetadataIndex.fqn")?
        .ok_or_else(|| MetadataError("MetadataIndex without fqn".into()))?;
    let offset = match attr(o, "offset") {
        None => None,
        Some(v) => Some(u64s(v, &format!("offset of `{fqn}`"))?),
    };
    let index = match attr(o, "index") {
        None => None,
        Some(v) => Some(u64_of(Some(v), &format!("index of `{fqn}`"))?),
    };
    Ok(MetadataIndex { fqn, offset, index })
}

fn parse_storage_info(v: &Value) -> Result<StorageInfo, MetadataError> {
    let o = object(v, Global::STORAGE_INFO, "a storage_data value")?;
    let relative_path = opt_str(o.attr("relative_path"), "relative_path")?
        .ok_or_else(|| MetadataError("relative_path is missing".into()))?;
    let transform_descriptors = match attr(o, "transform_descriptors") {
        None => None,
        Some(v) => Some(
            v.as_seq()
                .ok_or_else(|| MetadataError("transform_descriptors is not a list".into()))?
                .iter()
                .map(|d| {
                    d.as_str().map(str::to_string).ok_or_else(|| {
                        MetadataError("a transform descriptor is not a string".into())
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    Ok(StorageInfo {
        relative_path,
        offset: u64_of(o.attr("offset"), "offset")?,
        length: u64_of(o.attr("length"), "length")?,
        transform_descriptors,
    })
}

fn parse_storage_meta(v: &Value) -> Result<StorageMeta, MetadataError> {
    let o = object(v, Global::STORAGE_META, "storage_meta")?;
    let checkpoint_id = match attr(o, "checkpoint_id") {
        None => None,
        Some(Value::Str(s)) => Some(CheckpointId::Str(s.clone())),
        Some(Value::Object(p)) if p.class.module == "pathlib" => Some(CheckpointId::Path {
            class: p.class,
            parts: p
                .args
                .iter()
                .map(|a| a.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| MetadataError("checkpoint_id path has a non-string part".into()))?,
        }),
        Some(other) => return err(format!("checkpoint_id is a {}", other.kind())),
    };
    let modules = match attr(o, "modules") {
        None => Vec::new(),
        Some(v) => v
            .as_seq()
            .map(|m| {
                m.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    };
    Ok(StorageMeta {
        checkpoint_id,
        save_id: opt_str(o.attr("save_id"), "save_id")?,
        load_id: opt_str(o.attr("load_id"), "load_id")?,
        modules,
    })
}

fn parse_planner_data(v: &Value) -> Option<PlannerData> {
    let Value::Dict(items) = v else { return None };
    let mut map = Vec::with_capacity(items.len());
    for (k, v) in items {
        let fqn = k.as_str()?.to_string();
        let parts = v
            .as_seq()?
            .iter()
            .map(|p| match p {
                Value::Str(s) => Some(PathPart::Key(s.clone())),
                Value::Int(i) => Some(PathPart::Index(*i)),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()?;
        map.push((fqn, parts));
    }
    Some(PlannerData::Flatten(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `TensorProperties` pickled with `fields` as its state tuple.
    fn props(fields: Vec<Value>) -> Value {
        Value::Object(Box::new(Object::new_with_state(
            Global::TENSOR_PROPERTIES,
            Value::Tuple(fields),
        )))
    }

    fn torch_2_13_fields() -> Vec<Value> {
        vec![
            Value::Global(Global::for_dtype(Dtype::BF16)),
            Value::Global(Global::TORCH_STRIDED),
            Value::Bool(false),
            Value::Object(Box::new(Object::reduce(
                Global::MEM_FORMAT_ENCODING,
                vec![Value::Int(0)],
            ))),
            Value::Bool(false),
        ]
    }

    #[test]
    fn tensor_properties_of_torch_2_13_2_15_and_later() {
        let p = parse_properties(&props(torch_2_13_fields())).unwrap();
        assert_eq!((p.dtype, p.strides), (Dtype::BF16, None));
        // torch 2.15: strides appended.
        let mut f = torch_2_13_fields();
        f.push(Value::Tuple(vec![Value::Int(3), Value::Int(1)]));
        assert_eq!(
            parse_properties(&props(f.clone())).unwrap().strides,
            Some(vec![3, 1])
        );
        let mut none = torch_2_13_fields();
        none.push(Value::None);
        assert_eq!(parse_properties(&props(none)).unwrap().strides, None);
        // A later torch's extra trailing field is ignored.
        f.push(Value::Str("future".into()));
        assert_eq!(parse_properties(&props(f)).unwrap().dtype, Dtype::BF16);
        // Malformed: too short, or strides that are not integers.
        let e = parse_properties(&props(torch_2_13_fields()[..4].to_vec())).unwrap_err();
        assert!(e.0.contains("4-tuple"), "{e}");
        let mut bad = torch_2_13_fields();
        bad.push(Value::Str("x".into()));
        assert!(parse_properties(&props(bad)).is_err());
    }
}
