//! The copy engine: writes planned safetensors output files from a checkpoint plan.
//!
//! Work is split across a rayon pool: on local outputs every (file, tensor) pair is a task doing
//! positional writes; object store outputs are uploaded sequentially per file (one task per file).
//! A tensor whose chunks are contiguous runs of its bytes is copied range to range
//! (`copy_file_range` between local files, else pread/pwrite through a bounded buffer); other
//! tensors are assembled window by window. Output files appear only when all of them are complete.

use std::ops::Range;

use indicatif::ProgressBar;
use rayon::prelude::*;

use crate::assemble::{self, Layout, TensorReader};
use crate::cast;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, Encoding, TensorPlan};
use crate::safetensors::{self, OutEntry};
use crate::storage::{InFile, OutFile, Root};

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

/// One tensor of an output file.
#[derive(Debug, Clone)]
pub struct OutTensor {
    /// Name in the output.
    pub name: String,
    /// Name in the input plan.
    pub source: String,
    /// Output dtype (the input's unless converting).
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub row_map: Option<RowMap>,
}

impl OutTensor {
    pub fn nbytes(&self) -> u64 {
        safetensors::numel(&self.shape).unwrap_or(0) * self.dtype.size() as u64
    }
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

/// How to run the copy.
#[derive(Clone)]
pub struct EngineOptions {
    pub workers: usize,
    pub window_bytes: u64,
    pub progress: ProgressBar,
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
    let inputs: Vec<InFile> = plan
        .files
        .iter()
        .map(|f| plan.root.open(f))
        .collect::<Result<_>>()?;
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
                || Worker::new(plan, &inputs, opts),
                |w, &(fi, ti)| {
                    let (t, off) = &files[fi].tensors[ti];
                    w.write_tensor(t, &outs[fi], *off)
                },
            )
        } else {
            files.par_iter().zip(&outs).try_for_each_init(
                || Worker::new(plan, &inputs, opts),
                |w, (f, o)| {
                    o.write_at(0, &f.header)?;
                    for (t, off) in &f.tensors {
                        w.write_tensor(t, o, *off)?;
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
            return Err(e);
        }
        finished.push(f.name.clone());
    }
    Ok(())
}

/// Per-thread state: a reader with its caches and one bounded buffer pair.
struct Worker<'a> {
    plan: &'a CheckpointPlan,
    inputs: &'a [InFile],
    reader: TensorReader<'a>,
    buf: Vec<u8>,
    converted: Vec<u8>,
    window: u64,
    progress: ProgressBar,
}

impl<'a> Worker<'a> {
    fn new(plan: &'a CheckpointPlan, inputs: &'a [InFile], opts: &EngineOptions) -> Self {
        Worker {
            plan,
            inputs,
            reader: TensorReader::new(plan, inputs),
            buf: Vec::new(),
            converted: Vec::new(),
            window: opts.window_bytes.max(1),
            progress: opts.progress.clone(),
        }
    }

    fn write_tensor(&mut self, t: &OutTensor, out: &OutFile, offset: u64) -> Result<()> {
        let src = self.plan.tensors.get(&t.source).ok_or_else(|| {
            Error::tensor(
                self.plan.root.display(),
                &t.source,
                "internal: planned tensor missing from the input",
            )
        })?;
        tracing::debug!(tensor = %t.name, file = %out.name, "writing");
        if let Some(map) = t.row_map {
            return self.write_permuted(src, t, map, out, offset);
        }
        let layout = Layout::of(src);
        let direct = src.dtype == t.dtype
            && layout.is_runs()
            && src
                .chunks
                .iter()
                .all(|c| c.source.encoding == Encoding::Raw);
        if direct {
            let es = src.dtype.size() as u64;
            let mut chunks: Vec<_> = src.chunks.iter().filter(|c| c.numel() > 0).collect();
            chunks.sort_by_key(|c| assemble::run_of(src, c).start);
            for c in chunks {
                let run = assemble::run_of(src, c);
                self.copy_range(
                    &self.inputs[c.source.file],
                    c.source.begin,
                    out,
                    offset + run.start * es,
                    run.end * es - run.start * es,
                )?;
            }
            return Ok(());
        }
        let mut pos = offset;
        for w in assemble::windows(src, self.window) {
            let n = self.read_window(src, w.clone())?;
            let bytes = self.cast_window(src.dtype, t.dtype, n);
            out.write_at(pos, bytes)?;
            pos += bytes.len() as u64;
            self.progress
                .inc((w.end - w.start) * src.dtype.size() as u64);
        }
        Ok(())
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
        out: &OutFile,
        offset: u64,
    ) -> Result<()> {
        if src.shape.len() != 2 {
            return Err(Error::tensor(
                self.plan.root.display(),
                &t.source,
                format!(
                    "RoPE permutation needs a 2-D weight, got shape {:?}",
                    src.shape
                ),
            ));
        }
        let (rows, cols) = (src.shape[0], src.shape[1]);
        let (es, os) = (src.dtype.size() as u64, t.dtype.size() as u64);
        let per_batch = (self.window / (cols * es).max(1)).max(1);
        let mut block = Vec::new();
        let mut r = 0;
        while r < rows {
            let end = (r + per_batch).min(rows);
            block.clear();
            for out_row in r..end {
                let in_row = map.source_row(out_row, rows);
                let n = self.read_window(src, in_row * cols..(in_row + 1) * cols)?;
                let bytes = self.cast_window(src.dtype, t.dtype, n);
                block.extend_from_slice(bytes);
            }
            out.write_at(offset + r * cols * os, &block)?;
            self.progress.inc((end - r) * cols * es);
            r = end;
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
}
