//! FP8 block-quantized checkpoints: the DeepSeek-V3/R1, Kimi-K2 and Qwen3 `-FP8` releases.
//!
//! Such a checkpoint stores each quantized weight `W` as float8 (e4m3fn) next to a tensor
//! `W_scale_inv` holding one fp32 multiplier per block of `quantization_config.weight_block_size`
//! elements (`[128, 128]` in every release; edge blocks are cut to the weight's shape). The real
//! weight is `fp8.float() * scale_inv` with each scale spread over its block.
//!
//! [`attach`] pairs every float8 weight with its scales when a checkpoint is opened, so that the
//! scales leave the tensor list (an adapter never sees them) and ride on the weight's
//! [`TensorPlan`] instead; the copy engine then dequantizes such a weight window by window
//! ([`Dequantizer`]) into fp32 before casting it to the output dtype, as torch computes it: the
//! float8 -> fp32 decode is exact ([`e4m3fn_to_f32`]), the product is one fp32 multiply, and the
//! cast rounds to nearest even. [`check_shape`] and [`read_scales`] are what `verify` and the
//! copy engine check: the scales' shape against the weight and block size, and every scale
//! finite and non-zero.

use serde_json::Value;

use crate::assemble::TensorReader;
use crate::cast;
pub use crate::cast::{decode, e4m3fn_to_f32, e5m2_to_f32};
use crate::error::{Error, Result};
pub use crate::plan::{BlockScales, DEQUANT_DTYPE};
use crate::plan::{CheckpointPlan, TensorPlan};
use titan_dcp::Dtype;

/// The suffix of a weight's block scales (`q_proj.weight` -> `q_proj.weight_scale_inv`).
pub const SCALE_SUFFIX: &str = "_scale_inv";

/// The block of every released FP8 checkpoint, used when no `config.json` says otherwise.
pub const DEFAULT_BLOCK: [u64; 2] = [128, 128];

/// `config.json` files larger than this are refused.
const MAX_CONFIG_BYTES: u64 = 10 << 20;

/// A weight's scales are read whole (as f32): more than this is refused (a 128x128 block gives
/// 7168 x 18432 weights 32 KiB of scales; a block size of 1 would give 4x the weight's bytes).
const MAX_SCALE_BYTES: u64 = 256 << 20;

/// The block size from `config.json` beside the checkpoint (`quantization_config.
/// weight_block_size`), else [`DEFAULT_BLOCK`]; the second value says which.
fn block_size(plan: &CheckpointPlan) -> Result<([u64; 2], &'static str)> {
    let listed = plan
        .root
        .list()
        .map(|l| l.iter().any(|(f, _)| f == "config.json"))
        .unwrap_or(false);
    if !listed {
        return Ok((DEFAULT_BLOCK, "the releases' default (no config.json)"));
    }
    let name = plan.root.display_file("config.json");
    let bytes = plan.root.read_small("config.json", MAX_CONFIG_BYTES)?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::invalid(&name, format!("malformed JSON: {e}")))?;
    let Some(q) = v.get("quantization_config") else {
        return Ok((
            DEFAULT_BLOCK,
            "the releases' default (config.json has no quantization_config)",
        ));
    };
    if let Some(m) = q.get("quant_method").and_then(Value::as_str)
        && m != "fp8"
    {
        return Err(Error::invalid(
            &name,
            format!(
                "quantization_config.quant_method is `{m}`: titan-ckpt dequantizes block-wise \
                 `fp8` checkpoints (weights with `{SCALE_SUFFIX}` scales) only"
            ),
        ));
    }
    let Some(b) = q.get("weight_block_size") else {
        return Ok((
            DEFAULT_BLOCK,
            "the releases' default (no quantization_config.weight_block_size)",
        ));
    };
    match b
        .as_array()
        .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
    {
        Some(v) if v.len() == 2 && v.iter().all(|x| x.is_some_and(|x| x > 0)) => Ok((
            [v[0].unwrap_or(1), v[1].unwrap_or(1)],
            "config.json's quantization_config.weight_block_size",
        )),
        _ => Err(Error::invalid(
            &name,
            format!(
                "quantization_config.weight_block_size is {b}: expected two positive integers \
                 [rows, columns]"
            ),
        )),
    }
}

/// Moves every `W_scale_inv` tensor of `plan` whose `W` is a float8 tensor onto `W`'s plan
/// ([`TensorPlan::scales`]); returns how many weights are block-quantized. Shapes are not
/// checked here (`inspect` shows a bad pairing, `verify` and `convert` refuse it).
pub fn attach(plan: &mut CheckpointPlan) -> Result<usize> {
    let pairs: Vec<(String, String)> = plan
        .tensors
        .keys()
        .filter_map(|name| {
            let weight = name.strip_suffix(SCALE_SUFFIX)?;
            let w = plan.tensors.get(weight)?;
            matches!(w.dtype, Dtype::F8E4M3 | Dtype::F8E5M2)
                .then(|| (weight.to_string(), name.clone()))
        })
        .collect();
    if pairs.is_empty() {
        return Ok(0);
    }
    let (block, block_from) = block_size(plan)?;
    for (weight, scale) in &pairs {
        let tensor = plan.tensors.remove(scale).expect("listed above");
        let w = plan.tensors.get_mut(weight).expect("listed above");
        w.scales = Some(Box::new(BlockScales {
            name: scale.clone(),
            tensor,
            block,
            block_from,
        }));
    }
    Ok(pairs.len())
}

/// Blocks needed to cover `n` elements.
fn blocks(n: u64, b: u64) -> u64 {
    n.div_ceil(b)
}

/// Checks that `s` fits the float8 weight `weight` of shape `w`: both 2-D, the scales fp32 (or
/// bf16/f16) with one per block, edge blocks included.
pub fn check_shape(
    plan: &CheckpointPlan,
    weight: &str,
    w: &TensorPlan,
    s: &BlockScales,
) -> Result<()> {
    let at = plan.root.display();
    let [br, bc] = s.block;
    let [rows, cols] = w.shape[..] else {
        return Err(Error::tensor(
            at,
            weight,
            format!(
                "block-quantized weight has shape {:?}; block scales `{}` need a 2-D weight",
                w.shape, s.name
            ),
        ));
    };
    if !matches!(s.tensor.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
        return Err(Error::tensor(
            at,
            &s.name,
            format!("block scales are {}; expected float32", s.tensor.dtype),
        ));
    }
    let want = [blocks(rows, br), blocks(cols, bc)];
    if want[0].saturating_mul(want[1]).saturating_mul(4) > MAX_SCALE_BYTES {
        return Err(Error::tensor(
            at,
            &s.name,
            format!(
                "{br}x{bc} blocks ({}) give weight `{weight}` {:?} {want:?} scales, over the \
                 {MAX_SCALE_BYTES}-byte limit",
                s.block_from, w.shape
            ),
        ));
    }
    if s.tensor.shape != want {
        return Err(Error::tensor(
            at,
            &s.name,
            format!(
                "block scales have shape {:?} but weight `{weight}` {:?} in {br}x{bc} blocks ({}) \
                 needs {want:?}",
                s.tensor.shape, w.shape, s.block_from
            ),
        ));
    }
    Ok(())
}

/// Reads `s` (already [`check_shape`]d) as f32, refusing a NaN, infinite or zero scale (a zero
/// would silently zero a block of the weight), named with its block.
pub fn read_scales(
    plan: &CheckpointPlan,
    reader: &mut TensorReader,
    s: &BlockScales,
) -> Result<Vec<f32>> {
    let t = &s.tensor;
    let n = t.numel();
    let mut raw = vec![0u8; (n * t.dtype.size() as u64) as usize];
    reader.read_any(t, 0..n, &mut raw)?;
    let mut wide = Vec::new();
    cast::convert(t.dtype, Dtype::F32, &raw, &mut wide);
    let values: Vec<f32> = wide
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let cols = t.shape.get(1).copied().unwrap_or(1).max(1);
    if let Some((i, v)) = values
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite() || **v == 0.0)
    {
        let (r, c) = (i as u64 / cols, i as u64 % cols);
        return Err(Error::tensor(
            plan.root.display(),
            &s.name,
            format!(
                "block scale [{r}, {c}] is {v}: a scale must be finite and non-zero (weight rows \
                 {}.., columns {}..)",
                r * s.block[0],
                c * s.block[1]
            ),
        ));
    }
    Ok(values)
}

/// Checks the block scales of every block-quantized weight of `plan` (shape and values); returns
/// how many there are.
pub fn verify(plan: &CheckpointPlan) -> Result<usize> {
    let files = plan.open_files()?;
    let mut reader = TensorReader::new(plan, &files);
    let mut n = 0;
    for (name, w) in &plan.tensors {
        if let Some(s) = &w.scales {
            check_shape(plan, name, w, s)?;
            read_scales(plan, &mut reader, s)?;
            n += 1;
        }
    }
    Ok(n)
}

/// Dequantizes windows of one block-quantized weight: its scales read and checked once.
#[derive(Debug)]
pub struct Dequantizer {
    /// The weight this is for.
    pub weight: String,
    dtype: Dtype,
    cols: u64,
    block: [u64; 2],
    scale_cols: u64,
    scales: Vec<f32>,
}

impl Dequantizer {
    /// The dequantizer of `weight` (whose plan has [`TensorPlan::scales`]).
    pub fn new(
        plan: &CheckpointPlan,
        reader: &mut TensorReader,
        weight: &str,
        w: &TensorPlan,
    ) -> Result<Dequantizer> {
        let s = w.scales.as_deref().ok_or_else(|| {
            Error::tensor(plan.root.display(), weight, "internal: no block scales")
        })?;
        check_shape(plan, weight, w, s)?;
        let scales = read_scales(plan, reader, s)?;
        Ok(Dequantizer {
            weight: weight.to_string(),
            dtype: w.dtype,
            cols: w.shape[1],
            block: s.block,
            scale_cols: s.tensor.shape[1],
            scales,
        })
    }

    /// Writes the fp32 values (little endian) of the weight's elements `first..first +
    /// fp8.len()` (C order), whose float8 bytes are `fp8`, into `out`.
    pub fn dequantize(&self, first: u64, fp8: &[u8], out: &mut Vec<u8>) {
        out.resize(fp8.len() * 4, 0);
        let cols = self.cols;
        let [br, bc] = self.block;
        let mut i = 0usize;
        while i < fp8.len() {
            let e = first + i as u64;
            let (r, c) = (e / cols, e % cols);
            // A run of one row inside one column block shares its scale.
            let run_end = ((c / bc + 1) * bc).min(cols);
            let len = ((run_end - c) as usize).min(fp8.len() - i);
            let s = self.scales[((r / br) * self.scale_cols + c / bc) as usize];
            let dst = &mut out[i * 4..(i + len) * 4];
            for (b, o) in fp8[i..i + len].iter().zip(dst.chunks_exact_mut(4)) {
                let v = decode(self.dtype, *b) * s;
                o.copy_from_slice(&v.to_le_bytes());
            }
            i += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_decodes_exactly() {
        assert_eq!(e4m3fn_to_f32(0x38), 1.0);
        assert_eq!(e4m3fn_to_f32(0x7E), 448.0);
        assert_eq!(e4m3fn_to_f32(0xFE), -448.0);
        assert_eq!(e4m3fn_to_f32(0x08), 2f32.powi(-6));
        // Subnormals: man * 2^-9.
        for m in 1..8u8 {
            assert_eq!(e4m3fn_to_f32(m), m as f32 * 2f32.powi(-9), "{m}");
            assert_eq!(e4m3fn_to_f32(0x80 | m), -(m as f32) * 2f32.powi(-9));
        }
        assert_eq!(e4m3fn_to_f32(0x80).to_bits(), 0x8000_0000);
        assert_eq!(e4m3fn_to_f32(0x7F).to_bits(), 0x7FF0_0000);
        assert_eq!(e4m3fn_to_f32(0xFF).to_bits(), 0xFFF0_0000);
        // Every normal value against the textbook formula, in f64.
        for b in 0..=255u8 {
            let (exp, man) = ((b >> 3) & 0xF, b & 7);
            if exp == 0 || (exp == 0xF && man == 7) {
                continue;
            }
            let v = (1.0 + man as f64 / 8.0) * 2f64.powi(exp as i32 - 7);
            let v = if b & 0x80 != 0 { -v } else { v };
            assert_eq!(e4m3fn_to_f32(b) as f64, v, "{b:#x}");
        }
    }

    #[test]
    fn e5m2_is_the_upper_half_of_f16() {
        assert_eq!(e5m2_to_f32(0x3C), 1.0);
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert!(e5m2_to_f32(0x7C).is_infinite());
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
    }

    fn tensor(dtype: Dtype, shape: &[u64]) -> TensorPlan {
        TensorPlan {
            dtype,
            shape: shape.to_vec(),
            chunks: Vec::new(),
            scales: None,
        }
    }

    #[test]
    fn scale_shapes_are_checked_against_weight_and_block() {
        let plan = CheckpointPlan {
            format: crate::plan::Format::Hf,
            root: crate::storage::Root::local("/nonexistent"),
            files: Vec::new(),
            tensors: Default::default(),
            bytes_items: Default::default(),
            dcp: None,
        };
        let w = tensor(Dtype::F8E4M3, &[300, 129]);
        let scales = |shape: &[u64], block: [u64; 2]| BlockScales {
            name: "w_scale_inv".into(),
            tensor: tensor(Dtype::F32, shape),
            block,
            block_from: "test",
        };
        // Ragged edges: 300 rows in 128 -> 3 blocks, 129 columns -> 2.
        check_shape(&plan, "w", &w, &scales(&[3, 2], [128, 128])).unwrap();
        let e = check_shape(&plan, "w", &w, &scales(&[2, 2], [128, 128]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`w_scale_inv`") && e.contains("needs [3, 2]"),
            "{e}"
        );
        // A block of one element would make the scales 4x the weight: refused past the limit.
        let big = tensor(Dtype::F8E4M3, &[1 << 14, 1 << 14]);
        let e = check_shape(&plan, "w", &big, &scales(&[1 << 14, 1 << 14], [1, 1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("over the"), "{e}");
        let e = check_shape(
            &plan,
            "w",
            &tensor(Dtype::F8E4M3, &[4]),
            &scales(&[1], [128, 128]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("need a 2-D weight"), "{e}");
    }

    #[test]
    fn dequantize_spreads_each_scale_over_its_ragged_block() {
        // A 3x5 weight in 2x2 blocks: scales [2, 3], the last row and column blocks cut short.
        let d = Dequantizer {
            weight: "w".into(),
            dtype: Dtype::F8E4M3,
            cols: 5,
            block: [2, 2],
            scale_cols: 3,
            scales: vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        };
        let fp8 = vec![0x38u8; 15]; // all 1.0
        let mut out = Vec::new();
        d.dequantize(0, &fp8, &mut out);
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        #[rustfmt::skip]
        let want = [
            1.0, 1.0, 2.0, 2.0, 4.0,
            1.0, 1.0, 2.0, 2.0, 4.0,
            8.0, 8.0, 16.0, 16.0, 32.0,
        ];
        assert_eq!(got, want);
        // A window starting mid-row gives the same values.
        d.dequantize(7, &fp8[7..12], &mut out);
        let part: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(part, want[7..12]);
    }
}
