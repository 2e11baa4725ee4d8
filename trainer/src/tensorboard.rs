//! TensorBoard event files (`metrics.enable_tensorboard`), as torchtitan's TensorBoardLogger
//! writes them through torch.utils.tensorboard: `events.out.tfevents.<secs>.<host>.<pid>.<n>`
//! under `<dump_folder>/<save_tb_folder>/<YYYYMMDD-HHMM>` (plus `rank_<r>` with
//! `save_for_all_ranks`), one scalar per metric and step.
//!
//! The file is a TFRecord stream: per record the little-endian u64 length, its masked CRC32C,
//! the bytes of one `tensorflow.Event` protobuf and their masked CRC32C. The first event carries
//! `file_version = "brain.Event:2"`; the others one `Summary` of `simple_value` scalars.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use prost::Message;

/// `tensorflow.Event` (event.proto): the fields titan writes.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary` (summary.proto).
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value` scalar.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// TFRecord's CRC: CRC32C rotated right by 15 bits plus a constant.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its CRC, the data, its CRC.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An open event file; every [`EventWriter::scalars`] call is written (and flushed) at once, so
/// TensorBoard sees the run while it trains.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// torchtitan's folder for this run: `<dump>/<save_tb_folder>/<YYYYMMDD-HHMM>[/rank_<r>]`.
    pub fn run_dir(dump_folder: &Path, tb_folder: &str, rank: Option<usize>) -> PathBuf {
        let dir = dump_folder
            .join(tb_folder)
            .join(chrono::Local::now().format("%Y%m%d-%H%M").to_string());
        match rank {
            Some(r) => dir.join(format!("rank_{r}")),
            None => dir,
        }
    }

    /// Creates `dir` and a new event file in it, starting with the file-version event.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let now = wall_time();
        let name = format!(
            "events.out.tfevents.{}.{host}.{}.0",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut writer = Self { file, path };
        writer.write(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event holding `values` as scalars of `step`.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        let summary = Summary {
            value: values
                .iter()
                .map(|(tag, v)| SummaryValue {
                    tag: tag.clone(),
                    simple_value: Some(*v as f32),
                })
                .collect(),
        };
        self.write(&Event {
            wall_time: wall_time(),
            step: step as i64,
            file_version: None,
            summary: Some(summary),
        })
    }

    fn write(&mut self, event: &Event) -> Result<()> {
        self.file
            .write_all(&record(&event.encode_to_vec()))
            .and_then(|()| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_framed_with_masked_crc32c() {
        // TFRecord's masked CRC of the 8 length bytes of an empty record, as TensorFlow computes.
        let r = record(b"");
        assert_eq!(r.len(), 16);
        assert_eq!(&r[..8], &0u64.to_le_bytes());
        let crc = u32::from_le_bytes(r[8..12].try_into().unwrap());
        assert_eq!(
            crc,
            crc32c::crc32c(&[0; 8])
                .rotate_right(15)
                .wrapping_add(0xa282_ead8)
        );
        // An event round-trips through the protobuf encoding.
        let e = Event {
            wall_time: 1.5,
            step: 3,
            file_version: None,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: "training/loss_mean".into(),
                    simple_value: Some(2.5),
                }],
            }),
        };
        assert_eq!(Event::decode(&e.encode_to_vec()[..]).unwrap(), e);
    }
}
