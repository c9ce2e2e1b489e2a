//! The shim's layering, read from its source: each folder under `src/` is one layer and
//! names only the layers below it (`crate::` paths), and no circle of imports spans more
//! than three modules. A newcomer can then read the shim from the bottom up.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom first.
const LAYERS: &[&str] = &["driver", "books", "enforcer", "control", "hooks", "registry"];

/// Every module of `src/` (a file), by its path from the crate root (`control::gate`).
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut found = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src).expect("under src").with_extension("");
            let mut parts: Vec<String> =
                relative.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
                parts.pop();
            }
            found.insert(parts.join("::"), path);
        }
    }
    found
}

/// The modules `text` names with `crate::` paths, each the longest known module prefix.
fn named(text: &str, known: &BTreeMap<String, PathBuf>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        if text[..at].ends_with('$') {
            continue;
        }
        let path: String =
            text[at + 7..].chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect();
        let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
        if let Some(module) =
            (1..=parts.len()).rev().map(|n| parts[..n].join("::")).find(|m| known.contains_key(m))
        {
            out.insert(module);
        }
    }
    out
}

fn layer(module: &str) -> Option<usize> {
    let top = module.split("::").next()?;
    LAYERS.iter().position(|l| *l == top)
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let known = modules(&src);
    known
        .iter()
        .map(|(module, path)| {
            let text = std::fs::read_to_string(path).expect("read module");
            let mut deps = named(&text, &known);
            deps.remove(module);
            deps.remove("");
            (module.clone(), deps)
        })
        .collect()
}

#[test]
fn every_folder_is_a_layer_and_names_only_the_layers_below_it() {
    let graph = graph();
    let mut upward = Vec::new();
    for (module, deps) in &graph {
        if module.is_empty() {
            continue;
        }
        let Some(from) = layer(module) else {
            upward.push(format!("{module} is in no layer folder ({LAYERS:?})"));
            continue;
        };
        for dep in deps {
            if layer(dep).is_some_and(|to| to > from) {
                upward.push(format!("{module} -> {dep}"));
            }
        }
    }
    assert!(upward.is_empty(), "modules that name a layer above their own:\n{}", upward.join("\n"));
}

#[test]
fn no_circle_of_imports_spans_more_than_three_modules() {
    let graph = graph();
    // Tarjan's strongly connected components: a circle lies within one component, and a
    // component of at most three modules holds no circle of more.
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<&'a str>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.components.push(component);
            }
        }
    }
    let mut walk = Walk {
        graph: &graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    // Within each component, look for a circle through more than three modules: a
    // depth-first walk of simple paths from each module, along modules after it in the
    // component's order (each circle is found from its first module only).
    let mut long = Vec::new();
    for component in walk.components.iter().filter(|c| c.len() > 3) {
        let mut members: Vec<&str> = component.clone();
        members.sort();
        for (i, &start) in members.iter().enumerate() {
            let allowed: BTreeSet<&str> = members[i..].iter().copied().collect();
            let mut path = vec![start];
            longer_circle(&graph, &allowed, start, &mut path, &mut long);
        }
    }
    assert!(long.is_empty(), "circles of imports through more than three modules:\n{}", long.join("\n"));
}

/// Extends `path` (a simple path from `start`) through `allowed` modules; records a circle
/// back to `start` through more than three modules.
fn longer_circle<'a>(
    graph: &'a BTreeMap<String, BTreeSet<String>>,
    allowed: &BTreeSet<&'a str>,
    start: &'a str,
    path: &mut Vec<&'a str>,
    long: &mut Vec<String>,
) {
    if long.len() >= 10 {
        return;
    }
    let last = *path.last().expect("a path");
    for next in graph.get(last).into_iter().flatten() {
        let next = next.as_str();
        if next == start && path.len() > 3 {
            long.push(format!("{} -> {start}", path.join(" -> ")));
        } else if allowed.contains(next) && !path.contains(&next) {
            path.push(next);
            longer_circle(graph, allowed, start, path, long);
            path.pop();
        }
    }
}
