//! Numerics: titan's Llama-3 reproduces transformers' LlamaForCausalLM (rope_type "llama3", GQA)
//! logits to 1e-4 max abs in fp32, loading the HF-named safetensors through the q/k permutation;
//! and under bf16 mixed precision as training runs it (FSDP2's `MixedPrecisionPolicy`: fp32
//! weights gathered as bf16 for the forward and backward, fp32 gradients) its loss and gradients
//! stay as close to transformers' under `torch.autocast(bfloat16)` as bf16 itself is to fp32.

use std::process::Command;

use tch::{Device, Kind, Tensor};
use titan_tests::{python, workspace_root};
use titan_train::config::Parallelism;
use titan_train::distributed::DeviceMesh;
use titan_train::hf;
use titan_train::model::ModelArgs;
use titan_train::parallelize::ParallelModel;
use titan_train::parallelize::ParallelPlan;
use titan_train::precision::{self, Precision};

/// Runs the reference script into a temp dir and loads its weights into a titan model.
fn reference() -> (tempfile::TempDir, ParallelModel) {
    let dir = tempfile::tempdir().unwrap();
    let script = workspace_root().join("tests/python/trainer_hf_logits.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(dir.path())
        .output()
        .expect("run the .venv python (scripts/setup.sh creates it)");
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );

    let args: ModelArgs =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("args.json")).unwrap())
            .unwrap();
    assert_eq!(
        args.ffn_hidden_dim(),
        384,
        "titan's hidden rule must give HF's size"
    );
    let hf_state = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    let n_hf = hf_state.len();
    let state = hf::from_hf(hf_state, &args).unwrap();
    tch::manual_seed(0);
    let model = ParallelModel::new(args, Device::Cpu, &ParallelPlan::single()).unwrap();
    assert_eq!(state.len(), model.named_parameters().len());
    assert_eq!(n_hf, state.len());
    for (name, t) in &state {
        model.set_parameter(name, t).unwrap();
    }
    (dir, model)
}

#[test]
fn logits_match_transformers_llama() {
    let (dir, model) = reference();
    let expected = Tensor::read_safetensors(dir.path().join("expected.safetensors")).unwrap();
    let get = |n: &str| {
        expected
            .iter()
            .find(|(k, _)| k == n)
            .unwrap()
            .1
            .shallow_clone()
    };
    let (tokens, want) = (get("tokens"), get("logits"));
    let got = tch::no_grad(|| model.forward(&tokens, None));
    assert_eq!(got.size(), want.size());
    let max_abs = (&got - &want).abs().max().double_value(&[]);
    let scale = want.abs().max().double_value(&[]);
    eprintln!("max |titan - hf| = {max_abs:.3e} (logits up to {scale:.2})");
    assert!(max_abs < 1e-4, "logits differ by {max_abs}");

    // Without the q/k permutation the logits must NOT match: the test sees the RoPE layout.
    let raw = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    for (name, t) in raw {
        if let Some(titan) = titan_ckpt::adapter::from_hf_name(&name) {
            model.set_parameter(&titan, &t).unwrap();
        }
    }
    let unpermuted = tch::no_grad(|| model.forward(&tokens, None));
    let diff = (&unpermuted - &want).abs().max().double_value(&[]);
    assert!(diff > 1e-2, "unpermuted weights matched too ({diff})");

    // And back: torchtitan -> HF reproduces the original HF tensors bit for bit.
    let reloaded = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    let titan = hf::from_hf(
        reloaded
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect(),
        &model.args,
    )
    .unwrap();
    let back = hf::to_hf(&titan, &model.args).unwrap();
    for ((n0, t0), (n1, t1)) in reloaded.iter().zip(&back) {
        assert_eq!(n0, n1);
        assert!(t0.equal(t1), "{n0} changed in the round trip");
    }
}

/// titan's mean loss and HF-named gradients for the reference tokens with `precision`.
fn train_step(
    model: &ParallelModel,
    tokens: &Tensor,
    precision: Precision,
) -> (f64, Vec<(String, Tensor)>) {
    let seq = tokens.size()[1];
    let (inputs, labels) = (tokens.narrow(1, 0, seq - 1), tokens.narrow(1, 1, seq - 1));
    let loss = precision
        .run(Device::Cpu, || {
            model.summed_cross_entropy(&model.forward(&inputs, None), &labels)
                / labels.numel() as f64
        })
        .unwrap();
    loss.backward();
    let grads: Vec<(String, Tensor)> = model
        .named_parameters()
        .iter()
        .map(|(n, p)| (n.clone(), p.grad().copy()))
        .collect();
    for (_, p) in model.named_parameters() {
        p.shallow_clone().zero_grad();
    }
    let grads = hf::to_hf(&grads, &model.args).unwrap();
    (loss.double_value(&[]), grads)
}

/// ||a - b|| / ||b||.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).norm().double_value(&[]) / b.norm().double_value(&[]).max(1e-30)
}

#[test]
fn bf16_loss_and_grads_match_transformers_under_autocast() {
    let (dir, model) = reference();
    let reference = Tensor::read_safetensors(dir.path().join("train_step.safetensors")).unwrap();
    let get = |n: &str| {
        reference
            .iter()
            .find(|(k, _)| k == n)
            .unwrap_or_else(|| panic!("{n} missing"))
            .1
            .shallow_clone()
    };
    let expected = Tensor::read_safetensors(dir.path().join("expected.safetensors")).unwrap();
    let tokens = expected
        .iter()
        .find(|(k, _)| k == "tokens")
        .unwrap()
        .1
        .shallow_clone();

    let (fp32_loss, fp32_grads) = train_step(&model, &tokens, Precision::Plain);
    // The same weights as training's default builds them: `precision::param_kind` of the
    // default `[training]` (bf16 over fp32 master weights) is the dtype the plan gathers in.
    let param_kind = precision::param_kind(&Default::default());
    assert_eq!(param_kind, Kind::BFloat16);
    let plan = ParallelPlan::new(
        &DeviceMesh::single(),
        &Parallelism::default(),
        param_kind,
        Kind::Float,
    );
    let trained = ParallelModel::new(model.args.clone(), Device::Cpu, &plan).unwrap();
    for (name, t) in model.named_parameters() {
        trained.set_parameter(name, t).unwrap();
    }
    let (bf16_loss, bf16_grads) = train_step(&trained, &tokens, Precision::Plain);
    let hf_fp32 = get("fp32.loss").double_value(&[0]);
    let hf_bf16 = get("bf16.loss").double_value(&[0]);
    eprintln!(
        "loss: titan fp32 {fp32_loss} hf fp32 {hf_fp32}; titan bf16 {bf16_loss} hf bf16 {hf_bf16}"
    );
    // fp32: the same function to float rounding.
    assert!(
        (fp32_loss - hf_fp32).abs() < 1e-4,
        "fp32 loss {fp32_loss} vs {hf_fp32}"
    );
    // bf16 really computed in bf16 (it moves the loss), and titan's bf16 is as close to
    // transformers' bf16 as bf16 itself is to fp32 (x2: both sides round independently; the
    // kernels differ: SDPA vs eager softmax, complex vs rotate-half RoPE).
    let bf16_noise = (hf_bf16 - hf_fp32).abs();
    assert!(
        bf16_noise > 1e-6,
        "autocast changed nothing in transformers' loss"
    );
    assert!(
        (bf16_loss - fp32_loss).abs() > 1e-6,
        "titan's bf16 loss equals its fp32 loss"
    );
    assert!(
        (bf16_loss - hf_bf16).abs() <= 2.0 * bf16_noise + 1e-3,
        "bf16 loss {bf16_loss} vs transformers {hf_bf16} (bf16 vs fp32 there: {bf16_noise})"
    );
    for ((name, g32), (_, g16)) in fp32_grads.iter().zip(&bf16_grads) {
        let (hf32, hf16) = (
            get(&format!("fp32.grad.{name}")),
            get(&format!("bf16.grad.{name}")),
        );
        assert_eq!(
            g16.kind(),
            Kind::Float,
            "{name}: gradients of fp32 weights are fp32"
        );
        assert!(
            rel_err(g32, &hf32) < 1e-4,
            "{name}: fp32 grad differs by {}",
            rel_err(g32, &hf32)
        );
        let noise = rel_err(&hf16, &hf32);
        let err = rel_err(g16, &hf16);
        eprintln!("{name}: bf16 grad vs transformers' {err:.2e} (bf16 vs fp32 there {noise:.2e})");
        assert!(
            err <= 2.0 * noise + 1e-3,
            "{name}: bf16 grad differs from transformers' by {err:.3e}, more than 2x bf16's own \
             error {noise:.3e}"
        );
    }
}
