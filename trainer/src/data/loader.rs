//! Packs tokenized documents into `seq_len + 1` windows and batches them, as torchtitan's
//! HuggingFaceDataset does: every document becomes `BOS + ids + EOS`, appended to a token
//! buffer; each full window yields `input = w[..seq_len]`, `label = w[1..]`.
//!
//! Data-parallel aware: document `i` of the stream belongs to dp rank `i % dp_world`. The
//! position ([`LoaderState`]) is plain serde data so a checkpoint can resume the stream.

use std::sync::Arc;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use super::source::{Dataset, DocStream};
use super::tokenizer::TextTokenizer;

/// Where this rank's loader is in its stream (per dp rank).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Documents of the whole stream consumed so far in this epoch (all ranks' documents count,
    /// since ranks interleave).
    pub stream_idx: u64,
    /// Documents this rank has tokenized in this epoch (torchtitan's `sample_idx`).
    pub sample_idx: u64,
    /// Completed passes over the dataset.
    pub epoch: u64,
    /// Tokens read but not yet emitted in a window.
    pub token_buffer: Vec<u32>,
    /// dp rank and degree this state was written by (resuming on another layout is refused).
    pub dp_rank: u64,
    pub dp_world: u64,
}

/// One batch: `inputs` and `labels`, both (B, seq_len) int64.
pub struct Batch {
    pub inputs: Tensor,
    pub labels: Tensor,
}

/// A packing, batching loader over one dataset for one dp rank.
pub struct TextLoader {
    dataset: Dataset,
    tokenizer: Arc<TextTokenizer>,
    seq_len: usize,
    batch_size: usize,
    /// Restart at the beginning when the dataset ends (training) or stop (validation).
    infinite: bool,
    state: LoaderState,
    stream: Option<DocStream>,
}

impl TextLoader {
    pub fn new(
        dataset: Dataset,
        tokenizer: Arc<TextTokenizer>,
        seq_len: usize,
        batch_size: usize,
        dp_rank: u64,
        dp_world: u64,
        infinite: bool,
    ) -> Self {
        Self {
            dataset,
            tokenizer,
            seq_len,
            batch_size,
            infinite,
            state: LoaderState {
                dp_rank,
                dp_world,
                ..LoaderState::default()
            },
            stream: None,
        }
    }

    /// The resumable position.
    pub fn state(&self) -> &LoaderState {
        &self.state
    }

    /// Resumes from a saved position (the stream is re-read up to it).
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        if (state.dp_rank, state.dp_world) != (self.state.dp_rank, self.state.dp_world) {
            bail!(
                "dataloader state was saved by dp rank {} of {}, but this is dp rank {} of {}",
                state.dp_rank,
                state.dp_world,
                self.state.dp_rank,
                self.state.dp_world
            );
        }
        self.state = state;
        self.stream = None;
        Ok(())
    }

    /// Starts over at the beginning of the dataset (validation runs each time from the start).
    pub fn reset(&mut self) {
        let (r, w) = (self.state.dp_rank, self.state.dp_world);
        self.state = LoaderState {
            dp_rank: r,
            dp_world: w,
            ..LoaderState::default()
        };
        self.stream = None;
    }

    /// The next document of this rank, handling the end of the dataset.
    fn next_doc(&mut self) -> Result<Option<String>> {
        if self.stream.is_none() {
            // Fresh or resumed: skip what this epoch already consumed.
            let mut stream = self.dataset.open()?;
            for _ in 0..self.state.stream_idx {
                if stream.next_doc()?.is_none() {
                    break;
                }
            }
            self.stream = Some(stream);
        }
        let mut restarted_empty = false;
        loop {
            let stream = self.stream.as_mut().expect("opened above");
            match stream.next_doc()? {
                Some(doc) => {
                    let idx = self.state.stream_idx;
                    self.state.stream_idx += 1;
                    if idx % self.state.dp_world == self.state.dp_rank {
                        self.state.sample_idx += 1;
                        return Ok(Some(doc));
                    }
                }
                None => {
                    if !self.infinite {
                        return Ok(None);
                    }
                    if restarted_empty {
                        bail!(
                            "the dataset has no documents for dp rank {}",
                            self.state.dp_rank
                        );
                    }
                    tracing::warn!(
                        epoch = self.state.epoch,
                        "dataset exhausted; restarting from its beginning"
                    );
                    restarted_empty = self.state.stream_idx == 0;
                    self.state.epoch += 1;
                    self.state.stream_idx = 0;
                    self.state.sample_idx = 0;
                    self.stream = Some(self.dataset.open()?);
                }
            }
        }
    }

    /// The next `seq_len + 1` tokens, or `None` when a finite dataset ends.
    fn next_window(&mut self) -> Result<Option<Vec<u32>>> {
        let need = self.seq_len + 1;
        while self.state.token_buffer.len() < need {
            match self.next_doc()? {
                Some(doc) => {
                    let ids = self.tokenizer.encode(&doc)?;
                    self.state.token_buffer.extend_from_slice(&ids);
                }
                None => return Ok(None),
            }
        }
        let rest = self.state.token_buffer.split_off(need);
        Ok(Some(std::mem::replace(&mut self.state.token_buffer, rest)))
    }

    /// The next batch on `device`; a finite dataset's last batch may be smaller, then `None`.
    pub fn next_batch(&mut self, device: Device) -> Result<Option<Batch>> {
        let mut windows = Vec::with_capacity(self.batch_size);
        while windows.len() < self.batch_size {
            match self.next_window()? {
                Some(w) => windows.push(w),
                None => break,
            }
        }
        if windows.is_empty() {
            return Ok(None);
        }
        let (b, s) = (windows.len() as i64, self.seq_len);
        let mut inputs = Vec::with_capacity(windows.len() * s);
        let mut labels = Vec::with_capacity(windows.len() * s);
        for w in &windows {
            inputs.extend(w[..s].iter().map(|&t| t as i64));
            labels.extend(w[1..].iter().map(|&t| t as i64));
        }
        Ok(Some(Batch {
            inputs: Tensor::from_slice(&inputs)
                .view([b, s as i64])
                .to_device(device),
            labels: Tensor::from_slice(&labels)
                .view([b, s as i64])
                .to_device(device),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loader(rank: u64, world: u64, infinite: bool) -> TextLoader {
        let tok = Arc::new(TextTokenizer::embedded().unwrap());
        TextLoader::new(
            Dataset::DefaultValidation,
            tok,
            32,
            2,
            rank,
            world,
            infinite,
        )
    }

    fn tokens(b: &Batch) -> Vec<i64> {
        Vec::<i64>::try_from(&b.inputs.flatten(0, -1)).unwrap()
    }

    #[test]
    fn windows_are_shifted_and_start_with_bos() {
        let mut l = loader(0, 1, false);
        let b = l.next_batch(Device::Cpu).unwrap().unwrap();
        assert_eq!(b.inputs.size(), vec![2, 32]);
        let bos = l.tokenizer.bos_id.unwrap() as i64;
        assert_eq!(tokens(&b)[0], bos);
        let inp = Vec::<i64>::try_from(&b.inputs.get(0)).unwrap();
        let lab = Vec::<i64>::try_from(&b.labels.get(0)).unwrap();
        assert_eq!(&inp[1..], &lab[..31]);
        // The rows are consecutive 33-token windows of the BOS/EOS-wrapped document stream.
        let mut stream = Dataset::DefaultValidation.open().unwrap();
        let mut expected: Vec<i64> = Vec::new();
        while expected.len() < 66 {
            let doc = stream.next_doc().unwrap().unwrap();
            expected.extend(l.tokenizer.encode(&doc).unwrap().iter().map(|&t| t as i64));
        }
        let row1 = Vec::<i64>::try_from(&b.inputs.get(1)).unwrap();
        assert_eq!(inp, expected[..32]);
        assert_eq!(row1, expected[33..65]);
    }

    #[test]
    fn resume_from_state_continues_identically() {
        let mut a = loader(0, 1, true);
        for _ in 0..3 {
            a.next_batch(Device::Cpu).unwrap();
        }
        let saved = serde_json::to_string(a.state()).unwrap();
        let want: Vec<Vec<i64>> = (0..4)
            .map(|_| tokens(&a.next_batch(Device::Cpu).unwrap().unwrap()))
            .collect();
        let mut b = loader(0, 1, true);
        b.load_state(serde_json::from_str(&saved).unwrap()).unwrap();
        let got: Vec<Vec<i64>> = (0..4)
            .map(|_| tokens(&b.next_batch(Device::Cpu).unwrap().unwrap()))
            .collect();
        assert_eq!(got, want);
        let mut wrong = loader(1, 2, true);
        assert!(
            wrong
                .load_state(serde_json::from_str(&saved).unwrap())
                .is_err()
        );
    }

    #[test]
    fn dp_ranks_split_documents_and_finite_loader_ends() {
        let count = |rank, world| {
            let mut l = loader(rank, world, false);
            while l.next_batch(Device::Cpu).unwrap().is_some() {}
            l.state().sample_idx
        };
        let all = count(0, 1);
        assert_eq!(count(0, 2) + count(1, 2), all);
        assert!(count(0, 2) > 0 && count(1, 2) > 0);
    }

    #[test]
    fn infinite_loader_wraps_around() {
        let mut l = loader(0, 1, true);
        let mut batches = 0;
        while l.state().epoch == 0 {
            l.next_batch(Device::Cpu).unwrap().unwrap();
            batches += 1;
            assert!(batches < 100_000);
        }
        assert_eq!(l.state().epoch, 1);
    }
}
