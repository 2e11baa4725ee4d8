//! Data parallelism end to end on a small model: 1 rank versus 2 and 4 ranks on the same global
//! batch give the same loss curve (1e-5 relative) and final weights for replicate (DDP), shard
//! (ZeRO-2) and both (HSDP). The loss is a token-style sum divided by the global count of valid
//! targets, gradients are sum-reduced and clipped by the global norm, as torchtitan does.

mod dist_common;

use std::path::Path;
use std::time::Duration;

use dist_common::*;
use tch::{Device, Kind, Tensor};
use titan_train::dist::dp::DEFAULT_BUCKET_BYTES;
use titan_train::dist::{AdamWStep, CommOptions, DataParallel, Dist, DpDegrees, LaunchEnv};

const GLOBAL_BATCH: i64 = 8;
const STEPS: usize = 10;

/// Parameters with row counts that split unevenly over 4 shards (10 -> 3,3,3,1; 5 -> 2,2,1,0).
fn init_params() -> Vec<Tensor> {
    tch::manual_seed(1234);
    let o = (Kind::Float, Device::Cpu);
    [
        Tensor::randn([10, 6], o) * 0.5,
        Tensor::randn([5], o) * 0.1,
        Tensor::randn([5, 10], o) * 0.5,
        Tensor::randn([3, 5], o) * 0.5,
        Tensor::zeros([3], o),
    ]
    .into_iter()
    .map(|t| t.set_requires_grad(true))
    .collect()
}

/// The global batch of step `step`: inputs and class targets, some of them ignored (-100).
fn batch(step: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..GLOBAL_BATCH * 6)
        .map(|i| (((i * 37 + step as i64 * 11) % 23) as f32 - 11.0) / 7.0)
        .collect();
    let y: Vec<i64> = (0..GLOBAL_BATCH)
        .map(|i| {
            if (i + step as i64) % 5 == 0 {
                -100
            } else {
                (i * 7 + step as i64) % 3
            }
        })
        .collect();
    (
        Tensor::from_slice(&x).reshape([GLOBAL_BATCH, 6]),
        Tensor::from_slice(&y),
    )
}

fn forward(p: &[Tensor], x: &Tensor) -> Tensor {
    let h = x.matmul(&p[0].tr()).tanh();
    let h = (h.matmul(&p[2].tr()) + &p[1]).relu();
    h.matmul(&p[3].tr()) + &p[4]
}

/// Plain AdamW (torch's formula), used for unsharded runs.
struct RefAdamW {
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: i32,
}

impl RefAdamW {
    fn new(p: &[Tensor]) -> Self {
        RefAdamW {
            m: p.iter().map(|t| t.zeros_like()).collect(),
            v: p.iter().map(|t| t.zeros_like()).collect(),
            t: 0,
        }
    }
    fn step(&mut self, params: &[Tensor], hp: AdamWStep) {
        self.t += 1;
        tch::no_grad(|| {
            for ((p, m), v) in params.iter().zip(&mut self.m).zip(&mut self.v) {
                let g = p.grad();
                let mut p = p.shallow_clone();
                let _ = p.f_mul_scalar_(1.0 - hp.lr * hp.weight_decay);
                let _ = m.f_lerp_(&g, 1.0 - hp.beta1);
                let _ = v.f_mul_scalar_(hp.beta2);
                let _ = v.f_add_(&(&g * &g * (1.0 - hp.beta2)));
                let bc1 = 1.0 - hp.beta1.powi(self.t);
                let bc2 = (1.0 - hp.beta2.powi(self.t)).sqrt();
                let denom = v.sqrt() / bc2 + hp.eps;
                let _ = p.f_sub_(&(&*m / denom * (hp.lr / bc1)));
            }
        });
    }
}

/// Trains STEPS steps with the given degrees; returns the global loss per step and the final
/// parameters flattened.
fn train(dist: &Dist, degrees: DpDegrees) -> (Vec<f64>, Vec<f64>) {
    let params = init_params();
    let mut dp = DataParallel::new(dist, degrees, &params, DEFAULT_BUCKET_BYTES).unwrap();
    let mut opt = RefAdamW::new(&params);
    let hp = AdamWStep {
        lr: 0.05,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let (n, r) = (dp.dp_size() as i64, dp.dp_rank() as i64);
    let per = GLOBAL_BATCH / n;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        for p in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let (x, y) = batch(step);
        let (x, y) = (x.narrow(0, r * per, per), y.narrow(0, r * per, per));
        let local_valid = y.ne(-100).sum(Kind::Int64).int64_value(&[]) as f64;
        let global_valid = dp.global_sum(&[local_valid]).unwrap()[0];
        let logits = forward(&params, &x);
        let loss_sum = logits.log_softmax(-1, Kind::Float).nll_loss_nd::<Tensor>(
            &y,
            None,
            tch::Reduction::Sum,
            -100,
        );
        let loss = &loss_sum / global_valid;
        loss.backward();
        let global_loss = dp.global_sum(&[loss.double_value(&[])]).unwrap()[0];
        losses.push(global_loss);
        dp.reduce_gradients(&params).unwrap();
        // max_norm 0.5: the clip is active in the first steps.
        dp.clip_grad_norm(&params, 0.5).unwrap();
        if dp.is_sharded() {
            dp.sharded_adamw_step(&params, hp).unwrap();
        } else {
            opt.step(&params, hp);
        }
    }
    let flat: Vec<f64> = params
        .iter()
        .flat_map(|p| Vec::<f64>::try_from(p.detach().to_kind(Kind::Double).reshape([-1])).unwrap())
        .collect();
    (losses, flat)
}

fn write_result(dir: &Path, rank: usize, losses: &[f64], params: &[f64]) {
    let text = format!(
        "{}\n{}\n",
        losses
            .iter()
            .map(|l| format!("{l:e}"))
            .collect::<Vec<_>>()
            .join(" "),
        params
            .iter()
            .map(|l| format!("{l:e}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    std::fs::write(dir.join(format!("rank{rank}.txt")), text).unwrap();
}

fn read_result(dir: &Path, rank: usize) -> (Vec<f64>, Vec<f64>) {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.txt"))).unwrap();
    let mut lines = text
        .lines()
        .map(|l| l.split(' ').map(|v| v.parse().unwrap()).collect());
    (lines.next().unwrap(), lines.next().unwrap())
}

fn worker(replicate: usize, shard: usize) {
    let dist = join(Duration::from_secs(30), 256);
    let (losses, params) = train(&dist, DpDegrees { replicate, shard });
    write_result(&my_result_dir(), dist.rank(), &losses, &params);
}

/// Tests in this file run on parallel threads of one process, and the reference run draws from
/// libtorch's process-global RNG: two references at once would interleave their draws.
static REFERENCE_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn single_rank_reference() -> (Vec<f64>, Vec<f64>) {
    let _serial = REFERENCE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dist = Dist::init(LaunchEnv::single(), CommOptions::default()).unwrap();
    train(
        &dist,
        DpDegrees {
            replicate: 1,
            shard: 1,
        },
    )
}

fn compare(test: &str, replicate: usize, shard: usize) {
    let (ref_losses, ref_params) = single_rank_reference();
    // The loss must move for the comparison to mean anything.
    assert!(
        ref_losses[STEPS - 1] < ref_losses[0] * 0.9,
        "{ref_losses:?}"
    );
    let n = replicate * shard;
    let (outcome, dir) = launch(test, n);
    assert_eq!(outcome.exit_code, 0, "{:?}", outcome.failure);
    for r in 0..n {
        let (losses, params) = read_result(&dir, r);
        for (s, (a, b)) in losses.iter().zip(&ref_losses).enumerate() {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "rank {r} step {s}: loss {a} vs 1 rank {b}"
            );
        }
        assert_eq!(params.len(), ref_params.len());
        for (i, (a, b)) in params.iter().zip(&ref_params).enumerate() {
            assert!(
                (a - b).abs() < 1e-5 * (1.0 + b.abs()),
                "rank {r} param elem {i}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn replicate_2_matches_1_rank() {
    if is_worker() {
        return worker(2, 1);
    }
    compare("replicate_2_matches_1_rank", 2, 1);
}

#[test]
fn shard_2_matches_1_rank() {
    if is_worker() {
        return worker(1, 2);
    }
    compare("shard_2_matches_1_rank", 1, 2);
}

#[test]
fn shard_4_matches_1_rank() {
    if is_worker() {
        return worker(1, 4);
    }
    compare("shard_4_matches_1_rank", 1, 4);
}

#[test]
fn replicate_4_matches_1_rank() {
    if is_worker() {
        return worker(4, 1);
    }
    compare("replicate_4_matches_1_rank", 4, 1);
}

#[test]
fn hsdp_2x2_matches_1_rank() {
    if is_worker() {
        return worker(2, 2);
    }
    compare("hsdp_2x2_matches_1_rank", 2, 2);
}

#[test]
fn degrees_resolve_like_torchtitan() {
    assert_eq!(
        DpDegrees::resolve(1, -1, 8).unwrap(),
        DpDegrees {
            replicate: 1,
            shard: 8
        }
    );
    assert_eq!(
        DpDegrees::resolve(2, -1, 8).unwrap(),
        DpDegrees {
            replicate: 2,
            shard: 4
        }
    );
    assert_eq!(
        DpDegrees::resolve(-1, 2, 8).unwrap(),
        DpDegrees {
            replicate: 4,
            shard: 2
        }
    );
    let err = DpDegrees::resolve(3, 2, 8).unwrap_err();
    assert!(err.contains("= 6 but the job has 8 ranks"), "{err}");
    assert!(DpDegrees::resolve(3, -1, 8).is_err());
}
