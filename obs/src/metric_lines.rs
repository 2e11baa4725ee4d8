//! torchtitan's per-step metric lines as they are gathered: per (step, name, reduce) one
//! [`Acc`] of the values recorded, in first-recorded order. `analysis::metrics` fills them from
//! a run's scalars; the per-part summaries keep the same cells and their merge fills them in
//! the same (rank, part) order, so both print the same lines.

use std::collections::BTreeMap;

use crate::schema::Reduce;

/// The values of one (step, name, reduce) cell: what any reduce needs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acc {
    pub sum: f64,
    pub count: u64,
    pub min: f64,
    pub max: f64,
}

impl Acc {
    pub(crate) fn add(&mut self, v: f64) {
        self.merge(&Acc {
            sum: v,
            count: 1,
            min: v,
            max: v,
        });
    }
    /// Adds another cell's values (a later part's, or a later rank's).
    pub(crate) fn merge(&mut self, o: &Acc) {
        if o.count == 0 {
            return;
        }
        if self.count == 0 {
            *self = *o;
            return;
        }
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        self.sum += o.sum;
        self.count = self.count.saturating_add(o.count);
    }
    pub(crate) fn get(&self, r: Reduce) -> f64 {
        match r {
            Reduce::Mean => self.sum / self.count as f64,
            Reduce::Sum => self.sum,
            Reduce::Min => self.min,
            Reduce::Max => self.max,
        }
    }
}

/// Column order (first recorded first) and accumulators of one line.
type LineAcc = (Vec<(u32, Reduce)>, BTreeMap<(u32, Reduce), Acc>);

/// The metric lines being gathered: from the scalars, or from the per-part summaries' cells
/// merged in the same (rank, part) order.
#[derive(Debug, Clone, Default)]
pub struct Lines(pub(crate) BTreeMap<(u64, bool), LineAcc>);

impl Lines {
    /// Merges `acc` into (step, name, reduce); `validation`: the name is `validation/...`.
    pub(crate) fn add(
        &mut self,
        step: u64,
        validation: bool,
        name: u32,
        reduce: Reduce,
        acc: &Acc,
    ) {
        let (order, accs) = self.0.entry((step, validation)).or_default();
        let key = (name, reduce);
        accs.entry(key)
            .or_insert_with(|| {
                order.push(key);
                Acc::default()
            })
            .merge(acc);
    }
}

impl Lines {
    /// Every (step, name id, reduce, reduced value), in step order.
    pub fn values(&self) -> impl Iterator<Item = (u64, u32, Reduce, f64)> + '_ {
        self.0.iter().flat_map(|(&(step, _), (order, accs))| {
            order
                .iter()
                .filter_map(move |k| Some((step, k.0, k.1, accs.get(k)?.get(k.1))))
        })
    }
}

/// Whether scalar `name` goes on `validate step:` lines.
pub(crate) fn is_validation(name: &str) -> bool {
    name.starts_with("validation/")
}
