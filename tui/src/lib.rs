//! titan-obs: the interactive side of the `titan-obs` binary.
//!
//! [`app`] holds the terminal gantt of per-rank timelines (model, view state, rendering,
//! input, `--follow`) and the static SVG/PNG gantt renderer. The non-interactive commands
//! (summary, metrics, export) live with the binary.

pub mod app;
pub mod conventions;
