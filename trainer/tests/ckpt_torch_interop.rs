//! titan-train checkpoints against the real PyTorch and transformers from `.venv`:
//! - a full DCP save loads with `torch.distributed.checkpoint.load` into a plain state dict with
//!   exactly the live tensors' values, and its optimizer keys load into a real `torch.optim.AdamW`
//!   through `set_optimizer_state_dict(flatten_optimizer_state_dict=True)`;
//! - the HF export (`last_save_in_hf`) loads in transformers' LlamaForCausalLM and gives
//!   titan's loss on a fixed batch.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use titan_tests::{python_script, run_ok, tf4_python_script};
use titan_train::checkpoint::{Checkpointer, TrainerState};
use titan_train::config::{Checkpoint, LrScheduler};
use titan_train::data::{Dataset, PrefetchLoader, TextLoader, TextTokenizer};
use titan_train::lr_scheduler::LrSchedule;
use titan_train::model::ModelArgs;
use titan_train::names;
use titan_train::optim::{AdamW, AdamWParams, ParamState};
use titan_train::parallel::Mesh;
use titan_train::parallelize::ParallelModel;
use titan_train::parallelize::ParallelPlan;

/// Runs `cmd` (a `.venv` Python script) with `args`; its stdout.
fn python(mut cmd: Command, args: &[&Path]) -> String {
    String::from_utf8_lossy(&run_ok(cmd.args(args)).stdout).into_owned()
}

struct Run {
    model: ParallelModel,
    optimizer: AdamW,
    loader: PrefetchLoader,
    schedule: LrSchedule,
}

fn small_args() -> ModelArgs {
    ModelArgs {
        dim: 64,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: Some(2),
        max_seq_len: 32,
        ..ModelArgs::flavor("debugmodel").unwrap()
    }
}

fn setup(total_steps: u64) -> Run {
    tch::manual_seed(7);
    let tokenizer = Arc::new(TextTokenizer::embedded().unwrap());
    let loader = TextLoader::new(
        Dataset::resolve("default", None, "training").unwrap(),
        tokenizer,
        32,
        2,
        0,
        1,
        true,
    );
    let loader = PrefetchLoader::new(loader, 2);
    Run {
        model: ParallelModel::new(small_args(), Device::Cpu, &ParallelPlan::single()).unwrap(),
        optimizer: AdamW::new(AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            fused: true,
        }),
        loader,
        schedule: LrSchedule::new(&LrScheduler::default(), 1e-3, total_steps),
    }
}

/// One plain training step (loss = mean CE), as the loop does it on one rank.
fn train_step(run: &mut Run, step: u64) {
    let batch = run.loader.next_batch(Device::Cpu).unwrap().unwrap();
    let logits = run.model.forward(&batch.inputs, Some(&batch.positions));
    let n = batch.labels.ne(-100).sum(Kind::Int64).int64_value(&[]);
    let loss = run.model.summed_cross_entropy(&logits, &batch.labels) / n as f64;
    loss.backward();
    let lr = run.schedule.lr_for_step(step);
    for (name, p) in run.model.named_parameters() {
        run.optimizer.step_param(name, p, lr).unwrap();
        let _ = p.grad().zero_();
    }
}

fn state(run: &mut Run) -> TrainerState<'_> {
    TrainerState {
        model: &run.model,
        optimizer: &mut run.optimizer,
        loader: &mut run.loader,
        schedule: &run.schedule,
    }
}

#[test]
fn dcp_save_loads_in_torch_with_the_same_values() {
    let dump = tempfile::tempdir().unwrap();
    let cfg = Checkpoint {
        enable: true,
        interval: 3,
        last_save_model_only: false,
        ..Checkpoint::default()
    };
    let mut run = setup(3);
    let mut ckpt = Checkpointer::new(&cfg, dump.path(), Mesh::single()).unwrap();
    for step in 1..=3 {
        train_step(&mut run, step);
        ckpt.after_step(step, 3, 64, &state(&mut run)).unwrap();
    }
    ckpt.finish().unwrap();
    let dir = dump.path().join("checkpoint/step-3");
    assert!(dir.join(".metadata").is_file());

    // The live values, written by libtorch's own safetensors writer under the state keys.
    let mut expected: Vec<(String, Tensor)> = Vec::new();
    // The q/k/v projections' AdamW state under torchtitan's fused `wqkv` name.
    let opt = &run.optimizer.state;
    for (fqn, p) in run.model.named_parameters() {
        expected.push((fqn.clone(), p.detach().copy()));
        let (name, exp_avg, exp_avg_sq) = match names::fused_qkv(fqn) {
            None => (
                fqn.clone(),
                opt[fqn].exp_avg.copy(),
                opt[fqn].exp_avg_sq.copy(),
            ),
            Some((0, fused)) => {
                let part = |p: &str, f: fn(&ParamState) -> &Tensor| {
                    f(&opt[&fqn.replace(".wq.", &format!(".{p}."))]).shallow_clone()
                };
                let fuse = |f: fn(&ParamState) -> &Tensor| {
                    let kv = run.model.args.kv_heads();
                    names::fuse_qkv(&part("wq", f), &part("wk", f), &part("wv", f), kv)
                };
                (fused, fuse(|s| &s.exp_avg), fuse(|s| &s.exp_avg_sq))
            }
            Some(_) => continue,
        };
        expected.push((format!("optimizer.state.{name}.exp_avg"), exp_avg));
        expected.push((format!("optimizer.state.{name}.exp_avg_sq"), exp_avg_sq));
        expected.push((
            format!("optimizer.state.{name}.step"),
            Tensor::from_slice(&[opt[fqn].step as f32]).reshape(Vec::<i64>::new()),
        ));
    }
    let expected_file = dump.path().join("expected.safetensors");
    Tensor::write_safetensors(&expected, &expected_file).unwrap();
    let out = python(
        python_script("tests/python/trainckpt_torch_load.py"),
        &[&dir, &expected_file],
    );
    assert!(out.contains("OK"), "{out}");

    // And the checkpoint resumes into a fresh run with identical state.
    let mut fresh = setup(3);
    let mut ckpt = Checkpointer::new(&cfg, dump.path(), Mesh::single()).unwrap();
    assert_eq!(ckpt.load(&mut state(&mut fresh)).unwrap(), 3);
    for (fqn, p) in run.model.named_parameters() {
        assert!(
            p.equal(fresh.model.parameter(fqn).unwrap()),
            "{fqn} differs after load"
        );
        let (a, b) = (&run.optimizer.state[fqn], &fresh.optimizer.state[fqn]);
        assert!(
            a.exp_avg.equal(&b.exp_avg) && a.exp_avg_sq.equal(&b.exp_avg_sq) && a.step == b.step
        );
    }
    assert_eq!(run.loader.state(), fresh.loader.state());
}

#[test]
fn hf_export_loads_in_transformers_with_the_same_loss() {
    let dump = tempfile::tempdir().unwrap();
    let cfg = Checkpoint {
        enable: true,
        interval: 100,
        last_save_in_hf: true,
        export_dtype: titan_train::config::DtypeName::Float32,
        ..Checkpoint::default()
    };
    let mut run = setup(2);
    let mut ckpt = Checkpointer::new(&cfg, dump.path(), Mesh::single()).unwrap();
    for step in 1..=2 {
        train_step(&mut run, step);
        ckpt.after_step(step, 2, 64, &state(&mut run)).unwrap();
    }
    ckpt.finish().unwrap();
    let dir = dump.path().join("checkpoint/step-2");
    assert!(
        dir.join("model.safetensors").is_file(),
        "HF export missing in {}",
        dir.display()
    );
    assert!(
        !dir.join("sharded").exists(),
        "the sharded files are consolidated away"
    );

    tch::manual_seed(99);
    let tokens = Tensor::randint(2048, [2, 24], (Kind::Int64, Device::Cpu));
    let inputs = tokens.narrow(1, 0, 23);
    let labels = tokens.narrow(1, 1, 23);
    let loss = tch::no_grad(|| {
        let logits = run.model.forward(&inputs, None);
        run.model
            .summed_cross_entropy(&logits, &labels)
            .double_value(&[])
            / labels.numel() as f64
    });
    let batch = dump.path().join("batch.json");
    let ids: Vec<i64> = Vec::try_from(&tokens.view([-1])).unwrap();
    std::fs::write(
        &batch,
        serde_json::json!({"tokens": ids, "shape": [2, 24]}).to_string(),
    )
    .unwrap();
    // transformers 5 reads RoPE from `rope_parameters`, transformers 4 from `rope_theta` /
    // `rope_scaling`: the exported config.json must carry both.
    const SCRIPT: &str = "tests/python/trainckpt_hf_loss.py";
    for (version, mut cmd) in [
        ("5", python_script(SCRIPT)),
        ("4", tf4_python_script(SCRIPT)),
    ] {
        let o = run_ok(cmd.args([&dir, &batch]));
        // The config.json is titan-ckpt's: `rope_theta` at the top, not inside `rope_scaling`,
        // where transformers 4 reports it as an unrecognized key.
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            !stderr.contains("Unrecognized keys"),
            "transformers {version}: {stderr}"
        );
        let theirs: f64 = String::from_utf8_lossy(&o.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("loss "))
            .expect("the script prints `loss X`")
            .trim()
            .parse()
            .unwrap();
        assert!(
            (theirs - loss).abs() < 1e-4,
            "transformers {version} loss {theirs} vs titan {loss}"
        );
    }
}
