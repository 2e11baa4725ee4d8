//! Chrome trace-event JSON: torchtitan's `generate_gantt_trace` output, PyTorch profiler
//! traces (`prof.export_chrome_trace`), and titan-obs's own `export --chrome`.
//!
//! Events read: `X` (complete), `B`/`E` (begin/end, paired LIFO per pid/tid; an unclosed
//! `B` lasts until the process's last event and is reported open), `i`/`I` (instants), `C`
//! (counters -> scalars) and `M` `process_name`/`thread_name`. Flow and other events are
//! skipped. Times are microseconds (floats). Each process becomes a rank: the rank in its
//! name when it has one (`training.global_rank_3...` from torchtitan's gantt, `rank 3 (...)`
//! from titan's export), else the trace's `distributedInfo.rank` for a single-process
//! profiler trace, else the process's position among the trace's processes. Steps come from
//! `args.step`, else from the enclosing `ProfilerStep#N` span. Nesting depth comes from
//! time containment per (process, thread). torchtitan's gantt writes scalars as instants
//! named `name=value` and errors as `ERROR: phase`: both are read back as such.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use anyhow::{Context, Result};
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use crate::footer::PartHeader;
use crate::record::NO_STEP;
use crate::run::OpenSpan;
use crate::schema::Reduce;
use crate::tables::{PartData, RankInfo, RecordTable, Scalars, SharedFields};
use crate::vocab::{PROFILER_STEP, PROFILER_STEP_PREFIX, torch_pipelining, torchtitan as tt};

/// A pid or tid: a number, or a string in profiler traces (`"Spans"`, `"Traces"`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Id<'a> {
    Num(i64),
    Str(Cow<'a, str>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Id<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Id<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number or a string")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Id::Num(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Id::Num(v as i64))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                Ok(Id::Num(v as i64))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Id::Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Id::Str(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Default)]
struct Args<'a> {
    #[serde(default)]
    step: Option<serde_json::Number>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(default)]
    value: Option<f64>,
    #[serde(borrow, default)]
    message: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow, default)]
    ph: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pid: Option<Id<'a>>,
    #[serde(borrow, default)]
    tid: Option<Id<'a>>,
    #[serde(default)]
    ts: Option<f64>,
    #[serde(default)]
    dur: Option<f64>,
    #[serde(borrow, default)]
    args: Option<Args<'a>>,
}

#[derive(Deserialize)]
struct DistributedInfo {
    #[serde(default)]
    rank: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Doc<'a> {
    Object {
        #[serde(borrow, rename = "traceEvents")]
        trace_events: Vec<Event<'a>>,
        #[serde(default, rename = "distributedInfo")]
        distributed_info: Option<DistributedInfo>,
    },
    Array(#[serde(borrow)] Vec<Event<'a>>),
}

/// One span before depth and step are known.
struct RawSpan {
    thread: u32,
    name: u32,
    start_ns: i64,
    dur_ns: i64,
    step: u64,
}

/// Per-process tables while reading.
#[derive(Default)]
struct Proc {
    label: Option<String>,
    threads: BTreeMap<u32, String>,
    thread_ids: HashMap<IdKey, u32>,
    spans: Vec<RawSpan>,
    /// Open `B` events per thread: (name, start, step).
    open: HashMap<u32, Vec<(u32, i64, u64)>>,
    last_ns: i64,
    data: PartData,
}

/// A trace parsed into one [`PartData`] per process (= rank), plus the spans never closed.
pub struct Parsed {
    pub parts: Vec<PartData>,
    pub open: Vec<OpenSpan>,
    pub events: usize,
    /// The ranks are the trace's own (every process named with one, or `distributedInfo`
    /// of a single process), not positions: two such files holding one rank are two runs.
    pub ranked: bool,
}

fn us_to_ns(us: f64) -> i64 {
    (us * 1000.0).round() as i64
}

/// Sort key of a pid/tid: numbers first, in numeric order, then strings.
type IdKey = (u8, i64, String);

fn id_key(id: &Option<Id<'_>>) -> IdKey {
    match id {
        Some(Id::Num(n)) => (0, *n, String::new()),
        Some(Id::Str(s)) => (1, 0, s.to_string()),
        None => (0, 0, String::new()),
    }
}

/// Parses one trace file's bytes. `file_ix` separates processes of different files.
pub fn parse(bytes: &[u8], display: &str) -> Result<Parsed> {
    let doc: Doc<'_> = serde_json::from_slice(bytes)
        .with_context(|| format!("{display} is not Chrome trace-event JSON"))?;
    let (events, dist_rank) = match doc {
        Doc::Object {
            trace_events,
            distributed_info,
        } => (trace_events, distributed_info.and_then(|d| d.rank)),
        Doc::Array(a) => (a, None),
    };
    let n_events = events.len();
    let mut names: Vec<String> = Vec::new();
    let mut name_ids: HashMap<String, u32> = HashMap::new();
    let mut intern = |n: &str| -> u32 {
        if let Some(&i) = name_ids.get(n) {
            return i;
        }
        let i = names.len() as u32;
        names.push(n.to_string());
        name_ids.insert(n.to_string(), i);
        i
    };
    let mut procs: BTreeMap<IdKey, Proc> = BTreeMap::new();
    for e in events {
        let Some(ph) = e.ph.as_deref() else { continue };
        let pid = id_key(&e.pid);
        let proc = procs.entry(pid).or_default();
        let tid_key = id_key(&e.tid);
        let next_thread = proc.thread_ids.len() as u32;
        let thread = *proc
            .thread_ids
            .entry(tid_key.clone())
            .or_insert(next_thread);
        let name = e.name.as_deref().unwrap_or("");
        let args = e.args.unwrap_or_default();
        let step = args
            .step
            .as_ref()
            .and_then(|s| s.as_u64())
            .unwrap_or(NO_STEP);
        let ts = e.ts.map(us_to_ns);
        if let Some(t) = ts {
            proc.last_ns = proc.last_ns.max(t + e.dur.map_or(0, us_to_ns));
        }
        match ph {
            "M" => {
                if let Some(label) = args.name {
                    match name {
                        "process_name" => proc.label = Some(label.into_owned()),
                        "thread_name" => {
                            proc.threads.insert(thread, label.into_owned());
                        }
                        _ => {}
                    }
                }
            }
            "X" => {
                let Some(start_ns) = ts else { continue };
                // `ProfilerStep#7` is the phase `ProfilerStep` at step 7.
                let (name, step) = match name
                    .strip_prefix(PROFILER_STEP_PREFIX)
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    Some(n) => (PROFILER_STEP, n),
                    None => (name, step),
                };
                proc.spans.push(RawSpan {
                    thread,
                    name: intern(name),
                    start_ns,
                    dur_ns: e.dur.map_or(0, us_to_ns).max(0),
                    step,
                });
            }
            "B" => {
                let Some(start_ns) = ts else { continue };
                let id = intern(name);
                proc.open
                    .entry(thread)
                    .or_default()
                    .push((id, start_ns, step));
            }
            "E" => {
                let Some(end_ns) = ts else { continue };
                if let Some((id, start_ns, s)) =
                    proc.open.get_mut(&thread).and_then(|stack| stack.pop())
                {
                    proc.spans.push(RawSpan {
                        thread,
                        name: id,
                        start_ns,
                        dur_ns: (end_ns - start_ns).max(0),
                        step: if s != NO_STEP { s } else { step },
                    });
                }
            }
            "i" | "I" => {
                let Some(t) = ts else { continue };
                let d = &mut proc.data;
                // The rank is filled in per process below; nothing nests under an instant.
                let at = |name| SharedFields {
                    rank: 0,
                    name,
                    step,
                    start_ns: t,
                    thread,
                    depth: 0,
                    parent: 0,
                };
                if let Some(phase) = name.strip_prefix("ERROR: ") {
                    d.errors.shared_columns().push(at(intern(phase)));
                    d.errors
                        .message
                        .push(args.message.as_deref().unwrap_or_default().to_string());
                } else if let Some((scalar, v)) = name
                    .rsplit_once('=')
                    .and_then(|(n, v)| Some((n, v.parse::<f64>().ok()?)))
                    .filter(|(n, _)| !n.is_empty() && !n.contains(' '))
                {
                    push_counter(&mut d.scalars, at(intern(scalar)), v);
                } else {
                    d.instants.shared_columns().push(at(intern(name)));
                }
            }
            "C" => {
                let (Some(t), Some(v)) = (ts, args.value) else {
                    continue;
                };
                let at = SharedFields {
                    rank: 0,
                    name: intern(name),
                    step,
                    start_ns: t,
                    ..Default::default()
                };
                push_counter(&mut proc.data.scalars, at, v);
            }
            _ => {}
        }
    }

    // Processes with something to show. Profiler traces add pseudo processes with string
    // pids ("Spans", "Traces") next to the real, numeric ones: those are left out.
    let any_numeric = procs.keys().any(|k| k.0 == 0);
    let procs: Vec<Proc> = procs
        .into_iter()
        .filter(|(k, _)| k.0 == 0 || !any_numeric)
        .map(|(_, p)| p)
        .filter(|p| {
            !p.spans.is_empty()
                || !p.open.is_empty()
                || !p.data.instants.rank.is_empty()
                || !p.data.scalars.rank.is_empty()
                || !p.data.errors.rank.is_empty()
        })
        .collect();
    // Ranks: from the process names when they all carry one, else distributedInfo for a
    // single process, else the position.
    let labelled: Vec<Option<u32>> = procs
        .iter()
        .map(|p| p.label.as_deref().and_then(rank_in_process_label))
        .collect();
    let all_labelled = labelled.iter().all(Option::is_some);
    let single = procs.len() == 1;
    let ranked = !procs.is_empty() && (all_labelled || (single && dist_rank.is_some()));
    let mut parts = Vec::new();
    let mut open = Vec::new();
    for (i, (mut proc, label_rank)) in procs.into_iter().zip(labelled).enumerate() {
        let rank = match (all_labelled, label_rank, dist_rank) {
            (true, Some(r), _) => r,
            (_, _, Some(r)) if single => r,
            _ => i as u32,
        };
        // Unclosed B events: open until the process's last event.
        for (thread, stack) in std::mem::take(&mut proc.open) {
            for (id, start_ns, step) in stack {
                let dur = (proc.last_ns - start_ns).max(0);
                open.push(OpenSpan {
                    file: display.to_string(),
                    rank,
                    name: names[id as usize].clone(),
                    step: (step != NO_STEP).then_some(step),
                    start_ns,
                    shown_dur_ns: dur,
                });
                proc.spans.push(RawSpan {
                    thread,
                    name: id,
                    start_ns,
                    dur_ns: dur,
                    step,
                });
            }
        }
        let mut d = std::mem::take(&mut proc.data);
        nest(&mut proc.spans, &mut d, &names, rank);
        for v in [
            &mut d.instants.rank,
            &mut d.scalars.rank,
            &mut d.errors.rank,
        ] {
            v.fill(rank);
        }
        d.rows = d.spans.len() + d.instants.rank.len() + d.scalars.rank.len() + d.errors.rank.len();
        d.info = RankInfo {
            header: PartHeader {
                rank,
                source: proc.label.clone().unwrap_or_default(),
                threads: (0..proc.thread_ids.len() as u32)
                    .map(|t| {
                        let name = proc.threads.get(&t).cloned().unwrap_or_else(|| {
                            proc.thread_ids
                                .iter()
                                .find(|(_, v)| **v == t)
                                .map(|(k, _)| {
                                    if k.0 == 0 {
                                        format!("tid {}", k.1)
                                    } else {
                                        k.2.clone()
                                    }
                                })
                                .unwrap_or_default()
                        });
                        (t, name)
                    })
                    .collect(),
                ..Default::default()
            },
            parts: 1,
        };
        d.names.clone_from(&names);
        parts.push(d);
    }
    Ok(Parsed {
        parts,
        open,
        events: n_events,
        ranked,
    })
}

/// Appends a counter's value (`C` events, and `name=value` instants) as a mean scalar.
fn push_counter(t: &mut Scalars, at: SharedFields, value: f64) {
    t.shared_columns().push(at);
    t.value.push(value);
    t.reduce.push(Reduce::Mean);
}

/// `training.global_rank_3.<stamp>` (torchtitan's gantt) or `rank 3 (...)` (titan's export).
fn rank_in_process_label(label: &str) -> Option<u32> {
    tt::rank_in_label(label).or_else(|| {
        let rest = label.strip_prefix("rank ")?;
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    })
}

/// Depth and parent from time containment per thread, and steps from enclosing
/// `ProfilerStep#N` spans; appends the spans to `d`.
fn nest(spans: &mut [RawSpan], d: &mut PartData, names: &[String], rank: u32) {
    // Parents first: by thread, start, then longest first.
    spans.sort_unstable_by_key(|s| (s.thread, s.start_ns, std::cmp::Reverse(s.dur_ns)));
    let is_profiler_step = |name: u32| names[name as usize] == PROFILER_STEP;
    // (end, seq, step) of the enclosing spans.
    let mut stack: Vec<(i64, u64, u64)> = Vec::new();
    let mut thread = u32::MAX;
    for (i, s) in spans.iter().enumerate() {
        if s.thread != thread {
            thread = s.thread;
            stack.clear();
        }
        while stack.last().is_some_and(|&(end, _, _)| end <= s.start_ns) {
            stack.pop();
        }
        let seq = i as u64 + 1;
        let inherited = stack.iter().rev().map(|e| e.2).find(|&st| st != NO_STEP);
        let step = (s.step != NO_STEP)
            .then_some(s.step)
            .or(inherited)
            .unwrap_or(NO_STEP);
        let t = &mut d.spans;
        t.shared_columns().push(SharedFields {
            rank,
            name: s.name,
            step,
            start_ns: s.start_ns,
            thread: s.thread,
            depth: stack.len().min(u16::MAX as usize) as u16,
            parent: stack.last().map_or(0, |e| e.1),
        });
        t.dur_ns.push(s.dur_ns);
        t.seq.push(seq);
        t.pipeline
            .push(torch_pipelining::parse_action(&names[s.name as usize]).map(|(slot, _)| slot));
        stack.push((s.start_ns + s.dur_ns, seq, step));
    }
    // Profiler traces: spans on other threads of a step's time range get its step too.
    let mut steps: Vec<(i64, i64, u64)> = (0..d.spans.len())
        .filter(|&i| is_profiler_step(d.spans.name[i]))
        .map(|i| {
            let s = &d.spans;
            (s.start_ns[i], s.start_ns[i] + s.dur_ns[i], s.step[i])
        })
        .collect();
    steps.sort_unstable();
    if !steps.is_empty() {
        for i in 0..d.spans.len() {
            if d.spans.step[i] == NO_STEP {
                let t = d.spans.start_ns[i];
                let k = steps.partition_point(|s| s.0 <= t);
                if k > 0 && t < steps[k - 1].1 {
                    d.spans.step[i] = steps[k - 1].2;
                }
            }
        }
        for (st, ts) in [
            (&mut d.instants.step, &d.instants.start_ns),
            (&mut d.scalars.step, &d.scalars.start_ns),
        ] {
            for (s, &t) in st.iter_mut().zip(ts.iter()) {
                if *s == NO_STEP {
                    let k = steps.partition_point(|x| x.0 <= t);
                    if k > 0 && t < steps[k - 1].1 {
                        *s = steps[k - 1].2;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_x_b_e_i_and_m_events() {
        let trace = r#"{"traceEvents": [
          {"name": "process_name", "ph": "M", "pid": 5, "tid": 0, "args": {"name": "training.global_rank_1.20250101-000000-ABCDEF"}},
          {"name": "step", "ph": "X", "ts": 1000, "dur": 100.5, "pid": 5, "tid": 0, "args": {"step": 2}},
          {"name": "fwd_bwd", "ph": "B", "ts": 1010.25, "pid": 5, "tid": 0},
          {"name": "fwd_bwd", "ph": "E", "ts": 1060.25, "pid": 5, "tid": 0},
          {"name": "loss=2.5000", "ph": "i", "ts": 1070, "pid": 5, "tid": 0, "s": "t", "args": {"step": 2}},
          {"name": "ERROR: optim", "ph": "i", "ts": 1080, "pid": 5, "tid": 0, "s": "t", "args": {"step": 2}},
          {"name": "optim", "ph": "B", "ts": 1075, "pid": 5, "tid": 0}
        ]}"#;
        let p = parse(trace.as_bytes(), "t.json").unwrap();
        assert_eq!(p.parts.len(), 1);
        let d = &p.parts[0];
        assert_eq!(d.info.rank, 1);
        assert_eq!(d.spans.len(), 3);
        let by_name = |n: &str| {
            (0..d.spans.len())
                .find(|&i| d.names[d.spans.name[i] as usize] == n)
                .unwrap()
        };
        let f = by_name("fwd_bwd");
        assert_eq!(
            (d.spans.start_ns[f], d.spans.dur_ns[f]),
            (1_010_250, 50_000)
        );
        assert_eq!((d.spans.depth[f], d.spans.step[f]), (1, 2));
        assert_eq!(d.spans.dur_ns[by_name("step")], 100_500);
        assert_eq!(d.scalars.value, vec![2.5]);
        assert_eq!(d.names[d.scalars.name[0] as usize], "loss");
        assert_eq!(d.errors.rank.len(), 1);
        assert_eq!(p.open.len(), 1);
        assert_eq!(p.open[0].name, "optim");
        assert_eq!(p.open[0].shown_dur_ns, 25_500); // until the step span's end
    }

    #[test]
    fn profiler_steps_and_string_pids() {
        let trace = r#"[
          {"ph": "X", "name": "ProfilerStep#7", "pid": 42, "tid": 42, "ts": 0.0, "dur": 10.0},
          {"ph": "X", "name": "aten::mm", "pid": 42, "tid": 42, "ts": 1.0, "dur": 2.0},
          {"ph": "X", "name": "aten::mm", "pid": 42, "tid": 43, "ts": 4.0, "dur": 2.0},
          {"ph": "M", "name": "process_sort_index", "pid": "Spans", "tid": 0, "args": {"sort_index": 1}}
        ]"#;
        let p = parse(trace.as_bytes(), "t.json").unwrap();
        let d = &p.parts[0];
        assert_eq!(d.spans.step, vec![7, 7, 7]);
        assert_eq!(d.spans.depth, vec![0, 1, 0]);
    }
}
