//! DCP native format against real torch 2.13: torch's `dcp.save` output read by titan-ckpt's
//! reader, and titan-ckpt's writer output loaded by `torch.distributed.checkpoint.load`.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value as Json;
use titan_dcp::Dtype;
use titan_dcp::pickle::Value;
use titan_dcp::tensor_item::{parse_tensor_item, write_tensor_item};
use titan_dcp::torch_zip::TorchZip;
use titan_dcp::{DcpReader, DcpWriter, FileKey, TensorChunk, WriteOptions};
use titan_tests::python_script;

/// torch's checkpoints, written once per test run by tests/python/dcp_torch_save.py.
fn torch_out() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = titan_tests::binary_subdir("dcp-torch");
        let out = python_script("tests/python/dcp_torch_save.py")
            .arg(&dir)
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "dcp_torch_save.py failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

fn ref_index(dir: &Path) -> Json {
    serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap()
}

/// A bytes item's unpickled value as JSON, for comparing with what Python wrote.
fn to_json(v: &Value) -> Json {
    match v {
        Value::None => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::from(*i),
        Value::Float(f) => Json::from(*f),
        Value::Str(s) => Json::from(s.clone()),
        Value::List(items) | Value::Tuple(items) => {
            Json::Array(items.iter().map(to_json).collect())
        }
        Value::Dict(items) => Json::Object(
            items
                .iter()
                .map(|(k, v)| (k.as_str().unwrap().to_string(), to_json(v)))
                .collect(),
        ),
        other => panic!("unexpected value in a bytes item: {other:?}"),
    }
}

fn check_against_ref(ckpt: &Path, refdir: &Path, all_tensors: bool) {
    let r = DcpReader::open(ckpt).unwrap();
    let index = ref_index(refdir);
    let mut seen = 0;
    for (fqn, t) in r.tensors() {
        let want = &index["tensors"][fqn];
        assert_eq!(t.properties.dtype.torch_name(), want["dtype"], "{fqn}");
        let shape: Vec<u64> = serde_json::from_value(want["shape"].clone()).unwrap();
        assert_eq!(t.size, shape, "{fqn}");
        let got = r.read_tensor(fqn).unwrap();
        let bytes = std::fs::read(refdir.join(format!("{fqn}.bin"))).unwrap();
        assert_eq!(got.data, bytes, "{}: {fqn} bytes differ", ckpt.display());
        seen += 1;
    }
    if all_tensors {
        assert_eq!(seen, index["tensors"].as_object().unwrap().len());
    }
    let objects = index["objects"].as_object().unwrap();
    let names: Vec<&str> = r.bytes_items().collect();
    assert_eq!(names.len(), objects.len(), "{names:?}");
    for (fqn, want) in objects {
        assert_eq!(&to_json(&r.read_object(fqn).unwrap()), want, "{fqn}");
    }
}

#[test]
fn torch_single_process_save_reads_back_exactly() {
    let out = torch_out();
    for name in ["single", "single_zstd"] {
        check_against_ref(&out.join(name), &out.join("ref"), true);
    }
}

#[test]
fn torch_zstd_items_carry_the_descriptor() {
    let out = torch_out();
    for (name, zstd) in [
        ("single", false),
        ("single_zstd", true),
        ("multi_zstd", true),
    ] {
        let r = DcpReader::open(out.join(name)).unwrap();
        for (idx, info) in &r.metadata().storage_data {
            let want = zstd.then(|| vec!["stream.zstd/1".to_string()]);
            assert_eq!(info.transform_descriptors, want, "{name}: {}", idx.fqn);
        }
    }
}

#[test]
fn torch_two_rank_dtensor_save_reads_back_exactly() {
    let out = torch_out();
    for name in ["multi", "multi_zstd"] {
        let dir = out.join(name);
        check_against_ref(&dir, &out.join("ref"), false);
        let r = DcpReader::open(&dir).unwrap();
        // Shard(0) of 5 rows over 2 ranks: chunks of 3 and 2 rows, in two rank files.
        let f32 = r.tensor("model.f32").unwrap();
        let boxes: Vec<_> = f32
            .chunks
            .iter()
            .map(|c| (c.offsets.clone(), c.sizes.clone()))
            .collect();
        assert_eq!(
            boxes,
            vec![(vec![0, 0], vec![3, 7]), (vec![3, 0], vec![2, 7])]
        );
        let files: std::collections::BTreeSet<_> = (0..2)
            .map(|i| r.chunk_location("model.f32", i).unwrap().relative_path)
            .collect();
        assert_eq!(files.len(), 2, "chunks come from both ranks' files");
        // Shard(1) of 7 columns: 4 + 3, each chunk read on its own.
        let c = r.read_chunk("model.i64", 1).unwrap();
        assert_eq!(
            (c.offsets.clone(), c.sizes.clone()),
            (vec![0, 4], vec![5, 3])
        );
        assert_eq!(c.dtype, Dtype::I64);
        let full = r.read_tensor("model.i64").unwrap();
        let col = |row: usize, col: usize| &full.data[(row * 7 + col) * 8..(row * 7 + col + 1) * 8];
        assert_eq!(&c.data[..8], col(0, 4));
        assert_eq!(&c.data[8..16], col(0, 5));
    }
}

#[test]
fn torch_save_views_are_gathered() {
    let items = torch_out().join("items");
    let index = ref_index(&items);
    for (name, meta) in index.as_object().unwrap() {
        let bytes = std::fs::read(items.join(format!("{name}.pt"))).unwrap();
        let layout = parse_tensor_item(&bytes).unwrap();
        assert_eq!(layout.dtype.torch_name(), meta["dtype"], "{name}");
        let shape: Vec<u64> = serde_json::from_value(meta["shape"].clone()).unwrap();
        assert_eq!(layout.shape, shape, "{name}");
        let want = std::fs::read(items.join(format!("{name}.bin"))).unwrap();
        assert_eq!(layout.read_data(&bytes).unwrap(), want, "{name}");
    }
    // The views really are views: offsets and strides that a naive reader would get wrong.
    let v = parse_tensor_item(&std::fs::read(items.join("view_offset.pt")).unwrap()).unwrap();
    assert_eq!(
        (v.storage_offset, v.stride.clone(), v.storage_numel),
        (10, vec![8, 1], 48)
    );
    assert!(v.contiguous_range().is_none());
}

#[test]
fn our_tensor_items_are_byte_identical_to_torch_save() {
    let items = torch_out().join("items");
    let index = ref_index(&items);
    let mut compared = 0;
    for (name, meta) in index.as_object().unwrap() {
        if meta["contiguous_whole_storage"] != Json::Bool(true) {
            continue;
        }
        let torch = std::fs::read(items.join(format!("{name}.pt"))).unwrap();
        let dtype = Dtype::from_torch_name(meta["dtype"].as_str().unwrap()).unwrap();
        let shape: Vec<u64> = serde_json::from_value(meta["shape"].clone()).unwrap();
        let data = std::fs::read(items.join(format!("{name}.bin"))).unwrap();
        let (ours, _) = write_tensor_item(Vec::new(), dtype, &shape, &data).unwrap();
        assert_eq!(ours.len(), torch.len(), "{name}: length");
        // Identical up to the random serialization id (its record, CRC and the directory after).
        let zip = TorchZip::parse(&torch).unwrap();
        let id = zip.record(".data/serialization_id").unwrap();
        let cut = torch[..id.data_offset as usize]
            .windows(4)
            .rposition(|w| w == b"PK\x03\x04")
            .unwrap();
        assert_eq!(
            ours[..cut],
            torch[..cut],
            "{name}: bytes before the serialization id"
        );
        compared += 1;
    }
    assert!(compared >= 8, "compared {compared} items");
}

fn write_ref(
    refdir: &Path,
    tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)],
    objects: &[(&str, Json)],
) {
    std::fs::create_dir_all(refdir).unwrap();
    let mut t = serde_json::Map::new();
    for (fqn, dtype, shape, data) in tensors {
        std::fs::write(refdir.join(format!("{fqn}.bin")), data).unwrap();
        t.insert(
            fqn.to_string(),
            serde_json::json!({"dtype": dtype.torch_name(), "shape": shape}),
        );
    }
    let o: serde_json::Map<String, Json> = objects
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let index = serde_json::json!({"tensors": t, "objects": o});
    std::fs::write(
        refdir.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
}

/// Deterministic test values of a dtype (valid bools: 0/1).
fn values(dtype: Dtype, numel: usize, seed: u8) -> Vec<u8> {
    let es = dtype.size();
    (0..numel * es)
        .map(|i| match dtype {
            Dtype::Bool => ((i as u8).wrapping_mul(7).wrapping_add(seed) >> 2) & 1,
            // Keep float exponents tame so NaN payload canonicalisation cannot interfere.
            Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::BF16 if i % es == es - 1 => {
                0x3e ^ (i as u8 & 1)
            }
            _ => (i as u8).wrapping_mul(31).wrapping_add(seed),
        })
        .collect()
}

/// The row-major bytes of the box `offsets .. offsets + sizes` of a full tensor.
fn slice_box(full: &[u8], shape: &[u64], offsets: &[u64], sizes: &[u64], es: usize) -> Vec<u8> {
    let strides: Vec<u64> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product())
        .collect();
    let numel: u64 = sizes.iter().product();
    let mut out = Vec::with_capacity(numel as usize * es);
    for flat in 0..numel {
        let mut rem = flat;
        let mut src = 0;
        for d in (0..shape.len()).rev() {
            let i = rem % sizes[d];
            rem /= sizes[d];
            src += (offsets[d] + i) * strides[d];
        }
        out.extend_from_slice(&full[src as usize * es..(src as usize + 1) * es]);
    }
    out
}

struct Spec {
    fqn: &'static str,
    dtype: Dtype,
    shape: Vec<u64>,
    /// (rank file, offsets, sizes) per chunk.
    chunks: Vec<(FileKey, Vec<u64>, Vec<u64>)>,
}

fn file(rank: u32, k: u32) -> FileKey {
    FileKey { rank, k }
}

fn specs(multi: bool) -> Vec<Spec> {
    let whole = |fqn, dtype, shape: Vec<u64>| {
        let z = vec![0; shape.len()];
        Spec {
            fqn,
            dtype,
            chunks: vec![(file(0, 0), z, shape.clone())],
            shape,
        }
    };
    if !multi {
        return vec![
            whole("model.f32", Dtype::F32, vec![5, 7]),
            whole("model.bf16", Dtype::BF16, vec![6, 4]),
            whole("model.f16", Dtype::F16, vec![3]),
            whole("model.i64", Dtype::I64, vec![4, 3]),
            whole("model.bool", Dtype::Bool, vec![9]),
            whole("model.u8", Dtype::U8, vec![2, 2, 2]),
            whole("model.scalar", Dtype::F32, vec![]),
            whole("model.empty", Dtype::F32, vec![0, 3]),
        ];
    }
    vec![
        Spec {
            fqn: "model.f32",
            dtype: Dtype::F32,
            shape: vec![5, 7],
            chunks: vec![
                (file(0, 0), vec![0, 0], vec![3, 7]),
                (file(1, 0), vec![3, 0], vec![2, 7]),
            ],
        },
        Spec {
            fqn: "model.bf16",
            dtype: Dtype::BF16,
            shape: vec![6, 4],
            chunks: vec![
                (file(0, 0), vec![0, 0], vec![6, 2]),
                (file(1, 0), vec![0, 2], vec![6, 2]),
            ],
        },
        Spec {
            fqn: "model.i64",
            dtype: Dtype::I64,
            shape: vec![5, 7],
            chunks: vec![
                (file(0, 1), vec![0, 0], vec![5, 4]),
                (file(1, 1), vec![0, 4], vec![5, 3]),
            ],
        },
        Spec {
            fqn: "model.bool",
            dtype: Dtype::Bool,
            shape: vec![5],
            chunks: vec![
                (file(0, 0), vec![0], vec![3]),
                (file(1, 0), vec![3], vec![2]),
            ],
        },
        Spec {
            fqn: "model.grid",
            dtype: Dtype::F16,
            shape: vec![4, 4],
            chunks: vec![
                (file(0, 0), vec![0, 0], vec![2, 2]),
                (file(0, 1), vec![0, 2], vec![2, 2]),
                (file(1, 0), vec![2, 0], vec![2, 2]),
                (file(1, 1), vec![2, 2], vec![2, 2]),
            ],
        },
        whole("model.scalar", Dtype::I32, vec![]),
    ]
}

fn write_with_ours(dir: &Path, refdir: &Path, multi: bool, zstd: bool) {
    let opts = WriteOptions {
        zstd_level: zstd.then_some(3),
        fsync: false,
    };
    let mut w = DcpWriter::create(dir, opts).unwrap();
    let mut reference = Vec::new();
    for (seed, s) in specs(multi).into_iter().enumerate() {
        let numel: u64 = s.shape.iter().product();
        let full = values(s.dtype, numel as usize, seed as u8);
        for (f, offsets, sizes) in &s.chunks {
            let data = slice_box(&full, &s.shape, offsets, sizes, s.dtype.size());
            let chunk = TensorChunk {
                fqn: s.fqn,
                dtype: s.dtype,
                global_shape: &s.shape,
                offsets,
                sizes,
                data: &data,
            };
            w.add_tensor_chunk(*f, chunk).unwrap();
        }
        reference.push((s.fqn, s.dtype, s.shape.clone(), full));
    }
    let objects = [
        ("step", Value::Int(4321), serde_json::json!(4321)),
        ("meta.lr", Value::Float(3e-4), serde_json::json!(3e-4)),
        (
            "meta.name",
            Value::str("titan ✓"),
            serde_json::json!("titan ✓"),
        ),
        (
            "meta.milestones",
            Value::List(vec![
                Value::Int(1),
                Value::Int(-2),
                Value::Int(5_000_000_000),
            ]),
            serde_json::json!([1, -2, 5_000_000_000i64]),
        ),
    ];
    for (i, (fqn, v, _)) in objects.iter().enumerate() {
        w.add_object(file(i as u32 % 2 * multi as u32, 0), fqn, v)
            .unwrap();
    }
    w.finish().unwrap();
    let objects: Vec<(&str, Json)> = objects.iter().map(|(k, _, j)| (*k, j.clone())).collect();
    write_ref(refdir, &reference, &objects);
}

#[test]
fn our_dcp_output_loads_in_torch() {
    let tmp = tempfile::tempdir().unwrap();
    for multi in [false, true] {
        for zstd in [false, true] {
            let name = format!(
                "ours_{}_{}",
                if multi { "multi" } else { "single" },
                if zstd { "zstd" } else { "plain" }
            );
            let dir = tmp.path().join(&name);
            let refdir = tmp.path().join(format!("{name}_ref"));
            write_with_ours(&dir, &refdir, multi, zstd);
            // Nothing temporary is left behind.
            for e in std::fs::read_dir(&dir).unwrap() {
                let n = e.unwrap().file_name().into_string().unwrap();
                assert!(
                    n == ".metadata" || (n.starts_with("__") && n.ends_with(".distcp")),
                    "{n}"
                );
            }
            // Our own reader agrees.
            check_against_ref(&dir, &refdir, true);
            let out = python_script("tests/python/dcp_torch_load.py")
                .arg(&dir)
                .arg(&refdir)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: torch could not load our checkpoint:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
