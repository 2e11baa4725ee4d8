//! torchtitan 0.3.0's structured-logger JSONL, one file per process, parsed incrementally.
//!
//! Each line is one record written by `TraceJsonlFormatter` (jsonl_handler.py). Lines are
//! deserialized into a struct of borrowed fields (no `serde_json::Value` tree; unknown fields
//! are skipped), so a line costs one pass over its bytes. A [`FileCursor`] remembers how far
//! its file was read and the spans still open, so `--follow` parses only appended bytes.
//!
//! Pairing follows torchtitan's gantt_generator: `_start`/`_end` records pair LIFO per
//! `task_name` within a file (one file = one process); the duration is the `_end`'s `value`
//! (ms, from `perf_counter`), the start time the `_start`'s `time_us` (the host's wall
//! clock). An `_error` record comes before its span's `_end`. An `_end` without a `_start`
//! (a file that begins mid-span) starts at its own time minus its duration, as torchtitan's
//! gantt does. Spans never closed are reported by [`FileCursor::open_spans`].

use std::borrow::Cow;
use std::collections::HashMap;

use serde::Deserialize;

use crate::footer::PartHeader;
use crate::record::NO_STEP;
use crate::run::{BadLine, LoadReport, OpenSpan};
use crate::schema::Reduce;
use crate::tables::{PartData, RankInfo, RecordTable, SharedFields, Spans, intern};
use crate::vocab::torchtitan as tt;

/// The fields titan-obs uses of one record; the rest (`caller`, `delta_ms`, ...) are skipped.
#[derive(Deserialize)]
struct Line<'a> {
    #[serde(borrow, default)]
    log_type: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    log_type_name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    event_name: Option<Cow<'a, str>>,
    #[serde(default)]
    step: Option<u64>,
    #[serde(borrow, default)]
    step_tags: Option<Vec<Cow<'a, str>>>,
    #[serde(default)]
    time_us: Option<i64>,
    #[serde(default)]
    time_ms: Option<i64>,
    #[serde(default)]
    value: Option<f64>,
    #[serde(borrow, default)]
    task_name: Option<Cow<'a, str>>,
    #[serde(default)]
    seq_id: Option<u64>,
    #[serde(default)]
    global_rank: Option<u32>,
    #[serde(default)]
    local_rank: Option<u32>,
    #[serde(borrow, default)]
    source: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    host_name: Option<Cow<'a, str>>,
    #[serde(default)]
    pid: Option<u32>,
    #[serde(borrow, default)]
    message: Option<Cow<'a, str>>,
}

/// A `_start` waiting for its `_end`.
#[derive(Debug, Clone)]
struct Pending {
    name: u32,
    step: u64,
    start_ns: i64,
    seq: u64,
    depth: u16,
    parent: u64,
}

impl Pending {
    /// Appends the span this `_start` opened, ending `dur_ns` later, in `step`.
    fn push_span(&self, t: &mut Spans, rank: u32, thread: u32, step: u64, dur_ns: i64) {
        t.shared_columns().push(SharedFields {
            rank,
            name: self.name,
            step,
            start_ns: self.start_ns,
            thread,
            depth: self.depth,
            parent: self.parent,
        });
        t.dur_ns.push(dur_ns);
        t.seq.push(self.seq);
    }
}

/// Read state of one structured-log file.
#[derive(Debug, Clone)]
pub struct FileCursor {
    /// Path or URL, for messages.
    pub display: String,
    pub rank: u32,
    /// Bytes consumed: always the end of a complete line.
    pub offset: u64,
    /// Lines consumed.
    pub lines: u64,
    /// Distinguishes this file's span ids from another file of the same rank (a restart).
    file_ix: u64,
    /// Open spans per thread (0 = no asyncio task, then one per task name).
    stacks: Vec<Vec<Pending>>,
    tasks: HashMap<String, u32>,
    /// File-wide name and tag dictionaries (each increment's [`PartData`] gets a copy).
    names: Vec<String>,
    name_ids: HashMap<String, u32>,
    tags: Vec<String>,
    tag_ids: HashMap<String, u32>,
    /// Time of the latest record (open spans are drawn up to it).
    last_ns: i64,
    info: Option<RankInfo>,
}

/// What one increment parsed.
#[derive(Debug, Default, Clone, Copy)]
pub struct Parsed {
    pub bytes: u64,
    pub lines: u64,
}

impl FileCursor {
    pub fn new(display: String, rank: u32, file_ix: u64) -> Self {
        FileCursor {
            display,
            rank,
            offset: 0,
            lines: 0,
            file_ix,
            stacks: vec![Vec::new()],
            tasks: HashMap::new(),
            names: Vec::new(),
            name_ids: HashMap::new(),
            tags: Vec::new(),
            tag_ids: HashMap::new(),
            last_ns: i64::MIN,
            info: None,
        }
    }

    /// Parses `bytes` (the file's content from [`Self::offset`] on). Complete lines are
    /// consumed; a last line without its newline is left for the next call unless `at_end`
    /// (nothing more will be written): then it is parsed if complete, or reported as a
    /// truncated tail. Returns the records as a [`PartData`] for [`crate::run::Merger`].
    pub fn parse(
        &mut self,
        bytes: &[u8],
        at_end: bool,
        report: &mut LoadReport,
    ) -> (PartData, Parsed) {
        let first = self.info.is_none();
        let mut out = PartData::default();
        let mut pos = 0usize;
        let mut lines = 0u64;
        while pos < bytes.len() {
            let (line, next, complete) = match memchr::memchr(b'\n', &bytes[pos..]) {
                Some(i) => (&bytes[pos..pos + i], pos + i + 1, true),
                None => (&bytes[pos..], bytes.len(), false),
            };
            if !complete && !at_end {
                break;
            }
            let line_no = self.lines + lines + 1;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if !line.iter().all(u8::is_ascii_whitespace) {
                match serde_json::from_slice::<Line<'_>>(line) {
                    Ok(rec) => {
                        if let Err(e) = self.record(&rec, &mut out) {
                            report.add_bad_line(BadLine {
                                file: self.display.clone(),
                                line: line_no,
                                error: e,
                            });
                        }
                    }
                    Err(_) if !complete => {
                        report.truncated_tails.push(self.display.clone());
                    }
                    Err(e) => report.add_bad_line(BadLine {
                        file: self.display.clone(),
                        line: line_no,
                        error: format!("not a JSON record: {e}"),
                    }),
                }
            }
            lines += 1;
            pos = next;
        }
        self.offset += pos as u64;
        self.lines += lines;
        out.rows = lines as usize;
        out.names.clone_from(&self.names);
        out.tags.clone_from(&self.tags);
        out.info = self.info.clone().unwrap_or_else(|| RankInfo {
            header: PartHeader {
                rank: self.rank,
                ..Default::default()
            },
            parts: 0,
        });
        out.info.threads = self.thread_names();
        out.info.parts = usize::from(first && self.info.is_some());
        (
            out,
            Parsed {
                bytes: pos as u64,
                lines,
            },
        )
    }

    fn thread_names(&self) -> std::collections::BTreeMap<u32, String> {
        let mut t: std::collections::BTreeMap<u32, String> =
            self.tasks.iter().map(|(k, &v)| (v, k.clone())).collect();
        t.insert(0, "main".into());
        t
    }

    fn intern_name(&mut self, name: &str) -> u32 {
        intern(&mut self.names, &mut self.name_ids, name)
    }

    fn thread_of(&mut self, task: Option<&str>) -> u32 {
        let Some(task) = task else { return 0 };
        if let Some(&t) = self.tasks.get(task) {
            return t;
        }
        let t = self.stacks.len() as u32;
        self.stacks.push(Vec::new());
        self.tasks.insert(task.to_string(), t);
        t
    }

    /// Unique span id within the run's rank (file index in the high bits).
    fn span_id(&self, seq_id: u64) -> u64 {
        (self.file_ix << 40) | ((seq_id + 1) & ((1 << 40) - 1))
    }

    fn record(&mut self, r: &Line<'_>, out: &mut PartData) -> Result<(), String> {
        let name = r
            .log_type_name
            .as_deref()
            .ok_or("no `log_type_name` (not a structured-logger record)")?;
        let time_ns = match (r.time_us, r.time_ms) {
            (Some(us), _) => us.saturating_mul(1000),
            (None, Some(ms)) => ms.saturating_mul(1_000_000),
            _ => return Err("no `time_us` or `time_ms`".into()),
        };
        if self.info.is_none() {
            self.info = Some(RankInfo {
                header: PartHeader {
                    rank: r.global_rank.unwrap_or(self.rank),
                    source: r.source.as_deref().unwrap_or_default().to_string(),
                    host: r.host_name.as_deref().unwrap_or_default().to_string(),
                    pid: r.pid.unwrap_or(0),
                    local_rank: r.local_rank.unwrap_or(0),
                    ..Default::default()
                },
                parts: 0,
            });
        }
        self.last_ns = self.last_ns.max(time_ns);
        let step = r.step.unwrap_or(NO_STEP);
        if let Some(tags) = &r.step_tags
            && step != NO_STEP
            && !tags.is_empty()
        {
            let mut mask = 0u64;
            for t in tags {
                let id = intern(&mut self.tags, &mut self.tag_ids, t);
                if id < 64 {
                    mask |= 1 << id;
                }
            }
            *out.step_tags.entry(step).or_default() |= mask;
        }
        let seq = self.span_id(r.seq_id.unwrap_or(self.lines));
        let rank = self.rank;
        let instant = r.log_type.as_deref() == Some(tt::LOG_TYPE_INSTANT);
        if instant && name == tt::METRIC_VALUE {
            let scalar = r
                .event_name
                .as_deref()
                .ok_or("`metric_value` without `event_name`")?;
            let id = self.intern_name(scalar);
            let t = &mut out.scalars;
            t.shared_columns().push(SharedFields {
                rank,
                name: id,
                step,
                start_ns: time_ns,
                ..Default::default()
            });
            t.value.push(r.value.unwrap_or(f64::NAN));
            t.reduce.push(Reduce::Mean);
            return Ok(());
        }
        let thread = self.thread_of(r.task_name.as_deref());
        if !instant && let Some(base) = name.strip_suffix(tt::START_SUFFIX) {
            let id = self.intern_name(base);
            let stack = &mut self.stacks[thread as usize];
            let parent = stack.last().map_or(0, |p| p.seq);
            let depth = stack.len() as u16;
            stack.push(Pending {
                name: id,
                step,
                start_ns: time_ns,
                seq,
                depth,
                parent,
            });
        } else if !instant && let Some(base) = name.strip_suffix(tt::END_SUFFIX) {
            let dur_ns = r.value.map_or(0, ms_to_ns);
            let p = match self.stacks[thread as usize].pop() {
                Some(p) => p,
                None => {
                    let depth = self.stacks[thread as usize].len() as u16;
                    Pending {
                        name: self.intern_name(base),
                        step,
                        start_ns: time_ns - dur_ns,
                        seq,
                        depth,
                        parent: 0,
                    }
                }
            };
            let step = if p.step != NO_STEP { p.step } else { step };
            p.push_span(&mut out.spans, rank, thread, step, dur_ns);
        } else if !instant && let Some(base) = name.strip_suffix(tt::ERROR_SUFFIX) {
            let id = self.intern_name(base);
            let parent = self.stacks[thread as usize].last().map_or(0, |p| p.seq);
            let t = &mut out.errors;
            t.shared_columns().push(SharedFields {
                rank,
                name: id,
                step,
                start_ns: time_ns,
                thread,
                depth: 0,
                parent,
            });
            t.message
                .push(r.message.as_deref().unwrap_or_default().to_string());
        } else {
            let id = self.intern_name(name);
            let depth = self.stacks[thread as usize].len() as u16;
            let parent = self.stacks[thread as usize].last().map_or(0, |p| p.seq);
            out.instants.shared_columns().push(SharedFields {
                rank,
                name: id,
                step,
                start_ns: time_ns,
                thread,
                depth,
                parent,
            });
        }
        Ok(())
    }

    /// The spans still open, as spans lasting until this file's last record, for a snapshot
    /// of the run (they stay open in the cursor: a later `_end` closes them).
    pub fn open_spans(&self) -> (PartData, Vec<OpenSpan>) {
        let mut out = PartData {
            names: self.names.clone(),
            tags: self.tags.clone(),
            info: self.info.clone().unwrap_or_default(),
            ..Default::default()
        };
        out.info.rank = self.rank;
        out.info.parts = 0;
        out.info.threads = self.thread_names();
        let mut open = Vec::new();
        for (thread, stack) in self.stacks.iter().enumerate() {
            for p in stack {
                let dur = (self.last_ns - p.start_ns).max(0);
                p.push_span(&mut out.spans, self.rank, thread as u32, p.step, dur);
                open.push(OpenSpan {
                    file: self.display.clone(),
                    rank: self.rank,
                    name: self.names[p.name as usize].clone(),
                    step: (p.step != NO_STEP).then_some(p.step),
                    start_ns: p.start_ns,
                    shown_dur_ns: dur,
                });
            }
        }
        (out, open)
    }
}

/// torchtitan logs durations as float milliseconds.
fn ms_to_ns(ms: f64) -> i64 {
    (ms * 1e6).round() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(fields: &str) -> String {
        format!(
            "{{\"delta_ms\": 0.1, \"tid\": 7, \"rank\": 0, \"global_rank\": 0, \"local_rank\": 0, \"source\": \"training\", \"host_name\": \"h\", \"pid\": 7, {fields}, \"caller\": \"x.py:1:f\"}}\n"
        )
    }

    #[test]
    fn pairs_nested_spans_and_keeps_partial_lines() {
        let mut text = String::new();
        text += &line(
            r#""step": 1, "time_us": 1000, "log_type": "event", "log_type_name": "step_start", "seq_id": 0"#,
        );
        text += &line(
            r#""step": 1, "time_us": 1100, "log_type": "event", "log_type_name": "fwd_bwd_start", "seq_id": 1"#,
        );
        text += &line(
            r#""step": 1, "time_us": 1600, "log_type": "event", "log_type_name": "fwd_bwd_end", "value": 0.5, "seq_id": 2"#,
        );
        let tail = line(
            r#""step": 1, "step_tags": ["gc"], "time_us": 2000, "log_type": "event", "log_type_name": "step_end", "value": 1.0, "seq_id": 3"#,
        );
        let cut = tail.len() / 2;
        text += &tail[..cut];
        let mut c = FileCursor::new("f.jsonl".into(), 0, 0);
        let mut report = LoadReport::default();
        let (d, p) = c.parse(text.as_bytes(), false, &mut report);
        assert_eq!(p.lines, 3);
        assert_eq!(d.spans.len(), 1);
        assert_eq!(d.names[d.spans.name[0] as usize], "fwd_bwd");
        assert_eq!(
            (d.spans.start_ns[0], d.spans.dur_ns[0]),
            (1_100_000, 500_000)
        );
        assert_eq!((d.spans.depth[0], d.spans.parent[0]), (1, c.span_id(0)));
        let (open, named) = c.open_spans();
        assert_eq!(open.spans.len(), 1);
        assert_eq!(named[0].name, "step");
        assert_eq!(named[0].shown_dur_ns, 600_000);
        // The rest of the cut line arrives.
        let (d, p) = c.parse(tail.as_bytes(), false, &mut report);
        assert_eq!(p.lines, 1);
        assert_eq!(d.spans.len(), 1);
        assert_eq!(d.step_tags[&1], 1);
        assert_eq!(report.malformed_lines, 0);
        assert!(c.open_spans().1.is_empty());
    }

    #[test]
    fn malformed_and_truncated_lines_are_reported() {
        let mut text = line(
            r#""time_us": 1000, "log_type": "instant", "log_type_name": "training_start", "seq_id": 0"#,
        );
        text += "{not json\n";
        text += r#"{"time_us": 5, "log_type": "ins"#;
        let mut c = FileCursor::new("f.jsonl".into(), 3, 0);
        let mut report = LoadReport::default();
        let (d, _) = c.parse(text.as_bytes(), true, &mut report);
        assert_eq!(d.instants.rank.len(), 1);
        assert_eq!(report.malformed_lines, 1);
        assert_eq!(report.bad_lines[0].line, 2);
        assert_eq!(report.truncated_tails, vec!["f.jsonl".to_string()]);
    }
}
