//! Tensors staged in host memory: row-major little-endian bytes plus a [`Dtype`], the form
//! titan-ckpt reads and writes. Converting here keeps libtorch out of the checkpoint files'
//! code and lets a background thread write them (a `Vec<u8>` is `Send`, a tch tensor is not).

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};
use titan_dcp::Dtype;

/// One tensor copied to host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// The checkpoint dtype of a tch kind.
pub fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::Bool,
        other => bail!("tensors of kind {other:?} cannot be checkpointed"),
    })
}

/// The tch kind of a checkpoint dtype.
pub fn kind_of(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::Bool => Kind::Bool,
        other => bail!("checkpoint dtype {other} has no libtorch tensor kind here"),
    })
}

impl HostTensor {
    /// Copies `t` (any device) into host memory, cast to `kind` when given.
    pub fn from_tensor(t: &Tensor, kind: Option<Kind>) -> Result<Self> {
        let t = tch::no_grad(|| {
            let t = t.detach();
            let t = match kind {
                Some(k) if k != t.kind() => t.to_kind(k),
                _ => t,
            };
            t.to_device(Device::Cpu).contiguous()
        });
        let dtype = dtype_of(t.kind())?;
        let shape: Vec<u64> = t.size().iter().map(|&d| d as u64).collect();
        let numel = t.numel();
        let mut data = vec![0u8; numel * dtype.size()];
        if numel > 0 {
            t.f_copy_data_u8(&mut data, numel)?;
        }
        Ok(Self { dtype, shape, data })
    }

    /// A 0-dim tensor holding `value` (torch's scalar tensors, e.g. AdamW's `step`).
    pub fn scalar_f32(value: f32) -> Self {
        Self {
            dtype: Dtype::F32,
            shape: Vec::new(),
            data: value.to_le_bytes().to_vec(),
        }
    }

    pub fn scalar_i64(value: i64) -> Self {
        Self {
            dtype: Dtype::I64,
            shape: Vec::new(),
            data: value.to_le_bytes().to_vec(),
        }
    }

    /// A libtorch tensor on `device` with these values.
    pub fn to_tensor(&self, device: Device) -> Result<Tensor> {
        let kind = kind_of(self.dtype)?;
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        let want = self.shape.iter().product::<u64>() as usize * self.dtype.size();
        if self.data.len() != want {
            bail!(
                "tensor data is {} bytes, but shape {:?} of {} needs {want}",
                self.data.len(),
                self.shape,
                self.dtype
            );
        }
        Ok(Tensor::f_from_data_size(&self.data, &shape, kind)?.to_device(device))
    }

    /// The value of a one-element tensor as f64 (for counters stored as tensors).
    pub fn scalar_value(&self) -> Result<f64> {
        if self.shape.iter().product::<u64>() != 1 {
            bail!("expected a one-element tensor, got shape {:?}", self.shape);
        }
        let d = &self.data;
        Ok(match self.dtype {
            Dtype::F32 => f32::from_le_bytes(d[..4].try_into()?) as f64,
            Dtype::F64 => f64::from_le_bytes(d[..8].try_into()?),
            Dtype::I32 => i32::from_le_bytes(d[..4].try_into()?) as f64,
            Dtype::I64 => i64::from_le_bytes(d[..8].try_into()?) as f64,
            other => bail!("expected a float or int counter tensor, got {other}"),
        })
    }

    pub fn nbytes(&self) -> usize {
        self.data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_values_and_casts() {
        let t = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0]).view([2, 3]);
        let h = HostTensor::from_tensor(&t, None).unwrap();
        assert_eq!(
            (h.dtype, h.shape.clone(), h.data.len()),
            (Dtype::F32, vec![2, 3], 24)
        );
        let back = h.to_tensor(Device::Cpu).unwrap();
        assert!(back.equal(&t));
        let bf = HostTensor::from_tensor(&t, Some(Kind::BFloat16)).unwrap();
        assert_eq!((bf.dtype, bf.data.len()), (Dtype::BF16, 12));
        assert_eq!(HostTensor::scalar_i64(42).scalar_value().unwrap(), 42.0);
    }

    #[test]
    fn wrong_length_is_an_error() {
        let mut h = HostTensor::scalar_f32(1.0);
        h.data.pop();
        assert!(h.to_tensor(Device::Cpu).is_err());
    }
}
