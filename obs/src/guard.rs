//! The last line of defence against damaged files: decoding code from other crates (arrow's
//! IPC reader, the parquet reader) run so that a panic on bytes they did not expect becomes
//! an error naming what they said, for the caller to report with the file — not a crashed
//! analysis, and not a panic message on the user's terminal.
//!
//! Damage is checked before these decoders see it (`ipc_check.rs`, the journal's
//! checksums); this catches what those checks cannot know (a buffer length that does not fit
//! its column's type, say).

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

thread_local! {
    /// Set while this thread runs guarded code: its panics are reported by [`guarded`].
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    /// The message of the last panic in guarded code on this thread.
    static MESSAGE: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Installs (once) a panic hook that keeps quiet about panics inside [`guarded`] (recording
/// their message instead) and hands every other panic to the hook that was there before.
fn install_hook() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) {
                let what = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                let at = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                tracing::debug!("guarded decoder panicked: {what}{at}");
                MESSAGE.with(|m| *m.borrow_mut() = Some(what));
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs `f`; a panic inside it is returned as `Err(its message)`.
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    install_hook();
    let outer = GUARDED.with(|g| g.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(outer));
    result.map_err(|_| {
        MESSAGE
            .with(|m| m.borrow_mut().take())
            .unwrap_or_else(|| "a panic".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_is_an_error_with_its_message() {
        assert_eq!(guarded(|| 7), Ok(7));
        let e = guarded(|| -> u32 { panic!("offset past the end") }).unwrap_err();
        assert_eq!(e, "offset past the end");
        // Nested guards restore the outer state.
        let r = guarded(|| guarded(|| -> u8 { panic!("inner") }).unwrap_err());
        assert_eq!(r.as_deref(), Ok("inner"));
    }
}
