//! Who made the others wait, on two real titan-train ranks (cpu backend, DDP), both pinned to
//! one core: rank 1 is throttled from outside — frozen (SIGSTOP) 40 ms of every 60 ms, as a
//! CPU quota or a noisy neighbour would; nothing inside titan-train knows — so it computes at
//! a third of rank 0's speed at most, whatever else the machine runs. (On a core each, other
//! tests' processes crowding rank 0's core slowed it as much as the throttle slowed rank 1,
//! and rank 1 was no longer last: sharing one core, both see the same crowd.) Every gradient
//! all_reduce then waits for rank 1: `titan-obs summary` must name rank 1 in `waits` with the
//! wait it caused, and must not call rank 0 a straggler for the time it spent waiting.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use titan_tests::{bin, output_text as text, run_ok};

const STEPS: u64 = 10;

/// `cmd` started through `taskset -c core`, so every thread it ever starts runs on that core.
fn on_core(core: usize, cmd: Command) -> Command {
    let mut c = Command::new("taskset");
    c.args(["-c", &core.to_string()]).arg(cmd.get_program());
    c.args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    if let Some(d) = cmd.get_current_dir() {
        c.current_dir(d);
    }
    c
}

/// Freezes process `pid` 40 ms of every 60 ms until dropped (then lets it run).
struct Throttle {
    pid: u32,
    shell: Child,
}

impl Throttle {
    fn start(pid: u32) -> Throttle {
        let script = format!(
            "while kill -STOP {pid} 2>/dev/null; do sleep 0.04; kill -CONT {pid}; sleep 0.02; done"
        );
        let shell = Command::new("sh")
            .args(["-c", &script])
            .spawn()
            .expect("starting the throttle");
        Throttle { pid, shell }
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        let _ = self.shell.kill();
        let _ = self.shell.wait();
        let _ = Command::new("kill")
            .args(["-CONT", &self.pid.to_string()])
            .status();
    }
}

fn train_two_ranks(run: &Path) {
    let port = titan_tests::free_port().to_string();
    let args: Vec<String> = [
        "--job.dump_folder",
        run.to_str().unwrap(),
        "--training.steps",
        &STEPS.to_string(),
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "64",
        "--validation.enable=false",
        "--metrics.log_freq",
        "5",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--comm.train_timeout_seconds",
        "120",
    ]
    .map(String::from)
    .to_vec();
    let ranks: Vec<Child> = (0..2)
        .map(|r| {
            let mut c = titan_tests::titan_train();
            c.args(&args)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port);
            on_core(0, c)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let throttle = Throttle::start(ranks[1].id());
    let outputs: Vec<_> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    drop(throttle);
    for (r, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed:\n{}", text(o));
    }
}

#[test]
fn summary_names_the_slowed_rank_in_waits_and_not_the_waiting_one() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("ddp2");
    train_two_ranks(&run);

    let out = run_ok(Command::new(bin("titan-obs")).args(["summary", run.to_str().unwrap()]));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let out =
        run_ok(Command::new(bin("titan-obs")).args(["summary", run.to_str().unwrap(), "--json"]));
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    // Both ranks recorded every gradient all_reduce, with its bytes.
    let phases = s["phases"].as_array().unwrap();
    let all_reduce = phases
        .iter()
        .find(|p| p["name"] == "all_reduce")
        .unwrap_or_else(|| panic!("no all_reduce spans:\n{table}"));
    assert!(
        all_reduce["count"].as_u64().unwrap() >= 2 * STEPS,
        "{table}"
    );

    let waits = s["waits"].as_array().unwrap();
    let caused = |rank: u64| -> i64 {
        waits
            .iter()
            .filter(|w| w["rank"] == rank)
            .map(|w| w["wait_caused_ns"].as_i64().unwrap())
            .sum()
    };
    let top = &waits[0];
    assert_eq!(top["rank"], 1, "rank 1 should head the waits:\n{table}");
    // Rank 1's lateness is split over the phases it came from (data_loading before the token
    // count's all_reduce, forward/backward before the gradients'), in proportions that follow
    // where the throttle froze it: count its steps over all its rows.
    let steps_last = |rank: u64| -> u64 {
        waits
            .iter()
            .filter(|w| w["rank"] == rank)
            .map(|w| w["steps_last"].as_u64().unwrap())
            .sum()
    };
    assert!(
        steps_last(1) >= STEPS / 2 && steps_last(1) > steps_last(0),
        "rank 1 last in too few steps:\n{table}"
    );
    // Rank 1 made rank 0 wait, for several times longer than the other way round.
    assert!(caused(1) > 0 && caused(1) > 5 * caused(0), "{table}");
    // The per-row phase is one rank 1 really ran before a collective.
    let late_from = top["phase"].as_str().unwrap();
    assert!(
        phases.iter().any(|p| p["name"] == late_from),
        "{late_from} is not a phase:\n{table}"
    );
    assert!(table.contains("waiting on"), "{table}");

    // Rank 0 spent its extra time waiting in collectives: not a straggler anywhere.
    let stragglers = s["stragglers"].as_array().unwrap();
    assert!(
        stragglers.iter().all(|x| x["rank"] != 0),
        "rank 0 blamed for waiting:\n{table}"
    );
    assert!(
        stragglers
            .iter()
            .any(|x| x["rank"] == 1 && x["phase"] == "forward_backward"),
        "rank 1 is slow in forward_backward:\n{table}"
    );
}
