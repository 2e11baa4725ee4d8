//! The job's failure notices: the first rank whose collective fails describes the failure in the
//! rendezvous store, so every other rank's error can name the root cause instead of only the
//! neighbour it lost.
//!
//! The store lives in the launcher (titan-train's or torchrun's agent), which outlives every
//! rank, or — in a by-hand `env://` launch — in rank 0. In the second case rank 0 failing and
//! exiting at once would take the notices with it while the others are still timing out, so a
//! rank that hosts the store keeps it up after posting until every rank has posted or
//! [`FailureBoard::linger`] has passed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use titan_obs_core::vocab;

use super::store::TcpStore;

/// Store key where the first failing rank describes the failure for everyone else.
pub const FAILURE_KEY: &str = "titan/failure";
/// Counter of the ranks that have posted (and so read) a failure notice.
const POSTED_KEY: &str = "titan/failure/posted";

/// The most a store-hosting rank waits for the others after a failure: ranks of one job detect a
/// hung or dead peer within a second or so of each other (their no-progress clocks start when
/// the ring stalls), so this is ample without delaying a real exit much.
const MAX_LINGER: Duration = Duration::from_secs(10);

/// Where this rank posts and reads failure notices.
pub struct FailureBoard {
    pub store: Arc<TcpStore>,
    world_size: usize,
    hosts_store: bool,
    linger: Duration,
    /// Whether this process has posted already (it is counted, and lingers, once).
    posted: AtomicBool,
    /// Whether its failure is in its titan-obs records.
    recorded: AtomicBool,
}

/// What the board holds after this rank's notice was posted.
pub enum Posted {
    /// This rank's notice is the first of the job.
    First,
    /// Another rank posted first; its notice.
    After(String),
    /// The store could not be reached (its host has exited or the network failed).
    Unreachable(String),
}

impl FailureBoard {
    /// The board on `store`; `hosts_store` when this process runs the store's server. A hosting
    /// rank waits at most `comm_timeout` (capped at 10 s) for the others after a failure.
    pub fn new(
        store: Arc<TcpStore>,
        world_size: usize,
        hosts_store: bool,
        comm_timeout: Duration,
    ) -> FailureBoard {
        FailureBoard {
            store,
            world_size,
            hosts_store,
            linger: comm_timeout.min(MAX_LINGER),
            posted: AtomicBool::new(false),
            recorded: AtomicBool::new(false),
        }
    }

    /// How long a store-hosting rank keeps the store up after posting.
    pub fn linger(&self) -> Duration {
        self.linger
    }

    /// Posts `own` unless another rank posted first, and says what the board holds. A rank that
    /// hosts the store returns only once every rank has posted or [`Self::linger`] has passed.
    pub fn post(&self, own: &str) -> Posted {
        let posted = match self.store.compare_set(FAILURE_KEY, b"", own.as_bytes()) {
            Ok(first) if first == own.as_bytes() => Posted::First,
            Ok(first) => Posted::After(String::from_utf8_lossy(&first).into_owned()),
            Err(e) => Posted::Unreachable(e.to_string()),
        };
        // The failure goes into this rank's titan-obs records too (once), so the run's
        // summary names it: a run that failed no longer reads as "0 errors" (issue 39).
        if !self.recorded.swap(true, Ordering::SeqCst) {
            titan_obs_core::error(vocab::titan::JOB_FAILURE, &record_text(own, &posted));
        }
        if matches!(posted, Posted::Unreachable(_)) || self.posted.swap(true, Ordering::SeqCst) {
            return posted;
        }
        let counted = self.store.add(POSTED_KEY, 1);
        if self.hosts_store && counted.is_ok() {
            let deadline = Instant::now() + self.linger;
            while Instant::now() < deadline {
                match self.store.add(POSTED_KEY, 0) {
                    Ok(n) if (n as usize) < self.world_size => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => break,
                }
            }
        }
        posted
    }

    /// The first failure any rank posted, if one did.
    pub fn first(&self) -> Option<String> {
        if self.store.check(&[FAILURE_KEY]).ok()? {
            self.store
                .get(FAILURE_KEY)
                .ok()
                .map(|v| String::from_utf8_lossy(&v).into_owned())
        } else {
            None
        }
    }
}

/// What a rank records of its failure: its own message, and the job's first failure when
/// another rank's came first.
fn record_text(own: &str, posted: &Posted) -> String {
    match posted {
        Posted::First => own.to_string(),
        Posted::After(first) => format!("{own} (first failure reported in the job: {first})"),
        Posted::Unreachable(why) => {
            format!("{own} (the job's failure notices could not be read: {why})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::store::tests::{client, server};

    #[test]
    fn the_store_host_stays_up_until_every_rank_has_posted() {
        let host = Arc::new(server());
        let port = host.port();
        let host = FailureBoard::new(host, 2, true, Duration::from_secs(10));
        let peer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let peer = FailureBoard::new(Arc::new(client(port)), 2, false, Duration::from_secs(10));
            match peer.post("rank 1: lost rank 2") {
                Posted::After(first) => first,
                _ => panic!("rank 0 posted first"),
            }
        });
        let t0 = Instant::now();
        assert!(matches!(host.post("rank 0: rank 2 hung"), Posted::First));
        let waited = t0.elapsed();
        assert_eq!(peer.join().unwrap(), "rank 0: rank 2 hung");
        assert!(waited >= Duration::from_millis(250), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // A second post of the same process neither counts nor waits again.
        let t0 = Instant::now();
        assert!(matches!(host.post("rank 0: later"), Posted::After(_)));
        assert!(t0.elapsed() < Duration::from_millis(200));
    }

    #[test]
    fn the_store_host_gives_up_waiting_after_the_linger() {
        let host = FailureBoard::new(Arc::new(server()), 3, true, Duration::from_millis(400));
        assert_eq!(host.linger(), Duration::from_millis(400));
        let t0 = Instant::now();
        assert!(matches!(host.post("rank 0: rank 2 hung"), Posted::First));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(400), "{waited:?}");
        assert!(waited < Duration::from_secs(3), "{waited:?}");
        assert_eq!(host.first().as_deref(), Some("rank 0: rank 2 hung"));
        let long = FailureBoard::new(Arc::new(server()), 3, true, Duration::from_secs(600));
        assert_eq!(long.linger(), MAX_LINGER);
    }
}
