//! titan-train checkpoints in torchtitan 0.3.0: its own Llama-3 model (torch 2.15,
//! `TITAN_TT_PYTHON`) loads a titan-train DCP checkpoint with `dcp.load` bit for bit, and its
//! `to_hf` of those weights equals titan-train's HF export bit for bit. (Resuming from the older
//! names is in trainckpt_resume.rs.)

use std::path::Path;

use titan_tests::{output_text, run_ok, small_run, tt_python_script};

fn train(dump: &Path, extra: &[&str]) {
    run_ok(&mut small_run(dump, extra));
}

const SAVE_AT_3: &[&str] = &[
    "--training.steps",
    "3",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "3",
    "--checkpoint.last_save_model_only=false",
];

#[test]
fn torchtitan_0_3_loads_a_titan_checkpoint_bit_for_bit() {
    let dcp_run = tempfile::tempdir().unwrap();
    train(dcp_run.path(), SAVE_AT_3);
    // The same deterministic run, its last save as HF safetensors (fp32).
    let hf_run = tempfile::tempdir().unwrap();
    train(
        hf_run.path(),
        &[SAVE_AT_3, &["--checkpoint.last_save_in_hf"]].concat(),
    );
    let step = |run: &Path| run.join("checkpoint/step-3").to_str().unwrap().to_string();
    let out = run_ok(tt_python_script("tests/python/tt_train_load.py").args([
        step(dcp_run.path()),
        "debugmodel".into(),
        step(hf_run.path()),
    ]));
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", output_text(&out)));
    assert_eq!(report["torchtitan"], "0.3.0", "{report}");
    assert_eq!(report["weights"], 57, "{report}");
    assert_eq!(report["hf_checked"], 57, "{report}");
}
