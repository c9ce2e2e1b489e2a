//! The Kubernetes manifests in `examples/kubernetes/` are what the API server accepts:
//! every resource in every `*.yaml` passes `kubernetes-validate --strict` (the API's own
//! OpenAPI schemas, shipped inside that Python package, so it needs no network) for the
//! oldest and the newest Kubernetes the docs name, and the parts the binaries rely on
//! (the webhook's path, the kubelet's device-plugin folder, the flags) are where they
//! expect them. The certificate script makes a certificate the webhook can serve.
//!
//! The arbiter's trust rests on its manifests too (docs/security.md): parsed with PyYAML (from the
//! same virtual environment), the DaemonSet must run it with `--kubernetes`, the kubelet's
//! PodResources folder read-only, `NODE_NAME` from the downward API, `hostPID`, and the
//! service account's token in the arbiter alone; the only RBAC is get/list/watch on
//! pods, bound to the node's service account; and every flag a manifest passes is one the
//! built binary lists in `--help` (so the workspace must be built first, as for the other
//! end-to-end tests).
//!
//! The DRA driver's manifests (`examples/kubernetes/dra/`, `resource.k8s.io/v1`) pass for
//! Kubernetes 1.34, the first with that API, and 1.37; parsed, the DaemonSet runs the
//! kubelet plugin with `dra --node-name=$(NODE_NAME)` and the host folders it writes in,
//! and the arbiter with `--kubernetes --dra-checkpoint` in the plugin's folder, mounted
//! read-only; a node runs it or the device plugin's DaemonSet, never both; its RBAC is what
//! the plugin and the arbiter need; the claim example asks for memory with gpufrac's
//! `GpuFractionConfig`, and constrains its devices only by attributes the plugin publishes;
//! and every flag is one the built binaries list in `--help`. The
//! claims' admission check calls the webhook's Service at `/validate` for the kinds and
//! versions the webhook reads, and every example claim, template and class passes it.
//!
//! Needs `kubernetes-validate`, installed by the README's test command into the
//! workspace's virtual environment `.venv/` (`python3 -m venv .venv && .venv/bin/pip
//! install -r tests/requirements.txt`): without it these tests fail and say so; they
//! never pass without validating.

use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use gpufrac_e2e::kubernetes_validate;
use serde_json::{json, Value};

/// Kubernetes versions whose schemas every manifest must pass: the oldest the docs
/// support (`matchConditions` on webhooks is GA from 1.30), the first with DRA's `v1`
/// (the DRA manifests' oldest), and the newest bundled with kubernetes-validate 1.37.0.
const KUBERNETES_VERSIONS: &[&str] = &["1.30", "1.34", "1.37"];

/// The manifests every installation starts from (the namespace, shared with the DRA
/// install, has a folder of its own: see `kustomize.rs`).
const EXPECTED: &[&str] = &[
    "namespace/namespace.yaml",
    "rbac.yaml",
    "daemonset.yaml",
    "webhook.yaml",
    "inference-deployment.yaml",
    "tensor-parallel-deployment.yaml",
];

fn kubernetes_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes")
}

fn read(name: &str) -> String {
    let path = kubernetes_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every `*.yaml` in `dir`, sorted, but `kustomization.yaml`: kustomize's, not the API's
/// (what it renders is checked in `kustomize.rs`).
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml"))
        .filter(|path| path.file_name().is_some_and(|name| name != "kustomization.yaml"))
        .collect();
    files.sort();
    files
}

/// A temporary folder of this test process, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!("gpufrac-manifests-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Validates `files` against the schemas of `version` in strict mode (unknown fields are
/// errors). Ok only if the validator succeeds, says nothing but "passed", and passes
/// every resource of every file: kubernetes-validate only warns, and exits 0, for a
/// kind or apiVersion it has no schema for, which here is an error too. The validator is
/// found as `gpufrac_e2e::kubernetes_validate::validator` says.
fn validate(files: &[PathBuf], version: &str) -> Result<(), String> {
    kubernetes_validate::validate_files(files, version)
}

#[test]
fn every_manifest_is_valid_kubernetes() {
    let mut files = yaml_files(&kubernetes_dir());
    files.extend(yaml_files(&kubernetes_dir().join("namespace")));
    for name in EXPECTED {
        assert!(
            files.iter().any(|f| f.ends_with(name)),
            "examples/kubernetes/{name} is missing (found {files:?})"
        );
    }
    for version in KUBERNETES_VERSIONS {
        if let Err(e) = validate(&files, version) {
            panic!("the manifests in examples/kubernetes are not valid for Kubernetes {version}: {e}");
        }
    }
}

#[test]
fn the_validation_catches_mistakes() {
    let dir = TempDir::new("mistakes");
    let daemonset = read("daemonset.yaml");
    let mistakes = [
        // Strict mode: a misspelt field.
        ("unknown-field", daemonset.replacen("readOnlyRootFilesystem:", "readOnlyRootFilesytem:", 1)),
        // A wrong type.
        ("wrong-type", daemonset.replacen("containerPort: 9400", "containerPort: \"9400\"", 1)),
        // A kind the API does not have: the validator only warns.
        ("unknown-kind", "apiVersion: v1\nkind: Pood\nmetadata:\n  name: x\n".to_owned()),
        // Not YAML.
        ("not-yaml", "kind: [Pod\n".to_owned()),
    ];
    for (name, text) in mistakes {
        let path = dir.0.join(format!("{name}.yaml"));
        std::fs::write(&path, text).expect("writing a test manifest");
        assert!(validate(&[path], "1.37").is_err(), "a manifest with {name} passed validation");
    }
}

#[test]
fn the_webhook_configuration_calls_the_webhook() {
    let text = read("webhook.yaml");
    for needed in [
        "kind: MutatingWebhookConfiguration",
        "apiVersion: admissionregistration.k8s.io/v1",
        "path: /mutate",
        "admissionReviewVersions: [\"v1\"]",
        "sideEffects: None",
        "failurePolicy: Fail",
        "timeoutSeconds: 5",
        "operations: [\"CREATE\"]",
        "resources: [\"pods\"]",
        "name: gpufrac-webhook\n        namespace: gpufrac-system\n        port: 443",
        "values: [gpufrac-system, kube-system]",
        "- webhook\n            - --listen\n            - 0.0.0.0:8443",
        "- --tls-cert\n            - /tls/tls.crt\n            - --tls-key\n            - /tls/tls.key",
        "secretName: gpufrac-webhook-tls",
        "replicas: 2",
    ] {
        assert!(text.contains(needed), "webhook.yaml lacks {needed:?}");
    }
}

#[test]
fn the_daemonset_mounts_what_the_node_parts_need() {
    let text = read("daemonset.yaml");
    for needed in [
        "kind: DaemonSet",
        "gpufrac.io/enabled: \"true\"",
        "priorityClassName: system-node-critical",
        "key: nvidia.com/gpu",
        // The kubelet's device-plugin folder, mounted at the same path.
        "path: /var/lib/kubelet/device-plugins",
        "mountPath: /var/lib/kubelet/device-plugins",
        "- --device-plugin-dir\n            - /var/lib/kubelet/device-plugins",
        "- --shares-per-gpu\n            - \"100\"",
        "- --shim-dir\n            - /opt/gpufrac/lib",
        "- --arbiter-socket\n            - /run/gpufrac/arbiter.sock",
        // The arbiter, its socket folder and metrics.
        "command: [gpufrac-arbiter]",
        "- --socket\n            - /run/gpufrac/arbiter.sock",
        "- --metrics\n            - 0.0.0.0:9400",
        "path: /run/gpufrac\n            type: DirectoryOrCreate",
        "containerPort: 9400",
        // NVML through the NVIDIA container runtime.
        "name: NVIDIA_VISIBLE_DEVICES\n              value: all",
        "name: NVIDIA_DRIVER_CAPABILITIES\n              value: utility",
        // The shim installed on the host (the_install_container_... runs the script).
        "path: /opt/gpufrac/lib",
    ] {
        assert!(text.contains(needed), "daemonset.yaml lacks {needed:?}");
    }
    assert!(!text.contains("privileged: true"), "no container needs to be privileged");
}

/// The init container's script, run as the node would (the image's folder and the
/// host's replaced by temporary ones): both libraries of the shim land on the host, each
/// replaced by a rename, and the installed pair works (the preloaded library finds its
/// core beside it, from the host folder).
#[test]
fn the_install_container_puts_both_shim_libraries_on_the_host() {
    let docs = documents("daemonset.yaml");
    let spec = &resource(&docs, "DaemonSet", "gpufrac-node")["spec"]["template"]["spec"];
    let installer = spec["initContainers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "install-shim"))
        .expect("an install-shim init container");
    let command: Vec<&str> =
        installer["command"].as_array().expect("a command").iter().filter_map(Value::as_str).collect();
    assert_eq!(&command[..2], ["/bin/sh", "-ec"], "the script runs with -e: a failed copy fails the pod");
    let root = std::env::temp_dir().join(format!("gpufrac-install-{}", std::process::id()));
    let (image, host) = (root.join("image"), root.join("host"));
    std::fs::create_dir_all(&image).expect("make the image folder");
    std::fs::create_dir_all(&host).expect("make the host folder");
    for lib in ["libgpufrac.so", "libgpufrac_core.so"] {
        std::fs::copy(gpufrac_e2e::artifact(lib), image.join(lib)).expect("stage the built library");
    }
    let script = command[2]
        .replace("/usr/lib/gpufrac", &image.display().to_string())
        .replace("/host/opt/gpufrac/lib", &host.display().to_string());
    let out = Command::new("/bin/sh").args(["-ec", &script]).output().expect("run /bin/sh");
    assert!(out.status.success(), "the install script failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut installed: Vec<String> = std::fs::read_dir(&host)
        .expect("read the host folder")
        .map(|e| e.expect("a folder entry").file_name().to_string_lossy().into_owned())
        .collect();
    installed.sort();
    assert_eq!(
        installed,
        ["libgpufrac.so", "libgpufrac_core.so"],
        "exactly the two libraries, no temporary left"
    );
    for lib in ["libgpufrac.so", "libgpufrac_core.so"] {
        assert_eq!(
            std::fs::read(host.join(lib)).expect("read the installed library"),
            std::fs::read(image.join(lib)).expect("read the staged library"),
            "{lib} installed whole"
        );
    }
    // The installed libgpufrac.so loads its core from the host folder: with the staged
    // copies gone, a CUDA program under it runs and sees its slice.
    std::fs::remove_dir_all(&image).expect("remove the staged copies");
    let gpu = gpufrac_e2e::SimGpu::new("2GiB");
    let out = gpu
        .command(gpufrac_e2e::compile_c("alloc_paths.c", &["MODE_DLSYM"], false))
        .env("LD_PRELOAD", host.join("libgpufrac.so"))
        .env("GPUFRAC_MEMORY_REQUEST", "256MiB")
        .env("GPUFRAC_MEMORY_LIMIT", gpu.plus_real_context("640MiB"))
        .args(["alloc", &(32u64 << 20).to_string(), &(32u64 << 20).to_string()])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run alloc_paths");
    let _ = std::fs::remove_dir_all(&root);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("DONE"), "a CUDA program under the installed shim: {text}");
}

#[test]
fn the_inference_example_asks_for_a_fraction() {
    let text = read("inference-deployment.yaml");
    for needed in [
        "gpufrac.io/inject: enabled",
        "gpufrac.io/gpu-fraction: \"0.25\"",
        "gpufrac.io/gpu-fraction-limit: \"0.5\"",
        "gpufrac.io/resolver: \"wait\"",
        "gpufrac.io/container: server",
        "- name: server",
    ] {
        assert!(text.contains(needed), "inference-deployment.yaml lacks {needed:?}");
    }
}

/// The tensor-parallel example through the webhook, as the API server sends its pod: 2 ×
/// 0.75 is 150 shares, which the device plugin splits over two GPUs.
#[test]
fn the_tensor_parallel_example_asks_for_two_gpus_worth_of_shares() {
    let docs = documents("tensor-parallel-deployment.yaml");
    let deployment = resource(&docs, "Deployment", "llm-tp-server");
    let template = &deployment["spec"]["template"];
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": "llm-tp-server-0", "namespace": "inference",
                                  "annotations": template["metadata"]["annotations"]},
                     "spec": template["spec"]});
    let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "2a1b9c3d-0000-4000-8000-000000000001",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "name": "llm-tp-server-0", "namespace": "inference", "operation": "CREATE",
        "userInfo": {"username": "admin"}, "object": pod, "dryRun": false}});
    let answer = gpufrac_device_plugin::webhook::review(&review);
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(answer["response"]["patch"].as_str().expect("a patch"))
        .expect("base64");
    let patch: Value = serde_json::from_slice(&patch).expect("a JSON Patch");
    let value = |path: &str| {
        patch.as_array().into_iter().flatten().find(|op| op["path"] == path).map(|op| op["value"].clone())
    };
    for list in ["limits", "requests"] {
        let path = format!("/spec/containers/0/resources/{list}/gpufrac.io~1gpu");
        assert_eq!(value(&path), Some(json!("150")), "{path} in {patch}");
    }
}

/// Runs make-webhook-cert.sh with a stand-in `kubectl` that records its arguments:
/// the certificate is for the webhook's Service and signed by the CA that goes into
/// caBundle, and running it again keeps the CA.
#[test]
fn the_certificate_script_makes_a_serving_certificate() {
    let script = kubernetes_dir().join("make-webhook-cert.sh");
    let syntax = Command::new("bash").arg("-n").arg(&script).output().expect("running bash -n");
    assert!(syntax.status.success(), "make-webhook-cert.sh: {}", String::from_utf8_lossy(&syntax.stderr));
    if Command::new("openssl").arg("version").output().is_err() {
        gpufrac_e2e::report_skip(
            gpufrac_e2e::Skip::ThisMachine,
            "openssl is not installed: make-webhook-cert.sh was only syntax-checked",
        );
        return;
    }
    let dir = TempDir::new("cert");
    let bin = dir.0.join("bin");
    std::fs::create_dir_all(&bin).expect("creating bin");
    let log = dir.0.join("kubectl.log");
    let kubectl = bin.join("kubectl");
    std::fs::write(
        &kubectl,
        format!(
            "#!/bin/sh\necho \"$*\" >> '{}'\ncase \"$*\" in *'-o yaml'*) echo 'kind: Secret';; *'apply -f -'*) cat >/dev/null;; esac\n",
            log.display()
        ),
    )
    .expect("writing the stand-in kubectl");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&kubectl, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let certs = dir.0.join("certs");
    let run = || {
        let out = Command::new("bash")
            .arg(&script)
            .arg(&certs)
            .env("PATH", &path)
            .output()
            .expect("running the script");
        assert!(
            out.status.success(),
            "make-webhook-cert.sh failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(certs.join("ca.crt")).expect("the script keeps ca.crt")
    };
    let first_ca = run();
    let second_ca = run();
    assert_eq!(first_ca, second_ca, "running the script again keeps the CA (and so caBundle)");

    let calls = std::fs::read_to_string(&log).expect("kubectl was called");
    assert!(
        calls.contains("-n gpufrac-system create secret tls gpufrac-webhook-tls"),
        "kubectl calls: {calls}"
    );
    assert!(calls.contains("patch mutatingwebhookconfiguration gpufrac-webhook"), "kubectl calls: {calls}");
    // The DRA claims' check is served by the same pods: its caBundle too, when installed.
    assert!(
        calls.contains("patch validatingwebhookconfiguration gpufrac-dra-config"),
        "kubectl calls: {calls}"
    );
    // base64 of "-----BEGIN": the CA's PEM goes into caBundle.
    assert!(
        calls.contains("/webhooks/0/clientConfig/caBundle\",\"value\":\"LS0tLS1CRUdJTi"),
        "kubectl calls: {calls}"
    );

    let text = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(certs.join("tls.crt"))
        .output()
        .expect("openssl x509");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("DNS:gpufrac-webhook.gpufrac-system.svc"), "the certificate's names: {text}");
    let verify = Command::new("openssl")
        .arg("verify")
        .arg("-CAfile")
        .arg(certs.join("ca.crt"))
        .arg(certs.join("tls.crt"))
        .output()
        .expect("openssl verify");
    assert!(
        verify.status.success(),
        "the certificate is signed by the CA: {}",
        String::from_utf8_lossy(&verify.stdout)
    );
}

// ---- What the arbiter trusts (docs/security.md): its DaemonSet and its RBAC, parsed ----

/// The one document of `kind` named `name` in `docs`.
fn resource<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> =
        docs.iter().filter(|d| d["kind"] == kind && d["metadata"]["name"] == name).collect();
    assert_eq!(found.len(), 1, "expected one {kind} {name}, found {}", found.len());
    found[0]
}

/// The container `name` of a pod spec.
fn container<'a>(spec: &'a Value, name: &str) -> &'a Value {
    spec["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name} in the DaemonSet"))
}

/// A container's args as strings.
fn args(container: &Value) -> Vec<&str> {
    container["args"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default()
}

/// The value that follows `flag` in `args`.
fn flag_value<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    args.iter().position(|a| *a == flag).and_then(|i| args.get(i + 1).copied())
}

/// The volume mounted at `mount_path` in `container`, with its mount.
fn mounted<'a>(spec: &'a Value, container: &'a Value, mount_path: &str) -> (&'a Value, &'a Value) {
    let mount = container["volumeMounts"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["mountPath"] == mount_path))
        .unwrap_or_else(|| panic!("container {} mounts nothing at {mount_path}", container["name"]));
    let volume = spec["volumes"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == mount["name"]))
        .unwrap_or_else(|| panic!("no volume {} in the DaemonSet", mount["name"]));
    (mount, volume)
}

#[test]
fn the_arbiter_learns_entitlements_from_the_kubelet_and_the_pod() {
    let docs = documents("daemonset.yaml");
    let spec = &resource(&docs, "DaemonSet", "gpufrac-node")["spec"]["template"]["spec"];
    let arbiter = container(spec, "arbiter");
    let arbiter_args = args(arbiter);

    // Entitlements from the kubelet and the API server, never from a client's env.
    assert!(arbiter_args.contains(&"--kubernetes"), "arbiter args: {arbiter_args:?}");
    assert!(!arbiter_args.contains(&"--policy"), "--policy and --kubernetes exclude each other");
    assert_eq!(
        flag_value(&arbiter_args, "--pod-resources-socket"),
        Some("/var/lib/kubelet/pod-resources/kubelet.sock")
    );
    assert_eq!(flag_value(&arbiter_args, "--socket"), Some("/run/gpufrac/arbiter.sock"));
    // Shares are counted the same way by both: a share is 1/N of a GPU for each.
    let plugin_args = args(container(spec, "device-plugin"));
    assert_eq!(
        flag_value(&arbiter_args, "--shares-per-gpu"),
        flag_value(&plugin_args, "--shares-per-gpu"),
        "the arbiter's and the device plugin's --shares-per-gpu differ"
    );

    // NODE_NAME from the downward API.
    let node_name = arbiter["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == "NODE_NAME"))
        .expect("the arbiter has NODE_NAME");
    assert_eq!(node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");
    assert!(node_name.get("value").is_none());

    // The kubelet's PodResources folder, read-only, from the host.
    let (mount, volume) = mounted(spec, arbiter, "/var/lib/kubelet/pod-resources");
    assert_eq!(mount["readOnly"], true, "the PodResources folder is mounted read-only");
    assert_eq!(volume["hostPath"]["path"], "/var/lib/kubelet/pod-resources");
    // The socket folder the shims connect to.
    let (_, volume) = mounted(spec, arbiter, "/run/gpufrac");
    assert_eq!(volume["hostPath"]["path"], "/run/gpufrac");

    // The node's processes: /proc/<pid>/cgroup and pidfds of other pods' processes.
    assert_eq!(spec["hostPID"], true);
    // Signals to processes of any user, and nothing more.
    let caps = &arbiter["securityContext"]["capabilities"];
    assert_eq!(caps["drop"], json!(["ALL"]));
    assert_eq!(caps["add"], json!(["KILL"]));
    assert_ne!(arbiter["securityContext"]["privileged"], true);

    // The service account's token reaches the arbiter alone, at the standard path.
    assert_eq!(spec["serviceAccountName"], "gpufrac-node");
    assert_eq!(spec["automountServiceAccountToken"], false);
    let token_dir = "/var/run/secrets/kubernetes.io/serviceaccount";
    let (mount, volume) = mounted(spec, arbiter, token_dir);
    assert_eq!(mount["readOnly"], true);
    let sources = volume["projected"]["sources"].as_array().expect("a projected volume");
    assert!(sources.iter().any(|s| s["serviceAccountToken"]["path"] == "token"), "{sources:?}");
    assert!(
        sources.iter().any(|s| s["configMap"]["name"] == "kube-root-ca.crt"
            && s["configMap"]["items"] == json!([{"key": "ca.crt", "path": "ca.crt"}])),
        "{sources:?}"
    );
    for c in spec["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(spec["initContainers"].as_array().into_iter().flatten())
    {
        if c["name"] != "arbiter" {
            let mounts = c["volumeMounts"].as_array().into_iter().flatten();
            assert!(
                mounts.into_iter().all(|m| m["mountPath"] != token_dir && m["name"] != mount["name"]),
                "container {} gets the API token too",
                c["name"]
            );
        }
    }
}

/// What is wrong with the RBAC of `docs` for gpufrac's node service account: anything
/// but one ClusterRole of get/list/watch on core pods, bound to gpufrac-node only;
/// any Role, RoleBinding or other binding; any wildcard.
fn rbac_problems(docs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let rbac =
        |d: &&Value| d["apiVersion"].as_str().is_some_and(|v| v.starts_with("rbac.authorization.k8s.io/"));
    for doc in docs.iter().filter(rbac) {
        let kind = doc["kind"].as_str().unwrap_or_default();
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        match kind {
            "ClusterRole" => {
                let rules = doc["rules"].as_array().map(Vec::as_slice).unwrap_or_default();
                if rules.is_empty() {
                    problems.push(format!("ClusterRole {name} has no rules"));
                }
                for rule in rules {
                    let strings = |key: &str| -> Vec<String> {
                        rule[key]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|v| v.as_str().unwrap_or("?").to_owned())
                            .collect()
                    };
                    if strings("apiGroups") != [""] {
                        problems.push(format!(
                            "ClusterRole {name}: apiGroups {:?}, expected [\"\"]",
                            strings("apiGroups")
                        ));
                    }
                    if strings("resources") != ["pods"] {
                        problems.push(format!(
                            "ClusterRole {name}: resources {:?}, expected [\"pods\"]",
                            strings("resources")
                        ));
                    }
                    for verb in strings("verbs") {
                        if !["get", "list", "watch"].contains(&verb.as_str()) {
                            problems.push(format!("ClusterRole {name}: verb {verb:?} is not read-only"));
                        }
                    }
                    for key in ["nonResourceURLs", "resourceNames"] {
                        if rule.get(key).is_some() {
                            problems.push(format!("ClusterRole {name}: unexpected {key}"));
                        }
                    }
                }
                if doc.get("aggregationRule").is_some() {
                    problems.push(format!("ClusterRole {name} aggregates other roles"));
                }
            }
            "ClusterRoleBinding" => {
                if doc["roleRef"]
                    != json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "gpufrac-node"})
                {
                    problems.push(format!("ClusterRoleBinding {name} binds {}", doc["roleRef"]));
                }
                if doc["subjects"]
                    != json!([{"kind": "ServiceAccount", "name": "gpufrac-node", "namespace": "gpufrac-system"}])
                {
                    problems.push(format!("ClusterRoleBinding {name} binds to {}", doc["subjects"]));
                }
            }
            other => problems.push(format!("unexpected {other} {name}")),
        }
    }
    problems
}

/// A change made to each document of a manifest.
type Change<'a> = &'a dyn Fn(&mut Value);

#[test]
fn the_node_rbac_reads_pods_and_nothing_else() {
    let mut all = Vec::new();
    for file in yaml_files(&kubernetes_dir()) {
        all.extend(documents(&file.file_name().expect("a file name").to_string_lossy()));
    }
    let problems = rbac_problems(&all);
    assert!(problems.is_empty(), "{problems:#?}");
    // It is there at all, in rbac.yaml, and the webhook gets no role.
    let docs = documents("rbac.yaml");
    let role = resource(&docs, "ClusterRole", "gpufrac-node");
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}])
    );
    resource(&docs, "ClusterRoleBinding", "gpufrac-node");
    for account in ["gpufrac-node", "gpufrac-webhook"] {
        assert_eq!(resource(&docs, "ServiceAccount", account)["automountServiceAccountToken"], false);
    }

    // The check catches what it should.
    let mutated = |f: Change| {
        let mut docs = docs.clone();
        for doc in docs.iter_mut() {
            f(doc);
        }
        rbac_problems(&docs)
    };
    let widened: [(&str, Change); 5] = [
        ("a write verb", &|d| {
            if d["kind"] == "ClusterRole" {
                d["rules"][0]["verbs"] = json!(["get", "list", "watch", "delete"]);
            }
        }),
        ("secrets", &|d| {
            if d["kind"] == "ClusterRole" {
                d["rules"][0]["resources"] = json!(["pods", "secrets"]);
            }
        }),
        ("a wildcard", &|d| {
            if d["kind"] == "ClusterRole" {
                d["rules"][0]["verbs"] = json!(["*"]);
            }
        }),
        ("pods/exec", &|d| {
            if d["kind"] == "ClusterRole" {
                d["rules"][0]["resources"] = json!(["pods/exec"]);
            }
        }),
        ("the webhook bound too", &|d| {
            if d["kind"] == "ClusterRoleBinding" {
                if let Some(subjects) = d["subjects"].as_array_mut() {
                    subjects.push(json!({"kind": "ServiceAccount", "name": "gpufrac-webhook", "namespace": "gpufrac-system"}));
                }
            }
        }),
    ];
    for (what, change) in widened {
        assert!(!mutated(change).is_empty(), "RBAC with {what} passed the check");
    }
}

/// `binary --help` (or `binary SUBCOMMAND --help`), for the flags it takes.
fn help(binary: &str, subcommand: Option<&str>) -> String {
    let path = gpufrac_e2e::artifact(binary);
    let out = Command::new(&path)
        .args(subcommand)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("running {} --help: {e}", path.display()));
    assert!(
        out.status.success(),
        "{} --help failed: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_flag_the_manifests_pass_is_one_the_binaries_take() {
    let daemonset = documents("daemonset.yaml");
    let spec = &resource(&daemonset, "DaemonSet", "gpufrac-node")["spec"]["template"]["spec"];
    let webhook = documents("webhook.yaml");
    let webhook_spec = &resource(&webhook, "Deployment", "gpufrac-webhook")["spec"]["template"]["spec"];
    let cases = [
        ("gpufrac-arbiter", None, container(spec, "arbiter")),
        ("gpufrac-device-plugin", None, container(spec, "device-plugin")),
        ("gpufrac-device-plugin", Some("webhook"), container(webhook_spec, "webhook")),
    ];
    for (binary, subcommand, c) in cases {
        assert_eq!(c["command"], json!([binary]), "container {}", c["name"]);
        let help = help(binary, subcommand);
        let mut flags: Vec<&str> = args(c).into_iter().filter(|a| a.starts_with("--")).collect();
        assert!(!flags.is_empty(), "container {} passes no flags", c["name"]);
        flags.dedup();
        for flag in flags {
            let flag = flag.split('=').next().unwrap_or(flag);
            assert!(
                help.split(|ch: char| ch.is_whitespace() || ch == ',').any(|word| word == flag),
                "container {} passes {flag}, which {binary}{} --help does not list:\n{help}",
                c["name"],
                subcommand.map(|s| format!(" {s}")).unwrap_or_default()
            );
        }
    }
}

// ---- The DRA driver's manifests (examples/kubernetes/dra/): resource.k8s.io/v1 ----

/// Kubernetes versions whose schemas every DRA manifest must pass: the first with
/// `resource.k8s.io/v1` (DRA GA; the other manifests' 1.30 has no such API) and the newest
/// bundled with kubernetes-validate 1.37.0.
const DRA_KUBERNETES_VERSIONS: &[&str] = &["1.34", "1.37"];

/// The DRA manifests.
const DRA_EXPECTED: &[&str] = &[
    "deviceclass.yaml",
    "rbac-dra.yaml",
    "daemonset-dra.yaml",
    "inference-claim.yaml",
    "tensor-parallel-claim.yaml",
    "config-validation.yaml",
];

/// The driver's name (the DeviceClass's, the slices' and the claims' configuration's),
/// the plugin's folder (its DRA socket and checkpoint) and the checkpoint's file name in
/// it: the names the plugin and the arbiter share.
use gpufrac_common::dra::{CHECKPOINT_FILE, DEFAULT_PLUGIN_DIR as PLUGIN_DIR, DRIVER};
/// The kubelet's plugin registration folder.
const PLUGINS_REGISTRY: &str = "/var/lib/kubelet/plugins_registry";
/// Where the plugin writes CDI specs for the container runtime.
const CDI_DIR: &str = "/var/run/cdi";
/// The DRA nodes' ServiceAccount.
const DRA_ACCOUNT: &str = "gpufrac-node-dra";

fn dra_dir() -> PathBuf {
    kubernetes_dir().join("dra")
}

/// The documents of `examples/kubernetes/dra/<name>`, parsed by PyYAML.
fn documents(name: &str) -> Vec<Value> {
    kubernetes_validate::yaml_documents(&kubernetes_dir().join(name))
}

fn dra_documents(name: &str) -> Vec<Value> {
    documents(&format!("dra/{name}"))
}

/// The pod spec of the DRA DaemonSet.
fn dra_daemonset() -> Value {
    let docs = dra_documents("daemonset-dra.yaml");
    resource(&docs, "DaemonSet", "gpufrac-node-dra").clone()
}

/// The value of the environment variable `name` of `container`.
fn env<'a>(container: &'a Value, name: &str) -> &'a Value {
    container["env"]
        .as_array()
        .and_then(|env| env.iter().find(|e| e["name"] == name))
        .unwrap_or_else(|| panic!("container {} has no {name}", container["name"]))
}

/// The plugin's args split at its subcommand: the global flags before `dra`, the
/// subcommand's after.
fn split_at_dra<'a>(plugin_args: &[&'a str]) -> (Vec<&'a str>, Vec<&'a str>) {
    let at = plugin_args
        .iter()
        .position(|a| *a == "dra")
        .unwrap_or_else(|| panic!("the plugin does not run `dra`: {plugin_args:?}"));
    (plugin_args[..at].to_vec(), plugin_args[at + 1..].to_vec())
}

#[test]
fn every_dra_manifest_is_valid_kubernetes() {
    let files = yaml_files(&dra_dir());
    for name in DRA_EXPECTED {
        assert!(
            files.iter().any(|f| f.file_name().is_some_and(|n| n == *name)),
            "examples/kubernetes/dra/{name} is missing (found {files:?})"
        );
    }
    for version in DRA_KUBERNETES_VERSIONS {
        if let Err(e) = validate(&files, version) {
            panic!("the manifests in examples/kubernetes/dra are not valid for Kubernetes {version}: {e}");
        }
    }
    // Why they are a list of their own: before 1.34 there is no resource.k8s.io/v1.
    let class = dra_dir().join("deviceclass.yaml");
    assert!(validate(&[class], "1.33").is_err(), "a resource.k8s.io/v1 DeviceClass passed for 1.33");
}

/// Every attribute name the kubelet plugin can publish for a GPU (one whose place is all
/// known), qualified with the driver's domain as claims name them.
fn published_attributes() -> Vec<String> {
    use gpufrac_device_plugin::dra::gpus::{GpuInfo, Topology};
    use gpufrac_device_plugin::dra::slices::{device, share_devices};
    let gpu = GpuInfo {
        index: 0,
        uuid: "GPU-0".into(),
        product_name: "NVIDIA H100 80GB HBM3".into(),
        memory: 80 << 30,
        compute_capability: (9, 0),
        driver_version: "570.124.06".into(),
        cuda_version: (12, 8),
        pci_bus_id: "00000000:18:00.0".into(),
        topology: Topology {
            pcie_root: Some("pci0000:17".into()),
            numa_node: Some(0),
            nvlink_peers: Some(vec![1]),
            nvlink_domain: Some(0),
        },
    };
    let mut devices = share_devices(&gpu, 2);
    devices.push(device(&gpu));
    let mut names: Vec<String> = devices
        .iter()
        .flat_map(|d| d.attributes.iter().flat_map(|a| a.keys()))
        // Unqualified names are in the driver's domain.
        .map(|name| if name.contains('/') { name.clone() } else { format!("{DRIVER}/{name}") })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The example claims constrain their devices by attributes the plugin publishes (a
/// misspelt one matches no device, and the claim is never allocated); the tensor-parallel
/// example's NVLink template keeps its two halves on two GPUs of one NVLink domain.
#[test]
fn dra_example_claims_constrain_attributes_the_plugin_publishes() {
    let published = published_attributes();
    for name in
        ["gpu.gpufrac.io/nvlinkDomain", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"]
    {
        assert!(published.iter().any(|p| p == name), "{name} not in {published:?}");
    }
    let mut constrained = 0;
    for file in yaml_files(&dra_dir()) {
        for doc in kubernetes_validate::yaml_documents(&file) {
            let spec = match doc["kind"].as_str() {
                Some("ResourceClaimTemplate") => &doc["spec"]["spec"],
                Some("ResourceClaim") => &doc["spec"],
                _ => continue,
            };
            for constraint in spec["devices"]["constraints"].as_array().into_iter().flatten() {
                for key in ["matchAttribute", "distinctAttribute"] {
                    if let Some(name) = constraint[key].as_str() {
                        constrained += 1;
                        assert!(
                            published.iter().any(|p| p == name),
                            "{}: {key} {name} is not an attribute the plugin publishes ({published:?})",
                            file.display()
                        );
                    }
                }
            }
        }
    }
    assert!(constrained >= 3, "only {constrained} constraints found in the DRA examples");
    let docs = dra_documents("tensor-parallel-claim.yaml");
    let nvlink = resource(&docs, "ResourceClaimTemplate", "tp-gpus-nvlink");
    let constraints = &nvlink["spec"]["spec"]["devices"]["constraints"];
    assert_eq!(
        constraints,
        &json!([{"requests": ["gpu"], "distinctAttribute": "gpu.gpufrac.io/uuid"},
                {"requests": ["gpu"], "matchAttribute": "gpu.gpufrac.io/nvlinkDomain"}]),
    );
    assert_eq!(nvlink["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"], 2);
}

#[test]
fn the_dra_daemonset_runs_the_kubelet_plugin_and_the_arbiter_on_its_checkpoint() {
    let daemonset = dra_daemonset();
    let spec = &daemonset["spec"]["template"]["spec"];
    let names: Vec<&str> = spec["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["arbiter", "dra-plugin"], "no device plugin on a DRA node");

    // The kubelet plugin, on this node.
    let plugin = container(spec, "dra-plugin");
    assert_eq!(plugin["command"], json!(["gpufrac-device-plugin"]));
    let plugin_args = args(plugin);
    let (global, dra) = split_at_dra(&plugin_args);
    assert!(dra.contains(&"--node-name=$(NODE_NAME)"), "dra args: {dra:?}");
    for c in [plugin, container(spec, "arbiter")] {
        let node_name = env(c, "NODE_NAME");
        assert_eq!(node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName", "{}", c["name"]);
        assert!(node_name.get("value").is_none());
    }
    // The three host folders it writes in, each at its own path.
    for (flag, path) in
        [("--plugins-registry", PLUGINS_REGISTRY), ("--plugin-dir", PLUGIN_DIR), ("--cdi-dir", CDI_DIR)]
    {
        assert_eq!(flag_value(&dra, flag), Some(path), "dra args: {dra:?}");
        let (mount, volume) = mounted(spec, plugin, path);
        assert_ne!(mount["readOnly"], true, "the plugin writes in {path}");
        assert_eq!(volume["hostPath"]["path"], path);
    }
    // What the CDI specs name: the shim's folder and the arbiter's socket, from the host.
    let shim_dir = flag_value(&global, "--shim-dir").expect("--shim-dir before dra");
    let (mount, volume) = mounted(spec, plugin, shim_dir);
    assert_eq!(mount["readOnly"], true);
    assert_eq!(volume["hostPath"]["path"], shim_dir);
    let socket = flag_value(&global, "--arbiter-socket").expect("--arbiter-socket before dra");
    let socket_dir = Path::new(socket).parent().and_then(Path::to_str).expect("a socket in a folder");
    let (_, volume) = mounted(spec, plugin, socket_dir);
    assert_eq!(volume["hostPath"]["path"], socket_dir);

    // The arbiter: entitlements from the plugin's checkpoint, read-only.
    let arbiter = container(spec, "arbiter");
    let arbiter_args = args(arbiter);
    assert!(arbiter_args.contains(&"--kubernetes"), "arbiter args: {arbiter_args:?}");
    let checkpoint = format!("{PLUGIN_DIR}/{CHECKPOINT_FILE}");
    assert_eq!(flag_value(&arbiter_args, "--dra-checkpoint"), Some(checkpoint.as_str()));
    let (mount, volume) = mounted(spec, arbiter, PLUGIN_DIR);
    assert_eq!(mount["readOnly"], true, "the arbiter reads the plugin's folder only");
    assert_eq!(volume["hostPath"]["path"], PLUGIN_DIR);
    assert_eq!(mounted(spec, plugin, PLUGIN_DIR).1["name"], volume["name"], "one folder for both");
    // Shares are the device plugin's: not here.
    for flag in ["--shares-per-gpu", "--pod-resources-socket", "--policy"] {
        assert!(!arbiter_args.contains(&flag), "the DRA arbiter passes {flag}: {arbiter_args:?}");
    }
    // The socket the CDI specs name is the one the arbiter serves.
    assert_eq!(flag_value(&arbiter_args, "--socket"), Some(socket));
    let (_, volume) = mounted(spec, arbiter, socket_dir);
    assert_eq!(volume["hostPath"]["path"], socket_dir);

    // As ../daemonset.yaml: the node's processes, no privileged container, NVML through
    // the NVIDIA runtime, and the token in the containers that talk to the API server alone.
    assert_eq!(spec["hostPID"], true);
    assert_eq!(spec["serviceAccountName"], DRA_ACCOUNT);
    assert_eq!(spec["automountServiceAccountToken"], false);
    let token_dir = "/var/run/secrets/kubernetes.io/serviceaccount";
    for c in [arbiter, plugin] {
        assert_ne!(c["securityContext"]["privileged"], true, "{} is privileged", c["name"]);
        assert_eq!(env(c, "NVIDIA_VISIBLE_DEVICES")["value"], "all");
        let (mount, volume) = mounted(spec, c, token_dir);
        assert_eq!(mount["readOnly"], true);
        assert!(volume["projected"]["sources"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["serviceAccountToken"]["path"] == "token")));
    }
    for c in spec["initContainers"].as_array().into_iter().flatten() {
        let mounts = c["volumeMounts"].as_array().into_iter().flatten();
        assert!(mounts.into_iter().all(|m| m["mountPath"] != token_dir), "{} gets the token", c["name"]);
    }
}

/// Whether `selector`'s matchLabels select a pod labelled `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector["matchLabels"].as_object().is_some_and(|m| m.iter().all(|(k, v)| labels[k] == *v))
}

#[test]
fn a_node_runs_the_dra_daemonset_or_the_device_plugin_one_never_both() {
    let dra = dra_daemonset();
    let docs = documents("daemonset.yaml");
    let plugin = resource(&docs, "DaemonSet", "gpufrac-node");
    let dra_spec = &dra["spec"]["template"]["spec"];
    assert_eq!(dra_spec["nodeSelector"], json!({"gpufrac.io/mode": "dra"}));
    // Each of ../daemonset.yaml's node labels is excluded in every term of the affinity.
    let terms = dra_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .expect("a required node affinity");
    let old = plugin["spec"]["template"]["spec"]["nodeSelector"].as_object().expect("a nodeSelector");
    assert!(!old.is_empty());
    for (key, value) in old {
        for term in terms {
            let excluded = term["matchExpressions"].as_array().into_iter().flatten().any(|e| {
                e["key"] == *key
                    && (e["operator"] == "DoesNotExist"
                        || (e["operator"] == "NotIn"
                            && e["values"].as_array().is_some_and(|vs| vs.contains(value))))
            });
            assert!(
                excluded,
                "a node labelled {key}={value} (../daemonset.yaml's) may run gpufrac-node-dra too"
            );
        }
    }
    // Neither DaemonSet's selector takes the other's pods.
    let (dra_labels, plugin_labels) =
        (&dra["spec"]["template"]["metadata"]["labels"], &plugin["spec"]["template"]["metadata"]["labels"]);
    assert!(selects(&dra["spec"]["selector"], dra_labels));
    assert!(
        !selects(&dra["spec"]["selector"], plugin_labels),
        "gpufrac-node-dra selects gpufrac-node's pods"
    );
    assert!(
        !selects(&plugin["spec"]["selector"], dra_labels),
        "gpufrac-node selects gpufrac-node-dra's pods"
    );
}

#[test]
fn the_dra_rbac_grants_the_plugin_and_the_arbiter_what_they_need_and_no_more() {
    let docs = dra_documents("rbac-dra.yaml");
    assert_eq!(resource(&docs, "ServiceAccount", DRA_ACCOUNT)["automountServiceAccountToken"], false);
    assert_eq!(resource(&docs, "ServiceAccount", DRA_ACCOUNT)["metadata"]["namespace"], "gpufrac-system");

    // Every (group, resource, verb) granted, exactly.
    let role = resource(&docs, "ClusterRole", DRA_ACCOUNT);
    let mut granted = Vec::new();
    for rule in role["rules"].as_array().expect("rules") {
        for key in ["nonResourceURLs", "resourceNames"] {
            assert!(rule.get(key).is_none(), "a rule with {key}: {rule}");
        }
        let strings = |key: &str| -> Vec<String> {
            rule[key].as_array().into_iter().flatten().map(|v| v.as_str().unwrap_or("?").to_owned()).collect()
        };
        for group in strings("apiGroups") {
            for resource in strings("resources") {
                for verb in strings("verbs") {
                    granted.push(format!("{group}/{resource}:{verb}"));
                }
            }
        }
    }
    granted.sort();
    let mut expected: Vec<String> = Vec::new();
    for (group_resource, verbs) in [
        (
            "resource.k8s.io/resourceslices",
            &["get", "list", "watch", "create", "update", "patch", "delete"][..],
        ),
        ("resource.k8s.io/resourceclaims", &["get", "list", "watch"]),
        ("/pods", &["get", "list", "watch"]),
        ("/nodes", &["get"]),
        ("/nodes/status", &["patch"]),
    ] {
        expected.extend(verbs.iter().map(|verb| format!("{group_resource}:{verb}")));
    }
    expected.sort();
    assert_eq!(granted, expected, "the ClusterRole {DRA_ACCOUNT}");
    assert!(role.get("aggregationRule").is_none());

    let binding = resource(&docs, "ClusterRoleBinding", DRA_ACCOUNT);
    assert_eq!(
        binding["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": DRA_ACCOUNT})
    );
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": DRA_ACCOUNT, "namespace": "gpufrac-system"}])
    );
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert!(!kinds.contains(&"Role") && !kinds.contains(&"RoleBinding"), "{kinds:?}");
    assert_eq!(dra_daemonset()["spec"]["template"]["spec"]["serviceAccountName"], DRA_ACCOUNT);

    // Slice writes held to the account's own node, for that account.
    let policy = resource(&docs, "ValidatingAdmissionPolicy", "gpufrac-node-dra-resourceslices");
    let text = policy.to_string();
    assert!(text.contains(&format!("system:serviceaccount:gpufrac-system:{DRA_ACCOUNT}")), "{text}");
    assert!(text.contains("authentication.kubernetes.io/node-name"), "{text}");
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let binding = resource(&docs, "ValidatingAdmissionPolicyBinding", "gpufrac-node-dra-resourceslices");
    assert_eq!(binding["spec"]["policyName"], "gpufrac-node-dra-resourceslices");
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));

    // Its Node status writes held to its own node and its one condition.
    let policy = resource(&docs, "ValidatingAdmissionPolicy", "gpufrac-node-dra-node-condition");
    let text = policy.to_string();
    assert!(text.contains("nodes/status") && text.contains("GpufracDRASliceComplete"), "{text}");
    assert!(text.contains("authentication.kubernetes.io/node-name"), "{text}");
    let binding = resource(&docs, "ValidatingAdmissionPolicyBinding", "gpufrac-node-dra-node-condition");
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
}

/// A quantity with a binary suffix (`20Gi`, `256Mi`) in bytes.
fn quantity(text: &str) -> u64 {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let unit = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        other => panic!("unexpected unit {other:?} in {text:?}"),
    };
    number.parse::<u64>().unwrap_or_else(|e| panic!("{text:?}: {e}")) * unit
}

#[test]
fn the_dra_claim_asks_for_memory_of_a_gpufrac_gpu() {
    let docs = dra_documents("deviceclass.yaml");
    let class = resource(&docs, "DeviceClass", DRIVER);
    assert_eq!(
        class["spec"]["selectors"],
        json!([{"cel": {"expression": format!("device.driver == \"{DRIVER}\"")}}])
    );

    let docs = dra_documents("inference-claim.yaml");
    let template = resource(&docs, "ResourceClaimTemplate", "llm-gpu");
    let devices = &template["spec"]["spec"]["devices"];
    let requests = devices["requests"].as_array().expect("requests");
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0]["name"], "gpu");
    let exactly = &requests[0]["exactly"];
    assert_eq!(exactly["deviceClassName"], DRIVER);
    let request = quantity(exactly["capacity"]["requests"]["memory"].as_str().expect("a memory request"));
    assert_eq!(request, 20 << 30);
    assert!(request >= 256 << 20 && request.is_multiple_of(256 << 20), "off the slice's 256Mi steps");

    let configs = devices["config"].as_array().expect("config");
    assert_eq!(configs.len(), 1);
    assert_eq!(configs[0]["requests"], json!(["gpu"]));
    let opaque = &configs[0]["opaque"];
    assert_eq!(opaque["driver"], DRIVER);
    let parameters = &opaque["parameters"];
    assert_eq!(parameters["apiVersion"], "gpufrac.io/v1");
    assert_eq!(parameters["kind"], "GpuFractionConfig");
    assert_eq!(parameters["resolver"], "swap");
    // A compute share: 30% of the GPU's time through the scheduler (the "compute"
    // capacity, per mille), at most 80% even when the GPU is otherwise idle.
    assert_eq!(exactly["capacity"]["requests"]["compute"], "300");
    assert_eq!(parameters["computeLimit"], "80%");
    let limit = quantity(parameters["limit"].as_str().expect("a limit"));
    assert_eq!(limit, 40 << 30);
    assert!(limit >= request);
    for key in parameters.as_object().expect("parameters").keys() {
        assert!(
            [
                "apiVersion",
                "kind",
                "limit",
                "resolver",
                "priority",
                "parkAfter",
                "computeRequest",
                "computeLimit"
            ]
            .contains(&key.as_str()),
            "GpuFractionConfig has no field {key}"
        );
    }

    let deployment = resource(&docs, "Deployment", "llm-server");
    assert_eq!(deployment["metadata"]["namespace"], template["metadata"]["namespace"]);
    let pod = &deployment["spec"]["template"];
    assert_eq!(
        pod["spec"]["resourceClaims"],
        json!([{"name": "gpu", "resourceClaimTemplateName": "llm-gpu"}])
    );
    let server = pod["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "server"))
        .expect("a container server");
    assert_eq!(server["resources"]["claims"], json!([{"name": "gpu"}]));
    // No GPU asked for another way, and nothing for the webhook.
    let text = pod.to_string();
    for other in ["gpufrac.io/gpu", "nvidia.com/gpu", "gpufrac.io/gpu-fraction"] {
        assert!(!text.contains(other), "the DRA example asks for {other} too");
    }
}

/// `binary [subcommand] --help`, or why it failed (a subcommand the binary lacks yet).
fn try_help(binary: &str, subcommand: Option<&str>) -> Result<String, String> {
    let path = gpufrac_e2e::artifact(binary);
    let out = Command::new(&path)
        .args(subcommand)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("running {} --help: {e}", path.display()));
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The `--flags` of `args` (without `=value`) that `help` does not list.
fn unlisted<'a>(args: &[&'a str], help: &str) -> Vec<&'a str> {
    let mut missing: Vec<&str> = args
        .iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| a.split('=').next().unwrap_or(a))
        .filter(|flag| !help.split(|ch: char| ch.is_whitespace() || ch == ',').any(|word| word == *flag))
        .collect();
    missing.dedup();
    missing
}

#[test]
fn every_flag_the_dra_manifests_pass_is_one_the_binaries_take() {
    let daemonset = dra_daemonset();
    let spec = &daemonset["spec"]["template"]["spec"];
    let plugin = container(spec, "dra-plugin");
    let arbiter = container(spec, "arbiter");
    assert_eq!(arbiter["command"], json!(["gpufrac-arbiter"]));
    let plugin_args = args(plugin);
    let (global, dra) = split_at_dra(&plugin_args);
    let arbiter_args = args(arbiter);
    let cases = [
        ("gpufrac-arbiter", None, arbiter_args.as_slice()),
        ("gpufrac-device-plugin", None, global.as_slice()),
        ("gpufrac-device-plugin", Some("dra"), dra.as_slice()),
    ];
    // Every missing flag at once, so one run says all that the binaries still lack.
    let mut problems = Vec::new();
    for (binary, subcommand, passed) in cases {
        assert!(passed.iter().any(|a| a.starts_with("--")), "{binary} {subcommand:?} is passed no flags");
        let command = format!("{binary}{}", subcommand.map(|s| format!(" {s}")).unwrap_or_default());
        match try_help(binary, subcommand) {
            Ok(help) => {
                for flag in unlisted(passed, &help) {
                    problems.push(format!("{command} --help does not list {flag}"));
                }
            }
            Err(stderr) => problems.push(format!("{command} --help failed: {}", stderr.trim())),
        }
    }
    assert!(
        problems.is_empty(),
        "the DRA manifests pass flags the built binaries do not take:\n{}",
        problems.join("\n")
    );
}

/// The ValidatingWebhookConfiguration of the DRA claims' configuration check.
fn config_validation() -> Value {
    let docs = dra_documents("config-validation.yaml");
    resource(&docs, "ValidatingWebhookConfiguration", "gpufrac-dra-config").clone()
}

#[test]
fn the_claim_check_calls_the_webhook_for_what_it_reads() {
    let config = config_validation();
    let hooks = config["webhooks"].as_array().expect("webhooks");
    assert_eq!(hooks.len(), 1, "{config}");
    let hook = &hooks[0];
    // The webhook's own Service (webhook.yaml), at the route that checks claims.
    let webhook = documents("webhook.yaml");
    let service = resource(&webhook, "Service", "gpufrac-webhook");
    let called = &hook["clientConfig"]["service"];
    assert_eq!(called["name"], service["metadata"]["name"]);
    assert_eq!(called["namespace"], service["metadata"]["namespace"]);
    assert_eq!(called["port"], service["spec"]["ports"][0]["port"]);
    assert_eq!(called["path"], "/validate");
    assert_eq!(hook["sideEffects"], "None");
    assert_eq!(hook["admissionReviewVersions"], json!(["v1"]));
    // Ignore: the plugin checks again at prepare; an outage must not block every claim.
    assert_eq!(hook["failurePolicy"], "Ignore");
    assert!(hook["timeoutSeconds"].as_u64().is_some_and(|t| (1..=10).contains(&t)), "{hook}");
    // Exactly the kinds and versions the webhook reads, created or updated.
    let rules = hook["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 1, "{hook}");
    let rule = &rules[0];
    assert_eq!(rule["apiGroups"], json!([gpufrac_device_plugin::webhook::GROUP]));
    let mut versions: Vec<&str> =
        rule["apiVersions"].as_array().expect("apiVersions").iter().filter_map(Value::as_str).collect();
    versions.sort_unstable();
    let mut read = gpufrac_device_plugin::webhook::VERSIONS.to_vec();
    read.sort_unstable();
    assert_eq!(versions, read);
    assert_eq!(rule["resources"], json!(["resourceclaims", "resourceclaimtemplates", "deviceclasses"]));
    assert_eq!(rule["operations"], json!(["CREATE", "UPDATE"]));
}

#[test]
fn every_example_claim_passes_the_claim_check() {
    let mut checked = 0;
    for file in yaml_files(&dra_dir()) {
        for object in kubernetes_validate::yaml_documents(&file) {
            let Some(api_version) = object["apiVersion"].as_str() else { continue };
            let Some((group, version)) = api_version.split_once('/') else { continue };
            let kind = object["kind"].as_str().unwrap_or_default();
            if group != "resource.k8s.io" || kind == "ResourceSlice" {
                continue;
            }
            let review = json!({
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "example",
                    "kind": {"group": group, "version": version, "kind": kind},
                    "resource": {"group": group, "version": version, "resource": kind.to_lowercase()},
                    "operation": "CREATE",
                    "name": object["metadata"]["name"],
                    "userInfo": {},
                    "object": object,
                }
            });
            let answer = gpufrac_device_plugin::webhook::try_validate(&review).expect("a well-formed review");
            assert_eq!(answer["response"]["allowed"], true, "{}: {kind} refused: {answer}", file.display());
            checked += 1;
        }
    }
    // The class and the claim example at least.
    assert!(checked >= 2, "only {checked} DRA objects found in the examples");
}

/// A ResourceSlice as the contract says the kubelet plugin publishes it, for a node
/// `node-1` with one GPU.
fn sample_resource_slice() -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": "node-1-gpu.gpufrac.io",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "node-1",
                                 "uid": "0b5c2a3e-8f0e-4a57-9a7e-3a4c1c2d9e11", "controller": true}]
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-1",
            "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
            "devices": [{
                "name": "gpu-0",
                "allowMultipleAllocations": true,
                "attributes": {
                    "uuid": {"string": "GPU-5a3ce1b6-8a1c-4c57-bb7a-1d7f1b2c3d4e"},
                    "productName": {"string": "NVIDIA H100 80GB HBM3"},
                    "index": {"int": 0},
                    "computeCapability": {"version": "9.0.0"},
                    "driverVersion": {"string": "570.124.06"},
                    "cudaVersion": {"version": "12.8.0"},
                    "pciBusID": {"string": "0000:19:00.0"}
                },
                "capacity": {"memory": {
                    "value": "85520809984",
                    "requestPolicy": {"default": "1Gi", "validRange": {"min": "256Mi", "step": "256Mi"}}
                }}
            }]
        }
    })
}

#[test]
fn validate_objects_checks_what_a_test_builds() {
    let slice = sample_resource_slice();
    if let Err(e) =
        kubernetes_validate::validate_objects(&[slice.clone(), slice.clone()], DRA_KUBERNETES_VERSIONS)
    {
        panic!("the contract's ResourceSlice is not valid: {e}");
    }
    let mut misspelt = slice.clone();
    misspelt["spec"]["devices"][0]["allowMultipleAllocation"] = json!(true);
    let mut wrong_type = slice.clone();
    wrong_type["spec"]["pool"]["generation"] = json!("1");
    for (what, objects, versions) in [
        ("a misspelt field", vec![slice.clone(), misspelt], DRA_KUBERNETES_VERSIONS),
        ("a wrong type", vec![wrong_type], DRA_KUBERNETES_VERSIONS),
        ("a version without resource.k8s.io/v1", vec![slice.clone()], &["1.37", "1.33"][..]),
        ("no object", vec![], DRA_KUBERNETES_VERSIONS),
        ("no version", vec![slice.clone()], &[][..]),
    ] {
        assert!(
            kubernetes_validate::validate_objects(&objects, versions).is_err(),
            "objects with {what} passed validation"
        );
    }
}
