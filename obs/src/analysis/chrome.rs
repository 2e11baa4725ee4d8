//! Chrome Trace Event JSON (what Perfetto and chrome://tracing open).
//!
//! One process per rank (`pid` = rank, named `rank R (host, source pid P)`), one track per
//! thread (`tid` = thread id, named after the thread), spans as complete (`X`) events so
//! nesting shows from time containment (parents are written before their children), point
//! events, step tags and errors as instant (`i`) events, scalars as counter (`C`) tracks.
//! Times are microseconds since the earliest record; streamed, never built in memory.
//!
//! The analysis `titan-obs summary` prints goes along: `otherData` holds its `stragglers` and
//! `waits`, and each collective span's args say how long that rank waited in it for later
//! ranks (`waited_ns`).

use std::io::Write;

use anyhow::{Result, bail};

use super::summary::{StragglerOptions, analyse};
use super::table::{RunShape, SpanTable};
use crate::record::NO_STEP;
use crate::run::Run;

/// What was written.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChromeStats {
    pub spans: u64,
    pub instants: u64,
    pub counters: u64,
    pub errors: u64,
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).expect("strings always serialise")
}

/// Writes the run (loaded with [`crate::Columns::ALL`]) as Chrome Trace Event JSON.
pub fn write_chrome(run: &Run, out: &mut dyn Write) -> Result<ChromeStats> {
    let sp = &run.spans;
    if sp.start_ns.len() != sp.len() || sp.thread.len() != sp.len() || sp.depth.len() != sp.len() {
        bail!("chrome export needs start, thread and nesting columns (load with Columns::ALL)");
    }
    let names: Vec<String> = run.names.iter().map(|n| json_str(n)).collect();
    let origin = sp
        .start_ns
        .iter()
        .chain(&run.instants.start_ns)
        .chain(&run.scalars.start_ns)
        .chain(&run.errors.start_ns)
        .copied()
        .min()
        .unwrap_or(0);
    let us = |t: i64| -> String {
        let d = t - origin;
        format!("{}.{:03}", d.div_euclid(1000), d.rem_euclid(1000))
    };
    let mut stats = ChromeStats::default();
    let analysis = analyse(
        &SpanTable::of_run(run),
        &RunShape::of_run(run),
        &StragglerOptions::default(),
    );
    out.write_all(b"{\"displayTimeUnit\":\"ms\",\"otherData\":{\"run\":")?;
    out.write_all(json_str(&run.location).as_bytes())?;
    write!(
        out,
        ",\"stragglers\":{},\"waits\":{}",
        serde_json::to_string(&analysis.stragglers)?,
        serde_json::to_string(&analysis.waits.table)?
    )?;
    out.write_all(b"},\"traceEvents\":[\n")?;
    let span_wait = &analysis.waits.span_wait;
    let mut first = true;
    let mut sep = |out: &mut dyn Write| -> std::io::Result<()> {
        if first {
            first = false;
            Ok(())
        } else {
            out.write_all(b",\n")
        }
    };

    // Metadata: process and thread names, ranks in order.
    for (rank, info) in &run.ranks {
        sep(out)?;
        let label = format!(
            "rank {rank} ({}, {} pid {})",
            info.host, info.source, info.pid
        );
        write!(
            out,
            "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{rank},\"tid\":0,\"args\":{{\"name\":{}}}}}",
            json_str(&label)
        )?;
        sep(out)?;
        write!(
            out,
            "{{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":{rank},\"tid\":0,\"args\":{{\"sort_index\":{rank}}}}}"
        )?;
        for (tid, tname) in &info.threads {
            sep(out)?;
            write!(
                out,
                "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{rank},\"tid\":{tid},\"args\":{{\"name\":{}}}}}",
                json_str(tname)
            )?;
        }
    }

    // Spans, parents before children: sort by (rank, thread, start, depth).
    let mut order: Vec<u32> = (0..sp.len() as u32).collect();
    order.sort_unstable_by_key(|&i| {
        let i = i as usize;
        (sp.rank[i], sp.thread[i], sp.start_ns[i], sp.depth[i])
    });
    for &i in &order {
        let i = i as usize;
        sep(out)?;
        write!(
            out,
            "{{\"name\":{},\"cat\":\"span\",\"ph\":\"X\",\"pid\":{},\"tid\":{},\"ts\":{},\"dur\":{}.{:03},\"args\":{{",
            names[sp.name[i] as usize],
            sp.rank[i],
            sp.thread[i],
            us(sp.start_ns[i]),
            sp.dur_ns[i].max(0) / 1000,
            sp.dur_ns[i].max(0) % 1000
        )?;
        if sp.step[i] != NO_STEP {
            write!(out, "\"step\":{},", sp.step[i])?;
            let tags = run.tag_names(sp.rank[i], sp.step[i]);
            if !tags.is_empty() {
                write!(out, "\"tags\":{},", serde_json::to_string(&tags)?)?;
            }
        }
        if let Some(Some(slot)) = sp.pipeline.get(i) {
            write!(
                out,
                "\"microbatch\":{},\"stage\":{},",
                slot.microbatch, slot.stage
            )?;
        }
        if let Ok(k) = span_wait.binary_search_by_key(&(i as u32), |w| w.0) {
            write!(out, "\"waited_ns\":{},", span_wait[k].1)?;
        }
        write!(out, "\"depth\":{}}}}}", sp.depth[i])?;
        stats.spans += 1;
    }
    drop(order);

    let ins = &run.instants;
    for i in 0..ins.rank.len() {
        sep(out)?;
        let tag = run.tag_id(run.name(ins.name[i])).is_some();
        write!(
            out,
            "{{\"name\":{},\"cat\":\"{}\",\"ph\":\"i\",\"s\":\"{}\",\"pid\":{},\"tid\":{},\"ts\":{}",
            names[ins.name[i] as usize],
            if tag { "step_tag" } else { "event" },
            if tag { "p" } else { "t" },
            ins.rank[i],
            ins.thread.get(i).copied().unwrap_or(0),
            us(ins.start_ns.get(i).copied().unwrap_or(origin))
        )?;
        if ins.step[i] != NO_STEP {
            write!(out, ",\"args\":{{\"step\":{}}}", ins.step[i])?;
        }
        out.write_all(b"}")?;
        stats.instants += 1;
    }

    let er = &run.errors;
    for i in 0..er.rank.len() {
        sep(out)?;
        write!(
            out,
            "{{\"name\":{},\"cat\":\"error\",\"ph\":\"i\",\"s\":\"t\",\"pid\":{},\"tid\":{},\"ts\":{},\"args\":{{\"message\":{}",
            json_str(&format!("error: {}", run.name(er.name[i]))),
            er.rank[i],
            er.thread.get(i).copied().unwrap_or(0),
            us(er.start_ns.get(i).copied().unwrap_or(origin)),
            json_str(er.message.get(i).map(String::as_str).unwrap_or(""))
        )?;
        if er.step[i] != NO_STEP {
            write!(out, ",\"step\":{}", er.step[i])?;
        }
        out.write_all(b"}}")?;
        stats.errors += 1;
    }

    let sc = &run.scalars;
    for i in 0..sc.rank.len() {
        if !sc.value[i].is_finite() {
            continue;
        }
        sep(out)?;
        write!(
            out,
            "{{\"name\":{},\"cat\":\"scalar\",\"ph\":\"C\",\"pid\":{},\"tid\":0,\"ts\":{},\"args\":{{\"value\":{}}}}}",
            names[sc.name[i] as usize],
            sc.rank[i],
            us(sc.start_ns.get(i).copied().unwrap_or(origin)),
            sc.value[i]
        )?;
        stats.counters += 1;
    }
    out.write_all(b"\n]}\n")?;
    Ok(stats)
}
