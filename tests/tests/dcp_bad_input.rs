//! DCP native format: hostile, truncated and corrupt input gives clear errors naming the file and
//! the item, never a panic, and the writer leaves nothing half-written.

use std::io::Read;
use std::path::Path;

use titan_dcp::Dtype;
use titan_dcp::metadata::{
    ChunkStorageMetadata, ItemMetadata, Metadata, MetadataIndex, PlannerData, StorageInfo,
    TensorProperties, TensorStorageMetadata,
};
use titan_dcp::pickle::Value;
use titan_dcp::torch_zip::ZipWriter;
use titan_dcp::transform::Encoder;
use titan_dcp::{DcpReader, DcpWriter, FileKey, TensorChunk, WriteOptions, write_metadata_file};

const W: [u8; 64] = {
    let mut a = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        a[i] = i as u8;
        i += 1;
    }
    a
};

/// A two-rank checkpoint: `w` is a 4x4 f32 split into two row blocks, plus a bytes item.
fn good_ckpt(dir: &Path, zstd: bool) {
    let opts = WriteOptions {
        zstd_level: zstd.then_some(3),
        fsync: false,
    };
    let mut w = DcpWriter::create(dir, opts).unwrap();
    for rank in 0..2u32 {
        let off = rank as u64 * 2;
        let data = &W[rank as usize * 32..rank as usize * 32 + 32];
        let chunk = TensorChunk {
            fqn: "w",
            dtype: Dtype::F32,
            global_shape: &[4, 4],
            offsets: &[off, 0],
            sizes: &[2, 4],
            data,
        };
        w.add_tensor_chunk(FileKey { rank, k: 0 }, chunk).unwrap();
    }
    w.add_object(FileKey::default(), "step", &Value::Int(9))
        .unwrap();
    w.finish().unwrap();
}

fn err_string<T>(r: Result<T, titan_dcp::DcpError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// A checkpoint whose tensor `t` (one f32) is stored as the raw item bytes given.
fn ckpt_with_item(dir: &Path, relative_path: &str, item: &[u8], descriptors: Option<Vec<String>>) {
    std::fs::create_dir_all(dir).unwrap();
    // Only plain names are created; hostile paths must never be written to.
    if titan_ckpt::storage::check_relative(relative_path, "test").is_ok() {
        std::fs::write(dir.join(relative_path), item).unwrap();
    }
    let md = Metadata {
        state_dict_metadata: vec![(
            "t".into(),
            ItemMetadata::Tensor(TensorStorageMetadata {
                properties: TensorProperties::new(Dtype::F32),
                size: vec![1],
                chunks: vec![ChunkStorageMetadata {
                    offsets: vec![0],
                    sizes: vec![1],
                }],
            }),
        )],
        planner_data: PlannerData::None,
        storage_data: vec![(
            MetadataIndex {
                fqn: "t".into(),
                offset: Some(vec![0]),
                index: Some(0),
            },
            StorageInfo {
                relative_path: relative_path.into(),
                offset: 0,
                length: item.len() as u64,
                transform_descriptors: descriptors,
            },
        )],
        storage_meta: None,
        version: Some("1.0.0".into()),
    };
    write_metadata_file(dir, &md, false).unwrap();
}

#[test]
fn disallowed_global_in_metadata_names_the_global_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let marker = tmp.path().join("pwned");
    // pickle.dumps of an object whose __reduce__ is (os.system, ("touch <marker>",)).
    let cmd = format!("touch {}", marker.display());
    let mut p = b"\x80\x02cos\nsystem\nq\x00X".to_vec();
    p.extend_from_slice(&(cmd.len() as u32).to_le_bytes());
    p.extend_from_slice(cmd.as_bytes());
    p.extend_from_slice(b"\x85q\x01Rq\x02.");
    std::fs::write(tmp.path().join(".metadata"), &p).unwrap();
    let msg = err_string(DcpReader::open(tmp.path()));
    assert!(msg.contains("os.system"), "{msg}");
    assert!(msg.contains(".metadata"), "{msg}");
    assert!(msg.contains("disallowed global"), "{msg}");
    assert!(!marker.exists(), "nothing may run");
}

#[test]
fn disallowed_global_in_a_tensor_item_names_global_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let mut z = ZipWriter::new(Vec::new(), "archive");
    z.add_record(
        "data.pkl",
        b"\x80\x02cbuiltins\neval\nq\x00X\x01\x00\x00\x001\x85R.",
    )
    .unwrap();
    z.add_record("data/0", &[0u8; 4]).unwrap();
    let (item, _) = z.finish().unwrap();
    ckpt_with_item(tmp.path(), "__0_0.distcp", &item, None);
    let r = DcpReader::open(tmp.path()).unwrap();
    let msg = err_string(r.read_tensor("t"));
    assert!(msg.contains("builtins.eval"), "{msg}");
    assert!(msg.contains("__0_0.distcp"), "{msg}");
    assert!(msg.contains("tensor `t`"), "{msg}");
}

#[test]
fn truncated_metadata_is_an_error_at_every_length() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    good_ckpt(&good, false);
    let bytes = std::fs::read(good.join(".metadata")).unwrap();
    let bad = tmp.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    for cut in 0..bytes.len() {
        std::fs::write(bad.join(".metadata"), &bytes[..cut]).unwrap();
        let msg = err_string(DcpReader::open(&bad));
        assert!(msg.contains(".metadata"), "cut {cut}: {msg}");
    }
    // Flipped bytes: an error or (rarely) a still-valid pickle, never a panic.
    for at in 0..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x5a;
        std::fs::write(bad.join(".metadata"), &b).unwrap();
        let _ = DcpReader::open(&bad).map(|r| r.read_tensor("w"));
    }
}

#[test]
fn corrupt_and_truncated_items_name_the_file_and_tensor() {
    for zstd in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        good_ckpt(tmp.path(), zstd);
        let r = DcpReader::open(tmp.path()).unwrap();
        let loc = r.chunk_location("w", 1).unwrap();
        assert_eq!(loc.relative_path, "__1_0.distcp");
        let path = tmp.path().join("__1_0.distcp");
        let good = std::fs::read(&path).unwrap();

        if !zstd {
            // Flip a value byte: the CRC catches it.
            let (start, _) = loc.layout.unwrap().contiguous_range().unwrap();
            let mut bad = good.clone();
            bad[(loc.item_offset + start) as usize] ^= 1;
            std::fs::write(&path, &bad).unwrap();
            let msg = err_string(r.read_tensor("w"));
            assert!(msg.contains("CRC"), "{msg}");
            assert!(
                msg.contains("__1_0.distcp") && msg.contains("tensor `w`"),
                "{msg}"
            );
        }
        // Truncate the data file.
        std::fs::write(&path, &good[..good.len() / 2]).unwrap();
        let msg = err_string(r.read_tensor("w"));
        assert!(msg.contains("__1_0.distcp"), "{msg}");
        assert!(msg.contains("tensor `w`"), "{msg}");
        // Remove it: the missing shard is named.
        std::fs::remove_file(&path).unwrap();
        let msg = err_string(r.read_tensor("w"));
        assert!(msg.contains("__1_0.distcp"), "{msg}");
        // The other rank's chunk and the bytes item still read.
        assert_eq!(r.read_chunk("w", 0).unwrap().data, W[..32]);
        assert_eq!(r.read_object("step").unwrap(), Value::Int(9));
    }
}

#[test]
fn storage_paths_that_leave_the_checkpoint_are_refused() {
    for path in ["../evil.distcp", "/etc/passwd", "a/../../x.distcp"] {
        let tmp = tempfile::tempdir().unwrap();
        ckpt_with_item(tmp.path(), path, b"whatever", None);
        let msg = err_string(DcpReader::open(tmp.path()));
        assert!(msg.contains("outside the checkpoint"), "{path}: {msg}");
        assert!(msg.contains(".metadata"), "{msg}");
    }
}

#[test]
fn coverage_gaps_and_bad_chunks_in_metadata_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    good_ckpt(tmp.path(), false);
    let r = DcpReader::open(tmp.path()).unwrap();
    let mut md = r.metadata().clone();
    let ItemMetadata::Tensor(t) = &mut md.state_dict_metadata[0].1 else {
        panic!()
    };
    t.chunks.pop();
    let gap = tempfile::tempdir().unwrap();
    for f in ["__0_0.distcp", "__1_0.distcp"] {
        std::fs::copy(tmp.path().join(f), gap.path().join(f)).unwrap();
    }
    write_metadata_file(gap.path(), &md, false).unwrap();
    let msg = err_string(DcpReader::open(gap.path()).unwrap().read_tensor("w"));
    assert!(
        msg.contains("tensor `w`") && msg.contains("missing"),
        "{msg}"
    );

    // A chunk outside the tensor.
    let ItemMetadata::Tensor(t) = &mut md.state_dict_metadata[0].1 else {
        panic!()
    };
    t.chunks[0].sizes = vec![9, 4];
    write_metadata_file(gap.path(), &md, false).unwrap();
    let msg = err_string(DcpReader::open(gap.path()));
    assert!(
        msg.contains("tensor `w`") && msg.contains("outside"),
        "{msg}"
    );
}

#[test]
fn zstd_bombs_and_unknown_transforms_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // 200 MB of zeros compress to a few KB; the chunk needs 4 bytes.
    let mut enc = Encoder::new(Vec::new(), Some(3)).unwrap();
    std::io::copy(&mut std::io::repeat(0).take(200 << 20), &mut enc).unwrap();
    let bomb = enc.finish().unwrap();
    ckpt_with_item(
        tmp.path(),
        "__0_0.distcp",
        &bomb,
        Some(vec!["stream.zstd/1".into()]),
    );
    let msg = err_string(DcpReader::open(tmp.path()).unwrap().read_tensor("t"));
    assert!(
        msg.contains("more than") && msg.contains("tensor `t`"),
        "{msg}"
    );

    let tmp = tempfile::tempdir().unwrap();
    ckpt_with_item(
        tmp.path(),
        "__0_0.distcp",
        b"x",
        Some(vec!["stream.rot13/1".into()]),
    );
    let msg = err_string(DcpReader::open(tmp.path()).unwrap().read_tensor("t"));
    assert!(msg.contains("stream.rot13/1"), "{msg}");
}

#[test]
fn writer_refuses_inconsistent_chunks_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = DcpWriter::create(tmp.path(), WriteOptions::default()).unwrap();
    let chunk = |offsets: &'static [u64], dtype, data: &'static [u8]| TensorChunk {
        fqn: "w",
        dtype,
        global_shape: &[4, 4],
        offsets,
        sizes: &[2, 4],
        data,
    };
    w.add_tensor_chunk(FileKey::default(), chunk(&[0, 0], Dtype::F32, &W[..32]))
        .unwrap();
    let msg = w
        .add_tensor_chunk(FileKey::default(), chunk(&[2, 0], Dtype::BF16, &W[..16]))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("tensor `w`") && msg.contains("bfloat16"),
        "{msg}"
    );
    let msg = w
        .add_tensor_chunk(FileKey::default(), chunk(&[3, 0], Dtype::F32, &W[..32]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("outside"), "{msg}");
    let msg = w
        .add_tensor_chunk(FileKey::default(), chunk(&[2, 0], Dtype::F32, &W[..31]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("needs 32 bytes"), "{msg}");
    // Only half of `w` was written: finishing fails and leaves no files at all.
    let msg = w.finish().unwrap_err().to_string();
    assert!(
        msg.contains("tensor `w`") && msg.contains("missing"),
        "{msg}"
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");

    // Dropping an unfinished writer leaves nothing either.
    let mut w = DcpWriter::create(tmp.path(), WriteOptions::default()).unwrap();
    w.add_bytes(FileKey::default(), "x", b"123").unwrap();
    drop(w);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}
