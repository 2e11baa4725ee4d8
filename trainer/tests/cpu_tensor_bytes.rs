//! The counting CPU allocator (`cpp/memory_shim.cpp`): the live and peak bytes of CPU tensors
//! that titan-train reports as `tensor_peak_gib` and checks the memory estimate against. Its own
//! process, so no other test's tensors come and go while it counts.

use tch::{Device, Kind, Tensor};
use titan_train::metrics::{count_cpu_tensor_bytes, cpu_tensor_bytes};

const MIB: u64 = 1 << 20;

#[test]
fn cpu_tensor_bytes_are_counted_live_and_at_their_peak() {
    count_cpu_tensor_bytes().unwrap();
    count_cpu_tensor_bytes().unwrap(); // idempotent
    let (before, _) = cpu_tensor_bytes();
    let kept = Tensor::ones([16 * MIB as i64], (Kind::Float, Device::Cpu));
    let (live, peak) = cpu_tensor_bytes();
    assert_eq!(live - before, 64 * MIB);
    assert_eq!(peak, live);
    // A transient tensor is gone from the live bytes but not from the peak, which then starts
    // again from the live bytes.
    let transient = Tensor::zeros([8 * MIB as i64], (Kind::Double, Device::Cpu));
    assert_eq!(transient.sum(Kind::Double).double_value(&[]), 0.0);
    drop(transient);
    let (after, peak) = cpu_tensor_bytes();
    assert_eq!(after, live);
    // (The sum's scalar result was alive with it: a few bytes more.)
    assert!(
        (live + 64 * MIB..live + 64 * MIB + 1024).contains(&peak),
        "{peak} vs {live}"
    );
    assert_eq!(cpu_tensor_bytes(), (live, live));
    // The memory is real memory: the values survive, and copies and views work.
    assert_eq!(kept.sum(Kind::Double).double_value(&[]), (16 * MIB) as f64);
    let copy = kept.narrow(0, 0, MIB as i64).copy();
    assert_eq!(cpu_tensor_bytes().0, live + 4 * MIB);
    drop((kept, copy));
    assert_eq!(cpu_tensor_bytes().0, before);
}
