//! The Kubernetes manifests in `examples/kubernetes/` are what the API server accepts:
//! every resource in every `*.yaml` passes `kubernetes-validate --strict` (the API's own
//! OpenAPI schemas, shipped inside that Python package, so it needs no network) for the
//! oldest and the newest Kubernetes the docs name, and the parts the binaries rely on
//! (the webhook's path, the kubelet's device-plugin folder, the flags) are where they
//! expect them. The certificate script makes a certificate the webhook can serve.
//!
//! Needs `kubernetes-validate`, installed by the README's test command into the
//! workspace's virtual environment `.venv/` (`python3 -m venv .venv && .venv/bin/pip
//! install -r tests/requirements.txt`): without it these tests fail and say so; they
//! never pass without validating.

use std::path::{Path, PathBuf};
use std::process::Command;

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
        // The shim installed on the host, replaced by a rename.
        "cp /usr/lib/gpufrac/libgpufrac.so /host/opt/gpufrac/lib/",
        "mv -f /host/opt/gpufrac/lib/.libgpufrac.so.new /host/opt/gpufrac/lib/libgpufrac.so",
        "path: /opt/gpufrac/lib",
    ] {
        assert!(text.contains(needed), "daemonset.yaml lacks {needed:?}");
    }
    assert!(!text.contains("privileged: true"), "no container needs to be privileged");
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
