//! The Kubernetes manifests in `deploy/k8s`: valid against the Kubernetes API schemas
//! (`kubernetes-validate --strict`, the schemas of the oldest release `kube` is built for,
//! 1.33), fitting together (`k8s_manifests/check.py`: names, selectors, the seed the workers
//! join, the reconciler's workloads and RBAC, drain time inside the grace period), and their
//! configuration a valid Flotilla configuration with a loadable capacity profile.
//! `make test` installs kubernetes-validate into `.venv` (`make venv`); without it this test
//! fails and says so.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn venv_bin(name: &str) -> String {
    let p = format!("{ROOT}/.venv/bin/{name}");
    assert!(
        Path::new(&p).exists(),
        "{p} is missing: run `make venv` (it installs kubernetes-validate)"
    );
    p
}

fn manifests() -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(format!("{ROOT}/deploy/k8s"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
        })
        .collect();
    files.sort();
    files
}

#[test]
fn the_manifests_validate_against_the_kubernetes_schemas() {
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    let out = Command::new(venv_bin("kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", "1.33.0"])
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for kind in [
        "statefulset/flotilla-prefill",
        "statefulset/flotilla-decode",
        "role/flotilla-reconciler",
    ] {
        assert!(
            text.contains(&format!("passed for resource {kind}")),
            "{kind}: {text}"
        );
    }
    // The validator refuses a misspelt field (the check can fail).
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    let gateway = std::fs::read_to_string(format!("{ROOT}/deploy/k8s/gateway.yaml")).unwrap();
    std::fs::write(&bad, gateway.replace("serviceName:", "servicename:")).unwrap();
    let out = Command::new(venv_bin("kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", "1.33.0"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success(), "a misspelt field passed");
}

#[test]
fn the_manifests_fit_together() {
    let out = Command::new(venv_bin("python"))
        .arg(format!("{ROOT}/tests/k8s_manifests/check.py"))
        .arg(format!("{ROOT}/deploy/k8s"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // …and a broken copy does not: a reconciler pointed at a workload the Role does not grant.
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(format!("{ROOT}/deploy/k8s")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let rbac = dir.path().join("rbac.yaml");
    let text = std::fs::read_to_string(&rbac).unwrap();
    std::fs::write(&rbac, text.replace("\"flotilla-decode\"", "\"other\"")).unwrap();
    let out = Command::new(venv_bin("python"))
        .arg(format!("{ROOT}/tests/k8s_manifests/check.py"))
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("may not scale"),
        "{err}"
    );
}

#[test]
fn the_configmap_holds_a_valid_configuration_and_capacity_profile() {
    // In a pod the paths are under /etc/flotilla and /opt/flotilla, here the repository's;
    // the cookie comes from the flotilla-cookie Secret.
    let overrides = serde_json::json!({
        "node": { "cookie": "from-the-secret" },
        "planner": { "capacity_profile": format!("{ROOT}/deploy/k8s/capacity-cpu.json") },
        "worker": { "model_path": format!("{ROOT}/models/smollm2-135m-instruct-q4_1.gguf") },
    });
    let cfg = flotilla::node::config::Config::load(
        Some(Path::new(&format!("{ROOT}/deploy/k8s/flotilla.toml"))),
        overrides,
    )
    .expect("deploy/k8s/flotilla.toml is a valid configuration");
    use flotilla::runtime::role::Role;
    assert_eq!(cfg.planner.pools, vec![Role::Prefill, Role::Decode]);
    let capacity = cfg
        .planner_capacity(None)
        .expect("the capacity profile loads for the CPU engine");
    assert!(
        capacity.source.contains("flotilla profile"),
        "{}",
        capacity.source
    );
    assert!(
        cfg.node.drain_grace_ms < 60_000,
        "inside terminationGracePeriodSeconds"
    );
}
