//! Opening a ring's TCP connections: each rank listens, publishes its address in the store,
//! connects to the next rank and accepts the previous one (checked by a handshake, so a stray
//! connection from another job is refused rather than trusted).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::comm::CommError;
use super::store::TcpStore;

const MAGIC: &[u8; 8] = b"TITANRNG";

/// Socket-level settings of the cpu backend.
#[derive(Debug, Clone)]
pub struct SocketOptions {
    /// A peer making no progress for this long fails the collective (and connection setup).
    pub timeout: Duration,
    /// Pipelining granularity of the ring algorithms.
    pub segment_bytes: usize,
    /// SO_SNDBUF / SO_RCVBUF (0: kernel autotuning).
    pub socket_buffer_bytes: usize,
    /// The address other ranks reach this one at (default: the interface that routes to the
    /// store's host; `TITAN_COMM_HOST` overrides).
    pub host: Option<String>,
}

impl Default for SocketOptions {
    fn default() -> Self {
        SocketOptions {
            timeout: Duration::from_secs(100),
            segment_bytes: 512 << 10,
            socket_buffer_bytes: 4 << 20,
            host: None,
        }
    }
}

/// The address this rank advertises: loopback when the store is on this machine's loopback,
/// else the local address of the route to the store's host (no packet is sent).
pub fn advertise_host(store_host: &str) -> String {
    if let Ok(h) = std::env::var("TITAN_COMM_HOST")
        && !h.is_empty()
    {
        return h;
    }
    let target = (store_host, 9)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next());
    match target {
        Some(addr) if addr.ip().is_loopback() => addr.ip().to_string(),
        Some(addr) => {
            let probe = if addr.is_ipv4() {
                "0.0.0.0:0"
            } else {
                "[::]:0"
            };
            UdpSocket::bind(probe)
                .and_then(|s| s.connect(addr).and_then(|_| s.local_addr()))
                .map(|a| a.ip().to_string())
                .unwrap_or_else(|_| "127.0.0.1".into())
        }
        None => "127.0.0.1".into(),
    }
}

fn set_buffer_sizes(stream: &TcpStream, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: valid socket fd and a c_int option value.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

fn configure(stream: &TcpStream, opts: &SocketOptions) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(opts.timeout))?;
    stream.set_write_timeout(Some(opts.timeout))?;
    set_buffer_sizes(stream, opts.socket_buffer_bytes);
    Ok(())
}

/// A stable tag of a group name, so connections of different groups never mix.
fn tag(name: &str) -> u64 {
    // FNV-1a: stable across processes (unlike std's randomised hasher).
    name.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// The two ring connections of `members[me]`: to the next member and from the previous one.
/// `members` are global ranks; `name` keys this group's entries in the store.
pub fn connect_ring(
    store: &TcpStore,
    name: &str,
    members: &[usize],
    me: usize,
    opts: &SocketOptions,
    store_host: &str,
) -> Result<(TcpStream, TcpStream), CommError> {
    let n = members.len();
    let rank = members[me];
    let setup = |message: String| CommError::Setup { rank, message };
    let store_err = |source| CommError::Store { rank, source };
    let deadline = Instant::now() + opts.timeout;

    let host = opts
        .host
        .clone()
        .unwrap_or_else(|| advertise_host(store_host));
    let listener = TcpListener::bind((host.as_str(), 0))
        .or_else(|_| TcpListener::bind(("0.0.0.0", 0)))
        .map_err(|e| setup(format!("cannot listen on {host}: {e}")))?;
    let port = listener
        .local_addr()
        .map_err(|e| setup(e.to_string()))?
        .port();
    store
        .set(
            &format!("{name}/addr/{me}"),
            format!("{host}:{port}").as_bytes(),
        )
        .map_err(store_err)?;

    // Connect to the next member.
    let next_idx = (me + 1) % n;
    let next_rank = members[next_idx];
    store
        .wait(&[&format!("{name}/addr/{next_idx}")], opts.timeout)
        .map_err(|e| {
            setup(format!(
                "rank {next_rank} did not publish its address within {:?}: {e}",
                opts.timeout
            ))
        })?;
    let next_addr = store
        .get_string(&format!("{name}/addr/{next_idx}"))
        .map_err(store_err)?;
    let addr: SocketAddr = next_addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            setup(format!(
                "rank {next_rank} published a bad address {next_addr:?}"
            ))
        })?;
    let next = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(setup(format!(
                    "cannot connect to rank {next_rank} at {addr}: {e}"
                )));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    configure(&next, opts).map_err(|e| setup(e.to_string()))?;
    let mut hello = Vec::with_capacity(20);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&tag(name).to_le_bytes());
    hello.extend_from_slice(&(me as u32).to_le_bytes());
    (&next)
        .write_all(&hello)
        .map_err(|e| setup(format!("handshake with rank {next_rank}: {e}")))?;

    // Accept the previous member.
    let prev_idx = (me + n - 1) % n;
    let prev_rank = members[prev_idx];
    listener
        .set_nonblocking(true)
        .map_err(|e| setup(e.to_string()))?;
    let prev = loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| setup(e.to_string()))?;
                configure(&s, opts).map_err(|e| setup(e.to_string()))?;
                s.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(100)),
                ))
                .map_err(|e| setup(e.to_string()))?;
                let mut got = [0u8; 20];
                let ok = (&s).read_exact(&mut got).is_ok()
                    && &got[..8] == MAGIC
                    && got[8..16] == tag(name).to_le_bytes()
                    && got[16..20] == (prev_idx as u32).to_le_bytes();
                if ok {
                    s.set_read_timeout(Some(opts.timeout))
                        .map_err(|e| setup(e.to_string()))?;
                    break s;
                }
                tracing::warn!(
                    "rank {rank}: refused a connection that is not rank {prev_rank} of group {name}"
                );
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(setup(format!(
                        "rank {prev_rank} did not connect within {:?}",
                        opts.timeout
                    )));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(setup(format!("accepting rank {prev_rank}: {e}"))),
        }
    };
    Ok((next, prev))
}
