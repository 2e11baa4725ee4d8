//! Reading windows of a global tensor out of its chunks, with memory bounded by the window.
//!
//! Each tensor is viewed as `rows x row_len` elements, split at the deepest dimension `d` any
//! chunk is split along: every chunk then covers, in each outer row it touches, one contiguous
//! column range, and its rows are contiguous in its own bytes. When no chunk is split below
//! dimension 0 (row-sharded, replicated or whole tensors) each chunk is one contiguous run of the
//! output and windows are plain byte ranges; otherwise (column-sharded) a window is a block of
//! whole rows, assembled with one read per chunk.

use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, Chunk, Encoding, TensorPlan};
use crate::storage::InFile;

/// How a tensor's chunks lie in its C-order bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The deepest dimension along which some chunk is split (0 when every chunk is one run).
    pub split_dim: usize,
    /// Product of the dimensions before `split_dim`.
    pub rows: u64,
    /// Elements per row: product of the dimensions from `split_dim` on.
    pub row_len: u64,
}

impl Layout {
    pub fn of(t: &TensorPlan) -> Layout {
        let rank = t.shape.len();
        let mut split_dim = 0;
        for c in t.chunks.iter().filter(|c| c.numel() > 0) {
            let d = (0..rank)
                .rev()
                .find(|&d| c.sizes[d] != t.shape[d])
                .unwrap_or(0);
            split_dim = split_dim.max(d);
        }
        let rows = t.shape[..split_dim].iter().product();
        let row_len = t.shape[split_dim..].iter().product();
        Layout {
            split_dim,
            rows,
            row_len,
        }
    }

    /// Whether every chunk is one contiguous run of the tensor's bytes.
    pub fn is_runs(&self) -> bool {
        self.split_dim == 0
    }
}

/// Element ranges to process `t` in, each at most about `max_bytes` (at least one row).
pub fn windows(t: &TensorPlan, max_bytes: u64) -> Vec<Range<u64>> {
    windows_in(t, 0..t.numel(), max_bytes)
}

/// Windows over the elements `range` of `t` (which starts on a whole row of its layout).
pub fn windows_in(t: &TensorPlan, range: Range<u64>, max_bytes: u64) -> Vec<Range<u64>> {
    let es = t.dtype.size() as u64;
    let layout = Layout::of(t);
    let step = if layout.is_runs() {
        (max_bytes / es).max(1)
    } else {
        let rows = (max_bytes / (layout.row_len * es).max(1)).clamp(1, 1 << 16);
        rows * layout.row_len
    };
    let mut out = Vec::new();
    let mut s = range.start;
    while s < range.end {
        let e = (s + step).min(range.end);
        out.push(s..e);
        s = e;
    }
    out
}

/// The element range of the global tensor a run-shaped chunk covers (split_dim 0 layouts).
pub fn run_of(t: &TensorPlan, c: &Chunk) -> Range<u64> {
    let inner: u64 = t.shape.iter().skip(1).product();
    let start = c.offsets.first().copied().unwrap_or(0) * inner;
    start..start + c.numel()
}

/// A decoded DCP item, keyed by (file index, item offset).
type CachedItem = ((usize, u64), Arc<Vec<u8>>);

/// Reads windows of tensors of one plan. Not shared between threads (it caches a decoded item).
pub struct TensorReader<'a> {
    plan: &'a CheckpointPlan,
    files: &'a [InFile],
    cached: Option<CachedItem>,
    scratch: Vec<u8>,
}

impl<'a> TensorReader<'a> {
    pub fn new(plan: &'a CheckpointPlan, files: &'a [InFile]) -> Self {
        TensorReader {
            plan,
            files,
            cached: None,
            scratch: Vec::new(),
        }
    }

    /// Reads `len` bytes at `offset` of `chunk`'s own C-order bytes.
    pub fn read_chunk(&mut self, chunk: &Chunk, offset: u64, out: &mut [u8]) -> Result<()> {
        let file = &self.files[chunk.source.file];
        match &chunk.source.encoding {
            Encoding::Raw => {
                let start = chunk.source.begin + offset;
                if start + out.len() as u64 > chunk.source.end {
                    return Err(Error::invalid(
                        &file.name,
                        "internal: read past the chunk's byte range",
                    ));
                }
                Ok(file.read_at(start, out)?)
            }
            Encoding::DcpItem { fqn, chunk: index } => {
                let key = (chunk.source.file, chunk.source.begin);
                let bytes = match &self.cached {
                    Some((k, b)) if *k == key => b.clone(),
                    _ => {
                        let dcp = self.plan.dcp.as_ref().ok_or_else(|| {
                            Error::invalid(&file.name, "internal: DCP items without a DCP reader")
                        })?;
                        let b = Arc::new(dcp.decode_chunk(fqn, *index)?);
                        self.cached = Some((key, b.clone()));
                        b
                    }
                };
                let s = offset as usize;
                let src = bytes.get(s..s + out.len()).ok_or_else(|| {
                    Error::invalid(
                        &file.name,
                        format!(
                            "item holds {} bytes, fewer than its chunk needs",
                            bytes.len()
                        ),
                    )
                })?;
                out.copy_from_slice(src);
                Ok(())
            }
        }
    }

    /// Like [`TensorReader::read`] for any element range: a range that cuts rows of a
    /// column-sharded layout is read as its enclosing whole rows, then trimmed.
    pub fn read_any(&mut self, t: &TensorPlan, range: Range<u64>, out: &mut [u8]) -> Result<()> {
        let l = Layout::of(t).row_len.max(1);
        let whole = range.start.is_multiple_of(l)
            && (range.end.is_multiple_of(l) || range.end == t.numel());
        if Layout::of(t).is_runs() || whole {
            return self.read(t, range, out);
        }
        let es = t.dtype.size() as u64;
        let start = range.start / l * l;
        let end = (range.end.div_ceil(l) * l).min(t.numel());
        let mut rows = vec![0u8; ((end - start) * es) as usize];
        self.read(t, start..end, &mut rows)?;
        let skip = ((range.start - start) * es) as usize;
        out.copy_from_slice(&rows[skip..skip + out.len()]);
        Ok(())
    }

    /// Fills `out` with the elements `range` of tensor `t` (C order, the tensor's dtype).
    pub fn read(&mut self, t: &TensorPlan, range: Range<u64>, out: &mut [u8]) -> Result<()> {
        let es = t.dtype.size() as u64;
        debug_assert_eq!(out.len() as u64, (range.end - range.start) * es);
        let layout = Layout::of(t);
        if layout.is_runs() {
            for c in &t.chunks {
                let run = run_of(t, c);
                let s = run.start.max(range.start);
                let e = run.end.min(range.end);
                if s >= e {
                    continue;
                }
                let dst =
                    &mut out[((s - range.start) * es) as usize..((e - range.start) * es) as usize];
                self.read_chunk(c, (s - run.start) * es, dst)?;
            }
            return Ok(());
        }
        let l = layout.row_len;
        if !range.start.is_multiple_of(l)
            || (!range.end.is_multiple_of(l) && range.end != t.numel())
        {
            return Err(Error::invalid(
                "reader",
                "internal: column-sharded windows must be whole rows",
            ));
        }
        let (r0, r1) = (range.start / l, range.end.div_ceil(l));
        let d = layout.split_dim;
        let inner: u64 = t.shape[d + 1..].iter().product();
        for c in &t.chunks {
            if c.numel() == 0 {
                continue;
            }
            let covered = covered_rows(&t.shape[..d], &c.offsets[..d], &c.sizes[..d], r0..r1);
            let (Some(&(_, lmin)), Some(&(_, lmax))) = (covered.first(), covered.last()) else {
                continue;
            };
            let crow = c.sizes[d] * inner * es;
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.resize(((lmax - lmin + 1) * crow) as usize, 0);
            self.read_chunk(c, lmin * crow, &mut scratch)?;
            let col = c.offsets[d] * inner * es;
            for &(r, lr) in &covered {
                let src = ((lr - lmin) * crow) as usize;
                let dst = ((r - r0) * l * es + col) as usize;
                out[dst..dst + crow as usize].copy_from_slice(&scratch[src..src + crow as usize]);
            }
            self.scratch = scratch;
        }
        Ok(())
    }
}

/// The outer rows in `rows` that a chunk box (over the outer dims) covers, each with the row's
/// index inside the chunk. Both increase together.
fn covered_rows(
    outer: &[u64],
    offsets: &[u64],
    sizes: &[u64],
    rows: Range<u64>,
) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    if outer.len() == 1 {
        let s = rows.start.max(offsets[0]);
        let e = rows.end.min(offsets[0] + sizes[0]);
        for r in s..e {
            out.push((r, r - offsets[0]));
        }
        return out;
    }
    for r in rows {
        // Multi-index of r over the outer dims (C order), checked against the box.
        let mut rem = r;
        let mut idx = vec![0u64; outer.len()];
        for (i, &n) in idx.iter_mut().zip(outer).rev() {
            *i = rem % n;
            rem /= n;
        }
        let mut local = 0;
        let mut inside = true;
        for ((&i, &o), &s) in idx.iter().zip(offsets).zip(sizes) {
            if i < o || i >= o + s {
                inside = false;
                break;
            }
            local = local * s + (i - o);
        }
        if inside {
            out.push((r, local));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{ChunkSource, Format};
    use crate::storage::Root;
    use proptest::prelude::*;
    use titan_dcp::Dtype;

    /// Writes each chunk of a random tiling of `shape` as its own C-order bytes into one file,
    /// then checks that reading every window reproduces the global tensor.
    fn roundtrip(shape: Vec<u64>, cuts: Vec<Vec<u64>>, window: u64) {
        let dir = tempfile::tempdir().unwrap();
        let numel: u64 = shape.iter().product();
        let global: Vec<u8> = (0..numel * 2).map(|i| (i * 7 % 251) as u8).collect();
        // Grid tiling: per dimension, sorted cut points.
        let bounds: Vec<Vec<u64>> = shape
            .iter()
            .zip(&cuts)
            .map(|(&n, cs)| {
                let mut b: Vec<u64> = cs.iter().map(|c| c % (n + 1)).collect();
                b.push(0);
                b.push(n);
                b.sort();
                b.dedup();
                b
            })
            .collect();
        let mut boxes: Vec<(Vec<u64>, Vec<u64>)> = vec![(vec![], vec![])];
        for b in &bounds {
            let mut next = Vec::new();
            for (o, s) in &boxes {
                for w in b.windows(2) {
                    let mut o2 = o.clone();
                    let mut s2 = s.clone();
                    o2.push(w[0]);
                    s2.push(w[1] - w[0]);
                    next.push((o2, s2));
                }
            }
            boxes = next;
        }
        let mut bytes = Vec::new();
        let mut chunks = Vec::new();
        for (o, s) in boxes {
            let begin = bytes.len() as u64;
            let n: u64 = s.iter().product();
            for k in 0..n {
                let mut rem = k;
                let mut idx = vec![0; s.len()];
                for (i, &n) in idx.iter_mut().zip(&s).rev() {
                    *i = rem % n;
                    rem /= n;
                }
                let mut gi = 0;
                for ((&g, &off), &i) in shape.iter().zip(&o).zip(&idx) {
                    gi = gi * g + off + i;
                }
                bytes.extend_from_slice(&global[(gi * 2) as usize..(gi * 2 + 2) as usize]);
            }
            chunks.push(Chunk {
                offsets: o,
                sizes: s,
                source: ChunkSource {
                    file: 0,
                    begin,
                    end: bytes.len() as u64,
                    encoding: Encoding::Raw,
                },
            });
        }
        std::fs::write(dir.path().join("f"), &bytes).unwrap();
        let t = TensorPlan {
            dtype: Dtype::BF16,
            shape: shape.clone(),
            chunks,
            scales: None,
        };
        let root = Root::local(dir.path());
        let plan = CheckpointPlan {
            format: Format::DcpHf,
            root: root.clone(),
            files: vec!["f".into()],
            tensors: [("t".to_string(), t.clone())].into(),
            bytes_items: Default::default(),
            dcp: None,
        };
        plan.check_coverage().unwrap();
        let files = vec![root.open("f").unwrap()];
        let mut reader = TensorReader::new(&plan, &files);
        let mut got = Vec::new();
        for w in windows(&t, window) {
            let mut buf = vec![0u8; ((w.end - w.start) * 2) as usize];
            reader.read(&t, w, &mut buf).unwrap();
            got.extend_from_slice(&buf);
        }
        assert_eq!(got, global);
    }

    #[test]
    fn row_col_and_3d_tilings() {
        roundtrip(vec![13, 7], vec![vec![7], vec![]], 16);
        roundtrip(vec![5, 11], vec![vec![], vec![6]], 16);
        roundtrip(vec![2, 9, 3], vec![vec![], vec![5], vec![]], 10);
        roundtrip(vec![6, 4, 5], vec![vec![2, 3], vec![1], vec![4]], 7);
        roundtrip(vec![17], vec![vec![9]], 8);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_tilings_reassemble_exactly(
            shape in proptest::collection::vec(1u64..7, 1..4),
            cuts in proptest::collection::vec(proptest::collection::vec(0u64..8, 0..3), 3),
            window in 1u64..64,
        ) {
            let cuts = cuts[..shape.len()].to_vec();
            roundtrip(shape, cuts, window);
        }
    }
}
