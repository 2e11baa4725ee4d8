//! Mixture-of-experts checks for `verify`: does a checkpoint hold every expert of every layer
//! exactly once, and are any two experts bit-identical?
//!
//! Under expert parallelism each rank saves only its experts, as chunks of the full stacked
//! `[E, ...]` tensors (torchtitan's `layers.L.moe.routed_experts.inner_experts.w1_EFD`, their
//! AdamW moments `optimizer.state.<name>.exp_avg`, ...). A bad save loses a rank's chunks (a gap
//! in `[0, E)`), writes a rank's experts as if they were all of them (fewer experts than the
//! layer's router routes to), or writes one rank's experts in another's place (two experts
//! bit-identical). Which tensors hold experts is read from the family tables (`adapter`):
//! torchtitan's stacked tensors in either name generation, HF's stacked ones (gpt-oss, Qwen3.5)
//! and HF's split ones (`mlp.experts.N.*`: a missing expert is a missing tensor).
//!
//! Coverage builds on [`crate::plan::check_tiling`]: a stacked tensor that does not tile gets its
//! error said per expert ([`describe_coverage`]). Equality streams: each expert's bytes are
//! digested window by window (bounded memory), and experts with equal digests are compared byte
//! for byte before they are reported.

use std::collections::{BTreeMap, BTreeSet};
use std::hash::Hasher;
use std::ops::Range;

use rayon::prelude::*;
use serde::Serialize;

use crate::adapter::pattern::Captures;
use crate::adapter::{Rule, TABLES, Transform, find_hf, find_tt};
use crate::assemble::{TensorReader, windows_in};
use crate::error::Result;
use crate::plan::{CheckpointPlan, TensorPlan, is_model_tensor};

/// What `verify` found about a checkpoint's experts.
#[derive(Debug, Default, Serialize)]
pub struct ExpertReport {
    /// Layers with routed experts.
    pub layers: usize,
    /// Experts per layer (the distinct counts; one value when every layer has as many).
    pub experts_per_layer: Vec<u64>,
    /// Expert tensors checked (stacked tensors, model and optimizer state, plus HF's
    /// per-expert tensors grouped by projection and layer).
    pub tensors: usize,
    /// Experts missing or held twice, each naming the tensor (or key), the layer and the
    /// experts: `verify` fails (reported in its `error`).
    #[serde(skip)]
    pub errors: Vec<String>,
    /// Bit-identical experts of one model tensor (a sign of a bad save; sparse upcycling
    /// starts from copies on purpose): `verify` passes unless `--strict` (reported in its
    /// `warnings`).
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// How a tensor holds experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// `[E, ...]`: expert `e` is row `e` of dim 0.
    Stacked,
    /// One tensor per expert (HF's `{E}` in the name).
    Split,
}

/// The table rule an expert tensor's name matched, and what it captured.
struct ExpertName {
    rule: &'static Rule,
    /// Whether `rule.tt` (else `rule.hf`) matched.
    tt: bool,
    caps: Captures,
    holds: Holds,
}

impl ExpertName {
    /// The rule's pattern on the side that matched.
    fn rule_pattern(&self) -> &'static str {
        if self.tt { self.rule.tt } else { self.rule.hf }
    }

    /// The layer as its pattern names it (`layers.1`, `mtp_layers.0`, `model.layers.1`), so that
    /// a DeepSeek-V3 MTP layer is not taken for the main layer of the same index.
    fn layer_id(&self) -> Option<String> {
        layer_id(self.rule_pattern(), self.caps)
    }

    /// The projection within its layer: the pattern after `{L}.`.
    fn projection(&self) -> &'static str {
        let p = self.rule_pattern();
        p.split_once("{L}.").map_or(p, |(_, rest)| rest)
    }
}

/// `pattern` up to its `{L}` with the layer filled in.
fn layer_id(pattern: &str, caps: Captures) -> Option<String> {
    let (before, _) = pattern.split_once("{L}")?;
    Some(format!("{before}{}", caps.layer?))
}

/// `name` with the part a pattern's `{E}` matched written `{E}` (patterns match the end of a
/// name; a table's HF prefix may come before).
fn split_key(name: &str, pattern: &str) -> String {
    let from_end = pattern.split('.').rev().position(|p| p == "{E}");
    let mut parts: Vec<&str> = name.split('.').collect();
    if let Some(k) = from_end
        && k < parts.len()
    {
        let i = parts.len() - 1 - k;
        parts[i] = "{E}";
    }
    parts.join(".")
}

fn is_expert_transform(t: Transform) -> bool {
    matches!(
        t,
        Transform::Experts | Transform::TransposedExperts | Transform::GateUp { .. }
    )
}

/// The model tensor an optimizer-state name is about (`optimizer.state.<name>.exp_avg`), else
/// the name itself.
fn model_name(name: &str) -> &str {
    name.strip_prefix("optimizer.state.")
        .and_then(|rest| rest.rsplit_once('.'))
        .map(|(model, _)| model)
        .unwrap_or(name)
}

/// Whether `name` (or the model tensor whose optimizer state it is) holds experts, and how.
fn expert_name(name: &str) -> Option<ExpertName> {
    let model = model_name(name);
    TABLES.iter().find_map(|table| {
        if let Some((rule, caps)) = find_tt(table, model)
            && is_expert_transform(rule.transform)
        {
            return Some(ExpertName {
                rule,
                tt: true,
                caps,
                holds: Holds::Stacked,
            });
        }
        let (rule, caps) = find_hf(table, model, crate::adapter::TtNames::Current)?;
        is_expert_transform(rule.transform).then_some(ExpertName {
            rule,
            tt: false,
            caps,
            holds: match rule.transform {
                Transform::Experts => Holds::Split,
                _ => Holds::Stacked,
            },
        })
    })
}

/// The layer (as [`ExpertName::layer_id`]) whose router `name` is
/// (`layers.{L}.moe.router.gate.weight`, or its HF name: `[E, dim]`).
fn router_layer(name: &str) -> Option<String> {
    TABLES.iter().find_map(|table| {
        let is_router = |r: &Rule| r.tt == "layers.{L}.moe.router.gate.weight";
        if let Some((r, caps)) = find_tt(table, name)
            && is_router(r)
        {
            return layer_id(r.tt, caps);
        }
        let (r, caps) = find_hf(table, name, crate::adapter::TtNames::Current)?;
        if !is_router(r) {
            return None;
        }
        layer_id(r.hf, caps)
    })
}

/// `[0, 1, 2, 5, 7, 8]` as `0..3, 5, 7..9` (half-open runs, as Rust ranges).
pub fn runs(ids: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            ids[i].to_string()
        } else {
            format!("{}..{}", ids[i], ids[j] + 1)
        });
        i = j + 1;
    }
    out.join(", ")
}

/// "expert 5" / "experts 4..8".
fn experts_word(ids: &[u64]) -> String {
    match ids {
        [one] => format!("expert {one}"),
        _ => format!("experts {}", runs(ids)),
    }
}

fn is_are(ids: &[u64]) -> &'static str {
    if ids.len() == 1 { "is" } else { "are" }
}

/// Elements of each expert (row of dim 0) of a stacked tensor its chunks cover, counting
/// overlaps twice; None when a chunk does not fit the shape (the tiling error says how).
fn covered_per_expert(t: &TensorPlan) -> Option<Vec<u64>> {
    let e = *t.shape.first()?;
    let mut per = vec![0u64; e as usize];
    for c in &t.chunks {
        if c.offsets.len() != t.shape.len() || c.sizes.len() != t.shape.len() {
            return None;
        }
        if c.offsets[0].checked_add(c.sizes[0])? > e {
            return None;
        }
        let inner = crate::plan::numel(&c.sizes[1..])?;
        for row in &mut per[c.offsets[0] as usize..(c.offsets[0] + c.sizes[0]) as usize] {
            *row += inner;
        }
    }
    Some(per)
}

/// What is wrong with a stacked expert tensor whose chunks do not tile it, said per expert
/// (`experts 4..8 of 8 are in no chunk`); None when `name` holds no stacked experts or its
/// chunks fail in a way experts do not describe (the tiling error stands).
pub fn describe_coverage(name: &str, t: &TensorPlan) -> Option<String> {
    let en = expert_name(name)?;
    if en.holds != Holds::Stacked {
        return None;
    }
    let per = covered_per_expert(t)?;
    let whole = crate::plan::numel(&t.shape[1..])?;
    let pick = |f: &dyn Fn(u64) -> bool| -> Vec<u64> {
        (0..per.len() as u64)
            .filter(|&e| f(per[e as usize]))
            .collect()
    };
    let e = per.len();
    let mut said = Vec::new();
    let none = pick(&|n| n == 0);
    if !none.is_empty() {
        said.push(format!(
            "{} of {e} {} in no chunk",
            experts_word(&none),
            is_are(&none)
        ));
    }
    let part = pick(&|n| n > 0 && n < whole);
    if !part.is_empty() {
        said.push(format!(
            "{} of {e} {} only partly in chunks",
            experts_word(&part),
            is_are(&part)
        ));
    }
    let twice = pick(&|n| n > whole);
    if !twice.is_empty() {
        said.push(format!(
            "{} of {e} {} in more than one chunk (overlapping chunks)",
            experts_word(&twice),
            is_are(&twice)
        ));
    }
    let layer = en
        .caps
        .layer
        .map(|l| format!("layer {l}: "))
        .unwrap_or_default();
    (!said.is_empty()).then(|| format!("{layer}{}", said.join("; ")))
}

/// One tensor's experts as a list of (expert, tensor name, element range of that tensor).
type Members = Vec<(u64, String, Range<u64>)>;

/// A model tensor of experts to compare: a stacked tensor, or a split group.
struct Group {
    /// The stacked tensor's name, or the split tensors' name with `{E}`.
    key: String,
    layer: Option<u64>,
    members: Members,
}

/// Checks every expert tensor of `plan` (whose chunks tile: see [`describe_coverage`] for those
/// that do not): each layer's experts against its router's count, HF's per-expert tensors for
/// gaps, every projection present in every MoE layer, and bit-identical experts.
pub fn check(plan: &CheckpointPlan) -> Result<ExpertReport> {
    let mut report = ExpertReport::default();
    // Layer id -> (router name, experts it routes to).
    let routers: BTreeMap<String, (&str, u64)> = plan
        .tensors
        .iter()
        .filter(|(n, t)| is_model_tensor(n) && !t.shape.is_empty())
        .filter_map(|(n, t)| Some((router_layer(n)?, (n.as_str(), t.shape[0]))))
        .collect();
    let mut groups: Vec<Group> = Vec::new();
    // Split key -> (layer id, layer, members).
    let mut split: BTreeMap<String, (Option<String>, Option<u64>, Members)> = BTreeMap::new();
    // Per layer id, the expert projections its model tensors hold.
    let mut projections: BTreeMap<String, BTreeSet<&'static str>> = BTreeMap::new();
    let mut counts: BTreeSet<u64> = BTreeSet::new();
    let against_router = |name: &str, id: &Option<String>, e: u64, errors: &mut Vec<String>| {
        let Some((router, want)) = id.as_ref().and_then(|id| routers.get(id)) else {
            return e;
        };
        if e < *want {
            let lost: Vec<u64> = (e..*want).collect();
            errors.push(format!(
                "{name}: holds {e} experts but its router `{router}` routes to {want}: {} {} \
                 in no tensor",
                experts_word(&lost),
                is_are(&lost)
            ));
        } else if e > *want {
            errors.push(format!(
                "{name}: holds {e} experts but its router `{router}` routes to {want}"
            ));
        }
        *want
    };
    for (name, t) in &plan.tensors {
        let Some(en) = expert_name(name) else {
            continue;
        };
        if t.shape.is_empty() {
            continue; // AdamW's 0-d `step` of an expert tensor
        }
        let model = is_model_tensor(name);
        let id = en.layer_id();
        if let (true, Some(id)) = (model, &id) {
            projections
                .entry(id.clone())
                .or_default()
                .insert(en.projection());
        }
        match en.holds {
            Holds::Stacked => {
                report.tensors += 1;
                let e = t.shape[0];
                counts.insert(against_router(name, &id, e, &mut report.errors));
                if model {
                    let inner = crate::plan::numel(&t.shape[1..]).unwrap_or(0);
                    groups.push(Group {
                        key: name.clone(),
                        layer: en.caps.layer,
                        members: (0..e)
                            .map(|i| (i, name.clone(), i * inner..(i + 1) * inner))
                            .collect(),
                    });
                }
            }
            Holds::Split => {
                let entry = split.entry(split_key(name, en.rule_pattern())).or_insert((
                    id,
                    en.caps.layer,
                    Vec::new(),
                ));
                entry.2.push((
                    en.caps.expert.unwrap_or_default(),
                    name.clone(),
                    0..t.numel(),
                ));
            }
        }
    }
    for (key, (id, layer, mut members)) in split {
        report.tensors += 1;
        members.sort_by_key(|m| m.0);
        let have: BTreeSet<u64> = members.iter().map(|m| m.0).collect();
        let top = have.last().map_or(0, |&e| e + 1);
        let want = against_router(&key, &id, top, &mut Vec::new());
        counts.insert(want);
        let lost: Vec<u64> = (0..want.min(top)).filter(|e| !have.contains(e)).collect();
        let beyond: Vec<u64> = (top..want).collect();
        let lost: Vec<u64> = lost.into_iter().chain(beyond).collect();
        let at = layer.map(|l| format!("layer {l}: ")).unwrap_or_default();
        if !lost.is_empty() {
            report.errors.push(format!(
                "{key}: {at}{} of {want} {} missing (no such tensor)",
                experts_word(&lost),
                is_are(&lost)
            ));
        }
        if top > want {
            let extra: Vec<u64> = (want..top).filter(|e| have.contains(e)).collect();
            report.errors.push(format!(
                "{key}: {at}{} {} beyond the {want} its router routes to",
                experts_word(&extra),
                is_are(&extra)
            ));
        }
        groups.push(Group {
            key,
            layer,
            members,
        });
    }
    let every: BTreeSet<&str> = projections.values().flatten().copied().collect();
    for (id, has) in &projections {
        for p in every.iter().filter(|p| !has.contains(*p)) {
            report.errors.push(format!(
                "{id}.{p}: no such expert tensor, while other MoE layers have one"
            ));
        }
    }
    for (id, (router, _)) in &routers {
        if !projections.contains_key(id) && !projections.is_empty() {
            report.errors.push(format!(
                "{router}: {id} routes to experts but holds no expert tensor"
            ));
        }
    }
    report.layers = projections.len();
    report.experts_per_layer = counts.into_iter().collect();
    report.warnings = identical_experts(plan, &groups)?;
    Ok(report)
}

/// A digest of bytes: CRC-32 and SipHash side by side (96 bits); equal digests are confirmed
/// byte for byte before anything is reported.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Digest(u32, u64);

/// Window of bytes read at a time per expert.
const WINDOW: u64 = 8 << 20;

fn digest(
    reader: &mut TensorReader,
    t: &TensorPlan,
    range: Range<u64>,
    buf: &mut Vec<u8>,
) -> Result<Digest> {
    let mut crc = crc32fast::Hasher::new();
    let mut sip = std::hash::DefaultHasher::new();
    for w in windows_in(t, range, WINDOW) {
        buf.resize(((w.end - w.start) * t.dtype.size() as u64) as usize, 0);
        reader.read_any(t, w, buf)?;
        crc.update(buf);
        sip.write(buf);
    }
    Ok(Digest(crc.finalize(), sip.finish()))
}

/// Whether two experts' bytes are equal, streamed in windows.
fn same_bytes(
    reader: &mut TensorReader,
    plan: &CheckpointPlan,
    a: &(u64, String, Range<u64>),
    b: &(u64, String, Range<u64>),
) -> Result<bool> {
    let (ta, tb) = (&plan.tensors[&a.1], &plan.tensors[&b.1]);
    if ta.dtype != tb.dtype || a.2.end - a.2.start != b.2.end - b.2.start {
        return Ok(false);
    }
    let (mut ba, mut bb) = (Vec::new(), Vec::new());
    for w in windows_in(ta, a.2.clone(), WINDOW) {
        let shift = w.start - a.2.start;
        let n = ((w.end - w.start) * ta.dtype.size() as u64) as usize;
        ba.resize(n, 0);
        bb.resize(n, 0);
        reader.read_any(ta, w.clone(), &mut ba)?;
        reader.read_any(
            tb,
            b.2.start + shift..b.2.start + shift + (w.end - w.start),
            &mut bb,
        )?;
        if ba != bb {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Per group, the experts bit-identical to an earlier one, as warnings naming the tensor, the
/// layer and the experts (`expert 5 is bit-identical to expert 1`; runs where a block of
/// experts copies another block).
fn identical_experts(plan: &CheckpointPlan, groups: &[Group]) -> Result<Vec<String>> {
    let files = plan.open_files()?;
    let found: Vec<Vec<String>> = groups
        .par_iter()
        .map_init(
            || (TensorReader::new(plan, &files), Vec::new()),
            |(reader, buf), g| -> Result<Vec<String>> {
                let mut by_digest: BTreeMap<Digest, Vec<usize>> = BTreeMap::new();
                for (i, m) in g.members.iter().enumerate() {
                    let d = digest(reader, &plan.tensors[&m.1], m.2.clone(), buf)?;
                    by_digest.entry(d).or_default().push(i);
                }
                // (copy, original): each expert against the first one of its digest that
                // holds the same bytes.
                let mut pairs: Vec<(u64, u64)> = Vec::new();
                for same in by_digest.values().filter(|v| v.len() > 1) {
                    let mut originals: Vec<usize> = Vec::new();
                    for &i in same {
                        let mut of = None;
                        for &o in &originals {
                            if same_bytes(reader, plan, &g.members[o], &g.members[i])? {
                                of = Some(o);
                                break;
                            }
                        }
                        match of {
                            Some(o) => pairs.push((g.members[i].0, g.members[o].0)),
                            None => originals.push(i),
                        }
                    }
                }
                pairs.sort();
                Ok(say_identical(&g.key, g.layer, &pairs))
            },
        )
        .collect::<Result<_>>()?;
    Ok(found.into_iter().flatten().collect())
}

/// `key: layer L: experts 4..8 are bit-identical to experts 0..4` for runs of (copy, original)
/// pairs that both step by one.
fn say_identical(key: &str, layer: Option<u64>, pairs: &[(u64, u64)]) -> Vec<String> {
    let layer = layer.map(|l| format!("layer {l}: ")).unwrap_or_default();
    let mut out = Vec::new();
    let mut i = 0;
    while i < pairs.len() {
        let mut j = i;
        while j + 1 < pairs.len()
            && pairs[j + 1].0 == pairs[j].0 + 1
            && pairs[j + 1].1 == pairs[j].1 + 1
        {
            j += 1;
        }
        let copies: Vec<u64> = pairs[i..=j].iter().map(|p| p.0).collect();
        let originals: Vec<u64> = pairs[i..=j].iter().map(|p| p.1).collect();
        out.push(format!(
            "{key}: {layer}{} {} bit-identical to {}",
            experts_word(&copies),
            is_are(&copies),
            experts_word(&originals)
        ));
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Chunk, ChunkSource, Encoding};
    use titan_dcp::Dtype;

    fn stacked(shape: &[u64], chunks: &[(&[u64], &[u64])]) -> TensorPlan {
        TensorPlan {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            chunks: chunks
                .iter()
                .map(|(o, s)| Chunk {
                    offsets: o.to_vec(),
                    sizes: s.to_vec(),
                    source: ChunkSource {
                        file: 0,
                        begin: 0,
                        end: 0,
                        encoding: Encoding::Raw,
                    },
                })
                .collect(),
            scales: None,
        }
    }

    const W1: &str = "layers.1.moe.routed_experts.inner_experts.w1_EFD";

    #[test]
    fn names_that_hold_experts() {
        assert_eq!(expert_name(W1).unwrap().holds, Holds::Stacked);
        let opt = format!("optimizer.state.{W1}.exp_avg");
        assert_eq!(expert_name(&opt).unwrap().caps.layer, Some(1));
        let hf = expert_name("model.layers.2.mlp.experts.5.up_proj.weight").unwrap();
        assert_eq!((hf.holds, hf.caps.expert), (Holds::Split, Some(5)));
        assert_eq!(
            split_key(
                "model.layers.2.mlp.experts.5.up_proj.weight",
                hf.rule_pattern()
            ),
            "model.layers.2.mlp.experts.{E}.up_proj.weight"
        );
        assert_eq!(hf.layer_id().as_deref(), Some("model.layers.2"));
        assert!(expert_name("layers.1.moe.shared_experts.w1.weight").is_none());
        assert!(expert_name("layers.1.moe.router.gate.weight").is_none());
        assert_eq!(
            router_layer("layers.3.moe.router.gate.weight").as_deref(),
            Some("layers.3")
        );
        assert_eq!(
            router_layer("model.layers.3.mlp.gate.weight").as_deref(),
            Some("model.layers.3")
        );
    }

    #[test]
    fn coverage_is_said_per_expert() {
        let half = stacked(&[8, 2, 2], &[(&[0, 0, 0], &[4, 2, 2])]);
        assert_eq!(
            describe_coverage(W1, &half).unwrap(),
            "layer 1: experts 4..8 of 8 are in no chunk"
        );
        // FSDP split within experts 2..4 on dim 1, one half lost; expert 7 saved twice.
        let t = stacked(
            &[8, 2, 2],
            &[
                (&[0, 0, 0], &[2, 2, 2]),
                (&[2, 0, 0], &[2, 1, 2]),
                (&[4, 0, 0], &[4, 2, 2]),
                (&[7, 0, 0], &[1, 2, 2]),
            ],
        );
        assert_eq!(
            describe_coverage(W1, &t).unwrap(),
            "layer 1: experts 2..4 of 8 are only partly in chunks; expert 7 of 8 is in more \
             than one chunk (overlapping chunks)"
        );
        assert_eq!(describe_coverage("tok_embeddings.weight", &half), None);
    }

    #[test]
    fn runs_and_identical_pairs() {
        assert_eq!(runs(&[0, 1, 2, 5, 7, 8]), "0..3, 5, 7..9");
        assert_eq!(
            say_identical("w", Some(0), &[(4, 0), (5, 1), (6, 2), (7, 3)]),
            vec!["w: layer 0: experts 4..8 are bit-identical to experts 0..4"]
        );
        assert_eq!(
            say_identical("w", None, &[(2, 0), (5, 1)]),
            vec![
                "w: expert 2 is bit-identical to expert 0",
                "w: expert 5 is bit-identical to expert 1"
            ]
        );
    }
}
