//! Analyses behind the `titan-obs` commands and the TUI: pure functions over a span table
//! ([`SpanTable`], borrowed from a loaded [`crate::Run`] or the TUI's timeline), so every view
//! shows the same statistics, stragglers and waits.

pub mod chrome;
pub mod digested;
pub mod experts;
pub mod figured;
pub mod metrics;
pub mod pipeline;
pub mod spread;
pub mod streamed;
pub mod summary;
pub mod table;
pub mod waits;

pub use chrome::{ChromeStats, write_chrome};
pub use experts::{HostLoad, HostLoads, LayerLoad, layer_loads};
pub use figured::{analyse_figures, summary_of_figures};
pub use metrics::{HostSyncs, MetricsLine, format_line, format_value, host_syncs, metrics, to_csv};
pub use pipeline::{PipelineSummary, StageBubble, pipeline_summary, stage_groups};
pub use spread::{RankTimes, Spread, phase_step_spread, rank_times};
pub use summary::{
    Analysis, EndedEarly, ErrorRecord, NodeFiguresRead, PhaseStats, Straggler, StragglerOptions,
    Summary, TaggedStep, analyse, analyse_grouped, summary,
};
pub use table::{OwnedSpans, RunShape, SpanTable};
pub use waits::{StepWait, Wait, Waits};
