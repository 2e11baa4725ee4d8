//! The zero-bubble split of a linear layer's backward pass: the input-gradient half runs when
//! autograd reaches the layer, the weight-gradient half later, when the pipeline schedule has a
//! slot for it (torch's `stage_backward_input` / `stage_backward_weight`, done as Megatron's
//! zero-bubble pipeline does it, per matmul).
//!
//! A forward that should defer runs its linears through [`deferred_linear`]: an autograd
//! function whose backward returns only `grad_x = g·W` and parks `(x, g)` in the
//! microbatch's [`WeightGradStash`]. [`WeightGradStash::apply`] later computes each
//! `dW = gᵀ·x` — the same product autograd's linear backward computes — and hands it to the
//! weight through autograd, so it reaches the parameter through whatever cast produced the
//! weight, and accumulates into its `.grad` like any other gradient.

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tch::Tensor;

use crate::autograd::{self, Function};

/// One linear's parked weight-gradient inputs.
struct Parked {
    /// The weight as the forward used it (the parameter, or its cast: still in the graph).
    weight: Tensor,
    input: Tensor,
    output_grad: Tensor,
}

/// The weight gradients one microbatch's input-gradient pass left for later.
#[derive(Clone, Default)]
pub struct WeightGradStash(Arc<Mutex<Vec<Parked>>>);

impl WeightGradStash {
    pub fn new() -> Self {
        Self::default()
    }

    fn park(&self, p: Parked) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(p);
    }

    /// How many linears wait for their weight gradient.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The weight-gradient pass: `dW = gᵀ·x` for every parked linear, accumulated into the
    /// parameters' gradients.
    pub fn apply(&self) -> Result<()> {
        let parked = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        for p in parked {
            let (out, inp) = (p.weight.size()[0], p.weight.size()[1]);
            // Values only: x and g belong to a graph the input pass has freed.
            let dw = tch::no_grad(|| {
                p.output_grad
                    .f_reshape([-1, out])
                    .and_then(|g| g.f_tr())
                    .and_then(|gt| gt.f_mm(&p.input.f_reshape([-1, inp])?))
            })
            .context("weight gradient")?;
            // d/dW of sum(W * dW) is exactly dW: it flows to the parameter as autograd would.
            (&p.weight * dw.f_to_kind(p.weight.kind())?)
                .f_sum(p.weight.kind())?
                .f_backward()
                .context("accumulating a weight gradient")?;
        }
        Ok(())
    }
}

/// `x.linear(w)` whose backward computes only the input gradient and parks the rest in
/// `stash`.
pub fn deferred_linear(x: &Tensor, w: &Tensor, stash: &WeightGradStash) -> Tensor {
    let f = DeferredLinear {
        // The caller's tensor, with its autograd history (what the function's forward sees
        // may not carry it): the weight gradient later flows into it.
        weight: w.shallow_clone(),
        input: None,
        stash: stash.clone(),
    };
    let [y]: [Tensor; 1] = autograd::apply(f, &[x, w], 1)
        .try_into()
        .expect("one output");
    y
}

struct DeferredLinear {
    weight: Tensor,
    /// x, from the forward.
    input: Option<Tensor>,
    stash: WeightGradStash,
}

impl Function for DeferredLinear {
    fn forward(&mut self, inputs: &[Tensor]) -> Vec<Tensor> {
        let (x, w) = (&inputs[0], &inputs[1]);
        self.input = Some(x.shallow_clone());
        vec![x.linear::<&Tensor>(w, None)]
    }

    fn backward(&mut self, grads: &[Tensor]) -> Vec<Tensor> {
        let x = self
            .input
            .take()
            .expect("backward runs once, after forward");
        let g = &grads[0];
        let grad_x = g.matmul(&self.weight.detach());
        self.stash.park(Parked {
            weight: self.weight.shallow_clone(),
            input: x.detach(),
            output_grad: g.detach(),
        });
        vec![grad_x, Tensor::new()]
    }
}
