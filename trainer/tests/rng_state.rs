//! The CPU random generator state round-trips (its own process: libtorch's generator is global
//! and parallel tests in one process would draw from it concurrently).

use tch::{Device, Kind, Tensor};
use titan_train::rng::{cpu_state, set_cpu_state};

#[test]
fn restoring_the_state_replays_the_stream() {
    let state = cpu_state().unwrap();
    assert_eq!(
        state.len(),
        5056,
        "torch.get_rng_state() of the CPU generator"
    );
    let a = Tensor::randn([8], (Kind::Float, Device::Cpu));
    set_cpu_state(&state).unwrap();
    let b = Tensor::randn([8], (Kind::Float, Device::Cpu));
    assert!(a.equal(&b));
    assert!(set_cpu_state(&[1, 2, 3]).is_err());
}
