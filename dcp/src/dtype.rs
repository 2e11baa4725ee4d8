//! Tensor element types as the checkpoint formats name them.

use std::fmt;
use std::str::FromStr;

/// An element type, with its safetensors and PyTorch spellings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
    F8E4M3,
    F8E5M2,
}

impl Dtype {
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    /// The safetensors header spelling (`"BF16"`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
        }
    }

    /// The attribute of the `torch` module naming this dtype (`torch.bfloat16` -> `"bfloat16"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::I8 => "int8",
            Dtype::I16 => "int16",
            Dtype::U16 => "uint16",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::I32 => "int32",
            Dtype::U32 => "uint32",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::I64 => "int64",
            Dtype::U64 => "uint64",
            Dtype::F8E4M3 => "float8_e4m3fn",
            Dtype::F8E5M2 => "float8_e5m2",
        }
    }

    /// The storage class torch.save pickles for this dtype (`torch.BFloat16Storage`).
    pub fn torch_storage_name(self) -> &'static str {
        match self {
            Dtype::Bool => "BoolStorage",
            Dtype::U8 => "ByteStorage",
            Dtype::I8 => "CharStorage",
            Dtype::I16 => "ShortStorage",
            Dtype::U16 => "UInt16Storage",
            Dtype::F16 => "HalfStorage",
            Dtype::BF16 => "BFloat16Storage",
            Dtype::I32 => "IntStorage",
            Dtype::U32 => "UInt32Storage",
            Dtype::F32 => "FloatStorage",
            Dtype::F64 => "DoubleStorage",
            Dtype::I64 => "LongStorage",
            Dtype::U64 => "UInt64Storage",
            Dtype::F8E4M3 => "Float8_e4m3fnStorage",
            Dtype::F8E5M2 => "Float8_e5m2Storage",
        }
    }

    pub fn from_safetensors_name(name: &str) -> Option<Dtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.safetensors_name() == name)
    }

    /// Accepts torch's names and their common aliases (`float`, `half`, `long`, ...).
    pub fn from_torch_name(name: &str) -> Option<Dtype> {
        let canonical = match name {
            "float" => "float32",
            "double" => "float64",
            "half" => "float16",
            "long" => "int64",
            "int" => "int32",
            "short" => "int16",
            other => other,
        };
        Dtype::ALL.into_iter().find(|d| d.torch_name() == canonical)
    }

    pub fn from_torch_storage_name(name: &str) -> Option<Dtype> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.torch_storage_name() == name)
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 | Dtype::F8E4M3 | Dtype::F8E5M2
        )
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

/// Parses user spellings: `bf16`, `bfloat16`, `BF16`, `float32`, `fp32`, ...
impl FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let alias = match lower.as_str() {
            "bf16" => Some(Dtype::BF16),
            "fp16" | "f16" => Some(Dtype::F16),
            "fp32" | "f32" => Some(Dtype::F32),
            "fp64" | "f64" => Some(Dtype::F64),
            _ => None,
        };
        alias
            .or_else(|| Dtype::from_safetensors_name(&s.to_ascii_uppercase()))
            .or_else(|| Dtype::from_torch_name(&lower))
            .ok_or_else(|| {
                format!("unknown dtype `{s}` (expected e.g. bf16, float16, float32, int64)")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_safetensors_name(d.safetensors_name()), Some(d));
            assert_eq!(Dtype::from_torch_name(d.torch_name()), Some(d));
            assert_eq!(
                Dtype::from_torch_storage_name(d.torch_storage_name()),
                Some(d)
            );
        }
        assert_eq!("bf16".parse::<Dtype>(), Ok(Dtype::BF16));
        assert_eq!("float".parse::<Dtype>(), Ok(Dtype::F32));
        assert!("complex32".parse::<Dtype>().is_err());
    }
}
