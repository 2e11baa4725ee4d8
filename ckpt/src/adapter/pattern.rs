//! Tensor name patterns: dotted names whose parts may be `{L}` (layer index) or `{E}` (expert
//! index), matched against concrete names and filled back in.

/// The indices a pattern captured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captures {
    pub layer: Option<u64>,
    pub expert: Option<u64>,
}

/// Matches `name` against `pattern`; `{L}` and `{E}` parts match decimal numbers.
pub fn matches(pattern: &str, name: &str) -> Option<Captures> {
    let mut caps = Captures::default();
    let mut ps = pattern.split('.');
    let mut ns = name.split('.');
    loop {
        match (ps.next(), ns.next()) {
            (None, None) => return Some(caps),
            (Some(p), Some(n)) => {
                let slot = match p {
                    "{L}" => &mut caps.layer,
                    "{E}" => &mut caps.expert,
                    _ if p == n => continue,
                    _ => return None,
                };
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                *slot = Some(n.parse().ok()?);
            }
            _ => return None,
        }
    }
}

/// `pattern` with its `{L}` / `{E}` parts replaced by `caps`.
pub fn fill(pattern: &str, caps: Captures) -> String {
    pattern
        .split('.')
        .map(|p| match p {
            "{L}" => caps.layer.map(|l| l.to_string()).unwrap_or_default(),
            "{E}" => caps.expert.map(|e| e.to_string()).unwrap_or_default(),
            _ => p.to_string(),
        })
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_and_fill() {
        let p = "model.layers.{L}.mlp.experts.{E}.gate_proj.weight";
        let c = matches(p, "model.layers.3.mlp.experts.17.gate_proj.weight").unwrap();
        assert_eq!((c.layer, c.expert), (Some(3), Some(17)));
        assert_eq!(fill(p, c), "model.layers.3.mlp.experts.17.gate_proj.weight");
        assert!(matches(p, "model.layers.x.mlp.experts.1.gate_proj.weight").is_none());
        assert!(matches(p, "model.layers.3.mlp.experts.1.gate_proj").is_none());
        assert!(matches("norm.weight", "norm.weight").is_some());
        assert!(matches("norm.weight", "norm.bias").is_none());
    }
}
