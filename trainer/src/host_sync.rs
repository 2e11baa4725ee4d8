//! Every read of a tensor's value to the host in the training loop goes through here, and is
//! counted; copies the other way ([`upload`]) go through here too, so that they do not wait.
//!
//! On a GPU such a read waits for every kernel queued before it: the host stops running ahead
//! and its own costs (data, launches, logging) are no longer hidden behind GPU work. torchtitan
//! reads the loss and the gradient norm only on the steps it logs, and so does titan-train: the
//! loop records this count per step (`trainer/host_syncs`, see [`take`]), `titan-obs summary`
//! reports it, and a test holds it at 0 on the steps that do not log. On a CPU a "sync" is only
//! a read, but it is counted the same, so the figure says what a GPU run would do.

use std::sync::atomic::{AtomicU64, Ordering};

use tch::Tensor;

/// Reads since the last [`take`], over every thread of the process (FSDP's and the pipeline's
/// background threads read through here too).
static READS: AtomicU64 = AtomicU64::new(0);

/// The titan-obs scalar the loop records each step's count under (max over ranks).
pub const SCALAR: &str = titan_obs_core::vocab::titan::HOST_SYNCS;

fn counted(why: &'static str) {
    READS.fetch_add(1, Ordering::Relaxed);
    tracing::trace!(why, "host sync");
}

/// The value of the one-element tensor `t` as an f64, read to the host (`why` says what for,
/// in trace logs).
pub fn read_f64(t: &Tensor, why: &'static str) -> f64 {
    counted(why);
    t.double_value(&[])
}

/// The value of the one-element tensor `t` as an i64, read to the host.
pub fn read_i64(t: &Tensor, why: &'static str) -> i64 {
    counted(why);
    t.int64_value(&[])
}

/// The values of the 1-D tensor `t` as f64s, read to the host in one copy.
pub fn read_f64s(t: &Tensor, why: &'static str) -> Vec<f64> {
    counted(why);
    Vec::<f64>::try_from(
        &t.to_kind(tch::Kind::Double)
            .to_device(tch::Device::Cpu)
            .reshape([-1]),
    )
    .unwrap_or_default()
}

/// `t` copied to host memory (a CPU tensor is returned as it is, uncounted): from a CUDA
/// device this waits for the kernels that write `t`, as gloo's staging of CUDA tensors does
/// (the cpu backend's collectives on CUDA tensors).
pub fn to_host(t: &Tensor, why: &'static str) -> Tensor {
    if t.device() == tch::Device::Cpu {
        return t.shallow_clone();
    }
    counted(why);
    t.to_device(tch::Device::Cpu)
}

/// `values` as a tensor of `shape` on `device`: the other direction, which must not wait
/// either. On CUDA it goes from pinned host memory with a non-blocking copy (a copy from
/// pageable memory waits for the GPU's queue, so the host could not run ahead of it); libtorch's
/// pinned-memory pool keeps the host buffer until the copy has run. Not counted: it does not
/// wait.
pub fn upload<T: tch::kind::Element>(values: &[T], shape: &[i64], device: tch::Device) -> Tensor {
    let host = Tensor::from_slice(values).view(shape);
    if device.is_cuda() {
        host.pin_memory(device)
            .to_device_(device, host.kind(), true, false)
    } else {
        host
    }
}

/// The reads since the last call, and starts counting again from 0.
pub fn take() -> u64 {
    READS.swap(0, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_counted_and_taken() {
        // Other tests of this binary may read concurrently: count only what this one adds.
        let before = READS.load(Ordering::Relaxed);
        let t = Tensor::from_slice(&[2.5f64]);
        assert_eq!(read_f64(&t, "test"), 2.5);
        assert_eq!(read_i64(&Tensor::from_slice(&[7i64]), "test"), 7);
        assert_eq!(
            read_f64s(&Tensor::from_slice(&[1.0f32, 2.0]), "test"),
            [1.0, 2.0]
        );
        assert!(READS.load(Ordering::Relaxed) >= before + 3);
        take();
    }
}
