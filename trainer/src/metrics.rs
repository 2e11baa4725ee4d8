//! Step metrics: memory, throughput, FLOPs/MFU, and torchtitan's aggregated console line.
//!
//! The same [`StepMetrics`] values go to the console, to `metrics.jsonl` in the dump folder,
//! to TensorBoard and to titan-obs scalars, so they never disagree. Each field has one scope
//! (docs/training.md, "Metrics"): `tps`, `tflops`, `mfu_pct` per GPU as torchtitan computes
//! them (a data-parallel rank's tokens over its model-parallel ranks), `tokens` the step's
//! tokens over the whole job, each token counted once.

use std::fmt::Write as _;

use serde::Serialize;
use tch::Device;
use titan_obs_core::Reduce;

/// Resident and peak resident memory of this process in bytes (Linux `/proc/self/status`).
pub fn rss_bytes() -> (u64, u64) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (0, 0);
    };
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// A CUDA device's memory as its caching allocator counts it, since the last logged step
/// (torchtitan's `DeviceMemoryMonitor.get_peak_stats`, read from the same statistics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceMemory {
    /// Peak bytes in active blocks ("active_bytes.all.peak").
    pub max_active: u64,
    /// Peak bytes reserved from the device ("reserved_bytes.all.peak").
    pub max_reserved: u64,
    /// Allocations that failed and succeeded after the cache was freed (each a device sync).
    pub alloc_retries: u64,
    pub ooms: u64,
    /// The device's memory in bytes (the percentages' base).
    pub capacity: u64,
}

unsafe extern "C" {
    fn titan_cpu_count_tensor_bytes(err: *mut *mut std::ffi::c_char) -> i32;
    fn titan_cpu_tensor_bytes(reset_peak: i32, out: *mut i64);
    fn titan_cuda_memory_stats(
        index: i64,
        reset_peak: i32,
        out: *mut i64,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
}

/// CUDA device `index`'s [`DeviceMemory`] from libtorch's caching allocator (through
/// `cpp/memory_shim.cpp`; no process is forked and no driver tool is asked), then its peaks
/// reset as torchtitan resets them after each logged step. An error where there is no CUDA
/// allocator (a CPU-only libtorch).
pub fn cuda_memory(index: usize) -> Result<DeviceMemory, String> {
    let mut out = [0i64; 5];
    crate::shim::call(|err| {
        // SAFETY: `out` has the 5 slots the shim writes; `err` is the shim's error slot.
        unsafe { titan_cuda_memory_stats(index as i64, 1, out.as_mut_ptr(), err) }
    })?;
    let [max_active, max_reserved, alloc_retries, ooms, capacity] = out.map(|v| v.max(0) as u64);
    Ok(DeviceMemory {
        max_active,
        max_reserved,
        alloc_retries,
        ooms,
        capacity,
    })
}

/// Makes libtorch count the bytes of every CPU tensor allocated from now on
/// (`cpp/memory_shim.cpp`'s allocator over c10's default): what [`cpu_tensor_bytes`] reads.
/// Idempotent; call before the model is built.
pub fn count_cpu_tensor_bytes() -> Result<(), String> {
    // SAFETY: `err` is the shim's error slot.
    crate::shim::call(|err| unsafe { titan_cpu_count_tensor_bytes(err) })
}

/// Live bytes of CPU tensors and their peak since the last call, then the peak starts again
/// (as [`cuda_memory`]'s peaks after each logged step): the measured counterpart of the
/// memory estimate on CPU, free of what RSS also holds (memory the C library keeps after a
/// free, libtorch's own).
pub fn cpu_tensor_bytes() -> (u64, u64) {
    let mut out = [0i64; 2];
    // SAFETY: `out` has the 2 slots the shim writes.
    unsafe { titan_cpu_tensor_bytes(1, out.as_mut_ptr()) };
    (out[0].max(0) as u64, out[1].max(0) as u64)
}

/// Name of CUDA device `index` from `nvidia-smi`.
fn cuda_device_name(index: usize) -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=name",
            "--format=csv,noheader",
            &format!("--id={index}"),
        ])
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!name.is_empty()).then_some(name)
}

/// Peak bf16 dense FLOPS of a GPU by name, torchtitan's table (A100 when unknown, as torchtitan).
pub fn gpu_peak_flops(name: &str) -> f64 {
    let n = name.to_uppercase();
    if n.contains("A100") {
        312e12
    } else if n.contains("H100") {
        if n.contains("NVL") {
            835e12
        } else if n.contains("PCIE") {
            756e12
        } else {
            989e12
        }
    } else if n.contains("H200") {
        989e12
    } else if n.contains("B200") {
        2.25e15
    } else if n.contains("MI355X") {
        2500e12
    } else if n.contains("MI300X") || n.contains("MI325X") {
        1300e12
    } else if n.contains("L40S") {
        362e12
    } else {
        tracing::warn!(
            gpu = name,
            "peak flops unknown for this GPU; assuming A100 (312 TFLOPS)"
        );
        312e12
    }
}

/// Peak FLOPS for MFU: `metrics.peak_tflops` when set, else the GPU table on CUDA, else 1 TFLOPS.
pub fn peak_flops(device: Device, configured_tflops: f64) -> f64 {
    if configured_tflops > 0.0 {
        return configured_tflops * 1e12;
    }
    match device {
        Device::Cuda(i) => gpu_peak_flops(&cuda_device_name(i).unwrap_or_default()),
        _ => 1e12,
    }
}

/// The tokens and the training time behind one logged throughput: the steps since the last
/// logged step, minus the time spent outside training in between (validation), so tokens/s,
/// TFLOPS and MFU cover the same tokens and the same training time.
#[derive(Debug, Clone)]
pub struct ThroughputWindow {
    start: std::time::Instant,
    excluded: std::time::Duration,
    tokens: i64,
}

impl ThroughputWindow {
    pub fn new(now: std::time::Instant) -> Self {
        Self {
            start: now,
            excluded: std::time::Duration::ZERO,
            tokens: 0,
        }
    }

    /// A step's input tokens.
    pub fn add_tokens(&mut self, tokens: i64) {
        self.tokens += tokens;
    }

    /// Time inside the window that was not training (validation).
    pub fn exclude(&mut self, not_training: std::time::Duration) {
        self.excluded += not_training;
    }

    /// Tokens per second per GPU over the training time up to `now`, as torchtitan 0.3.0's
    /// `MetricsProcessor.log` computes it: this rank's input tokens / (time x the
    /// non-data-parallel size, cp x tp x pp), so context-, tensor- and pipeline-parallel
    /// ranks, which train the same tokens, share them rather than each claiming them all.
    /// `model_parallel` is the mesh's cp x tp x pp.
    pub fn tokens_per_second(&self, now: std::time::Instant, model_parallel: usize) -> f64 {
        let training = now
            .saturating_duration_since(self.start)
            .saturating_sub(self.excluded);
        self.tokens as f64 / (training.as_secs_f64().max(1e-9) * model_parallel.max(1) as f64)
    }

    /// Starts the next window at `now` (after a logged step).
    pub fn restart(&mut self, now: std::time::Instant) {
        *self = Self::new(now);
    }
}

/// The metrics of one logged training step: one rank's, or reduced across ranks.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    /// GiB: RSS on CPU; on CUDA the caching allocator's peak reserved memory since the last
    /// logged step (torchtitan's `memory/max_reserved(GiB)`).
    pub memory_gib: f64,
    /// Peak RSS (GiB) of the process.
    pub peak_rss_gib: f64,
    /// GiB: the peak of live tensor bytes since the last logged step: CPU tensors as the
    /// counting allocator sees them ([`cpu_tensor_bytes`]), on CUDA the caching allocator's
    /// active bytes (torchtitan's `max_active`). What the memory estimate predicts.
    pub tensor_peak_gib: f64,
    /// Tokens per second per GPU ([`ThroughputWindow::tokens_per_second`]); reduced: the mean
    /// over every rank of the job.
    pub tps: f64,
    pub tflops: f64,
    pub mfu_pct: f64,
    /// Valid label tokens of the step. Reduced (console, `metrics.jsonl`, TensorBoard): the
    /// step's tokens over the whole job. One rank's: its data-parallel rank's tokens; what it
    /// records for titan-obs is its share of them ([`Self::scalars`]), so `titan-obs
    /// metrics`' `training/tokens_sum` over every rank is the same step's tokens.
    pub tokens: i64,
    pub on_cuda: bool,
}

impl StepMetrics {
    /// One rank's values as the titan-obs scalars it records, with their cross-rank
    /// reductions, in console order. `training/tokens` is the rank's share of its
    /// data-parallel rank's tokens (tokens / tp x pp): its model-parallel ranks trained the
    /// same tokens, so summed over every rank they count once (issue 39: TP2 trained 512
    /// tokens and titan-obs said 1024).
    pub fn scalars(&self, model_parallel: usize) -> [(&'static str, f64, Reduce); 9] {
        let mut v = self.values();
        v[8].1 /= model_parallel.max(1) as f64;
        v
    }

    /// The values with their cross-rank reductions, in console order.
    fn values(&self) -> [(&'static str, f64, Reduce); 9] {
        let mem = if self.on_cuda {
            "trainer_memory/reserved_gib"
        } else {
            "trainer_memory/rss_gib"
        };
        [
            ("training/loss", self.loss, Reduce::Mean),
            ("training/grad_norm", self.grad_norm, Reduce::Max),
            (mem, self.memory_gib, Reduce::Max),
            (
                "trainer_memory/tensor_peak_gib",
                self.tensor_peak_gib,
                Reduce::Max,
            ),
            ("trainer_throughput/tps", self.tps, Reduce::Mean),
            ("trainer_throughput/tflops", self.tflops, Reduce::Mean),
            ("trainer_throughput/mfu_pct", self.mfu_pct, Reduce::Mean),
            ("training/lr", self.lr, Reduce::Max),
            ("training/tokens", self.tokens as f64, Reduce::Sum),
        ]
    }

    /// Every scalar under its console name (`training/loss_mean`, ...): what TensorBoard gets.
    pub fn console_scalars(&self) -> Vec<(String, f64)> {
        self.values()
            .iter()
            .map(|(name, value, reduce)| (format!("{name}_{}", suffix(*reduce)), *value))
            .collect()
    }

    /// torchtitan's aggregated console line (suffix = cross-rank reduction).
    pub fn console_line(&self) -> String {
        let mut line = format!("step: {:2}", self.step);
        for (name, value, reduce) in &self.values()[..7] {
            let digits = match *name {
                "training/loss" => 4,
                "training/grad_norm" => 4,
                "trainer_throughput/tps" => 1,
                "trainer_throughput/tflops" => 3,
                "trainer_throughput/mfu_pct" => 4,
                _ => 2,
            };
            let _ = write!(line, "  {name}_{}: {value:.digits$}", suffix(*reduce));
        }
        line
    }
}

/// The metrics of one validation run.
#[derive(Debug, Clone, Serialize)]
pub struct ValidationMetrics {
    pub step: u64,
    pub loss: f64,
    pub tokens: i64,
    pub seconds: f64,
}

impl ValidationMetrics {
    /// The console line's values under its names (for TensorBoard).
    pub fn console_scalars(&self) -> Vec<(String, f64)> {
        vec![
            ("validation/loss_mean".into(), self.loss),
            ("validation/tokens_sum".into(), self.tokens as f64),
            ("validation/time_s_max".into(), self.seconds),
        ]
    }

    pub fn console_line(&self) -> String {
        format!(
            "validate step: {:2}  validation/loss_mean: {:.4}  validation/tokens_sum: {}  validation/time_s_max: {:.2}",
            self.step, self.loss, self.tokens, self.seconds
        )
    }
}

pub fn suffix(r: Reduce) -> &'static str {
    match r {
        Reduce::Mean => "mean",
        Reduce::Max => "max",
        Reduce::Min => "min",
        Reduce::Sum => "sum",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_leaves_validation_time_out() {
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let mut w = ThroughputWindow::new(t0);
        // 5 steps of 1000 tokens in 5 s of training, then 5 s of validation, then 5 more steps
        // in 5 s: 10000 tokens over 10 s of training.
        w.add_tokens(5000);
        w.exclude(Duration::from_secs(5));
        w.add_tokens(5000);
        let tps = w.tokens_per_second(t0 + Duration::from_secs(15), 1);
        assert!((tps - 1000.0).abs() < 1e-6, "{tps}");
        w.restart(t0 + Duration::from_secs(15));
        w.add_tokens(3000);
        let tps = w.tokens_per_second(t0 + Duration::from_secs(18), 1);
        assert!((tps - 1000.0).abs() < 1e-6, "{tps}");
    }

    /// torchtitan 0.3.0's `tps = ntokens_since_last_log / (time_delta *
    /// parallel_dims.non_data_parallel_size)`, computed here by hand.
    #[test]
    fn throughput_is_per_gpu_as_torchtitan() {
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let mut w = ThroughputWindow::new(t0);
        w.add_tokens(4096);
        let at = t0 + Duration::from_secs(2);
        assert!((w.tokens_per_second(at, 1) - 4096.0 / 2.0).abs() < 1e-9);
        // tp 2 x pp 2: the data-parallel rank's 4096 tokens over 4 GPUs for 2 s.
        assert!((w.tokens_per_second(at, 4) - 4096.0 / (2.0 * 4.0)).abs() < 1e-9);
    }

    #[test]
    fn console_line_has_torchtitan_names() {
        let m = StepMetrics {
            step: 1,
            loss: 8.028,
            grad_norm: 50810.5,
            lr: 8e-4,
            memory_gib: 0.19,
            peak_rss_gib: 0.2,
            tensor_peak_gib: 0.1,
            tps: 361.4,
            tflops: 0.026,
            mfu_pct: 0.0026,
            tokens: 100,
            on_cuda: true,
        };
        assert_eq!(
            m.console_line(),
            "step:  1  training/loss_mean: 8.0280  training/grad_norm_max: 50810.5000  \
             trainer_memory/reserved_gib_max: 0.19  trainer_memory/tensor_peak_gib_max: 0.10  \
             trainer_throughput/tps_mean: 361.4  \
             trainer_throughput/tflops_mean: 0.026  trainer_throughput/mfu_pct_mean: 0.0026"
        );
    }

    /// Without a GPU the allocator's statistics are an error, not a crash or a made-up zero.
    #[test]
    fn cuda_memory_is_an_error_without_cuda() {
        if !tch::Cuda::is_available() {
            assert!(cuda_memory(0).is_err());
        }
    }

    #[test]
    fn gpu_table() {
        assert_eq!(gpu_peak_flops("NVIDIA H100 80GB HBM3"), 989e12);
        assert_eq!(gpu_peak_flops("NVIDIA A100-SXM4-80GB"), 312e12);
        assert_eq!(peak_flops(Device::Cpu, 0.5), 0.5e12);
        let (rss, peak) = rss_bytes();
        assert!(rss > 0 && peak >= rss);
    }
}
