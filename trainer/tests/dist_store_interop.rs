//! titan's TCPStore shim against torch.distributed.TCPStore from .venv, in both directions.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use titan_tests::{python, workspace_root};
use titan_train::dist::store::{StoreOptions, TcpStore};

fn script() -> PathBuf {
    workspace_root().join("tests/python/dist_store_peer.py")
}

fn exchange(store: &TcpStore) {
    store
        .set("titan/hello", b"hello from titan \x00\xff")
        .unwrap();
    assert_eq!(store.get("torch/reply").unwrap(), b"hello from torch");
    let after_torch = store.get_string("torch/counter_after_add").unwrap();
    assert_eq!(after_torch, "5");
    assert_eq!(store.add("shared/counter", 1).unwrap(), 6);
    store.set("titan/done", b"").unwrap();
}

#[test]
fn titan_client_talks_to_a_torch_tcpstore_server() {
    let mut py = Command::new(python())
        .arg(script())
        .arg("server")
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the .venv python");
    let mut lines = BufReader::new(py.stdout.take().unwrap()).lines();
    let port: u16 = lines.next().unwrap().unwrap().trim().parse().unwrap();
    let store = TcpStore::connect(&StoreOptions {
        host: "127.0.0.1".into(),
        port,
        is_server: false,
        num_workers: None,
        timeout: Duration::from_secs(30),
    })
    .unwrap();
    exchange(&store);
    assert_eq!(lines.next().unwrap().unwrap(), "ok");
    assert!(py.wait().unwrap().success());
}

#[test]
fn torch_client_talks_to_a_titan_tcpstore_server() {
    let store = TcpStore::connect(&StoreOptions {
        host: "127.0.0.1".into(),
        port: 0,
        is_server: true,
        num_workers: None,
        timeout: Duration::from_secs(30),
    })
    .unwrap();
    let py = Command::new(python())
        .arg(script())
        .args(["client", &store.port().to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the .venv python");
    exchange(&store);
    let out = py.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}
