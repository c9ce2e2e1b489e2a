//! The docs a newcomer walks: every relative link in the README, `docs/` and the
//! examples' READMEs leads to a file that exists (and to a heading of it, for an anchor),
//! and every shell block in them is either run here, from a fresh build, with what it
//! promises checked, or listed below with the reason it cannot be (a GPU, a cluster, the
//! test command itself). A new block that is neither fails this test, so a command cannot
//! slip into the docs untried.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpufrac_e2e::{artifact, skip_on_real_gpu};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().expect("the workspace root")
}

/// The Markdown files a reader is pointed to: the README, `docs/`, and the examples'.
fn markdown_files() -> Vec<PathBuf> {
    let root = root();
    let out = Command::new("git")
        .args(["ls-files", "--cached", "--others", "--exclude-standard", "*.md"])
        .current_dir(&root)
        .output()
        .expect("git ls-files");
    assert!(out.status.success(), "git ls-files: {}", String::from_utf8_lossy(&out.stderr));
    let mut files: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|f| *f == "README.md" || f.starts_with("docs/") || f.starts_with("examples/"))
        .map(|f| root.join(f))
        .collect();
    files.sort();
    assert!(files.len() >= 8, "the README and the docs: {files:?}");
    files
}

fn relative(path: &Path) -> String {
    path.strip_prefix(root()).unwrap_or(path).display().to_string()
}

/// The lines of `text` outside fenced code blocks, with their numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((n + 1, line));
        }
    }
    out
}

/// GitHub's anchor for a heading: lowercase, punctuation but `-` and `_` dropped, spaces
/// as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a Markdown file has (repeated headings get `-1`, `-2`, as on GitHub).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let Some(heading) = line.strip_prefix('#') else { continue };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of `[text](target)` links and images on a line, outside code spans.
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    let bytes: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            '`' => in_code = !in_code,
            ']' if !in_code && bytes.get(i + 1) == Some(&'(') => {
                let start = i + 2;
                if let Some(len) = bytes[start..].iter().position(|c| *c == ')') {
                    let target: String = bytes[start..start + len].iter().collect();
                    out.push(target.split_whitespace().next().unwrap_or_default().to_owned());
                    i = start + len;
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[test]
fn every_relative_link_leads_somewhere() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let dest = if path.is_empty() { file.clone() } else { file.parent().unwrap().join(path) };
                let place = format!("{}:{n}: {target}", relative(&file));
                if !dest.exists() {
                    broken.push(format!("{place} (no such file)"));
                    continue;
                }
                if let Some(anchor) = anchor {
                    let text = std::fs::read_to_string(&dest).unwrap_or_default();
                    if !anchors(&text).contains(anchor) {
                        broken.push(format!("{place} (no heading with that anchor in {})", relative(&dest)));
                    }
                }
            }
        }
    }
    assert!(checked >= 20, "the docs link to each other: only {checked} links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_checker_knows_githubs_anchors() {
    assert_eq!(
        slug("Dynamic Resource Allocation (Kubernetes 1.34+)"),
        "dynamic-resource-allocation-kubernetes-134"
    );
    assert_eq!(slug("The shim (`libgpufrac.so`)"), "the-shim-libgpufracso");
    assert_eq!(slug("For cluster admins: install"), "for-cluster-admins-install");
    let text = "# A\n## A\n```\n# not a heading\n```\n### B c\n";
    assert_eq!(anchors(text), BTreeSet::from(["a".to_owned(), "a-1".to_owned(), "b-c".to_owned()]));
    assert_eq!(link_targets("see [x](a.md#b) and `[y](z)` and ![p](d.svg)"), ["a.md#b", "d.svg"]);
}

/// A code block of a Markdown file: fenced (with its language) or indented.
#[derive(Debug)]
struct Block {
    file: String,
    line: usize,
    language: String,
    text: String,
}

impl Block {
    fn first_line(&self) -> &str {
        self.text.lines().next().unwrap_or_default().trim()
    }
}

fn blocks(file: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if let Some(fence) = line.trim_start().strip_prefix("```") {
            let mut j = i + 1;
            while j < lines.len() && !lines[j].trim_start().starts_with("```") {
                j += 1;
            }
            out.push(Block {
                file: relative(file),
                line: i + 1,
                language: fence.trim().to_owned(),
                text: lines[i + 1..j.min(lines.len())].join("\n"),
            });
            i = j + 1;
            continue;
        }
        let after_blank = i == 0 || lines[i - 1].trim().is_empty();
        if line.starts_with("    ") && after_blank {
            let mut j = i;
            while j < lines.len() && (lines[j].starts_with("    ") || lines[j].trim().is_empty()) {
                j += 1;
            }
            let text = lines[i..j].iter().map(|l| l.get(4..).unwrap_or("")).collect::<Vec<_>>().join("\n");
            out.push(Block {
                file: relative(file),
                line: i + 1,
                language: "indented".into(),
                text: text.trim_end().into(),
            });
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// Blocks that are not run, by file and the start of their first line, with the reason.
const NOT_RUN: &[(&str, &str, &str)] = &[
    ("README.md", "cargo build --release --workspace && target/release/gpufrac demo", "the two commands a newcomer runs: the test command is what runs this test, and the demo runs in tests/tests/arbiter.rs (the_demo_*)"),
    ("README.md", "cargo build --release --workspace\n", "needs an NVIDIA GPU and YOUR-CUDA-PROGRAM"),
    ("README.md", "cargo build --workspace && GPUFRAC_E2E_REAL_GPU=1", "needs an NVIDIA GPU"),
    ("docs/testing.md", "cargo build --workspace && GPUFRAC_E2E_REAL_GPU=1", "needs an NVIDIA GPU"),
    ("docs/testing.md", "cargo build --workspace && tests/real_gpu/accept.sh --simgpu", "the acceptance run on simgpu: .ci/run runs it after the test command"),
    ("docs/testing.md", "cargo build --release --workspace && tests/real_gpu/pack.sh", "a release build (several GiB) for the GPU machine, done by hand before a GPU session"),
    ("docs/testing.md", "python3 -m venv .venv/torch", "downloads PyTorch's CUDA wheel (about 2.5 GB), kept out of CI"),
    ("docs/arbiter.md", "gpufrac-arbiter --socket /run/gpufrac/arbiter.sock", "a synopsis of the flags, not a command; the arbiter runs in most end-to-end tests"),
    ("docs/interface.md", "gpufrac-arbiter [--socket PATH]", "a synopsis of the flags, not a command"),
    ("docs/arbiter.md", "gpufrac top [--socket", "a synopsis; tests/tests/top.rs drives gpufrac top in a pseudo-terminal"),
    ("docs/simgpu.md", "mkdir -p /tmp/simgpu && for l in", "runs the reader's own program (./your-program); the same folder is made and used by the README's quick start, which runs here"),
    ("docs/demo.md", "gpufrac demo: inference servers", "the output of a run, not a command"),
    ("docs/kubernetes.md", "docker build", "needs docker and a registry"),
    ("README.md", "kubectl apply -k", "needs a Kubernetes cluster; tests/tests/kustomize.rs renders and validates both installs"),
    ("docs/kubernetes.md", "kubectl", "needs a Kubernetes cluster"),
    ("docs/kubernetes.md", "apiVersion: cert-manager.io/v1", "YAML for a cluster with cert-manager"),
    ("docs/kubernetes.md", "metadata:", "YAML (a pod's annotations); the manifests test validates the examples"),
    ("docs/kubernetes.md", "devices:", "YAML (a claim's spec); examples/kubernetes/dra/ holds it whole, validated by the manifests test"),
    ("examples/kubernetes/dra/README.md", "kubectl", "needs a Kubernetes cluster"),
    ("examples/grafana/README.md", "kubectl", "needs a Kubernetes cluster with Prometheus and Grafana"),
    ("examples/grafana/README.md", "scrape_configs:", "Prometheus configuration, not a command; tests/tests/dashboard.rs scrapes a running arbiter"),
];

/// Blocks run here, by file and the start of their first line.
const RUN: &[(&str, &str)] = &[("README.md", "cargo build --release --workspace && mkdir -p /tmp/simgpu")];

fn matches(block: &Block, file: &str, start: &str) -> bool {
    block.file == file && format!("{}\n", block.text.trim_start()).starts_with(start)
}

#[test]
fn every_shell_block_is_run_or_says_why_not() {
    let all: Vec<Block> = markdown_files().iter().flat_map(|f| blocks(f)).collect();
    let mut unlisted = Vec::new();
    for block in &all {
        let not_run = NOT_RUN.iter().filter(|(f, s, _)| matches(block, f, s)).count();
        let run = RUN.iter().filter(|(f, s)| matches(block, f, s)).count();
        if not_run + run != 1 {
            unlisted.push(format!(
                "{}:{} ({}, listed {} times): {}",
                block.file,
                block.line,
                block.language,
                not_run + run,
                block.first_line()
            ));
        }
    }
    assert!(
        unlisted.is_empty(),
        "code blocks neither run by tests/tests/docs.rs nor listed there with a reason (add each to RUN \
         or NOT_RUN):\n{}",
        unlisted.join("\n")
    );
    for (file, start, why) in NOT_RUN {
        assert!(!why.is_empty());
        assert!(
            all.iter().any(|b| matches(b, file, start)),
            "NOT_RUN names a block that is gone: {file}: {start}"
        );
    }
    for (file, start) in RUN {
        assert!(
            all.iter().any(|b| matches(b, file, start)),
            "RUN names a block that is gone: {file}: {start}"
        );
    }
}

#[test]
fn the_readmes_quick_start_on_simgpu_runs_as_written() {
    skip_on_real_gpu!("the block makes simgpu the CUDA driver");
    let file = root().join("README.md");
    let block = blocks(&file)
        .into_iter()
        .find(|b| matches(b, RUN[0].0, RUN[0].1))
        .expect("the README's simgpu quick start");
    // As written, but on this test's build (the test command built the workspace), in a
    // folder of its own instead of /tmp/simgpu.
    let build_dir = artifact("gpufrac").parent().unwrap().to_path_buf();
    let folder = std::env::temp_dir().join(format!("gpufrac-docs-simgpu-{}", std::process::id()));
    let script = block
        .text
        .replace("cargo build --release --workspace && ", "")
        .replace("$PWD/target/release/", &format!("{}/", build_dir.display()))
        .replace("target/release/", &format!("{}/", build_dir.display()))
        .replace("/tmp/simgpu", &folder.display().to_string());
    assert!(!script.contains("release"), "every release path replaced: {script}");
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(root())
        .env_remove("LD_PRELOAD")
        .env("SIMGPU_STATE", folder.join("state"))
        .output()
        .expect("bash");
    let _ = std::fs::remove_dir_all(&folder);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let all = format!("{stdout}{stderr}");
    assert!(out.status.success(), "{script}\n{all}");
    // What the README says it prints.
    for promised in [
        "server started device=0 total=2147483648",
        "server out-of-memory batch=2",
        "server done served=2 out-of-memory=1",
    ] {
        assert!(all.contains(promised), "the README promises {promised:?}:\n{all}");
    }
}
