//! Multi-process test harness: a test re-runs its own test binary as the ranks (`--exact
//! <test>`), either through titan's launcher or with torchrun's variables set by hand. A process
//! started that way sees `RANK` in its environment and runs the worker side of the test.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub use titan_tests::free_port;
use titan_train::dist::launch::{LaunchArgs, LaunchOutcome, LogRanks, run};
use titan_train::dist::{CommOptions, Dist, LaunchEnv};

/// Whether this process is a rank started by a test (not the test runner itself).
pub fn is_worker() -> bool {
    std::env::var_os("RANK").is_some()
}

/// Where the ranks of the job using `port` write their results.
pub fn result_dir(port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("titan-dist-test-{port}"))
}

/// This rank's result directory (from MASTER_PORT).
pub fn my_result_dir() -> PathBuf {
    let port: u16 = std::env::var("MASTER_PORT").unwrap().parse().unwrap();
    result_dir(port)
}

fn self_args(test: &str) -> Vec<std::ffi::OsString> {
    ["--exact", test, "--nocapture", "--test-threads=1"]
        .iter()
        .map(Into::into)
        .collect()
}

/// Runs `test`'s worker side on `n` ranks through titan's launcher; returns the outcome and the
/// result directory.
pub fn launch(test: &str, n: usize) -> (LaunchOutcome, PathBuf) {
    let port = free_port();
    let dir = result_dir(port);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let args = LaunchArgs {
        nproc_per_node: n,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: Some(port),
        log_ranks: LogRanks::All,
        grace: Duration::from_secs(3),
    };
    let exe = std::env::current_exe().unwrap();
    let outcome = run(&args, &exe, &self_args(test)).unwrap();
    (outcome, dir)
}

/// Starts `n` ranks of `test` with torchrun's variables set by hand (rank 0 hosts the store).
pub fn spawn_by_hand(test: &str, n: usize, extra: &[(&str, &str)]) -> (Vec<Child>, PathBuf) {
    let port = free_port();
    let dir = result_dir(port);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let children = (0..n)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(self_args(test))
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    (children, dir)
}

/// Joins the job from the environment with the cpu backend.
pub fn join(timeout: Duration, segment_bytes: usize) -> Dist {
    let env = LaunchEnv::from_process_env().unwrap();
    let mut opts = CommOptions {
        timeout,
        init_timeout: Duration::from_secs(60),
        ..CommOptions::default()
    };
    opts.socket.segment_bytes = segment_bytes;
    Dist::init(env, opts).unwrap()
}
