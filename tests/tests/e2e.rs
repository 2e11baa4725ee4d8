//! Every end-to-end test of titan's binaries, as modules of one test binary: one link instead
//! of one per file, and libtest runs two tests at a time across all of them (one binary a file
//! ran the files one after another, leaving a core idle while a file's last test ran alone).
//! Run one file's tests with its module as a filter: `cargo test --workspace --test e2e
//! tt_parity::`. Fixtures a file makes once (`titan_tests::fixture_made_once`,
//! `binary_tempdir`) are made once per run of this binary.

mod ckpt_bad_input;
mod ckpt_experts;
mod ckpt_families;
mod ckpt_fp8;
mod ckpt_interop;
mod ckpt_object_store;
mod ckpt_torchtitan;
mod ckpt_trust;
mod cli_conventions;
mod dcp_bad_input;
mod dcp_interop;
mod dist_train;
mod gpu_timing;
mod layering;
mod obs_experts;
mod obs_figures;
mod obs_journal;
mod obs_pipeline;
mod obs_recording;
mod obs_runs;
mod obs_torchtitan;
mod obs_trust;
mod obs_waits;
mod trainckpt_object_store;
mod trainckpt_resume;
mod trainckpt_torchtitan;
mod trainer_ac;
mod trainer_cli;
mod trainer_console;
mod trainer_context_parallel;
mod trainer_expert_parallel;
mod trainer_float8;
mod trainer_host_syncs;
mod trainer_memory_estimate;
mod trainer_memory_measured;
mod trainer_seed_init;
mod trainer_torchtitan_cli;
mod tt_parity;
mod tt_trainer_run;

/// A file of tests/tests/ left out of the list above would never be compiled or run
/// (`autotests = false` in tests/Cargo.toml): every one is a module here.
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let dir = titan_tests::workspace_root().join("tests/tests");
    let declared = std::fs::read_to_string(dir.join("e2e.rs")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if let Some(module) = name.strip_suffix(".rs")
            && module != "e2e"
            && !declared.lines().any(|l| l == format!("mod {module};"))
        {
            missing.push(name);
        }
    }
    assert!(
        missing.is_empty(),
        "add `mod` lines to tests/tests/e2e.rs for {missing:?}"
    );
}
