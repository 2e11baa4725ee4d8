//! titan-train checkpoints in torchtitan 0.3.0: its own Llama-3 model (torch 2.15,
//! `TITAN_TT_PYTHON`) loads a titan-train DCP checkpoint with `dcp.load` bit for bit, and its
//! `to_hf` of those weights equals titan-train's HF export bit for bit. (Resuming from the older
//! names is in trainckpt_resume.rs.)

use std::path::Path;

use titan_tests::{output_text, run_ok, small_run, titan_ckpt, tt_python_script};

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

/// torchtitan's model loads `dcp_run`'s step-3 checkpoint bit for bit, and its `to_hf` of it
/// equals `hf_run`'s step-3 HF export (57 weights each).
fn assert_torchtitan_loads(dcp_run: &Path, hf_run: &Path) {
    let step = |run: &Path| run.join("checkpoint/step-3").to_str().unwrap().to_string();
    let out = run_ok(tt_python_script("tests/python/tt_train_load.py").args([
        step(dcp_run),
        "debugmodel".into(),
        step(hf_run),
    ]));
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", output_text(&out)));
    assert_eq!(report["torchtitan"], "0.3.0", "{report}");
    assert_eq!(report["weights"], 57, "{report}");
    assert_eq!(report["hf_checked"], 57, "{report}");
}

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
    assert_torchtitan_loads(dcp_run.path(), hf_run.path());
}

/// A pipeline-parallel checkpoint: each of the two stages writes its own parameters under
/// their global names, and torchtitan's one-process model loads the whole of it bit for bit;
/// the HF export the two stages write together is torchtitan's `to_hf` of it.
#[test]
fn torchtitan_0_3_loads_a_pp2_checkpoint_bit_for_bit() {
    const PP2: &[&str] = &[
        "--nproc-per-node",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
    ];
    let dcp_run = tempfile::tempdir().unwrap();
    train(dcp_run.path(), &[SAVE_AT_3, PP2].concat());
    let hf_run = tempfile::tempdir().unwrap();
    train(
        hf_run.path(),
        &[SAVE_AT_3, PP2, &["--checkpoint.last_save_in_hf"]].concat(),
    );
    assert_torchtitan_loads(dcp_run.path(), hf_run.path());
}

/// The families' HF checkpoints: qwen3 dense (tied embeddings) and MoE, and deepseek_v3. The
/// same deterministic run saved as a DCP checkpoint and as HF safetensors; torchtitan's own
/// model of the family loads the DCP one bit for bit and its state-dict adapter's `to_hf` of it
/// equals titan-train's HF export (the tied `lm_head.weight` and qwen3's `expert_bias_E` left
/// out as torchtitan leaves them, deepseek_v3's written as `e_score_correction_bias`, each
/// expert's weights split out of the stacked tensors). The export then loads back
/// (`initial_load_in_hf`: the experts stacked again, the routing biases into their buffers)
/// and, one step at learning rate 0 later (with round-robin routing on the MoE models, which
/// leaves the biases where they are), exports again equal to the bit (`titan-ckpt diff`).
/// transformers loads each export from its config.json and computes torchtitan's logits
/// (tests/python/tt_hf_logits.py: measured 3.1e-7 qwen3 dense and MoE, 4.4e-5 deepseek_v3, of the
/// largest logit; deepseek_v3's debug model routes with softmax scores, which transformers'
/// DeepseekV3 cannot be told, so the check gives its router a softmax: with its sigmoid the
/// logits were 1.8e-2 apart).
fn family_hf_export_is_torchtitans_to_hf_and_loads_back(
    module: &str,
    flavor: &str,
    dcp_weights: u64,
    hf_weights: u64,
) {
    let model = ["--model.name", module, "--model.flavor", flavor];
    let what = format!("{module}:{flavor}");
    let save_at_3 = [&model[..], &SAVE_AT_3[..SAVE_AT_3.len() - 1]].concat();
    let dcp_run = tempfile::tempdir().unwrap();
    train(dcp_run.path(), &save_at_3);
    let hf_run = tempfile::tempdir().unwrap();
    train(
        hf_run.path(),
        &[&save_at_3[..], &["--checkpoint.last_save_in_hf"]].concat(),
    );
    let step = |run: &Path, n: u32| run.join(format!("checkpoint/step-{n}"));
    // `script DCP MODULE:FLAVOR HF`'s JSON report.
    let check = |script: &str| -> serde_json::Value {
        let out = run_ok(tt_python_script(script).args([
            step(dcp_run.path(), 3).to_str().unwrap(),
            &what,
            step(hf_run.path(), 3).to_str().unwrap(),
        ]));
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", output_text(&out)))
    };
    let report = check("tests/python/tt_train_load.py");
    assert_eq!(report["weights"], dcp_weights, "{what}: {report}");
    assert_eq!(report["hf_checked"], hf_weights, "{what}: {report}");
    // transformers runs the export (its config.json alone) as torchtitan runs the DCP one.
    let logits = check("tests/python/tt_hf_logits.py");
    assert!(
        logits["logits_rel"].as_f64().unwrap() <= 1e-4,
        "{what}: {logits}"
    );

    let back = tempfile::tempdir().unwrap();
    let hf = step(hf_run.path(), 3);
    let moe: &[&str] = match flavor {
        "debugmodel" if module == "qwen3" => &[],
        _ => &["--debug.moe_force_load_balance"],
    };
    train(
        back.path(),
        &[
            &model[..],
            moe,
            &[
                "--training.steps",
                "1",
                "--optimizer.lr",
                "0",
                "--checkpoint.enable",
                "--checkpoint.initial_load_path",
                hf.to_str().unwrap(),
                "--checkpoint.initial_load_in_hf",
                "--checkpoint.last_save_in_hf",
            ],
        ]
        .concat(),
    );
    let diff = titan_ckpt()
        .arg("diff")
        .arg(&hf)
        .arg(step(back.path(), 1))
        .output()
        .unwrap();
    assert!(diff.status.success(), "{what}: {}", output_text(&diff));
}

#[test]
fn qwen3_dense_hf_export_is_torchtitans_to_hf_and_loads_back() {
    family_hf_export_is_torchtitans_to_hf_and_loads_back("qwen3", "debugmodel", 91, 90);
}

/// The MoE case CI runs is DeepSeek-V3's; qwen3's 316 M-parameter MoE debug model takes minutes
/// of CI's two cores for the same paths (stacked experts split out, routing biases).
#[test]
#[ignore = "full matrix: bash bench/full_matrix.sh"]
fn qwen3_moe_hf_export_is_torchtitans_to_hf_and_loads_back() {
    family_hf_export_is_torchtitans_to_hf_and_loads_back("qwen3", "debugmodel_moe", 107, 1611);
}

#[test]
fn deepseek_v3_hf_export_is_torchtitans_to_hf_and_loads_back() {
    family_hf_export_is_torchtitans_to_hf_and_loads_back("deepseek_v3", "debugmodel", 88, 193);
}
