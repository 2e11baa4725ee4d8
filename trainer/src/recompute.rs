//! Activation checkpointing's mechanism: [`checkpoint`] runs a region of the model keeping only
//! its inputs, and recomputes the region in the backward pass (torch.utils.checkpoint with
//! `use_reentrant=True`, through `cpp/recompute_shim.cpp`; tch has no checkpoint function).
//!
//! The region is a Rust closure owned by the autograd graph: it runs once in the forward pass
//! (no graph recorded) and once more when the backward pass reaches it (graph recorded, then
//! back-propagated at once). The recompute sees the autocast state of the forward. Parameters the
//! region reads get their gradients from that inner backward, so they are complete when
//! `backward()` returns, before any gradient reduction.
//!
//! Each recompute is a titan-obs `recompute` span inside the backward pass: what activation
//! checkpointing costs shows in the timeline, and a test can count that the forward ran again.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

use tch::Tensor;

use crate::autograd::{Callback, DropCtx, answer, borrowed, call_mapping, check, drop_boxed, raw};

unsafe extern "C" {
    fn titan_recompute_apply(
        ctx: *mut c_void,
        run: Callback,
        drop: DropCtx,
        inputs: *mut *mut c_void,
        n_in: i64,
        outputs: *mut *mut c_void,
        n_out: i64,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_kept_linear(
        x: *mut c_void,
        w: *mut c_void,
        kept: *mut c_void,
        out: *mut *mut c_void,
        err: *mut *mut c_char,
    ) -> i32;
}

/// `x.linear(w)` for a recompute that already has its value: returns `kept` (the output of the
/// same matmul in the forward pass) without multiplying, and back-propagates as linear does (the
/// same mm calls, so the gradients are bit-identical). Under autocast `x` and `w` are cast to
/// `kept`'s dtype first, as autocast's linear casts them.
pub fn kept_linear(x: &Tensor, w: &Tensor, kept: &Tensor) -> Tensor {
    let as_kept = |t: &Tensor| {
        if t.kind() == kept.kind() {
            t.shallow_clone()
        } else {
            t.to_kind(kept.kind())
        }
    };
    let (x, w) = (as_kept(x), as_kept(w));
    let mut out = std::ptr::null_mut();
    // SAFETY: live tch tensors borrowed for the call; on success `out` is a new at::Tensor* we own.
    check("kept linear", |err| unsafe {
        titan_kept_linear(raw(&x), raw(&w), raw(kept), &mut out, err)
    });
    // SAFETY: see above.
    unsafe { Tensor::from_ptr(out.cast()) }
}

/// Runs `region` on `inputs` and returns its `N` outputs, keeping only `inputs` for the backward
/// pass: what the region computes in between is recomputed there. The region must be a pure
/// function of its inputs and of what it captures (parameters), with no randomness.
///
/// Panics (as tch's own ops do) if libtorch or the region fails.
pub fn checkpoint<const N: usize, F>(inputs: &[&Tensor], region: F) -> [Tensor; N]
where
    F: Fn(&[Tensor]) -> [Tensor; N] + Send + 'static,
{
    let region = Region {
        region,
        runs: AtomicU32::new(0),
    };
    let ctx = Box::into_raw(Box::new(region)).cast::<c_void>();
    // SAFETY: the slots come from `call_mapping`; the shim takes ownership of `ctx` (freed
    // through drop_boxed, also on error).
    let out = call_mapping(
        "activation checkpoint",
        inputs,
        N,
        |ins, n_in, outs, n_out, err| unsafe {
            titan_recompute_apply(
                ctx,
                run_region::<N, F>,
                drop_boxed::<Region<F>>,
                ins,
                n_in,
                outs,
                n_out,
                err,
            )
        },
    );
    out.try_into()
        .unwrap_or_else(|_| unreachable!("call_mapping returns the N tensors asked for"))
}

/// The shim's [`Callback`]: runs the region on the inputs the shim lends.
unsafe extern "C" fn run_region<const N: usize, F>(
    ctx: *mut c_void,
    inputs: *mut *mut c_void,
    n_in: i64,
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
) -> i32
where
    F: Fn(&[Tensor]) -> [Tensor; N],
{
    // SAFETY: the shim lends n_in live at::Tensor*.
    let inputs = unsafe { borrowed(inputs, n_in) };
    // SAFETY: ctx is the Box<Region<F>> made in `checkpoint`, alive until drop_boxed.
    let region = unsafe { &*ctx.cast::<Region<F>>() };
    // The first run is the forward pass; every later one recomputes in backward.
    let recompute = region.runs.fetch_add(1, Ordering::Relaxed) > 0;
    let _span = recompute.then(|| titan_obs_core::span(titan_obs_core::vocab::titan::RECOMPUTE));
    // SAFETY: the shim passes n_out output slots and an error slot.
    unsafe { answer(outputs, n_out, err, || Vec::from((region.region)(&inputs))) }
}

/// A checkpointed region and how often it has run.
struct Region<F> {
    region: F,
    runs: AtomicU32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn grads_of(checkpointed: bool) -> (Tensor, Tensor, Tensor) {
        let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 0.25])
            .view([2, 2])
            .set_requires_grad(true);
        let w = Tensor::from_slice(&[1.5f32, -0.5, 0.75, 2.0])
            .view([2, 2])
            .set_requires_grad(true);
        let region = {
            let w = w.shallow_clone();
            move |i: &[Tensor]| [(i[0].matmul(&w).silu() * &i[0]).tanh()]
        };
        let [y] = if checkpointed {
            checkpoint(&[&x], region)
        } else {
            region(&[x.shallow_clone()])
        };
        (y.sum(Kind::Float) * 3.0).backward();
        (y.detach(), x.grad(), w.grad())
    }

    #[test]
    fn checkpointed_region_gives_the_same_values_and_gradients() {
        let (y0, gx0, gw0) = grads_of(false);
        let (y1, gx1, gw1) = grads_of(true);
        assert!(y0.equal(&y1));
        assert!(gx0.equal(&gx1), "input grad {gx0} vs {gx1}");
        assert!(gw0.equal(&gw1), "weight grad {gw0} vs {gw1}");
    }

    #[test]
    fn the_region_runs_again_in_backward_only() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runs = Arc::new(AtomicUsize::new(0));
        let x = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let counted = runs.clone();
        let [y] = checkpoint(&[&x], move |i| {
            counted.fetch_add(1, Ordering::SeqCst);
            [i[0].exp() * 2.0]
        });
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(y.requires_grad());
        y.sum(Kind::Float).backward();
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        assert!(x.grad().equal(&(x.exp() * 2.0)));
    }

    #[test]
    fn the_recompute_runs_under_the_forwards_autocast() {
        let _generator = crate::rng::global_generator();
        use crate::precision::Precision;
        let run = |checkpointed: bool| {
            tch::manual_seed(3);
            let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let w = Tensor::randn([8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let region = {
                let w = w.shallow_clone();
                move |i: &[Tensor]| [i[0].matmul(&w).gelu("none")]
            };
            let y = Precision::Autocast(Kind::BFloat16)
                .run(Device::Cpu, || {
                    if checkpointed {
                        let [y] = checkpoint(&[&x], region);
                        y
                    } else {
                        region(&[x.shallow_clone()])[0].shallow_clone()
                    }
                })
                .unwrap();
            assert_eq!(y.kind(), Kind::BFloat16);
            y.to_kind(Kind::Float).sum(Kind::Float).backward();
            (x.grad(), w.grad())
        };
        let (gx0, gw0) = run(false);
        let (gx1, gw1) = run(true);
        assert_eq!(gw1.kind(), Kind::Float);
        assert!(gx0.equal(&gx1) && gw0.equal(&gw1));
    }

    #[test]
    fn kept_linear_back_propagates_as_linear() {
        let _generator = crate::rng::global_generator();
        let run = |kept: bool| {
            tch::manual_seed(5);
            let x = Tensor::randn([2, 3, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let w = Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let y = if kept {
                let value = tch::no_grad(|| x.linear::<&Tensor>(&w, None));
                kept_linear(&x, &w, &value)
            } else {
                x.linear::<&Tensor>(&w, None)
            };
            (y.tanh().sum(Kind::Float) * 2.0).backward();
            (y.detach(), x.grad(), w.grad())
        };
        let (y0, gx0, gw0) = run(false);
        let (y1, gx1, gw1) = run(true);
        assert!(y0.equal(&y1) && gx0.equal(&gx1) && gw0.equal(&gw1));
    }

    #[test]
    fn a_panicking_region_is_an_error_not_an_abort() {
        let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let result =
            std::panic::catch_unwind(|| checkpoint::<1, _>(&[&x], |_| panic!("region exploded")));
        let message = result.unwrap_err();
        let text = message
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(text.contains("region exploded"), "{text}");
    }
}
