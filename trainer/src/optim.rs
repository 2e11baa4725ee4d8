//! AdamW over tch tensors with visible, checkpointable state, and total-norm gradient clipping.
//!
//! The update is PyTorch's `torch.optim.AdamW` (decoupled weight decay, bias correction): through
//! torch's fused kernel (`optimizer.implementation = "fused"`, torchtitan's default), one call over
//! all parameters of a (device, dtype) group as torch's optimizer makes it, or as its for-loop
//! sequence of tensor ops per parameter, each rounding as torch's does; its state (`exp_avg`,
//! `exp_avg_sq`, `step` per parameter fqn) is plain tensors that checkpointing can save and load
//! by name.
//!
//! Clipping stays on the device, as `clip_grad_norm_` does: the total norm is a tensor, the clip
//! coefficient is computed from it on the device and multiplied in; nothing here reads a value
//! back to the host (a step that does not log makes no host sync).

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

/// What parameters share to step in one fused call: device, dtype and step count.
type GroupKey = (tch::Device, Kind, u64);

/// A parameter of a fused group: its fqn, the parameter and its gradient.
type Member<'a> = (&'a str, &'a Tensor, Tensor);

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
    /// The fused kernel's step count, a 0-dim f32 per device, refilled from
    /// [`ParamState::step`] before each group's call (a fill kernel, not a host-to-device copy).
    fused_steps: Vec<Tensor>,
}

impl AdamW {
    pub fn new(hparams: AdamWParams) -> Self {
        Self {
            hparams,
            state: BTreeMap::new(),
            resumed_lr: None,
            fused_steps: Vec::new(),
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

    /// One AdamW update of every parameter of `params` (fqn, tensor) that has a gradient, at
    /// learning rate `lr`. With the fused kernel the parameters go to it in groups of one
    /// device, dtype and step count, one call per group (torch's optimizer groups by device
    /// and dtype the same way; the fused kernel rounds each element as it does per parameter);
    /// the for-loop implementation updates them one by one. A failed call is an error naming
    /// the parameter, or the group's first and last parameter.
    pub fn step(&mut self, params: &[(String, Tensor)], lr: f64) -> Result<()> {
        if !self.hparams.fused {
            for (name, p) in params {
                self.step_param(name, p, lr)?;
            }
            return Ok(());
        }
        // (device, dtype, step after this update) -> the group's parameters, in model order.
        let mut groups: Vec<(GroupKey, Vec<Member<'_>>)> = Vec::new();
        for (name, param) in params {
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            let state = self
                .state
                .entry(name.clone())
                .or_insert_with(|| ParamState {
                    step: 0,
                    exp_avg: param.zeros_like(),
                    exp_avg_sq: param.zeros_like(),
                });
            state.step += 1;
            let key = (param.device(), param.kind(), state.step);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push((name, param, grad)),
                None => groups.push((key, vec![(name, param, grad)])),
            }
        }
        for ((device, _, step), members) in &groups {
            // Calls on one device run in order (one stream), so one step tensor per device
            // serves every group there.
            let at = match self.fused_steps.iter().position(|t| t.device() == *device) {
                Some(at) => at,
                None => {
                    self.fused_steps
                        .push(Tensor::zeros([], (Kind::Float, *device)));
                    self.fused_steps.len() - 1
                }
            };
            let step_t = &mut self.fused_steps[at];
            let _ = step_t.fill_(*step as f64);
            let raw = |t: &Tensor| t.as_ptr() as *mut std::ffi::c_void;
            let (mut p, mut g, mut m, mut v) = (vec![], vec![], vec![], vec![]);
            for (name, param, grad) in members {
                let state = &self.state[*name];
                p.push(raw(param));
                g.push(raw(grad));
                m.push(raw(&state.exp_avg));
                v.push(raw(&state.exp_avg_sq));
            }
            let AdamWParams {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } = self.hparams;
            crate::shim::call(|err| {
                // SAFETY: tch's C_tensor is an `at::Tensor*`; every tensor is alive for the call
                // (`members` and the state hold them) and each list has `members.len()` entries.
                unsafe {
                    titan_fused_adamw(
                        p.as_mut_ptr(),
                        g.as_mut_ptr(),
                        m.as_mut_ptr(),
                        v.as_mut_ptr(),
                        raw(step_t),
                        members.len() as i64,
                        lr,
                        beta1,
                        beta2,
                        weight_decay,
                        eps,
                        err,
                    )
                }
            })
            .map_err(anyhow::Error::msg)
            .with_context(|| {
                let (first, last) = (members[0].0, members[members.len() - 1].0);
                format!("AdamW step of `{first}` .. `{last}`")
            })?;
        }
        Ok(())
    }

    /// One AdamW update of `param` (named `name`) with its current gradient, at learning rate
    /// `lr`: [`AdamW::step`] for one parameter. Parameters without a gradient are skipped, as
    /// PyTorch does. A failed tensor operation (a device or dtype mismatch, an out-of-memory)
    /// is an error naming the parameter.
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
        if fused {
            return self.step(&[(name.to_string(), param.shallow_clone())], lr);
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
        params: *mut *mut std::ffi::c_void,
        grads: *mut *mut std::ffi::c_void,
        exp_avgs: *mut *mut std::ffi::c_void,
        exp_avg_sqs: *mut *mut std::ffi::c_void,
        step: *mut std::ffi::c_void,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    fn titan_foreach_norm(
        tensors: *mut *mut std::ffi::c_void,
        n: i64,
        out: *mut *mut std::ffi::c_void,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    fn titan_foreach_mul_(
        tensors: *mut *mut std::ffi::c_void,
        n: i64,
        scale: *mut std::ffi::c_void,
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
/// `torch.nn.utils.clip_grad_norm_(foreach=True)` computes it: the fp32 norm of the per-tensor
/// fp32 norms (`_foreach_norm`, stacked). The order and grouping of the tensors change the last
/// bits (the norms are summed in order), so callers pass the parameters as the model they mirror
/// has them. A 0-dim fp32 tensor on the gradients' device (0 on the CPU when there are none):
/// read it only where it is logged.
pub fn total_grad_norm(grads: &[Tensor]) -> Result<Tensor> {
    let fp32: Vec<Tensor> = grads
        .iter()
        .filter(|g| g.defined())
        .map(|g| g.to_kind(Kind::Float))
        .collect();
    if fp32.is_empty() {
        return Ok(Tensor::zeros([], (Kind::Float, tch::Device::Cpu)));
    }
    let mut raw: Vec<*mut std::ffi::c_void> = fp32
        .iter()
        .map(|t| t.as_ptr() as *mut std::ffi::c_void)
        .collect();
    let mut out = std::ptr::null_mut();
    crate::shim::call(|err| {
        // SAFETY: tch's C_tensor is an `at::Tensor*`; `fp32` keeps every tensor alive for the
        // call; on success `out` is a new `at::Tensor*` that we own.
        unsafe { titan_foreach_norm(raw.as_mut_ptr(), raw.len() as i64, &mut out, err) }
    })
    .map_err(anyhow::Error::msg)
    .context("the gradients' norms")?;
    // SAFETY: see above.
    let norms = unsafe { Tensor::from_ptr(out.cast()) };
    tch::no_grad(|| norms.f_norm())
        .map_err(anyhow::Error::from)
        .context("the gradients' total norm")
}

/// The factor `clip_grad_norm_` scales gradients by: `max_norm / (total_norm + 1e-6)` clamped
/// to 1, computed on the device in fp32 as torch computes it (`max_norm / t` is
/// `t.reciprocal() * max_norm` there), so the clipped gradients are torch's bit for bit and no
/// value crosses to the host. `total_norm` may be f64 (summed over ranks in f64): it is rounded
/// to fp32 first, as the fp32 norm torch divides by.
pub fn clip_coefficient(max_norm: f64, total_norm: &Tensor) -> Result<Tensor> {
    tch::no_grad(|| {
        total_norm
            .f_to_kind(Kind::Float)?
            .f_add_scalar(1e-6)?
            .f_reciprocal()?
            .f_mul_scalar(max_norm)?
            .f_clamp_max(1.0)
    })
    .map_err(anyhow::Error::from)
    .context("the clip coefficient")
}

/// Scales every gradient of `params` by `coef` ([`clip_coefficient`], a 0-dim tensor on their
/// device) in one multi-tensor multiply, as `clip_grad_norm_` does whatever the coefficient: a
/// coefficient of 1 leaves each gradient bit for bit as it was, and a non-finite norm makes the
/// gradients non-finite as it does in torch. The one clipping function.
pub fn clip_grads(params: &[&Tensor], coef: &Tensor) -> Result<()> {
    let grads: Vec<Tensor> = params
        .iter()
        .map(|p| p.grad())
        .filter(|g| g.defined())
        .collect();
    if grads.is_empty() {
        return Ok(());
    }
    let mut raw: Vec<*mut std::ffi::c_void> = grads
        .iter()
        .map(|t| t.as_ptr() as *mut std::ffi::c_void)
        .collect();
    crate::shim::call(|err| {
        // SAFETY: tch's C_tensor is an `at::Tensor*`; `grads` and `coef` are alive for the call.
        unsafe {
            titan_foreach_mul_(
                raw.as_mut_ptr(),
                raw.len() as i64,
                coef.as_ptr() as *mut std::ffi::c_void,
                err,
            )
        }
    })
    .map_err(anyhow::Error::msg)
    .context("clipping the gradients")
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
        let norm_t = total_grad_norm(&[a.grad(), b.grad()]).unwrap();
        let norm = norm_t.double_value(&[]);
        assert!((norm - (81.0f64 + 256.0).sqrt()).abs() < 1e-4);
        let coef = clip_coefficient(1.0, &norm_t).unwrap();
        // torch: (1 / (norm + 1e-6)) * max_norm in fp32, at most 1.
        assert_eq!(
            coef.double_value(&[]) as f32,
            (1.0f32 / (norm as f32 + 1e-6f32)) * 1.0f32
        );
        clip_grads(&[&a, &b], &coef).unwrap();
        let clipped = total_grad_norm(&[a.grad(), b.grad()]).unwrap();
        assert!((clipped.double_value(&[]) - 1.0).abs() < 1e-5);
        // Below max_norm the coefficient is 1 and the gradients stay bit for bit.
        let before = Vec::<f32>::try_from(&a.grad()).unwrap();
        let one = clip_coefficient(100.0, &clipped).unwrap();
        assert_eq!(one.double_value(&[]), 1.0);
        clip_grads(&[&a, &b], &one).unwrap();
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), before);
    }

    /// The norm is the fp32 norm of the per-tensor norms in order (what torch's foreach
    /// `clip_grad_norm_` computes), not the norm of all elements at once.
    #[test]
    fn total_norm_is_the_norm_of_per_tensor_norms() {
        let _generator = crate::rng::global_generator();
        let grads: Vec<Tensor> = (0..5)
            .map(|i| Tensor::randn([97 + i], (Kind::Float, tch::Device::Cpu)))
            .collect();
        let got = total_grad_norm(&grads).unwrap();
        let want = Tensor::stack(&grads.iter().map(|g| g.norm()).collect::<Vec<_>>(), 0).norm();
        assert_eq!(got.kind(), Kind::Float);
        assert_eq!(got.double_value(&[]), want.double_value(&[]));
        assert_eq!(total_grad_norm(&[]).unwrap().double_value(&[]), 0.0);
    }

    /// One fused call over a group updates each parameter exactly as one call per parameter.
    #[test]
    fn grouped_fused_step_equals_per_parameter_steps() {
        let _generator = crate::rng::global_generator();
        let hp = AdamWParams {
            fused: true,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let make = || -> Vec<(String, Tensor)> {
            tch::manual_seed(7);
            (0..4)
                .map(|i| {
                    let t = Tensor::randn([33 + i], (Kind::Float, tch::Device::Cpu))
                        .set_requires_grad(true);
                    (format!("p{i}"), t)
                })
                .collect()
        };
        let (grouped, single) = (make(), make());
        let (mut a, mut b) = (AdamW::new(hp), AdamW::new(hp));
        for step in 0..3 {
            for params in [&grouped, &single] {
                for (i, (_, p)) in params.iter().enumerate() {
                    p.shallow_clone().zero_grad();
                    (p * (step as f64 + i as f64 + 0.5))
                        .pow_tensor_scalar(2)
                        .sum(Kind::Float)
                        .backward();
                }
            }
            a.step(&grouped, 1e-2).unwrap();
            for (name, p) in &single {
                b.step_param(name, p, 1e-2).unwrap();
            }
        }
        for ((n, x), (_, y)) in grouped.iter().zip(&single) {
            assert_eq!(
                Vec::<f32>::try_from(&x.detach()).unwrap(),
                Vec::<f32>::try_from(&y.detach()).unwrap(),
                "{n}"
            );
            assert_eq!(a.state[n].step, 3);
        }
    }
}
