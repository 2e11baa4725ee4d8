//! all_reduce bus bandwidth of the cpu backend (busbw as nccl-tests defines it:
//! algbw * 2 (n-1) / n, algbw = bytes / time), on 2 and 4 local ranks, for 1 MB .. 256 MB of f32,
//! against two loopback bounds measured in the same run: single-stream TCP loopback throughput
//! and memcpy bandwidth. Medians of several timed iterations after a warm-up.
//!
//! `cargo bench -p titan-train --bench dist_allreduce [-- --ranks 2,4 --max-mb 256 --iters 5]`
//! Prints a table, and one JSON line per row with `--json`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use titan_train::distributed::launch::{LaunchArgs, LogRanks, run};
use titan_train::distributed::{CommOptions, Dist, LaunchEnv, ReduceOp};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn sizes(max_mb: usize) -> Vec<usize> {
    let mut out = vec![];
    let mut mb = 1;
    while mb <= max_mb {
        out.push(mb << 20);
        mb *= 4;
    }
    out
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Rank side: time all_reduce per size; rank 0 prints one line per size.
fn worker(args: &[String]) {
    let max_mb: usize = arg(args, "--max-mb", 256);
    let iters: usize = arg(args, "--iters", 5);
    let segment: usize = arg(args, "--segment-kb", 512) << 10;
    let env = LaunchEnv::from_process_env().unwrap();
    let mut opts = CommOptions::default();
    opts.socket.segment_bytes = segment;
    let dist = Dist::init(env, opts).unwrap();
    let mut g = dist.world_group().unwrap();
    let n = dist.world_size() as f64;
    for bytes in sizes(max_mb) {
        let t = Tensor::ones([(bytes / 4) as i64], (Kind::Float, Device::Cpu));
        g.all_reduce(&t, ReduceOp::Sum).unwrap();
        let mut times = vec![];
        for _ in 0..iters {
            g.barrier().unwrap();
            let t0 = Instant::now();
            g.all_reduce(&t, ReduceOp::Sum).unwrap();
            times.push(t0.elapsed().as_secs_f64());
        }
        // The slowest rank defines the collective's time.
        let med = median(times);
        let worst = dist_max(&mut *g, med);
        if dist.rank() == 0 {
            let path = std::env::var("TITAN_BENCH_OUT").unwrap();
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .unwrap();
            writeln!(f, "{} {} {}", n as usize, bytes, worst).unwrap();
        }
    }
}

fn dist_max(g: &mut dyn titan_train::distributed::Collectives, v: f64) -> f64 {
    let t = Tensor::from_slice(&[v]);
    g.all_reduce(&t, ReduceOp::Max).unwrap();
    t.double_value(&[0])
}

/// Single-stream TCP loopback throughput (GB/s): one thread writes, one reads.
fn tcp_loopback(bytes: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let writer = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let buf = vec![1u8; 4 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(buf.len());
            s.write_all(&buf[..n]).unwrap();
            left -= n;
        }
    });
    let (mut s, _) = l.accept().unwrap();
    let mut buf = vec![0u8; 4 << 20];
    let t0 = Instant::now();
    let mut got = 0;
    while got < bytes {
        got += s.read(&mut buf).unwrap();
    }
    let dt = t0.elapsed().as_secs_f64();
    writer.join().unwrap();
    bytes as f64 / dt / 1e9
}

fn memcpy_bw(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    std::hint::black_box(&dst);
    bytes as f64 / t0.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if std::env::var_os("RANK").is_some() {
        return worker(&args);
    }
    let ranks: String = arg(&args, "--ranks", "2,4".to_string());
    let max_mb: usize = arg(&args, "--max-mb", 256);
    let iters: usize = arg(&args, "--iters", 5);
    let json = args.iter().any(|a| a == "--json");
    let tcp = median((0..3).map(|_| tcp_loopback(256 << 20)).collect());
    let mem = median((0..3).map(|_| memcpy_bw(256 << 20)).collect());
    println!(
        "bounds: single-stream TCP loopback {tcp:.2} GB/s, memcpy {mem:.2} GB/s (256 MB, median of 3)"
    );
    println!(
        "{:>5} {:>9} {:>10} {:>10} {:>10} {:>9}",
        "ranks", "size", "time_ms", "algbw", "busbw", "busbw/tcp"
    );
    let exe = std::env::current_exe().unwrap();
    let out_path =
        std::env::temp_dir().join(format!("titan-bench-allreduce-{}", std::process::id()));
    let _ = std::fs::remove_file(&out_path);
    // SAFETY: single-threaded at this point; the ranks inherit it.
    unsafe { std::env::set_var("TITAN_BENCH_OUT", &out_path) };
    for n in ranks.split(',').map(|r| r.parse::<usize>().unwrap()) {
        let launch = LaunchArgs {
            nproc_per_node: n,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            log_ranks: LogRanks::Only(vec![0]),
            grace: Duration::from_secs(3),
        };
        let mut child_args: Vec<std::ffi::OsString> = vec!["--bench".into()];
        for (k, v) in [
            ("--max-mb", max_mb.to_string()),
            ("--iters", iters.to_string()),
        ] {
            child_args.push(k.into());
            child_args.push(v.into());
        }
        if let Some(i) = args.iter().position(|a| a == "--segment-kb") {
            child_args.push("--segment-kb".into());
            child_args.push(args[i + 1].clone().into());
        }
        let out = run(&launch, &exe, &child_args).unwrap();
        assert_eq!(out.exit_code, 0, "{:?}", out.failure);
    }
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    for line in text.lines() {
        let v: Vec<f64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        let (n, bytes, secs) = (v[0], v[1], v[2]);
        let algbw = bytes / secs / 1e9;
        let busbw = algbw * 2.0 * (n - 1.0) / n;
        if json {
            println!(
                "{{\"ranks\":{n},\"bytes\":{bytes},\"time_s\":{secs:.6},\"algbw_gbps\":{algbw:.3},\"busbw_gbps\":{busbw:.3},\"tcp_loopback_gbps\":{tcp:.3},\"memcpy_gbps\":{mem:.3}}}"
            );
        } else {
            println!(
                "{:>5} {:>7}MB {:>10.2} {:>8.2}GB/s {:>6.2}GB/s {:>9.2}",
                n,
                bytes / (1 << 20) as f64,
                secs * 1e3,
                algbw,
                busbw,
                busbw / tcp
            );
        }
    }
}
