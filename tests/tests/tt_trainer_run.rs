//! titan-ckpt and titan-obs on a run of torchtitan 0.3.0's own Trainer: `torchtitan.train` on
//! 2 gloo ranks with FSDP2, torch 2.15 (tests/python/tt_ckpt_trainer.py says what it changes to run
//! on a CPU-only machine), made once per test binary.
//! - Its checkpoint converts to HF with tensors equal to torchtitan's `Llama3StateDictAdapter.to_hf`
//!   bit for bit and logits equal to torchtitan's model in transformers 5 and 4; the HF output
//!   converts back to a DCP that torch 2.15's `dcp.load` reads into torchtitan's model exactly.
//! - Its structured logs open in `titan-obs summary` with every step of every rank.
//! - titan-train (its checkpoint sharded by FSDP2 x TP2) and the Trainer start from each other's
//!   checkpoints (`initial_load_path`) and,
//!   taking one step at learning rate 0, save exactly the weights they loaded.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use titan_tests::{
    SMALL_DETERMINISTIC_RUN, bin, binary_subdir, python_script, run_ok, tf4_python_script,
    titan_ckpt, titan_train, tt_python_script,
};

/// The Trainer's run folder (`run/`) and the references next to it.
fn trainer_run() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = binary_subdir("trainer");
        run_ok(
            tt_python_script("tests/python/tt_ckpt_trainer.py")
                .arg("make")
                .arg(&d),
        );
        d
    })
}

const CHECKS: &str = "tests/python/tt_ckpt_llama3.py";

fn stdout(c: &mut Command) -> String {
    String::from_utf8_lossy(&run_ok(c).stdout).into_owned()
}

#[test]
fn torchtitan_trainer_checkpoint_converts_to_hf_and_back_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let d = trainer_run();

    // The run folder, as a user would pass it: titan-ckpt picks checkpoint/step-2 and says so.
    let hf = tmp.path().join("hf");
    let o = run_ok(
        titan_ckpt()
            .args(["convert", "--quiet"])
            .arg(d.join("run"))
            .arg(&hf)
            .args(["--to", "hf", "--adapter", "llama3"]),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains(&Path::new("checkpoint").join("step-2").display().to_string()),
        "titan-ckpt should name the checkpoint it used: {stderr}"
    );

    // Bitwise equal to torchtitan's to_hf, logits equal torchtitan's model to 1e-4.
    let v5 = stdout(python_script(CHECKS).arg("check-hf").arg(&hf).arg(d));
    assert!(v5.contains("ok transformers 5."), "{v5}");
    let v4 = stdout(tf4_python_script(CHECKS).arg("check-hf").arg(&hf).arg(d));
    assert!(v4.contains("ok transformers 4.57"), "{v4}");

    // HF -> DCP with 0.3.0's names loads into torchtitan's model state dict bit for bit.
    let back = tmp.path().join("dcp");
    run_ok(
        titan_ckpt()
            .args(["convert", "--quiet"])
            .arg(&hf)
            .arg(&back)
            .args(["--to", "dcp", "--adapter", "llama3"]),
    );
    let loaded = stdout(tt_python_script(CHECKS).arg("check-dcp").arg(&back).arg(d));
    assert!(loaded.contains("ok torch 2.15"), "{loaded}");
}

#[test]
fn titan_obs_summarises_the_trainers_structured_logs() {
    let o = run_ok(
        Command::new(bin("titan-obs"))
            .args(["summary", "--json"])
            .arg(trainer_run().join("run")),
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ranks"], 2, "{v}");
    assert_eq!(v["steps"], 2, "{v}");
    assert_eq!(v["malformed_lines"], 0, "{v}");
    let count = |name: &str| {
        v["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .map(|p| p["count"].as_u64().unwrap())
    };
    // torchtitan's own phase names, once per step per rank.
    for phase in [
        "step",
        "fwd_bwd",
        "optim",
        "fetching_batch",
        "checkpoint_save",
    ] {
        assert_eq!(count(phase), Some(4), "phase {phase}: {v}");
    }
    // The last step saved a checkpoint: torchtitan tags it.
    let tagged = v["tagged_steps"].as_array().unwrap();
    assert!(
        tagged.iter().any(|t| t["step"] == 2
            && t["tags"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x == "checkpoint_save")),
        "{v}"
    );
}

/// `titan-ckpt diff --json A B`: the names of the tensors in both, after checking every one of
/// them is equal (training state only one side has is left out of the comparison).
fn equal_model_tensors(a: &Path, b: &Path) -> Vec<String> {
    let o = titan_ckpt()
        .args(["diff", "--json"])
        .arg(a)
        .arg(b)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "titan-ckpt diff --json: {e}: {}",
            titan_tests::output_text(&o)
        )
    });
    let mut both = Vec::new();
    for t in v["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap().to_string();
        match t["status"].as_str().unwrap() {
            "equal" => both.push(name),
            "only_in_a" | "only_in_b" => assert!(
                [
                    "optimizer.",
                    "lr_scheduler",
                    "dataloader",
                    "train_state",
                    "rng"
                ]
                .iter()
                .any(|p| name.starts_with(p)),
                "model tensor {name} is only on one side: {v}"
            ),
            other => panic!("{name}: {other}: {v}"),
        }
    }
    both
}

/// titan-train's checkpoint is sharded (FSDP2 x TP2 on 4 ranks: 2-D blocks); torchtitan's
/// Trainer on 2 FSDP ranks loads it through DCP's resharding.
#[test]
fn torchtitan_trainer_starts_from_a_titan_train_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let titan = tmp.path().join("titan");
    run_ok(
        titan_train()
            .args(SMALL_DETERMINISTIC_RUN)
            .args([
                "--nproc-per-node",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
            ])
            .args(["--training.steps", "2", "--checkpoint.enable"])
            .args(["--checkpoint.last_save_model_only", "--job.dump_folder"])
            .arg(&titan),
    );
    let step = titan.join("checkpoint/step-2");
    let tt = tmp.path().join("tt");
    let o = run_ok(
        tt_python_script("tests/python/tt_ckpt_trainer.py")
            .arg("load")
            .arg(trainer_run())
            .arg(&step)
            .arg(&tt),
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("ok torchtitan Trainer loaded"));
    let equal = equal_model_tensors(&step, &tt.join("checkpoint/step-1"));
    assert_eq!(
        equal.len(),
        57,
        "every Llama-3 debugmodel weight: {equal:?}"
    );
}

#[test]
fn titan_train_starts_from_the_trainers_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let tt_step = trainer_run().join("run/checkpoint/step-2");
    let titan = tmp.path().join("titan");
    run_ok(
        titan_train()
            .args(SMALL_DETERMINISTIC_RUN)
            .args(["--training.steps", "1", "--optimizer.lr", "0"])
            .args(["--checkpoint.enable", "--checkpoint.last_save_model_only"])
            .args([
                "--checkpoint.initial_load_model_only",
                "--checkpoint.initial_load_path",
            ])
            .arg(&tt_step)
            .arg("--job.dump_folder")
            .arg(&titan),
    );
    let equal = equal_model_tensors(&tt_step, &titan.join("checkpoint/step-1"));
    assert_eq!(
        equal.len(),
        57,
        "every Llama-3 debugmodel weight: {equal:?}"
    );
}
