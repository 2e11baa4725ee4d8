//! The copy engine: writes planned safetensors output files from a checkpoint plan.
//!
//! Work is split across a rayon pool: on local outputs every (file, tensor) pair is a task doing
//! positional writes; object store outputs are uploaded sequentially per file (one task per file).
//! A tensor whose chunks are contiguous runs of its bytes is copied range to range
//! (`copy_file_range` between local files, else pread/pwrite through a bounded buffer); other
//! tensors are assembled window by window. Output files appear only when all of them are complete.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use crate::assemble::{self, Layout, TensorReader};
use crate::cast;
use crate::error::{Error, Result};
use crate::fp8::Dequantizer;
use crate::plan::{self, CheckpointPlan, Encoding, TensorPlan};
use crate::safetensors::{self, OutEntry};
use crate::storage::{InFile, OutFile, Root};
use titan_dcp::Dtype;

/// The bytes a single copy or window moves at most (and so the per-thread buffer size).
pub const DEFAULT_WINDOW_BYTES: u64 = 16 << 20;

/// Reorders the rows of a 2-D tensor: q/k RoPE layouts between torchtitan and HF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowMap {
    /// torchtitan -> HF: `w.view(H, D1/H/2, 2, D2).transpose(1, 2).reshape(D1, D2)`.
    ToHf { heads: u64 },
    /// HF -> torchtitan: `w.view(H, 2, D1/H/2, D2).transpose(1, 2).reshape(D1, D2)`.
    FromHf { heads: u64 },
}

impl RowMap {
    /// `rows` must be whole heads of an even head dim for the permutation to be one.
    pub fn check(self, tensor: &str, rows: u64) -> Result<()> {
        let heads = match self {
            RowMap::ToHf { heads } | RowMap::FromHf { heads } => heads,
        };
        if heads == 0 || !rows.is_multiple_of(2 * heads) {
            return Err(Error::usage(format!(
                "`{tensor}`: {rows} rows are not {heads} heads of an even head dim: check \
                 --n-heads / --n-kv-heads"
            )));
        }
        Ok(())
    }

    /// The input row that output row `r` of a `rows`-row tensor comes from.
    pub fn source_row(self, r: u64, rows: u64) -> u64 {
        match self {
            RowMap::ToHf { heads } => {
                let per = rows / heads;
                let half = per / 2;
                let (h, rest) = (r / per, r % per);
                let (j, i) = (rest / half, rest % half);
                h * per + i * 2 + j
            }
            RowMap::FromHf { heads } => {
                let per = rows / heads;
                let half = per / 2;
                let (h, rest) = (r / per, r % per);
                let (i, j) = (rest / 2, rest % 2);
                h * per + j * half + i
            }
        }
    }
}

/// Swaps the two inner dims of every expert of a stacked tensor: input `[E, rows, cols]`, output
/// `[E, cols, rows]` (gpt-oss: torchtitan keeps `[E, out, in]` weights, HF `[E, in, out]`).
///
/// Streamed in tiles of output rows: a tile of `w` output rows of one expert reads `w` columns of
/// each of the expert's `rows` input rows (one read per input row, or one read for the whole
/// expert when the tile is all of it), so every input element is read once and memory is the
/// tile, never the expert or the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertTranspose {
    /// Rows of one expert's input matrix.
    pub rows: u64,
    /// Columns of one expert's input matrix.
    pub cols: u64,
    /// The input columns transposed: `first_col..first_col + width` (all of them, or one half of
    /// Qwen3.5's fused `gate_up_proj`).
    pub first_col: u64,
    pub width: u64,
}

impl ExpertTranspose {
    /// The transpose of the `[.., rows, cols]` tensor `tensor` of shape `shape`.
    pub fn of(tensor: &str, shape: &[u64]) -> Result<ExpertTranspose> {
        match shape {
            [_, rows, cols] => Ok(ExpertTranspose {
                rows: *rows,
                cols: *cols,
                first_col: 0,
                width: *cols,
            }),
            _ => Err(Error::usage(format!(
                "`{tensor}`: stacked experts to transpose need an [E, rows, cols] shape, got \
                 {shape:?}"
            ))),
        }
    }

    /// The output shape for an input of `[experts, rows, cols]`.
    pub fn out_shape(self, experts: u64) -> Vec<u64> {
        vec![experts, self.width, self.rows]
    }

    /// Fills `out` with the output elements `range` (whole output rows of `rows` elements) in
    /// `src`'s dtype; `tile` is scratch space of at most `out`'s size.
    pub fn read(
        self,
        reader: &mut TensorReader,
        src: &TensorPlan,
        range: Range<u64>,
        out: &mut [u8],
        tile: &mut Vec<u8>,
    ) -> Result<()> {
        let (rows, cols, width) = (self.rows, self.cols, self.width);
        let es = src.dtype.size();
        if rows == 0 || width == 0 {
            return Ok(());
        }
        debug_assert!(range.start.is_multiple_of(rows) && range.end.is_multiple_of(rows));
        let (mut k, k_end) = (range.start / rows, range.end / rows);
        while k < k_end {
            // Output row k is input column first_col + k % width of expert k / width.
            let (expert, c0) = (k / width, k % width);
            let c1 = width.min(c0 + (k_end - k));
            let w = c1 - c0;
            let base = expert * rows * cols;
            let row_bytes = (w as usize) * es;
            tile.resize(rows as usize * row_bytes, 0);
            let (c0, c1) = (self.first_col + c0, self.first_col + c1);
            if w == cols {
                reader.read_any(src, base..base + rows * cols, tile)?;
            } else {
                for r in 0..rows {
                    let at = base + r * cols;
                    let dst = &mut tile[r as usize * row_bytes..(r as usize + 1) * row_bytes];
                    reader.read_any(src, at + c0..at + c1, dst)?;
                }
            }
            let o = ((k - range.start / rows) * rows) as usize * es;
            transpose_bytes(tile, rows as usize, w as usize, es, &mut out[o..]);
            k = expert * width + (c1 - self.first_col);
        }
        Ok(())
    }
}

/// Writes the `[n, m]` matrix `a` of `es`-byte elements into `out` as `[m, n]`.
fn transpose_bytes(a: &[u8], n: usize, m: usize, es: usize, out: &mut [u8]) {
    for j in 0..m {
        let row = &mut out[j * n * es..(j + 1) * n * es];
        for (i, dst) in row.chunks_exact_mut(es).enumerate() {
            let s = (i * m + j) * es;
            dst.copy_from_slice(&a[s..s + es]);
        }
    }
}

/// A run of an input tensor's elements (C order): the whole tensor, or one expert's rows of a
/// stacked `[E, ...]` tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceSlice {
    /// Name in the input plan.
    pub tensor: String,
    /// First element.
    pub offset: u64,
    /// Element count.
    pub numel: u64,
}

/// One tensor of an output file.
#[derive(Debug, Clone)]
pub struct OutTensor {
    /// Name in the output.
    pub name: String,
    /// Where its elements come from, concatenated in order: one whole input tensor for a copy,
    /// a slice of one for a split expert, one slice per expert for stacked experts.
    pub sources: Vec<SourceSlice>,
    /// Output dtype (the input's unless converting).
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Row reordering of a single-source 2-D tensor (RoPE q/k layouts).
    pub row_map: Option<RowMap>,
    /// Per-expert transpose of a single-source stacked tensor (gpt-oss expert weights).
    pub transpose: Option<ExpertTranspose>,
    /// Two stacked sources, each transposed per expert by this and the rows put side by side:
    /// `[E, F, D]` twice -> `[E, D, 2F]` (Qwen3.5's `gate_up_proj` from torchtitan's w1, w3).
    pub side_by_side: Option<ExpertTranspose>,
}

impl OutTensor {
    /// `source` copied whole under `name`.
    pub fn whole(name: String, source: &str, src: &TensorPlan, dtype: Dtype) -> OutTensor {
        OutTensor {
            name,
            sources: vec![SourceSlice {
                tensor: source.to_string(),
                offset: 0,
                numel: src.numel(),
            }],
            dtype,
            shape: src.shape.clone(),
            row_map: None,
            transpose: None,
            side_by_side: None,
        }
    }

    pub fn nbytes(&self) -> u64 {
        plan::numel(&self.shape).unwrap_or(0) * self.dtype.size() as u64
    }

    /// The single input tensor this copies whole, if it is one.
    pub fn whole_source(&self) -> Option<&str> {
        match self.sources.as_slice() {
            [s] if s.offset == 0 && Some(s.numel) == plan::numel(&self.shape) => Some(&s.tensor),
            _ => None,
        }
    }

    /// Input bytes read to write this tensor (for progress bars).
    pub fn input_bytes(&self, plan: &CheckpointPlan) -> u64 {
        self.sources
            .iter()
            .map(|s| {
                s.numel
                    * plan
                        .tensors
                        .get(&s.tensor)
                        .map(|t| t.dtype.size() as u64)
                        .unwrap_or(0)
            })
            .sum()
    }
}

/// The input tensors of `t`'s slices, checked against the plan: each exists with one dtype,
/// every slice lies inside its tensor and starts and ends on whole rows of the tensor's chunk
/// layout, and together they hold `t`'s element count.
pub fn resolve_sources<'p, 't>(
    plan: &'p CheckpointPlan,
    t: &'t OutTensor,
) -> Result<Vec<(&'p TensorPlan, &'t SourceSlice)>> {
    let mut out: Vec<(&TensorPlan, &SourceSlice)> = Vec::with_capacity(t.sources.len());
    let mut total = 0u64;
    for s in &t.sources {
        let src = plan.tensors.get(&s.tensor).ok_or_else(|| {
            Error::tensor(
                plan.root.display(),
                &s.tensor,
                format!("needed for `{}` but missing from the input", t.name),
            )
        })?;
        // Column-sharded layouts are read in whole rows: slices must not cut them.
        let layout = Layout::of(src);
        let row = if layout.is_runs() {
            1
        } else {
            layout.row_len.max(1)
        };
        let end = s.offset.checked_add(s.numel);
        if end.is_none_or(|e| e > src.numel())
            || !s.offset.is_multiple_of(row)
            || (!s.numel.is_multiple_of(row) && end != Some(src.numel()))
        {
            return Err(Error::tensor(
                plan.root.display(),
                &s.tensor,
                format!(
                    "elements {}..{} (for `{}`) do not fit its shape {:?} and chunk layout",
                    s.offset,
                    s.offset.saturating_add(s.numel),
                    t.name,
                    src.shape
                ),
            ));
        }
        if let Some((first, _)) = out.first()
            && first.dtype != src.dtype
        {
            return Err(Error::tensor(
                plan.root.display(),
                &s.tensor,
                format!(
                    "dtype {} differs from the other parts of `{}`",
                    src.dtype, t.name
                ),
            ));
        }
        total += s.numel;
        out.push((src, s));
    }
    if Some(total) != plan::numel(&t.shape) {
        return Err(Error::tensor(
            plan.root.display(),
            &t.name,
            format!(
                "internal: its sources hold {total} elements, its shape {:?} needs more or fewer",
                t.shape
            ),
        ));
    }
    Ok(out)
}

/// An output file: header bytes, then its tensors at their offsets.
#[derive(Debug, Clone)]
pub struct OutFilePlan {
    pub name: String,
    pub header: Vec<u8>,
    /// Tensors with their absolute byte offsets in the file.
    pub tensors: Vec<(OutTensor, u64)>,
    pub size: u64,
}

impl OutFilePlan {
    /// Lays out `tensors` back to back after a safetensors header with `metadata`.
    pub fn safetensors(
        name: String,
        tensors: Vec<OutTensor>,
        metadata: &std::collections::BTreeMap<String, String>,
    ) -> OutFilePlan {
        let entries: Vec<OutEntry> = tensors
            .iter()
            .map(|t| OutEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            })
            .collect();
        let (header, offsets) = safetensors::build_header(&entries, metadata);
        let base = header.len() as u64;
        let size = base + tensors.iter().map(OutTensor::nbytes).sum::<u64>();
        OutFilePlan {
            name,
            header,
            tensors: tensors
                .into_iter()
                .zip(offsets)
                .map(|(t, o)| (t, base + o))
                .collect(),
            size,
        }
    }
}

/// Where the copy engine puts one output tensor's bytes: C order, already in the output dtype.
/// A safetensors file takes them at any position ([`FileSink`]); a DCP writer takes them in
/// order and cuts them into row chunks (`formats::dcp_native`).
pub trait TensorSink {
    /// Bytes `pos..pos + data.len()` of the tensor.
    fn put(&mut self, pos: u64, data: &[u8]) -> Result<()>;
    /// The output file and the tensor's offset in it, when raw input runs may be copied file to
    /// file, in any order (`copy_file_range`).
    fn file(&self) -> Option<(&OutFile, u64)> {
        None
    }
}

/// A tensor at `offset` of an output file.
pub struct FileSink<'a> {
    pub out: &'a OutFile,
    pub offset: u64,
}

impl TensorSink for FileSink<'_> {
    fn put(&mut self, pos: u64, data: &[u8]) -> Result<()> {
        Ok(self.out.write_at(self.offset + pos, data)?)
    }

    fn file(&self) -> Option<(&OutFile, u64)> {
        Some((self.out, self.offset))
    }
}

/// Progress of a long copy or comparison, in input bytes. The library only reports it; the
/// `titan-ckpt` binary draws a bar, a library caller such as titan-train passes [`NoProgress`].
pub trait Progress: Send + Sync {
    /// The total expected, once known.
    fn set_length(&self, bytes: u64);
    /// `bytes` more are done (called from the worker threads).
    fn inc(&self, bytes: u64);
}

/// Reports nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn set_length(&self, _: u64) {}
    fn inc(&self, _: u64) {}
}

/// How to run the copy.
#[derive(Clone)]
pub struct EngineOptions {
    pub workers: usize,
    pub window_bytes: u64,
    pub progress: Arc<dyn Progress>,
}

/// Writes `files` under `out` from `plan`; on error nothing of this call is left behind.
pub fn write_files(
    plan: &CheckpointPlan,
    out: &Root,
    files: &[OutFilePlan],
    opts: &EngineOptions,
) -> Result<()> {
    if files.is_empty() {
        return Ok(());
    }
    out.create_dir_all()?;
    let inputs = plan.open_files()?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.workers.max(1))
        .build()
        .map_err(|e| Error::usage(format!("cannot start {} worker threads: {e}", opts.workers)))?;
    let outs: Vec<OutFile> = files
        .iter()
        .map(|f| {
            let o = out.create(&f.name, Some(f.size))?;
            Ok(o)
        })
        .collect::<Result<_>>()?;
    pool.install(|| -> Result<()> {
        if outs.iter().all(OutFile::is_positional) {
            // Headers first, then every tensor as its own task, biggest first for balance.
            for (f, o) in files.iter().zip(&outs) {
                o.write_at(0, &f.header)?;
            }
            let mut tasks: Vec<(usize, usize)> = files
                .iter()
                .enumerate()
                .flat_map(|(fi, f)| (0..f.tensors.len()).map(move |ti| (fi, ti)))
                .collect();
            tasks.sort_by_key(|&(fi, ti)| std::cmp::Reverse(files[fi].tensors[ti].0.nbytes()));
            tasks.par_iter().try_for_each_init(
                || TensorCopier::new(plan, &inputs, opts),
                |w, &(fi, ti)| {
                    let (t, offset) = &files[fi].tensors[ti];
                    w.write_tensor(
                        t,
                        &mut FileSink {
                            out: &outs[fi],
                            offset: *offset,
                        },
                    )
                },
            )
        } else {
            files.par_iter().zip(&outs).try_for_each_init(
                || TensorCopier::new(plan, &inputs, opts),
                |w, (f, o)| {
                    o.write_at(0, &f.header)?;
                    for (t, offset) in &f.tensors {
                        w.write_tensor(
                            t,
                            &mut FileSink {
                                out: o,
                                offset: *offset,
                            },
                        )?;
                    }
                    Ok(())
                },
            )
        }
    })?;
    // Every byte is written: make the files appear. A failure here removes those already renamed.
    let mut finished: Vec<String> = Vec::new();
    for (f, o) in files.iter().zip(outs) {
        if let Err(e) = o.finish() {
            for name in &finished {
                let _ = out.remove(name);
            }
            return Err(e.into());
        }
        finished.push(f.name.clone());
    }
    Ok(())
}

/// The copy engine for one thread: streams output tensors from a plan's inputs into
/// [`TensorSink`]s through one bounded buffer pair (a reader with its caches, the window size).
pub struct TensorCopier<'a> {
    plan: &'a CheckpointPlan,
    inputs: &'a [InFile],
    reader: TensorReader<'a>,
    buf: Vec<u8>,
    converted: Vec<u8>,
    /// float8 bytes of a block-quantized window, before dequantizing into `buf`.
    raw: Vec<u8>,
    /// The scales of the block-quantized weight being written (kept across its windows).
    dequant: Option<Dequantizer>,
    window: u64,
    progress: Arc<dyn Progress>,
}

impl<'a> TensorCopier<'a> {
    pub fn new(plan: &'a CheckpointPlan, inputs: &'a [InFile], opts: &EngineOptions) -> Self {
        TensorCopier {
            plan,
            inputs,
            reader: TensorReader::new(plan, inputs),
            buf: Vec::new(),
            converted: Vec::new(),
            raw: Vec::new(),
            dequant: None,
            window: opts.window_bytes.max(1),
            progress: opts.progress.clone(),
        }
    }

    /// Streams `t` into `sink`: sources in order, RoPE rows permuted or experts transposed,
    /// cast to `t.dtype`.
    pub fn write_tensor(&mut self, t: &OutTensor, sink: &mut dyn TensorSink) -> Result<()> {
        let sources = resolve_sources(self.plan, t)?;
        tracing::debug!(tensor = %t.name, "writing");
        if let Some(tr) = t.side_by_side {
            let [(a, _), (b, _)] = sources.as_slice() else {
                return Err(Error::tensor(
                    self.plan.root.display(),
                    &t.name,
                    "internal: side-by-side experts need exactly two sources",
                ));
            };
            return self.write_side_by_side([a, b], t, tr, sink);
        }
        if t.row_map.is_some() || t.transpose.is_some() {
            // Both reorder one input tensor.
            let [(src, _)] = sources.as_slice() else {
                return Err(Error::tensor(
                    self.plan.root.display(),
                    &t.name,
                    "internal: a RoPE row map or expert transpose needs exactly one source",
                ));
            };
            if let Some(map) = t.row_map {
                return self.write_permuted(src, t, map, sink);
            }
            if let Some(tr) = t.transpose {
                return self.write_transposed(src, t, tr, sink);
            }
        }
        let os = t.dtype.size() as u64;
        let mut pos = 0;
        for (src, slice) in sources {
            self.write_slice(src, slice, t.dtype, sink, pos)?;
            pos += slice.numel * os;
        }
        Ok(())
    }

    /// Puts the elements `slice` of `src` at byte `pos` of the tensor, cast to `dtype`: raw runs
    /// are copied file to file when the sink is a file, anything else goes through windows of at
    /// most the window size, in order.
    fn write_slice(
        &mut self,
        src: &TensorPlan,
        slice: &SourceSlice,
        dtype: Dtype,
        sink: &mut dyn TensorSink,
        pos: u64,
    ) -> Result<()> {
        let range = slice.offset..slice.offset + slice.numel;
        let layout = Layout::of(src);
        let direct = src.dtype == dtype
            && src.scales.is_none()
            && layout.is_runs()
            && src
                .chunks
                .iter()
                .all(|c| c.source.encoding == Encoding::Raw);
        if direct && let Some((out, offset)) = sink.file() {
            let es = src.dtype.size() as u64;
            for c in src.chunks.iter().filter(|c| c.numel() > 0) {
                let run = assemble::run_of(src, c);
                let (s, e) = (run.start.max(range.start), run.end.min(range.end));
                if s >= e {
                    continue;
                }
                self.copy_range(
                    &self.inputs[c.source.file],
                    c.source.begin + (s - run.start) * es,
                    out,
                    offset + pos + (s - range.start) * es,
                    (e - s) * es,
                )?;
            }
            return Ok(());
        }
        let mut at = pos;
        for w in assemble::windows_in(src, range, self.window_for(src)) {
            let (from, n) = self.read_values(&slice.tensor, src, w.clone())?;
            let bytes = self.cast_window(from, dtype, n);
            sink.put(at, bytes)?;
            at += bytes.len() as u64;
            self.progress
                .inc((w.end - w.start) * src.dtype.size() as u64);
        }
        Ok(())
    }

    /// The bytes of stored elements one window reads: a block-quantized weight's float8 bytes
    /// become fp32 values 4 times their size, so its windows are a quarter of the window size.
    fn window_for(&self, src: &TensorPlan) -> u64 {
        match src.scales {
            Some(_) => (self.window / 4).max(1),
            None => self.window,
        }
    }

    /// Reads elements `w` of `src` (input tensor `name`) into `self.buf` as the values to cast:
    /// the stored elements, or a block-quantized weight's dequantized fp32 values (its scales
    /// read and checked on its first window). Returns their dtype and byte count.
    fn read_values(
        &mut self,
        name: &str,
        src: &TensorPlan,
        w: Range<u64>,
    ) -> Result<(Dtype, usize)> {
        if src.scales.is_none() {
            return Ok((src.dtype, self.read_window(src, w)?));
        }
        if self.dequant.as_ref().is_none_or(|d| d.weight != name) {
            self.dequant = Some(Dequantizer::new(self.plan, &mut self.reader, name, src)?);
        }
        let n = (w.end - w.start) as usize;
        self.raw.resize(n, 0);
        self.reader.read(src, w.clone(), &mut self.raw[..n])?;
        let d = self.dequant.as_ref().expect("set above");
        d.dequantize(w.start, &self.raw[..n], &mut self.buf);
        Ok((Dtype::F32, n * 4))
    }

    /// Reads elements `w` of `src` into `self.buf`; returns the byte count.
    fn read_window(&mut self, src: &TensorPlan, w: Range<u64>) -> Result<usize> {
        let n = ((w.end - w.start) * src.dtype.size() as u64) as usize;
        self.buf.resize(n, 0);
        self.reader.read(src, w, &mut self.buf[..n])?;
        Ok(n)
    }

    fn cast_window(&mut self, from: Dtype, to: Dtype, n: usize) -> &[u8] {
        if from == to {
            &self.buf[..n]
        } else {
            cast::convert(from, to, &self.buf[..n], &mut self.converted);
            &self.converted
        }
    }

    fn write_permuted(
        &mut self,
        src: &TensorPlan,
        t: &OutTensor,
        map: RowMap,
        sink: &mut dyn TensorSink,
    ) -> Result<()> {
        if src.shape.len() != 2 {
            return Err(Error::tensor(
                self.plan.root.display(),
                &t.name,
                format!(
                    "RoPE permutation needs a 2-D weight, got shape {:?}",
                    src.shape
                ),
            ));
        }
        let (rows, cols) = (src.shape[0], src.shape[1]);
        map.check(&t.name, rows)?;
        let (es, os) = (src.dtype.size() as u64, t.dtype.size() as u64);
        let per_batch = (self.window_for(src) / (cols * es).max(1)).max(1);
        let name = &t.sources[0].tensor;
        let mut block = Vec::new();
        let mut r = 0;
        while r < rows {
            let end = (r + per_batch).min(rows);
            block.clear();
            for out_row in r..end {
                let in_row = map.source_row(out_row, rows);
                let (from, n) = self.read_values(name, src, in_row * cols..(in_row + 1) * cols)?;
                let bytes = self.cast_window(from, t.dtype, n);
                block.extend_from_slice(bytes);
            }
            sink.put(r * cols * os, &block)?;
            self.progress.inc((end - r) * cols * es);
            r = end;
        }
        Ok(())
    }

    /// Puts `t`, the per-expert transpose of `src`, in tiles of whole output rows of at most
    /// the window size, in order (object store outputs and DCP take nothing else).
    fn write_transposed(
        &mut self,
        src: &TensorPlan,
        t: &OutTensor,
        tr: ExpertTranspose,
        sink: &mut dyn TensorSink,
    ) -> Result<()> {
        if let Some(s) = &src.scales {
            // Only gpt-oss's experts are transposed, and they are not block-quantized.
            return Err(Error::tensor(
                self.plan.root.display(),
                &s.name,
                format!(
                    "`{}` is a transposed expert stack: titan-ckpt does not dequantize those",
                    t.name
                ),
            ));
        }
        let es = src.dtype.size() as u64;
        let per = (self.window / (tr.rows * es).max(1)).max(1) * tr.rows;
        let total = plan::numel(&t.shape).unwrap_or(0);
        let os = t.dtype.size() as u64;
        let mut buf = std::mem::take(&mut self.buf);
        let mut tile = Vec::new();
        let mut s = 0;
        while s < total {
            let e = (s + per).min(total);
            buf.resize(((e - s) * es) as usize, 0);
            tr.read(&mut self.reader, src, s..e, &mut buf, &mut tile)?;
            let bytes: &[u8] = if src.dtype == t.dtype {
                &buf
            } else {
                cast::convert(src.dtype, t.dtype, &buf, &mut self.converted);
                &self.converted
            };
            sink.put(s * os, bytes)?;
            self.progress.inc((e - s) * es);
            s = e;
        }
        self.buf = buf;
        Ok(())
    }

    /// Puts `t`, the two stacked `[E, F, D]` sources each transposed per expert (`tr`: rows F,
    /// columns D) with their rows side by side (`[E, D, 2F]`), in tiles of whole output rows of
    /// one expert, in order.
    fn write_side_by_side(
        &mut self,
        srcs: [&TensorPlan; 2],
        t: &OutTensor,
        tr: ExpertTranspose,
        sink: &mut dyn TensorSink,
    ) -> Result<()> {
        let (f, d) = (tr.rows, tr.width);
        let es = srcs[0].dtype.size() as u64;
        if srcs
            .iter()
            .any(|s| s.scales.is_some() || s.dtype != srcs[0].dtype)
        {
            return Err(Error::tensor(
                self.plan.root.display(),
                &t.name,
                "side-by-side experts need two unquantized sources of one dtype",
            ));
        }
        let experts = t.shape.first().copied().unwrap_or(0);
        let per = (self.window / (2 * f * es).max(1)).clamp(1, d.max(1));
        let os = t.dtype.size() as u64;
        let (mut halves, mut tile, mut rows) = ([Vec::new(), Vec::new()], Vec::new(), Vec::new());
        for e in 0..experts {
            let mut d0 = 0;
            while d0 < d {
                let d1 = (d0 + per).min(d);
                let range = (e * d + d0) * f..(e * d + d1) * f;
                for (half, src) in halves.iter_mut().zip(srcs) {
                    half.resize(((range.end - range.start) * es) as usize, 0);
                    tr.read(&mut self.reader, src, range.clone(), half, &mut tile)?;
                }
                let row = (f * es) as usize;
                rows.clear();
                for j in 0..(d1 - d0) as usize {
                    rows.extend_from_slice(&halves[0][j * row..(j + 1) * row]);
                    rows.extend_from_slice(&halves[1][j * row..(j + 1) * row]);
                }
                let bytes: &[u8] = if srcs[0].dtype == t.dtype {
                    &rows
                } else {
                    cast::convert(srcs[0].dtype, t.dtype, &rows, &mut self.converted);
                    &self.converted
                };
                sink.put((e * d + d0) * 2 * f * os, bytes)?;
                self.progress.inc(2 * (d1 - d0) * f * es);
                d0 = d1;
            }
        }
        Ok(())
    }

    /// Copies `len` bytes between files: `copy_file_range` when both are local, else through
    /// a bounded buffer.
    fn copy_range(
        &mut self,
        src: &InFile,
        src_off: u64,
        out: &OutFile,
        dst_off: u64,
        len: u64,
    ) -> Result<()> {
        if let (Some(sfd), Some(dfd)) = (src.local_fd(), out.local_fd()) {
            let mut done = 0u64;
            while done < len {
                let mut so = (src_off + done) as libc::loff_t;
                let mut d = (dst_off + done) as libc::loff_t;
                let step = (len - done).min(1 << 30) as usize;
                // SAFETY: both fds are open for the lifetime of the call; offsets are passed by
                // pointer to locals, so the files' own positions are untouched.
                let n = unsafe { libc::copy_file_range(sfd, &mut so, dfd, &mut d, step, 0) };
                if n > 0 {
                    done += n as u64;
                    self.progress.inc(n as u64);
                    continue;
                }
                if n == 0 {
                    return Err(Error::invalid(
                        &src.name,
                        format!("truncated: expected bytes up to {}", src_off + len),
                    ));
                }
                let err = std::io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(
                        libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP | libc::EBADF,
                    ) if done == 0 => break,
                    Some(libc::EINTR) => continue,
                    _ => return Err(Error::io(&out.name, err)),
                }
            }
            if done == len {
                return Ok(());
            }
        }
        let mut done = 0;
        while done < len {
            let n = (len - done).min(self.window) as usize;
            self.buf.resize(n, 0);
            src.read_at(src_off + done, &mut self.buf[..n])?;
            out.write_at(dst_off + done, &self.buf[..n])?;
            done += n as u64;
            self.progress.inc(n as u64);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_row_maps_invert_each_other() {
        let rows = 32;
        for heads in [1, 2, 4, 8] {
            let to = RowMap::ToHf { heads };
            let from = RowMap::FromHf { heads };
            for r in 0..rows {
                assert_eq!(to.source_row(from.source_row(r, rows), rows), r);
            }
        }
        // One head of 8 rows: HF row order is the even rows then the odd rows of torchtitan's.
        let to = RowMap::ToHf { heads: 1 };
        let got: Vec<u64> = (0..8).map(|r| to.source_row(r, 8)).collect();
        assert_eq!(got, vec![0, 2, 4, 6, 1, 3, 5, 7]);
    }

    #[test]
    fn transpose_bytes_swaps_dims() {
        // [2, 3] of u16 -> [3, 2].
        let a: Vec<u8> = [1u16, 2, 3, 4, 5, 6]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut out = vec![0u8; a.len()];
        transpose_bytes(&a, 2, 3, 2, &mut out);
        let got: Vec<u16> = out
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(got, vec![1, 4, 2, 5, 3, 6]);
    }
}
