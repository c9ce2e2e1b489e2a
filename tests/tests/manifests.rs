//! The Kubernetes manifests in `examples/kubernetes/` are what the API server accepts:
//! every resource in every `*.yaml` passes `kubernetes-validate --strict` (the API's own
//! OpenAPI schemas, shipped inside that Python package, so it needs no network) for the
//! oldest and the newest Kubernetes the docs name, and the parts the binaries rely on
//! (the webhook's path, the kubelet's device-plugin folder, the flags) are where they
//! expect them. The certificate script makes a certificate the webhook can serve.
//!
//! The arbiter's trust rests on its manifests too (README, "Security model"): parsed with PyYAML (from the
//! same virtual environment), the DaemonSet must run it with `--kubernetes`, the kubelet's
//! PodResources folder read-only, `NODE_NAME` from the downward API, `hostPID`, and the
//! service account's token in the arbiter alone; the only RBAC is get/list/watch on
//! pods, bound to the node's service account; and every flag a manifest passes is one the
//! built binary lists in `--help` (so the workspace must be built first, as for the other
//! end-to-end tests).
//!
//! Needs `kubernetes-validate`, installed by the README's test command into the
//! workspace's virtual environment `.venv/` (`python3 -m venv .venv && .venv/bin/pip
//! install -r tests/requirements.txt`): without it these tests fail and say so; they
//! never pass without validating.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};

/// Kubernetes versions whose schemas every manifest must pass: the oldest the docs
/// support (`matchConditions` on webhooks is GA from 1.30) and the newest bundled with
/// kubernetes-validate 1.37.0.
const KUBERNETES_VERSIONS: &[&str] = &["1.30", "1.37"];

const INSTALL: &str = "python3 -m venv .venv && .venv/bin/pip install -r tests/requirements.txt";

/// The manifests every installation starts from.
const EXPECTED: &[&str] =
    &["namespace.yaml", "rbac.yaml", "daemonset.yaml", "webhook.yaml", "inference-deployment.yaml"];

fn kubernetes_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes")
}

fn read(name: &str) -> String {
    let path = kubernetes_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every `*.yaml` in `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yaml" || ext == "yml"))
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

/// The workspace's virtual environment, where the README's test command installs the
/// validator.
fn venv_validator() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/kubernetes-validate")
}

/// The validator's command line: `$KUBERNETES_VALIDATE` if set, else
/// `.venv/bin/kubernetes-validate` at the workspace root, else `kubernetes-validate` on
/// PATH, else `python3 -m kubernetes_validate` (a `pip install --user` whose scripts
/// folder is not on PATH). Fails the test when none runs.
fn validator() -> Vec<String> {
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
            return candidate.clone();
        }
    }
    panic!(
        "kubernetes-validate is not installed, so the Kubernetes manifests cannot be \
         validated. Install it, at the workspace root, with:\n    {INSTALL}\n(tried \
         {candidates:?}; set KUBERNETES_VALIDATE to its path if it is elsewhere)"
    );
}

/// How many resources a YAML file holds: its documents with a top-level `kind:`.
fn resource_count(text: &str) -> usize {
    text.lines().filter(|line| line.starts_with("kind:")).count()
}

/// Validates `files` against the schemas of `version` in strict mode (unknown fields are
/// errors). Ok only if the validator succeeds, says nothing but "passed", and passes
/// every resource of every file: kubernetes-validate only warns, and exits 0, for a
/// kind or apiVersion it has no schema for, which here is an error too.
fn validate(files: &[PathBuf], version: &str) -> Result<(), String> {
    let command = validator();
    let out = Command::new(&command[0])
        .args(&command[1..])
        .args(["--kubernetes-version", version, "--strict"])
        .args(files)
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
    for file in files {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let expected = resource_count(&text);
        let prefix = format!("INFO {} passed for resource ", file.display());
        let passed = output.lines().filter(|line| line.starts_with(&prefix)).count();
        if expected == 0 || passed != expected {
            return failed(format!("{}: {passed} resources passed of {expected}", file.display()));
        }
    }
    Ok(())
}

#[test]
fn every_manifest_is_valid_kubernetes() {
    let files = yaml_files(&kubernetes_dir());
    for name in EXPECTED {
        assert!(
            files.iter().any(|f| f.file_name().is_some_and(|n| n == *name)),
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

/// Runs make-webhook-cert.sh with a stand-in `kubectl` that records its arguments:
/// the certificate is for the webhook's Service and signed by the CA that goes into
/// caBundle, and running it again keeps the CA.
#[test]
fn the_certificate_script_makes_a_serving_certificate() {
    let script = kubernetes_dir().join("make-webhook-cert.sh");
    let syntax = Command::new("bash").arg("-n").arg(&script).output().expect("running bash -n");
    assert!(syntax.status.success(), "make-webhook-cert.sh: {}", String::from_utf8_lossy(&syntax.stderr));
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("openssl is not installed: make-webhook-cert.sh was only syntax-checked");
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

// ---- What the arbiter trusts (README, "Security model"): its DaemonSet and its RBAC, parsed ----

/// The Python that parses YAML for these tests: the one beside the validator in `.venv/`
/// (kubernetes-validate depends on PyYAML), else `python3`.
fn python() -> PathBuf {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python3");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("python3")
    }
}

/// The documents of `examples/kubernetes/<name>`, as JSON, parsed by PyYAML's
/// `safe_load_all` (empty documents left out).
fn documents(name: &str) -> Vec<Value> {
    let path = kubernetes_dir().join(name);
    let out = Command::new(python())
        .args([
            "-c",
            "import json, sys, yaml\nprint(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))",
        ])
        .arg(&path)
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
