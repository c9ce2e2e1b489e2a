//! The installs in one command (`kubectl apply -k`): each kustomization, rendered with
//! `kubectl kustomize` as `kubectl apply -k` renders it, holds every object its way of
//! running gpufrac needs and nothing else (no sample workload), unchanged from the
//! manifests it lists; every object passes `kubernetes-validate --strict` as the manifests
//! do (`manifests.rs`), but the PodMonitor, a custom resource the Kubernetes schemas lack,
//! which must be the one of `examples/kubernetes/monitoring/` that `dashboard.rs` checks.
//! The operator's overlays (`examples/kubernetes-overlays/`) change exactly what they say:
//! every container's image, the DaemonSet's node selector (narrowed, never widened), and
//! flags added after the arbiter's own, each one the built arbiter takes.
//!
//! Needs `kubectl` with kustomize v5 (the machines' image has it; Debian's own
//! `kubernetes-client` is too old, with kustomize v2): without it each test says so in
//! the skip summary, as a skip CI does not accept. Needs `kubernetes-validate` and PyYAML
//! from `.venv/`, as `manifests.rs`, and the workspace built (the arbiter's `--help`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use gpufrac_e2e::kubernetes_validate;
use serde_json::{json, Value};

/// The Kubernetes versions of `manifests.rs`: the device plugin's from 1.30, DRA's `v1`
/// from 1.34; 1.37 the newest kubernetes-validate bundles.
const DEVICE_PLUGIN_VERSIONS: &[&str] = &["1.30", "1.34", "1.37"];
const DRA_VERSIONS: &[&str] = &["1.34", "1.37"];

/// The image every container of the manifests names.
const IMAGE: &str = "gpufrac/gpufrac:0.1.0";

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// `kind/name` of every object an install must hold, from the files it lists.
const DEVICE_PLUGIN_OBJECTS: &[&str] = &[
    "Namespace/gpufrac-system",
    "ResourceQuota/gpufrac-critical-pods",
    "ServiceAccount/gpufrac-node",
    "ServiceAccount/gpufrac-webhook",
    "ClusterRole/gpufrac-node",
    "ClusterRoleBinding/gpufrac-node",
    "DaemonSet/gpufrac-node",
    "Deployment/gpufrac-webhook",
    "PodDisruptionBudget/gpufrac-webhook",
    "Service/gpufrac-webhook",
    "MutatingWebhookConfiguration/gpufrac-webhook",
    "PodMonitor/gpufrac-arbiter",
];
const DRA_OBJECTS: &[&str] = &[
    "Namespace/gpufrac-system",
    "ResourceQuota/gpufrac-critical-pods",
    "ServiceAccount/gpufrac-node-dra",
    "ClusterRole/gpufrac-node-dra",
    "ClusterRoleBinding/gpufrac-node-dra",
    "ValidatingAdmissionPolicy/gpufrac-node-dra-resourceslices",
    "ValidatingAdmissionPolicyBinding/gpufrac-node-dra-resourceslices",
    "ValidatingAdmissionPolicy/gpufrac-node-dra-node-condition",
    "ValidatingAdmissionPolicyBinding/gpufrac-node-dra-node-condition",
    "DaemonSet/gpufrac-node-dra",
    "DeviceClass/gpu.gpufrac.io",
    "PodMonitor/gpufrac-arbiter",
];

/// One way of installing: its kustomization, the manifests it stands for, the objects it
/// must hold, its node DaemonSet, the Kubernetes versions it is for, and its overlay.
struct Install {
    dir: &'static str,
    files: &'static [&'static str],
    objects: &'static [&'static str],
    daemonset: &'static str,
    versions: &'static [&'static str],
    overlay: &'static str,
}

const DEVICE_PLUGIN: Install = Install {
    dir: "kubernetes",
    files: &[
        "kubernetes/namespace/namespace.yaml",
        "kubernetes/rbac.yaml",
        "kubernetes/daemonset.yaml",
        "kubernetes/webhook.yaml",
        "kubernetes/monitoring/podmonitor.yaml",
    ],
    objects: DEVICE_PLUGIN_OBJECTS,
    daemonset: "gpufrac-node",
    versions: DEVICE_PLUGIN_VERSIONS,
    overlay: "kubernetes-overlays/device-plugin",
};

const DRA: Install = Install {
    dir: "kubernetes/dra",
    files: &[
        "kubernetes/namespace/namespace.yaml",
        "kubernetes/dra/rbac-dra.yaml",
        "kubernetes/dra/deviceclass.yaml",
        "kubernetes/dra/daemonset-dra.yaml",
        "kubernetes/monitoring/podmonitor.yaml",
    ],
    objects: DRA_OBJECTS,
    daemonset: "gpufrac-node-dra",
    versions: DRA_VERSIONS,
    overlay: "kubernetes-overlays/dra",
};

/// `kubectl` with kustomize v5 or later, or why there is none.
fn kubectl() -> Result<(), String> {
    let out = Command::new("kubectl")
        .args(["version", "--client"])
        .output()
        .map_err(|e| format!("kubectl is not installed ({e}): the kustomizations were not rendered"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let kustomize = text.lines().find_map(|l| l.strip_prefix("Kustomize Version: v")).unwrap_or("");
    match kustomize.split('.').next().and_then(|major| major.parse::<u32>().ok()) {
        Some(major) if major >= 5 => Ok(()),
        _ => Err(format!(
            "kubectl's kustomize is not v5 or later (kubectl version --client: {}): the \
             kustomizations were not rendered",
            text.trim()
        )),
    }
}

/// Returns from the calling test, after reporting the skip, without kubectl's kustomize v5.
macro_rules! need_kubectl {
    () => {
        if let Err(why) = kubectl() {
            gpufrac_e2e::report_skip(gpufrac_e2e::Skip::ThisMachine, &why);
            return;
        }
    };
}

/// Removes the file when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The objects `kubectl kustomize DIR` renders (DIR relative to `examples/`, or
/// absolute), parsed by PyYAML.
fn render(dir: impl AsRef<Path>) -> Vec<Value> {
    let path = examples().join(dir.as_ref());
    let out =
        Command::new("kubectl").arg("kustomize").arg(&path).output().expect("running kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    // One file per call: tests render the same folder at once.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let file =
        TempFile(std::env::temp_dir().join(format!("gpufrac-kustomize-{}-{n}.yaml", std::process::id())));
    std::fs::write(&file.0, &out.stdout).expect("writing the rendered objects");
    kubernetes_validate::yaml_documents(&file.0)
}

/// An object's `kind/name`.
fn id(object: &Value) -> String {
    format!(
        "{}/{}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// What is wrong with the rendered `objects` of an install that must hold `expected`:
/// one line for each object missing, each one too many, and each repeated.
fn problems(objects: &[Value], expected: &[&str]) -> Vec<String> {
    let ids: Vec<String> = objects.iter().map(id).collect();
    let mut problems = Vec::new();
    for want in expected {
        match ids.iter().filter(|have| have == want).count() {
            0 => problems.push(format!("{want} is missing")),
            1 => {}
            n => problems.push(format!("{want} is there {n} times")),
        }
    }
    for have in &ids {
        if !expected.contains(&have.as_str()) {
            problems.push(format!("{have} is not part of the install"));
        }
    }
    problems
}

/// The objects of `examples/<file>`, parsed by PyYAML.
fn documents(file: &str) -> Vec<Value> {
    kubernetes_validate::yaml_documents(&examples().join(file))
}

/// Validates the objects against the API schemas of `versions`; the PodMonitor, which
/// the schemas lack, must be the monitoring folder's.
fn validate(objects: &[Value], versions: &[&str]) {
    let (monitors, api): (Vec<Value>, Vec<Value>) =
        objects.iter().cloned().partition(|o| o["apiVersion"] == "monitoring.coreos.com/v1");
    assert_eq!(monitors, documents("kubernetes/monitoring/podmonitor.yaml"), "the PodMonitor");
    if let Err(e) = kubernetes_validate::validate_objects(&api, versions) {
        panic!("the rendered install is not valid Kubernetes: {e}");
    }
}

/// The one object `kind/name` of `objects`.
fn find<'a>(objects: &'a [Value], wanted: &str) -> &'a Value {
    let found: Vec<&Value> = objects.iter().filter(|o| id(o) == wanted).collect();
    assert_eq!(found.len(), 1, "one {wanted} in {:?}", objects.iter().map(id).collect::<Vec<_>>());
    found[0]
}

/// Every container and init container of every pod template in `objects`.
fn containers(objects: &[Value]) -> Vec<&Value> {
    let mut all = Vec::new();
    for object in objects {
        let spec = &object["spec"]["template"]["spec"];
        for key in ["initContainers", "containers"] {
            all.extend(spec[key].as_array().into_iter().flatten());
        }
    }
    all
}

/// The arbiter container's args in a DaemonSet.
fn arbiter_args(daemonset: &Value) -> Vec<String> {
    let arbiter = daemonset["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "arbiter"))
        .expect("an arbiter container");
    arbiter["args"]
        .as_array()
        .expect("the arbiter's args")
        .iter()
        .map(|a| a.as_str().unwrap_or("?").to_owned())
        .collect()
}

fn check_install(install: &Install) {
    let objects = render(install.dir);
    let found = problems(&objects, install.objects);
    assert!(found.is_empty(), "kubectl kustomize examples/{}:\n{}", install.dir, found.join("\n"));
    // Unchanged from the manifests it lists: kustomize only gathers them.
    let mut sources: Vec<Value> = install.files.iter().flat_map(|f| documents(f)).collect();
    let mut rendered = objects.clone();
    sources.sort_by_key(id);
    rendered.sort_by_key(id);
    assert_eq!(rendered, sources, "examples/{} renders its manifests changed", install.dir);
    validate(&objects, install.versions);
    assert!(containers(&objects).iter().all(|c| c["image"] == IMAGE), "every container runs {IMAGE}");
    // gpufrac's own namespace only: no sample workload.
    for object in &objects {
        let namespace = &object["metadata"]["namespace"];
        assert!(namespace.is_null() || namespace == "gpufrac-system", "{} in {namespace}", id(object));
    }
}

#[test]
fn the_device_plugin_install_holds_what_the_nodes_need() {
    need_kubectl!();
    check_install(&DEVICE_PLUGIN);
}

#[test]
fn the_dra_install_holds_what_the_nodes_need() {
    need_kubectl!();
    check_install(&DRA);
}

/// The check finds a forgotten file, a sample workload let in, and a repeated object.
#[test]
fn the_install_check_catches_a_forgotten_resource() {
    need_kubectl!();
    let objects = render(DRA.dir);
    assert!(problems(&objects, DRA.objects).is_empty());
    let without_rbac: Vec<Value> = objects.iter().filter(|o| o["kind"] != "ClusterRole").cloned().collect();
    assert_eq!(problems(&without_rbac, DRA.objects), ["ClusterRole/gpufrac-node-dra is missing"]);
    let mut with_sample = objects.clone();
    with_sample.extend(documents("kubernetes/dra/inference-claim.yaml"));
    let found = problems(&with_sample, DRA.objects);
    assert!(found.iter().any(|p| p == "Deployment/llm-server is not part of the install"), "{found:?}");
    let mut twice = objects.clone();
    twice.push(find(&objects, "DeviceClass/gpu.gpufrac.io").clone());
    assert_eq!(problems(&twice, DRA.objects), ["DeviceClass/gpu.gpufrac.io is there 2 times"]);
}

/// `gpufrac-arbiter --help`, for the flags it takes.
fn arbiter_help() -> String {
    let path = gpufrac_e2e::artifact("gpufrac-arbiter");
    let out =
        Command::new(&path).arg("--help").output().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(out.status.success(), "gpufrac-arbiter --help: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn check_overlay(install: &Install) {
    let base = render(install.dir);
    let objects = render(install.overlay);
    let found = problems(&objects, install.objects);
    assert!(found.is_empty(), "kubectl kustomize examples/{}:\n{}", install.overlay, found.join("\n"));
    validate(&objects, install.versions);

    // The image: every container's, none left behind.
    let images: BTreeSet<&str> = containers(&objects).iter().filter_map(|c| c["image"].as_str()).collect();
    assert_eq!(images, BTreeSet::from(["registry.example.com/gpufrac/gpufrac:0.1.0"]), "the overlay's image");

    // The nodes: the install's selector, narrowed by one label.
    let wanted = format!("DaemonSet/{}", install.daemonset);
    let (before, after) = (find(&base, &wanted), find(&objects, &wanted));
    let mut selector = before["spec"]["template"]["spec"]["nodeSelector"].clone();
    selector["nvidia.com/gpu.product"] = json!("NVIDIA-H100-80GB-HBM3");
    assert_eq!(after["spec"]["template"]["spec"]["nodeSelector"], selector, "the overlay's node selector");

    // The arbiter's flags: the install's, then the overlay's, each one the arbiter takes.
    let (was, now) = (arbiter_args(before), arbiter_args(after));
    assert_eq!(now[..was.len()], was[..], "the install's arbiter flags are kept, in order");
    assert_eq!(now[was.len()..], ["--gpu-memory", "95%"], "the overlay's arbiter flags");
    let help = arbiter_help();
    for flag in now.iter().filter(|a| a.starts_with("--")) {
        assert!(
            help.split(|c: char| c.is_whitespace() || c == ',').any(|word| word == flag),
            "gpufrac-arbiter --help does not list {flag}"
        );
    }

    // Nothing else changed.
    let undo = |objects: &[Value]| -> Vec<Value> {
        let mut objects = objects.to_vec();
        for object in objects.iter_mut() {
            let is_node_daemonset = id(object) == wanted;
            let spec = &mut object["spec"]["template"]["spec"];
            for key in ["initContainers", "containers"] {
                for c in spec[key].as_array_mut().into_iter().flatten() {
                    c["image"] = json!(IMAGE);
                    if c["name"] == "arbiter" {
                        if let Some(args) = c["args"].as_array_mut() {
                            args.truncate(was.len());
                        }
                    }
                }
            }
            if is_node_daemonset {
                spec["nodeSelector"] = before["spec"]["template"]["spec"]["nodeSelector"].clone();
            }
        }
        objects.sort_by_key(id);
        objects
    };
    assert_eq!(undo(&objects), undo(&base), "the overlay changes more than image, nodes and flags");
}

#[test]
fn the_device_plugin_overlay_changes_image_nodes_and_arbiter_flags() {
    need_kubectl!();
    check_overlay(&DEVICE_PLUGIN);
}

#[test]
fn the_dra_overlay_changes_image_nodes_and_arbiter_flags() {
    need_kubectl!();
    check_overlay(&DRA);
}

/// The overlays' commented-out patch for clusters without the Prometheus Operator, once
/// uncommented, installs the rest without the PodMonitor.
#[test]
fn the_overlays_can_leave_the_pod_monitor_out() {
    need_kubectl!();
    for install in [&DEVICE_PLUGIN, &DRA] {
        let path = examples().join(install.overlay).join("kustomization.yaml");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (kept, commented) = text
            .split_once("  # Without the Prometheus Operator")
            .unwrap_or_else(|| panic!("{}: no patch to leave the PodMonitor out", path.display()));
        let patch: String = commented
            .lines()
            .skip(1)
            .map(|l| l.strip_prefix("  # ").map_or_else(|| l.to_owned(), |rest| format!("  {rest}")))
            .map(|l| format!("{l}\n"))
            .collect();
        // A copy in a temporary folder: kustomize takes only relative paths to the install.
        let dir = TempDirGuard::new(&install.overlay.replace('/', "-"));
        let up = "../".repeat(dir.0.components().count() - 1);
        let examples = examples().canonicalize().expect("the examples folder");
        let to_examples = format!("{up}{}/", examples.display().to_string().trim_start_matches('/'));
        let kept = kept.replace("  - ../../", &format!("  - {to_examples}"));
        std::fs::write(dir.0.join("kustomization.yaml"), format!("{kept}{patch}")).expect("writing the copy");
        let objects = render(&dir.0);
        let expected: Vec<&str> =
            install.objects.iter().copied().filter(|o| !o.starts_with("PodMonitor/")).collect();
        let found = problems(&objects, &expected);
        assert!(
            found.is_empty(),
            "{} with its PodMonitor patch uncommented:\n{}",
            path.display(),
            found.join("\n")
        );
    }
}

/// A temporary folder of this test process, removed when dropped.
struct TempDirGuard(PathBuf);

impl TempDirGuard {
    fn new(name: &str) -> TempDirGuard {
        let path = std::env::temp_dir().join(format!("gpufrac-kustomize-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        TempDirGuard(path.canonicalize().expect("the temporary folder"))
    }
}

impl Drop for TempDirGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
