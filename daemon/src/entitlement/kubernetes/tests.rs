//! Tests of the Kubernetes source's decisions, from pods and the kubelet's answers as given.

use super::pods::ContainerStatus;
use super::*;

/// A pod and the kubelet's answer about it.
struct Cached {
    pod: PodRecord,
    devices: Option<PodDevices>,
}

fn decide_for(
    entry: &Cached,
    container_id: &str,
    node: Option<&str>,
    shares_per_gpu: u32,
) -> Result<Entitlement, String> {
    decide(&entry.pod, entry.devices.as_ref(), container_id, node.unwrap_or("n1"), shares_per_gpu)
}

const UID: &str = "0f3c2a4e-1111-2222-3333-444455556666";
const GPU: &str = "GPU-516d6770-7500-0000-0000-000000000003";

fn entry(annotations: &[(&str, &str)], ids: &[&str]) -> Cached {
    let pod = PodRecord {
        namespace: "ns".into(),
        name: "p".into(),
        uid: UID.into(),
        node_name: Some("n1".into()),
        priority: 7,
        containers: vec!["main".into(), "side".into()],
        statuses: vec![
            ContainerStatus { name: "main".into(), container_id: Some("aa11".into()) },
            ContainerStatus { name: "side".into(), container_id: Some("bb22".into()) },
        ],
        annotations: annotations.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect(),
    };
    let mut containers = BTreeMap::new();
    containers.insert("main".to_owned(), ids.iter().map(|s| (*s).to_owned()).collect());
    containers.insert("side".to_owned(), vec![format!("{GPU}::90")]);
    Cached { pod, devices: Some(PodDevices { namespace: "ns".into(), name: "p".into(), containers }) }
}

fn ids(n: u32) -> Vec<String> {
    (0..n).map(|i| format!("{GPU}::{i}")).collect()
}

#[test]
fn shares_become_a_fraction_of_their_gpu() {
    let ids = ids(25);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let e =
        decide_for(&entry(&[(FRACTION_LIMIT, "0.5"), (RESOLVER, "swap")], &refs), "aa11", Some("n1"), 100)
            .expect("entitled");
    assert_eq!(e.max_request, Amount::Fraction(0.25));
    assert_eq!(e.max_limit, Amount::Fraction(0.5));
    assert_eq!(e.resolver, Some(Resolver::Swap));
    assert_eq!(e.max_priority, 7);
    let caps = DeviceCaps { max_request: Amount::Fraction(0.25), max_limit: Amount::Fraction(0.5) };
    assert_eq!(e.devices, gpufrac_common::gpu_uuid::parse(GPU).map(|u| BTreeMap::from([(u, caps)])));
    assert_eq!(e.group.as_deref(), Some("k8s-0f3c2a4e-1111-2222-3333-444455556666-main"));
    assert_eq!(e.source, "kubelet: ns/p container main");
    // The other container with shares: its request, no burst, wait.
    let e = decide_for(&entry(&[(FRACTION_LIMIT, "0.5"), (RESOLVER, "swap")], &refs), "bb22", None, 100)
        .expect("entitled");
    assert_eq!(e.max_request, Amount::Fraction(0.01));
    assert_eq!(e.max_limit, Amount::Fraction(0.01));
    assert_eq!(e.resolver, Some(Resolver::Wait));
}

fn compute_spec(request: u16, limit: u16) -> Option<ComputeSpec> {
    use gpufrac_common::compute::ComputeShare;
    Some(ComputeSpec {
        request: ComputeShare::from_per_mille(request).unwrap(),
        limit: ComputeShare::from_per_mille(limit).unwrap(),
    })
}

#[test]
fn compute_annotations_are_the_most_compute_share_believed() {
    let ids = ids(10);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let max = |annotations: &[(&str, &str)], container: &str| {
        decide_for(&entry(annotations, &refs), container, None, 100).expect("entitled").max_compute
    };
    assert_eq!(max(&[(COMPUTE, "30%"), (COMPUTE_LIMIT, "0.8")], "aa11"), compute_spec(300, 800));
    assert_eq!(max(&[(COMPUTE, "12.5%")], "aa11"), compute_spec(125, 1000), "a request alone: any limit");
    assert_eq!(max(&[(COMPUTE_LIMIT, "40%")], "aa11"), compute_spec(0, 400), "a limit alone: no request");
    // No annotation: no compute request vouched, a declared limit believed.
    assert_eq!(max(&[], "aa11"), compute_spec(0, 1000));
    // The other container with shares gets no compute request, whatever the annotations.
    assert_eq!(max(&[(COMPUTE, "30%")], "bb22"), compute_spec(0, 1000));
    assert_eq!(max(&[(COMPUTE, "30%"), (CONTAINER, "side")], "bb22"), compute_spec(300, 1000));
}

#[test]
fn a_bad_compute_annotation_refuses_the_pod() {
    let ids = ids(10);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    for (annotations, want) in [
        (&[(COMPUTE, "150%")][..], "gpufrac.io/compute-fraction=\"150%\""),
        (&[(COMPUTE, "lots")][..], "gpufrac.io/compute-fraction=\"lots\""),
        (&[(COMPUTE_LIMIT, "0%")][..], "gpufrac.io/compute-fraction-limit=\"0%\""),
        (&[(COMPUTE, "50%"), (COMPUTE_LIMIT, "40%")][..], "gpufrac.io/compute-fraction-limit=\"40%\""),
    ] {
        // Whichever container asks: the annotation is the pod's mistake.
        for container in ["aa11", "bb22"] {
            let why = decide_for(&entry(annotations, &refs), container, None, 100).expect_err(want);
            assert!(why.starts_with("pod ns/p: annotation ") && why.contains(want), "{why}");
        }
    }
}

#[test]
fn a_limit_below_the_granted_shares_is_raised() {
    let ids = ids(34);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let e = decide_for(&entry(&[(FRACTION_LIMIT, "0.333")], &refs), "aa11", None, 100).expect("entitled");
    assert_eq!(e.max_limit, Amount::Fraction(0.34));
}

#[test]
fn refusals_name_the_cause() {
    let ids = ids(10);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let no = |r: Result<Entitlement, String>| match r {
        Err(why) => why,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let why = no(decide_for(&entry(&[(FRACTION_LIMIT, "25%")], &refs), "aa11", None, 100));
    assert!(why.contains("gpufrac.io/gpu-fraction-limit=\"25%\""), "{why}");
    let why = no(decide_for(&entry(&[(RESOLVER, "fastest")], &refs), "aa11", None, 100));
    assert!(why.contains("gpufrac.io/resolver=\"fastest\""), "{why}");
    let why = no(decide_for(&entry(&[], &refs), "aa11", Some("n2"), 100));
    assert!(why.contains("runs on node n1"), "{why}");
    let why = no(decide_for(&entry(&[], &["GPU-x::1"]), "aa11", None, 100));
    assert!(why.contains("device ID \"GPU-x::1\""), "{why}");
    let mut e = entry(&[], &refs);
    e.devices.as_mut().map(|d| d.containers.remove("main"));
    let why = no(decide_for(&e, "aa11", None, 100));
    assert!(why.contains("allocated no gpufrac.io/gpu shares"), "{why}");
    let why = no(decide_for(&entry(&[], &refs), "cc33", None, 100));
    assert!(why.contains("container cc33 is not (yet) one of pod ns/p's containers"), "{why}");
    let mut e = entry(&[], &refs);
    e.devices = None;
    let why = no(decide_for(&e, "aa11", None, 100));
    assert!(why.contains("lists no gpufrac.io/gpu shares for pod ns/p"), "{why}");
}

#[test]
fn shares_on_several_gpus_are_each_gpus_own_fraction() {
    const OTHER: &str = "GPU-516d6770-7500-0000-0000-000000000004";
    let mut ids = ids(75);
    ids.extend((0..50).map(|i| format!("{OTHER}::{i}")));
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let e = decide_for(&entry(&[(FRACTION_LIMIT, "0.6")], &refs), "aa11", None, 100).expect("entitled");
    let uuid = |text: &str| gpufrac_common::gpu_uuid::parse(text).expect("a UUID");
    let caps = |request, limit| DeviceCaps {
        max_request: Amount::Fraction(request),
        max_limit: Amount::Fraction(limit),
    };
    assert_eq!(
        e.devices,
        Some(BTreeMap::from([(uuid(GPU), caps(0.75, 0.75)), (uuid(OTHER), caps(0.5, 0.6))])),
        "each GPU its own shares, the limit never below them"
    );
    assert_eq!((e.max_request, e.max_limit), (Amount::Fraction(0.75), Amount::Fraction(0.75)));
    assert_eq!(e.group.as_deref(), Some("k8s-0f3c2a4e-1111-2222-3333-444455556666-main"), "one group");
}

#[test]
fn share_ids_are_checked() {
    let one = |ids: &[String]| shares_of(ids, 100).map(|gpus| gpus.into_values().collect::<Vec<_>>());
    assert_eq!(one(&ids(3)), Ok(vec![3]));
    // Duplicates count once.
    let mut dup = ids(3);
    dup.push(dup[0].clone());
    assert_eq!(one(&dup), Ok(vec![3]));
    assert!(shares_of(&[format!("{GPU}::100")], 100).is_err());
    assert!(shares_of(&[format!("{GPU}:1")], 100).is_err());
    assert!(shares_of(&[], 100).is_err());
}

#[test]
fn fractions() {
    assert_eq!(parse_fraction("0.5"), Some(0.5));
    assert_eq!(parse_fraction(".25"), Some(0.25));
    assert_eq!(parse_fraction("1"), Some(1.0));
    for bad in ["", ".", "0", "1.5", "-0.5", "1e-1", "NaN", "inf", "25%", "0.2.5", "0x1"] {
        assert_eq!(parse_fraction(bad), None, "{bad}");
    }
}

#[test]
fn groups_fit_the_arbiter() {
    let ok = |g: &str| {
        g.len() <= MAX_GROUP
            && g.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    };
    let long = "c".repeat(63);
    let a = group_name(UID, &long);
    let b = group_name(UID, &format!("{}d", "c".repeat(62)));
    assert!(ok(&a) && ok(&b), "{a} {b}");
    assert_ne!(a, b);
    assert!(a.starts_with(&format!("k8s-{UID}-cccccc-")), "{a}");
    assert_eq!(group_name(UID, &long), a, "stable");
    let odd = group_name(UID, "a/b");
    assert!(ok(&odd), "{odd}");
}
