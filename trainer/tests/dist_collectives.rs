//! The cpu backend's collectives on 2 and 4 processes: sum/max all_reduce, reduce_scatter,
//! all_gather, broadcast, all_to_all_single (uneven splits, empty blocks), batch_isend_irecv
//! (sends and receives between ring neighbours) and barrier on sizes that do not divide evenly into chunks or segments,
//! several dtypes and non-contiguous tensors; and failures: a killed or hung rank makes the
//! others fail within the timeout with an error naming it.

mod dist_common;

use std::time::{Duration, Instant};

use dist_common::*;
use tch::{Kind, Tensor};
use titan_train::distributed::{P2pOp, ReduceOp};

/// A value every rank can recompute: small integers, so float sums are exact.
fn val(rank: usize, i: i64) -> f64 {
    ((rank as i64 * 7919 + i * 31) % 97) as f64 - 40.0
}

fn input(rank: usize, n: i64, kind: Kind) -> Tensor {
    let v: Vec<f64> = (0..n).map(|i| val(rank, i)).collect();
    Tensor::from_slice(&v).to_kind(kind)
}

fn expected(world: usize, n: i64, op: ReduceOp, kind: Kind) -> Tensor {
    let v: Vec<f64> = (0..n)
        .map(|i| {
            let it = (0..world).map(|r| val(r, i));
            match op {
                ReduceOp::Sum => it.sum(),
                ReduceOp::Max => it.fold(f64::MIN, f64::max),
            }
        })
        .collect();
    Tensor::from_slice(&v).to_kind(kind)
}

fn assert_same(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    if got.numel() == 0 {
        return;
    }
    let diff = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[]);
    assert!(diff == 0.0, "{what}: max abs difference {diff}");
}

fn collectives_worker() {
    // 4 KiB segments: even the small cases cross several segments and chunk boundaries.
    let dist = join(Duration::from_secs(30), 4096);
    let mut g = dist.world_group().unwrap();
    let (r, w) = (dist.rank(), dist.world_size());
    assert_eq!((g.rank(), g.size()), (r, w));
    for &n in &[0i64, 1, 3, 1001, 100_003] {
        for (kind, op) in [
            (Kind::Float, ReduceOp::Sum),
            (Kind::Float, ReduceOp::Max),
            (Kind::Double, ReduceOp::Sum),
            (Kind::Int64, ReduceOp::Max),
            (Kind::Int, ReduceOp::Sum),
            (Kind::BFloat16, ReduceOp::Sum),
        ] {
            let t = input(r, n, kind);
            g.all_reduce(&t, op).unwrap();
            assert_same(
                &format!("all_reduce {op:?} {kind:?} n={n}"),
                &t,
                &expected(w, n, op, kind),
            );
        }
    }
    // Non-contiguous: a transposed view is reduced in place through its own strides.
    let base = input(r, 12 * 5, Kind::Float).reshape([12, 5]);
    let view = base.tr();
    g.all_reduce(&view, ReduceOp::Sum).unwrap();
    assert_same(
        "all_reduce of a transposed view",
        &base,
        &expected(w, 60, ReduceOp::Sum, Kind::Float).reshape([12, 5]),
    );

    // reduce_scatter / all_gather: per-rank chunks of uneven (odd) sizes.
    for &k in &[1i64, 7, 33_333] {
        let full = input(r, k * w as i64, Kind::Float);
        let before = full.copy();
        let out = Tensor::zeros([k], (Kind::Float, tch::Device::Cpu));
        g.reduce_scatter(&out, &full, ReduceOp::Sum).unwrap();
        let want = expected(w, k * w as i64, ReduceOp::Sum, Kind::Float).narrow(0, r as i64 * k, k);
        assert_same(&format!("reduce_scatter k={k}"), &out, &want);
        assert_same("reduce_scatter leaves its input alone", &full, &before);

        let mine = Tensor::full([k], r as f64 + 0.5, (Kind::Double, tch::Device::Cpu));
        let gathered = Tensor::zeros([w as i64, k], (Kind::Double, tch::Device::Cpu));
        g.all_gather(&gathered, &mine).unwrap();
        let want = Tensor::arange(w as i64, (Kind::Double, tch::Device::Cpu))
            .unsqueeze(1)
            .expand([w as i64, k], false)
            + 0.5;
        assert_same(&format!("all_gather k={k}"), &gathered, &want);
    }
    // Size contract errors name the sizes instead of corrupting memory.
    let err = g
        .reduce_scatter(
            &Tensor::zeros([3], (Kind::Float, tch::Device::Cpu)),
            &Tensor::zeros([7], (Kind::Float, tch::Device::Cpu)),
            ReduceOp::Sum,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("7 elements"), "{err}");

    // broadcast from every root, uneven sizes, bool and u8 too.
    for root in 0..w {
        for &n in &[1i64, 5000, 77_777] {
            let t = if r == root {
                input(root, n, Kind::Float)
            } else {
                Tensor::zeros([n], (Kind::Float, tch::Device::Cpu))
            };
            g.broadcast(&t, root).unwrap();
            assert_same(
                &format!("broadcast root={root} n={n}"),
                &t,
                &input(root, n, Kind::Float),
            );
        }
        let flags = Tensor::from_slice(&[r == root, true, false]);
        g.broadcast(&flags, root).unwrap();
        assert_eq!(
            Vec::<bool>::try_from(&flags).unwrap(),
            vec![true, true, false]
        );
    }
    // all_to_all_single with uneven splits: rank s sends rank d `rows(s, d)` rows (some none),
    // each row of 3 values naming (s, d, row, column); small, and large enough to cross segments.
    for scale in [1usize, 700] {
        let rows = |s: usize, d: usize| ((s * 3 + d * 5 + 1) % 7) * scale;
        let value =
            |s: usize, d: usize, i: usize, j: usize| ((s * 10 + d) * 100_000 + i * 3 + j) as f64;
        let block = |s: usize, d: usize, kind: Kind| {
            let v: Vec<f64> = (0..rows(s, d))
                .flat_map(|i| (0..3).map(move |j| value(s, d, i, j)))
                .collect();
            Tensor::from_slice(&v).to_kind(kind).view([-1, 3])
        };
        for kind in [Kind::Double, Kind::Int64, Kind::Float] {
            let input = Tensor::cat(&(0..w).map(|d| block(r, d, kind)).collect::<Vec<_>>(), 0);
            let want = Tensor::cat(&(0..w).map(|s| block(s, r, kind)).collect::<Vec<_>>(), 0);
            let output = Tensor::full(want.size(), -1.0, (kind, tch::Device::Cpu));
            let in_splits: Vec<usize> = (0..w).map(|d| rows(r, d)).collect();
            let out_splits: Vec<usize> = (0..w).map(|s| rows(s, r)).collect();
            g.all_to_all(&output, &input, &out_splits, &in_splits)
                .unwrap();
            assert_same(
                &format!("all_to_all_single {kind:?} x{scale} on rank {r}"),
                &output,
                &want,
            );
        }
    }
    // Splits that do not add up to the rows are refused before anything is sent.
    let err = g
        .all_to_all(
            &Tensor::zeros([w as i64, 2], (Kind::Float, tch::Device::Cpu)),
            &Tensor::zeros([w as i64, 2], (Kind::Float, tch::Device::Cpu)),
            &vec![1; w],
            &vec![2; w],
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("input splits") && err.contains("add up to"),
        "{err}"
    );
    // batch_isend_irecv between ring neighbours: a send to and a receive from each in one
    // batch, several dtypes, a receive into a transposed (non-contiguous) view.
    let peers: Vec<usize> = if w == 2 {
        vec![1 - r]
    } else {
        vec![(r + 1) % w, (r + w - 1) % w]
    };
    for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
        let sent: Vec<Tensor> = peers
            .iter()
            .map(|&p| input(r * 10 + p, 41 * 121, kind))
            .collect();
        let bases: Vec<Tensor> = peers
            .iter()
            .map(|_| Tensor::zeros([41, 122], (kind, tch::Device::Cpu)))
            .collect();
        let views: Vec<Tensor> = bases.iter().map(|b| b.narrow(1, 0, 121).tr()).collect();
        let mut batch = Vec::new();
        for ((&peer, s), v) in peers.iter().zip(&sent).zip(&views) {
            batch.push(P2pOp::Send { tensor: s, peer });
            batch.push(P2pOp::Recv { tensor: v, peer });
        }
        g.send_recv(&batch).unwrap();
        for (&peer, v) in peers.iter().zip(&views) {
            assert_same(
                &format!("batch_isend_irecv {kind:?} on rank {r} from {peer}"),
                &v.reshape([-1]),
                &input(peer * 10 + r, 41 * 121, kind),
            );
        }
    }
    g.barrier().unwrap();
    // A sub-group of the even ranks next to the world group.
    if w == 4 {
        let members: Vec<usize> = (0..w).filter(|x| x % 2 == r % 2).collect();
        let mut sub = dist
            .new_group(&format!("parity{}", r % 2), members)
            .unwrap();
        let t = Tensor::from_slice(&[r as f32]);
        sub.all_reduce(&t, ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), if r % 2 == 0 { 2.0 } else { 4.0 });
    }
    std::fs::write(my_result_dir().join(format!("rank{r}.ok")), "ok").unwrap();
}

fn check_all_ok(test: &str, n: usize) {
    let (outcome, dir) = launch(test, n);
    assert_eq!(outcome.exit_code, 0, "{:?}", outcome.failure);
    for r in 0..n {
        assert!(
            dir.join(format!("rank{r}.ok")).exists(),
            "rank {r} did not finish"
        );
    }
}

#[test]
fn collectives_on_2_ranks() {
    if is_worker() {
        return collectives_worker();
    }
    check_all_ok("collectives_on_2_ranks", 2);
}

#[test]
fn collectives_on_4_ranks() {
    if is_worker() {
        return collectives_worker();
    }
    check_all_ok("collectives_on_4_ranks", 4);
}

/// Ranks loop on all_reduce; the victim rank dies (SIGKILL) or hangs (SIGSTOP) after a few.
fn failure_worker() {
    let timeout: u64 = std::env::var("TEST_COMM_TIMEOUT_S")
        .unwrap()
        .parse()
        .unwrap();
    let dist = join(Duration::from_secs(timeout), 64 << 10);
    let mut g = dist.world_group().unwrap();
    let victim: usize = std::env::var("TEST_VICTIM").unwrap().parse().unwrap();
    let how = std::env::var("TEST_HOW").unwrap();
    let t = Tensor::ones([1 << 16], (Kind::Float, tch::Device::Cpu));
    for i in 0.. {
        if i == 5 && dist.rank() == victim {
            let sig = if how == "kill" {
                libc::SIGKILL
            } else {
                libc::SIGSTOP
            };
            // SAFETY: signalling ourselves.
            unsafe { libc::raise(sig) };
        }
        if let Err(e) = g.all_reduce(&t, ReduceOp::Sum) {
            eprintln!("ERROR: {e}");
            std::process::exit(1);
        }
        if i > 100_000 {
            break;
        }
    }
    panic!("the collectives kept working with rank {victim} gone");
}

fn survivors_fail_naming(victim: usize, how: &str, timeout_s: u64, within: Duration) {
    let n = 3;
    let test = if how == "kill" {
        "a_killed_rank_fails_the_others_naming_it"
    } else {
        "a_hung_rank_fails_the_others_within_the_timeout"
    };
    let t0 = Instant::now();
    let (mut children, _dir) = spawn_by_hand(
        test,
        n,
        &[
            ("TEST_VICTIM", &victim.to_string()),
            ("TEST_HOW", how),
            ("TEST_COMM_TIMEOUT_S", &timeout_s.to_string()),
        ],
    );
    let victim_child = children.remove(victim);
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let rank = if i >= victim { i + 1 } else { i };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "rank {rank}: {stderr}");
        // Every survivor names the victim: directly (its ring neighbours) or through the failure
        // notice the first detector posted to the store.
        let named = format!("rank {victim} ");
        assert!(
            stderr.contains("ERROR: ") && stderr.contains(&named),
            "rank {rank}: {stderr}"
        );
    }
    let elapsed = t0.elapsed();
    let mut victim_child = victim_child;
    let _ = victim_child.kill();
    let _ = victim_child.wait();
    assert!(elapsed < within, "took {elapsed:?}");
}

#[test]
fn a_killed_rank_fails_the_others_naming_it() {
    if is_worker() {
        return failure_worker();
    }
    // A dead peer closes its sockets: the others fail at once, long before the 60 s timeout.
    survivors_fail_naming(1, "kill", 60, Duration::from_secs(30));
}

#[test]
fn a_hung_rank_fails_the_others_within_the_timeout() {
    if is_worker() {
        return failure_worker();
    }
    // A stopped peer keeps its sockets open: only the 3 s no-progress timeout can catch it.
    survivors_fail_naming(2, "stop", 3, Duration::from_secs(25));
}
