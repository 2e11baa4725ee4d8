//! titan-train's float8 linear against torchao 0.18's `Float8Linear` on the same inputs
//! (tests/python/float8_torchao.py runs torchao): every recipe (tensorwise, rowwise,
//! rowwise_with_gw_hp), both ways of multiplying (emulated, as torchao's `emulate=True`, and
//! `torch._scaled_mm`, whose CPU kernel both run) and both input dtypes (f32, bf16).
//!
//! What must agree, and the tolerance derived from it:
//! - the scales: bit-identical (the same amax, the same f64 division, the same power-of-two
//!   rounding), hence the same float8 operands;
//! - the output and both gradients: the two sides multiply the same float8 operands, so they
//!   differ only by the order in which the kernels (libtorch 2.13 here, torch 2.15 there) sum
//!   the n products of each element. Each sum is within n·2⁻²⁴·(|a|·|b|) of the exact one
//!   (f32 accumulation), so the two within 2·n·2⁻²⁴·(|a|·|b|); |a|, |b| are the dequantised
//!   operands, at most 1.3x the high-precision ones (e4m3 rounds by ≤ 2⁻⁴, e5m2 by ≤ 2⁻³, both
//!   operands). An output rounded to bf16 (bf16 inputs; rowwise `_scaled_mm`, whose kernel has
//!   no f32 output) may land one bf16 step (2⁻⁸ relative) apart on top.

use std::process::Command;

use tch::{Kind, Tensor};
use titan_tests::{tt_python, workspace_root};
use titan_train::distributed::DeviceMesh;
use titan_train::float8::{Backend, Float8Linear, Recipe, WeightSplit};

/// |got - want| <= 2·n·2⁻²⁴·1.3·(|a|·|b|) + (one bf16 step of |want| when `bf16_rounded`),
/// elementwise; returns the largest difference and its worst ratio to the bound.
fn within_bound(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    (a, b): (&Tensor, &Tensor),
    bf16_rounded: bool,
) -> (f64, f64) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    assert_eq!(got.kind(), want.kind(), "{what}: dtype");
    let f = |t: &Tensor| t.to_kind(Kind::Double);
    let n = a.size()[1] as f64;
    let magnitude = f(a).abs().mm(&f(b).abs()).reshape(want.size().as_slice());
    let mut bound = magnitude * (2.0 * n * 2f64.powi(-24) * 1.3);
    if bf16_rounded {
        bound += f(want).abs() * 2f64.powi(-8);
    }
    let diff = (f(got) - f(want)).abs();
    let worst = (&diff / (&bound + 1e-30)).max().double_value(&[]);
    let largest = diff.max().double_value(&[]);
    assert!(
        worst <= 1.0,
        "{what}: max |diff| {largest} exceeds the bound (worst ratio {worst})"
    );
    // Not a comparison of zeros.
    assert!(
        f(want).abs().max().double_value(&[]) > 1e-3,
        "{what}: {want}"
    );
    (largest, worst)
}

#[test]
fn float8_linear_matches_torchao() {
    let dir = tempfile::tempdir().unwrap();
    let script = workspace_root().join("tests/python/float8_torchao.py");
    let out = Command::new(tt_python())
        .arg(&script)
        .arg(dir.path())
        .output()
        .expect("run the .venv-tt python (scripts/setup.sh creates it, with torchao)");
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let tp = DeviceMesh::single().tp;
    let mut checked = 0;
    for recipe in [Recipe::Tensorwise, Recipe::Rowwise, Recipe::RowwiseWithGwHp] {
        for (path, backend) in [
            ("emulate", Backend::Emulated),
            ("scaled", Backend::ScaledMm),
        ] {
            for dtype in ["float32", "bfloat16"] {
                let name = format!("{}-{path}-{dtype}", recipe.name());
                let file = dir.path().join(format!("{name}.safetensors"));
                let t = Tensor::read_safetensors(&file).unwrap();
                let get = |k: &str| {
                    t.iter()
                        .find(|(n, _)| n == k)
                        .unwrap_or_else(|| panic!("{name}: no {k}"))
                        .1
                        .shallow_clone()
                };
                let f8 = Float8Linear::new(recipe, backend, tp.clone(), WeightSplit::Whole);
                let (x, w, go) = (get("x"), get("w"), get("grad_out"));
                for (i, key) in ["scale_x", "scale_w", "scale_go"].iter().enumerate() {
                    let ours = &f8.scales(&x, &w, &go)[i];
                    let theirs = get(key);
                    assert_eq!(ours.size(), theirs.size(), "{name} {key}: shape");
                    assert!(ours.equal(&theirs), "{name} {key}: {ours} vs {theirs}");
                }
                let xg = x.copy().set_requires_grad(true);
                let wg = w.copy().set_requires_grad(true);
                let y = f8.apply(&xg, &wg);
                (&y * &go).sum(Kind::Float).backward();
                let (k, n) = (w.size()[1], w.size()[0]);
                let (x2, go2) = (x.reshape([-1, k]), go.reshape([-1, n]));
                let rowwise_scaled = recipe != Recipe::Tensorwise && backend == Backend::ScaledMm;
                let bf16 = dtype == "bfloat16";
                let r = [
                    within_bound(
                        &format!("{name} y"),
                        &y.detach(),
                        &get("y"),
                        (&x2, &w.tr()),
                        bf16 || rowwise_scaled,
                    ),
                    within_bound(
                        &format!("{name} grad_x"),
                        &xg.grad(),
                        &get("grad_x"),
                        (&go2, &w),
                        bf16 || rowwise_scaled,
                    ),
                    within_bound(
                        &format!("{name} grad_w"),
                        &wg.grad(),
                        &get("grad_w"),
                        (&go2.tr(), &x2),
                        bf16 || (rowwise_scaled && recipe == Recipe::Rowwise),
                    ),
                ];
                println!("{name}: (max |diff|, worst diff / bound) for y, grad_x, grad_w: {r:?}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 12);
}
