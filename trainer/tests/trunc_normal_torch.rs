//! `model::trunc_normal_` draws what torch's `nn.init.trunc_normal_` draws from the same seed,
//! bit for bit, in both of torch's branches (a normal with the few values outside the bounds
//! drawn again, and uniform candidates accepted by the normal's density), on torch 2.13 (the
//! libtorch titan-train links, `.venv`). Its own process: libtorch's generator is global.

use std::process::Command;

use tch::{Device, Kind, Tensor};
use titan_tests::python;
use titan_train::model::trunc_normal_;

#[test]
fn draws_what_torch_draws() {
    // (std, a, b): torchtitan's linears (bounds at 100 sigma), its lm_head (3 sigma), and a
    // window in the tail (acceptance probability 0.02: the uniform branch).
    let cases = [
        (0.02, -2.0, 2.0),
        (0.0625, -0.1875, 0.1875),
        (1.0, 2.0, 3.0),
    ];
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import sys, torch
out = sys.argv[1]
cases = [(0.02, -2.0, 2.0), (0.0625, -0.1875, 0.1875), (1.0, 2.0, 3.0)]
tensors = {}
for i, (std, a, b) in enumerate(cases):
    torch.manual_seed(11 + i)
    t = torch.empty(512, 384)
    torch.nn.init.trunc_normal_(t, std=std, a=a, b=b)
    tensors[f"case{i}"] = t
from safetensors.torch import save_file
save_file(tensors, out)
"#;
    let file = dir.path().join("torch.safetensors");
    let out = Command::new(python())
        .args(["-c", script])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let torch = Tensor::read_safetensors(&file).unwrap();
    for (i, (std, a, b)) in cases.into_iter().enumerate() {
        tch::manual_seed(11 + i as i64);
        let mut t = Tensor::empty([512, 384], (Kind::Float, Device::Cpu));
        tch::no_grad(|| trunc_normal_(&mut t, std, a, b));
        let want = &torch
            .iter()
            .find(|(k, _)| *k == format!("case{i}"))
            .unwrap()
            .1;
        assert!(
            t.equal(want),
            "case {i} (std {std}, [{a}, {b}]): titan's draw differs from torch's; max |diff| {}",
            (&t - want).abs().max().double_value(&[])
        );
        let (lo, hi) = (t.min().double_value(&[]), t.max().double_value(&[]));
        assert!(
            lo >= a && hi <= b,
            "case {i}: [{lo}, {hi}] outside [{a}, {b}]"
        );
    }
}
