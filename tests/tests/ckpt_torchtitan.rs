//! titan-ckpt against torchtitan 0.3.0 and torch 2.15 (TITAN_TT_PYTHON): fixtures written by
//! torchtitan's own Llama-3 debugmodel and Llama3StateDictAdapter (tests/python/tt_ckpt_llama3.py),
//! converted by titan-ckpt and checked by transformers 5 (TITAN_PYTHON) and 4 (TITAN_TF4_PATH),
//! torchtitan's `to_hf` bytes and torch 2.15's `dcp.load`; committed torch 2.15 DCP fixtures.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use titan_tests::{
    binary_subdir, ckpt, output_text, python_script, run_ok, tf4_python_script, tt_python_script,
    workspace_root,
};

const SCRIPT: &str = "tests/python/tt_ckpt_llama3.py";

/// The torchtitan fixtures, made once per test binary.
fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = binary_subdir("torchtitan");
        run_ok(tt_python_script(SCRIPT).arg("make").arg(&d));
        d
    })
}

fn check_hf(hf: &Path, tf4: bool) -> String {
    let mut c = if tf4 {
        tf4_python_script(SCRIPT)
    } else {
        python_script(SCRIPT)
    };
    c.arg("check-hf").arg(hf).arg(fixtures());
    String::from_utf8_lossy(&run_ok(&mut c).stdout).into_owned()
}

/// A torchtitan run folder: `checkpoint/step-10` complete, `step-20` interrupted (no
/// `.metadata`), holding the 2-rank FSDP checkpoint with optimizer state.
fn run_folder(tmp: &Path) -> PathBuf {
    let run = tmp.join("run");
    let step10 = run.join("checkpoint/step-10");
    std::fs::create_dir_all(&step10).unwrap();
    for e in std::fs::read_dir(fixtures().join("dcp2")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), step10.join(e.file_name())).unwrap();
    }
    let step20 = run.join("checkpoint/step-20");
    std::fs::create_dir_all(&step20).unwrap();
    std::fs::copy(
        fixtures().join("dcp2/__0_0.distcp"),
        step20.join("__0_0.distcp"),
    )
    .unwrap();
    run
}

#[test]
fn fsdp_checkpoint_to_hf_equals_torchtitan_to_hf_and_logits_in_transformers_4_and_5() {
    let tmp = tempfile::tempdir().unwrap();
    let run = run_folder(tmp.path());
    let out = tmp.path().join("hf");
    let o =
        run_ok(
            ckpt()
                .arg("convert")
                .arg(&run)
                .arg(&out)
                .args(["--to", "hf", "--adapter", "auto"]),
        );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("step-10") && err.contains("picked llama3"),
        "{err}"
    );
    assert!(
        check_hf(&out, false).contains("ok transformers 5."),
        "transformers 5"
    );
    assert!(
        check_hf(&out, true).contains("ok transformers 4."),
        "transformers 4"
    );
    // One process, model-only DCP, the llama3 adapter named explicitly.
    let out1 = tmp.path().join("hf1");
    run_ok(
        ckpt()
            .arg("convert")
            .arg(fixtures().join("dcp1"))
            .arg(&out1)
            .args(["--to", "hf", "--adapter", "llama3"]),
    );
    run_ok(
        ckpt()
            .arg("diff")
            .arg(&out1)
            .arg(fixtures().join("expected_hf.safetensors")),
    );
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out1.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_theta"], 500000.0);
    assert_eq!(cfg["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(cfg["rope_parameters"]["rope_type"], "llama3");
    assert_eq!(cfg["num_attention_heads"], 16);
}

#[test]
fn hf_to_dcp_loads_in_torchtitan_in_both_name_generations() {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = tmp.path().join("dcp");
    run_ok(
        ckpt()
            .arg("convert")
            .arg(fixtures().join("expected_hf.safetensors"))
            .arg(&dcp)
            .args(["--to", "dcp", "--adapter", "llama3"]),
    );
    let o = run_ok(
        tt_python_script(SCRIPT)
            .arg("check-dcp")
            .arg(&dcp)
            .arg(fixtures()),
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("ok torch 2.15"),
        "{}",
        output_text(&o)
    );
    // The older generation's names on request; they convert back to the same HF bytes.
    let legacy = tmp.path().join("legacy");
    run_ok(
        ckpt()
            .arg("convert")
            .arg(fixtures().join("expected_hf.safetensors"))
            .arg(&legacy)
            .args(["--to", "dcp", "--adapter", "llama3", "--tt-names", "legacy"]),
    );
    let o = run_ok(ckpt().arg("inspect").arg(&legacy).arg("--json"));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"output.weight") && names.contains(&"layers.5.attention.wq.weight"));
    assert!(!names.iter().any(|n| n.contains("qkv_linear")));
    let back = tmp.path().join("back");
    run_ok(ckpt().arg("convert").arg(&legacy).arg(&back).args([
        "--to",
        "hf",
        "--adapter",
        "llama3",
    ]));
    run_ok(
        ckpt()
            .arg("diff")
            .arg(&back)
            .arg(fixtures().join("expected_hf.safetensors")),
    );
}

#[test]
fn inspect_counts_model_parameters_apart_from_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let run = run_folder(tmp.path());
    let o = run_ok(ckpt().arg("inspect").arg(&run).arg("--json"));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["parameter_count"], 6_163_712,
        "debugmodel has 6.16 M parameters"
    );
    assert!(v["total_elements"].as_u64().unwrap() > 3 * 6_163_712);
    assert!(v["path"].as_str().unwrap().ends_with("step-10"));
    // Every step folder incomplete: a clear error, exit 2.
    std::fs::remove_dir_all(run.join("checkpoint/step-10")).unwrap();
    let o = ckpt().arg("verify").arg(&run).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no complete step-N"),
        "{}",
        output_text(&o)
    );
}

#[test]
fn convert_splits_across_torchrun_and_slurm_processes() {
    let tmp = tempfile::tempdir().unwrap();
    for (scheme, (rank_var, world_var)) in [
        ("torchrun", ("RANK", "WORLD_SIZE")),
        ("slurm", ("SLURM_PROCID", "SLURM_NTASKS")),
    ] {
        let out = tmp.path().join(scheme);
        let spawn = |rank: u32| {
            ckpt()
                .arg("convert")
                .arg(fixtures().join("dcp1"))
                .arg(&out)
                .args([
                    "--to",
                    "hf",
                    "--adapter",
                    "llama3",
                    "--max-shard-size",
                    "5MB",
                ])
                .env(rank_var, rank.to_string())
                .env(world_var, "2")
                .spawn()
                .unwrap()
        };
        let (a, b) = (spawn(0), spawn(1));
        for c in [a, b] {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{scheme}: {}", output_text(&o));
        }
        assert!(
            out.join("model.safetensors.index.json").exists(),
            "{scheme}"
        );
        run_ok(
            ckpt()
                .arg("diff")
                .arg(&out)
                .arg(fixtures().join("expected_hf.safetensors")),
        );
    }
}

#[test]
fn torch_2_15_dcp_fixtures_read_and_convert_exactly() {
    let fx = workspace_root().join("tests/fixtures/ckpt/torch-2.15");
    let expected = fx.join("expected.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    for case in ["one", "two"] {
        run_ok(ckpt().arg("verify").arg(fx.join(case)));
        run_ok(ckpt().arg("diff").arg(fx.join(case)).arg(&expected));
        let hf = tmp.path().join(format!("{case}-hf"));
        run_ok(
            ckpt()
                .arg("convert")
                .arg(fx.join(case))
                .arg(&hf)
                .args(["--to", "hf"]),
        );
        run_ok(ckpt().arg("diff").arg(&hf).arg(&expected));
        // Rewritten by titan as DCP (5-tuple TensorProperties), it reads back equal.
        let dcp = tmp.path().join(format!("{case}-dcp"));
        run_ok(
            ckpt()
                .arg("convert")
                .arg(fx.join(case))
                .arg(&dcp)
                .args(["--to", "dcp"]),
        );
        run_ok(ckpt().arg("diff").arg(&dcp).arg(&expected));
    }
}

#[test]
fn adapter_errors_name_what_was_looked_for_and_write_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 4] = [
        // The wrong family: qwen3 needs q_norm to know the head dim, gpt_oss its sinks.
        (&["--adapter", "qwen3"], "layers.0.attention.q_norm.weight"),
        (&["--adapter", "gpt_oss"], "layers.0.attention.sinks"),
        (
            &["--adapter", "llama3", "--n-heads", "5"],
            "does not divide dim 256",
        ),
        (&["--adapter", "mistral"], "invalid value 'mistral'"),
    ];
    for (i, (flags, want)) in cases.iter().enumerate() {
        let out = tmp.path().join(format!("out{i}"));
        let o = ckpt()
            .arg("convert")
            .arg(fixtures().join("dcp1"))
            .arg(&out)
            .args(["--to", "hf"])
            .args(*flags)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {}", output_text(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(want),
            "{flags:?}: {}",
            output_text(&o)
        );
        assert!(!out.join("model.safetensors").exists(), "{flags:?}");
    }
}
