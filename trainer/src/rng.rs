//! libtorch's default CPU random generator state (`torch.get_rng_state()`'s bytes), saved in
//! checkpoints so a resumed run continues the same random stream.

use anyhow::{Result, bail};

unsafe extern "C" {
    fn titan_cpu_rng_get_state(out: *mut u8, cap: i64) -> i64;
    fn titan_cpu_rng_set_state(data: *const u8, n: i64) -> i32;
}

/// The CPU generator's state.
pub fn cpu_state() -> Result<Vec<u8>> {
    // SAFETY: a null buffer only asks for the size.
    let n = unsafe { titan_cpu_rng_get_state(std::ptr::null_mut(), 0) };
    if n < 0 {
        bail!("libtorch could not read the CPU random generator state");
    }
    let mut state = vec![0u8; n as usize];
    // SAFETY: `state` has room for `n` bytes; the state's size does not change between calls.
    let got = unsafe { titan_cpu_rng_get_state(state.as_mut_ptr(), n) };
    if got != n {
        bail!("libtorch's CPU random generator state changed size ({n} -> {got} bytes)");
    }
    Ok(state)
}

/// Restores a state from [`cpu_state`] (of the same libtorch version).
pub fn set_cpu_state(state: &[u8]) -> Result<()> {
    // SAFETY: the shim copies `state.len()` bytes from the slice.
    let rc = unsafe { titan_cpu_rng_set_state(state.as_ptr(), state.len() as i64) };
    if rc != 0 {
        bail!(
            "libtorch rejected a CPU random generator state of {} bytes (saved by another torch version?)",
            state.len()
        );
    }
    Ok(())
}
