//! titan-train checkpoint save/load timing (run by `bench/trainckpt/run.sh`, which also times
//! torch `dcp.save` / `dcp.load` of the same state).
//!
//! For each model size: one training step populates AdamW's state, then
//! - sync save: stage (device -> host bytes) + write + commit, `RUNS` times;
//! - async save: the time `after_step` blocks training (staging only) and the background write;
//! - load: open + read + copy into the model/optimizer, `RUNS` times.
//!
//! Prints one JSON line per size; the last checkpoint is left in `$OUT/<size>/checkpoint/`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind};
use titan_train::checkpoint::{Checkpointer, TrainerState};
use titan_train::config::{AsyncModeName, Checkpoint, LrScheduler};
use titan_train::data::{Dataset, PrefetchLoader, TextLoader, TextTokenizer};
use titan_train::lr_scheduler::LrSchedule;
use titan_train::model::ModelArgs;
use titan_train::optim::{AdamW, AdamWParams};
use titan_train::parallel::Mesh;
use titan_train::parallelize::ParallelModel;
use titan_train::parallelize::ParallelPlan;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let runs: usize = std::env::var("RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5);
    let out = PathBuf::from(std::env::var("OUT").unwrap_or_else(|_| "/tmp/trainckpt_bench".into()));
    let sizes: Vec<String> = std::env::var("SIZES")
        .unwrap_or_else(|_| "debugmodel,1gb".into())
        .split(',')
        .map(String::from)
        .collect();
    let debug = ModelArgs::flavor("debugmodel").unwrap();
    for size in sizes {
        let args = match size.as_str() {
            "debugmodel" => ModelArgs {
                max_seq_len: 64,
                ..debug.clone()
            },
            // ~82M parameters: model + exp_avg + exp_avg_sq = ~0.98 GB of fp32 state.
            "1gb" => ModelArgs {
                dim: 768,
                n_layers: 8,
                n_heads: 12,
                n_kv_heads: None,
                vocab_size: 16384,
                multiple_of: 256,
                max_seq_len: 64,
                ..debug.clone()
            },
            other => panic!("unknown size {other}"),
        };
        let dump = out.join(&size);
        let _ = std::fs::remove_dir_all(&dump);
        tch::manual_seed(0);
        let model = ParallelModel::new(args, Device::Cpu, &ParallelPlan::single()).unwrap();
        let mut optimizer = AdamW::new(AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            fused: true,
        });
        let schedule = LrSchedule::new(&LrScheduler::default(), 1e-3, 1000);
        let mut loader = PrefetchLoader::new(
            TextLoader::new(
                Dataset::resolve("default", None, "training").unwrap(),
                Arc::new(TextTokenizer::embedded().unwrap()),
                32,
                1,
                0,
                1,
                true,
            ),
            0,
        );
        let tokens = tch::Tensor::randint(1000, [1, 33], (Kind::Int64, Device::Cpu));
        let logits = model.forward(&tokens.narrow(1, 0, 32), None);
        (model.summed_cross_entropy(&logits, &tokens.narrow(1, 1, 32)) / 32.0).backward();
        for (n, p) in model.named_parameters() {
            optimizer.step_param(n, p, 1e-3).unwrap();
            p.shallow_clone().zero_grad();
        }
        let mut cfg = Checkpoint {
            enable: true,
            interval: 1,
            keep_latest_k: 2,
            last_save_model_only: false,
            ..Checkpoint::default()
        };
        let (mut save_s, mut blocked_s, mut async_total_s, mut load_s) =
            (vec![], vec![], vec![], vec![]);
        let mut bytes = 0u64;
        for mode in [AsyncModeName::Disabled, AsyncModeName::Async] {
            cfg.async_mode = mode;
            for i in 0..runs {
                let mut ckpt = Checkpointer::new(&cfg, &dump, Mesh::single()).unwrap();
                let state = TrainerState {
                    model: &model,
                    optimizer: &mut optimizer,
                    loader: &mut loader,
                    schedule: &schedule,
                };
                let t = Instant::now();
                ckpt.after_step(i as u64 + 1, 1_000_000, 0, &state).unwrap();
                let blocked = t.elapsed().as_secs_f64();
                ckpt.finish().unwrap();
                let total = t.elapsed().as_secs_f64();
                if mode == AsyncModeName::Disabled {
                    save_s.push(total);
                } else {
                    blocked_s.push(blocked);
                    async_total_s.push(total);
                }
            }
        }
        let last = dump.join("checkpoint").join(format!("step-{runs}"));
        for entry in std::fs::read_dir(&last).unwrap().flatten() {
            bytes += entry.metadata().unwrap().len();
        }
        for _ in 0..runs {
            let mut ckpt = Checkpointer::new(
                &Checkpoint {
                    load_step: Some(runs as u64),
                    ..cfg.clone()
                },
                &dump,
                Mesh::single(),
            )
            .unwrap();
            let mut state = TrainerState {
                model: &model,
                optimizer: &mut optimizer,
                loader: &mut loader,
                schedule: &schedule,
            };
            let t = Instant::now();
            ckpt.load(&mut state).unwrap();
            load_s.push(t.elapsed().as_secs_f64());
        }
        let (_, peak) = titan_train::metrics::rss_bytes();
        println!(
            "{}",
            serde_json::json!({
                "tool": "titan-train",
                "size": size,
                "checkpoint": last,
                "bytes": bytes,
                "runs": runs,
                "save_s": median(save_s),
                "async_blocked_s": median(blocked_s),
                "async_total_s": median(async_total_s),
                "load_s": median(load_s),
                "peak_rss_bytes": peak,
            })
        );
    }
}
