//! Analyses behind the `titan-obs` commands: pure functions over a loaded [`crate::Run`].

pub mod chrome;
pub mod metrics;
pub mod stats;
pub mod summary;

pub use chrome::{ChromeStats, write_chrome};
pub use metrics::{MetricsLine, format_line, format_value, metrics, to_csv};
pub use stats::DurationStats;
pub use summary::{PhaseStats, Straggler, StragglerOptions, Summary, TaggedStep, summary};
