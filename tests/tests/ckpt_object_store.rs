//! titan-ckpt on an S3-compatible object store: a local moto server (moto[server] from
//! requirements-dev.txt, `.venv/bin/moto_server`) started on a free port for the test. Inputs are
//! read with ranged GETs, outputs written with multipart uploads that complete only at the end.

use std::path::Path;
use std::process::Command;

use titan_tests::{MotoServer, dcp_hf_shard, run_ok as ok};

/// titan-ckpt (no progress bars) talking to `moto`.
fn ckpt(moto: &MotoServer) -> Command {
    let mut c = titan_tests::ckpt();
    moto.aws_env(&mut c);
    c
}

/// A dcp-hf shard of `entries` whose data bytes depend on `seed`.
fn shard(entries: &[(&str, &str, &[u64], &[u64])], seed: u64) -> Vec<u8> {
    dcp_hf_shard(entries, |i| ((i * 31 + seed * 7) % 253) as u8)
}

/// Two ranks: `big` (F32 [2048, 4096], 32 MiB, row-sharded: multipart-sized), `col` column-sharded, `n` int64.
fn fixture(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("shard-00001-model-00001-of-00001.safetensors"),
        shard(
            &[
                ("big", "F32", &[1024, 4096], &[0, 0]),
                ("col", "BF16", &[64, 50], &[0, 0]),
                ("n", "I64", &[5], &[0]),
            ],
            1,
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("shard-00002-model-00001-of-00001.safetensors"),
        shard(
            &[
                ("big", "F32", &[1024, 4096], &[1024, 0]),
                ("col", "BF16", &[64, 50], &[0, 50]),
            ],
            2,
        ),
    )
    .unwrap();
}

fn files_equal(a: &Path, b: &Path) {
    let mut names: Vec<_> = std::fs::read_dir(a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    let mut other: Vec<_> = std::fs::read_dir(b)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    other.sort();
    assert_eq!(names, other);
    for n in names {
        assert!(
            std::fs::read(a.join(&n)).unwrap() == std::fs::read(b.join(&n)).unwrap(),
            "{n:?} differs"
        );
    }
}

#[test]
fn consolidate_from_and_to_s3() {
    let moto = MotoServer::start("ckpt");
    let tmp = tempfile::tempdir().unwrap();
    let local_in = tmp.path().join("in");
    fixture(&local_in);
    moto.s3(&["put", local_in.to_str().unwrap(), "ckpt/in"]);

    // Reference: local to local.
    let reference = tmp.path().join("ref");
    ok(ckpt(&moto)
        .arg("consolidate")
        .arg(&local_in)
        .arg(&reference)
        .args(["--max-shard-size", "20MB"]));

    // inspect and verify read headers with ranged GETs.
    let o = ok(ckpt(&moto).args(["inspect", "s3://ckpt/ckpt/in", "--json"]));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "dcp-hf");
    assert_eq!(v["parameter_count"], 2048 * 4096 + 64 * 100 + 5);

    // S3 -> S3: the 32 MiB file goes up as a multipart upload; index written last by rank 0.
    ok(ckpt(&moto).args([
        "consolidate",
        "s3://ckpt/ckpt/in",
        "s3://ckpt/ckpt/out",
        "--max-shard-size",
        "20MB",
    ]));
    let listed = moto.s3(&["ls", "ckpt/out"]);
    assert!(!listed.contains("UPLOAD-IN-PROGRESS"), "{listed}");
    let got = tmp.path().join("got");
    moto.s3(&["get", "ckpt/out", got.to_str().unwrap()]);
    files_equal(&reference, &got);
    ok(ckpt(&moto).args(["verify", "s3://ckpt/ckpt/out"]));

    // S3 -> local and local -> S3 agree too.
    let from_s3 = tmp.path().join("from_s3");
    ok(ckpt(&moto)
        .args(["consolidate", "s3://ckpt/ckpt/in"])
        .arg(&from_s3)
        .args(["--max-shard-size", "20MB"]));
    files_equal(&reference, &from_s3);
    ok(ckpt(&moto)
        .arg("diff")
        .arg(&reference)
        .arg("s3://ckpt/ckpt/out"));

    // DCP native to S3 (staged locally, `.metadata` uploaded last), read back from S3.
    ok(ckpt(&moto).args([
        "convert",
        "s3://ckpt/ckpt/in",
        "s3://ckpt/ckpt/dcp",
        "--to",
        "dcp",
        "--quiet",
    ]));
    let listed = moto.s3(&["ls", "ckpt/dcp"]);
    assert!(
        listed.contains(".metadata") && listed.contains("__0_0.distcp"),
        "{listed}"
    );
    ok(ckpt(&moto).args(["verify", "s3://ckpt/ckpt/dcp"]));
    ok(ckpt(&moto)
        .arg("diff")
        .arg(&reference)
        .arg("s3://ckpt/ckpt/dcp"));

    // Bad input on S3: a truncated shard fails with the URL named and leaves no object behind.
    let bad = tmp.path().join("bad");
    fixture(&bad);
    let p = bad.join("shard-00002-model-00001-of-00001.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() - 100]).unwrap();
    moto.s3(&["put", bad.to_str().unwrap(), "ckpt/bad"]);
    let o = ckpt(&moto)
        .args([
            "consolidate",
            "s3://ckpt/ckpt/bad",
            "s3://ckpt/ckpt/bad-out",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("s3://ckpt/ckpt/bad/shard-00002") && err.contains("truncated"),
        "{err}"
    );
    assert_eq!(moto.s3(&["ls", "ckpt/bad-out"]), "");
}
