//! Mixture-of-experts load in titan-obs, on real titan-train runs of DeepSeek-V3's debug model (5
//! MoE layers of 8 experts, top 3): the per-(layer, expert) token counts each rank records on the
//! steps it logs become `titan-obs summary`'s experts section and `titan-obs metrics`'
//! `moe/max_over_mean`.
//! - With `--debug.moe_force_load_balance` (torchtitan's round-robin routing) every expert of
//!   every layer gets the same tokens: max/mean 1, cv 0, the counts adding up to the tokens x
//!   top 3 of every step and rank.
//! - With one expert's routing bias (`expert_bias_E`, which the router adds to the scores it
//!   picks its top 3 by) raised in a checkpoint (torch's DCP, edited by
//!   `tests/python/bias_expert.py`), that expert is the hottest of its layer, in every token's
//!   three, and the other layers are not as uneven. That run is under expert parallelism (EP 2
//!   on 2 ranks): the summary names the rank hosting the hot expert, and the wait the layers'
//!   experts caused at the all-to-all after them; the TUI's load colouring (`e`) finds rank 1's
//!   experts of that layer hot and rank 0's idle. Under PP 2 x EP 2 on 4 ranks the hot expert
//!   is hosted by its stage's rank only.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use titan_obs::app::source::RunSource;
use titan_obs::app::terminal::TimelineSource;
use titan_obs_core::vocab::moe;
use titan_tests::{bin, python_script, run_ok, titan_train};

const STEPS: u64 = 3;
/// Tokens a rank routes per step: local batch 2 x seq 128, each to 3 experts.
const ROUTED_PER_STEP: f64 = 2.0 * 128.0 * 3.0;

fn args(dump: &Path) -> Vec<String> {
    [
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        &STEPS.to_string(),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--validation.enable=false",
        "--job.dump_folder",
        dump.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

fn summary(dump: &Path) -> Value {
    let o = run_ok(
        Command::new(bin("titan-obs"))
            .args(["summary", "--json"])
            .arg(dump),
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn forced_balance_reports_every_expert_even() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("balanced");
    run_ok(titan_train().args(args(&dump)).args([
        "--nproc-per-node",
        "2",
        "--debug.moe_force_load_balance",
    ]));
    let s = summary(&dump);
    let layers = s["experts"].as_array().expect("an experts section");
    assert_eq!(
        layers
            .iter()
            .map(|l| l["layer"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5],
        "the MoE layers: {s}"
    );
    for l in layers {
        assert_eq!(l["experts"], 8, "{l}");
        assert_eq!(l["steps"], STEPS, "{l}");
        // Every step's and both ranks' routed tokens.
        assert_eq!(
            l["tokens"].as_f64().unwrap(),
            ROUTED_PER_STEP * 2.0 * STEPS as f64
        );
        assert_eq!(l["max_over_mean"].as_f64().unwrap(), 1.0, "{l}");
        assert_eq!(l["cv"].as_f64().unwrap(), 0.0, "{l}");
    }
    // The per-step figure in `metrics`, and none of the per-expert columns.
    let o = run_ok(
        Command::new(bin("titan-obs"))
            .args(["metrics", "--json"])
            .arg(&dump),
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!text.contains("moe/layer/"), "{text}");
    let lines: Vec<Value> = serde_json::from_str(&text).unwrap();
    let imbalance: Vec<f64> = lines
        .iter()
        .filter_map(|l| l["values"]["moe/max_over_mean"].as_f64())
        .collect();
    assert_eq!(imbalance, vec![1.0; STEPS as usize], "{text}");
}

/// A run into `dump` under EP 2 (and `layout`) from the model as initialised, saved under
/// `dir`, then edited so that layer 2's router always picks expert 5.
fn run_favouring_expert_5_of_layer_2(dir: &Path, dump: &Path, layout: &[&str]) {
    let seed = dir.join("seed");
    run_ok(
        titan_train()
            .args(args(&seed))
            .args(["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]),
    );
    let biased = dir.join("biased");
    run_ok(
        python_script("tests/python/bias_expert.py")
            .arg(seed.join("checkpoint/step-0"))
            .arg(&biased)
            .args(["2", "5", "10"]),
    );
    run_ok(
        titan_train()
            .args(args(dump))
            .args(layout)
            .args([
                "--parallelism.expert_parallel_degree",
                "2",
                "--checkpoint.enable",
            ])
            .arg("--checkpoint.initial_load_path")
            .arg(&biased)
            .arg("--checkpoint.initial_load_model_only"),
    );
}

#[test]
fn a_favoured_expert_is_the_hottest_of_its_layer() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("run");
    run_favouring_expert_5_of_layer_2(dir.path(), &dump, &["--nproc-per-node", "2"]);
    let s = summary(&dump);
    let layers = s["experts"].as_array().expect("an experts section");
    let layer = |i: u64| layers.iter().find(|l| l["layer"] == i).unwrap();
    let hot = layer(2);
    assert_eq!(hot["hottest_expert"], 5, "{hot}");
    // Top 3 of 8: expert 5 in every token's three, a third of the layer's routed tokens.
    assert!(
        (hot["hottest_share"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-9,
        "{hot}"
    );
    assert!(
        (hot["max_over_mean"].as_f64().unwrap() - 8.0 / 3.0).abs() < 1e-9,
        "{hot}"
    );
    // EP 2 over 8 experts: rank 0 hosts 0..4, rank 1 hosts 4..8.
    assert_eq!(hot["hottest_hosts"], serde_json::json!([1]), "{hot}");
    for i in [1, 3, 4, 5] {
        let l = layer(i);
        assert!(
            l["max_over_mean"].as_f64().unwrap() < hot["max_over_mean"].as_f64().unwrap(),
            "layer {i} {l} vs layer 2 {hot}"
        );
    }
    // Every layer's combine waits for the rank whose experts finished last: some rank came
    // late from each layer's experts, and the others waited for it. The figures are the
    // "waiting on" table's rows late from that layer's experts span: their sum, and the rank
    // of the largest.
    let waits = s["waits"].as_array().expect("a waits table");
    for l in layers {
        let span = format!("moe/layer/{}/experts", l["layer"]);
        let rows: Vec<&Value> = waits.iter().filter(|w| w["phase"] == span).collect();
        let caused: i64 = rows
            .iter()
            .map(|w| w["wait_caused_ns"].as_i64().unwrap())
            .sum();
        assert!(caused > 0, "{span}: {l}\n{waits:?}");
        assert_eq!(l["experts_wait_caused_ns"].as_i64(), Some(caused), "{l}");
        let largest = rows
            .iter()
            .max_by_key(|w| w["wait_caused_ns"].as_i64().unwrap())
            .unwrap();
        assert_eq!(l["experts_late_rank"], largest["rank"], "{l}\n{rows:?}");
    }
    // The gantt's load colouring: rank 1's experts of layer 2 got the favoured expert's
    // tokens besides their share, rank 0's fewer than theirs, on every step of the run.
    let t = RunSource::new(dump.to_str().unwrap()).load().unwrap();
    let span = t
        .phase_id(moe::experts_span(2))
        .expect("layer 2's experts span");
    for step in 1..=STEPS {
        let hot = t.experts_load_at(1, span, step).expect("rank 1's load");
        let idle = t.experts_load_at(0, span, step).expect("rank 0's load");
        assert_eq!((hot.first, hot.count, idle.first), (4, 4, 0), "{hot:?}");
        assert_eq!(hot.layer_tokens, idle.layer_tokens);
        assert!(
            (hot.hosted_tokens + idle.hosted_tokens - hot.layer_tokens).abs() < 1e-9,
            "{hot:?} {idle:?}"
        );
        // Expert 5 alone gets a third of the layer's tokens (2/3 of rank 1's even half), and
        // its three neighbours about 3/7 of the rest: about 1.24x.
        assert!(hot.factor > 1.1, "step {step}: {hot:?}");
        assert!(
            (hot.factor + idle.factor - 2.0).abs() < 1e-9,
            "{hot:?} {idle:?}"
        );
    }
    // The text names it.
    let o = run_ok(Command::new(bin("titan-obs")).arg("summary").arg(&dump));
    let text = String::from_utf8_lossy(&o.stdout);
    let row = text
        .lines()
        .skip_while(|l| !l.starts_with("experts"))
        .find(|l| l.trim_start().starts_with("2 "))
        .unwrap_or_else(|| panic!("no layer 2 row:\n{text}"));
    assert!(
        row.contains("expert 5") && row.contains("rank 1"),
        "{row}\n{text}"
    );
}

/// Under pipeline parallelism a rank hosts its experts only in its stage's layers: PP 2 x EP 2
/// on 4 ranks, stage 0 (ranks 0 and 1) holding the dense block 0 and MoE blocks 1 and 2, stage 1
/// (ranks 2 and 3) blocks 3 to 5. Expert 5 of layer 2 lives on rank 1 only, not also on rank 3
/// (which hosts experts 4..8 of the other stage's layers), and every layer's hottest expert has
/// one host, in its own stage.
#[test]
fn under_pipeline_parallelism_the_hot_expert_lives_in_its_stage() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("run");
    run_favouring_expert_5_of_layer_2(
        dir.path(),
        &dump,
        &[
            "--nproc-per-node",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
        ],
    );
    let s = summary(&dump);
    let layers = s["experts"].as_array().expect("an experts section");
    assert_eq!(layers.len(), 5, "{layers:?}");
    for l in layers {
        let (layer, hottest) = (l["layer"].as_u64().unwrap(), l["hottest_expert"].as_u64());
        let hosts: Vec<u64> = l["hottest_hosts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_u64().unwrap())
            .collect();
        // Stage 0's ep ranks are 0 and 1, stage 1's 2 and 3; ep rank 1 hosts experts 4..8.
        let stage_ranks = if layer <= 2 { [0, 1] } else { [2, 3] };
        let want = stage_ranks[usize::from(hottest.unwrap() >= 4)];
        assert_eq!(hosts, vec![want], "layer {layer}: {l}");
    }
    let hot = layers.iter().find(|l| l["layer"] == 2).unwrap();
    assert_eq!(
        (&hot["hottest_expert"], &hot["hottest_hosts"]),
        (&serde_json::json!(5), &serde_json::json!([1])),
        "{hot}"
    );
    // The gantt's load colouring finds layer 2's experts on stage 0's ranks only.
    let t = RunSource::new(dump.to_str().unwrap()).load().unwrap();
    let span = t
        .phase_id(moe::experts_span(2))
        .expect("layer 2's experts span");
    let hot = t.experts_load_at(1, span, 1).expect("rank 1's load");
    assert!(hot.factor > 1.1, "{hot:?}");
    assert_eq!(t.experts_load_at(3, span, 1), None);
}
