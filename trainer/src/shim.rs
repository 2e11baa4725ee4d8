//! The Rust side of the C++ shims' one error convention (`cpp/shim_error.h`): a call returns 0,
//! or non-zero with a malloc'd NUL-terminated message in `*err`, freed by whoever receives it.
//! Rust receives it from the shims' entry points ([`call`], [`take_message`]) and hands it to the
//! shims from its callbacks ([`set_message`]).

use std::ffi::{CStr, c_char};

/// Calls a shim entry point with its error slot; the shim's message on failure.
pub(crate) fn call(f: impl FnOnce(*mut *mut c_char) -> i32) -> Result<(), String> {
    let mut err: *mut c_char = std::ptr::null_mut();
    let rc = f(&mut err);
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the shim left null or a malloc'd message in the slot, ours from here on.
    Err(unsafe { take_message(err) }
        .unwrap_or_else(|| format!("failed (code {rc}) without a message")))
}

/// The message a shim left in an error slot, freed here; `None` when it left none.
///
/// # Safety
/// `err` is null or a malloc'd NUL-terminated string nobody else uses or frees.
pub(crate) unsafe fn take_message(err: *mut c_char) -> Option<String> {
    if err.is_null() {
        return None;
    }
    // SAFETY: per the contract above.
    let message = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: malloc'd by the shim, not used after this.
    unsafe { libc::free(err.cast()) };
    Some(message)
}

/// Hands `message` to a C++ caller through its error slot, as a malloc'd copy it frees.
///
/// # Safety
/// `err` points at a writable error slot.
pub(crate) unsafe fn set_message(err: *mut *mut c_char, message: &str) {
    let bytes = message.as_bytes();
    let bytes = &bytes[..bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len())];
    // SAFETY: a fresh allocation of len + 1 bytes, filled before it is handed over.
    unsafe {
        let p = libc::malloc(bytes.len() + 1).cast::<c_char>();
        if !p.is_null() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), p, bytes.len());
            *p.add(bytes.len()) = 0;
        }
        *err = p;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_cross_both_ways_and_are_freed() {
        let mut slot: *mut c_char = std::ptr::null_mut();
        // SAFETY: a local slot; the message is taken (and freed) once.
        unsafe { set_message(&mut slot, "region panicked: boom") };
        assert_eq!(
            unsafe { take_message(slot) }.as_deref(),
            Some("region panicked: boom")
        );
        assert_eq!(unsafe { take_message(std::ptr::null_mut()) }, None);
        assert_eq!(call(|_| 0), Ok(()));
        let failed = call(|err| {
            // SAFETY: `call` passes a writable slot.
            unsafe { set_message(err, "no storage") };
            1
        });
        assert_eq!(failed, Err("no storage".to_string()));
        assert_eq!(
            call(|_| 3),
            Err("failed (code 3) without a message".to_string())
        );
    }
}
