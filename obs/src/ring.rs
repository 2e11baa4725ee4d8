//! A bounded single-producer single-consumer ring of records, one per recording thread.
//!
//! The producer (the recording thread) and the consumer (the writer thread) only touch two
//! atomics; no lock, no allocation after construction. When the ring is full the producer
//! wakes the writer and waits for room rather than dropping records.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::record::RawRecord;

pub struct Ring {
    slots: Box<[UnsafeCell<MaybeUninit<RawRecord>>]>,
    /// Next slot the producer writes (monotonically increasing; index = head % capacity).
    head: AtomicUsize,
    /// Next slot the consumer reads.
    tail: AtomicUsize,
    /// Process-local thread id written into the `thread` column.
    pub thread: u32,
    pub thread_name: String,
}

// SAFETY: slots are only written by the single producer at indices in [tail+cap .. ) that the
// consumer has released, and only read by the single consumer at indices in [tail, head) that
// the producer has published with a Release store of `head`.
unsafe impl Sync for Ring {}
unsafe impl Send for Ring {}

impl Ring {
    pub fn new(capacity: usize, thread: u32, thread_name: String) -> Self {
        let capacity = capacity.max(2);
        let slots = (0..capacity)
            .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Ring {
            slots,
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            thread,
            thread_name,
        }
    }

    /// Number of records waiting for the consumer.
    pub fn len(&self) -> usize {
        self.head.load(Ordering::Acquire) - self.tail.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Producer side: tries to append; gives the record back when the ring is full.
    ///
    /// # Safety
    /// Must only be called from the single producer thread that owns this ring.
    #[inline]
    pub unsafe fn try_push(&self, record: RawRecord) -> Result<(), RawRecord> {
        let head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Acquire);
        if head - tail == self.slots.len() {
            return Err(record);
        }
        let slot = &self.slots[head % self.slots.len()];
        // SAFETY: the slot is outside [tail, head), so the consumer does not read it.
        unsafe { (*slot.get()).write(record) };
        self.head.store(head + 1, Ordering::Release);
        Ok(())
    }

    /// Consumer side: hands every published record to `f`, oldest first.
    ///
    /// # Safety
    /// Must only be called from the single consumer (the writer thread).
    pub unsafe fn drain(&self, mut f: impl FnMut(RawRecord)) -> usize {
        let tail = self.tail.load(Ordering::Relaxed);
        let head = self.head.load(Ordering::Acquire);
        for i in tail..head {
            let slot = &self.slots[i % self.slots.len()];
            // SAFETY: published by the producer, read exactly once before tail moves past it.
            f(unsafe { (*slot.get()).assume_init_read() });
            // Release each slot as we go so a blocked producer can continue early.
            self.tail.store(i + 1, Ordering::Release);
        }
        head - tail
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: we have exclusive access; drop whatever was never drained.
        unsafe { self.drain(drop) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{Kind, Reduce};

    fn rec(seq: u64) -> RawRecord {
        RawRecord {
            kind: Kind::Instant,
            reduce: Reduce::Mean,
            depth: 0,
            name: "x",
            seq,
            parent: 0,
            step: 0,
            tags: 0,
            start_mono: seq,
            dur_ns: 0,
            value: 0.0,
            message: None,
            pipeline: None,
        }
    }

    #[test]
    fn fills_refuses_when_full_and_drains_in_order() {
        let ring = Ring::new(4, 0, "t".into());
        for i in 0..4 {
            unsafe { ring.try_push(rec(i)).unwrap() };
        }
        assert!(unsafe { ring.try_push(rec(9)) }.is_err());
        let mut seen = vec![];
        unsafe { ring.drain(|r| seen.push(r.seq)) };
        assert_eq!(seen, vec![0, 1, 2, 3]);
        unsafe { ring.try_push(rec(4)).unwrap() };
        seen.clear();
        unsafe { ring.drain(|r| seen.push(r.seq)) };
        assert_eq!(seen, vec![4]);
    }

    #[test]
    fn concurrent_producer_consumer_loses_nothing() {
        use std::sync::Arc;
        let ring = Arc::new(Ring::new(64, 0, "t".into()));
        let producer = {
            let ring = ring.clone();
            std::thread::spawn(move || {
                for i in 0..100_000u64 {
                    let mut r = rec(i);
                    loop {
                        match unsafe { ring.try_push(r) } {
                            Ok(()) => break,
                            Err(back) => {
                                r = back;
                                std::thread::yield_now();
                            }
                        }
                    }
                }
            })
        };
        let mut next = 0u64;
        while next < 100_000 {
            unsafe {
                ring.drain(|r| {
                    assert_eq!(r.seq, next);
                    next += 1;
                })
            };
        }
        producer.join().unwrap();
    }
}
