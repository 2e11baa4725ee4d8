//! The rendezvous key-value store: libtorch's c10d `TCPStore` through `cpp/tcpstore_shim.cpp`.
//!
//! Speaking torch's own store protocol means titan-train ranks can rendezvous through torchrun's
//! agent store (`TORCHELASTIC_USE_AGENT_STORE=True`), a store hosted by our own launcher, or one
//! hosted by rank 0, and Python tools can read the same keys.

use std::ffi::{CString, c_char};
use std::ptr;
use std::time::Duration;

/// What went wrong in a store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store operation `{op}` timed out: {message}")]
    Timeout { op: &'static str, message: String },
    #[error("store at {addr} unreachable or connection lost during `{op}`: {message}")]
    Network {
        op: &'static str,
        addr: String,
        message: String,
    },
    #[error("store operation `{op}` failed: {message}")]
    Other { op: &'static str, message: String },
    #[error("store key {0:?} contains a NUL byte")]
    BadKey(String),
}

#[repr(C)]
struct RawStore {
    _private: [u8; 0],
}

unsafe extern "C" {
    fn titan_store_new(
        host: *const c_char,
        port: u16,
        is_server: i32,
        num_workers: i64,
        wait_workers: i32,
        timeout_ms: i64,
        use_libuv: i32,
        out: *mut *mut RawStore,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_store_free(s: *mut RawStore);
    fn titan_store_free_buf(p: *mut std::ffi::c_void);
    fn titan_store_port(s: *const RawStore) -> u16;
    fn titan_store_set_timeout(s: *mut RawStore, timeout_ms: i64, err: *mut *mut c_char) -> i32;
    fn titan_store_set(
        s: *mut RawStore,
        key: *const c_char,
        value: *const u8,
        len: usize,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_store_get(
        s: *mut RawStore,
        key: *const c_char,
        value: *mut *mut u8,
        len: *mut usize,
        err: *mut *mut c_char,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn titan_store_compare_set(
        s: *mut RawStore,
        key: *const c_char,
        expected: *const u8,
        expected_len: usize,
        desired: *const u8,
        desired_len: usize,
        value: *mut *mut u8,
        len: *mut usize,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_store_add(
        s: *mut RawStore,
        key: *const c_char,
        delta: i64,
        result: *mut i64,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_store_delete(
        s: *mut RawStore,
        key: *const c_char,
        deleted: *mut i32,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_store_check(
        s: *mut RawStore,
        keys: *const *const c_char,
        n: usize,
        present: *mut i32,
        err: *mut *mut c_char,
    ) -> i32;
    fn titan_store_wait(
        s: *mut RawStore,
        keys: *const *const c_char,
        n: usize,
        timeout_ms: i64,
        err: *mut *mut c_char,
    ) -> i32;
}

/// How to reach (or host) a store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub host: String,
    /// 0 with `is_server` picks a free port; see [`TcpStore::port`].
    pub port: u16,
    pub is_server: bool,
    /// Clients expected by a server (`None`: unknown, do not wait).
    pub num_workers: Option<usize>,
    /// Connect timeout and the default timeout of blocking `get`/`wait`.
    pub timeout: Duration,
}

/// A connection to (and possibly the host of) a c10d TCPStore. Thread-safe: c10d serialises
/// operations on one client connection.
pub struct TcpStore {
    raw: *mut RawStore,
    addr: String,
}

// SAFETY: c10d::TCPStore guards its client socket with an internal mutex (`activeOpLock_`), and
// its server runs on its own thread; the handle may be used and dropped from any thread.
unsafe impl Send for TcpStore {}
unsafe impl Sync for TcpStore {}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn key_c(key: &str) -> Result<CString, StoreError> {
    CString::new(key).map_err(|_| StoreError::BadKey(key.to_string()))
}

/// Takes ownership of a malloc'd buffer from the shim.
unsafe fn take_buf(p: *mut u8, len: usize) -> Vec<u8> {
    if p.is_null() {
        return Vec::new();
    }
    // SAFETY: the shim malloc'd at least `len` bytes at `p`.
    let v = unsafe { std::slice::from_raw_parts(p, len) }.to_vec();
    unsafe { titan_store_free_buf(p.cast()) };
    v
}

impl TcpStore {
    /// Connects to the store (or starts it, with `is_server`), retrying until `timeout`.
    pub fn connect(opts: &StoreOptions) -> Result<TcpStore, StoreError> {
        let host =
            CString::new(opts.host.as_str()).map_err(|_| StoreError::BadKey(opts.host.clone()))?;
        let mut raw = ptr::null_mut();
        let mut err = ptr::null_mut();
        let num_workers = opts.num_workers.map(|n| n as i64).unwrap_or(-1);
        // SAFETY: valid C string and out-pointers; the shim catches all exceptions.
        let code = unsafe {
            titan_store_new(
                host.as_ptr(),
                opts.port,
                opts.is_server as i32,
                num_workers,
                0,
                millis(opts.timeout),
                1,
                &mut raw,
                &mut err,
            )
        };
        let addr = format!("{}:{}", opts.host, opts.port);
        if code != 0 {
            return Err(Self::error(code, err, "connect", &addr));
        }
        let mut store = TcpStore { raw, addr };
        store.addr = format!("{}:{}", opts.host, store.port());
        Ok(store)
    }

    /// The port the store listens on (the chosen one when started with port 0).
    pub fn port(&self) -> u16 {
        // SAFETY: `raw` is a live store.
        unsafe { titan_store_port(self.raw) }
    }

    /// `host:port` of the store.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn error(code: i32, err: *mut c_char, op: &'static str, addr: &str) -> StoreError {
        // SAFETY: the shim left null or a malloc'd message (cpp/shim_error.h), ours from here.
        let message = unsafe { crate::shim::take_message(err) }
            .map_or_else(|| "no message".to_string(), |m| m.trim().to_string());
        // c10d messages can carry a multi-line context; the first line says what happened.
        match code {
            2 => StoreError::Timeout { op, message },
            3 => StoreError::Network {
                op,
                addr: addr.to_string(),
                message,
            },
            _ => StoreError::Other { op, message },
        }
    }

    fn check_code(&self, code: i32, err: *mut c_char, op: &'static str) -> Result<(), StoreError> {
        if code == 0 {
            Ok(())
        } else {
            Err(Self::error(code, err, op, &self.addr))
        }
    }

    /// Sets the timeout of blocking `get` and of `wait` without an explicit timeout.
    pub fn set_timeout(&self, timeout: Duration) -> Result<(), StoreError> {
        let mut err = ptr::null_mut();
        // SAFETY: live store, valid out-pointer.
        let code = unsafe { titan_store_set_timeout(self.raw, millis(timeout), &mut err) };
        self.check_code(code, err, "set_timeout")
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let k = key_c(key)?;
        let mut err = ptr::null_mut();
        // SAFETY: valid key and value pointers for the duration of the call.
        let code =
            unsafe { titan_store_set(self.raw, k.as_ptr(), value.as_ptr(), value.len(), &mut err) };
        self.check_code(code, err, "set")
    }

    /// Gets a key, waiting for it to appear up to the store timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let k = key_c(key)?;
        let (mut p, mut len, mut err) = (ptr::null_mut(), 0usize, ptr::null_mut());
        // SAFETY: valid key and out-pointers.
        let code = unsafe { titan_store_get(self.raw, k.as_ptr(), &mut p, &mut len, &mut err) };
        self.check_code(code, err, "get")?;
        // SAFETY: on success the shim returned a malloc'd buffer of `len` bytes.
        Ok(unsafe { take_buf(p, len) })
    }

    /// Sets `key` to `desired` if it currently holds `expected` (an absent key matches an empty
    /// `expected`); returns the value the key holds afterwards.
    pub fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let k = key_c(key)?;
        let (mut p, mut len, mut err) = (ptr::null_mut(), 0usize, ptr::null_mut());
        // SAFETY: valid pointers for the duration of the call.
        let code = unsafe {
            titan_store_compare_set(
                self.raw,
                k.as_ptr(),
                expected.as_ptr(),
                expected.len(),
                desired.as_ptr(),
                desired.len(),
                &mut p,
                &mut len,
                &mut err,
            )
        };
        self.check_code(code, err, "compare_set")?;
        // SAFETY: on success the shim returned a malloc'd buffer of `len` bytes.
        Ok(unsafe { take_buf(p, len) })
    }

    /// Atomically adds `delta` to the integer at `key` (absent: 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let k = key_c(key)?;
        let (mut out, mut err) = (0i64, ptr::null_mut());
        // SAFETY: valid key and out-pointers.
        let code = unsafe { titan_store_add(self.raw, k.as_ptr(), delta, &mut out, &mut err) };
        self.check_code(code, err, "add")?;
        Ok(out)
    }

    pub fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let k = key_c(key)?;
        let (mut out, mut err) = (0i32, ptr::null_mut());
        // SAFETY: valid key and out-pointers.
        let code = unsafe { titan_store_delete(self.raw, k.as_ptr(), &mut out, &mut err) };
        self.check_code(code, err, "delete")?;
        Ok(out != 0)
    }

    /// Whether all `keys` exist (does not wait).
    pub fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let owned = keys
            .iter()
            .map(|k| key_c(k))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
        let (mut out, mut err) = (0i32, ptr::null_mut());
        // SAFETY: `ptrs` points into `owned`, alive for the call.
        let code =
            unsafe { titan_store_check(self.raw, ptrs.as_ptr(), ptrs.len(), &mut out, &mut err) };
        self.check_code(code, err, "check")?;
        Ok(out != 0)
    }

    /// Waits until all `keys` exist, up to `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let owned = keys
            .iter()
            .map(|k| key_c(k))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|k| k.as_ptr()).collect();
        let mut err = ptr::null_mut();
        // SAFETY: `ptrs` points into `owned`, alive for the call.
        let code = unsafe {
            titan_store_wait(
                self.raw,
                ptrs.as_ptr(),
                ptrs.len(),
                millis(timeout),
                &mut err,
            )
        };
        self.check_code(code, err, "wait")
    }

    /// Gets a key as UTF-8 text.
    pub fn get_string(&self, key: &str) -> Result<String, StoreError> {
        let v = self.get(key)?;
        String::from_utf8(v).map_err(|_| StoreError::Other {
            op: "get",
            message: format!("value of {key:?} is not UTF-8"),
        })
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        // SAFETY: `raw` came from titan_store_new and is freed exactly once.
        unsafe { titan_store_free(self.raw) };
    }
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn server() -> TcpStore {
        TcpStore::connect(&StoreOptions {
            host: "127.0.0.1".into(),
            port: 0,
            is_server: true,
            num_workers: None,
            timeout: Duration::from_secs(10),
        })
        .unwrap()
    }

    pub(crate) fn client(port: u16) -> TcpStore {
        TcpStore::connect(&StoreOptions {
            host: "127.0.0.1".into(),
            port,
            is_server: false,
            num_workers: None,
            timeout: Duration::from_secs(10),
        })
        .unwrap()
    }

    #[test]
    fn set_get_add_check_between_server_and_client() {
        let s = server();
        assert_ne!(s.port(), 0);
        let c = client(s.port());
        s.set("a", b"hello").unwrap();
        assert_eq!(c.get("a").unwrap(), b"hello");
        assert_eq!(c.add("n", 3).unwrap(), 3);
        assert_eq!(s.add("n", 4).unwrap(), 7);
        assert!(c.check(&["a", "n"]).unwrap());
        assert!(!c.check(&["a", "missing"]).unwrap());
        assert!(c.delete("a").unwrap());
        assert!(!s.check(&["a"]).unwrap());
        // An absent key matches an empty expected value: first writer wins.
        assert_eq!(c.compare_set("first", b"", b"rank 1").unwrap(), b"rank 1");
        assert_eq!(s.compare_set("first", b"", b"rank 0").unwrap(), b"rank 1");
        // Empty values round-trip.
        c.set("empty", b"").unwrap();
        assert_eq!(s.get("empty").unwrap(), b"");
    }

    #[test]
    fn get_of_missing_key_times_out_with_a_timeout_error() {
        let s = server();
        s.set_timeout(Duration::from_millis(200)).unwrap();
        let t0 = std::time::Instant::now();
        let err = s.get("never").unwrap_err();
        assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        let err = s.wait(&["never"], Duration::from_millis(100)).unwrap_err();
        assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    }

    #[test]
    fn connecting_to_a_closed_port_fails_within_the_timeout() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let t0 = std::time::Instant::now();
        let err = TcpStore::connect(&StoreOptions {
            host: "127.0.0.1".into(),
            port,
            is_server: false,
            num_workers: None,
            timeout: Duration::from_millis(1500),
        })
        .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(10), "{err}");
    }
}
