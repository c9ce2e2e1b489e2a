//! The Grafana dashboard (`examples/grafana/gpufrac-dashboard.json`) and the arbiter's
//! metrics cannot drift apart: an arbiter on simgpu, with `--metrics`, serves a workload
//! that makes bursts grant, wait, time out, end a lower-priority holder, be refused and
//! swap; its `GET /metrics` is scraped, and every metric name a panel's query or a template
//! variable uses (every identifier starting `gpufrac_`) must be a sample name the arbiter
//! exposes (a counter's `_total`, a histogram's `_bucket`, `_sum`, `_count`), every label a
//! query matches on, groups by or shows in its legend one its series carry (or one the
//! PodMonitor in `examples/kubernetes/monitoring/` adds, such as `node`), and every literal
//! label value it matches one the series have. Renaming a metric, a label or a `kind` in
//! the arbiter, or mistyping one in the dashboard, fails here (the test makes sure of that
//! by mutating the dashboard and the scrape). The workload must give every family the
//! dashboard reads series with labels worth checking: the test fails, naming them, if it
//! left any without.
//!
//! A fresh node's dashboard shows zeros, not "No data": an arbiter that has served nobody
//! has a sample of every metric the dashboard's queries name, for each of its GPUs where
//! the metric is per GPU (read from the dashboard, so the check follows it).
//!
//! The dashboard is checked as a dashboard too: valid JSON with a `${datasource}`
//! Prometheus variable and `node` and `gpu` variables, unique panel ids and titles, every
//! panel described, on the `${datasource}` variable, inside the 24-column grid without
//! overlapping another, with at least one target whose query is balanced. The PodMonitor
//! selects the arbiter pods of both DaemonSets (device plugin and DRA) in their namespace
//! and scrapes the port their `--metrics` listens on.
//!
//! The PodMonitor is read with PyYAML from the workspace's `.venv/` (as in
//! `manifests.rs`); the live test needs the workspace built, as the other end-to-end tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use gpufrac_e2e::size::{GIB, MIB};
use gpufrac_e2e::{
    bursting_server, compile_c, skip_on_real_gpu, unique, wait_for, Arbiter, ChildProcess, ShimSettings,
    SimGpu, TIMEOUT,
};
use serde_json::Value;

/// Labels Prometheus adds to every series it scrapes (`job`, `instance`) and those the
/// Prometheus Operator adds for a PodMonitor; the PodMonitor's own relabelings (its
/// `targetLabel`s, read from the file) are added to these.
const SCRAPE_LABELS: &[&str] = &["job", "instance", "namespace", "pod", "container", "endpoint"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dashboard_path() -> PathBuf {
    repo().join("examples/grafana/gpufrac-dashboard.json")
}

fn dashboard() -> Value {
    let path = dashboard_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

// ---- What the arbiter exports, from its text exposition ----

/// One metric family of the exposition: its type (`# TYPE`), and per sample name the
/// label names and values its samples carry.
#[derive(Debug, Default)]
struct Family {
    kind: String,
    labels: BTreeMap<String, BTreeSet<String>>,
    samples: usize,
}

/// Every family the exposition declares, by family name.
#[derive(Debug, Default)]
struct Exported {
    families: BTreeMap<String, Family>,
}

/// The suffixes of the sample names of a family of type `kind` (OpenMetrics).
fn suffixes(kind: &str) -> &'static [&'static str] {
    match kind {
        "counter" => &["_total", "_created"],
        "histogram" => &["_bucket", "_sum", "_count", "_created"],
        "summary" => &["", "_sum", "_count", "_created"],
        "info" => &["_info"],
        _ => &[""],
    }
}

impl Exported {
    fn parse(text: &str) -> Exported {
        let mut exported = Exported::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut words = rest.split_whitespace();
                let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                    panic!("a malformed TYPE line: {line}")
                };
                exported.families.entry(name.to_owned()).or_default().kind = kind.to_owned();
            } else if line.starts_with('#') || line.trim().is_empty() {
                continue;
            } else {
                let (name, labels) = parse_sample(line);
                let family = exported
                    .family_of_mut(&name)
                    .unwrap_or_else(|| panic!("sample {name} of no declared family: {line}"));
                family.samples += 1;
                for (label, value) in labels {
                    family.labels.entry(label).or_default().insert(value);
                }
            }
        }
        exported
    }

    /// The family a sample named `sample` belongs to.
    fn family_of(&self, sample: &str) -> Option<(&str, &Family)> {
        self.families.iter().find_map(|(name, family)| {
            let suffix = sample.strip_prefix(name.as_str())?;
            suffixes(&family.kind).contains(&suffix).then_some((name.as_str(), family))
        })
    }

    fn family_of_mut(&mut self, sample: &str) -> Option<&mut Family> {
        let name = self.family_of(sample)?.0.to_owned();
        self.families.get_mut(&name)
    }

    /// Every sample name the families may expose, for messages.
    fn sample_names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for (name, family) in &self.families {
            for suffix in suffixes(&family.kind) {
                if *suffix != "_created" {
                    names.push(format!("{name}{suffix}"));
                }
            }
        }
        names
    }
}

/// A sample line's name and labels: `name{a="x",b="y\"z"} value [timestamp]`.
fn parse_sample(line: &str) -> (String, Vec<(String, String)>) {
    let end = line.find(['{', ' ']).unwrap_or_else(|| panic!("a sample line with no value: {line}"));
    let name = line[..end].to_owned();
    let mut labels = Vec::new();
    if line[end..].starts_with('{') {
        let mut chars = line[end + 1..].chars().peekable();
        loop {
            match chars.peek() {
                Some('}') => break,
                Some(',') | Some(' ') => {
                    chars.next();
                    continue;
                }
                None => panic!("unterminated labels: {line}"),
                _ => {}
            }
            let label: String = chars.by_ref().take_while(|&c| c != '=').collect();
            assert_eq!(chars.next(), Some('"'), "a label value not quoted: {line}");
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some('\\') => match chars.next() {
                        Some('n') => value.push('\n'),
                        Some(c) => value.push(c),
                        None => panic!("unterminated label value: {line}"),
                    },
                    Some('"') => break,
                    Some(c) => value.push(c),
                    None => panic!("unterminated label value: {line}"),
                }
            }
            labels.push((label.trim().to_owned(), value));
        }
    }
    (name, labels)
}

// ---- What the dashboard queries, from its PromQL ----

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    Number,
    /// A Grafana variable: `$node`, `${node}`, `$__rate_interval`.
    Variable,
    Punct(String),
}

/// PromQL (with Grafana's variables) as tokens; comments dropped. Durations (`5m`) and
/// numbers are `Number`.
fn tokenize(expr: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '$' {
            i += 1;
            if chars.get(i) == Some(&'{') {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                if i == chars.len() {
                    return Err(format!("unterminated ${{...}} in {expr}"));
                }
                i += 1;
            } else {
                while i < chars.len() && ident(chars[i]) {
                    i += 1;
                }
            }
            tokens.push(Token::Variable);
        } else if c == '"' || c == '\'' || c == '`' {
            let mut value = String::new();
            i += 1;
            loop {
                match chars.get(i) {
                    None => return Err(format!("unterminated string in {expr}")),
                    Some('\\') if c != '`' => {
                        value
                            .push(*chars.get(i + 1).ok_or_else(|| format!("unterminated string in {expr}"))?);
                        i += 2;
                    }
                    Some(&q) if q == c => {
                        i += 1;
                        break;
                    }
                    Some(&other) => {
                        value.push(other);
                        i += 1;
                    }
                }
            }
            tokens.push(Token::Str(value));
        } else if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            while i < chars.len() && (ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
            tokens.push(Token::Number);
        } else if ident(c) {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            tokens.push(Token::Ident(chars[start..i].iter().collect()));
        } else {
            let two: String = chars[i..(i + 2).min(chars.len())].iter().collect();
            let op = if ["=~", "!~", "!=", "==", ">=", "<="].contains(&two.as_str()) {
                two
            } else {
                c.to_string()
            };
            i += op.chars().count();
            tokens.push(Token::Punct(op));
        }
    }
    // Brackets balance.
    let mut open = Vec::new();
    for t in &tokens {
        if let Token::Punct(p) = t {
            match p.as_str() {
                "(" | "{" | "[" => open.push(p.clone()),
                ")" | "}" | "]" => {
                    let want = match p.as_str() {
                        ")" => "(",
                        "}" => "{",
                        _ => "[",
                    };
                    if open.pop().as_deref() != Some(want) {
                        return Err(format!("unbalanced {p} in {expr}"));
                    }
                }
                _ => {}
            }
        }
    }
    if let Some(p) = open.pop() {
        return Err(format!("unclosed {p} in {expr}"));
    }
    Ok(tokens)
}

/// A label matcher of a selector: `label op "value"` (the value `None` when it is a
/// Grafana variable).
#[derive(Debug)]
struct Matcher {
    metric: String,
    label: String,
    op: String,
    value: Option<String>,
}

/// What one query uses: metric names (identifiers starting `gpufrac_`), their selectors'
/// matchers, and the labels of `by`/`without`/`on`/`ignoring`/`group_left`/`group_right`.
#[derive(Debug, Default)]
struct Query {
    metrics: BTreeSet<String>,
    matchers: Vec<Matcher>,
    grouping: BTreeSet<String>,
    /// Only the labels of `by (...)`: what an aggregation keeps.
    by: BTreeSet<String>,
}

fn parse_query(expr: &str) -> Result<Query, String> {
    let tokens = tokenize(expr)?;
    let mut query = Query::default();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            Token::Ident(name) if name.starts_with("gpufrac_") => {
                query.metrics.insert(name.clone());
                if tokens.get(i + 1) == Some(&Token::Punct("{".into())) {
                    i += 2;
                    while tokens.get(i) != Some(&Token::Punct("}".into())) {
                        match (&tokens.get(i), &tokens.get(i + 1), &tokens.get(i + 2)) {
                            (Some(Token::Ident(label)), Some(Token::Punct(op)), Some(value))
                                if ["=", "!=", "=~", "!~"].contains(&op.as_str()) =>
                            {
                                let value = match value {
                                    Token::Str(s) if !s.contains('$') => Some(s.clone()),
                                    Token::Str(_) | Token::Variable => None,
                                    other => return Err(format!("a matcher's value {other:?} in {expr}")),
                                };
                                query.matchers.push(Matcher {
                                    metric: name.clone(),
                                    label: label.clone(),
                                    op: op.clone(),
                                    value,
                                });
                                i += 3;
                            }
                            (Some(Token::Punct(comma)), _, _) if comma == "," => i += 1,
                            _ => {
                                return Err(format!(
                                    "a selector of {name} that is not label matchers: {expr}"
                                ))
                            }
                        }
                    }
                }
            }
            Token::Ident(word)
                if ["by", "without", "on", "ignoring", "group_left", "group_right"]
                    .contains(&word.as_str())
                    && tokens.get(i + 1) == Some(&Token::Punct("(".into())) =>
            {
                i += 2;
                while let Some(t) = tokens.get(i) {
                    match t {
                        Token::Ident(label) => {
                            query.grouping.insert(label.clone());
                            if word == "by" {
                                query.by.insert(label.clone());
                            }
                        }
                        Token::Punct(p) if p == "," => {}
                        Token::Punct(p) if p == ")" => break,
                        other => return Err(format!("{other:?} in the labels of {word}: {expr}")),
                    }
                    i += 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    Ok(query)
}

/// The labels a legend format shows: `{{label}}`.
fn legend_labels(format: &str) -> Vec<String> {
    format
        .split("{{")
        .skip(1)
        .filter_map(|s| s.split_once("}}").map(|(label, _)| label.trim().to_owned()))
        .collect()
}

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        all.push(panel);
        for nested in panel["panels"].as_array().into_iter().flatten() {
            all.push(nested);
        }
    }
    all
}

/// `(where, query, legend format)` of every panel target and template-variable query.
fn queries(dashboard: &Value) -> Vec<(String, String, String)> {
    let mut all = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?");
            let ref_id = target["refId"].as_str().unwrap_or("?");
            all.push((
                format!("panel {title:?} target {ref_id}"),
                target["expr"].as_str().unwrap_or_default().to_owned(),
                target["legendFormat"].as_str().unwrap_or_default().to_owned(),
            ));
        }
    }
    for variable in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        if variable["type"] == "query" {
            let query = match &variable["query"] {
                Value::String(s) => s.clone(),
                q => q["query"].as_str().unwrap_or_default().to_owned(),
            };
            all.push((format!("variable {}", variable["name"]), query, String::new()));
        }
    }
    all
}

/// A template-variable query `label_values(selector, label)`: the selector and the label.
fn label_values(query: &str) -> Option<(&str, &str)> {
    let inner = query.trim().strip_prefix("label_values(")?.strip_suffix(')')?;
    let (selector, label) = inner.rsplit_once(',')?;
    Some((selector, label.trim()))
}

/// What is wrong with the dashboard's queries against what `exported` exposes, with
/// `scrape_labels` the labels the scrape adds: one line per problem.
fn problems(dashboard: &Value, exported: &Exported, scrape_labels: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let all = queries(dashboard);
    if all.is_empty() {
        problems.push("the dashboard has no queries".to_owned());
    }
    for (place, expr, legend) in all {
        // `label_values(selector, label)`: the selector is PromQL, the label must be one
        // of its series'.
        let (promql, shown) = match label_values(&expr) {
            Some((selector, label)) => (selector.to_owned(), vec![label.to_owned()]),
            None => (expr.clone(), legend_labels(&legend)),
        };
        let query = match parse_query(&promql) {
            Ok(q) => q,
            Err(e) => {
                problems.push(format!("{place}: {e}"));
                continue;
            }
        };
        if query.metrics.is_empty() {
            problems.push(format!("{place}: queries no gpufrac_ metric: {expr}"));
        }
        // Labels any of the query's metrics carry, plus the scrape's.
        let mut known: BTreeSet<String> = scrape_labels.clone();
        let mut unchecked = false;
        for metric in &query.metrics {
            match exported.family_of(metric) {
                None => {
                    let hint = match exported.families.get(metric.as_str()) {
                        Some(f) => format!(
                            " ({metric} is a {} family: its samples are {})",
                            f.kind,
                            suffixes(&f.kind)
                                .iter()
                                .map(|s| format!("{metric}{s}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                        None => String::new(),
                    };
                    problems.push(format!(
                        "{place}: {metric} is not exported by the arbiter{hint}; it exports {:?}",
                        exported.sample_names()
                    ));
                }
                Some((_, family)) if family.samples == 0 => unchecked = true,
                Some((_, family)) => {
                    known.extend(family.labels.keys().cloned());
                    // `le` is on the buckets only.
                    if !metric.ends_with("_bucket") {
                        known.remove("le");
                    }
                }
            }
        }
        for m in &query.matchers {
            let Some((_, family)) = exported.family_of(&m.metric) else { continue };
            if family.samples == 0 {
                continue;
            }
            if scrape_labels.contains(&m.label) {
                continue;
            }
            let Some(values) = family.labels.get(&m.label) else {
                problems.push(format!(
                    "{place}: {} has no label {:?} (its labels: {:?})",
                    m.metric,
                    m.label,
                    family.labels.keys().collect::<Vec<_>>()
                ));
                continue;
            };
            // A literal value, or an alternation of literals, must be one the series have.
            if let (Some(value), "=" | "=~") = (&m.value, m.op.as_str()) {
                let literals: Vec<&str> = if m.op == "=" {
                    vec![value.as_str()]
                } else if value.chars().all(|c| c.is_ascii_alphanumeric() || "_-|".contains(c)) {
                    value.split('|').collect()
                } else {
                    Vec::new()
                };
                for literal in literals {
                    if !values.contains(literal) {
                        problems.push(format!(
                            "{place}: no series of {} has {}={literal:?} (it has {values:?})",
                            m.metric, m.label
                        ));
                    }
                }
            }
        }
        if unchecked {
            continue;
        }
        for label in &query.grouping {
            if !known.contains(label) {
                problems
                    .push(format!("{place}: groups by {label:?}, a label none of {:?} has", query.metrics));
            }
        }
        for label in shown {
            if !known.contains(&label) {
                problems.push(format!("{place}: shows {label:?}, a label none of {:?} has", query.metrics));
            } else if !query.by.is_empty() && !query.by.contains(&label) {
                problems
                    .push(format!("{place}: shows {label:?}, which its aggregation by {:?} drops", query.by));
            }
        }
    }
    problems
}

// ---- The dashboard as a dashboard ----

#[test]
fn the_dashboard_is_a_well_formed_grafana_dashboard() {
    let dashboard = dashboard();
    let mut problems = Vec::new();
    let schema = dashboard["schemaVersion"].as_u64().unwrap_or(0);
    if !(36..=41).contains(&schema) {
        problems.push(format!("schemaVersion {schema}, not a current one (36 to 41)"));
    }
    for key in ["title", "uid"] {
        if dashboard[key].as_str().is_none_or(str::is_empty) {
            problems.push(format!("no {key}"));
        }
    }
    // Template variables: the Prometheus data source, then node and gpu from its series.
    let variables = dashboard["templating"]["list"].as_array().cloned().unwrap_or_default();
    let variable = |name: &str| variables.iter().find(|v| v["name"] == name);
    match variable("datasource") {
        Some(v) if v["type"] == "datasource" && v["query"] == "prometheus" => {}
        other => problems.push(format!("no Prometheus data-source variable `datasource`: {other:?}")),
    }
    for name in ["node", "gpu"] {
        match variable(name) {
            Some(v) if v["type"] == "query" && v["datasource"]["uid"] == "${datasource}" => {
                let query = v["query"]["query"].as_str().or(v["query"].as_str()).unwrap_or_default();
                if label_values(query).map(|(_, label)| label) != Some(name) {
                    problems.push(format!("variable {name} is not label_values(..., {name}): {query}"));
                }
            }
            other => problems.push(format!("no query variable {name} on ${{datasource}}: {other:?}")),
        }
    }
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    let mut boxes: Vec<(String, [u64; 4])> = Vec::new();
    let all = panels(&dashboard);
    if all.iter().filter(|p| p["type"] != "row").count() < 10 {
        problems.push(format!("only {} panels", all.len()));
    }
    for panel in all {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        if title.is_empty() {
            problems.push(format!("a panel with no title: {panel}"));
        }
        if !titles.insert(title.clone()) {
            problems.push(format!("two panels titled {title:?}"));
        }
        match panel["id"].as_u64() {
            Some(id) if ids.insert(id) => {}
            id => problems.push(format!("panel {title:?}: id {id:?} missing or not unique")),
        }
        let grid = &panel["gridPos"];
        let Some([h, w, x, y]) = ["h", "w", "x", "y"]
            .map(|k| grid[k].as_u64())
            .into_iter()
            .collect::<Option<Vec<u64>>>()
            .and_then(|v| <[u64; 4]>::try_from(v).ok())
        else {
            problems.push(format!("panel {title:?}: no gridPos h, w, x, y: {grid}"));
            continue;
        };
        if x + w > 24 || h == 0 || w == 0 {
            problems.push(format!("panel {title:?}: outside the 24-column grid: {grid}"));
        }
        for (other, [oh, ow, ox, oy]) in &boxes {
            if x < ox + ow && *ox < x + w && y < oy + oh && *oy < y + h {
                problems.push(format!("panels {title:?} and {other:?} overlap"));
            }
        }
        boxes.push((title.clone(), [h, w, x, y]));
        if panel["type"] == "row" {
            continue;
        }
        if panel["type"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("panel {title:?} has no type"));
        }
        if panel["description"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("panel {title:?} has no description"));
        }
        if panel["datasource"]["uid"] != "${datasource}" {
            problems.push(format!("panel {title:?} is not on ${{datasource}}: {}", panel["datasource"]));
        }
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            problems.push(format!("panel {title:?} has no target"));
        }
        let mut refs = BTreeSet::new();
        for target in &targets {
            let ref_id = target["refId"].as_str().unwrap_or_default();
            if ref_id.is_empty() || !refs.insert(ref_id.to_owned()) {
                problems.push(format!("panel {title:?}: refId {ref_id:?} missing or repeated"));
            }
            let expr = target["expr"].as_str().unwrap_or_default();
            if expr.trim().is_empty() {
                problems.push(format!("panel {title:?} target {ref_id}: no expr"));
            } else if let Err(e) = parse_query(expr) {
                problems.push(format!("panel {title:?} target {ref_id}: {e}"));
            }
            if !target["datasource"].is_null() && target["datasource"]["uid"] != "${datasource}" {
                problems.push(format!("panel {title:?} target {ref_id} is not on ${{datasource}}"));
            }
        }
    }
    assert!(problems.is_empty(), "{}:\n{}", dashboard_path().display(), problems.join("\n"));
}

// ---- The PodMonitor ----

fn pod_monitor() -> Value {
    let docs = documents("monitoring/podmonitor.yaml");
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "PodMonitor").collect();
    assert_eq!(found.len(), 1, "one PodMonitor in examples/kubernetes/monitoring/podmonitor.yaml: {docs:?}");
    found[0].clone()
}

/// The labels the PodMonitor's relabelings set, and Prometheus's and the operator's own.
fn scrape_labels() -> BTreeSet<String> {
    let mut labels: BTreeSet<String> = SCRAPE_LABELS.iter().map(|s| s.to_string()).collect();
    for endpoint in pod_monitor()["spec"]["podMetricsEndpoints"].as_array().into_iter().flatten() {
        for relabeling in endpoint["relabelings"].as_array().into_iter().flatten() {
            if let Some(label) = relabeling["targetLabel"].as_str() {
                labels.insert(label.to_owned());
            }
        }
    }
    labels
}

/// Whether a label selector (`matchLabels`, `matchExpressions`) selects `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let match_labels = selector["matchLabels"].as_object().into_iter().flatten();
    let expressions = selector["matchExpressions"].as_array().into_iter().flatten();
    match_labels.into_iter().all(|(k, v)| labels[k] == *v)
        && expressions.into_iter().all(|e| {
            let value = &labels[e["key"].as_str().unwrap_or_default()];
            let values = e["values"].as_array().cloned().unwrap_or_default();
            match e["operator"].as_str() {
                Some("In") => values.contains(value),
                Some("NotIn") => !values.contains(value),
                Some("Exists") => !value.is_null(),
                Some("DoesNotExist") => value.is_null(),
                _ => false,
            }
        })
}

#[test]
fn the_pod_monitor_scrapes_every_arbiter_on_its_metrics_port() {
    let monitor = pod_monitor();
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1", "{monitor}");
    let spec = &monitor["spec"];
    let endpoints = spec["podMetricsEndpoints"].as_array().cloned().unwrap_or_default();
    assert_eq!(endpoints.len(), 1, "one endpoint: {spec}");
    let endpoint = &endpoints[0];
    assert_eq!(endpoint["path"], "/metrics", "{endpoint}");
    // `node` is what the dashboard's variable and legends use; it comes from the pod's node.
    let relabelings = endpoint["relabelings"].as_array().cloned().unwrap_or_default();
    assert!(
        relabelings.iter().any(|r| r["targetLabel"] == "node"
            && r["sourceLabels"] == serde_json::json!(["__meta_kubernetes_pod_node_name"])),
        "the PodMonitor must label series with their node: {relabelings:?}"
    );
    let mut arbiters = 0;
    for (file, daemonset) in
        [("daemonset.yaml", "gpufrac-node"), ("dra/daemonset-dra.yaml", "gpufrac-node-dra")]
    {
        let docs = documents(file);
        let ds = docs
            .iter()
            .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == daemonset)
            .unwrap_or_else(|| panic!("no DaemonSet {daemonset} in {file}"));
        let namespace = &ds["metadata"]["namespace"];
        let watched = spec["namespaceSelector"]["matchNames"].as_array().cloned().unwrap_or_default();
        assert!(
            monitor["metadata"]["namespace"] == *namespace
                && (watched.is_empty() || watched.contains(namespace)),
            "the PodMonitor looks in {} {watched:?}, the arbiters of {file} run in {namespace}",
            monitor["metadata"]["namespace"]
        );
        let pod = &ds["spec"]["template"];
        assert!(selects(&spec["selector"], &pod["metadata"]["labels"]), "{file}'s pods are not selected");
        let arbiter = pod["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["command"][0] == "gpufrac-arbiter")
            .unwrap_or_else(|| panic!("no arbiter container in {file}"));
        let args: Vec<&str> =
            arbiter["args"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        let listen = args
            .iter()
            .position(|a| *a == "--metrics")
            .and_then(|i| args.get(i + 1))
            .unwrap_or_else(|| panic!("the arbiter of {file} serves no --metrics: {args:?}"));
        let port: u64 =
            listen.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).expect("a port in --metrics");
        let named = arbiter["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == endpoint["port"])
            .unwrap_or_else(|| panic!("the arbiter of {file} has no port named {}", endpoint["port"]));
        assert_eq!(
            named["containerPort"].as_u64(),
            Some(port),
            "the port named {} is --metrics {listen}",
            endpoint["port"]
        );
        arbiters += 1;
    }
    assert_eq!(arbiters, 2);
    // Not the webhook's pods: they serve no metrics.
    let webhook_labels =
        serde_json::json!({"app.kubernetes.io/name": "gpufrac", "app.kubernetes.io/component": "webhook"});
    assert!(!selects(&spec["selector"], &webhook_labels), "the PodMonitor selects the webhook too");
}

// ---- The drift check ----

/// The checker catches what drift looks like: against `exported` (where the dashboard
/// as it is passes), a renamed metric, a counter without `_total`, a histogram without
/// `_bucket`, a renamed `kind`, a label the series lack, a grouping by one, and a legend
/// showing a label the aggregation drops all fail; so does a family the arbiter stops
/// exporting (`body` with it renamed).
fn assert_the_check_catches_drift(body: &str, exported: &Exported, labels: &BTreeSet<String>) {
    let text = std::fs::read_to_string(dashboard_path()).unwrap();
    let check = |text: &str| problems(&serde_json::from_str(text).unwrap(), exported, labels);
    for (from, to, says) in [
        ("gpufrac_grants_total", "gpufrac_grant_total", "gpufrac_grant_total is not exported"),
        ("gpufrac_grants_total", "gpufrac_grants", "gpufrac_grants is a counter family"),
        ("gpufrac_wait_seconds_bucket", "gpufrac_wait_seconds", "gpufrac_wait_seconds is a histogram family"),
        (r#"kind=~\"guaranteed|burst"#, r#"kind=~\"guaranteed|lent"#, r#"has kind="lent""#),
        (r#"\"$gpu\", kind=\"total\""#, r#"\"$gpu\", kind=\"capacity\""#, r#"has kind="capacity""#),
        (r#"kind=\"held\""#, r#"type=\"held\""#, r#"has no label "type""#),
        (
            "sum by (node, gpu, kind) (gpufrac_gpu",
            "sum by (node, gpu, kinds) (gpufrac_gpu",
            r#"groups by "kinds""#,
        ),
        ("{{node}} {{gpu}} {{kind}}", "{{node}} {{gpu}} {{group}}", r#"shows "group""#),
        (
            "sum by (node, gpu, group) (gpufrac_group",
            "sum by (node, gpu) (gpufrac_group",
            "which its aggregation by",
        ),
    ] {
        assert!(text.contains(from), "the dashboard no longer has {from}: update this test");
        let found = check(&text.replacen(from, to, 1));
        assert!(found.iter().any(|p| p.contains(says)), "{from} -> {to}: expected {says:?} in {found:#?}");
    }
    // The other way round: a metric renamed in the arbiter.
    let renamed = Exported::parse(&body.replace("gpufrac_swap_bytes", "gpufrac_swapped_bytes"));
    let found = problems(&serde_json::from_str(&text).unwrap(), &renamed, labels);
    assert!(found.iter().any(|p| p.contains("gpufrac_swap_bytes_total is not exported")), "{found:#?}");
}

const CHUNK: u64 = 32 * MIB;

#[test]
fn every_metric_the_dashboard_queries_is_one_the_arbiter_exports() {
    skip_on_real_gpu!(
        "the bursts collide on simgpu's 4 GiB device; on a larger real GPU they fit side by side"
    );
    let gpu = SimGpu::new("4GiB").with_context_overhead("64MiB");
    // The arbiter picks the metrics port and says which.
    let arbiter = Arbiter::start_at(
        &gpu,
        gpu.lib_dir().join("dashboard.sock"),
        &["--metrics", "127.0.0.1:0", "--kill-grace", "2s", "--swap-quantum", "0s"],
    );

    // A grant: A holds 2.5 GiB, 1.5 GiB of it lent.
    let mut a = ChildProcess::spawn(&mut bursting_server(
        &gpu,
        &arbiter,
        &unique("low"),
        2560 * MIB,
        "30s",
        "wait",
        0,
    ));
    assert_eq!(a.ready()[0], 2560 * MIB);
    // A wait, then a termination: B, of higher priority, wants 2 GiB; A is ended for it.
    let mut b = ChildProcess::spawn(&mut bursting_server(
        &gpu,
        &arbiter,
        &unique("vip"),
        2 * GIB,
        "30s",
        "priority",
        10,
    ));
    assert_eq!(b.ready()[0], 2 * GIB, "the priority burst is served");
    assert!(!a.wait(TIMEOUT).success(), "A was ended");
    // A refusal: a request that does not fit beside B's.
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    cmd.memory_request("3584MiB")
        .arbiter_socket(arbiter.socket())
        .group(unique("big"))
        .args(["alloc", "1048576"]);
    assert!(!cmd.output().unwrap().status.success(), "a request that does not fit is refused");
    // A timeout: C waits 1 s for memory B holds.
    let mut c =
        ChildProcess::spawn(&mut bursting_server(&gpu, &arbiter, &unique("late"), 3 * GIB, "1s", "wait", 0));
    assert!(c.ready()[0] < 3 * GIB, "C's wait times out");
    c.close_stdin();
    c.finish();
    b.close_stdin();
    b.finish();
    // Swaps: H holds bursts and sleeps; R's burst swaps them out (a quantum of 0 s).
    let swap_env = |cmd: &mut Command, group: &str| {
        cmd.memory_request("1GiB")
            .memory_limit("3GiB")
            .resolver("swap")
            .arbiter_socket(arbiter.socket())
            .group(group)
            .wait_timeout("30s");
    };
    let (gh, gr) = (unique("holder"), unique("burst"));
    let mut cmd = gpu.shimmed(env!("CARGO_BIN_EXE_simgpu_probe"));
    swap_env(&mut cmd, &gh);
    cmd.args(["hold-bursts", &GIB.to_string(), &(256 * MIB).to_string(), "4"]);
    let mut h = ChildProcess::spawn(&mut cmd);
    h.expect_line(&["PTRS"], TIMEOUT);
    h.ready();
    let mut cmd = gpu.shimmed(compile_c("alloc_paths.c", &["MODE_DLSYM"], false));
    swap_env(&mut cmd, &gr);
    cmd.args(["alloc", &CHUNK.to_string(), &(2560 * MIB).to_string()]);
    let mut r = ChildProcess::spawn(&mut cmd);
    assert_eq!(r.ready()[0], 2560 * MIB, "R's burst is served by swapping H out");
    wait_for(&arbiter, "H swapped out", |s| {
        s.gpus[0].processes.iter().any(|p| p.group == gh && p.host_bytes >= GIB)
    });
    // Scraped while H is swapped out and R holds its burst: every memory kind has a value.
    let body = arbiter.metrics();
    r.close_stdin();
    r.finish();
    h.close_stdin();
    h.finish();

    let exported = Exported::parse(&body);
    // The workload made every family the dashboard reads have series, so that their labels
    // and values are checked too, not their names alone.
    let dashboard = dashboard();
    let mut silent = BTreeSet::new();
    for (_, expr, _) in queries(&dashboard) {
        let promql = label_values(&expr).map_or(expr.as_str(), |(selector, _)| selector).to_owned();
        for metric in parse_query(&promql).map(|q| q.metrics).unwrap_or_default() {
            if exported.family_of(&metric).is_some_and(|(_, f)| f.samples == 0) {
                silent.insert(metric);
            }
        }
    }
    assert!(silent.is_empty(), "the workload left these with no series: {silent:?}\n{body}");
    for (family, label, value) in [
        ("gpufrac_refusals", "reason", "admission"),
        ("gpufrac_terminations", "reason", "lower-priority"),
        ("gpufrac_swaps", "direction", "out"),
    ] {
        let values = exported.families[family].labels.get(label).cloned().unwrap_or_default();
        assert!(values.contains(value), "{family}{{{label}={value:?}}} missing:\n{body}");
    }
    let found = problems(&dashboard, &exported, &scrape_labels());
    assert!(
        found.is_empty(),
        "{} queries what the arbiter does not export:\n{}\n\nthe arbiter's /metrics:\n{body}",
        dashboard_path().display(),
        found.join("\n")
    );
    assert_the_check_catches_drift(&body, &exported, &scrape_labels());
}

fn documents(name: &str) -> Vec<Value> {
    gpufrac_e2e::kubernetes_validate::yaml_documents(&repo().join("examples/kubernetes").join(name))
}

// ---- A fresh node ----

/// The dashboard's queried metrics without a sample in `body`, and those without one for
/// each of `gpus` where their series are per GPU: one line each. A sample of `name` is a
/// line of `body` whose name is exactly `name` (`gpufrac_grants_total`,
/// `gpufrac_wait_seconds_bucket`).
fn missing_from_a_fresh_scrape(dashboard: &Value, body: &str, gpus: &[String]) -> Vec<String> {
    let mut metrics = BTreeSet::new();
    for (place, expr, _) in queries(dashboard) {
        let promql = label_values(&expr).map_or(expr.as_str(), |(selector, _)| selector).to_owned();
        let query = parse_query(&promql).unwrap_or_else(|e| panic!("{place}: {e}"));
        metrics.extend(query.metrics);
    }
    assert!(metrics.len() >= 10, "the dashboard's queries name only {metrics:?}");
    let mut missing = Vec::new();
    for metric in &metrics {
        let samples: Vec<Vec<(String, String)>> = body
            .lines()
            .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
            .map(parse_sample)
            .filter(|(name, _)| name == metric)
            .map(|(_, labels)| labels)
            .collect();
        if samples.is_empty() {
            missing.push(format!("{metric}: no sample"));
            continue;
        }
        let gpus_of: BTreeSet<&str> = samples
            .iter()
            .flatten()
            .filter(|(label, _)| label == "gpu")
            .map(|(_, value)| value.as_str())
            .collect();
        if !gpus_of.is_empty() {
            for gpu in gpus {
                if !gpus_of.contains(gpu.as_str()) {
                    missing.push(format!("{metric}: no sample for GPU {gpu}"));
                }
            }
        }
    }
    missing
}

/// A fresh node's dashboard shows zeros, not "No data": an arbiter on two simulated GPUs
/// that has served nobody has, at its first scrape, a sample of every metric the
/// dashboard's queries name (read from the dashboard, so this follows it), for each GPU
/// where the metric is per GPU; its counters and histograms are all 0.
#[test]
fn a_fresh_arbiter_has_every_series_the_dashboard_queries() {
    let gpu = SimGpu::new("4GiB,2GiB");
    let arbiter = Arbiter::start_at(&gpu, gpu.lib_dir().join("fresh.sock"), &["--metrics", "127.0.0.1:0"]);
    let gpus: Vec<String> = gpufrac_e2e::status(&arbiter).gpus.iter().map(|g| g.uuid.clone()).collect();
    assert_eq!(gpus.len(), 2, "the arbiter manages both simulated GPUs");
    let body = arbiter.metrics();
    let dashboard = dashboard();
    let missing = missing_from_a_fresh_scrape(&dashboard, &body, &gpus);
    assert!(
        missing.is_empty(),
        "a fresh arbiter lacks what the dashboard queries:\n{}\n\n{body}",
        missing.join("\n")
    );

    let exported = Exported::parse(&body);
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let (name, _) = parse_sample(line);
        let (_, family) = exported.family_of(&name).expect("a declared family");
        let value: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a sample's value");
        if family.kind == "counter" || family.kind == "histogram" {
            assert_eq!(value, 0.0, "nothing happened yet: {line}");
        }
    }

    // The check catches a series the arbiter would leave out: each metric the dashboard
    // names, dropped from the scrape, or kept for the first GPU only.
    for metric in
        ["gpufrac_swap_seconds_bucket", "gpufrac_timeouts_total", "gpufrac_groups_ended_over_limit_total"]
    {
        let dropped: String =
            body.lines().filter(|l| !l.starts_with(metric)).map(|l| format!("{l}\n")).collect();
        let found = missing_from_a_fresh_scrape(&dashboard, &dropped, &gpus);
        assert_eq!(found, [format!("{metric}: no sample")], "{metric} dropped");
    }
    let second = format!("gpu=\"{}\"", gpus[1]);
    let one_gpu: String = body
        .lines()
        .filter(|l| !(l.starts_with("gpufrac_waits_total") && l.contains(&second)))
        .map(|l| format!("{l}\n"))
        .collect();
    let found = missing_from_a_fresh_scrape(&dashboard, &one_gpu, &gpus);
    assert_eq!(found, [format!("gpufrac_waits_total: no sample for GPU {}", gpus[1])]);
}
