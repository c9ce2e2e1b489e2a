//! Kubernetes objects checked against the API's own schemas with `kubernetes-validate
//! --strict` (the OpenAPI schemas of each Kubernetes version ship inside that Python
//! package, so it needs no network): the manifests of `examples/kubernetes/`
//! (`tests/tests/manifests.rs`) and objects a test builds or a binary publishes
//! ([`validate_objects`], such as the DRA plugin's ResourceSlices).
//!
//! Needs `kubernetes-validate`, installed by the README's test command into the
//! workspace's virtual environment `.venv/` ([`INSTALL`]): without it every check fails
//! and says so; none passes without validating.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use serde_json::Value;

/// The command, run at the workspace root, that installs the validator.
pub const INSTALL: &str = "python3 -m venv .venv && .venv/bin/pip install -r tests/requirements.txt";

/// The workspace's virtual environment, where the README's test command installs the
/// validator.
fn venv_validator() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/kubernetes-validate")
}

/// The validator's command line: `$KUBERNETES_VALIDATE` if set, else
/// `.venv/bin/kubernetes-validate` at the workspace root, else `kubernetes-validate` on
/// PATH, else `python3 -m kubernetes_validate` (a `pip install --user` whose scripts
/// folder is not on PATH). Found once per test process; panics, saying how to install it,
/// when none runs.
pub fn validator() -> Vec<String> {
    static FOUND: OnceLock<Result<Vec<String>, String>> = OnceLock::new();
    match FOUND.get_or_init(find_validator) {
        Ok(command) => command.clone(),
        Err(message) => panic!("{message}"),
    }
}

fn find_validator() -> Result<Vec<String>, String> {
    let mut candidates: Vec<Vec<String>> = Vec::new();
    if let Ok(path) = std::env::var("KUBERNETES_VALIDATE") {
        candidates.push(vec![path]);
    }
    candidates.push(vec![venv_validator().display().to_string()]);
    candidates.push(vec!["kubernetes-validate".into()]);
    candidates.push(vec!["python3".into(), "-m".into(), "kubernetes_validate".into()]);
    for candidate in &candidates {
        let ran = Command::new(&candidate[0]).args(&candidate[1..]).arg("--version").output();
        if ran.is_ok_and(|out| out.status.success()) {
            return Ok(candidate.clone());
        }
    }
    Err(format!(
        "kubernetes-validate is not installed, so the Kubernetes objects cannot be \
         validated. Install it, at the workspace root, with:\n    {INSTALL}\n(tried \
         {candidates:?}; set KUBERNETES_VALIDATE to its path if it is elsewhere)"
    ))
}

/// How many resources a YAML file holds: its documents with a top-level `kind:`.
pub fn resource_count(text: &str) -> usize {
    text.lines().filter(|line| line.starts_with("kind:")).count()
}

/// Validates the YAML `files` against the schemas of Kubernetes `version` (`"1.34"`) in
/// strict mode (unknown fields are errors), each file expected to hold as many resources
/// as it has lines starting with `kind:` ([`resource_count`]). See [`validate_counted`].
pub fn validate_files(files: &[PathBuf], version: &str) -> Result<(), String> {
    let counted = files
        .iter()
        .map(|file| {
            let text =
                std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
            (file.clone(), resource_count(&text))
        })
        .collect::<Vec<_>>();
    validate_counted(&counted, version)
}

/// Validates `files` (each with the number of resources it holds) against the schemas of
/// Kubernetes `version` in strict mode. Ok only if the validator succeeds, says nothing
/// but "passed", and passes every resource of every file: kubernetes-validate only warns,
/// and exits 0, for a kind or apiVersion it has no schema for (a resource.k8s.io/v1 object
/// for Kubernetes 1.33, say), which here is an error too, as is a file of no resource.
pub fn validate_counted(files: &[(PathBuf, usize)], version: &str) -> Result<(), String> {
    let command = validator();
    let out = Command::new(&command[0])
        .args(&command[1..])
        .args(["--kubernetes-version", version, "--strict"])
        .args(files.iter().map(|(file, _)| file))
        .output()
        .unwrap_or_else(|e| panic!("running {command:?}: {e}"));
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let failed =
        |why: String| Err(format!("{why}\n--- kubernetes-validate -k {version} --strict said:\n{output}"));
    if !out.status.success() {
        return failed(format!("kubernetes-validate exited with {}", out.status));
    }
    if let Some(line) = output.lines().find(|line| !line.trim().is_empty() && !line.starts_with("INFO ")) {
        return failed(format!("unexpected output: {line}"));
    }
    for (file, expected) in files {
        let prefix = format!("INFO {} passed for resource ", file.display());
        let passed = output.lines().filter(|line| line.starts_with(&prefix)).count();
        if *expected == 0 || passed != *expected {
            return failed(format!("{}: {passed} resources passed of {expected}", file.display()));
        }
    }
    Ok(())
}

/// Removes the file when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Validates Kubernetes objects (each with its `apiVersion`, `kind` and `metadata`, as
/// JSON) against the schemas of every Kubernetes version of `versions` (`["1.34",
/// "1.37"]`) in strict mode: written as a multi-document file, one JSON document each
/// (JSON is YAML), and checked as [`validate_counted`] checks a file. Err names the
/// version and carries what the validator said; an empty list of objects or of versions
/// is an error too. Panics, saying how to install it, without kubernetes-validate.
pub fn validate_objects(objects: &[Value], versions: &[&str]) -> Result<(), String> {
    if objects.is_empty() {
        return Err("no object to validate".to_owned());
    }
    if versions.is_empty() {
        return Err("no Kubernetes version to validate against".to_owned());
    }
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let file =
        TempFile(std::env::temp_dir().join(format!("gpufrac-validate-{}-{n}.yaml", std::process::id())));
    let mut text = String::new();
    for object in objects {
        text.push_str("---\n");
        text.push_str(&serde_json::to_string(object).map_err(|e| format!("an object as JSON: {e}"))?);
        text.push('\n');
    }
    std::fs::write(&file.0, text).map_err(|e| format!("writing {}: {e}", file.0.display()))?;
    for version in versions {
        validate_counted(&[(file.0.clone(), objects.len())], version)
            .map_err(|e| format!("not valid for Kubernetes {version}: {e}"))?;
    }
    Ok(())
}

/// The virtual environment's Python (where PyYAML is installed), else `python3`.
pub fn python() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python3");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// The documents of a YAML file, read with PyYAML (the parser Kubernetes tooling agrees
/// with), as JSON. Panics, saying how to install it, when PyYAML cannot read the file.
pub fn yaml_documents(path: &Path) -> Vec<Value> {
    let out = Command::new(python())
        .args([
            "-c",
            "import json, sys, yaml\nprint(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))",
        ])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python().display()));
    assert!(
        out.status.success(),
        "parsing {} with PyYAML failed (install it with: {INSTALL}): {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("PyYAML's documents as JSON")
}
