//! Each rank's wall-clock offset to rank 0, NTP-style: rank 0 answers pings on a small TCP
//! service; every other rank keeps the sample with the shortest round trip and estimates
//! `offset = t_rank0 - (t_send + t_recv) / 2` (add it to a local timestamp to get rank 0's time).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::comm::CommError;
use super::connect::advertise_host;
use super::store::TcpStore;

const PINGS: usize = 16;

/// Nanoseconds since the Unix epoch (the clock obs timestamps use).
pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Rank 0's clock minus this rank's, in nanoseconds, with the round-trip time of the sample used
/// (the offset's error is at most half of it). Rank 0 gets (0, 0). Collective over the world.
pub fn measure_offset(
    store: &TcpStore,
    store_host: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<(i64, i64), CommError> {
    let setup = |message: String| CommError::Setup { rank, message };
    let key = "titan/clock/addr";
    if rank == 0 {
        let host = advertise_host(store_host);
        let listener = TcpListener::bind((host.as_str(), 0))
            .or_else(|_| TcpListener::bind(("0.0.0.0", 0)))
            .map_err(|e| setup(format!("clock service: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| setup(e.to_string()))?
            .port();
        store
            .set(key, format!("{host}:{port}").as_bytes())
            .map_err(|source| CommError::Store { rank, source })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| setup(e.to_string()))?;
        let deadline = Instant::now() + timeout;
        let mut served = 0;
        while served + 1 < world_size {
            match listener.accept() {
                Ok((s, _)) => {
                    served += 1;
                    // A peer that fails mid-ping only loses its own estimate.
                    let _ = serve(s, timeout);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(setup(format!(
                            "clock sync: only {served} of {} ranks connected within {timeout:?}",
                            world_size - 1
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(setup(format!("clock service: {e}"))),
            }
        }
        return Ok((0, 0));
    }
    store
        .wait(&[key], timeout)
        .map_err(|source| CommError::Store { rank, source })?;
    let addr = store
        .get_string(key)
        .map_err(|source| CommError::Store { rank, source })?;
    let sock = addr
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| setup(format!("rank 0 published a bad clock address {addr:?}")))?;
    let mut s = TcpStream::connect_timeout(&sock, timeout)
        .map_err(|e| setup(format!("clock sync with rank 0 at {addr}: {e}")))?;
    s.set_nodelay(true).ok();
    s.set_read_timeout(Some(timeout)).ok();
    let mut best: Option<(i64, i64)> = None;
    for _ in 0..PINGS {
        let t0 = now_ns();
        let mut buf = [0u8; 8];
        s.write_all(&t0.to_le_bytes())
            .and_then(|_| s.read_exact(&mut buf))
            .map_err(|e| setup(format!("clock sync with rank 0: {e}")))?;
        let t2 = now_ns();
        let t1 = i64::from_le_bytes(buf);
        let rtt = t2 - t0;
        let offset = t1 - (t0 + t2) / 2;
        if best.is_none_or(|(_, r)| rtt < r) {
            best = Some((offset, rtt));
        }
    }
    Ok(best.unwrap_or((0, 0)))
}

fn serve(mut s: TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    let mut buf = [0u8; 8];
    for _ in 0..PINGS {
        s.read_exact(&mut buf)?;
        s.write_all(&now_ns().to_le_bytes())?;
    }
    Ok(())
}
