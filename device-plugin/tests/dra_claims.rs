//! Claims as the API server returns them (`resource.k8s.io/v1` JSON, read into the API's
//! own types) → the fraction the DRA plugin prepares: the consumed `memory` capacity is
//! the request, the opaque configuration gives limit, resolver, priority, `parkAfter` and
//! the compute share (`computeRequest`, or the consumed `compute` capacity, and
//! `computeLimit`) down to the CDI spec's env, and a bad configuration is refused naming
//! its field.

use gpufrac_common::dra::PreparedClaim;
use gpufrac_common::resolver::Resolver;
use gpufrac_device_plugin::dra::cdi::{self, CdiConfig};
use gpufrac_device_plugin::dra::claim::{fraction, quantity_bytes, quantity_count, ClaimError};
use gpufrac_device_plugin::dra::gpus::GpuInfo;
use gpufrac_device_plugin::dra::slices::{self, Sharing};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;
const NODE: &str = "gpu-node-3";

fn gpus() -> Vec<GpuInfo> {
    [(0, 80 * GIB), (1, 40 * GIB)]
        .into_iter()
        .map(|(index, memory)| GpuInfo {
            index,
            uuid: format!("GPU-{index}aaaaaaa-0000-0000-0000-000000000000"),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            memory,
            compute_capability: (9, 0),
            driver_version: "570.124.06".into(),
            cuda_version: (12, 8),
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + index),
            topology: Default::default(),
        })
        .collect()
}

fn config(parameters: Value) -> Value {
    json!({"driver": "gpu.gpufrac.io", "parameters": parameters})
}

/// A claim allocated by the scheduler on `device` with `consumed` (None: a cluster without
/// consumable capacity), with `configs` as the allocation's configuration.
fn claim(device: &str, consumed: Option<&str>, configs: Value) -> ResourceClaim {
    let mut result = json!({
        "request": "gpu", "driver": "gpu.gpufrac.io", "pool": NODE, "device": device,
    });
    if let Some(memory) = consumed {
        result["consumedCapacity"] = json!({"memory": memory});
        result["shareID"] = json!("8b0e2f14-7c53-4a8e-9d1f-2e6b3c4d5a69");
    }
    let text = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": "llm-0-gpu-x7k2q", "namespace": "inference",
            "uid": "3d5c1b0e-8f2a-4c6d-9e1b-7a2f4c8d0e13", "resourceVersion": "482913",
            "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "llm-0",
                                 "uid": "a1f3e9c2-5b7d-4e80-9c6a-2d4f8b1e3a57", "controller": true,
                                 "blockOwnerDeletion": true}]
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.gpufrac.io", "allocationMode": "ExactCount", "count": 1,
            "capacity": {"requests": {"memory": "20Gi"}}
        }}]}},
        "status": {
            "allocation": {
                "devices": {"results": [
                    result,
                    {"request": "nic", "driver": "rdma.example.com", "pool": NODE, "device": "mlx5-0"}
                ], "config": configs},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
                "allocationTimestamp": "2026-11-24T09:12:44Z"
            },
            "reservedFor": [{"resource": "pods", "name": "llm-0", "uid": "a1f3e9c2-5b7d-4e80-9c6a-2d4f8b1e3a57"}]
        }
    });
    serde_json::from_value(text).expect("a resource.k8s.io/v1 ResourceClaim")
}

fn from_claim(parameters: Value) -> Value {
    json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": config(parameters)}])
}

#[test]
fn the_consumed_memory_is_the_request_and_the_configuration_the_rest() {
    let claim = claim(
        "gpu-1",
        Some("20Gi"),
        json!([
            {"source": "FromClass", "opaque": config(json!({
                "apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "resolver": "wait", "priority": 1}))},
            {"source": "FromClaim", "requests": ["gpu"], "opaque": config(json!({
                "apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "40Gi", "resolver": "swap"}))},
            {"source": "FromClaim", "requests": ["nic"], "opaque": config(json!({"not": "for this request"}))}
        ]),
    );
    let prepared = fraction(&claim, NODE, &gpus(), Sharing::Capacity).unwrap();
    assert_eq!(prepared.pods, [("a1f3e9c2-5b7d-4e80-9c6a-2d4f8b1e3a57".to_owned(), "llm-0".to_owned())]);
    assert_eq!(prepared.devices.len(), 1, "the other driver's device is not ours");
    let device = &prepared.devices[0];
    assert_eq!((device.device.as_str(), device.pool.as_str()), ("gpu-1", NODE));
    assert_eq!(device.gpu_uuid, "GPU-1aaaaaaa-0000-0000-0000-000000000000");
    assert_eq!(device.request_bytes, 20 * GIB);
    assert_eq!(device.limit_bytes, 40 * GIB);
    assert_eq!(device.resolver, Some(Resolver::Swap), "the claim's configuration overrides the class's");
    assert_eq!(device.priority, Some(1), "a field the claim does not set stays the class's");
    assert_eq!(device.share_id.as_deref(), Some("8b0e2f14-7c53-4a8e-9d1f-2e6b3c4d5a69"));
    assert_eq!(device.cdi_device_id, "gpufrac.io/claim=3d5c1b0e-8f2a-4c6d-9e1b-7a2f4c8d0e13-gpu-1");
}

#[test]
fn without_configuration_the_limit_is_the_request_and_without_consumable_capacity_the_gpu() {
    let plain =
        fraction(&claim("gpu-0", Some("21474836480"), json!([])), NODE, &gpus(), Sharing::Capacity).unwrap();
    let device = &plain.devices[0];
    assert_eq!((device.request_bytes, device.limit_bytes), (20 * GIB, 20 * GIB));
    assert_eq!((device.resolver, device.priority), (None, None));
    // A cluster without DRAConsumableCapacity allocates the device whole.
    let whole = fraction(&claim("gpu-0", None, json!([])), NODE, &gpus(), Sharing::Capacity).unwrap();
    assert_eq!(whole.devices[0].request_bytes, 80 * GIB);
    // A limit as a fraction of the GPU.
    let half = fraction(
        &claim(
            "gpu-0",
            Some("20Gi"),
            from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "0.5"})),
        ),
        NODE,
        &gpus(),
        Sharing::Capacity,
    )
    .unwrap();
    assert_eq!(half.devices[0].limit_bytes, 40 * GIB);
}

/// The env of the CDI spec the plugin writes for `claim` (one device).
fn cdi_env(claim: &ResourceClaim) -> Vec<String> {
    let fraction = fraction(claim, NODE, &gpus(), Sharing::Capacity).expect("prepared");
    let prepared = PreparedClaim {
        namespace: "inference".into(),
        name: "llm-0-gpu-x7k2q".into(),
        uid: "3d5c1b0e-8f2a-4c6d-9e1b-7a2f4c8d0e13".into(),
        pod_uids: fraction.pods.iter().map(|(uid, _)| uid.clone()).collect(),
        devices: fraction.devices,
    };
    let config = CdiConfig {
        dir: "/var/run/cdi".into(),
        shim_dir: "/opt/gpufrac/lib".into(),
        arbiter_socket: "/run/gpufrac/arbiter.sock".into(),
        nvidia_cdi: false,
    };
    let spec = cdi::spec(&config, &prepared, 0);
    let env = spec["devices"][0]["containerEdits"]["env"].as_array().expect("env");
    env.iter().map(|e| e.as_str().expect("NAME=VALUE").to_owned()).collect()
}

#[test]
fn park_after_reaches_the_cdi_env() {
    let parkable = claim(
        "gpu-1",
        Some("20Gi"),
        from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "parkAfter": "30s"})),
    );
    let prepared = fraction(&parkable, NODE, &gpus(), Sharing::Capacity).expect("prepared");
    assert_eq!(prepared.devices[0].park_after.as_deref(), Some("30s"));
    let env = cdi_env(&parkable);
    assert!(env.contains(&"GPUFRAC_PARK_AFTER=30s".to_owned()), "{env:?}");
    assert!(env.contains(&"GPUFRAC_RESOLVER=wait".to_owned()), "{env:?}");

    // The claim's own configuration overrides its class's.
    let both = json!([
        {"source": "FromClass", "opaque": config(json!({
            "apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "parkAfter": "5m"}))},
        {"source": "FromClaim", "requests": ["gpu"], "opaque": config(json!({
            "apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "parkAfter": "500ms"}))},
    ]);
    let env = cdi_env(&claim("gpu-1", Some("20Gi"), both));
    assert!(env.contains(&"GPUFRAC_PARK_AFTER=500ms".to_owned()), "{env:?}");

    // Without it, no variable: the claim is never parked.
    let env = cdi_env(&claim("gpu-1", Some("20Gi"), json!([])));
    assert!(!env.iter().any(|e| e.starts_with("GPUFRAC_PARK_AFTER=")), "{env:?}");

    // A bad duration is refused naming the field and the value.
    for bad in [json!("soon"), json!("30"), json!(30)] {
        let e = fraction(
            &claim(
                "gpu-1",
                Some("20Gi"),
                from_claim(
                    json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "parkAfter": bad}),
                ),
            ),
            NODE,
            &gpus(),
            Sharing::Capacity,
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, ClaimError::Config { index: 0, .. }), "{text}");
        assert!(text.contains("status.allocation.devices.config[0].opaque.parameters.parkAfter: "), "{text}");
        assert!(text.contains(&bad.to_string()), "names the value: {text}");
        assert!(text.contains("expected a duration such as"), "{text}");
    }
}

/// `claim` as if it had also consumed `compute` per mille of the GPU's time.
fn with_compute(mut claim: ResourceClaim, compute: &str) -> ResourceClaim {
    let status = claim.status.as_mut().expect("status");
    let results =
        status.allocation.as_mut().and_then(|a| a.devices.as_mut()).and_then(|d| d.results.as_mut());
    let result = &mut results.expect("results")[0];
    result.consumed_capacity.get_or_insert_default().insert("compute".into(), Quantity(compute.into()));
    claim
}

fn gpufrac(parameters: Value) -> Value {
    let mut base = json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig"});
    base.as_object_mut().expect("object").extend(parameters.as_object().expect("object").clone());
    base
}

fn compute_env(env: &[String]) -> Vec<&str> {
    env.iter().filter(|e| e.starts_with("GPUFRAC_COMPUTE_")).map(String::as_str).collect()
}

#[test]
fn compute_shares_reach_the_cdi_env_and_the_checkpoint() {
    // From the configuration alone (the scheduler does not see it).
    let configured = claim(
        "gpu-1",
        Some("20Gi"),
        from_claim(gpufrac(json!({"computeRequest": "0.3", "computeLimit": "80%"}))),
    );
    let prepared = fraction(&configured, NODE, &gpus(), Sharing::Capacity).expect("prepared");
    let device = &prepared.devices[0];
    assert_eq!((device.compute_request_per_mille, device.compute_limit_per_mille), (Some(300), Some(800)));
    assert_eq!(
        compute_env(&cdi_env(&configured)),
        ["GPUFRAC_COMPUTE_REQUEST=30%", "GPUFRAC_COMPUTE_LIMIT=80%"]
    );

    // A request alone may burst to the whole GPU; a limit alone guarantees nothing.
    let env = cdi_env(&claim("gpu-1", Some("20Gi"), from_claim(gpufrac(json!({"computeRequest": "12.5%"})))));
    assert_eq!(compute_env(&env), ["GPUFRAC_COMPUTE_REQUEST=12.5%", "GPUFRAC_COMPUTE_LIMIT=100%"]);
    let env = cdi_env(&claim("gpu-1", Some("20Gi"), from_claim(gpufrac(json!({"computeLimit": "0.5"})))));
    assert_eq!(compute_env(&env), ["GPUFRAC_COMPUTE_REQUEST=0%", "GPUFRAC_COMPUTE_LIMIT=50%"]);

    // None: no variable.
    let env = cdi_env(&claim("gpu-1", Some("20Gi"), json!([])));
    assert!(compute_env(&env).is_empty(), "{env:?}");

    // The claim's configuration overrides its class's, field by field.
    let both = json!([
        {"source": "FromClass", "opaque": config(gpufrac(json!({"computeRequest": "10%", "computeLimit": "50%"})))},
        {"source": "FromClaim", "requests": ["gpu"], "opaque": config(gpufrac(json!({"computeRequest": "20%"})))},
    ]);
    let env = cdi_env(&claim("gpu-1", Some("20Gi"), both));
    assert_eq!(compute_env(&env), ["GPUFRAC_COMPUTE_REQUEST=20%", "GPUFRAC_COMPUTE_LIMIT=50%"]);

    // The compute capacity the scheduler let the claim consume is the request (the API
    // server writes 1000 as "1k"); a consumed 0 (the policy's default) is no request.
    let placed = with_compute(
        claim("gpu-1", Some("20Gi"), from_claim(gpufrac(json!({"computeLimit": "0.6"})))),
        "250",
    );
    assert_eq!(compute_env(&cdi_env(&placed)), ["GPUFRAC_COMPUTE_REQUEST=25%", "GPUFRAC_COMPUTE_LIMIT=60%"]);
    let whole = with_compute(claim("gpu-1", Some("20Gi"), json!([])), "1k");
    assert_eq!(compute_env(&cdi_env(&whole)), ["GPUFRAC_COMPUTE_REQUEST=100%", "GPUFRAC_COMPUTE_LIMIT=100%"]);
    let zero = with_compute(claim("gpu-1", Some("20Gi"), json!([])), "0");
    assert!(compute_env(&cdi_env(&zero)).is_empty());
    let same = with_compute(
        claim("gpu-1", Some("20Gi"), from_claim(gpufrac(json!({"computeRequest": "25%"})))),
        "250",
    );
    assert_eq!(compute_env(&cdi_env(&same))[0], "GPUFRAC_COMPUTE_REQUEST=25%");
}

#[test]
fn bad_compute_shares_are_refused_naming_the_field() {
    let refusal = |claim: ResourceClaim| {
        fraction(&claim, NODE, &gpus(), Sharing::Capacity).expect_err("refused").to_string()
    };
    for (parameters, expected) in [
        (
            json!({"computeRequest": "1.5"}),
            r#"opaque.parameters.computeRequest: "1.5": a share is at most one whole GPU"#,
        ),
        (
            json!({"computeRequest": "150%"}),
            r#"opaque.parameters.computeRequest: "150%": a share is at most"#,
        ),
        (
            json!({"computeLimit": "fast"}),
            r#"opaque.parameters.computeLimit: "fast": expected a share of one GPU's time"#,
        ),
        (json!({"computeLimit": 0.5}), "opaque.parameters.computeLimit: expected a share of the GPU's time"),
        (
            json!({"computeRequest": "50%", "computeLimit": "40%"}),
            r#"parameters.computeLimit: "40%": the limit must be at least computeRequest (50%)"#,
        ),
        (
            json!({"computeLimit": "0%"}),
            r#"parameters.computeLimit: "0%": a limit of 0% would never let the group run"#,
        ),
    ] {
        let text = refusal(claim("gpu-1", Some("20Gi"), from_claim(gpufrac(parameters.clone()))));
        assert!(text.contains(expected), "{parameters}: {text}");
    }
    // Merged: the class's request above the claim's limit.
    let merged = json!([
        {"source": "FromClass", "opaque": config(gpufrac(json!({"computeRequest": "70%"})))},
        {"source": "FromClaim", "requests": ["gpu"], "opaque": config(gpufrac(json!({"computeLimit": "60%"})))},
    ]);
    let text = refusal(claim("gpu-1", Some("20Gi"), merged));
    assert!(
        text.contains(r#"parameters.computeLimit: "60%": the limit must be at least computeRequest (70%)"#),
        "{text}"
    );
    // Asked for twice, differently.
    let text = refusal(with_compute(
        claim("gpu-1", Some("20Gi"), from_claim(gpufrac(json!({"computeRequest": "30%"})))),
        "250",
    ));
    assert!(text.contains("parameters.computeRequest: \"30%\" differs from the compute capacity"), "{text}");
    // A consumed capacity past the GPU.
    let text = refusal(with_compute(claim("gpu-1", Some("20Gi"), json!([])), "1500"));
    assert!(text.contains("consumedCapacity.compute \"1500\""), "{text}");
}

#[test]
fn a_bad_configuration_is_refused_naming_the_field() {
    let cases = [
        (
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "forty"}),
            "parameters.limit",
        ),
        (
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "resolver": "evict"}),
            "parameters.resolver",
        ),
        (
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "priority": 1.5}),
            "parameters.priority",
        ),
        (
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "burst": "40Gi"}),
            "parameters.burst",
        ),
        (json!({"apiVersion": "gpufrac.io/v2", "kind": "GpuFractionConfig"}), "parameters.apiVersion"),
        (json!({"apiVersion": "gpufrac.io/v1", "kind": "FractionConfig"}), "parameters.kind"),
    ];
    for (parameters, field) in cases {
        let e = fraction(
            &claim("gpu-1", Some("20Gi"), from_claim(parameters.clone())),
            NODE,
            &gpus(),
            Sharing::Capacity,
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, ClaimError::Config { index: 0, .. }), "{text}");
        assert!(text.contains(field), "{parameters} → {text}");
        assert!(text.contains("inference/llm-0-gpu-x7k2q"), "names the claim: {text}");
    }
    // Limits that do not fit.
    let below =
        from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "10Gi"}));
    let e = fraction(&claim("gpu-1", Some("20Gi"), below), NODE, &gpus(), Sharing::Capacity)
        .unwrap_err()
        .to_string();
    assert!(e.contains("parameters.limit") && e.contains("below"), "{e}");
    let above =
        from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "60Gi"}));
    let e = fraction(&claim("gpu-1", Some("20Gi"), above), NODE, &gpus(), Sharing::Capacity)
        .unwrap_err()
        .to_string();
    assert!(e.contains("parameters.limit") && e.contains("more than the GPU"), "{e}");
}

#[test]
fn a_claim_that_is_not_this_nodes_is_refused() {
    let unallocated: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "n", "uid": "u"},
        "spec": {"devices": {"requests": []}}
    }))
    .unwrap();
    assert!(matches!(
        fraction(&unallocated, NODE, &gpus(), Sharing::Capacity),
        Err(ClaimError::NotAllocated(_))
    ));
    let e = fraction(&claim("gpu-1", Some("20Gi"), json!([])), "other-node", &gpus(), Sharing::Capacity)
        .unwrap_err()
        .to_string();
    assert!(e.contains("results[0]") && e.contains("pool"), "{e}");
    let e = fraction(&claim("gpu-7", Some("20Gi"), json!([])), NODE, &gpus(), Sharing::Capacity)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gpu-7"), "{e}");
    let e = fraction(&claim("gpu-1", Some("50Gi"), json!([])), NODE, &gpus(), Sharing::Capacity)
        .unwrap_err()
        .to_string();
    assert!(e.contains("consumedCapacity.memory"), "{e}");
}

#[test]
fn quantities_as_the_api_server_writes_them() {
    assert_eq!(quantity_bytes("20Gi"), Some(20 * GIB));
    assert_eq!(
        [quantity_count("0"), quantity_count("250"), quantity_count("1k")],
        [Some(0), Some(250), Some(1000)]
    );
    assert_eq!(quantity_bytes("21474836480"), Some(20 * GIB));
    assert_eq!(quantity_bytes("20G"), Some(20_000_000_000));
    assert_eq!(quantity_bytes("1536Mi"), Some(1536 << 20));
    assert_eq!(quantity_bytes("2e9"), Some(2_000_000_000));
    assert_eq!(quantity_bytes("lots"), None);
    assert_eq!(quantity_bytes("1.5Gi"), Some(3 * GIB / 2));
    assert_eq!(quantity_count("300m"), Some(1));
}

/// A consumed capacity is a Kubernetes quantity: `compute` counts per mille (`"1"` is one
/// per mille, `300m` rounds up to one), a lowercase `m` is milli, `1.5Gi` is exact.
#[test]
fn consumed_capacities_read_with_kubernetes_semantics() {
    let per_mille = |compute: &str| {
        let claim = with_compute(claim("gpu-1", Some("20Gi"), json!([])), compute);
        let prepared =
            fraction(&claim, NODE, &gpus(), Sharing::Capacity).unwrap_or_else(|e| panic!("{compute}: {e}"));
        prepared.devices[0].compute_request_per_mille
    };
    assert_eq!(per_mille("1"), Some(1), "one per mille, not the whole GPU");
    assert_eq!(per_mille("300m"), Some(1), "0.3 per mille, rounded up");
    assert_eq!(per_mille("250"), Some(250));
    assert_eq!(per_mille("1e3"), Some(1000));
    let bytes = |memory: &str| {
        let prepared = fraction(&claim("gpu-1", Some(memory), json!([])), NODE, &gpus(), Sharing::Capacity)
            .unwrap_or_else(|e| panic!("{memory}: {e}"));
        prepared.devices[0].request_bytes
    };
    assert_eq!(bytes("1.5Gi"), 3 * GIB / 2);
    assert_eq!(bytes("20M"), 20_000_000, "M is mega");
    assert_eq!(bytes("1500m"), 2, "m is milli, rounded up to a byte");
    assert_eq!(bytes("4e9"), 4_000_000_000);
    let e = fraction(&claim("gpu-1", Some("20GB"), json!([])), NODE, &gpus(), Sharing::Capacity)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("consumedCapacity.memory") && e.contains("\"20GB\" is not a Kubernetes quantity"),
        "{e}"
    );
}

#[test]
fn each_gpu_is_one_device_with_a_shared_memory_capacity() {
    let slice = slices::slice(NODE, &gpus(), Sharing::Capacity, |uuid| !uuid.starts_with("GPU-1"), 3, None);
    let value = serde_json::to_value(&slice).unwrap();
    assert_eq!(value["metadata"]["name"], "gpu-node-3-gpu.gpufrac.io");
    assert_eq!(value["spec"]["pool"], json!({"name": NODE, "generation": 3, "resourceSliceCount": 1}));
    let devices = value["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 1, "the unhealthy GPU is left out");
    let device = &devices[0];
    assert_eq!(device["name"], "gpu-0");
    assert_eq!(device["allowMultipleAllocations"], true);
    assert_eq!(
        device["capacity"]["memory"],
        json!({"value": (80 * GIB).to_string(), "requestPolicy": {
            "default": "1Gi", "validRange": {"min": "256Mi", "step": "256Mi"}}})
    );
    // Compute: 1000 per mille of the GPU's time; a claim that names none consumes none.
    assert_eq!(
        device["capacity"]["compute"],
        json!({"value": "1000", "requestPolicy": {"default": "0", "validRange": {"min": "0", "step": "1"}}})
    );
    assert_eq!(device["attributes"]["computeCapability"], json!({"version": "9.0.0"}));
    assert_eq!(device["attributes"]["cudaVersion"], json!({"version": "12.8.0"}));
    assert_eq!(device["attributes"]["driverVersion"], json!({"string": "570.124.06"}));
    assert_eq!(device["attributes"]["pciBusID"], json!({"string": "00000000:18:00.0"}));
    assert_eq!(device["attributes"]["index"], json!({"int": 0}));
}

/// A claim on a cluster without consumable capacity: `count` shares of one GPU.
fn shares_claim(devices: &[(&str, &str)], configs: Value) -> ResourceClaim {
    let results: Vec<Value> = devices
        .iter()
        .map(|(request, device)| json!({"request": request, "driver": "gpu.gpufrac.io", "pool": NODE, "device": device}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "shares", "namespace": "inference", "uid": "5e1d0c2b-0000-4000-8000-00000000000a"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpufrac.io", "allocationMode": "ExactCount", "count": 2}}],
            "constraints": [{"requests": ["gpu"], "matchAttribute": "gpu.gpufrac.io/uuid"}]
        }},
        "status": {"allocation": {"devices": {"results": results, "config": configs}}}
    }))
    .unwrap()
}

#[test]
fn shares_of_one_gpu_add_up_to_the_request() {
    let limit =
        from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "30Gi"}));
    let claim = shares_claim(&[("gpu", "gpu-1-0"), ("gpu", "gpu-1-3")], limit);
    let prepared = fraction(&claim, NODE, &gpus(), Sharing::Shares(4)).unwrap();
    assert_eq!(prepared.devices.len(), 1, "one GPU, one fraction");
    let device = &prepared.devices[0];
    assert_eq!(device.device, "gpu-1");
    assert_eq!(device.shares, ["gpu-1-0", "gpu-1-3"]);
    assert_eq!(device.request_bytes, 20 * GIB, "two quarters of 40 GiB");
    assert_eq!(device.limit_bytes, 30 * GIB);
    // The limit is checked against all the shares, not one.
    let low =
        from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "15Gi"}));
    let e = fraction(
        &shares_claim(&[("gpu", "gpu-1-0"), ("gpu", "gpu-1-3")], low),
        NODE,
        &gpus(),
        Sharing::Shares(4),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("parameters.limit") && e.contains("20.00 GiB"), "{e}");
    // Devices of the other way of publishing are not this node's.
    let e = fraction(&claim, NODE, &gpus(), Sharing::Capacity).unwrap_err().to_string();
    assert!(e.contains("gpu-1-0"), "{e}");
    let plain = fraction(
        &shares_claim(&[("gpu", "gpu-1-0"), ("gpu", "gpu-1-3")], json!([])),
        NODE,
        &gpus(),
        Sharing::Shares(4),
    )
    .unwrap();
    assert_eq!(
        (plain.devices[0].request_bytes, plain.devices[0].limit_bytes),
        (20 * GIB, 20 * GIB),
        "no limit: the request"
    );
    let whole = shares_claim(&[("gpu", "gpu-1")], json!([]));
    assert!(fraction(&whole, NODE, &gpus(), Sharing::Shares(4)).is_err());
    let out_of_range = shares_claim(&[("gpu", "gpu-1-4")], json!([]));
    assert!(fraction(&out_of_range, NODE, &gpus(), Sharing::Shares(4)).is_err());
    // Two requests on one GPU are refused, naming both.
    let two = shares_claim(&[("a", "gpu-0-0"), ("b", "gpu-0-1")], json!([]));
    let e = fraction(&two, NODE, &gpus(), Sharing::Shares(4)).unwrap_err().to_string();
    assert!(e.contains("\"a\"") && e.contains("\"b\""), "{e}");
}

#[test]
fn shares_are_devices_with_the_gpus_attributes() {
    let slice = slices::slice(NODE, &gpus(), Sharing::Shares(4), |_| true, 1, None);
    let value = serde_json::to_value(&slice).unwrap();
    let devices = value["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 8);
    let share = &devices[5];
    assert_eq!(share["name"], "gpu-1-1");
    assert_eq!(share["attributes"]["uuid"], json!({"string": "GPU-1aaaaaaa-0000-0000-0000-000000000000"}));
    assert_eq!(share["attributes"]["share"], json!({"int": 1}));
    assert_eq!(share["capacity"]["memory"], json!({"value": (10 * GIB).to_string()}));
    assert!(share.get("allowMultipleAllocations").is_none(), "a share goes to one claim");
    assert!(share["capacity"].get("compute").is_none(), "no compute capacity without consumable capacity");
}

/// A tensor-parallel claim: request `gpu` with `count: 2`, allocated `memory` on each of
/// `devices` (or one request per device, `gpu-a` and `gpu-b`, when `requests` is 2).
fn two_gpus_claim(devices: &[(&str, &str)], requests: usize, configs: Value) -> ResourceClaim {
    let names = ["gpu-a", "gpu-b"];
    let results: Vec<Value> = devices
        .iter()
        .enumerate()
        .map(|(i, (device, memory))| {
            let request = if requests == 1 { "gpu" } else { names[i] };
            json!({"request": request, "driver": "gpu.gpufrac.io", "pool": NODE, "device": device,
                   "consumedCapacity": {"memory": memory}, "shareID": format!("8b0e2f14-7c53-4a8e-9d1f-2e6b3c4d5a6{i}")})
        })
        .collect();
    let exactly = |name: &str, count: usize| {
        json!({"name": name, "exactly": {"deviceClassName": "gpu.gpufrac.io", "allocationMode": "ExactCount",
               "count": count, "capacity": {"requests": {"memory": "8Gi"}}}})
    };
    let requests =
        if requests == 1 { vec![exactly("gpu", 2)] } else { vec![exactly("gpu-a", 1), exactly("gpu-b", 1)] };
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "tp", "namespace": "inference", "uid": "3d5c1b0e-8f2a-4c6d-9e1b-7a2f4c8d0e13"},
        "spec": {"devices": {
            "requests": requests,
            "constraints": [{"matchAttribute": "gpu.gpufrac.io/nvlinkDomain"}, {"distinctAttribute": "gpu.gpufrac.io/uuid"}]
        }},
        "status": {"allocation": {"devices": {"results": results, "config": configs}}}
    }))
    .expect("a resource.k8s.io/v1 ResourceClaim")
}

#[test]
fn a_claim_of_two_gpus_holds_a_fraction_of_each_and_its_spec_shows_both() {
    let limit =
        from_claim(json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "0.5",
                                  "resolver": "swap", "computeLimit": "50%"}));
    let claim = two_gpus_claim(&[("gpu-1", "8Gi"), ("gpu-0", "12Gi")], 1, limit);
    let prepared = fraction(&claim, NODE, &gpus(), Sharing::Capacity).expect("prepared");
    let got: Vec<(&str, u64, u64)> =
        prepared.devices.iter().map(|d| (d.device.as_str(), d.request_bytes, d.limit_bytes)).collect();
    // Each GPU its own: half of 40 GiB, half of 80 GiB.
    assert_eq!(got, [("gpu-1", 8 * GIB, 20 * GIB), ("gpu-0", 12 * GIB, 40 * GIB)]);
    let claim_entry = PreparedClaim {
        namespace: "inference".into(),
        name: "tp".into(),
        uid: "3d5c1b0e-8f2a-4c6d-9e1b-7a2f4c8d0e13".into(),
        pod_uids: Vec::new(),
        devices: prepared.devices,
    };
    let config = CdiConfig {
        dir: "/var/run/cdi".into(),
        shim_dir: "/opt/gpufrac/lib".into(),
        arbiter_socket: "/run/gpufrac/arbiter.sock".into(),
        nvidia_cdi: false,
    };
    let spec = cdi::spec(&config, &claim_entry, 0);
    let devices = spec["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 2, "one CDI device per GPU");
    assert_eq!(devices[0]["containerEdits"], devices[1]["containerEdits"], "the claim's edits on each");
    let env: Vec<&str> = devices[0]["containerEdits"]["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for want in [
        "NVIDIA_VISIBLE_DEVICES=GPU-0aaaaaaa-0000-0000-0000-000000000000,GPU-1aaaaaaa-0000-0000-0000-000000000000",
        // The largest of each: the arbiter cuts each GPU to its own.
        "GPUFRAC_MEMORY_REQUEST=12884901888",
        "GPUFRAC_MEMORY_LIMIT=42949672960",
        "GPUFRAC_RESOLVER=swap",
        "GPUFRAC_GROUP=dra-3d5c1b0e-8f2a-4c6d-9e1b-7a2f4c8d0e13",
        "GPUFRAC_COMPUTE_LIMIT=50%",
    ] {
        assert!(env.contains(&want), "{want} in {env:?}");
    }
    assert_eq!(env.iter().filter(|e| e.starts_with("NVIDIA_VISIBLE_DEVICES=")).count(), 1, "{env:?}");
}

#[test]
fn a_claim_of_two_gpus_that_cannot_be_one_process_is_refused() {
    // Two requests configured apart: one resolver per process.
    let configs = json!([
        {"source": "FromClaim", "requests": ["gpu-a"], "opaque": config(json!({
            "apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "resolver": "swap"}))},
    ]);
    let e = fraction(
        &two_gpus_claim(&[("gpu-0", "8Gi"), ("gpu-1", "8Gi")], 2, configs),
        NODE,
        &gpus(),
        Sharing::Capacity,
    )
    .unwrap_err();
    assert!(matches!(e, ClaimError::Differs { field: "resolver", .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "claim inference/tp: gpu-0 and gpu-1 differ in resolver: a process holds one resolver on every GPU \
         of its claim; configure the claim's requests alike"
    );
    // 48 GiB on the 80 GiB GPU: the 40 GiB one cannot take the request the shim declares.
    let e = fraction(
        &two_gpus_claim(&[("gpu-0", "48Gi"), ("gpu-1", "8Gi")], 1, json!([])),
        NODE,
        &gpus(),
        Sharing::Capacity,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "claim inference/tp: the request on gpu-0 (48.00 GiB) is more than gpu-1 has (40.00 GiB): a claim of \
         several GPUs needs each GPU to hold its largest request"
    );
}
