//! DCP native format throughput: writing and reading a 64 MiB two-rank checkpoint (plain and
//! zstd) and parsing a large `.metadata`.
//!
//! Compare with torch on the same files: `DCP_BENCH_KEEP=/tmp/dcpbench cargo bench -p titan-dcp --bench
//! dcp_native` leaves the checkpoints there, then
//! `.venv/bin/python tests/python/dcp_bench_torch.py /tmp/dcpbench` times torch's `dcp.load`
//! and `pickle.load` of the same files.

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use titan_dcp::Dtype;
use titan_dcp::pickle::Value;
use titan_dcp::{DcpReader, DcpWriter, FileKey, TensorChunk, WriteOptions};

const TENSORS: usize = 8;
const ROWS: u64 = 2048;
const COLS: u64 = 1024; // 8 MiB of f32 per tensor

fn data() -> Vec<u8> {
    (0..(ROWS * COLS) as usize * 4)
        .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[i % 4] & 0x3f)
        .collect()
}

fn write(dir: &Path, zstd: bool, data: &[u8]) {
    let opts = WriteOptions {
        zstd_level: zstd.then_some(3),
        fsync: false,
    };
    let mut w = DcpWriter::create(dir, opts).unwrap();
    let half = (ROWS / 2 * COLS * 4) as usize;
    for t in 0..TENSORS {
        let fqn = format!("layers.{t}.weight");
        for rank in 0..2u32 {
            let chunk = TensorChunk {
                fqn: &fqn,
                dtype: Dtype::F32,
                global_shape: &[ROWS, COLS],
                offsets: &[rank as u64 * ROWS / 2, 0],
                sizes: &[ROWS / 2, COLS],
                data: &data[rank as usize * half..(rank as usize + 1) * half],
            };
            w.add_tensor_chunk(FileKey { rank, k: 0 }, chunk).unwrap();
        }
    }
    w.add_object(FileKey::default(), "step", &Value::Int(1))
        .unwrap();
    w.finish().unwrap();
}

/// A checkpoint with many small tensors: `.metadata` parsing dominates.
fn write_many(dir: &Path) {
    let mut w = DcpWriter::create(dir, WriteOptions::default()).unwrap();
    for t in 0..5000 {
        let fqn = format!("model.layers.{}.block.{}.weight", t / 10, t % 10);
        let chunk = TensorChunk {
            fqn: &fqn,
            dtype: Dtype::BF16,
            global_shape: &[4],
            offsets: &[0],
            sizes: &[4],
            data: &[0u8; 8],
        };
        w.add_tensor_chunk(FileKey::default(), chunk).unwrap();
    }
    w.finish().unwrap();
}

fn bench(c: &mut Criterion) {
    let keep = std::env::var_os("DCP_BENCH_KEEP");
    let tmp = tempfile::tempdir().unwrap();
    let root = keep
        .as_ref()
        .map(Path::new)
        .unwrap_or(tmp.path())
        .to_path_buf();
    let data = data();
    let total = (TENSORS * data.len()) as u64;

    let mut g = c.benchmark_group("dcp_64MiB");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(total));
    for zstd in [false, true] {
        let name = if zstd { "zstd" } else { "plain" };
        let dir = root.join(name);
        g.bench_function(format!("write_{name}"), |b| {
            b.iter(|| write(&dir, zstd, &data))
        });
        write(&dir, zstd, &data);
        g.bench_function(format!("read_{name}"), |b| {
            b.iter(|| {
                let r = DcpReader::open(&dir).unwrap();
                for t in 0..TENSORS {
                    black_box(r.read_tensor(&format!("layers.{t}.weight")).unwrap());
                }
            })
        });
    }
    g.finish();

    let many = root.join("many");
    write_many(&many);
    let mut g = c.benchmark_group("dcp_metadata");
    g.sample_size(20);
    g.bench_function("open_5000_tensors", |b| {
        b.iter(|| black_box(DcpReader::open(&many).unwrap()))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
