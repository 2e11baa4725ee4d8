//! AdamW over tch tensors with visible, checkpointable state, and total-norm gradient clipping.
//!
//! The update is PyTorch's `torch.optim.AdamW` (decoupled weight decay, bias correction), applied
//! per parameter: through torch's fused kernel (`optimizer.implementation = "fused"`,
//! torchtitan's default) or as its for-loop sequence of tensor ops, each rounding as torch's does; its state (`exp_avg`, `exp_avg_sq`, `step` per parameter fqn) is plain tensors
//! that checkpointing can save and load by name.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use crate::config::Optimizer as OptimizerConfig;

/// AdamW hyper-parameters (torchtitan's `[optimizer]` defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// torch's fused kernel (`implementation = "fused"`, torchtitan's default), else the
    /// for-loop/foreach sequence of tensor ops; the two round differently.
    pub fused: bool,
}

impl From<&OptimizerConfig> for AdamWParams {
    fn from(c: &OptimizerConfig) -> Self {
        Self {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            fused: c.implementation == crate::config::OptimizerImpl::Fused,
        }
    }
}

/// The state of one parameter, named as in PyTorch's optimizer state dict.
#[derive(Debug)]
pub struct ParamState {
    pub step: u64,
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
}

/// AdamW with its state keyed by parameter fqn.
#[derive(Debug)]
pub struct AdamW {
    pub hparams: AdamWParams,
    pub state: BTreeMap<String, ParamState>,
    /// The learning rate a loaded checkpoint's `param_groups` hold: torch's optimizer steps with
    /// it once after a resume, before the scheduler next writes the schedule's value (what
    /// torchtitan does; it differs from the schedule only when the schedule's settings or
    /// `training.steps` changed between the runs).
    pub resumed_lr: Option<f64>,
    /// The fused kernel's step count for the parameter being updated: a 0-dim f32 on the
    /// parameters' device, refilled from [`ParamState::step`] for each call (a fill kernel, not
    /// a host-to-device copy per parameter per step).
    fused_step: Option<Tensor>,
}

impl AdamW {
    pub fn new(hparams: AdamWParams) -> Self {
        Self {
            hparams,
            state: BTreeMap::new(),
            resumed_lr: None,
            fused_step: None,
        }
    }

    /// The learning rate of the next optimizer step: the resumed one once, then `scheduled`.
    pub fn next_lr(&mut self, scheduled: f64) -> f64 {
        self.resumed_lr.take().unwrap_or(scheduled)
    }

    /// The state torch's `get_optimizer_state_dict` gives an optimizer that has not stepped yet
    /// (DCP's `_init_optim_state`: one step with zero gradients at lr 0, which moves no
    /// parameter): `step` 1 and zero moments for every parameter. torchtitan's full checkpoints
    /// taken before the first step (a seed checkpoint with `last_save_model_only = false`) hold
    /// it. Parameters that already have state keep it.
    pub fn init_state_as_torch_checkpoints_do(&mut self, params: &[(String, Tensor)]) {
        for (name, param) in params {
            self.state
                .entry(name.clone())
                .or_insert_with(|| ParamState {
                    step: 1,
                    exp_avg: param.zeros_like(),
                    exp_avg_sq: param.zeros_like(),
                });
        }
    }

    /// One AdamW update of `param` (named `name`) with its current gradient, at learning rate `lr`.
    /// Parameters without a gradient are skipped, as PyTorch does. A failed tensor operation
    /// (a device or dtype mismatch, an out-of-memory) is an error naming the parameter.
    pub fn step_param(&mut self, name: &str, param: &Tensor, lr: f64) -> Result<()> {
        let grad = param.grad();
        if !grad.defined() {
            return Ok(());
        }
        let AdamWParams {
            beta1,
            beta2,
            eps,
            weight_decay,
            fused,
        } = self.hparams;
        if fused
            && self
                .fused_step
                .as_ref()
                .is_none_or(|t| t.device() != param.device())
        {
            self.fused_step = Some(Tensor::zeros([], (Kind::Float, param.device())));
        }
        let state = self
            .state
            .entry(name.to_string())
            .or_insert_with(|| ParamState {
                step: 0,
                exp_avg: param.zeros_like(),
                exp_avg_sq: param.zeros_like(),
            });
        // Each in-place op returns another handle to the tensor it changed: dropped; its error is
        // not.
        if let Some(step) = self.fused_step.as_mut().filter(|_| fused) {
            state.step += 1;
            let _ = step.fill_(state.step as f64);
            let p = param.shallow_clone();
            let tensors = [&p, &grad, &state.exp_avg, &state.exp_avg_sq, &*step];
            let [p, g, m, v, s] = tensors.map(|t| t.as_ptr() as *mut std::ffi::c_void);
            return crate::shim::call(|err| {
                // SAFETY: tch's C_tensor is an `at::Tensor*`; every tensor is alive for the call.
                unsafe {
                    titan_fused_adamw(p, g, m, v, s, lr, beta1, beta2, weight_decay, eps, err)
                }
            })
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("AdamW step of `{name}`"));
        }
        tch::no_grad(|| -> std::result::Result<(), tch::TchError> {
            state.step += 1;
            let mut p = param.shallow_clone();
            // Decoupled weight decay first, as torch.optim.AdamW.
            if weight_decay != 0.0 {
                p.f_mul_scalar_(1.0 - lr * weight_decay).map(drop)?;
            }
            state.exp_avg.f_lerp_(&grad, 1.0 - beta1).map(drop)?;
            state.exp_avg_sq.f_mul_scalar_(beta2).map(drop)?;
            state
                .exp_avg_sq
                .f_addcmul_(&grad.f_mul_scalar(1.0 - beta2)?, &grad)
                .map(drop)?;
            // `beta ** step` as Python computes it (C's pow, correctly rounded), not repeated
            // multiplication, which rounds at each step: torch's AdamW bit for bit.
            let step = state.step as f64;
            let bias_correction1 = 1.0 - beta1.powf(step);
            let bias_correction2 = 1.0 - beta2.powf(step);
            let step_size = lr / bias_correction1;
            let mut denom = state.exp_avg_sq.f_sqrt()?;
            denom.f_div_scalar_(bias_correction2.sqrt()).map(drop)?;
            denom.f_add_scalar_(eps).map(drop)?;
            p.f_addcdiv_(&state.exp_avg.f_mul_scalar(-step_size)?, &denom)
                .map(drop)?;
            Ok(())
        })
        .with_context(|| format!("AdamW step of `{name}`"))
    }
}

unsafe extern "C" {
    fn titan_clear_grad(tensor: *mut std::ffi::c_void, err: *mut *mut std::ffi::c_char) -> i32;
    fn titan_accumulate_grad(
        tensor: *mut std::ffi::c_void,
        grad: *mut std::ffi::c_void,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn titan_fused_adamw(
        param: *mut std::ffi::c_void,
        grad: *mut std::ffi::c_void,
        exp_avg: *mut std::ffi::c_void,
        exp_avg_sq: *mut std::ffi::c_void,
        step: *mut std::ffi::c_void,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
}

/// Adds `grad` into `param`'s gradient (or makes it the gradient), outside autograd.
pub fn accumulate_grad(param: &Tensor, grad: &Tensor) {
    crate::autograd::check("accumulating a gradient", |err| {
        // SAFETY: tch's C_tensor is an `at::Tensor*`; both are alive for the call.
        unsafe {
            titan_accumulate_grad(
                param.as_ptr() as *mut std::ffi::c_void,
                grad.as_ptr() as *mut std::ffi::c_void,
                err,
            )
        }
    });
}

/// Drops the gradients of `params`: `optimizer.zero_grad()` with torch's default
/// `set_to_none=True`. The next backward then hands its gradient buffers over instead of adding
/// into zeroed ones (a memset and an add per parameter less).
pub fn clear_grads(params: &[&Tensor]) {
    for p in params {
        // SAFETY: tch's C_tensor is an `at::Tensor*`, alive for this call; the shim only resets
        // the autograd grad slot of the tensor it points to.
        let cleared =
            crate::shim::call(|err| unsafe { titan_clear_grad(p.as_ptr() as *mut _, err) });
        if cleared.is_err() {
            // Not reachable for leaf tensors; zeroing in place is the same for the next step.
            p.shallow_clone().zero_grad();
        }
    }
}

/// The total 2-norm of `grads` (one per parameter, in parameter order), as
/// `torch.nn.utils.clip_grad_norm_` computes it: the fp32 norm of the per-tensor fp32 norms. The
/// order and grouping of the tensors change the last bits (the norms are summed in order), so
/// callers pass the parameters as the model they mirror has them.
pub fn total_grad_norm(grads: &[Tensor]) -> f64 {
    tch::no_grad(|| {
        let norms: Vec<Tensor> = grads
            .iter()
            .filter(|g| g.defined())
            .map(|g| g.to_kind(Kind::Float).norm().reshape([1]))
            .collect();
        if norms.is_empty() {
            return 0.0;
        }
        Tensor::cat(&norms, 0).norm().double_value(&[])
    })
}

/// The factor `clip_grad_norm_` scales gradients by: `max_norm / (total_norm + 1e-6)` clamped
/// to 1, in fp32 as torch computes it (`total_norm` is an fp32 tensor there, and `max_norm /
/// t` is `t.reciprocal() * max_norm`), so the clipped gradients are torch's bit for bit.
pub fn clip_coefficient(max_norm: f64, total_norm: f64) -> f32 {
    let recip = 1.0f32 / (total_norm as f32 + 1e-6f32);
    (recip * max_norm as f32).min(1.0)
}

/// Scales every gradient by [`clip_coefficient`] when that is below 1, as `clip_grad_norm_`
/// does. The one clipping function; `total_norm` comes from [`total_grad_norm`] (summed over the
/// ranks by the caller for sharded parameters).
pub fn clip_grads(params: &[&Tensor], max_norm: f64, total_norm: f64) -> Result<()> {
    let coef = clip_coefficient(max_norm, total_norm);
    if coef >= 1.0 || !total_norm.is_finite() {
        return Ok(());
    }
    tch::no_grad(|| {
        for p in params {
            let mut g = p.grad();
            if g.defined() {
                g.f_mul_scalar_(f64::from(coef))
                    .map(drop)
                    .with_context(|| format!("clipping a gradient of shape {:?}", g.size()))?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both implementations (torch's fused kernel, the for-loop ops) follow torch.optim.AdamW's
    /// formulas, computed here by hand in f64.
    #[test]
    fn adamw_matches_reference_two_steps() {
        for fused in [false, true] {
            let hp = AdamWParams {
                fused,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            };
            let mut opt = AdamW::new(hp);
            let p = Tensor::from_slice(&[1.0f64, -2.0]).set_requires_grad(true);
            let grads = [[0.5f64, 0.25], [-1.0, 2.0]];
            let (mut w, mut m, mut v) = ([1.0f64, -2.0], [0.0f64; 2], [0.0f64; 2]);
            let lr = 1e-2;
            for (t, g) in grads.iter().enumerate() {
                let loss = (&p * Tensor::from_slice(g)).sum(Kind::Double);
                p.shallow_clone().zero_grad();
                loss.backward();
                opt.step_param("w", &p, lr).unwrap();
                let t = (t + 1) as i32;
                for i in 0..2 {
                    w[i] *= 1.0 - lr * 0.1;
                    m[i] = 0.9 * m[i] + 0.1 * g[i];
                    v[i] = 0.95 * v[i] + 0.05 * g[i] * g[i];
                    let denom = (v[i] / (1.0 - 0.95f64.powi(t))).sqrt() + 1e-8;
                    w[i] -= lr / (1.0 - 0.9f64.powi(t)) * m[i] / denom;
                }
            }
            let got = Vec::<f64>::try_from(&p.detach()).unwrap();
            for i in 0..2 {
                assert!(
                    (got[i] - w[i]).abs() < 1e-12,
                    "fused {fused}: {got:?} vs {w:?}"
                );
            }
            assert_eq!(opt.state["w"].step, 2);
        }
    }

    #[test]
    fn clear_grads_sets_them_to_none() {
        let a = Tensor::from_slice(&[3.0f32, 1.0]).set_requires_grad(true);
        (&a * &a).sum(Kind::Float).backward();
        assert!(a.grad().defined());
        clear_grads(&[&a]);
        assert!(!a.grad().defined());
        // The next backward creates a fresh gradient, not one added to the old values.
        (&a * 2.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), vec![2.0, 2.0]);
    }

    #[test]
    fn clip_scales_to_max_norm() {
        let a = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let b = Tensor::from_slice(&[4.0f32]).set_requires_grad(true);
        let loss = (&a * &a * 1.5 + &b * &b * 2.0).sum(Kind::Float);
        loss.backward(); // grads 3a = 9 and 4b = 16
        let norm = total_grad_norm(&[a.grad(), b.grad()]);
        assert!((norm - (81.0f64 + 256.0).sqrt()).abs() < 1e-4);
        clip_grads(&[&a, &b], 1.0, norm).unwrap();
        assert!((total_grad_norm(&[a.grad(), b.grad()]) - 1.0).abs() < 1e-5);
        // torch: (1 / (norm + 1e-6)) * max_norm in fp32, at most 1.
        let coef = clip_coefficient(1.0, norm);
        assert_eq!(coef, (1.0f32 / (norm as f32 + 1e-6f32)) * 1.0f32);
        assert_eq!(clip_coefficient(100.0, norm), 1.0);
    }
}
