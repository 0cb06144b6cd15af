//! The Kubernetes reconciler (`flotilla reconcile`) against a fake API server: an in-process
//! axum server answering the two endpoints it uses (GET and PATCH of a workload's `scale`
//! subresource, `apps/v1`) as the API server does — `autoscaling/v1` Scale objects, `Status`
//! errors — reached through a real kubeconfig file and the `kube` client. There is no cluster
//! here; the last test adds a fake kubelet (a PATCH starts or SIGTERMs real `flotilla node`
//! worker processes, as a StatefulSet controller would) so that a real planner, the reconciler
//! and the fleet close the loop: a pool at zero wakes for a request and goes back to zero.

#![cfg(feature = "kubernetes")]

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use flotilla::cli::reconcile::{Kubernetes, Reconciler, Workload, parse_workloads};
use flotilla::control::planner::{Action, Decision, PlannerMode, PlannerView, PoolDecision};
use flotilla::runtime::role::Role;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One request the fake API server saw.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    path: String,
    query: HashMap<String, String>,
    content_type: String,
    authorization: String,
    body: Value,
}

/// What a PATCH asks of the fake kubelet: workload name, new replica count.
type Kubelet = tokio::sync::mpsc::UnboundedSender<(String, u32)>;

#[derive(Default)]
struct World {
    /// `kind/name` → spec.replicas (a missing key: 404).
    replicas: HashMap<String, u32>,
    /// `kind/name` the service account may not touch (403).
    forbidden: Vec<String>,
    /// `kind/name` whose scale the server answers with a body that is not JSON.
    garbage: Vec<String>,
    seen: Vec<Seen>,
    kubelet: Option<Kubelet>,
}

type Shared = Arc<Mutex<World>>;

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    });
    (
        StatusCode::from_u16(code).unwrap(),
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn scale(ns: &str, name: &str, replicas: u32) -> Response {
    let body = json!({
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "selector": format!("app={name}")},
    });
    ([("content-type", "application/json")], body.to_string()).into_response()
}

async fn scale_endpoint(
    State(world): State<Shared>,
    method: Method,
    Path((ns, kind, name)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let header = |h: &str| {
        headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let mut w = world.lock().unwrap();
    w.seen.push(Seen {
        method: method.clone(),
        path: format!("/apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale"),
        query,
        content_type: header("content-type"),
        authorization: header("authorization"),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    let key = format!("{kind}/{name}");
    if w.garbage.contains(&key) {
        return ([("content-type", "application/json")], "{not json").into_response();
    }
    if w.forbidden.contains(&key) {
        return status(
            403,
            "Forbidden",
            &format!(
                "{kind}.apps \"{name}\" is forbidden: cannot {method} resource \"{kind}/scale\""
            ),
        );
    }
    let Some(&now) = w.replicas.get(&key) else {
        return status(
            404,
            "NotFound",
            &format!("{kind}.apps \"{name}\" not found"),
        );
    };
    if method == Method::PATCH {
        if header("content-type") != "application/merge-patch+json" {
            return status(415, "UnsupportedMediaType", "expected a merge patch");
        }
        let Some(n) = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|b| b["spec"]["replicas"].as_u64())
        else {
            return status(422, "Invalid", "spec.replicas: Required value");
        };
        w.replicas.insert(key, n as u32);
        if let Some(k) = &w.kubelet {
            let _ = k.send((name.clone(), n as u32));
        }
        return scale(&ns, &name, n as u32);
    }
    scale(&ns, &name, now)
}

/// The fake API server: its base URL and its world.
async fn fake_api(world: World) -> (String, Shared) {
    let world = Arc::new(Mutex::new(world));
    let app = axum::Router::new()
        .route(
            "/apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale",
            get(scale_endpoint).patch(scale_endpoint),
        )
        .with_state(world.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), world)
}

/// A kubeconfig for `server`, namespace `flotilla`, a bearer token.
fn kubeconfig(dir: &std::path::Path, server: &str) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
             clusters:\n- name: fake\n  cluster:\n    server: {server}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: flotilla\n\
             users:\n- name: fake\n  user:\n    token: test-token\n"
        ),
    )
    .unwrap();
    path
}

async fn client(kubeconfig: &std::path::Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// A planner's view with one decision: per pool, its desired count and action.
fn decision(
    at_ms: u64,
    mode: PlannerMode,
    stale: bool,
    pools: &[(Role, u32, Action)],
) -> PlannerView {
    let pools = pools
        .iter()
        .map(|&(role, desired, action)| PoolDecision {
            role,
            actual: 1,
            desired,
            action,
            needed: desired,
            load_tokens_per_s: 100.0,
            correction: 1.0,
            reason: format!("test wants {desired}"),
        })
        .collect();
    PlannerView {
        mode,
        interval_s: 10.0,
        capacity: "test".into(),
        decisions: vec![Decision {
            at_ms,
            mode,
            stale,
            signals_age_ms: 0,
            forecast: None,
            pools,
            manual: vec![],
            cost_per_hour: 0.0,
            term: 0,
        }],
        leadership: None,
    }
}

fn workloads(flags: &[&str]) -> Vec<Workload> {
    parse_workloads(&flags.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

#[tokio::test]
async fn a_decision_patches_each_pools_scale_once() {
    let mut world = World::default();
    world
        .replicas
        .insert("statefulsets/flotilla-prefill".into(), 1);
    world
        .replicas
        .insert("deployments/flotilla-decode".into(), 2);
    let (server, world) = fake_api(world).await;
    let dir = tempfile::tempdir().unwrap();
    let kube = Kubernetes::new(client(&kubeconfig(dir.path(), &server)).await, None);
    assert_eq!(
        kube.namespace(),
        "flotilla",
        "the kubeconfig context's namespace"
    );
    let mut r = Reconciler::new(
        kube,
        workloads(&[
            "prefill=statefulset/flotilla-prefill",
            "decode=deployment/flotilla-decode",
        ]),
        2,
    );

    // prefill: 5 replicas at 2 per node → 3 nodes (patched); decode: 4 → 2 nodes (as is).
    let v = decision(
        1_000,
        PlannerMode::Act,
        false,
        &[
            (Role::Prefill, 5, Action::Up),
            (Role::Decode, 4, Action::Up),
        ],
    );
    let pass = r.pass([&v]).await;
    assert!(pass.errors.is_empty(), "{:?}", pass.errors);
    assert_eq!(pass.decision_ms, Some(1_000));
    assert_eq!(
        pass.applied
            .iter()
            .map(|a| (a.from, a.to))
            .collect::<Vec<_>>(),
        vec![(1, 3), (2, 2)]
    );
    let seen = std::mem::take(&mut world.lock().unwrap().seen);
    let calls: Vec<(String, String)> = seen
        .iter()
        .map(|s| (s.method.to_string(), s.path.clone()))
        .collect();
    assert_eq!(
        calls,
        vec![
            (
                "GET".into(),
                "/apis/apps/v1/namespaces/flotilla/statefulsets/flotilla-prefill/scale".into()
            ),
            (
                "PATCH".into(),
                "/apis/apps/v1/namespaces/flotilla/statefulsets/flotilla-prefill/scale".into()
            ),
            (
                "GET".into(),
                "/apis/apps/v1/namespaces/flotilla/deployments/flotilla-decode/scale".into()
            ),
        ],
        "a pool already at its count is not patched"
    );
    let patch = &seen[1];
    assert_eq!(patch.content_type, "application/merge-patch+json");
    assert_eq!(patch.body, json!({"spec": {"replicas": 3}}));
    assert_eq!(
        patch.query.get("fieldManager").map(String::as_str),
        Some("flotilla-reconciler")
    );
    assert!(
        seen.iter().all(|s| s.authorization == "Bearer test-token"),
        "{seen:?}"
    );
    assert_eq!(
        world.lock().unwrap().replicas["statefulsets/flotilla-prefill"],
        3
    );

    // The same decision again, an advisory one, a stale one: nothing is called.
    let advisory = decision(
        2_000,
        PlannerMode::Advisory,
        false,
        &[(Role::Prefill, 9, Action::Up)],
    );
    let stale = decision(
        3_000,
        PlannerMode::Act,
        true,
        &[(Role::Prefill, 9, Action::Up)],
    );
    for views in [vec![&v], vec![&advisory], vec![&stale]] {
        let pass = r.pass(views).await;
        assert_eq!(pass.decision_ms, None);
    }
    assert!(world.lock().unwrap().seen.is_empty(), "nothing called");

    // Scaled by hand to 5 (kubectl scale): a hold whose `desired` still reads the view's 1
    // leaves it (the planner adopts it once the pods join); so does an up that asks for
    // less than the pool has (a view emptied by a gateway restart).
    world
        .lock()
        .unwrap()
        .replicas
        .insert("statefulsets/flotilla-prefill".into(), 5);
    for (at, action) in [(4_000, Action::Hold), (5_000, Action::Up)] {
        let v = decision(at, PlannerMode::Act, false, &[(Role::Prefill, 1, action)]);
        let pass = r.pass([&v]).await;
        assert!(pass.errors.is_empty(), "{:?}", pass.errors);
        assert_eq!((pass.applied[0].from, pass.applied[0].to), (5, 5));
    }
    assert!(
        !world
            .lock()
            .unwrap()
            .seen
            .iter()
            .any(|s| s.method == Method::PATCH),
        "no patch"
    );

    // A pool without a workload is left alone; a down to zero is a patch to 0.
    let v = decision(
        6_000,
        PlannerMode::Act,
        false,
        &[
            (Role::Prefill, 0, Action::Down),
            (Role::Aggregated, 3, Action::Up),
        ],
    );
    let pass = r.pass([&v]).await;
    assert!(pass.errors.is_empty(), "{:?}", pass.errors);
    assert_eq!(pass.applied.len(), 1);
    assert_eq!(
        world.lock().unwrap().replicas["statefulsets/flotilla-prefill"],
        0
    );
}

#[tokio::test]
async fn api_errors_say_what_to_fix_and_the_decision_is_tried_again() {
    let mut world = World::default();
    world
        .replicas
        .insert("statefulsets/flotilla-decode".into(), 1);
    world.forbidden.push("statefulsets/flotilla-decode".into());
    let (server, world) = fake_api(world).await;
    let dir = tempfile::tempdir().unwrap();
    let kube = Kubernetes::new(
        client(&kubeconfig(dir.path(), &server)).await,
        Some("serving".into()),
    );
    let mut r = Reconciler::new(
        kube,
        workloads(&[
            "prefill=statefulset/flotilla-prefill",
            "decode=statefulset/flotilla-decode",
        ]),
        1,
    );
    let v = decision(
        1_000,
        PlannerMode::Act,
        false,
        &[
            (Role::Prefill, 2, Action::Up),
            (Role::Decode, 2, Action::Up),
        ],
    );
    let pass = r.pass([&v]).await;
    let errors: Vec<String> = pass.errors.iter().map(|e| e.to_string()).collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    // --namespace wins over the kubeconfig's.
    assert!(
        errors[0].contains("statefulset/flotilla-prefill")
            && errors[0].contains("not found in namespace \"serving\""),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("forbidden") && errors[1].contains("rbac.yaml"),
        "{}",
        errors[1]
    );
    // An answer that is not a Scale object is named as such (the server was reached).
    world
        .lock()
        .unwrap()
        .garbage
        .push("statefulsets/flotilla-decode".into());
    let e = r.pass([&v]).await.errors.last().unwrap().to_string();
    assert!(
        e.contains("not a Scale object") && !e.contains("cannot reach"),
        "{e}"
    );
    world.lock().unwrap().garbage.clear();
    // Fixed (the workload created, the role granted) a planner interval later, when its
    // latest decision is a hold waiting on the replicas it asked for: the missed up applies.
    {
        let mut w = world.lock().unwrap();
        w.forbidden.clear();
        w.replicas.insert("statefulsets/flotilla-prefill".into(), 0);
    }
    let mut later = v.clone();
    let mut hold = later.decisions[0].clone();
    hold.at_ms = 2_000;
    for p in &mut hold.pools {
        p.action = Action::Hold;
    }
    later.decisions.push(hold);
    let pass = r.pass([&later]).await;
    assert!(pass.errors.is_empty(), "{:?}", pass.errors);
    assert_eq!(pass.decision_ms, Some(2_000));
    let w = world.lock().unwrap();
    assert_eq!(w.replicas["statefulsets/flotilla-prefill"], 2);
    assert_eq!(w.replicas["statefulsets/flotilla-decode"], 2);
}

#[tokio::test]
async fn an_unreachable_api_server_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let port = poll::free_port();
    let kube = Kubernetes::new(
        client(&kubeconfig(dir.path(), &format!("http://127.0.0.1:{port}"))).await,
        None,
    );
    let mut r = Reconciler::new(kube, workloads(&["decode=sts/flotilla-decode"]), 1);
    let v = decision(
        1_000,
        PlannerMode::Act,
        false,
        &[(Role::Decode, 2, Action::Up)],
    );
    let pass = r.pass([&v]).await;
    assert_eq!(pass.errors.len(), 1);
    let e = pass.errors[0].to_string();
    assert!(e.contains("cannot reach the Kubernetes API"), "{e}");
}

#[test]
fn the_command_refuses_bad_flags_before_it_connects() {
    for (args, says) in [
        (vec!["--workload", "decode"], "expected POOL=KIND/NAME"),
        (
            vec!["--workload", "decode=sts/a", "--workload", "decode=sts/b"],
            "given twice",
        ),
        (
            vec!["--workload", "decode=sts/a", "--interval-ms", "0"],
            "--interval-ms",
        ),
        (
            vec!["--workload", "decode=sts/a", "--replicas-per-node", "0"],
            "--replicas-per-node",
        ),
        (
            vec!["--workload", "decode=sts/a", "--gateway", "not a url"],
            "--gateway",
        ),
        // Flags fine, no configuration: said, with where it was looked for.
        (vec!["--workload", "decode=sts/a"], "KUBECONFIG"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
            .arg("reconcile")
            .args(&args)
            // No configuration at all: the flags are checked first.
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// Worker node processes a fake kubelet runs for the `flotilla-worker` StatefulSet.
struct Pods {
    join: String,
    cookie: String,
    pods: Vec<tokio::process::Child>,
}

impl Pods {
    fn scale(&mut self, n: usize) {
        while self.pods.len() < n {
            let i = self.pods.len();
            let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
                .args(["node", "--name", &format!("flotilla-worker-{i}")])
                .args(["--listen", &format!("127.0.0.1:{}", poll::free_port())])
                .args(["--roles", "worker", "--join", &self.join])
                .args(["--set", "worker.engine=sim"])
                .env("FLOTILLA_NODE__COOKIE", &self.cookie)
                .stdout(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            self.pods.push(child);
        }
        // A StatefulSet removes its highest pods first, with SIGTERM (the node drains).
        while self.pods.len() > n {
            let mut pod = self.pods.pop().unwrap();
            if let Some(pid) = pod.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            tokio::spawn(async move { pod.wait().await });
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_scales_a_statefulset_from_zero_and_back_through_the_api() {
    use tokio::io::AsyncBufReadExt;
    let (kubelet_tx, mut kubelet_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut world = World::default();
    world
        .replicas
        .insert("statefulsets/flotilla-worker".into(), 0);
    world.kubelet = Some(kubelet_tx);
    let (server, world) = fake_api(world).await;
    let dir = tempfile::tempdir().unwrap();
    let kc = kubeconfig(dir.path(), &server);

    // The gateway pod: gateway, router and planner; no worker; the pool may go to zero.
    let cookie = "k8s-reconcile-test";
    let seed = format!("127.0.0.1:{}", poll::free_port());
    let mut gateway = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["node", "--name", "flotilla-gateway-0", "--listen", &seed])
        .args(["--roles", "gateway,router,planner", "--http", "127.0.0.1:0"])
        .args(["--set", "worker.engine=sim"])
        .args(["--set", "planner.interval_s=1"])
        .args(["--set", "planner.cooldown_s=1"])
        .args(["--set", "planner.pools=[\"aggregated\"]"])
        .args(["--set", "planner.aggregated.min=0"])
        .args(["--set", "planner.aggregated.max=2"])
        .args(["--set", "planner.idle_to_zero_s=3"])
        .env("FLOTILLA_NODE__COOKIE", cookie)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(gateway.stdout.take().unwrap()).lines();
    let ready: Value = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(j) = line.strip_prefix(flotilla::node::READY_PREFIX) {
                return serde_json::from_str(j).unwrap();
            }
        }
        panic!("the gateway node ended before it was ready");
    })
    .await
    .expect("gateway node ready within 60 s");
    let http = format!("http://{}", ready["http_addr"].as_str().unwrap());

    // The fake kubelet: a PATCH to the StatefulSet's scale starts or stops worker pods.
    let pods = Arc::new(tokio::sync::Mutex::new(Pods {
        join: seed.clone(),
        cookie: cookie.into(),
        pods: vec![],
    }));
    let p = pods.clone();
    tokio::spawn(async move {
        while let Some((name, n)) = kubelet_rx.recv().await {
            assert_eq!(name, "flotilla-worker");
            p.lock().await.scale(n as usize);
        }
    });

    // The reconciler, as deploy/k8s/reconciler.yaml runs it.
    let mut reconciler = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["reconcile", "--gateway", &http])
        .args(["--workload", "aggregated=statefulset/flotilla-worker"])
        .args(["--interval-ms", "200"])
        .env("KUBECONFIG", &kc)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut out = tokio::io::BufReader::new(reconciler.stdout.take().unwrap()).lines();
    let l = log.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = out.next_line().await {
            l.lock().unwrap().push(line);
        }
    });

    // A request at zero waits at the gateway; the planner wants a replica; the reconciler
    // patches the StatefulSet to 1; the pod starts, joins, and the request is served.
    let body = json!({"model": http::MODEL, "prompt": "hello there", "max_tokens": 4});
    let (s, _, text) = http::post(&format!("{http}/v1/completions"), &body).await;
    assert_eq!(s, 200, "{text}");
    assert_eq!(
        world.lock().unwrap().replicas["statefulsets/flotilla-worker"],
        1
    );
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("aggregated: statefulset/flotilla-worker 0 -> 1")),
        "{:?}",
        log.lock().unwrap()
    );

    // Idle for planner.idle_to_zero_s: back to zero through the API, the pod drained.
    poll::poll_until(
        Duration::from_secs(60),
        "the StatefulSet back at zero",
        || async {
            (world.lock().unwrap().replicas["statefulsets/flotilla-worker"] == 0).then_some(())
        },
    )
    .await;
    poll::poll_until(Duration::from_secs(30), "no ready worker", || async {
        (http::ready_workers(&http::At(http.clone())).await == 0).then_some(())
    })
    .await;
    let patches = world
        .lock()
        .unwrap()
        .seen
        .iter()
        .filter(|s| s.method == Method::PATCH)
        .map(|s| s.body["spec"]["replicas"].as_u64().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(patches, vec![1, 0], "one patch each way, no flapping");
    let _ = reconciler.start_kill();
    let _ = gateway.start_kill();
}

/// A gateway whose `/v1/fleet` shows one planner node with `view`, and an API server that
/// accepts connections and never answers: the reconciler's calls hang.
async fn fleet_and_hanging_api(view: PlannerView) -> (String, String) {
    use flotilla::control::discovery::membership::{NodeState, NodeView};
    let node = NodeView {
        id: flotilla::runtime::ids::NodeId::new("flotilla-gateway-0"),
        addr: String::new(),
        http_addr: None,
        roles: vec![],
        pid: 0,
        incarnation: 1,
        state: NodeState::Up,
        last_seen_ms: 0,
        workers: vec![],
        actors: vec![],
        counters: Default::default(),
        signals: None,
        planner: Some(view),
        regions: vec![],
    };
    let fleet = json!({ "nodes": [node] });
    let app = axum::Router::new()
        .route(
            "/v1/fleet",
            get(move || {
                let f = fleet.clone();
                async move { axum::Json(f) }
            }),
        )
        .route(
            "/apis/apps/v1/namespaces/{ns}/{kind}/{name}/scale",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                ""
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), format!("http://{addr}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_api_server_does_not_keep_the_reconciler_from_stopping() {
    let v = decision(
        1_000,
        PlannerMode::Act,
        false,
        &[(Role::Decode, 2, Action::Up)],
    );
    let (gateway, api) = fleet_and_hanging_api(v).await;
    let dir = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_flotilla"))
        .args(["reconcile", "--gateway", &gateway])
        .args(["--workload", "decode=statefulset/flotilla-decode"])
        .env("KUBECONFIG", kubeconfig(dir.path(), &api))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Give it time to read the fleet and hang in its call to the API server.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(child.try_wait().unwrap().is_none(), "still running");
    let pid = child.id().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .expect("SIGTERM stops it mid-call")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// Fencing through the Kubernetes reconciler: a leader's decision (term 5) is applied; a newer
/// decision from a planner that still claims to lead in term 3 (a deposed leader on the far
/// side of a partition) patches nothing, and a standby's is ignored.
#[tokio::test]
async fn a_deposed_leaders_decisions_are_refused() {
    use flotilla::control::leadership::Standing;
    let mut world = World::default();
    world
        .replicas
        .insert("statefulsets/flotilla-decode".into(), 1);
    let (server, world) = fake_api(world).await;
    let dir = tempfile::tempdir().unwrap();
    let kube = Kubernetes::new(client(&kubeconfig(dir.path(), &server)).await, None);
    let mut r = Reconciler::new(kube, workloads(&["decode=statefulset/flotilla-decode"]), 1);
    let led = |at_ms: u64, desired: u32, standing: Standing| {
        let mut v = decision(
            at_ms,
            PlannerMode::Act,
            false,
            &[(Role::Decode, desired, Action::Up)],
        );
        v.decisions[0].term = standing.term();
        v.leadership = Some(standing);
        v
    };
    let leader = led(1_000, 3, Standing::Leader { term: 5 });
    let pass = r.pass([&leader]).await;
    assert_eq!(
        pass.applied.iter().map(|a| a.to).collect::<Vec<_>>(),
        vec![3]
    );
    world.lock().unwrap().seen.clear();
    let deposed = led(2_000, 6, Standing::Leader { term: 3 });
    let standby = led(
        3_000,
        9,
        Standing::Standby {
            term: 5,
            leader: None,
        },
    );
    let pass = r.pass([&deposed, &standby]).await;
    assert_eq!(pass.decision_ms, None, "nothing to apply");
    assert!(pass.applied.is_empty());
    assert!(
        world.lock().unwrap().seen.is_empty(),
        "no call to the API server"
    );
}
