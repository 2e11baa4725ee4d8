//! What selective activation checkpointing keeps of a block (torchtitan 0.3.0's `SelectiveAC`
//! policy): the forward run records the outputs the policy saves, and the recompute in backward
//! takes them back, in the same order, instead of computing them again.
//!
//! A [`Kept`] holds one kind of output for one run of one block: every other matmul's
//! (`Matmuls` in `parallel_model`), or the collectives torchtitan's policy saves —
//! `reduce_scatter_tensor` (tensor parallelism's exit under sequence parallelism) and
//! `all_to_all_single` (expert parallelism's exchanges) — so that a recompute communicates only
//! where torchtitan's does (its all-gathers and all-reduces are recomputed).

use std::cell::RefCell;
use std::collections::VecDeque;

use tch::Tensor;

/// One kind of kept output of one run of a selectively checkpointed block (a run that keeps
/// nothing has none: [`Kept::keep_in`] with `None`).
pub struct Kept(RefCell<Memo>);

enum Memo {
    Record(Vec<Tensor>),
    Replay(VecDeque<Tensor>),
}

impl Kept {
    /// Records when `replay` is `None` (the forward run), else replays it (the recompute).
    pub fn new(replay: Option<VecDeque<Tensor>>) -> Self {
        Kept(RefCell::new(match replay {
            None => Memo::Record(Vec::new()),
            Some(kept) => Memo::Replay(kept),
        }))
    }

    /// `compute()`, kept when recording. When replaying, `replay(value)` with the value the
    /// forward run kept: it must give that value back with `compute`'s backward, without
    /// computing it. `what` names the output for the error of a recompute that asks for more
    /// than the forward kept (it ran differently: a bug).
    pub fn keep(
        &self,
        what: &str,
        compute: impl FnOnce() -> Tensor,
        replay: impl FnOnce(Tensor) -> Tensor,
    ) -> Tensor {
        // The borrow ends before `compute` or `replay` runs: either may keep outputs of another
        // kind, or run code that does.
        let kept = match &mut *self.0.borrow_mut() {
            Memo::Record(_) => None,
            Memo::Replay(record) => Some(record.pop_front().unwrap_or_else(|| {
                panic!("the recompute asks for a {what} the forward run did not keep")
            })),
        };
        if let Some(value) = kept {
            return replay(value);
        }
        let value = compute();
        if let Memo::Record(record) = &mut *self.0.borrow_mut() {
            record.push(value.shallow_clone());
        }
        value
    }

    /// [`Kept::keep`] in `kept`, where there is one; else `compute()` (a run that keeps
    /// nothing).
    pub fn keep_in(
        kept: Option<&Kept>,
        what: &str,
        compute: impl FnOnce() -> Tensor,
        replay: impl FnOnce(Tensor) -> Tensor,
    ) -> Tensor {
        match kept {
            Some(kept) => kept.keep(what, compute, replay),
            None => compute(),
        }
    }

    /// What a recording run kept, for the replay (`None` after a replay).
    pub fn into_recorded(self) -> Option<VecDeque<Tensor>> {
        match self.0.into_inner() {
            Memo::Record(record) => Some(record.into()),
            Memo::Replay(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replay_takes_back_what_the_forward_kept_in_order() {
        let record = Kept::new(None);
        let a = record.keep("x", || Tensor::from(1.0), |_| unreachable!());
        let b = record.keep("x", || Tensor::from(2.0), |_| unreachable!());
        assert_eq!((a.double_value(&[]), b.double_value(&[])), (1.0, 2.0));
        let replay = Kept::new(record.into_recorded());
        let mut computed = 0;
        for want in [1.0, 2.0] {
            let got = replay.keep(
                "x",
                || {
                    computed += 1;
                    Tensor::from(0.0)
                },
                |kept| kept,
            );
            assert_eq!(got.double_value(&[]), want);
        }
        assert_eq!(computed, 0, "a replay computes nothing it kept");
        assert!(replay.into_recorded().is_none());
        let c = Kept::keep_in(None, "x", || Tensor::from(3.0), |_| unreachable!());
        assert_eq!(c.double_value(&[]), 3.0);
    }
}
