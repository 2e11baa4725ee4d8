//! Model adapters: torchtitan <-> Hugging Face tensor names per model family, over one
//! streaming engine.
//!
//! A family is data: a [`tables::Table`] of name pairs with a per-tensor [`Transform`] (rename,
//! RoPE row permutation, expert split/stack). [`plan_tensors`] turns a checkpoint plan into the
//! output tensors of the copy engine (`write`): a RoPE permutation is a row map, a split expert
//! is a slice of the stacked tensor's rows, stacked experts are a list of per-expert sources.
//! Nothing is materialised: each output is streamed from its sources window by window.

pub mod args;
pub mod pattern;
pub mod tables;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

pub use args::{Hints, ModelArgs, hf_config};
pub use tables::{Rule, TABLES, Table, Transform};

use crate::assemble::TensorReader;
use crate::error::{Error, Result};
use crate::plan::{CheckpointPlan, TensorPlan};
use crate::write::{ExpertTranspose, OutTensor, RowMap, SourceSlice};
use pattern::{Captures, fill, matches};
use titan_dcp::Dtype;

/// Which naming a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    Torchtitan,
    Hf,
}

/// A model family with a torchtitan 0.3.0 state-dict adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama-3 (torchtitan 0.3.0 or older names): q/k rows permuted between RoPE layouts.
    Llama3,
    /// Qwen3 dense and MoE: q_norm/k_norm, experts split/stacked, tied embeddings.
    Qwen3,
    /// DeepSeek-V3: MLA with or without q-LoRA, routed and shared experts, expert bias, MTP
    /// layers after the main ones.
    DeepseekV3,
    /// gpt-oss: biased attention with sinks, router bias, stacked experts transposed per expert
    /// (unquantized; MXFP4 checkpoints need dequantizing first).
    GptOss,
    /// Kimi K2.5/K2.7 (torchtitan's `kimi_k2_7`): a DeepSeek-V3 text decoder under HF's
    /// `language_model.` and the MoonViT vision encoder (fused qkv split, Conv2d patch embedding
    /// as a Linear) with its projector.
    KimiK27,
    /// Qwen3.5 (torchtitan's `qwen3_5`): full attention and GatedDeltaNet layers (fused q/k/v
    /// split), dense FFN or routed experts (HF's fused, per-expert transposed `gate_up_proj`) with
    /// a gated shared expert, the vision encoder (fused qkv, Conv3d patch embedding) and merger.
    Qwen35,
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Family {
    /// Every family, in `--adapter`'s order.
    pub const ALL: [Family; 6] = [
        Family::Llama3,
        Family::Qwen3,
        Family::DeepseekV3,
        Family::GptOss,
        Family::KimiK27,
        Family::Qwen35,
    ];

    /// The family's name (`--adapter`'s value, torchtitan's model name).
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama3 => "llama3",
            Family::Qwen3 => "qwen3",
            Family::DeepseekV3 => "deepseek_v3",
            Family::GptOss => "gpt_oss",
            Family::KimiK27 => "kimi_k2_7",
            Family::Qwen35 => "qwen3_5",
        }
    }

    pub fn table(self) -> &'static Table {
        TABLES
            .iter()
            .find(|t| t.family == self)
            .expect("every family has a table")
    }
}

/// Which torchtitan name generation to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TtNames {
    /// torchtitan 0.3.0 (`attention.qkv_linear.wq`, `lm_head`).
    #[default]
    Current,
    /// Older torchtitan releases (`attention.wq`, `output`).
    Legacy,
}

impl TtNames {
    pub const ALL: [TtNames; 2] = [TtNames::Current, TtNames::Legacy];

    /// `--tt-names`' value.
    pub fn name(self) -> &'static str {
        match self {
            TtNames::Current => "current",
            TtNames::Legacy => "legacy",
        }
    }
}

/// The HF name of a torchtitan Llama-3 parameter (either name generation).
pub fn to_hf_name(name: &str) -> Option<String> {
    to_hf_rule(name).map(|(hf, _)| hf)
}

/// The HF name of a torchtitan Llama-3 parameter (either name generation) with what its tensor
/// goes through on the way ([`Transform::RopeQ`] / [`Transform::RopeK`] for the RoPE-permuted
/// q and k weights).
pub fn to_hf_rule(name: &str) -> Option<(String, Transform)> {
    let (rule, caps) = find_tt(&tables::LLAMA3, name)?;
    Some((hf_of(&tables::LLAMA3, rule, caps), rule.transform))
}

/// The older torchtitan name (the table's `legacy` rules) of a current torchtitan name of
/// `table`'s family; `None` when both generations agree or the name is not in the table.
pub fn legacy_name(table: &Table, name: &str) -> Option<String> {
    let (rule, caps) = find_tt(table, name)?;
    table
        .legacy
        .iter()
        .find(|r| r.hf == rule.hf && r.tt != rule.tt)
        .map(|r| fill(r.tt, caps))
}

/// The torchtitan 0.3.0 name of an HF Llama parameter.
pub fn from_hf_name(name: &str) -> Option<String> {
    let (rule, caps) = find_hf(&tables::LLAMA3, name, TtNames::Current)?;
    Some(fill(rule.tt, caps))
}

/// Which naming `names` use (by the embedding's name).
pub fn detect_naming<'a>(names: impl IntoIterator<Item = &'a String>) -> Option<Naming> {
    for n in names {
        if n == "tok_embeddings.weight" {
            return Some(Naming::Torchtitan);
        }
        if [
            "model.embed_tokens.weight",
            "language_model.model.embed_tokens.weight",
            "model.language_model.embed_tokens.weight",
        ]
        .contains(&n.as_str())
        {
            return Some(Naming::Hf);
        }
    }
    None
}

/// The family whose signature tensors `plan` holds (torchtitan or HF names); llama3 when the
/// checkpoint has Llama-3 attention and no other family's signature.
pub fn detect_family(plan: &CheckpointPlan) -> Option<Family> {
    for t in TABLES {
        if t.signature.is_empty() {
            continue;
        }
        let hit = t.signature.iter().any(|sig| {
            plan.tensors.contains_key(*sig)
                || find_tt(t, sig)
                    .map(|(r, c)| plan.tensors.contains_key(&hf_of(t, r, c)))
                    .unwrap_or(false)
        });
        if hit {
            return Some(t.family);
        }
    }
    plan.tensors
        .keys()
        .any(|n| {
            find_tt(&tables::LLAMA3, n).is_some()
                || find_hf(&tables::LLAMA3, n, TtNames::Current).is_some()
        })
        .then_some(Family::Llama3)
}

/// The rule of `table` for torchtitan tensor `name` (current names, then the older ones) and
/// what its pattern captured: [`hf_of`] gives the HF name (an [`Transform::Experts`] rule's
/// names take each expert's index in `Captures::expert`).
pub fn find_tt<'t>(table: &'t Table, name: &str) -> Option<(&'t Rule, Captures)> {
    table
        .current()
        .chain(table.legacy)
        .find_map(|r| matches(r.tt, name).map(|c| (r, c)))
}

/// The rule of `table` for HF tensor `name` (the older torchtitan rules first with
/// [`TtNames::Legacy`]) and what its pattern captured: `fill(rule.tt, captures)` is the
/// torchtitan name, `captures.expert` the expert of a [`Transform::Experts`] rule.
pub fn find_hf<'t>(table: &'t Table, name: &str, names: TtNames) -> Option<(&'t Rule, Captures)> {
    let first: &[Rule] = match names {
        TtNames::Legacy => table.legacy,
        TtNames::Current => &[],
    };
    first
        .iter()
        .chain(table.current())
        .find_map(|r| match_hf(table, r, name).map(|c| (r, c)))
}

/// The HF name `rule` gives for `caps`: the table's HF prefix before it unless the rule is one
/// of its unprefixed ones.
pub fn hf_of(table: &Table, rule: &Rule, caps: Captures) -> String {
    match table.is_prefixed(rule) {
        true => format!("{}{}", table.hf_prefix, fill(rule.hf, caps)),
        false => fill(rule.hf, caps),
    }
}

/// `rule`'s HF pattern (with the table's prefix, as [`hf_of`]) matched against `name`.
fn match_hf(table: &Table, rule: &Rule, name: &str) -> Option<Captures> {
    match table.is_prefixed(rule) {
        true => matches(rule.hf, name.strip_prefix(table.hf_prefix)?),
        false => matches(rule.hf, name),
    }
}

/// Layer index of a torchtitan name (`layers.N.` / `mtp_layers.N.`).
fn tt_layer(name: &str, prefix: &str) -> Option<u64> {
    name.strip_prefix(prefix)?.split('.').next()?.parse().ok()
}

/// The number of main (non-MTP) transformer layers, from either naming (`hf_layers`: the
/// family's HF prefix of layer names, [`Table::hf_layers`]).
pub fn main_layers(plan: &CheckpointPlan, naming: Naming, hf_layers: &str) -> u64 {
    let prefix = match naming {
        Naming::Torchtitan => "layers.",
        Naming::Hf => hf_layers,
    };
    let layers: BTreeSet<u64> = plan
        .tensors
        .keys()
        .filter_map(|n| tt_layer(n, prefix))
        .collect();
    if naming == Naming::Hf {
        // DeepSeek-V3 keeps its MTP layers after the main ones; they alone have `enorm`.
        if let Some(first_mtp) = layers.iter().find(|l| {
            plan.tensors
                .contains_key(&format!("{prefix}{l}.enorm.weight"))
        }) {
            return *first_mtp;
        }
    }
    layers.len() as u64
}

/// What [`plan_tensors`] produced.
#[derive(Debug)]
pub struct Planned {
    pub tensors: Vec<OutTensor>,
    /// Input tensors left out, with why (the caller warns).
    pub dropped: Vec<(String, String)>,
}

/// How to map one checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct MapOptions {
    pub to: Naming,
    pub tt_names: TtNames,
    /// Output dtype of floating point tensors.
    pub dtype: Option<Dtype>,
}

/// The output tensors for converting the model tensors of `plan` (named per `from`) to
/// `opts.to`, per `table`. Unknown tensors are an error naming them.
pub fn plan_tensors(
    plan: &CheckpointPlan,
    table: &Table,
    from: Naming,
    args: &ModelArgs,
    opts: MapOptions,
) -> Result<Planned> {
    let mut out = Planned {
        tensors: Vec::new(),
        dropped: Vec::new(),
    };
    if from == opts.to {
        for (name, t) in &plan.tensors {
            out.tensors.push(whole(name.clone(), name, t, opts.dtype)?);
        }
        return Ok(out);
    }
    match from {
        Naming::Torchtitan => to_hf(plan, table, args, opts, &mut out)?,
        Naming::Hf => from_hf(plan, table, args, opts, &mut out)?,
    }
    out.tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn out_dtype(src: Dtype, to: Option<Dtype>) -> Result<Dtype> {
    let d = match to {
        Some(d) if src.is_float() => d,
        _ => src,
    };
    crate::cast::check(src, d)?;
    Ok(d)
}

fn whole(name: String, source: &str, t: &TensorPlan, to: Option<Dtype>) -> Result<OutTensor> {
    Ok(OutTensor::whole(
        name,
        source,
        t,
        out_dtype(t.value_dtype(), to)?,
    ))
}

fn unknown(table: &Table, name: &str, naming: Naming) -> Error {
    let side = match naming {
        Naming::Torchtitan => "torchtitan",
        Naming::Hf => "HF",
    };
    // The released gpt-oss checkpoints store expert weights as MXFP4 blocks and scales.
    let hint = if name.ends_with("_blocks") || name.ends_with("_scales") {
        "; it looks MXFP4-quantized: titan-ckpt converts unquantized weights, so dequantize first \
         (transformers: Mxfp4Config(dequantize=True), then save_pretrained)"
    } else {
        ""
    };
    Error::usage(format!(
        "--adapter {}: `{name}` is not a {side} {} model tensor this adapter knows \
         (torchtitan 0.3.0's state_dict_adapter names; use --model-only to drop training \
         state){hint}",
        table.family, table.family
    ))
}

fn rope_map(rule: &Rule, to: Naming, args: &ModelArgs) -> Option<RowMap> {
    let heads = match rule.transform {
        Transform::RopeQ => args.n_heads,
        Transform::RopeK => args.n_kv_heads,
        _ => return None,
    };
    Some(match to {
        Naming::Hf => RowMap::ToHf { heads },
        Naming::Torchtitan => RowMap::FromHf { heads },
    })
}

/// Makes `o` the per-expert transpose of `t` when `rule` says so.
fn transposed(rule: &Rule, name: &str, t: &TensorPlan, o: &mut OutTensor) -> Result<()> {
    if rule.transform == Transform::TransposedExperts {
        let tr = ExpertTranspose::of(name, &t.shape)?;
        o.shape = tr.out_shape(t.shape[0]);
        o.transpose = Some(tr);
    }
    Ok(())
}

fn to_hf(
    plan: &CheckpointPlan,
    table: &Table,
    args: &ModelArgs,
    opts: MapOptions,
    out: &mut Planned,
) -> Result<()> {
    let n_layers = args.n_layers;
    // Fused HF tensors: HF name -> (parts, side by side, (part index, torchtitan name) of each
    // part seen).
    type Fused = (u64, bool, Vec<(u64, String)>);
    let mut fused: BTreeMap<String, Fused> = BTreeMap::new();
    for (name, t) in &plan.tensors {
        if args.tie_word_embeddings && (name == "lm_head.weight" || name == "output.weight") {
            out.dropped.push((
                name.clone(),
                "equal to tok_embeddings.weight: HF ties it to model.embed_tokens.weight".into(),
            ));
            continue;
        }
        // MTP layers are HF's layers after the main ones.
        let lookup = match tt_layer(name, "mtp_layers.") {
            Some(m) if table.mtp_layers => {
                let rest = name.splitn(3, '.').nth(2).unwrap_or_default();
                format!("layers.{}.{rest}", n_layers + m)
            }
            _ => name.clone(),
        };
        if let Some((pat, why)) = table
            .no_hf_home
            .iter()
            .find(|(p, _)| matches(p, name).is_some())
        {
            let _ = pat;
            out.dropped.push((name.clone(), why.to_string()));
            continue;
        }
        let (rule, caps) =
            find_tt(table, &lookup).ok_or_else(|| unknown(table, name, Naming::Torchtitan))?;
        let dtype = out_dtype(t.value_dtype(), opts.dtype)?;
        if let Transform::Part { index, .. }
        | Transform::GdnPart { index }
        | Transform::GateUp { index } = rule.transform
        {
            let (of, side) = match rule.transform {
                Transform::Part { of, .. } => (of, false),
                Transform::GateUp { .. } => (2, true),
                _ => (3, false),
            };
            let parts = fused
                .entry(hf_of(table, rule, caps))
                .or_insert((of, side, Vec::new()));
            parts.2.push((index, name.clone()));
            continue;
        }
        if rule.transform == Transform::Experts {
            let (&e, rest) = t.shape.split_first().ok_or_else(|| {
                Error::tensor(
                    plan.root.display(),
                    name,
                    "stacked experts need an [E, ...] shape",
                )
            })?;
            let per: u64 = rest.iter().product();
            for expert in 0..e {
                out.tensors.push(OutTensor {
                    name: hf_of(
                        table,
                        rule,
                        Captures {
                            expert: Some(expert),
                            ..caps
                        },
                    ),
                    sources: vec![SourceSlice {
                        tensor: name.clone(),
                        offset: expert * per,
                        numel: per,
                    }],
                    dtype,
                    shape: rest.to_vec(),
                    row_map: None,
                    transpose: None,
                    side_by_side: None,
                });
            }
            continue;
        }
        let mut o = OutTensor::whole(hf_of(table, rule, caps), name, t, dtype);
        o.row_map = rope_map(rule, Naming::Hf, args);
        transposed(rule, name, t, &mut o)?;
        if let Transform::PatchEmbed { channels, temporal } = rule.transform {
            o.shape = conv_patch_shape(plan, name, &t.shape, channels, temporal)?;
        }
        out.tensors.push(o);
    }
    for (hf, (of, side, mut parts)) in fused {
        parts.sort();
        if parts.iter().map(|(i, _)| *i).ne(0..of) {
            let names: Vec<&str> = parts.iter().map(|(_, n)| n.as_str()).collect();
            return Err(Error::usage(format!(
                "`{hf}` fuses {of} torchtitan tensors, but only {names:?} are in {}",
                plan.root.display()
            )));
        }
        let first = &plan.tensors[&parts[0].1];
        let mut rows = 0;
        let mut sources = Vec::with_capacity(parts.len());
        for (_, name) in &parts {
            let t = &plan.tensors[name];
            if t.shape.get(1..) != first.shape.get(1..) || t.dtype != first.dtype {
                return Err(Error::tensor(
                    plan.root.display(),
                    name,
                    format!(
                        "shape {:?} {} cannot be fused with `{}` {:?} {} into `{hf}`",
                        t.shape, t.dtype, parts[0].1, first.shape, first.dtype
                    ),
                ));
            }
            rows += t.shape.first().copied().unwrap_or(1);
            sources.push(SourceSlice {
                tensor: name.clone(),
                offset: 0,
                numel: t.numel(),
            });
        }
        let mut shape = first.shape.clone();
        let mut side_by_side = None;
        let same = parts
            .iter()
            .all(|(_, n)| plan.tensors[n].shape == first.shape);
        match (side, &first.shape[..]) {
            (true, &[e, f, d]) if same => {
                shape = vec![e, d, 2 * f];
                side_by_side = Some(ExpertTranspose {
                    rows: f,
                    cols: d,
                    first_col: 0,
                    width: d,
                });
            }
            (true, _) => {
                return Err(Error::tensor(
                    plan.root.display(),
                    &parts[0].1,
                    format!("`{hf}` fuses two [E, F, D] expert stacks of one shape"),
                ));
            }
            (false, _) => {
                if let Some(r) = shape.first_mut() {
                    *r = rows;
                }
            }
        }
        out.tensors.push(OutTensor {
            name: hf,
            sources,
            dtype: out_dtype(first.value_dtype(), opts.dtype)?,
            shape,
            row_map: None,
            transpose: None,
            side_by_side,
        });
    }
    Ok(())
}

/// HF's Conv2d weight shape `[out, C, k, k]` (or Conv3d `[out, C, T, k, k]` when `temporal` T is
/// over 1) of torchtitan's Linear patch embedding `[out, C T k k]` (`channels` = C).
fn conv_patch_shape(
    plan: &CheckpointPlan,
    name: &str,
    shape: &[u64],
    channels: u64,
    temporal: u64,
) -> Result<Vec<u64>> {
    let bad = || {
        Error::tensor(
            plan.root.display(),
            name,
            format!(
                "shape {shape:?} is not a Linear patch embedding of {channels} channels x \
                 {temporal} frames x a square patch"
            ),
        )
    };
    let [out, cols] = shape[..] else {
        return Err(bad());
    };
    let area = cols / (channels * temporal).max(1);
    let k = (area as f64).sqrt().round() as u64;
    if k == 0 || k * k * channels * temporal != cols {
        return Err(bad());
    }
    Ok(match temporal {
        1 => vec![out, channels, k, k],
        t => vec![out, channels, t, k, k],
    })
}

fn from_hf(
    plan: &CheckpointPlan,
    table: &Table,
    args: &ModelArgs,
    opts: MapOptions,
    out: &mut Planned,
) -> Result<()> {
    let n_layers = args.n_layers;
    // Stacked experts: torchtitan name -> expert index -> HF name.
    let mut stacks: BTreeMap<String, BTreeMap<u64, String>> = BTreeMap::new();
    for (name, t) in &plan.tensors {
        if table.hf_ignored.iter().any(|p| matches(p, name).is_some()) {
            continue;
        }
        if let Some((_, why)) = table
            .hf_dropped
            .iter()
            .find(|(p, _)| matches(p, name).is_some())
        {
            out.dropped.push((name.clone(), why.to_string()));
            continue;
        }
        let (rule, caps) =
            find_hf(table, name, opts.tt_names).ok_or_else(|| unknown(table, name, Naming::Hf))?;
        let mut tt = fill(
            rule.tt,
            Captures {
                expert: None,
                ..caps
            },
        );
        // Only the text model's layers continue into MTP layers (not a vision encoder's).
        if table.mtp_layers
            && tt.starts_with("layers.")
            && let Some(l) = caps.layer.filter(|l| *l >= n_layers)
        {
            let rest = tt.splitn(3, '.').nth(2).unwrap_or_default().to_string();
            tt = format!("mtp_layers.{}.{rest}", l - n_layers);
        }
        if rule.transform == Transform::Experts {
            let e = caps.expert.unwrap_or_default();
            stacks.entry(tt).or_default().insert(e, name.clone());
            continue;
        }
        if let Transform::Part { .. } | Transform::GdnPart { .. } | Transform::GateUp { .. } =
            rule.transform
        {
            split_fused(plan, table, rule, caps, name, t, opts, out)?;
            continue;
        }
        let mut o = whole(tt, name, t, opts.dtype)?;
        o.row_map = rope_map(rule, Naming::Torchtitan, args);
        transposed(rule, name, t, &mut o)?;
        if let Transform::PatchEmbed { .. } = rule.transform {
            o.shape = vec![
                t.shape.first().copied().unwrap_or(1),
                t.numel() / t.shape.first().copied().unwrap_or(1).max(1),
            ];
        }
        out.tensors.push(o);
    }
    // torchtitan's model holds lm_head even when HF ties it to the embedding.
    let has_head = out
        .tensors
        .iter()
        .any(|t| t.name == "lm_head.weight" || t.name == "output.weight");
    let emb_name = find_tt(table, "tok_embeddings.weight")
        .map(|(r, c)| hf_of(table, r, c))
        .unwrap_or_default();
    if !has_head && let Some(emb) = plan.tensors.get(&emb_name) {
        let head = match opts.tt_names {
            TtNames::Current => "lm_head.weight",
            TtNames::Legacy => "output.weight",
        };
        out.tensors
            .push(whole(head.into(), &emb_name, emb, opts.dtype)?);
    }
    for (tt, experts) in stacks {
        let count = experts.len() as u64;
        if experts.keys().copied().ne(0..count) {
            return Err(Error::usage(format!(
                "`{tt}`: HF experts {:?} are not 0..{count} (missing experts)",
                experts.keys().collect::<Vec<_>>()
            )));
        }
        let first = &experts[&0];
        let t0 = &plan.tensors[first];
        let mut sources = Vec::with_capacity(experts.len());
        for hf in experts.values() {
            let t = &plan.tensors[hf];
            if t.shape != t0.shape
                || t.dtype != t0.dtype
                || t.scales.is_some() != t0.scales.is_some()
            {
                return Err(Error::tensor(
                    plan.root.display(),
                    hf,
                    format!(
                        "shape {:?} {} differs from expert 0's {:?} {} (`{first}`)",
                        t.shape, t.dtype, t0.shape, t0.dtype
                    ),
                ));
            }
            sources.push(SourceSlice {
                tensor: hf.clone(),
                offset: 0,
                numel: t.numel(),
            });
        }
        let mut shape = vec![count];
        shape.extend_from_slice(&t0.shape);
        out.tensors.push(OutTensor {
            name: tt,
            sources,
            dtype: out_dtype(t0.value_dtype(), opts.dtype)?,
            shape,
            row_map: None,
            transpose: None,
            side_by_side: None,
        });
    }
    Ok(())
}

/// The rows of each part of the fused HF tensor `name` (matched by `rule`): `of` equal blocks
/// for a [`Transform::Part`]; k, k, v for a [`Transform::GdnPart`], v being the rows of the
/// layer's `in_proj_z`.
fn part_rows(
    plan: &CheckpointPlan,
    table: &Table,
    rule: &Rule,
    caps: Captures,
    name: &str,
    rows: u64,
) -> Result<Vec<u64>> {
    let bad = |why: String| Error::tensor(plan.root.display(), name, why);
    match rule.transform {
        Transform::Part { of, .. } if of > 0 && rows.is_multiple_of(of) => {
            Ok(vec![rows / of; of as usize])
        }
        Transform::Part { of, .. } => Err(bad(format!(
            "{rows} rows do not split into {of} equal parts"
        ))),
        _ => {
            let z = format!(
                "{}{}.linear_attn.in_proj_z.weight",
                table.hf_layers,
                caps.layer.unwrap_or_default()
            );
            let v = plan
                .tensors
                .get(&z)
                .and_then(|t| t.shape.first().copied())
                .ok_or_else(|| bad(format!("its q/k/v split needs `{z}`, which is missing")))?;
            match rows.checked_sub(v).filter(|kk| kk.is_multiple_of(2)) {
                Some(kk) => Ok(vec![kk / 2, kk / 2, v]),
                None => Err(bad(format!(
                    "{rows} rows are not k + k + v with v = {v} (`{z}`'s rows)"
                ))),
            }
        }
    }
}

/// `[E, D, 2F]` of HF's fused gate/up experts `name` as (E, D, F).
fn gate_up_dims(plan: &CheckpointPlan, name: &str, t: &TensorPlan) -> Result<(u64, u64, u64)> {
    match t.shape[..] {
        [e, d, two_f] if two_f.is_multiple_of(2) => Ok((e, d, two_f / 2)),
        _ => Err(Error::tensor(
            plan.root.display(),
            name,
            format!(
                "fused gate/up experts need an [E, D, 2F] shape, got {:?}",
                t.shape
            ),
        )),
    }
}

/// The torchtitan tensors of the fused HF tensor `name` (matched by `rule`), one per rule of the
/// same HF name: blocks of its rows for a part transform ([`part_rows`]); for
/// [`Transform::GateUp`] (`[E, D, 2F]`), one half of its columns transposed per expert, `[E, F,
/// D]` each.
#[allow(clippy::too_many_arguments)]
fn split_fused(
    plan: &CheckpointPlan,
    table: &Table,
    rule: &Rule,
    caps: Captures,
    name: &str,
    t: &TensorPlan,
    opts: MapOptions,
    out: &mut Planned,
) -> Result<()> {
    let dtype = out_dtype(t.value_dtype(), opts.dtype)?;
    let row_len: u64 = t.shape.iter().skip(1).product();
    let (rows, gate_up) = match rule.transform {
        Transform::GateUp { .. } => (Vec::new(), Some(gate_up_dims(plan, name, t)?)),
        _ => {
            let first_dim = t.shape.first().copied().unwrap_or(0);
            (part_rows(plan, table, rule, caps, name, first_dim)?, None)
        }
    };
    for r in table.current().filter(|r| r.hf == rule.hf) {
        let (shape, offset, numel, transpose) = match (r.transform, gate_up) {
            (Transform::Part { index, .. } | Transform::GdnPart { index }, None) => {
                let mut shape = t.shape.clone();
                shape[0] = rows[index as usize];
                let first: u64 = rows[..index as usize].iter().sum();
                (shape.clone(), first * row_len, shape[0] * row_len, None)
            }
            // The slice counts the half of the input read, through the column window.
            (Transform::GateUp { index }, Some((e, d, f))) => {
                let tr = ExpertTranspose {
                    rows: d,
                    cols: 2 * f,
                    first_col: index * f,
                    width: f,
                };
                (vec![e, f, d], 0, e * d * f, Some(tr))
            }
            _ => continue,
        };
        out.tensors.push(OutTensor {
            name: fill(r.tt, caps),
            sources: vec![SourceSlice {
                tensor: name.to_string(),
                offset,
                numel,
            }],
            dtype,
            shape,
            row_map: None,
            transpose,
            side_by_side: None,
        });
    }
    Ok(())
}

/// Whether tensors `a` and `b` of `plan` hold the same bytes (streamed in windows).
pub fn same_contents(plan: &CheckpointPlan, a: &str, b: &str) -> Result<bool> {
    let (Some(ta), Some(tb)) = (plan.tensors.get(a), plan.tensors.get(b)) else {
        return Ok(false);
    };
    if ta.shape != tb.shape || ta.dtype != tb.dtype {
        return Ok(false);
    }
    let files = plan.open_files()?;
    let mut ra = TensorReader::new(plan, &files);
    let mut rb = TensorReader::new(plan, &files);
    let es = ta.dtype.size() as u64;
    let step = (8u64 << 20) / es;
    let (mut ba, mut bb) = (Vec::new(), Vec::new());
    let mut s = 0;
    while s < ta.numel() {
        let e = (s + step).min(ta.numel());
        ba.resize(((e - s) * es) as usize, 0);
        bb.resize(((e - s) * es) as usize, 0);
        ra.read_any(ta, s..e, &mut ba)?;
        rb.read_any(tb, s..e, &mut bb)?;
        if ba != bb {
            return Ok(false);
        }
        s = e;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_names_both_generations() {
        for (old, new) in [
            (
                "layers.3.attention.wk.weight",
                "layers.3.attention.qkv_linear.wk.weight",
            ),
            ("output.weight", "lm_head.weight"),
            ("layers.0.ffn_norm.weight", "layers.0.ffn_norm.weight"),
        ] {
            let hf = to_hf_name(old).unwrap();
            assert_eq!(to_hf_name(new).unwrap(), hf);
            assert_eq!(from_hf_name(&hf).as_deref(), Some(new));
        }
        assert_eq!(
            to_hf_name("layers.1.feed_forward.w2.weight").unwrap(),
            "model.layers.1.mlp.down_proj.weight"
        );
        assert_eq!(to_hf_name("layers.x.attention.wq.weight"), None);
        assert_eq!(to_hf_name("optimizer.state"), None);
        let (r, c) = find_hf(&tables::LLAMA3, "lm_head.weight", TtNames::Legacy).unwrap();
        assert_eq!(fill(r.tt, c), "output.weight");
    }

    #[test]
    fn llama3_legacy_names_and_rope_roles() {
        let t = &tables::LLAMA3;
        for (new, old) in [
            (
                "layers.3.attention.qkv_linear.wk.weight",
                "layers.3.attention.wk.weight",
            ),
            ("lm_head.weight", "output.weight"),
        ] {
            assert_eq!(legacy_name(t, new).as_deref(), Some(old));
            assert_eq!(legacy_name(t, old), None);
        }
        for same in [
            "layers.0.attention.wo.weight",
            "tok_embeddings.weight",
            "layers.0.attention.qkv_linear.wqkv.weight",
        ] {
            assert_eq!(legacy_name(t, same), None, "{same}");
        }
        let role = |n: &str| to_hf_rule(n).map(|(_, tr)| tr);
        for (name, want) in [
            ("layers.2.attention.qkv_linear.wq.weight", Transform::RopeQ),
            ("layers.2.attention.wq.weight", Transform::RopeQ),
            ("layers.2.attention.qkv_linear.wk.weight", Transform::RopeK),
            ("layers.2.attention.wk.weight", Transform::RopeK),
            ("layers.2.attention.qkv_linear.wv.weight", Transform::Copy),
            ("layers.2.attention.wo.weight", Transform::Copy),
        ] {
            assert_eq!(role(name), Some(want), "{name}");
        }
    }
}
