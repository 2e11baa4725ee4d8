//! The cpu backend's transport: each rank holds a TCP connection to the next rank of the ring
//! and one from the previous, and runs gloo-style chunked, pipelined ring algorithms over them.
//!
//! A buffer is cut into `size` chunks (one per rank) and each chunk into segments. A helper
//! thread writes segments to the next rank while this thread reads segments from the previous
//! rank and reduces (or copies) them in place; a segment is queued for sending as soon as it has
//! been reduced, so sending, receiving and reducing overlap. Every rank cuts segments at the same
//! boundaries, which is what makes the in-place overwrite safe: a segment is overwritten only
//! after the data that depends on its earlier contents has travelled the whole ring.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use super::comm::{CommError, ReduceOp};
use super::elem::{Elem, reduce_into};

/// One rank's two ring connections.
pub struct Ring {
    pub rank: usize,
    pub size: usize,
    /// Global ranks of the group members, for error messages.
    pub members: Vec<usize>,
    /// To rank+1 (absent for a group of one).
    next: Option<TcpStream>,
    /// From rank-1.
    prev: Option<TcpStream>,
    segment_bytes: usize,
    timeout: Duration,
    /// Receive buffer for reductions; u64-backed so every element type is aligned.
    scratch: Vec<u64>,
}

/// What to do with a received segment.
#[derive(Clone, Copy)]
enum Mode {
    Reduce(ReduceOp),
    Copy,
}

/// Ring reduce-scatter over `n` chunks on rank `r`: the rank first sends chunk r-1; at step s it
/// receives and reduces chunk r-s-2 (and forwards it next). It ends holding the reduced chunk r.
fn reduce_scatter_steps(n: usize, r: usize, op: ReduceOp) -> impl Iterator<Item = (usize, Mode)> {
    (0..n - 1).map(move |s| ((r + 2 * n - s - 2) % n, Mode::Reduce(op)))
}

/// Ring all-gather over `n` chunks on rank `r`: the rank first sends chunk r; at step s it
/// receives chunk r-s-1 (and forwards it next).
fn all_gather_steps(n: usize, r: usize) -> impl Iterator<Item = (usize, Mode)> {
    (0..n - 1).map(move |s| ((r + 2 * n - s - 1) % n, Mode::Copy))
}

/// A region of the caller's buffer queued for sending. Raw because the sender thread reads it
/// while this thread writes other, disjoint regions of the same buffer.
struct Seg {
    ptr: *const u8,
    len: usize,
    /// The bytes `ptr` points into when the segment owns them (an all-to-all's forwarded
    /// blocks): moving the `Vec` into the queue does not move its heap buffer.
    _owned: Option<Vec<u8>>,
}

impl Seg {
    fn borrowed(ptr: *const u8, len: usize) -> Seg {
        Seg {
            ptr,
            len,
            _owned: None,
        }
    }

    fn owned(bytes: Vec<u8>) -> Seg {
        Seg {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            _owned: Some(bytes),
        }
    }
}
// SAFETY: the pointed-to buffer outlives the scoped sender thread, and a segment is never written
// while it is queued (see the module docs).
unsafe impl Send for Seg {}

impl Ring {
    pub fn new(
        rank: usize,
        members: Vec<usize>,
        next: Option<TcpStream>,
        prev: Option<TcpStream>,
        segment_bytes: usize,
        timeout: Duration,
    ) -> Ring {
        Ring {
            rank,
            size: members.len(),
            members,
            next,
            prev,
            segment_bytes: segment_bytes.max(64),
            timeout,
            scratch: Vec::new(),
        }
    }

    /// Sets the no-progress timeout of both connections.
    pub fn set_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        self.timeout = timeout;
        for s in [&self.next, &self.prev].into_iter().flatten() {
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))?;
        }
        Ok(())
    }

    fn next_rank(&self) -> usize {
        self.members[(self.rank + 1) % self.size]
    }

    fn prev_rank(&self) -> usize {
        self.members[(self.rank + self.size - 1) % self.size]
    }

    /// Boundaries of the `size` chunks of a buffer of `numel` elements: equal chunks, the
    /// remainder spread over the first ones.
    fn chunks(&self, numel: usize) -> Vec<(usize, usize)> {
        let base = numel / self.size;
        let extra = numel % self.size;
        let mut out = Vec::with_capacity(self.size);
        let mut lo = 0;
        for c in 0..self.size {
            let n = base + usize::from(c < extra);
            out.push((lo, lo + n));
            lo += n;
        }
        out
    }

    /// Segments of the element range [lo, hi), as byte ranges.
    fn segments(&self, elem: Elem, lo: usize, hi: usize) -> impl Iterator<Item = (usize, usize)> {
        let es = elem.size();
        let per = (self.segment_bytes / es).max(1);
        (lo..hi)
            .step_by(per)
            .map(move |s| (s * es, (s + per).min(hi) * es))
    }

    /// In-place sum/max all-reduce of `buf` (elements of type `elem`).
    pub fn all_reduce(
        &mut self,
        buf: &mut [u8],
        elem: Elem,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (n, r) = (self.size, self.rank);
        // A reduce-scatter leaves rank r with the reduced chunk r: exactly what the all-gather
        // that follows sends first.
        let steps = reduce_scatter_steps(n, r, op).chain(all_gather_steps(n, r));
        self.run_chunked("all_reduce", buf, elem, (r + n - 1) % n, steps)
    }

    /// Reduce-scatter over equal-size chunks in place: afterwards chunk `rank` of `buf` holds the
    /// reduction of every rank's chunk `rank`; the other chunks hold partial sums.
    pub fn reduce_scatter(
        &mut self,
        buf: &mut [u8],
        elem: Elem,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (n, r) = (self.size, self.rank);
        let steps = reduce_scatter_steps(n, r, op);
        self.run_chunked("reduce_scatter", buf, elem, (r + n - 1) % n, steps)
    }

    /// All-gather in place: chunk `rank` of `buf` is this rank's input; afterwards every chunk
    /// holds its rank's input.
    pub fn all_gather(&mut self, buf: &mut [u8], elem: Elem) -> Result<(), CommError> {
        let (n, r) = (self.size, self.rank);
        let steps = all_gather_steps(n, r);
        self.run_chunked("all_gather", buf, elem, r, steps)
    }

    /// Runs a collective over the `size` chunks of `buf` ([`Ring::chunks`]): the engine's
    /// `first_send` and `steps`. Nothing to do alone.
    fn run_chunked(
        &mut self,
        op_name: &'static str,
        buf: &mut [u8],
        elem: Elem,
        first_send: usize,
        steps: impl Iterator<Item = (usize, Mode)>,
    ) -> Result<(), CommError> {
        if self.size == 1 {
            return Ok(());
        }
        let chunks = self.chunks(buf.len() / elem.size());
        let steps: Vec<(usize, Mode)> = steps.collect();
        self.run(op_name, buf, elem, &chunks, first_send, &steps)
    }

    /// Pipelined chain broadcast from `root` around the ring.
    pub fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        if self.size == 1 {
            return Ok(());
        }
        let n = self.size;
        let all = [(0, buf.len())];
        if self.rank == root {
            return self.run("broadcast", buf, Elem::U8, &all, 0, &[]);
        }
        // The last rank of the chain (the one before root) does not forward.
        let forward = (self.rank + 1) % n != root;
        self.run_chain("broadcast", buf, forward)
    }

    /// All-to-all with blocks of any size: `input` is cut into `input_splits` (bytes, one block
    /// per destination rank, in rank order) and `output` into `output_splits` (one block per
    /// source rank); afterwards block s of `output` holds what rank s sent this rank.
    ///
    /// Over the ring a block travels to its rank hop by hop: at step k (1 ≤ k < size) this rank
    /// sends the next rank the blocks that started at rank r-k+1 and have not arrived, each
    /// prefixed by its length, and receives from the previous rank those that started at rank
    /// r-k: it keeps the first (its own) and forwards the others at the next step. A block
    /// whose length differs from what this rank's `output_splits` expects is an error naming
    /// both ranks (the callers' split tables disagree).
    pub fn all_to_all(
        &mut self,
        output: &mut [u8],
        output_splits: &[usize],
        input: &[u8],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        const OP: &str = "all_to_all_single";
        let (n, r) = (self.size, self.rank);
        let offsets = |splits: &[usize]| -> Vec<usize> {
            let mut at = 0;
            splits
                .iter()
                .map(|&len| {
                    at += len;
                    at - len
                })
                .collect()
        };
        let (in_at, out_at) = (offsets(input_splits), offsets(output_splits));
        output[out_at[r]..out_at[r] + output_splits[r]]
            .copy_from_slice(&input[in_at[r]..in_at[r] + input_splits[r]]);
        if n == 1 {
            return Ok(());
        }
        let mut mismatch = None;
        let result = self.pipeline(OP, |prev, tx| {
            // Step 1 sends this rank's own blocks for ranks r+1, ..., r+n-1.
            let mut outgoing = Vec::new();
            for d in 1..n {
                let dest = (r + d) % n;
                outgoing.extend_from_slice(&(input_splits[dest] as u64).to_le_bytes());
                outgoing.extend_from_slice(&input[in_at[dest]..in_at[dest] + input_splits[dest]]);
            }
            for k in 1..n {
                let _ = tx.send(Seg::owned(std::mem::take(&mut outgoing)));
                let source = (r + n - k) % n;
                let mut len = [0u8; 8];
                read_full(prev, &mut len)?;
                let len = u64::from_le_bytes(len) as usize;
                if len != output_splits[source] {
                    mismatch = Some((source, len));
                    return Err(io::Error::other("all_to_all split mismatch"));
                }
                read_full(prev, &mut output[out_at[source]..out_at[source] + len])?;
                // The blocks of `source` for ranks r+1, ..., r+n-k-1 go on at the next step.
                for _ in k + 1..n {
                    let mut len = [0u8; 8];
                    read_full(prev, &mut len)?;
                    let at = outgoing.len();
                    outgoing.extend_from_slice(&len);
                    outgoing.resize(at + 8 + u64::from_le_bytes(len) as usize, 0);
                    read_full(prev, &mut outgoing[at + 8..])?;
                }
            }
            Ok(())
        });
        match (result, mismatch) {
            (Err(_), Some((source, len))) => Err(CommError::BadArgument {
                op: OP,
                message: format!(
                    "rank {} expected {} bytes from rank {} but it sent {len} (the ranks' split \
                     tables disagree: rank s's input split for rank d must equal rank d's \
                     output split for rank s)",
                    self.members[r], output_splits[source], self.members[source]
                ),
            }),
            (result, _) => result,
        }
    }

    /// Point-to-point transfers run together (torch's `batch_isend_irecv`): `sends` (peer
    /// group rank, bytes) and `recvs` (peer, buffer), each list in issue order. A transfer
    /// travels on the connection between the two ranks, which must be neighbours on the ring
    /// (a pipeline's stages are): to or from the next rank on `next`, the previous on `prev`
    /// (a connection carries bytes both ways); of two ranks, sends go on `next` and receives
    /// come on `prev`. Each message is its length, then its bytes: a receive whose length
    /// differs is an error naming both ranks. The directions run on threads of their own, so a
    /// send blocked until its receiver reads holds up no receive of the batch.
    pub fn send_recv(
        &mut self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<(), CommError> {
        const OP: &str = "batch_isend_irecv";
        // Lanes by connection (0: `prev`, 1: `next`), transfers in issue order.
        let mut writes: [Vec<(usize, &[u8])>; 2] = [Vec::new(), Vec::new()];
        for &(peer, bytes) in sends {
            writes[self.connection_to(peer, true)?].push((peer, bytes));
        }
        let mut reads: [Vec<(usize, &mut [u8])>; 2] = [Vec::new(), Vec::new()];
        for (peer, buf) in recvs.iter_mut() {
            reads[self.connection_to(*peer, false)?].push((*peer, &mut **buf));
        }
        let streams = [self.prev.as_ref(), self.next.as_ref()];
        let (rank, members, timeout) = (self.members[self.rank], &self.members, self.timeout);
        // The first failure and the peer (group rank) it names; it shuts this rank's
        // connections for reading so that the other lanes stop waiting for bytes that cannot
        // come.
        let failure: std::sync::Mutex<Option<(usize, LaneFailure)>> = std::sync::Mutex::new(None);
        let fail = |peer: usize, f: LaneFailure| {
            let mut first = failure.lock().unwrap_or_else(|p| p.into_inner());
            if first.is_none() {
                *first = Some((peer, f));
                for s in streams.iter().flatten() {
                    let _ = s.shutdown(Shutdown::Read);
                }
            }
        };
        std::thread::scope(|scope| {
            for (lane, stream) in writes.into_iter().zip(streams) {
                let (Some(mut stream), false) = (stream, lane.is_empty()) else {
                    continue;
                };
                let fail = &fail;
                scope.spawn(move || {
                    for (peer, bytes) in lane {
                        let sent = stream
                            .write_all(&(bytes.len() as u64).to_le_bytes())
                            .and_then(|()| stream.write_all(bytes));
                        if let Err(e) = sent {
                            return fail(peer, LaneFailure::Io(e));
                        }
                    }
                });
            }
            for (lane, stream) in reads.into_iter().zip(streams) {
                let (Some(stream), false) = (stream, lane.is_empty()) else {
                    continue;
                };
                let fail = &fail;
                scope.spawn(move || {
                    for (peer, buf) in lane {
                        let mut len = [0u8; 8];
                        if let Err(e) = read_full(stream, &mut len) {
                            return fail(peer, LaneFailure::Io(e));
                        }
                        let sent = u64::from_le_bytes(len) as usize;
                        if sent != buf.len() {
                            return fail(
                                peer,
                                LaneFailure::Length {
                                    sent,
                                    expected: buf.len(),
                                },
                            );
                        }
                        if let Err(e) = read_full(stream, buf) {
                            return fail(peer, LaneFailure::Io(e));
                        }
                    }
                });
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some((peer, LaneFailure::Io(e))) => {
                Err(peer_error(rank, members[peer], OP, timeout, e))
            }
            Some((peer, LaneFailure::Length { sent, expected })) => Err(CommError::BadArgument {
                op: OP,
                message: format!(
                    "rank {rank} expected {expected} bytes from rank {} but it sent {sent} (the \
                     two ranks pair their transfers differently: the k-th send from a rank to \
                     another pairs with the other's k-th receive from it)",
                    members[peer]
                ),
            }),
        }
    }

    /// The connection a transfer to or from `peer` (a group rank) travels on: 1 for `next`,
    /// 0 for `prev`. Of two ranks, sends go on `next` and receives come on `prev`.
    fn connection_to(&self, peer: usize, send: bool) -> Result<usize, CommError> {
        let (n, r) = (self.size, self.rank);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        match (peer == next && n > 1, peer == prev && n > 1) {
            (true, true) => Ok(usize::from(send)),
            (true, false) => Ok(1),
            (false, true) => Ok(0),
            (false, false) => Err(CommError::BadArgument {
                op: "batch_isend_irecv",
                message: format!(
                    "the cpu backend sends point to point only between neighbours of the \
                     group's ring, and ranks {} and {} are not",
                    self.members[r],
                    self.members.get(peer).copied().unwrap_or(peer)
                ),
            }),
        }
    }

    /// The pipelined engine: queue chunk `first_send`, then for each step receive its chunk
    /// segment by segment, reduce or copy it in place, and queue it for the next step's send.
    fn run(
        &mut self,
        op_name: &'static str,
        buf: &mut [u8],
        elem: Elem,
        chunks: &[(usize, usize)],
        first_send: usize,
        steps: &[(usize, Mode)],
    ) -> Result<(), CommError> {
        let seg_bytes = self.segment_bytes;
        if self.scratch.len() * 8 < seg_bytes + 8 {
            self.scratch = vec![0u64; seg_bytes / 8 + 2];
        }
        let (first_lo, first_hi) = chunks[first_send];
        let first: Vec<(usize, usize)> = self.segments(elem, first_lo, first_hi).collect();
        let step_segs: Vec<Vec<(usize, usize)>> = steps
            .iter()
            .map(|&(c, _)| self.segments(elem, chunks[c].0, chunks[c].1).collect())
            .collect();
        let base = buf.as_mut_ptr();
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = self.pipeline(op_name, |prev, tx| {
            for &(a, b) in &first {
                // SAFETY: in bounds of `buf`.
                let _ = tx.send(Seg::borrowed(unsafe { base.add(a) }, b - a));
            }
            for (i, &(_, mode)) in steps.iter().enumerate() {
                let forward = i + 1 < steps.len();
                for &(a, b) in &step_segs[i] {
                    // SAFETY: [a, b) is in bounds of `buf` and not queued for sending (it was
                    // sent a full ring turn ago, see the module docs).
                    let dst = unsafe { std::slice::from_raw_parts_mut(base.add(a), b - a) };
                    match mode {
                        Mode::Copy => read_full(prev, dst)?,
                        Mode::Reduce(op) => {
                            // SAFETY: scratch holds at least seg_bytes >= b - a bytes.
                            let tmp = unsafe {
                                std::slice::from_raw_parts_mut(
                                    scratch.as_mut_ptr().cast::<u8>(),
                                    b - a,
                                )
                            };
                            read_full(prev, tmp)?;
                            reduce_into(elem, op, dst, tmp);
                        }
                    }
                    if forward {
                        let _ = tx.send(Seg::borrowed(dst.as_ptr(), b - a));
                    }
                }
            }
            Ok(())
        });
        self.scratch = scratch;
        result
    }

    /// Receives `buf` from the previous rank segment by segment, forwarding each to the next.
    fn run_chain(
        &mut self,
        op_name: &'static str,
        buf: &mut [u8],
        forward: bool,
    ) -> Result<(), CommError> {
        let segs: Vec<(usize, usize)> = self.segments(Elem::U8, 0, buf.len()).collect();
        let base = buf.as_mut_ptr();
        self.pipeline(op_name, |prev, tx| {
            for &(a, b) in &segs {
                // SAFETY: in bounds; each segment is written once, then only read.
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(a), b - a) };
                read_full(prev, dst)?;
                if forward {
                    let _ = tx.send(Seg::borrowed(dst.as_ptr(), b - a));
                }
            }
            Ok(())
        })
    }

    /// Runs `receive` on this thread while a scoped thread writes the segments it queues. The
    /// side that fails first names the peer at fault; it also shuts the other side's connection
    /// for reading so that this thread stops waiting for data that cannot come.
    fn pipeline(
        &self,
        op_name: &'static str,
        receive: impl FnOnce(&TcpStream, &mpsc::Sender<Seg>) -> io::Result<()>,
    ) -> Result<(), CommError> {
        let (rank, next_rank, prev_rank, timeout) = (
            self.members[self.rank],
            self.next_rank(),
            self.prev_rank(),
            self.timeout,
        );
        let next = self
            .next
            .as_ref()
            .expect("ring of size > 1 has a next connection");
        let prev = self
            .prev
            .as_ref()
            .expect("ring of size > 1 has a prev connection");
        // 0: no failure yet, 1: sending failed first, 2: receiving failed first.
        let first_failure = AtomicU8::new(0);
        std::thread::scope(|scope| {
            let (tx, rx) = mpsc::channel::<Seg>();
            let first = &first_failure;
            let sender = scope.spawn(move || {
                let mut out = next;
                for seg in rx {
                    // SAFETY: see `Seg`.
                    let data = unsafe { std::slice::from_raw_parts(seg.ptr, seg.len) };
                    if let Err(e) = out.write_all(data) {
                        let _ = first.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst);
                        // Read-only shutdown: unblocks our receive without signalling the
                        // (healthy) previous rank, which would otherwise blame us.
                        let _ = prev.shutdown(Shutdown::Read);
                        return Err(e);
                    }
                }
                Ok(())
            });
            let recv_result = receive(prev, &tx);
            drop(tx);
            if recv_result.is_err() {
                // The sender drains what is queued (bounded by the write timeout) and stops. The
                // next rank is not signalled: it learns of the failure from the store notice we
                // post before exiting, and only then from our closed socket.
                let _ = first_failure.compare_exchange(0, 2, Ordering::SeqCst, Ordering::SeqCst);
            }
            let send_result = sender
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the sender thread panicked")));
            let blame_sender = first_failure.load(Ordering::SeqCst) == 1;
            match (send_result, recv_result) {
                (Ok(()), Ok(())) => Ok(()),
                (Err(e), _) if blame_sender => {
                    Err(peer_error(rank, next_rank, op_name, timeout, e))
                }
                (_, Err(e)) => Err(peer_error(rank, prev_rank, op_name, timeout, e)),
                (Err(e), Ok(())) => Err(peer_error(rank, next_rank, op_name, timeout, e)),
            }
        })
    }
}

/// Why a lane of [`Ring::send_recv`] stopped.
enum LaneFailure {
    Io(io::Error),
    /// A message of another length than the receive's buffer.
    Length {
        sent: usize,
        expected: usize,
    },
}

fn read_full(mut stream: &TcpStream, buf: &mut [u8]) -> io::Result<()> {
    stream.read_exact(buf)
}

fn peer_error(
    rank: usize,
    peer: usize,
    op: &'static str,
    timeout: Duration,
    e: io::Error,
) -> CommError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::PeerTimeout {
            rank,
            peer,
            op,
            timeout,
        },
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => CommError::PeerClosed { rank, peer, op },
        _ => CommError::PeerIo {
            rank,
            peer,
            op,
            source: e,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Rings of `n` ranks over loopback, one per thread: `body(ring)` runs on each.
    fn on_ring<T: Send>(n: usize, body: impl Fn(&mut Ring) -> T + Sync) -> Vec<T> {
        let listeners: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, listener)| {
                    let (addrs, body) = (&addrs, &body);
                    scope.spawn(move || {
                        let next = TcpStream::connect(addrs[(r + 1) % n]).unwrap();
                        let (prev, _) = listener.accept().unwrap();
                        let members = (0..n).map(|m| m + 10).collect();
                        let timeout = Duration::from_secs(10);
                        let mut ring = Ring::new(r, members, Some(next), Some(prev), 64, timeout);
                        ring.set_timeout(timeout).unwrap();
                        body(&mut ring)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// What rank `from` sends rank `to` in batch `k`: bytes naming all three, of a length
    /// that differs per pair (larger than a socket's buffers both ways between ranks 0 and 1:
    /// sent one after the other, each rank's send would wait for the other's receive).
    fn message(from: usize, to: usize, k: usize) -> Vec<u8> {
        let len = match (from, to) {
            (0, 1) | (1, 0) => (24 << 20) + from,
            _ => 100 + 37 * from + 11 * to + k,
        };
        (0..len)
            .map(|i| (from * 31 + to * 7 + k * 3 + i) as u8)
            .collect()
    }

    /// Each rank sends to and receives from both neighbours in one batch, twice: every
    /// receive gets its sender's bytes, though every send is larger than the other side reads
    /// before it has sent its own (the directions run side by side).
    #[test]
    fn a_batch_sends_and_receives_between_neighbours() {
        for n in [2, 3, 4] {
            on_ring(n, |ring| {
                let r = ring.rank;
                let peers: Vec<usize> = if n == 2 {
                    vec![1 - r]
                } else {
                    vec![(r + 1) % n, (r + n - 1) % n]
                };
                for k in 0..2 {
                    let outgoing: Vec<Vec<u8>> = peers.iter().map(|&p| message(r, p, k)).collect();
                    let sends: Vec<(usize, &[u8])> = peers
                        .iter()
                        .zip(&outgoing)
                        .map(|(&p, m)| (p, m.as_slice()))
                        .collect();
                    let mut bufs: Vec<Vec<u8>> = peers
                        .iter()
                        .map(|&p| vec![0; message(p, r, k).len()])
                        .collect();
                    let mut recvs: Vec<(usize, &mut [u8])> = peers
                        .iter()
                        .zip(bufs.iter_mut())
                        .map(|(&p, b)| (p, b.as_mut_slice()))
                        .collect();
                    ring.send_recv(&sends, &mut recvs).unwrap();
                    for (&p, got) in peers.iter().zip(&bufs) {
                        assert!(*got == message(p, r, k), "n{n} rank {r} from {p} batch {k}");
                    }
                }
            });
        }
    }

    /// A receive of another length than its send fails naming both ranks; a send to a rank
    /// that is not a neighbour, or to itself, is refused before anything is sent.
    #[test]
    fn mismatched_and_unreachable_transfers_are_errors() {
        let errors = on_ring(2, |ring| {
            let r = ring.rank;
            let data = vec![7u8; 16 + r];
            let mut buf = vec![0u8; 16];
            ring.send_recv(&[(1 - r, &data)], &mut [(1 - r, &mut buf)])
                .err()
                .map(|e| e.to_string())
        });
        // Rank 1 (global 11) sends 17 bytes where rank 0 reads 16; rank 0's 16 fit.
        assert_eq!(errors[1], None);
        let err = errors[0].as_deref().expect("rank 0 got 17 bytes for 16");
        assert!(
            err.contains("rank 10 expected 16 bytes from rank 11 but it sent 17"),
            "{err}"
        );
        on_ring(4, |ring| {
            let err = ring.send_recv(&[((ring.rank + 2) % 4, &[1u8][..])], &mut []);
            let err = err.unwrap_err().to_string();
            assert!(err.contains("not"), "{err}");
            assert!(err.contains("neighbours"), "{err}");
            let err = ring.send_recv(&[(ring.rank, &[1u8][..])], &mut []);
            assert!(err.unwrap_err().to_string().contains("neighbours"));
        });
    }
}
