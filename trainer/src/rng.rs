//! libtorch's default CPU random generator state (`torch.get_rng_state()`'s bytes), saved in
//! checkpoints so a resumed run continues the same random stream.

use anyhow::{Result, anyhow, bail};

unsafe extern "C" {
    fn titan_cpu_rng_get_state(
        out: *mut u8,
        cap: i64,
        size: *mut i64,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    fn titan_cpu_rng_set_state(data: *const u8, n: i64, err: *mut *mut std::ffi::c_char) -> i32;
}

/// The CPU generator's state.
pub fn cpu_state() -> Result<Vec<u8>> {
    let unreadable =
        |m: String| anyhow!("libtorch could not read the CPU random generator state: {m}");
    let mut n = 0i64;
    // SAFETY: a null buffer only asks for the size.
    crate::shim::call(|err| unsafe {
        titan_cpu_rng_get_state(std::ptr::null_mut(), 0, &mut n, err)
    })
    .map_err(unreadable)?;
    let mut state = vec![0u8; n as usize];
    let mut got = 0i64;
    // SAFETY: `state` has room for `n` bytes; the state's size does not change between calls.
    crate::shim::call(|err| unsafe {
        titan_cpu_rng_get_state(state.as_mut_ptr(), n, &mut got, err)
    })
    .map_err(unreadable)?;
    if got != n {
        bail!("libtorch's CPU random generator state changed size ({n} -> {got} bytes)");
    }
    Ok(state)
}

/// Restores a state from [`cpu_state`] (of the same libtorch version).
pub fn set_cpu_state(state: &[u8]) -> Result<()> {
    // SAFETY: the shim copies `state.len()` bytes from the slice.
    crate::shim::call(|err| unsafe {
        titan_cpu_rng_set_state(state.as_ptr(), state.len() as i64, err)
    })
    .map_err(|m| {
        anyhow!(
            "libtorch rejected a CPU random generator state of {} bytes (saved by another torch \
             version?): {m}",
            state.len()
        )
    })
}

/// Held by the unit tests that seed or draw from libtorch's one global generator: cargo runs a
/// crate's tests on several threads of one process, and a draw of one test landing between
/// another's `manual_seed` and its draws gives that test different numbers (a CI run saw
/// `one_process_runs_the_decoder_bit_for_bit` fail so).
#[cfg(test)]
pub(crate) fn global_generator() -> std::sync::MutexGuard<'static, ()> {
    static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that panicked holding it left nothing a reseed does not fix.
    GENERATOR.lock().unwrap_or_else(|e| e.into_inner())
}
