//! The Llama-3 model's arguments and its parameters as data: every parameter's torchtitan 0.3.0
//! fqn, global shape, initialisation and module, in registration order ([`ModelArgs::parameters`]).
//! No libtorch: the model build draws these, the parallelism plan places them
//! ([`crate::parallelize::plan`]), and the memory estimate counts them, from this one list.

use anyhow::{Result, bail};

/// Llama-3.1's RoPE frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl Default for RopeScaling {
    fn default() -> Self {
        Self {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        }
    }
}

/// Shape and numerics of a Llama-3 model (torchtitan's `TransformerModelArgs`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelArgs {
    pub dim: i64,
    pub n_layers: i64,
    pub n_heads: i64,
    /// `None` means `n_heads` (no grouped-query attention).
    pub n_kv_heads: Option<i64>,
    pub vocab_size: i64,
    pub multiple_of: i64,
    pub ffn_dim_multiplier: Option<f64>,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE tables are built for this many positions (torchtitan sets it to training.seq_len).
    pub max_seq_len: i64,
}

impl ModelArgs {
    /// The flavors torchtitan ships for llama3.
    pub fn flavor(name: &str) -> Result<Self> {
        let base = Self {
            dim: 4096,
            n_layers: 32,
            n_heads: 32,
            n_kv_heads: Some(8),
            vocab_size: 128256,
            multiple_of: 1024,
            ffn_dim_multiplier: Some(1.3),
            norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: Some(RopeScaling::default()),
            max_seq_len: 131072,
        };
        Ok(match name {
            "debugmodel" => Self {
                dim: 256,
                n_layers: 6,
                n_heads: 16,
                n_kv_heads: None,
                vocab_size: 2048,
                multiple_of: 256,
                ffn_dim_multiplier: None,
                ..base
            },
            "8B" => base,
            "70B" => Self {
                dim: 8192,
                n_layers: 80,
                n_heads: 64,
                multiple_of: 4096,
                ..base
            },
            "405B" => Self {
                dim: 16384,
                n_layers: 126,
                n_heads: 128,
                multiple_of: 4096,
                ffn_dim_multiplier: Some(1.2),
                ..base
            },
            other => bail!("unknown llama3 flavor `{other}` (known: debugmodel, 8B, 70B, 405B)"),
        })
    }

    pub fn kv_heads(&self) -> i64 {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    pub fn head_dim(&self) -> i64 {
        self.dim / self.n_heads
    }

    /// torchtitan's SwiGLU hidden size: 2/3 of 4*dim, times the multiplier, rounded up to
    /// `multiple_of`.
    pub fn ffn_hidden_dim(&self) -> i64 {
        let mut hidden = 2 * (4 * self.dim) / 3;
        if let Some(m) = self.ffn_dim_multiplier {
            hidden = (m * hidden as f64) as i64;
        }
        self.multiple_of * ((hidden + self.multiple_of - 1) / self.multiple_of)
    }

    /// Parameter count (total, of which the token embedding), from [`ModelArgs::parameters`]'
    /// shapes (no tensors needed).
    pub fn num_params(&self) -> (i64, i64) {
        let specs = self.parameters();
        let numel = |p: &ParamSpec| p.shape.iter().product::<i64>();
        let embedding = specs
            .iter()
            .filter(|p| p.module == Module::Embeddings)
            .map(numel)
            .sum();
        (specs.iter().map(numel).sum(), embedding)
    }

    /// torchtitan's training FLOPs per token (see DESIGN.md):
    /// 6 * non-embedding params + 6 * layers * heads * head_dim * seq_len.
    pub fn flops_per_token(&self, seq_len: i64) -> f64 {
        let (total, embedding) = self.num_params();
        6.0 * (total - embedding) as f64
            + 6.0 * (self.n_layers * self.n_heads * self.head_dim() * seq_len) as f64
    }

    pub fn validate(&self) -> Result<()> {
        if self.dim % self.n_heads != 0 || self.head_dim() % 2 != 0 {
            bail!(
                "model dim {} must split into {} heads of even size",
                self.dim,
                self.n_heads
            );
        }
        if self.n_heads % self.kv_heads() != 0 {
            bail!(
                "n_heads {} must be a multiple of n_kv_heads {}",
                self.n_heads,
                self.kv_heads()
            );
        }
        Ok(())
    }
}

/// How a parameter is initialised (torchtitan's `init_weights`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// `normal_(0, std)`.
    Normal { std: f64 },
    /// `trunc_normal_(0, std, a, b)`.
    TruncNormal { std: f64, a: f64, b: f64 },
    /// `ones_`.
    Ones,
}

/// Which module a parameter belongs to: what pipeline stages and FSDP units are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Module {
    /// `tok_embeddings`.
    Embeddings,
    /// Transformer block `layers.{i}`.
    Layer(usize),
    /// The final `norm` and `lm_head`.
    Head,
}

/// One parameter: its fqn, global shape, initialisation and module.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub fqn: String,
    pub shape: Vec<i64>,
    pub init: Init,
    pub module: Module,
}

/// Parameters per transformer block ([`ModelArgs::parameters`] lists each block's together).
pub const BLOCK_PARAMS: usize = 9;

impl ModelArgs {
    /// Every parameter in torchtitan's registration order (the order its `init_weights` draws
    /// them from the RNG): `tok_embeddings`, each block's attention q/k/v/o, feed-forward
    /// w1/w2/w3 and two norms, the final `norm`, `lm_head`.
    pub fn parameters(&self) -> Vec<ParamSpec> {
        let (d, hd, kv, v) = (
            self.dim,
            self.ffn_hidden_dim(),
            self.kv_heads() * self.head_dim(),
            self.vocab_size,
        );
        let spec = |fqn: String, shape: &[i64], init: Init, module: Module| ParamSpec {
            fqn,
            shape: shape.to_vec(),
            init,
            module,
        };
        let mut out = vec![spec(
            "tok_embeddings.weight".into(),
            &[v, d],
            Init::Normal { std: 1.0 },
            Module::Embeddings,
        )];
        for i in 0..self.n_layers as usize {
            // Depth-scaled init for the output projections, as torchtitan's depth_init.
            let depth_std = 0.02 / (2.0 * (i + 1) as f64).sqrt();
            let std02 = Init::TruncNormal {
                std: 0.02,
                a: -2.0,
                b: 2.0,
            };
            let depth = Init::TruncNormal {
                std: depth_std,
                a: -2.0,
                b: 2.0,
            };
            let layer = Module::Layer(i);
            let p = |n: &str| format!("layers.{i}.{n}");
            out.extend([
                spec(p("attention.qkv_linear.wq.weight"), &[d, d], std02, layer),
                spec(p("attention.qkv_linear.wk.weight"), &[kv, d], std02, layer),
                spec(p("attention.qkv_linear.wv.weight"), &[kv, d], std02, layer),
                spec(p("attention.wo.weight"), &[d, d], depth, layer),
                spec(p("feed_forward.w1.weight"), &[hd, d], std02, layer),
                spec(p("feed_forward.w2.weight"), &[d, hd], depth, layer),
                spec(p("feed_forward.w3.weight"), &[hd, d], depth, layer),
                spec(p("attention_norm.weight"), &[d], Init::Ones, layer),
                spec(p("ffn_norm.weight"), &[d], Init::Ones, layer),
            ]);
        }
        let final_std = (d as f64).powf(-0.5);
        out.push(spec("norm.weight".into(), &[d], Init::Ones, Module::Head));
        out.push(spec(
            "lm_head.weight".into(),
            &[v, d],
            Init::TruncNormal {
                std: final_std,
                a: -3.0 * final_std,
                b: 3.0 * final_std,
            },
            Module::Head,
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_grouped_by_module_in_registration_order() {
        let args = ModelArgs::flavor("debugmodel").unwrap();
        let specs = args.parameters();
        assert_eq!(specs.len(), 3 + BLOCK_PARAMS * args.n_layers as usize);
        for (k, s) in specs[1..specs.len() - 2].iter().enumerate() {
            assert_eq!(s.module, Module::Layer(k / BLOCK_PARAMS), "{}", s.fqn);
        }
        // The hand count torchtitan logs for the debug model.
        assert_eq!(args.num_params(), (6_163_712, 524_288));
    }
}
