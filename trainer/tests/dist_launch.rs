//! titan's launcher supervising ranks: a rank that dies takes the job down quickly, non-zero,
//! with the dead rank named; a clean run exits 0 with torchrun's variables set for every rank.

mod dist_common;

use std::time::{Duration, Instant};

use dist_common::*;

fn env_worker() {
    // The launcher sets torchrun's variables and hosts the store (agent store).
    let get = |k: &str| std::env::var(k).unwrap();
    assert_eq!(get("WORLD_SIZE"), "3");
    assert_eq!(get("LOCAL_WORLD_SIZE"), "3");
    assert_eq!(get("RANK"), get("LOCAL_RANK"));
    assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), "True");
    let dist = join(Duration::from_secs(30), 1 << 20);
    assert!(dist.env.use_agent_store);
    // Rank 0's clock is the reference; on one machine the offset is tiny.
    assert!(
        dist.clock_offset_ns.abs() < 50_000_000,
        "{}",
        dist.clock_offset_ns
    );
    let mut g = dist.world_group().unwrap();
    g.barrier().unwrap();
    std::fs::write(my_result_dir().join(format!("rank{}.ok", dist.rank())), "").unwrap();
}

#[test]
fn launcher_runs_every_rank_with_torchrun_variables() {
    if is_worker() {
        return env_worker();
    }
    let (outcome, dir) = launch("launcher_runs_every_rank_with_torchrun_variables", 3);
    assert_eq!(outcome.exit_code, 0, "{:?}", outcome.failure);
    assert!(outcome.failure.is_none());
    for r in 0..3 {
        assert!(dir.join(format!("rank{r}.ok")).exists());
    }
}

fn dying_worker() {
    let dist = join(Duration::from_secs(60), 1 << 20);
    let mut g = dist.world_group().unwrap();
    let t = tch::Tensor::ones([1000], (tch::Kind::Float, tch::Device::Cpu));
    for i in 0..1_000_000 {
        if i == 20 && dist.rank() == 2 {
            // SAFETY: signalling ourselves.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        if g.all_reduce(&t, titan_train::distributed::ReduceOp::Sum)
            .is_err()
        {
            // Keep running as a stubborn rank would: the launcher must stop us.
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

#[test]
fn a_dead_rank_stops_the_job_and_is_named() {
    if is_worker() {
        return dying_worker();
    }
    let t0 = Instant::now();
    let (outcome, _dir) = launch("a_dead_rank_stops_the_job_and_is_named", 3);
    let elapsed = t0.elapsed();
    assert_ne!(outcome.exit_code, 0);
    let failure = outcome.failure.unwrap();
    assert!(
        failure.starts_with("rank 2 ") && failure.contains("killed by signal 9"),
        "{failure}"
    );
    // The survivors sleep after their error; SIGTERM ends them long before their 60 s timeout.
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
}
