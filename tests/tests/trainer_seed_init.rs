//! titan-train initialises the model as torchtitan 0.3.0 does, and writes a seed checkpoint as
//! torchtitan's `--checkpoint.create_seed_checkpoint` does (tests/python/tt_seed_init.py).
//!
//! The seed checkpoints of both (one process, step 0; full checkpoints, as the registry's
//! debugmodel sets `last_save_model_only = false`) hold the same keys, shapes and dtypes, and the
//! same optimizer state (what torch's DCP initialises before a first step: zero moments, step
//! 1); titan-train adds only its RNG state. The initial weights cannot be equal value for value (the two draw from the RNG in
//! different orders), so each parameter's distribution is compared instead, pooled over several
//! seeds: titan-train's seed checkpoints against torchtitan's own `init_states`. Per parameter:
//! all ones (norms) on both sides or neither, the mean within 6 standard errors, the standard deviation
//! within 6 of its standard errors, and the fractions of values beyond 2 and 3 of torchtitan's
//! standard deviations within 6 standard errors (a truncation at 3 sigma, as `lm_head`'s, leaves
//! none beyond 3; a missing one 0.27%). The extremes are not compared: a normal's largest value
//! over a few hundred thousand draws varies by a third of a sigma from run to run.

use titan_tests::{bin, output_text, tt_python_script};

const SEEDS: u32 = 6;

#[test]
fn initialisation_and_seed_checkpoint_match_torchtitan() {
    let dir = tempfile::tempdir().unwrap();
    let out = tt_python_script("tests/python/tt_seed_init.py")
        .arg(dir.path())
        .arg(bin("titan-train"))
        .arg(SEEDS.to_string())
        .output()
        .unwrap();
    let text = output_text(&out);
    assert!(out.status.success(), "tt_seed_init.py failed:\n{text}");
    let last = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let v: serde_json::Value =
        serde_json::from_str(&last).unwrap_or_else(|e| panic!("{e}: {text}"));
    for field in ["only_torchtitan", "only_titan", "layout_differs"] {
        assert_eq!(
            v[field],
            serde_json::json!([]),
            "seed checkpoints differ ({field})"
        );
    }
    assert_eq!(v["params"], 57, "the debug model's state dict");

    let (titan, tt) = (
        v["titan"].as_object().unwrap(),
        v["torchtitan"].as_object().unwrap(),
    );
    assert_eq!(titan.len(), tt.len());
    let mut problems = Vec::new();
    for (name, b) in tt {
        let a = &titan[name];
        let f = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap();
        let (na, nb) = (f(a, "n"), f(b, "n"));
        let (sa, sb) = (f(a, "std"), f(b, "std"));
        // All ones (a norm) on both sides or on neither (a normal draw may hit 1.0 exactly, rarely).
        if (f(a, "ones") == 1.0) != (f(b, "ones") == 1.0) {
            problems.push(format!(
                "{name}: fraction of ones {} vs torchtitan's {}",
                f(a, "ones"),
                f(b, "ones")
            ));
        }
        let mean_tol = 6.0 * (sa * sa / na + sb * sb / nb).sqrt();
        if (f(a, "mean") - f(b, "mean")).abs() > mean_tol {
            problems.push(format!(
                "{name}: mean {} vs torchtitan's {} (tolerance {mean_tol:.2e})",
                f(a, "mean"),
                f(b, "mean")
            ));
        }
        // The standard error of a sample standard deviation is about std / sqrt(2 n).
        let std_tol = 6.0 * (sa * sa / (2.0 * na) + sb * sb / (2.0 * nb)).sqrt();
        if (sa - sb).abs() > std_tol {
            problems.push(format!(
                "{name}: std {sa} vs torchtitan's {sb} (tolerance {std_tol:.2e})"
            ));
        }
        for k in ["tail2", "tail3"] {
            let (pa, pb) = (f(a, k), f(b, k));
            // A binomial proportion's standard error, from the pooled proportion.
            let pooled = (pa * na + pb * nb) / (na + nb);
            let tol = 6.0 * (pooled * (1.0 - pooled) * (1.0 / na + 1.0 / nb)).sqrt();
            if (pa - pb).abs() > tol {
                problems.push(format!(
                    "{name}: fraction beyond {} sigma {pa:.3e} vs torchtitan's {pb:.3e} \
                     (tolerance {tol:.1e})",
                    &k[4..]
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "titan-train's initialisation differs from torchtitan's:\n{}",
        problems.join("\n")
    );
}
