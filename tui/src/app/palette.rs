//! Phase colours: fixed ones for torchtitan's phase names (so a phase looks the same in every
//! run), a palette for the rest; xterm-256 indices so the SVG/PNG renderer can use the same RGB.

use ratatui::style::Color;
use titan_obs_core::vocab::{STEP, torchtitan as tt};

/// No reds, salmons or oranges: the straggler red ([`STRAGGLER`]) must stand out from every
/// phase (167 salmon, where `broadcast` hashed, and 173 light salmon read as it).
const PALETTE: [u8; 12] = [67, 74, 143, 108, 179, 61, 132, 37, 140, 98, 150, 31];

/// The phases with colours of their own (so a phase looks the same in every run); torchtitan's
/// spellings of the same phases get the same colours.
const FIXED_PHASES: [(&str, u8); 26] = [
    (STEP, 240),
    (tt::FWD_BWD, 33),
    (tt::OPTIM, 35),
    (tt::FETCHING_BATCH, 178),
    (tt::EVAL, 44),
    ("data_loading", 178),
    ("prefetch", 186),
    ("forward_backward", 33),
    ("microbatch", 62),
    ("forward", 75),
    ("backward", 69),
    ("optimizer", 35),
    ("optimizer_step", 41),
    ("clip_grad", 71),
    ("lr_update", 114),
    ("checkpoint", 170),
    ("checkpoint_save", 170),
    ("checkpoint_load", 176),
    ("validation", 44),
    ("gc", 101),
    ("collect_dist_metrics", 139),
    ("tokenizer", 102),
    ("dataloader", 136),
    ("model_build", 96),
    ("parallelism", 66),
    ("teardown", 244),
];

/// xterm-256 colour index of a phase.
pub fn phase_index(name: &str) -> u8 {
    if let Some(&(_, index)) = FIXED_PHASES.iter().find(|(n, _)| *n == name) {
        return index;
    }
    // FNV-1a: stable across runs and platforms.
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    PALETTE[(h % PALETTE.len() as u64) as usize]
}

pub fn phase_color(name: &str) -> Color {
    Color::Indexed(phase_index(name))
}

/// Colouring by expert load (the `e` key): an experts span's colour says how many tokens the
/// rank's experts got against an even share, from blue (idle) through grey (even) to yellow
/// (hot), in colours no phase has. No reds: the straggler red keeps its meaning. Each entry: the factor below which it
/// applies, its xterm index, its legend label.
pub const LOAD_SCALE: [(f64, u8, &str); 6] = [
    (0.8, 21, "<0.8"),
    (0.95, 117, "<0.95"),
    (1.05, 252, "even"),
    (1.25, 229, "<1.25"),
    (1.5, 226, "<1.5"),
    (f64::INFINITY, 220, "≥1.5"),
];

/// xterm-256 colour index of an expert load factor (1.0: an even share).
pub fn load_index(factor: f64) -> u8 {
    LOAD_SCALE
        .iter()
        .find(|(below, _, _)| factor < *below)
        .map_or(LOAD_SCALE[LOAD_SCALE.len() - 1].1, |e| e.1)
}

/// Straggler highlight.
pub const STRAGGLER: Color = Color::Indexed(196);
pub const STRAGGLER_INDEX: u8 = 196;

/// RGB of an xterm-256 colour index.
pub fn rgb(index: u8) -> (u8, u8, u8) {
    const BASIC: [(u8, u8, u8); 16] = [
        (0, 0, 0),
        (205, 0, 0),
        (0, 205, 0),
        (205, 205, 0),
        (0, 0, 238),
        (205, 0, 205),
        (0, 205, 205),
        (229, 229, 229),
        (127, 127, 127),
        (255, 0, 0),
        (0, 255, 0),
        (255, 255, 0),
        (92, 92, 255),
        (255, 0, 255),
        (0, 255, 255),
        (255, 255, 255),
    ];
    match index {
        0..=15 => BASIC[index as usize],
        16..=231 => {
            let i = index - 16;
            let level = |v: u8| if v == 0 { 0 } else { 55 + 40 * v };
            (level(i / 36), level((i / 6) % 6), level(i % 6))
        }
        _ => {
            let g = 8 + 10 * (index - 232);
            (g, g, g)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Euclidean RGB distance.
    fn distance(a: u8, b: u8) -> f64 {
        let ((r1, g1, b1), (r2, g2, b2)) = (rgb(a), rgb(b));
        let d = |x: u8, y: u8| (f64::from(x) - f64::from(y)).powi(2);
        (d(r1, r2) + d(g1, g2) + d(b1, b2)).sqrt()
    }

    #[test]
    fn no_phase_colour_is_near_the_straggler_red() {
        // Every fixed name, a spread of other names (palette colours), every palette entry.
        let mut names: Vec<String> = [
            "step",
            "data_loading",
            "forward_backward",
            "microbatch",
            "forward",
            "backward",
            "optimizer",
            "optimizer_step",
            "checkpoint",
            "checkpoint_load",
            "validation",
            "gc",
            "collect_dist_metrics",
            "tokenizer",
            "dataloader",
            "model_build",
            "parallelism",
            "teardown",
            "build",
            "init",
        ]
        .map(String::from)
        .to_vec();
        names.extend((0..200).map(|i| format!("phase_{i}")));
        for n in &names {
            let d = distance(phase_index(n), STRAGGLER_INDEX);
            assert!(
                d >= 150.0,
                "`{n}` ({}) is {d:.0} from the straggler red",
                phase_index(n)
            );
        }
        for &p in &PALETTE {
            assert!(distance(p, STRAGGLER_INDEX) >= 150.0, "palette {p}");
        }
    }

    #[test]
    fn load_colours_go_from_idle_to_hot_and_none_is_near_the_straggler_red() {
        assert_eq!(load_index(0.0), 21);
        assert_eq!(load_index(0.9), 117);
        assert_eq!(load_index(1.0), 252);
        assert_eq!(load_index(1.2), 229);
        assert_eq!(load_index(1.49), 226);
        assert_eq!(load_index(1.5), 220);
        // No phase shares a load colour: a forward span must not read as an idle expert.
        let mut phases: Vec<u8> = PALETTE.to_vec();
        phases.extend((0..200).map(|i| phase_index(&format!("phase_{i}"))));
        phases.extend(FIXED_PHASES.iter().map(|(_, index)| index));
        for (_, index, label) in LOAD_SCALE {
            let d = distance(index, STRAGGLER_INDEX);
            assert!(
                d >= 150.0,
                "{label} ({index}) is {d:.0} from the straggler red"
            );
            assert!(
                !phases.contains(&index),
                "{label} ({index}) is a phase colour"
            );
        }
    }

    #[test]
    fn xterm_cube_and_grey() {
        assert_eq!(rgb(16), (0, 0, 0));
        assert_eq!(rgb(196), (255, 0, 0));
        assert_eq!(rgb(33), (0, 135, 255));
        assert_eq!(rgb(240), (88, 88, 88));
    }
}
