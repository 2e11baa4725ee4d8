//! Bad input to titan-ckpt: each case must fail with a clear error naming the file (and tensor),
//! exit non-zero, and leave no output behind.

use std::path::Path;

use serde_json::json;
use titan_tests::{dcp_hf_shard, titan_ckpt};

/// A dcp-hf shard from (name, dtype, shape, saved_offsets) entries with patterned data.
fn shard(entries: &[(&str, &str, &[u64], &[u64])]) -> Vec<u8> {
    dcp_hf_shard(entries, |i| (i % 251) as u8)
}

fn with_header(json: &[u8], data_len: u64) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json);
    out.extend((0..data_len).map(|i| (i % 251) as u8));
    out
}

fn name(rank: u32) -> String {
    format!("shard-{rank:05}-model-00001-of-00001.safetensors")
}

/// A valid 2-rank checkpoint: w F32 [4, 3] row-sharded, b I64 [4] on rank 1.
fn good(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join(name(1)),
        shard(&[("w", "F32", &[2, 3], &[0, 0]), ("b", "I64", &[4], &[0])]),
    )
    .unwrap();
    std::fs::write(dir.join(name(2)), shard(&[("w", "F32", &[2, 3], &[2, 0])])).unwrap();
}

/// Runs `titan-ckpt consolidate IN OUT`; asserts failure, the message fragments, and no output.
fn fails(input: &Path, expect: &[&str]) -> String {
    let out = input.parent().unwrap().join("out");
    let o = titan_ckpt()
        .args(["--quiet", "consolidate"])
        .arg(input)
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "consolidate succeeded on bad input");
    assert!(matches!(o.status.code(), Some(1) | Some(2)), "{err}");
    for e in expect {
        assert!(err.contains(e), "`{e}` not in: {err}");
    }
    assert!(
        !out.exists() || std::fs::read_dir(&out).unwrap().next().is_none(),
        "partial output left in {}",
        out.display()
    );
    // verify agrees and exits 1.
    let v = titan_ckpt().arg("verify").arg(input).output().unwrap();
    assert_ne!(v.status.code(), Some(0), "verify passed bad input");
    err
}

fn case() -> (tempfile::TempDir, std::path::PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("in");
    good(&d);
    (t, d)
}

#[test]
fn the_good_fixture_consolidates() {
    let (_t, d) = case();
    let out = d.parent().unwrap().join("out");
    let o = titan_ckpt()
        .args(["--quiet", "consolidate"])
        .arg(&d)
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("model.safetensors").exists());
}

#[test]
fn truncated_file() {
    let (_t, d) = case();
    let p = d.join(name(2));
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 5]).unwrap();
    fails(&d, &[&name(2), "`w`", "truncated"]);
}

#[test]
fn header_length_past_the_file_or_over_the_limit() {
    let (_t, d) = case();
    let p = d.join(name(2));
    let mut b = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap());
    b[..8].copy_from_slice(&(n + 10_000).to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    fails(&d, &[&name(2), "past the end"]);
    b[..8].copy_from_slice(&200_000_000u64.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    fails(&d, &[&name(2), "limit"]);
}

#[test]
fn malformed_json() {
    let (_t, d) = case();
    std::fs::write(
        d.join(name(2)),
        with_header(br#"{"w": {"dtype": "F32", "shape": [2, 3]"#, 24),
    )
    .unwrap();
    fails(&d, &[&name(2), "malformed"]);
}

#[test]
fn offsets_out_of_range() {
    let (_t, d) = case();
    let h = json!({"w": {"dtype": "F32", "shape": [250], "data_offsets": [0, 1000]},
                   "__metadata__": {"DCP_SHARDING_INFO": "{\"w\": {\"saved_offsets\": [0]}}"}});
    std::fs::write(
        d.join(name(2)),
        with_header(&serde_json::to_vec(&h).unwrap(), 24),
    )
    .unwrap();
    fails(&d, &[&name(2), "`w`", "out of range"]);
}

#[test]
fn overlapping_offsets() {
    let (_t, d) = case();
    let h = json!({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                   "v": {"dtype": "F32", "shape": [2, 3], "data_offsets": [12, 36]},
                   "__metadata__": {"DCP_SHARDING_INFO": "{}"}});
    std::fs::write(
        d.join(name(2)),
        with_header(&serde_json::to_vec(&h).unwrap(), 36),
    )
    .unwrap();
    fails(&d, &[&name(2), "`v`", "overlap"]);
}

#[test]
fn dtype_disagreeing_between_shards() {
    let (_t, d) = case();
    std::fs::write(d.join(name(2)), shard(&[("w", "F16", &[2, 3], &[2, 0])])).unwrap();
    fails(
        &d,
        &[&name(2), &name(1), "`w`", "dtype F16 disagrees with F32"],
    );
}

#[test]
fn shape_disagreeing_between_shards() {
    let (_t, d) = case();
    std::fs::write(
        d.join(name(2)),
        shard(&[("w", "F32", &[2, 3, 1], &[2, 0, 0])]),
    )
    .unwrap();
    fails(&d, &[&name(2), "`w`", "different rank"]);
    // Same rank, wrong width: the chunks no longer tile the tensor.
    std::fs::write(d.join(name(2)), shard(&[("w", "F32", &[2, 2], &[2, 0])])).unwrap();
    fails(&d, &["`w`", "cover 10 of 12"]);
}

#[test]
fn missing_shard() {
    let (_t, d) = case();
    // Three ranks; rank 2's file is there but lacks its rows of `w`: a coverage gap.
    std::fs::write(d.join(name(2)), shard(&[("x", "F32", &[1], &[0])])).unwrap();
    std::fs::write(d.join(name(3)), shard(&[("w", "F32", &[2, 3], &[4, 0])])).unwrap();
    fails(&d, &["`w`", "cover 12 of 18", "missing", "[2, 0]"]);
    // A whole rank's file gone.
    std::fs::remove_file(d.join(name(2))).unwrap();
    fails(&d, &["rank(s) 00002", "missing"]);
}

#[test]
fn index_entry_leaving_the_directory() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path().join("in");
    std::fs::create_dir_all(&d).unwrap();
    // A real safetensors file outside the checkpoint that the index points at.
    let h = json!({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}});
    std::fs::write(
        t.path().join("outside.safetensors"),
        with_header(&serde_json::to_vec(&h).unwrap(), 8),
    )
    .unwrap();
    let idx = json!({"metadata": {"total_size": 8}, "weight_map": {"w": "../outside.safetensors"}});
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::to_vec(&idx).unwrap(),
    )
    .unwrap();
    let err = fails(
        &d,
        &[
            "model.safetensors.index.json",
            "`w`",
            "../outside.safetensors",
            "leaves",
        ],
    );
    assert!(!err.contains("panicked"));
    let abs = json!({"weight_map": {"w": t.path().join("outside.safetensors")}});
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::to_vec(&abs).unwrap(),
    )
    .unwrap();
    fails(&d, &["absolute"]);
}

#[test]
fn index_from_mapping_leaving_the_output_directory() {
    let (_t, d) = case();
    let idx = d.parent().unwrap().join("idx.json");
    std::fs::write(
        &idx,
        serde_json::to_vec(&json!({"weight_map": {"w": "../w.safetensors", "b": "b.safetensors"}}))
            .unwrap(),
    )
    .unwrap();
    let out = d.parent().unwrap().join("out");
    let o = titan_ckpt()
        .args(["--quiet", "consolidate"])
        .arg(&d)
        .arg(&out)
        .arg("--index-from")
        .arg(&idx)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("idx.json") && err.contains("../w.safetensors"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(!d.parent().unwrap().join("w.safetensors").exists());
}
