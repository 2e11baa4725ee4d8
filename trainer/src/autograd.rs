//! Custom autograd functions written in Rust ([`Function`], applied with [`apply`]): PyTorch's
//! `torch.autograd.Function` for tch, through `cpp/function_shim.cpp`. Sharded training puts its
//! collectives in them (FSDP's all-gather whose backward reduce-scatters, tensor parallelism's
//! copies and reductions), so autograd runs each at its place in the backward pass.
//!
//! Also the two storage primitives FSDP2 frees and restores unsharded parameters with while the
//! autograd graph holds them: [`resize_storage`] and [`copy_keep_version`].

use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use tch::Tensor;

use crate::shim;

/// A differentiable operation. `forward` runs with grad mode off (as in torch); `backward` gets
/// one gradient per output (zeros for an unused output) and returns one per input (an undefined
/// tensor where the input needs none).
pub trait Function: Send + 'static {
    fn forward(&mut self, inputs: &[Tensor]) -> Vec<Tensor>;
    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor>;
}

/// A Rust callback the autograd shims call (`titan_callback` of `cpp/rust_callback.h`: forward
/// and backward here, the region of `recompute.rs`): maps `n_in` tensors the shim lends
/// ([`borrowed`]) to `n_out` new ones written to `outputs` ([`answer`]); returns 0, or 1 with a
/// message in `err` (`cpp/shim_error.h`).
pub(crate) type Callback = unsafe extern "C" fn(
    ctx: *mut c_void,
    inputs: *mut *mut c_void,
    n_in: i64,
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
) -> i32;
/// Frees a callback's `ctx` once the shim can call it no more.
pub(crate) type DropCtx = unsafe extern "C" fn(ctx: *mut c_void);

unsafe extern "C" {
    fn titan_function_apply(
        ctx: *mut c_void,
        forward: Callback,
        backward: Callback,
        drop: DropCtx,
        inputs: *mut *mut c_void,
        n_in: i64,
        outputs: *mut *mut c_void,
        n_out: i64,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_storage_resize(t: *mut c_void, nbytes: i64, err: *mut *mut c_char) -> i32;
    fn titan_storage_nbytes(t: *mut c_void, out: *mut i64, err: *mut *mut c_char) -> i32;
    fn titan_copy_keep_version(dst: *mut c_void, src: *mut c_void, err: *mut *mut c_char) -> i32;
}

pub(crate) fn raw(t: &Tensor) -> *mut c_void {
    t.as_ptr().cast_mut().cast()
}

/// Calls a shim entry point ([`shim::call`]), panicking with its message on failure (as tch's
/// own ops fail).
pub(crate) fn check(what: &str, f: impl FnOnce(*mut *mut c_char) -> i32) {
    if let Err(message) = shim::call(f) {
        panic!("{what}: {message}");
    }
}

/// Calls a shim entry point that maps `inputs` to `n_out` new tensors (`titan_function_apply`,
/// `titan_recompute_apply`) with its input, output and error slots: the inputs are lent for the
/// call, the tensors it writes are ours. Panics with its message on failure, as [`check`].
pub(crate) fn call_mapping(
    what: &str,
    inputs: &[&Tensor],
    n_out: usize,
    entry: impl FnOnce(*mut *mut c_void, i64, *mut *mut c_void, i64, *mut *mut c_char) -> i32,
) -> Vec<Tensor> {
    let mut in_ptrs: Vec<*mut c_void> = inputs.iter().map(|t| raw(t)).collect();
    let mut out_ptrs = vec![std::ptr::null_mut::<c_void>(); n_out];
    check(what, |err| {
        entry(
            in_ptrs.as_mut_ptr(),
            in_ptrs.len() as i64,
            out_ptrs.as_mut_ptr(),
            n_out as i64,
            err,
        )
    });
    // SAFETY: on success each slot holds a new at::Tensor* that we now own.
    out_ptrs
        .into_iter()
        .map(|p| unsafe { Tensor::from_ptr(p.cast()) })
        .collect()
}

/// Applies `f` to `inputs`, returning its `n_out` outputs connected to the autograd graph.
/// Panics (as tch's ops do) if `f` panics in forward; a panic in backward fails the backward pass
/// with the panic's message.
pub fn apply<F: Function>(f: F, inputs: &[&Tensor], n_out: usize) -> Vec<Tensor> {
    let ctx = Box::into_raw(Box::new(Mutex::new(f))).cast::<c_void>();
    // SAFETY: the slots come from `call_mapping`; the shim takes ownership of `ctx` (freed
    // through drop_boxed, also on error).
    call_mapping(
        "autograd function",
        inputs,
        n_out,
        |ins, n_in, outs, n_out, err| unsafe {
            titan_function_apply(
                ctx,
                call_fn::<F, false>,
                call_fn::<F, true>,
                drop_boxed::<Mutex<F>>,
                ins,
                n_in,
                outs,
                n_out,
                err,
            )
        },
    )
}

/// Borrows the `n` at::Tensor* a shim lends a [`Callback`] as tch tensors (shallow clones; the
/// originals stay the shim's).
///
/// # Safety
/// `ptrs` holds `n` live at::Tensor*.
pub(crate) unsafe fn borrowed(ptrs: *mut *mut c_void, n: i64) -> Vec<Tensor> {
    (0..n as usize)
        .map(|i| {
            // SAFETY: the shim passes n live at::Tensor* it keeps owning.
            let t = unsafe { Tensor::from_ptr((*ptrs.add(i)).cast()) };
            let copy = t.shallow_clone();
            std::mem::forget(t);
            copy
        })
        .collect()
}

/// How every [`Callback`] answers, never letting a panic cross the C++ frames: the `n_out`
/// tensors `body` returns go to the shim's output slots (it takes ownership); a panic's message,
/// or a wrong count, goes to its error slot. Returns the callback's code.
///
/// # Safety
/// `outputs` has `n_out` writable slots and `err` is a writable error slot.
pub(crate) unsafe fn answer(
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
    body: impl FnOnce() -> Vec<Tensor>,
) -> i32 {
    let message = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(out) if out.len() == n_out as usize => {
            for (i, t) in out.into_iter().enumerate() {
                // SAFETY: the caller guarantees the slot exists.
                unsafe { *outputs.add(i) = raw(&t) };
                std::mem::forget(t);
            }
            return 0;
        }
        Ok(out) => format!("returned {} tensors, expected {n_out}", out.len()),
        Err(panic) => panic_text(panic),
    };
    // SAFETY: the caller guarantees a writable error slot.
    unsafe { shim::set_message(err, &message) };
    1
}

/// The message of a caught panic.
pub(crate) fn panic_text(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panicked".into())
}

/// The shim's forward (`BACKWARD = false`: inputs to outputs) or backward (output gradients to
/// input gradients) [`Callback`].
unsafe extern "C" fn call_fn<F: Function, const BACKWARD: bool>(
    ctx: *mut c_void,
    inputs: *mut *mut c_void,
    n_in: i64,
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
) -> i32 {
    // SAFETY: see `borrowed`.
    let inputs = unsafe { borrowed(inputs, n_in) };
    // SAFETY: ctx is the Box<Mutex<F>> made in `apply`, alive until drop_boxed.
    let f = unsafe { &*ctx.cast::<Mutex<F>>() };
    // SAFETY: the shim passes n_out output slots and an error slot.
    unsafe {
        answer(outputs, n_out, err, || {
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            if BACKWARD {
                f.backward(&inputs)
            } else {
                f.forward(&inputs)
            }
        })
    }
}

/// The [`DropCtx`] of a `ctx` made by `Box::into_raw(Box<T>)`.
///
/// # Safety
/// `ctx` is such a box, and this is called once (the shims do).
pub(crate) unsafe extern "C" fn drop_boxed<T>(ctx: *mut c_void) {
    // SAFETY: per the contract above.
    drop(unsafe { Box::from_raw(ctx.cast::<T>()) });
}

/// The bytes `t`'s storage holds now (0 while [`resize_storage`] has it freed).
pub fn storage_nbytes(t: &Tensor) -> usize {
    let mut out = 0i64;
    // SAFETY: a live tch tensor borrowed for the call; `out` is written on success.
    check("reading a storage's size", |err| unsafe {
        titan_storage_nbytes(raw(t), &mut out, err)
    });
    out as usize
}

/// Gives `t`'s storage `nbytes` of fresh memory (0: frees it) in place; every tensor sharing the
/// storage, autograd's saved ones included, sees it.
pub fn resize_storage(t: &Tensor, nbytes: usize) {
    // SAFETY: a live tch tensor borrowed for the call.
    check("resizing a parameter's storage", |err| unsafe {
        titan_storage_resize(raw(t), nbytes as i64, err)
    });
}

/// `dst.copy_(src)` that leaves `dst`'s version counter as it was, so the autograd graph that
/// saved `dst` still accepts it.
pub fn copy_keep_version(dst: &Tensor, src: &Tensor) {
    // SAFETY: live tch tensors borrowed for the call.
    check("restoring a parameter", |err| unsafe {
        titan_copy_keep_version(raw(dst), raw(src), err)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// y = 3x in forward; backward doubles the incoming gradient once more (a made-up rule, to
    /// see that the custom backward is the one that runs).
    struct Odd;
    impl Function for Odd {
        fn forward(&mut self, x: &[Tensor]) -> Vec<Tensor> {
            vec![&x[0] * 3.0]
        }
        fn backward(&mut self, g: &[Tensor]) -> Vec<Tensor> {
            vec![&g[0] * 6.0]
        }
    }

    #[test]
    fn custom_backward_runs() {
        let x = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let y = apply(Odd, &[&x], 1).remove(0);
        assert_eq!(Vec::<f32>::try_from(&y.detach()).unwrap(), vec![3.0, 6.0]);
        (&y * 2.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&x.grad()).unwrap(), vec![12.0, 12.0]);
    }

    struct Fails;
    impl Function for Fails {
        fn forward(&mut self, x: &[Tensor]) -> Vec<Tensor> {
            vec![x[0].shallow_clone()]
        }
        fn backward(&mut self, _g: &[Tensor]) -> Vec<Tensor> {
            panic!("rank 3 closed the connection")
        }
    }

    #[test]
    fn a_failing_backward_is_an_error() {
        let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = apply(Fails, &[&x], 1).remove(0);
        let err = (&y * 2.0).sum(Kind::Float).f_backward().unwrap_err();
        assert!(err.to_string().contains("rank 3 closed"), "{err}");
    }

    #[test]
    fn storage_freed_and_restored_under_autograd() {
        let w = Tensor::from_slice(&[2.0f32, 3.0]).set_requires_grad(true);
        // `full` stands for an unsharded parameter: saved by the mul for backward.
        let full = apply(Identity, &[&w], 1).remove(0);
        let x = Tensor::from_slice(&[5.0f32, 7.0]).set_requires_grad(true);
        let y = (&x * &full).sum(Kind::Float);
        let keep = tch::no_grad(|| full.detach().copy());
        resize_storage(&full, 0);
        // Freed: the storage autograd saved holds no bytes until it is refilled.
        assert_eq!(storage_nbytes(&full), 0);
        resize_storage(&full, 2 * 4);
        assert_eq!(storage_nbytes(&full), 2 * 4);
        copy_keep_version(&full, &keep);
        y.backward();
        assert_eq!(Vec::<f32>::try_from(&x.grad()).unwrap(), vec![2.0, 3.0]);
    }

    struct Identity;
    impl Function for Identity {
        fn forward(&mut self, x: &[Tensor]) -> Vec<Tensor> {
            vec![x[0].copy()]
        }
        fn backward(&mut self, g: &[Tensor]) -> Vec<Tensor> {
            vec![g[0].shallow_clone()]
        }
    }
}
