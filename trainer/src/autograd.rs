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

type FnCall = unsafe extern "C" fn(
    ctx: *mut c_void,
    inputs: *mut *mut c_void,
    n_in: i64,
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
) -> i32;
type FnDrop = unsafe extern "C" fn(ctx: *mut c_void);

unsafe extern "C" {
    fn titan_function_apply(
        ctx: *mut c_void,
        forward: FnCall,
        backward: FnCall,
        drop: FnDrop,
        inputs: *mut *mut c_void,
        n_in: i64,
        outputs: *mut *mut c_void,
        n_out: i64,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_storage_resize(t: *mut c_void, nbytes: i64, err: *mut *mut c_char) -> i32;
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

/// Applies `f` to `inputs`, returning its `n_out` outputs connected to the autograd graph.
/// Panics (as tch's ops do) if `f` panics in forward; a panic in backward fails the backward pass
/// with the panic's message.
pub fn apply<F: Function>(f: F, inputs: &[&Tensor], n_out: usize) -> Vec<Tensor> {
    let ctx = Box::into_raw(Box::new(Mutex::new(f))).cast::<c_void>();
    let mut in_ptrs: Vec<*mut c_void> = inputs.iter().map(|t| raw(t)).collect();
    let mut out_ptrs = vec![std::ptr::null_mut::<c_void>(); n_out];
    // SAFETY: the input pointers are live at::Tensor* borrowed for the call; the shim takes
    // ownership of `ctx` (freed through drop_fn::<F>) and writes n_out owned tensors on success.
    check("autograd function", |err| unsafe {
        titan_function_apply(
            ctx,
            call_fn::<F, false>,
            call_fn::<F, true>,
            drop_fn::<F>,
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

/// Borrows the shim's `n` at::Tensor* as tch tensors (shallow clones; the originals stay the
/// shim's).
unsafe fn borrowed(ptrs: *mut *mut c_void, n: i64) -> Vec<Tensor> {
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

/// The shim's output slots and error slot for one callback.
struct Reply {
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
}

/// Runs `body` on the function behind `ctx`, handing `n_out` tensors to the shim or the panic
/// message to `err`.
unsafe fn run<F: Function>(
    ctx: *mut c_void,
    inputs: *mut *mut c_void,
    n_in: i64,
    reply: Reply,
    body: fn(&mut F, &[Tensor]) -> Vec<Tensor>,
) -> i32 {
    let Reply {
        outputs,
        n_out,
        err,
    } = reply;
    // SAFETY: see `borrowed`.
    let inputs = unsafe { borrowed(inputs, n_in) };
    // SAFETY: ctx is the Box<Mutex<F>> made in `apply`, alive until drop_fn.
    let f = unsafe { &*ctx.cast::<Mutex<F>>() };
    let result = catch_unwind(AssertUnwindSafe(|| {
        let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
        body(&mut f, &inputs)
    }));
    let message = match result {
        Ok(out) if out.len() == n_out as usize => {
            // SAFETY: the output array has n_out slots.
            unsafe { hand_over(out, outputs) };
            return 0;
        }
        Ok(out) => format!("returned {} tensors, expected {n_out}", out.len()),
        Err(panic) => panic_text(panic),
    };
    // SAFETY: the shim passes a writable error slot.
    unsafe { shim::set_message(err, &message) };
    1
}

/// Hands `tensors` to a C++ caller through its output slots (it takes ownership).
///
/// # Safety
/// `outputs` has at least `tensors.len()` slots.
pub(crate) unsafe fn hand_over(
    tensors: impl IntoIterator<Item = Tensor>,
    outputs: *mut *mut c_void,
) {
    for (i, t) in tensors.into_iter().enumerate() {
        // SAFETY: the caller guarantees the slot exists.
        unsafe { *outputs.add(i) = t.as_ptr().cast_mut().cast() };
        std::mem::forget(t);
    }
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
/// input gradients) callback.
unsafe extern "C" fn call_fn<F: Function, const BACKWARD: bool>(
    ctx: *mut c_void,
    inputs: *mut *mut c_void,
    n_in: i64,
    outputs: *mut *mut c_void,
    n_out: i64,
    err: *mut *mut c_char,
) -> i32 {
    let reply = Reply {
        outputs,
        n_out,
        err,
    };
    // SAFETY: forwarded from the shim's contract.
    unsafe {
        run::<F>(ctx, inputs, n_in, reply, |f, x| {
            if BACKWARD {
                f.backward(x)
            } else {
                f.forward(x)
            }
        })
    }
}

unsafe extern "C" fn drop_fn<F>(ctx: *mut c_void) {
    // SAFETY: ctx is the Box<Mutex<F>> made in `apply`; the shim calls this exactly once.
    drop(unsafe { Box::from_raw(ctx.cast::<Mutex<F>>()) });
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
        resize_storage(&full, 2 * 4);
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
