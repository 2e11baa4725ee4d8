//! torchtitan's learning-rate schedule: linear warmup, a stable phase, then linear/sqrt/cosine decay
//! towards `min_lr_factor`. The factor for 0-indexed step `s` multiplies `optimizer.lr`; training
//! step `k` (1-indexed) uses the factor of `s = k - 1`, as torchtitan's LambdaLR does.

pub use crate::config::DecayType;
use crate::config::LrScheduler as LrSchedulerConfig;

/// The resolved schedule for a run of `total` steps.
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub stable_steps: u64,
    pub decay_steps: u64,
    pub decay_type: DecayType,
    pub min_lr_factor: f64,
}

impl LrSchedule {
    /// Resolves the phases as torchtitan's `build_lr_schedulers` does: over
    /// `lr_scheduler.total_steps` when set, else over `training_steps`.
    pub fn new(cfg: &LrSchedulerConfig, base_lr: f64, training_steps: u64) -> Self {
        let total_steps = cfg.total_steps.unwrap_or(training_steps);
        let warmup = cfg.warmup_steps.min(total_steps);
        let decay = match cfg.decay_ratio {
            Some(ratio) => ((total_steps as f64 * ratio).round() as u64).min(total_steps - warmup),
            None => total_steps - warmup,
        };
        // The `+ 1` keeps the last training step's lr above min when decay ends exactly there.
        let stable = total_steps + 1 - warmup - decay;
        Self {
            base_lr,
            warmup_steps: warmup,
            stable_steps: stable,
            decay_steps: decay,
            decay_type: cfg.decay_type,
            min_lr_factor: cfg.min_lr_factor,
        }
    }

    /// The multiplicative factor for 0-indexed step `s`.
    pub fn factor(&self, s: u64) -> f64 {
        let warmup_stable = self.warmup_steps + self.stable_steps;
        if s < self.warmup_steps {
            return (s + 1) as f64 / self.warmup_steps as f64;
        }
        if s < warmup_stable || self.decay_steps == 0 {
            return 1.0;
        }
        let progress = (((s + 1 - warmup_stable) as f64) / self.decay_steps as f64).min(1.0);
        let adjustment = match self.decay_type {
            DecayType::Linear => 1.0 - progress,
            DecayType::Sqrt => 1.0 - progress.sqrt(),
            DecayType::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        };
        self.min_lr_factor + (1.0 - self.min_lr_factor) * adjustment
    }

    /// The learning rate of training step `step` (1-indexed).
    pub fn lr_for_step(&self, step: u64) -> f64 {
        self.base_lr * self.factor(step.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(warmup: u64, ratio: Option<f64>, decay: &str, min: f64) -> LrSchedulerConfig {
        LrSchedulerConfig {
            total_steps: None,
            warmup_steps: warmup,
            decay_ratio: ratio,
            decay_type: serde_json::from_value(decay.into()).unwrap(),
            min_lr_factor: min,
        }
    }

    #[test]
    fn design_vector_linear() {
        let s = LrSchedule::new(&cfg(2, Some(0.8), "linear", 0.0), 8e-4, 10);
        let got: Vec<f64> = (1..=10).map(|k| s.lr_for_step(k)).collect();
        let want = [4e-4, 8e-4, 8e-4, 7e-4, 6e-4, 5e-4, 4e-4, 3e-4, 2e-4, 1e-4];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "got {got:?}");
        }
    }

    #[test]
    fn no_decay_ratio_decays_after_warmup_and_min_factor_floors() {
        let s = LrSchedule::new(&cfg(2, None, "linear", 0.1), 1.0, 10);
        assert_eq!((s.warmup_steps, s.stable_steps, s.decay_steps), (2, 1, 8));
        // Last step: progress 7/8 -> 0.1 + 0.9 * 0.125.
        assert!((s.lr_for_step(10) - (0.1 + 0.9 * 0.125)).abs() < 1e-12);
        let cos = LrSchedule::new(&cfg(0, Some(1.0), "cosine", 0.0), 1.0, 4);
        // stable = 1: step 1 is flat, then cosine over progress 1/4, 2/4, 3/4.
        assert_eq!(cos.lr_for_step(1), 1.0);
        assert!((cos.lr_for_step(3) - 0.5).abs() < 1e-12);
        let sqrt = LrSchedule::new(&cfg(0, Some(1.0), "sqrt", 0.0), 1.0, 4);
        assert!((sqrt.lr_for_step(2) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn warmup_longer_than_run_is_clipped() {
        let s = LrSchedule::new(&cfg(200, None, "linear", 0.0), 1.0, 10);
        assert_eq!(s.warmup_steps, 10);
        assert!((s.lr_for_step(5) - 0.5).abs() < 1e-12);
    }
}
