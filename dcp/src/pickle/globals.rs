//! The allow-list of globals a checkpoint pickle may name.
//!
//! Found by writing checkpoints with torch 2.13 and disassembling them with `pickletools`:
//!
//! * `.metadata` (protocol 4, `STACK_GLOBAL`): the `torch.distributed.checkpoint.metadata`
//!   dataclasses, `torch.distributed.checkpoint.filesystem._StorageInfo`, `torch.Size`,
//!   `torch.<dtype>`, `pathlib.PosixPath` (the `checkpoint_id`), and two surprises:
//!   the layout is pickled as `torch.serialization._get_layout("torch.strided")` (a REDUCE with a
//!   string argument, not the global `torch.strided`), and the memory format as
//!   `_MEM_FORMAT_ENCODING(0)` (an `Enum` REDUCE), inside a 5-tuple `BUILD` state of
//!   `TensorProperties` (it has `__getstate__`, unlike the other dataclasses whose state is a dict).
//! * tensor items' `data.pkl` (protocol 2, `GLOBAL`): `torch._utils._rebuild_tensor_v2`,
//!   `torch.<Type>Storage` and `collections.OrderedDict` (the empty backward-hooks dict).
//! * bytes items' `data.pkl`: whatever the user's Python object needs; builtins only for `int`,
//!   `list`, `dict`, `str`; `_codecs.encode` for `bytes` at protocol 2.
//!
//! Anything else is refused: unpickling never imports or calls anything.

use crate::Dtype;

/// A global (`module.name`) from the allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Global {
    pub module: &'static str,
    pub name: &'static str,
}

const DCP_METADATA: &str = "torch.distributed.checkpoint.metadata";
const DCP_FILESYSTEM: &str = "torch.distributed.checkpoint.filesystem";

impl Global {
    pub const METADATA: Global = Global::new(DCP_METADATA, "Metadata");
    pub const TENSOR_STORAGE_METADATA: Global = Global::new(DCP_METADATA, "TensorStorageMetadata");
    pub const TENSOR_PROPERTIES: Global = Global::new(DCP_METADATA, "TensorProperties");
    pub const CHUNK_STORAGE_METADATA: Global = Global::new(DCP_METADATA, "ChunkStorageMetadata");
    pub const BYTES_STORAGE_METADATA: Global = Global::new(DCP_METADATA, "BytesStorageMetadata");
    pub const METADATA_INDEX: Global = Global::new(DCP_METADATA, "MetadataIndex");
    pub const STORAGE_META: Global = Global::new(DCP_METADATA, "StorageMeta");
    pub const MEM_FORMAT_ENCODING: Global = Global::new(DCP_METADATA, "_MEM_FORMAT_ENCODING");
    pub const STORAGE_INFO: Global = Global::new(DCP_FILESYSTEM, "_StorageInfo");
    pub const TORCH_SIZE: Global = Global::new("torch", "Size");
    pub const TORCH_DEVICE: Global = Global::new("torch", "device");
    pub const GET_LAYOUT: Global = Global::new("torch.serialization", "_get_layout");
    pub const REBUILD_TENSOR_V2: Global = Global::new("torch._utils", "_rebuild_tensor_v2");
    pub const REBUILD_PARAMETER: Global = Global::new("torch._utils", "_rebuild_parameter");
    pub const ORDERED_DICT: Global = Global::new("collections", "OrderedDict");
    pub const CODECS_ENCODE: Global = Global::new("_codecs", "encode");
    pub const BUILTIN_SET: Global = Global::new("builtins", "set");
    pub const BUILTIN_FROZENSET: Global = Global::new("builtins", "frozenset");
    pub const BUILTIN_BYTEARRAY: Global = Global::new("builtins", "bytearray");
    pub const POSIX_PATH: Global = Global::new("pathlib", "PosixPath");
    pub const TORCH_STRIDED: Global = Global::new("torch", "strided");

    pub const fn new(module: &'static str, name: &'static str) -> Global {
        Global { module, name }
    }

    /// Resolves `module.name` against the allow-list; `None` when it is not allowed.
    pub fn lookup(module: &str, name: &str) -> Option<Global> {
        if let Some(g) = FIXED.iter().find(|g| g.module == module && g.name == name) {
            return Some(*g);
        }
        if module == "torch" {
            if let Some(n) = TORCH_DTYPE_NAMES.iter().find(|n| **n == name) {
                return Some(Global::new("torch", n));
            }
            if let Some(d) = Dtype::ALL.iter().find(|d| d.torch_storage_name() == name) {
                return Some(Global::new("torch", d.torch_storage_name()));
            }
        }
        None
    }

    /// The dtype a `torch.<dtype>` global names (`None` for other globals and for torch dtypes
    /// titan does not handle, such as complex ones).
    pub fn dtype(&self) -> Option<Dtype> {
        (self.module == "torch")
            .then(|| Dtype::from_torch_name(self.name))
            .flatten()
    }

    /// Whether this is a `torch.<dtype>` global, handled or not.
    pub fn is_torch_dtype(&self) -> bool {
        self.module == "torch" && TORCH_DTYPE_NAMES.contains(&self.name)
    }

    /// The dtype of a `torch.<Type>Storage` class.
    pub fn storage_dtype(&self) -> Option<Dtype> {
        (self.module == "torch")
            .then(|| Dtype::from_torch_storage_name(self.name))
            .flatten()
    }

    /// The `torch.<dtype>` global of a dtype.
    pub fn for_dtype(dtype: Dtype) -> Global {
        Global::new("torch", dtype.torch_name())
    }

    /// The `torch.<Type>Storage` global of a dtype.
    pub fn storage_for_dtype(dtype: Dtype) -> Global {
        Global::new("torch", dtype.torch_storage_name())
    }

    /// A torch layout (`torch.strided`, ...), which pickles as `_get_layout("torch.<name>")`.
    pub fn is_layout(&self) -> bool {
        self.module == "torch" && LAYOUT_NAMES.contains(&self.name)
    }
}

impl std::fmt::Display for Global {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.module, self.name)
    }
}

const LAYOUT_NAMES: &[&str] = &[
    "strided",
    "sparse_coo",
    "sparse_csr",
    "sparse_csc",
    "sparse_bsr",
    "sparse_bsc",
    "_mkldnn",
    "jagged",
];

/// Every `torch.<dtype>` attribute torch 2.13 pickles by name.
const TORCH_DTYPE_NAMES: &[&str] = &[
    "float32",
    "float",
    "float64",
    "double",
    "float16",
    "half",
    "bfloat16",
    "uint8",
    "int8",
    "int16",
    "short",
    "int32",
    "int",
    "int64",
    "long",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex32",
    "complex64",
    "complex128",
    "cfloat",
    "cdouble",
    "chalf",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
];

/// The fixed part of the allow-list (dtypes and storage classes are matched by name above).
const FIXED: &[Global] = &[
    Global::METADATA,
    Global::TENSOR_STORAGE_METADATA,
    Global::TENSOR_PROPERTIES,
    Global::CHUNK_STORAGE_METADATA,
    Global::BYTES_STORAGE_METADATA,
    Global::METADATA_INDEX,
    Global::STORAGE_META,
    Global::MEM_FORMAT_ENCODING,
    Global::STORAGE_INFO,
    Global::TORCH_SIZE,
    Global::TORCH_DEVICE,
    Global::GET_LAYOUT,
    Global::REBUILD_TENSOR_V2,
    Global::REBUILD_PARAMETER,
    Global::ORDERED_DICT,
    Global::CODECS_ENCODE,
    Global::BUILTIN_SET,
    Global::BUILTIN_FROZENSET,
    Global::BUILTIN_BYTEARRAY,
    Global::POSIX_PATH,
    Global::new("pathlib", "WindowsPath"),
    Global::new("pathlib", "PurePosixPath"),
    Global::new("pathlib", "PureWindowsPath"),
    Global::new("pathlib", "Path"),
    Global::TORCH_STRIDED,
    Global::new("torch", "sparse_coo"),
    Global::new("torch", "contiguous_format"),
    Global::new("torch", "channels_last"),
    Global::new("torch", "channels_last_3d"),
    Global::new("torch", "preserve_format"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_list_resolves_known_and_refuses_others() {
        assert_eq!(
            Global::lookup("torch", "BFloat16Storage").and_then(|g| g.storage_dtype()),
            Some(Dtype::BF16)
        );
        assert_eq!(
            Global::lookup("torch", "bfloat16").and_then(|g| g.dtype()),
            Some(Dtype::BF16)
        );
        assert!(Global::lookup("torch", "complex64").is_some_and(|g| g.dtype().is_none()));
        assert_eq!(
            Global::lookup("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            Some(Global::STORAGE_INFO)
        );
        assert_eq!(Global::lookup("os", "system"), None);
        assert_eq!(Global::lookup("builtins", "eval"), None);
        assert_eq!(Global::lookup("torch", "load"), None);
    }
}
