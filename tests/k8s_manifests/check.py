"""Checks deploy/k8s beyond the schemas (tests/k8s_manifests.rs runs it with the venv's Python,
where kubernetes-validate brings PyYAML): the parts must fit together. Usage: check.py DIR.
Exits non-zero naming the first thing that does not fit."""
import sys
import tomllib
from pathlib import Path

import yaml

d = Path(sys.argv[1])


def fail(msg):
    print(f"deploy/k8s: {msg}", file=sys.stderr)
    sys.exit(1)


kust = yaml.safe_load((d / "kustomization.yaml").read_text())
docs = []
for r in kust["resources"]:
    if not (d / r).is_file():
        fail(f"kustomization.yaml lists {r}, which does not exist")
    docs += [x for x in yaml.safe_load_all((d / r).read_text()) if x]
by = {(x["kind"], x["metadata"]["name"]): x for x in docs}
gen = {g["name"]: g for g in kust.get("configMapGenerator", [])}
for g in gen.values():
    for f in g["files"]:
        if not (d / f).is_file():
            fail(f"configMapGenerator {g['name']} lists {f}, which does not exist")
config = tomllib.loads((d / "flotilla.toml").read_text())
image_names = {i["name"] for i in kust.get("images", [])}

workloads = [x for x in docs if x["kind"] in ("StatefulSet", "Deployment")]
nodes = []
for w in workloads:
    name = w["metadata"]["name"]
    pod = w["spec"]["template"]
    sel = w["spec"]["selector"]["matchLabels"]
    if any(pod["metadata"]["labels"].get(k) != v for k, v in sel.items()):
        fail(f"{name}: the selector does not match the pod's labels")
    for c in pod["spec"]["containers"]:
        if c["image"].split(":")[0] not in image_names:
            fail(f"{name}: image {c['image']} is not in the kustomization's images")
    for v in pod["spec"].get("volumes", []):
        cm = v.get("configMap", {}).get("name")
        if cm and cm not in gen:
            fail(f"{name}: volume {v['name']} names ConfigMap {cm}, which nothing generates")
    args = pod["spec"]["containers"][0]["args"]
    if args[0] == "node":
        nodes.append((w, args))

# The headless Service: every node pod in it, and the seed its workers join resolvable.
headless = [s for s in docs if s["kind"] == "Service" and s["spec"].get("clusterIP") == "None"]
if len(headless) != 1:
    fail("one headless Service is needed for the nodes' names")
svc = headless[0]
drain_ms = config["node"]["drain_grace_ms"]
for w, args in nodes:
    name = w["metadata"]["name"]
    labels = w["spec"]["template"]["metadata"]["labels"]
    if any(labels.get(k) != v for k, v in svc["spec"]["selector"].items()):
        fail(f"{name}: its pods are not in the headless Service {svc['metadata']['name']}")
    if w["kind"] == "StatefulSet" and w["spec"]["serviceName"] != svc["metadata"]["name"]:
        fail(f"{name}: serviceName is not the headless Service")
    grace = w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    if grace * 1000 <= drain_ms:
        fail(f"{name}: terminationGracePeriodSeconds {grace} s does not cover node.drain_grace_ms {drain_ms}")
    for a in args:
        if a.startswith("--join="):
            host, port = a.removeprefix("--join=").rsplit(":", 1)
            pod, _, service = host.partition(".")
            seed_set, _, ordinal = pod.rpartition("-")
            seed = by.get(("StatefulSet", seed_set))
            if service != svc["metadata"]["name"] or seed is None or not ordinal.isdigit():
                fail(f"{name}: --join {host} is not a pod of a StatefulSet in the headless Service")
            if int(ordinal) >= seed["spec"].get("replicas", 1):
                fail(f"{name}: --join {host}: {seed_set} has no pod {ordinal}")
            if not any(f"--listen=$(POD_IP):{port}" == x for x in seed["spec"]["template"]["spec"]["containers"][0]["args"]):
                fail(f"{name}: --join port {port} is not where {seed_set} listens")

# The reconciler: its workloads exist, its Role grants exactly those, their pools are planned.
rec = by.get(("Deployment", "flotilla-reconciler"))
if rec is None:
    fail("no flotilla-reconciler Deployment")
rspec = rec["spec"]["template"]["spec"]
rargs = rspec["containers"][0]["args"]
if rargs[0] != "reconcile":
    fail("flotilla-reconciler does not run `flotilla reconcile`")
targets = {}
for a in rargs:
    if a.startswith("--workload="):
        pool, ref = a.removeprefix("--workload=").split("=")
        kind, name = ref.split("/")
        targets[pool] = (kind, name)
pools = set(config["planner"].get("pools", []))
if set(targets) != pools:
    fail(f"the reconciler's pools {sorted(targets)} are not planner.pools {sorted(pools)}")
sa = rspec.get("serviceAccountName")
bindings = [b for b in docs if b["kind"] == "RoleBinding" and any(s["name"] == sa for s in b["subjects"])]
if not bindings:
    fail(f"no RoleBinding for the reconciler's service account {sa}")
role = by[("Role", bindings[0]["roleRef"]["name"])]
granted = set()
for rule in role["rules"]:
    if set(rule["verbs"]) - {"get", "patch"}:
        fail(f"Role {role['metadata']['name']} grants more than get and patch: {rule['verbs']}")
    if not rule.get("resourceNames"):
        fail(f"Role {role['metadata']['name']} is not limited to named workloads")
    for res in rule["resources"]:
        if not res.endswith("/scale"):
            fail(f"Role {role['metadata']['name']} grants {res}, not only a scale subresource")
        granted |= {(res.removesuffix("/scale"), n) for n in rule["resourceNames"]}
for pool, (kind, name) in targets.items():
    w = by.get(({"statefulset": "StatefulSet", "deployment": "Deployment"}[kind], name))
    if w is None:
        fail(f"the reconciler's {pool} workload {kind}/{name} does not exist")
    if (kind + "s", name) not in granted:
        fail(f"the reconciler may not scale {kind}/{name} (rbac.yaml)")
    if "replicas" in w["spec"]:
        fail(f"{name}: spec.replicas is set: every `kubectl apply` would undo the planner")
    env = {e["name"]: e.get("value") for e in w["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    if env.get("FLOTILLA_WORKER__ROLE") != pool:
        fail(f"{name}: FLOTILLA_WORKER__ROLE is {env.get('FLOTILLA_WORKER__ROLE')}, not {pool}")
if rspec.get("automountServiceAccountToken") is False:
    fail("the reconciler needs its service account token")
for w, _ in nodes:
    if w["spec"]["template"]["spec"].get("automountServiceAccountToken") is not False:
        fail(f"{w['metadata']['name']}: node pods need no API access (automountServiceAccountToken: false)")
print(f"deploy/k8s: {len(docs)} resources fit together")
