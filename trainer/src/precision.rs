//! Mixed precision. torchtitan 0.3.0 applies FSDP2's `MixedPrecisionPolicy` to every layout, one
//! process included: [`param_kind`] is the dtype parameters are gathered and computed in (see
//! [`crate::parallelize::fsdp`]); gradients reach the fp32 shards through the reduce dtype.
//!
//! [`Precision`] is the autocast alternative earlier torchtitan releases used without FSDP: fp32 parameters (master weights),
//! gradients and optimizer state, with the forward pass (and so the backward's matmuls and
//! attention) under `torch.autocast(device, mixed_precision_param)`. The model keeps RoPE and
//! the logits/loss in fp32 itself, as torchtitan's model does.
//!
//! titan-train applies it the same way for one process, DDP, ZeRO-2 and HSDP (torchtitan casts
//! parameters through FSDP's `MixedPrecisionPolicy` when sharding; titan's ZeRO-2 keeps whole
//! fp32 parameters on every rank, so autocast is the cast that applies). Gradients are reduced
//! in `mixed_precision_reduce` (float32, the only value torchtitan 0.3.0 accepts).

use anyhow::{Result, anyhow};
use tch::{Device, Kind};

use crate::config::{DtypeName, Training};

/// The libtorch dtype of one of torchtitan's dtype names (the config itself knows no libtorch).
pub fn kind(dtype: DtypeName) -> Kind {
    match dtype {
        DtypeName::Float32 => Kind::Float,
        DtypeName::Bfloat16 => Kind::BFloat16,
        DtypeName::Float16 => Kind::Half,
    }
}

/// The dtype parameters compute in: `mixed_precision_param` over fp32 master weights, or the
/// whole model's `training.dtype`.
pub fn param_kind(t: &Training) -> Kind {
    match t.dtype {
        DtypeName::Float32 => kind(t.mixed_precision_param),
        other => kind(other),
    }
}

/// How the forward pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Everything in the parameters' dtype (fp32, or bf16 with `training.dtype = bfloat16`).
    Plain,
    /// fp32 parameters, the forward under autocast to this dtype.
    Autocast(Kind),
}

impl Precision {
    /// torchtitan's rule: autocast to `mixed_precision_param` unless it is float32 or the whole
    /// model already trains in `training.dtype = bfloat16`.
    pub fn from_config(t: &Training) -> Self {
        match (t.dtype, t.mixed_precision_param) {
            (DtypeName::Float32, DtypeName::Float32) => Precision::Plain,
            (DtypeName::Float32, p) => Precision::Autocast(kind(p)),
            _ => Precision::Plain,
        }
    }

    /// Runs `f` (a forward pass) with this precision on `device`.
    pub fn run<T>(self, device: Device, f: impl FnOnce() -> T) -> Result<T> {
        match self {
            Precision::Plain => Ok(f()),
            Precision::Autocast(kind) => {
                let guard = AutocastGuard::enter(device, kind)?;
                let out = f();
                guard.exit()?;
                Ok(out)
            }
        }
    }

    /// The dtype the matmuls and attention compute in, for parameters of `params`.
    pub fn activation_kind(self, params: Kind) -> Kind {
        match self {
            Precision::Plain => params,
            Precision::Autocast(kind) => kind,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Precision::Plain => "none".into(),
            Precision::Autocast(kind) => format!("autocast({kind:?})"),
        }
    }
}

unsafe extern "C" {
    fn titan_autocast_enter(
        cuda: i32,
        dtype: i32,
        prev_enabled: *mut i32,
        prev_dtype: *mut i32,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    fn titan_autocast_exit(
        cuda: i32,
        prev_enabled: i32,
        prev_dtype: i32,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
}

/// An autocast region on one device type; [`AutocastGuard::exit`] (or drop) restores the state.
struct AutocastGuard {
    cuda: i32,
    prev_enabled: i32,
    prev_dtype: i32,
    open: bool,
}

impl AutocastGuard {
    fn enter(device: Device, kind: Kind) -> Result<Self> {
        let cuda = i32::from(device.is_cuda());
        let (mut prev_enabled, mut prev_dtype) = (0, 0);
        // SAFETY: the shim writes the two out-pointers, which point at live locals.
        crate::shim::call(|err| unsafe {
            titan_autocast_enter(
                cuda,
                scalar_type(kind),
                &mut prev_enabled,
                &mut prev_dtype,
                err,
            )
        })
        .map_err(|m| anyhow!("libtorch refused to enable autocast({kind:?}) on {device:?}: {m}"))?;
        Ok(Self {
            cuda,
            prev_enabled,
            prev_dtype,
            open: true,
        })
    }

    fn exit(mut self) -> Result<()> {
        self.open = false;
        // SAFETY: plain values; restores what enter saved.
        crate::shim::call(|err| unsafe {
            titan_autocast_exit(self.cuda, self.prev_enabled, self.prev_dtype, err)
        })
        .map_err(|m| anyhow!("libtorch failed to leave an autocast region: {m}"))
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: as in exit; a panic unwinding through the region still restores it (a
            // failure here has nobody to report to: the region's own error is on its way).
            let _restored = crate::shim::call(|err| unsafe {
                titan_autocast_exit(self.cuda, self.prev_enabled, self.prev_dtype, err)
            });
        }
    }
}

/// c10::ScalarType codes of the dtypes autocast takes.
fn scalar_type(kind: Kind) -> i32 {
    match kind {
        Kind::Half => 5,
        Kind::Float => 6,
        Kind::BFloat16 => 15,
        other => unreachable!("autocast dtype {other:?} is not offered by the config"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn autocast_runs_matmuls_in_bf16_and_restores() {
        let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
        let out = Precision::Autocast(Kind::BFloat16)
            .run(Device::Cpu, || a.matmul(&a))
            .unwrap();
        assert_eq!(out.kind(), Kind::BFloat16);
        // Outside the region: fp32 again.
        assert_eq!(a.matmul(&a).kind(), Kind::Float);
        let plain = Precision::Plain.run(Device::Cpu, || a.matmul(&a)).unwrap();
        assert_eq!(plain.kind(), Kind::Float);
    }
}
