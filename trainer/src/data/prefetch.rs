//! The training loop's loader: a [`TextLoader`] on its own thread, a bounded number of batches
//! ahead, so that reading, tokenizing and packing documents overlap the step instead of
//! preceding it (on a GPU the host must stay ahead of the kernels it queues).
//!
//! The batches and their order are the [`TextLoader`]'s own; only when they are built changes.
//! What a checkpoint stores is the position after the last batch *handed out* (each
//! [`HostBatch`] carries it), not how far the thread has read: a resumed run sees the batches an
//! unbroken run sees. Moving the position (resume, validation's restart) stops the thread,
//! takes the loader back, repositions it and starts again on the next batch.

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow, bail};
use tch::Device;

use super::loader::{Batch, HostBatch, LoaderState, TextLoader};

type Sent = Result<Option<HostBatch>>;

/// A [`TextLoader`] read `ahead` batches in advance on a background thread (`ahead = 0`: on the
/// caller's thread, when asked).
pub struct PrefetchLoader {
    ahead: usize,
    /// The loader while no thread holds it.
    idle: Option<TextLoader>,
    worker: Option<Worker>,
    /// The position after the last batch handed out.
    state: LoaderState,
    /// The thread's loader reached the end of a finite dataset or failed: nothing more comes.
    ended: bool,
}

struct Worker {
    batches: Receiver<Sent>,
    thread: JoinHandle<TextLoader>,
}

impl PrefetchLoader {
    pub fn new(loader: TextLoader, ahead: usize) -> Self {
        Self {
            ahead,
            state: loader.state().clone(),
            idle: Some(loader),
            worker: None,
            ended: false,
        }
    }

    /// The position after the last batch handed out (what a checkpoint stores).
    pub fn state(&self) -> &LoaderState {
        &self.state
    }

    /// Resumes from a saved position: the thread's batches read beyond the old one are dropped.
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        let mut loader = self.stop()?;
        let loaded = loader.load_state(state);
        self.state = loader.state().clone();
        self.idle = Some(loader);
        loaded
    }

    /// Starts over at the beginning of the dataset (validation runs each time from the start).
    pub fn reset(&mut self) -> Result<()> {
        let mut loader = self.stop()?;
        loader.reset();
        self.state = loader.state().clone();
        self.idle = Some(loader);
        Ok(())
    }

    /// The next batch on `device`; `None` once a finite dataset has ended.
    pub fn next_batch(&mut self, device: Device) -> Result<Option<Batch>> {
        let Some(mut batch) = self.next_host_batch()? else {
            return Ok(None);
        };
        self.state = std::mem::take(&mut batch.state_after);
        Ok(Some(batch.to_device(device)))
    }

    fn next_host_batch(&mut self) -> Result<Option<HostBatch>> {
        if self.ended {
            return Ok(None);
        }
        if self.ahead == 0 {
            let loader = self.idle.as_mut().expect("no thread runs without prefetch");
            return loader.next_host_batch();
        }
        if self.worker.is_none() {
            let loader = self
                .idle
                .take()
                .expect("the loader is idle while no thread runs");
            self.worker = Some(Worker::start(loader, self.ahead)?);
        }
        let worker = self.worker.as_ref().expect("started above");
        let received = worker.batches.recv();
        match received {
            Ok(Ok(Some(batch))) => Ok(Some(batch)),
            Ok(Ok(None)) => {
                self.ended = true;
                Ok(None)
            }
            Ok(Err(e)) => {
                self.ended = true;
                Err(e)
            }
            // The thread left without saying why: it panicked.
            Err(_) => {
                let err = match self.stop() {
                    Ok(mut loader) => {
                        loader.load_state(self.state.clone())?;
                        self.idle = Some(loader);
                        anyhow!("the data loader thread stopped unexpectedly")
                    }
                    Err(e) => e,
                };
                self.ended = true;
                Err(err)
            }
        }
    }

    /// Stops the thread (if any) and returns the loader, positioned where its thread left it
    /// (ahead of what was handed out: the callers reposition it).
    fn stop(&mut self) -> Result<TextLoader> {
        self.ended = false;
        if let Some(loader) = self.idle.take() {
            return Ok(loader);
        }
        let Some(Worker { batches, thread }) = self.worker.take() else {
            bail!("the data loader is gone after its thread failed");
        };
        // A thread blocked on a full queue sees the receiver gone and returns its loader.
        drop(batches);
        thread.join().map_err(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("no message");
            anyhow!("the data loader thread panicked: {why}")
        })
    }
}

impl Worker {
    fn start(mut loader: TextLoader, ahead: usize) -> Result<Worker> {
        let (send, batches) = sync_channel::<Sent>(ahead);
        let thread = std::thread::Builder::new()
            .name("titan-data".into())
            .spawn(move || {
                produce(&mut loader, &send);
                loader
            })
            .context("starting the data loader thread")?;
        Ok(Worker { batches, thread })
    }
}

/// Sends batches until the dataset ends, the loader fails, or nobody listens.
fn produce(loader: &mut TextLoader, send: &SyncSender<Sent>) {
    loop {
        let next = {
            // The batch's own work, not the wait for room in the queue.
            let _s = titan_obs_core::span(titan_obs_core::vocab::titan::DATA_PREFETCH);
            loader.next_host_batch()
        };
        let last = !matches!(next, Ok(Some(_)));
        if send.send(next).is_err() || last {
            return;
        }
    }
}

impl Drop for PrefetchLoader {
    fn drop(&mut self) {
        if let Some(Worker { batches, thread }) = self.worker.take() {
            drop(batches);
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::data::{Dataset, TextTokenizer};

    fn text_loader(infinite: bool) -> TextLoader {
        let tok = Arc::new(TextTokenizer::embedded().unwrap());
        TextLoader::new(Dataset::DefaultValidation, tok, 64, 2, 0, 1, infinite)
    }

    fn inputs(b: &Batch) -> Vec<i64> {
        Vec::<i64>::try_from(&b.inputs.reshape([-1])).unwrap()
    }

    /// Batches ahead of the loop are the inline loader's, and a checkpoint of the position
    /// taken while the thread has read further resumes where the loop was.
    #[test]
    fn prefetched_batches_and_positions_are_the_inline_loaders() {
        let mut inline = text_loader(true);
        let mut ahead = PrefetchLoader::new(text_loader(true), 3);
        let mut saved = None;
        for step in 0..6 {
            let a = inline.next_batch(Device::Cpu).unwrap().unwrap();
            let b = ahead.next_batch(Device::Cpu).unwrap().unwrap();
            assert_eq!(inputs(&a), inputs(&b), "batch {step}");
            assert_eq!(a.valid_tokens, b.valid_tokens);
            assert_eq!(inline.state(), ahead.state(), "position after batch {step}");
            if step == 2 {
                // Let the thread run ahead before the position is read.
                std::thread::sleep(std::time::Duration::from_millis(50));
                saved = Some(ahead.state().clone());
            }
        }
        let mut resumed = PrefetchLoader::new(text_loader(true), 2);
        resumed.load_state(saved.unwrap()).unwrap();
        let mut reference = text_loader(true);
        for _ in 0..3 {
            reference.next_batch(Device::Cpu).unwrap();
        }
        for step in 3..6 {
            let a = reference.next_batch(Device::Cpu).unwrap().unwrap();
            let b = resumed.next_batch(Device::Cpu).unwrap().unwrap();
            assert_eq!(inputs(&a), inputs(&b), "resumed batch {step}");
        }
        // Moving a running loader's position drops what its thread read ahead.
        ahead.reset().unwrap();
        let first = text_loader(true).next_batch(Device::Cpu).unwrap().unwrap();
        assert_eq!(
            inputs(&ahead.next_batch(Device::Cpu).unwrap().unwrap()),
            inputs(&first)
        );
    }

    /// A finite loader ends, and starts again from the beginning after a reset.
    #[test]
    fn finite_loader_ends_and_resets() {
        let count = |l: &mut PrefetchLoader| {
            let mut n = 0;
            while l.next_batch(Device::Cpu).unwrap().is_some() {
                n += 1;
            }
            n
        };
        let mut inline = PrefetchLoader::new(text_loader(false), 0);
        let mut ahead = PrefetchLoader::new(text_loader(false), 2);
        let n = count(&mut inline);
        assert!(n > 1);
        assert_eq!(count(&mut ahead), n);
        assert!(ahead.next_batch(Device::Cpu).unwrap().is_none());
        ahead.reset().unwrap();
        assert_eq!(count(&mut ahead), n);
    }
}
