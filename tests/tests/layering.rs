//! Layers import downward only. For every crate of the workspace this reads the sources, takes
//! each file's `crate::` paths (outside comments and `#[cfg(test)]` modules) as edges between the
//! crate's top-level modules, and finds the import circles: the strongly connected components
//! of more than one module. A circle not in [`KNOWN`], or a known one that grew, fails with the
//! modules and the files whose imports close it. Known circles may only shrink (a test below
//! says so when one is gone, so the list is kept true).
//!
//! Also checked: titan-train's configuration crate depends on no libtorch (the bottom layer).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use titan_tests::workspace_root;

/// Import circles that exist today, per crate, each as its sorted module set. They are what is
/// left of issue #34's "no import circle anywhere"; remove an entry when its circle is broken.
const KNOWN: &[(&str, &[&str])] = &[];

/// titan-train's layers, bottom up (docs/ARCHITECTURE.md "Layers"): a module may reach, through
/// any chain of imports, only its own layer and those below. The configuration is a crate of
/// its own below them all (`the_config_crate_links_no_libtorch`).
const TRAINER_LAYERS: &[&[&str]] = &[
    &["distributed", "shim", "host_sync", "gpu_clock"],
    &["model"],
    &["float8"],
    &["parallelize"],
    &["train"],
];

/// The crates checked: (name, source folder).
const CRATES: &[(&str, &str)] = &[
    ("titan-cli", "cli/src"),
    ("titan-dcp", "dcp/src"),
    ("titan-storage", "storage/src"),
    ("titan-train-config", "trainer/config/src"),
    ("titan-train", "trainer/src"),
    ("titan-ckpt", "ckpt/src"),
    ("titan-obs-core", "obs/src"),
    ("titan-obs", "tui/src"),
];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/model/args.rs` -> `model`), or None for the
/// crate roots.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_string())
}

/// The source without comments and without `#[cfg(test)]` items (test code may reach any
/// layer it tests).
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut skip_depth: Option<i64> = None;
    let mut depth = 0i64;
    let mut pending_test = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        let code = match line.find("//") {
            // A `//` inside a string would cut it; paths never follow one on the same line.
            Some(i) if !line[..i].contains('"') => &line[..i],
            _ => line,
        };
        if trimmed.starts_with("#[cfg(test)]") {
            pending_test = true;
            continue;
        }
        let opens = code.matches('{').count() as i64;
        let closes = code.matches('}').count() as i64;
        if pending_test && skip_depth.is_none() && !trimmed.starts_with("#[") {
            pending_test = false;
            if opens > closes {
                skip_depth = Some(depth);
            } else {
                // A one-line item (`use ...;`, `mod x;`): skipped whole.
                depth += opens - closes;
                continue;
            }
        }
        depth += opens - closes;
        if let Some(d) = skip_depth {
            if depth <= d {
                skip_depth = None;
            }
            continue;
        }
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// The top-level modules `code` names through `crate::a` or `crate::{a, b::c}`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        // `titan_crate::x` or `$crate::x` are other paths.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group: split at commas outside nested braces.
            let mut level = 0;
            let mut start = 0;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => level += 1,
                    '}' if level == 0 => {
                        out.insert(ident(group[start..k].trim()));
                        break;
                    }
                    '}' => level -= 1,
                    ',' if level == 0 => {
                        out.insert(ident(group[start..k].trim()));
                        start = k + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// A crate's module graph: module -> (imported module -> the files that import it).
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn graph_of(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| module_of(src, f)).collect();
    let mut graph = Graph::new();
    for file in &files {
        let Some(from) = module_of(src, file) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let entry = graph.entry(from.clone()).or_default();
        for to in crate_paths(&code_of(&text)) {
            // Names that are not modules are items the crate root re-exports or defines.
            if to != from && modules.contains(&to) {
                let rel = file.strip_prefix(src).unwrap().display().to_string();
                entry.entry(to).or_default().insert(rel);
            }
        }
    }
    graph
}

/// Strongly connected components of more than one module (Tarjan's algorithm).
fn circles(graph: &Graph) -> Vec<BTreeSet<String>> {
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = BTreeSet::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                component.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The imports inside `component`, for the failure message.
fn describe(graph: &Graph, component: &BTreeSet<String>) -> String {
    let mut lines = Vec::new();
    for from in component {
        for (to, files) in &graph[from] {
            if component.contains(to) {
                let files: Vec<&str> = files.iter().map(String::as_str).collect();
                lines.push(format!("  {from} -> {to} ({})", files.join(", ")));
            }
        }
    }
    lines.join("\n")
}

#[test]
fn no_crate_has_a_new_import_circle() {
    let root = workspace_root();
    let mut problems = Vec::new();
    let mut seen_known = BTreeSet::new();
    for (name, dir) in CRATES {
        let graph = graph_of(&root.join(dir));
        for component in circles(&graph) {
            let known = KNOWN.iter().position(|(c, modules)| {
                c == name && component.iter().all(|m| modules.contains(&m.as_str()))
            });
            match known {
                Some(k) => {
                    seen_known.insert(k);
                }
                None => problems.push(format!(
                    "{name}: the modules {component:?} import each other (a layer imports one \
                     above it; move the shared item down, or the code that needs both up):\n{}",
                    describe(&graph, &component)
                )),
            }
        }
    }
    for (k, (name, modules)) in KNOWN.iter().enumerate() {
        if !seen_known.contains(&k) {
            problems.push(format!(
                "{name}: the known circle {modules:?} is gone: remove it from KNOWN in \
                 tests/tests/layering.rs"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}

/// The modules `from` reaches through imports, each with the chain that reaches it.
fn reachable(graph: &Graph, from: &str) -> BTreeMap<String, Vec<String>> {
    let mut seen = BTreeMap::new();
    let mut todo = vec![(from.to_string(), vec![from.to_string()])];
    while let Some((at, path)) = todo.pop() {
        for to in graph.get(&at).into_iter().flat_map(|e| e.keys()) {
            if to != from && !seen.contains_key(to) {
                let mut p = path.clone();
                p.push(to.clone());
                seen.insert(to.clone(), p.clone());
                todo.push((to.clone(), p));
            }
        }
    }
    seen
}

/// The layers of `layers` that `graph` breaks: a module reaching one of a higher layer.
fn upward_imports(graph: &Graph, layers: &[&[&str]]) -> Vec<String> {
    let layer_of = |m: &str| layers.iter().position(|l| l.contains(&m));
    let mut problems = Vec::new();
    for (low, modules) in layers.iter().enumerate() {
        for from in modules.iter() {
            for (to, path) in reachable(graph, from) {
                if layer_of(&to).is_some_and(|high| high > low) {
                    problems.push(format!(
                        "{from} reaches {to}, a layer above it: {}",
                        path.join(" -> ")
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn titan_train_layers_import_downward_only() {
    let graph = graph_of(&workspace_root().join("trainer/src"));
    for modules in TRAINER_LAYERS {
        for m in *modules {
            assert!(graph.contains_key(*m), "titan-train has no module `{m}`");
        }
    }
    let problems = upward_imports(&graph, TRAINER_LAYERS);
    assert!(
        problems.is_empty(),
        "titan-train's layers import upward (move the shared item down, or the code that \
         needs both up):\n{}",
        problems.join("\n")
    );
}

#[test]
fn an_import_through_another_module_is_upward_too() {
    let mut g = Graph::new();
    // low -> helper -> high: low reaches a layer above it without naming it.
    for (a, b) in [("low", "helper"), ("helper", "high"), ("high", "low")] {
        g.entry(a.into())
            .or_default()
            .entry(b.into())
            .or_default()
            .insert(format!("{a}.rs"));
    }
    let problems = upward_imports(&g, &[&["low"], &["high"]]);
    assert_eq!(
        problems,
        ["low reaches high, a layer above it: low -> helper -> high"]
    );
}

#[test]
fn the_config_crate_links_no_libtorch() {
    let manifest = std::fs::read_to_string(workspace_root().join("trainer/config/Cargo.toml"))
        .expect("trainer/config/Cargo.toml");
    let deps = manifest
        .split("[dependencies]")
        .nth(1)
        .expect("a [dependencies] table");
    for banned in ["tch", "torch-sys", "titan-train"] {
        assert!(
            !deps.lines().any(|l| l
                .split(['=', '.'])
                .next()
                .is_some_and(|k| k.trim() == banned)),
            "titan-train-config depends on {banned}: the configuration is the trainer's bottom \
             layer and must build without libtorch"
        );
    }
}

#[test]
fn the_parser_sees_grouped_and_nested_paths() {
    let code = code_of(
        "use crate::a::X;\nuse crate::{b, c::{D, e::F}};\n// crate::z\nfn f() { titan_crate::y(); \
         crate::g::h(); }\n#[cfg(test)]\nmod tests {\n    use crate::t;\n}\n",
    );
    let found: Vec<String> = crate_paths(&code).into_iter().collect();
    assert_eq!(found, ["a", "b", "c", "g"]);
    let mut g = Graph::new();
    for (a, b) in [("x", "y"), ("y", "z"), ("z", "x"), ("z", "w")] {
        g.entry(a.into())
            .or_default()
            .entry(b.into())
            .or_default()
            .insert(format!("{a}.rs"));
    }
    let c = circles(&g);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].iter().collect::<Vec<_>>(), ["x", "y", "z"]);
}
