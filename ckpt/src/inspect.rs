//! Reports on checkpoints: `inspect` (what is in it), `verify` (is it whole and consistent) and
//! `diff` (per-tensor max abs difference between two checkpoints of any formats).

use rayon::prelude::*;
use serde::Serialize;

use crate::assemble::{Layout, TensorReader};
use crate::cast;
use crate::error::Result;
use crate::plan::{CheckpointPlan, Format, TensorPlan};
use crate::write::Progress;

#[derive(Debug, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub chunks: usize,
    pub bytes: u64,
    /// A block-quantized float8 weight's scales.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_scales: Option<ScaleInfo>,
}

/// The block scales of a float8 weight, as `inspect` shows them.
#[derive(Debug, Serialize)]
pub struct ScaleInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Rows x columns of the weight per scale.
    pub block: [u64; 2],
    /// Why the scales do not fit the weight, if they do not (`verify` fails on it).
    pub problem: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct InspectReport {
    pub path: String,
    pub format: Format,
    pub files: usize,
    pub tensor_count: usize,
    /// Elements of model tensors (not optimizer, lr_scheduler, dataloader, train_state, RNG).
    pub parameter_count: u64,
    /// Elements of every tensor.
    pub total_elements: u64,
    pub total_bytes: u64,
    pub tensors: Vec<TensorInfo>,
    /// Non-tensor items (DCP native only).
    pub bytes_items: Vec<String>,
}

pub fn inspect(plan: &CheckpointPlan) -> InspectReport {
    InspectReport {
        path: plan.root.display(),
        format: plan.format,
        files: plan.files.len(),
        tensor_count: plan.tensors.len(),
        parameter_count: plan.parameter_count(),
        total_elements: plan.total_elements(),
        total_bytes: plan.total_bytes(),
        tensors: plan
            .tensors
            .iter()
            .map(|(n, t)| TensorInfo {
                name: n.clone(),
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                chunks: t.chunks.len(),
                bytes: t.nbytes(),
                block_scales: t.scales.as_deref().map(|s| ScaleInfo {
                    name: s.name.clone(),
                    dtype: s.tensor.dtype.to_string(),
                    shape: s.tensor.shape.clone(),
                    block: s.block,
                    problem: crate::fp8::check_shape(plan, n, t, s)
                        .err()
                        .map(|e| e.to_string()),
                }),
            })
            .collect(),
        bytes_items: plan.bytes_items.keys().cloned().collect(),
    }
}

/// Human-readable byte counts.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

impl InspectReport {
    pub fn render(&self) -> String {
        let mut s = format!(
            "{}  format {}  {} files  {} tensors  {} model parameters  {} elements in all  {}\n\n",
            self.path,
            self.format,
            self.files,
            self.tensor_count,
            self.parameter_count,
            self.total_elements,
            human_bytes(self.total_bytes)
        );
        let w = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(6);
        s.push_str(&format!(
            "{:<w$}  {:<7}  {:<20}  {:>6}  {:>10}\n",
            "tensor", "dtype", "shape", "chunks", "bytes"
        ));
        for t in &self.tensors {
            s.push_str(&format!(
                "{:<w$}  {:<7}  {:<20}  {:>6}  {:>10}\n",
                t.name,
                t.dtype,
                format!("{:?}", t.shape),
                t.chunks,
                human_bytes(t.bytes)
            ));
            if let Some(b) = &t.block_scales {
                s.push_str(&format!(
                    "{:<w$}    scales {} {} {:?}, one per {}x{} block{}\n",
                    "",
                    b.name,
                    b.dtype,
                    b.shape,
                    b.block[0],
                    b.block[1],
                    b.problem
                        .as_ref()
                        .map(|p| format!(": DOES NOT FIT: {p}"))
                        .unwrap_or_default()
                ));
            }
        }
        if !self.bytes_items.is_empty() {
            s.push_str(&format!(
                "\nnon-tensor items: {}\n",
                self.bytes_items.join(", ")
            ));
        }
        s
    }
}

/// Outcome of `verify`.
#[derive(Debug, Serialize)]
pub struct VerifyReport {
    pub path: String,
    /// The `step-N` folder checked when `path` is a run or checkpoint folder (its newest
    /// complete step), else None.
    pub checked: Option<String>,
    pub ok: bool,
    pub format: Option<Format>,
    pub tensors: usize,
    pub chunks: usize,
    /// Block-quantized float8 weights whose scales were checked.
    pub block_scaled: usize,
    /// The mixture-of-experts checks (None when verify stopped before them).
    pub experts: Option<crate::experts::ExpertReport>,
    /// Every problem found, one per line.
    pub error: Option<String>,
    /// What verify warns of without failing (`--strict` fails on them): bit-identical experts.
    pub warnings: Vec<String>,
}

/// `[8]` as `8`, `[4, 8]` as `4 or 8` (counts that differ between layers).
pub fn list(values: &[u64]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(" or ")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiffStatus {
    Equal,
    Differs,
    ShapeDiffers,
    OnlyInA,
    OnlyInB,
}

#[derive(Debug, Serialize)]
pub struct TensorDiff {
    pub name: String,
    pub status: DiffStatus,
    pub dtype_a: Option<String>,
    pub dtype_b: Option<String>,
    pub shape_a: Option<Vec<u64>>,
    pub shape_b: Option<Vec<u64>>,
    /// Max |a - b| over all elements (NaN compares equal to NaN; NaN vs a number is infinite).
    pub max_abs_diff: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct DiffReport {
    pub a: String,
    pub b: String,
    pub atol: f64,
    /// Same names on both sides, every one within `atol`.
    pub equal: bool,
    /// Tensors present on both sides (whose values were compared).
    pub compared: usize,
    /// Of those, the ones whose values (or shapes) differ.
    pub differing: usize,
    /// Tensors only A has, and only B has: not differences in value, a different name set
    /// (torchtitan vs HF names: `--adapter`).
    pub only_in_a: usize,
    pub only_in_b: usize,
    pub tensors: Vec<TensorDiff>,
}

impl DiffReport {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let rows: Vec<&TensorDiff> = self
            .tensors
            .iter()
            .filter(|t| t.status != DiffStatus::Equal)
            .collect();
        if !rows.is_empty() {
            let w = rows.iter().map(|t| t.name.len()).max().unwrap_or(6).max(6);
            s.push_str(&format!(
                "{:<w$}  {:<14}  {:>12}  {}\n",
                "tensor", "status", "max_abs_diff", "a / b"
            ));
            for t in rows {
                let status = match t.status {
                    DiffStatus::Differs => "differs",
                    DiffStatus::ShapeDiffers => "shape differs",
                    DiffStatus::OnlyInA => "only in A",
                    DiffStatus::OnlyInB => "only in B",
                    DiffStatus::Equal => "equal",
                };
                let d = t
                    .max_abs_diff
                    .map(|d| format!("{d:.6e}"))
                    .unwrap_or_else(|| "-".into());
                let side = |dt: &Option<String>, sh: &Option<Vec<u64>>| match (dt, sh) {
                    (Some(dt), Some(sh)) => format!("{dt}{sh:?}"),
                    _ => "-".into(),
                };
                s.push_str(&format!(
                    "{:<w$}  {:<14}  {:>12}  {} / {}\n",
                    t.name,
                    status,
                    d,
                    side(&t.dtype_a, &t.shape_a),
                    side(&t.dtype_b, &t.shape_b)
                ));
            }
            s.push('\n');
        }
        s.push_str(&format!(
            "{} tensors in both: {} equal, {} differ in value (atol {}); {} only in A, {} only \
             in B: {}\n",
            self.compared,
            self.compared - self.differing,
            self.differing,
            self.atol,
            self.only_in_a,
            self.only_in_b,
            if self.equal { "EQUAL" } else { "DIFFERENT" }
        ));
        s
    }
}

/// Compares every tensor of `a` and `b`.
pub fn diff(
    a: &CheckpointPlan,
    b: &CheckpointPlan,
    atol: f64,
    workers: usize,
    progress: &dyn Progress,
) -> Result<DiffReport> {
    let fa = a.open_files()?;
    let fb = b.open_files()?;
    let mut names: Vec<&String> = a.tensors.keys().chain(b.tensors.keys()).collect();
    names.sort();
    names.dedup();
    progress.set_length(
        names
            .iter()
            .filter_map(|n| a.tensors.get(*n).filter(|_| b.tensors.contains_key(*n)))
            .map(TensorPlan::nbytes)
            .sum(),
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(workers.max(1))
        .build()
        .map_err(|e| crate::Error::usage(format!("cannot start worker threads: {e}")))?;
    let tensors: Vec<TensorDiff> = pool.install(|| {
        names
            .par_iter()
            .map_init(
                || (TensorReader::new(a, &fa), TensorReader::new(b, &fb)),
                |(ra, rb), name| -> Result<TensorDiff> {
                    let (ta, tb) = (a.tensors.get(*name), b.tensors.get(*name));
                    let mut d = TensorDiff {
                        name: name.to_string(),
                        status: DiffStatus::Equal,
                        dtype_a: ta.map(|t| t.dtype.to_string()),
                        dtype_b: tb.map(|t| t.dtype.to_string()),
                        shape_a: ta.map(|t| t.shape.clone()),
                        shape_b: tb.map(|t| t.shape.clone()),
                        max_abs_diff: None,
                    };
                    match (ta, tb) {
                        (Some(_), None) => d.status = DiffStatus::OnlyInA,
                        (None, Some(_)) => d.status = DiffStatus::OnlyInB,
                        (Some(ta), Some(tb)) if ta.shape != tb.shape => {
                            d.status = DiffStatus::ShapeDiffers
                        }
                        (Some(ta), Some(tb)) => {
                            let m = max_abs_diff(ra, rb, ta, tb, progress)?;
                            d.max_abs_diff = Some(m);
                            if m > atol || m.is_nan() {
                                d.status = DiffStatus::Differs;
                            }
                        }
                        (None, None) => unreachable!(),
                    }
                    Ok(d)
                },
            )
            .collect::<Result<Vec<_>>>()
    })?;
    let count = |want: &[DiffStatus]| tensors.iter().filter(|t| want.contains(&t.status)).count();
    let only_in_a = count(&[DiffStatus::OnlyInA]);
    let only_in_b = count(&[DiffStatus::OnlyInB]);
    let differing = count(&[DiffStatus::Differs, DiffStatus::ShapeDiffers]);
    Ok(DiffReport {
        a: a.root.display(),
        b: b.root.display(),
        atol,
        equal: differing == 0 && only_in_a == 0 && only_in_b == 0,
        compared: tensors.len() - only_in_a - only_in_b,
        differing,
        only_in_a,
        only_in_b,
        tensors,
    })
}

fn max_abs_diff(
    ra: &mut TensorReader,
    rb: &mut TensorReader,
    ta: &TensorPlan,
    tb: &TensorPlan,
    progress: &dyn Progress,
) -> Result<f64> {
    let numel = ta.numel();
    // Windows must be whole rows for both layouts; one row length divides the other.
    let row = Layout::of(ta).row_len.max(Layout::of(tb).row_len).max(1);
    let per = ((8 << 20) / (row * ta.dtype.size().max(tb.dtype.size()) as u64)).max(1) * row;
    let exact_ints = !ta.dtype.is_float() && !tb.dtype.is_float();
    let (mut ba, mut bb) = (Vec::new(), Vec::new());
    let mut m = 0f64;
    let mut s = 0;
    while s < numel {
        let e = (s + per).min(numel);
        ba.resize(((e - s) * ta.dtype.size() as u64) as usize, 0);
        bb.resize(((e - s) * tb.dtype.size() as u64) as usize, 0);
        ra.read(ta, s..e, &mut ba)?;
        rb.read(tb, s..e, &mut bb)?;
        if ta.dtype == tb.dtype && ba == bb {
            // Bit-identical window.
        } else if exact_ints {
            for i in 0..(e - s) as usize {
                let d = (cast::element_i128(ta.dtype, &ba, i)
                    - cast::element_i128(tb.dtype, &bb, i))
                .unsigned_abs();
                m = m.max(d as f64);
            }
        } else {
            for i in 0..(e - s) as usize {
                let (x, y) = (
                    cast::element_f64(ta.dtype, &ba, i),
                    cast::element_f64(tb.dtype, &bb, i),
                );
                let d = if x.is_nan() && y.is_nan() {
                    0.0
                } else if x.is_nan() || y.is_nan() {
                    f64::INFINITY
                } else if x == y {
                    0.0
                } else {
                    (x - y).abs()
                };
                m = m.max(d);
            }
        }
        progress.inc((e - s) * ta.dtype.size() as u64);
        s = e;
    }
    Ok(m)
}
