//! The interactive gantt (`titan-obs RUN`) and the static gantt image (`titan-obs gantt`).
//!
//! Data flows one way: a [`terminal::TimelineSource`] (the run directory, read through
//! `titan_obs_core`) builds a [`model::Timeline`] with everything precomputed; [`view::View`] holds
//! what the user looks at and the navigation actions; [`render`] draws a frame from both, with
//! cost bounded by the screen size ([`cells`]); [`input`] maps keys and mouse to actions;
//! [`export`] lays the same gantt out as SVG/PNG.

pub mod cells;
pub mod cli;
pub mod demo;
pub mod detail;
pub mod detail_source;
pub mod export;
pub mod input;
pub mod model;
pub mod palette;
pub mod render;
pub mod source;
pub mod terminal;
pub mod units;
pub mod view;
