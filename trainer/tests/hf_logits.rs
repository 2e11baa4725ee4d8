//! Numerics: titan's Llama-3 reproduces transformers' LlamaForCausalLM (rope_type "llama3", GQA)
//! logits to 1e-4 max abs in fp32, loading the HF-named safetensors through the q/k permutation.

use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{Device, Tensor};
use titan_train::hf;
use titan_train::model::{Llama, ModelArgs};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn python() -> PathBuf {
    std::env::var_os("TITAN_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

#[test]
fn logits_match_transformers_llama() {
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
    let model = Llama::new(args, Device::Cpu).unwrap();
    assert_eq!(state.len(), model.named_parameters().len());
    assert_eq!(n_hf, state.len());
    for (name, t) in &state {
        model.set_parameter(name, t).unwrap();
    }

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
    let got = tch::no_grad(|| model.forward(&tokens));
    assert_eq!(got.size(), want.size());
    let max_abs = (&got - &want).abs().max().double_value(&[]);
    let scale = want.abs().max().double_value(&[]);
    eprintln!("max |titan - hf| = {max_abs:.3e} (logits up to {scale:.2})");
    assert!(max_abs < 1e-4, "logits differ by {max_abs}");

    // Without the q/k permutation the logits must NOT match: the test sees the RoPE layout.
    let raw = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    for (name, t) in raw {
        if let Some(titan) = hf::titan_name(&name) {
            model.set_parameter(&titan, &t).unwrap();
        }
    }
    let unpermuted = tch::no_grad(|| model.forward(&tokens));
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
