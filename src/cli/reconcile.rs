//! `flotilla reconcile`: the Kubernetes reconciler. It reads the planner's decisions from a
//! gateway's `/v1/fleet` (the published fleet view; it never calls the planner) and patches
//! the `scale` subresource of each pool's workload — a StatefulSet or a Deployment — to the
//! node count the planner wants (`control::reconcile`: decisions in mode `act`, not stale,
//! each applied once). Kubernetes does the rest: a scale-up starts pods that join the cluster
//! through the headless Service; a scale-down sends SIGTERM to the highest pods, and a node
//! drains on SIGTERM (it leaves routing, finishes or migrates what it runs, then stops), so
//! nothing is cut as long as the pod's `terminationGracePeriodSeconds` exceeds
//! `node.drain_grace_ms`. A pod that fails to start is restarted by the kubelet with its own
//! back-off (CrashLoopBackOff); the planner does not count it until it is in the fleet view.
//!
//! Its rights are those of `deploy/k8s/rbac.yaml`: `get` and `patch` on the `scale` of the
//! named workloads, nothing else. The Kubernetes configuration is the pod's service account
//! in a cluster, else `KUBECONFIG` or `~/.kube/config`.
//!
//! Output: a line per change on stdout (`reconcile: <pool>: <kind>/<name> <from> -> <to>
//! node(s) ...`); on stderr, errors (each once until it changes; retried with back-off, 1 s
//! doubling to 30 s; `recovered` when it clears) and why nothing is applied (no planner, an
//! advisory one, stale signals). Every API call times out ([`API_READ_TIMEOUT`]).

use crate::control::reconcile::{pending, target};
use crate::runtime::role::Role;
use clap::Args;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use kube::api::{Api, Patch, PatchParams};
use std::time::Duration;

/// The field manager the API server records for our patches.
pub const FIELD_MANAGER: &str = "flotilla-reconciler";

/// Longest wait between retries after an API error.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Flags of `flotilla reconcile`.
#[derive(Args, Debug)]
pub struct ReconcileArgs {
    /// Gateway whose `/v1/fleet` carries the planner's decisions.
    #[arg(
        long,
        env = "FLOTILLA_GATEWAY",
        default_value = crate::cli::DEFAULT_GATEWAY,
        value_parser = crate::cli::gateway_arg
    )]
    pub gateway: String,
    /// A pool's workload, `POOL=KIND/NAME` (pool: aggregated, prefill or decode; kind:
    /// statefulset or deployment), repeatable. Pools without one are left alone.
    #[arg(long = "workload", required = true)]
    pub workloads: Vec<String>,
    /// Namespace of the workloads (default: the pod's own, or the kubeconfig context's).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Replicas each worker node runs (its `worker.replicas`): the planner counts replicas,
    /// a workload counts nodes.
    #[arg(long, default_value_t = 1)]
    pub replicas_per_node: u32,
    /// Milliseconds between reads of the fleet view.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// Apply the latest decision once and exit (status 2 if the gateway or the API failed).
    #[arg(long)]
    pub once: bool,
}

/// The kind of a pool's workload (both have a `scale` subresource).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    StatefulSet,
    Deployment,
}

impl WorkloadKind {
    fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::StatefulSet => "statefulset",
            WorkloadKind::Deployment => "deployment",
        }
    }
}

/// One pool's workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub pool: Role,
    pub kind: WorkloadKind,
    pub name: String,
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind.as_str(), self.name)
    }
}

impl std::str::FromStr for Workload {
    type Err = String;

    /// `POOL=KIND/NAME`, e.g. `decode=statefulset/flotilla-decode`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!(
                "--workload {s:?}: {why} (expected POOL=KIND/NAME, e.g. decode=statefulset/flotilla-decode)"
            )
        };
        let (pool, rest) = s.split_once('=').ok_or_else(|| bad("no '='"))?;
        let pool: Role = pool.trim().parse().map_err(|_| {
            bad(&format!(
                "unknown pool {:?} (aggregated, prefill or decode)",
                pool.trim()
            ))
        })?;
        let (kind, name) = rest.split_once('/').ok_or_else(|| bad("no '/'"))?;
        let kind = match kind.trim().to_ascii_lowercase().as_str() {
            "statefulset" | "statefulsets" | "sts" => WorkloadKind::StatefulSet,
            "deployment" | "deployments" | "deploy" => WorkloadKind::Deployment,
            other => {
                return Err(bad(&format!(
                    "unknown kind {other:?} (statefulset or deployment)"
                )));
            }
        };
        let name = name.trim();
        // An RFC 1123 subdomain, as the API server requires of a workload's name: labels of
        // lower-case letters, digits and '-', each starting and ending alphanumeric, joined
        // by '.'; 253 characters at most.
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && l.starts_with(|c: char| c.is_ascii_alphanumeric())
                && l.ends_with(|c: char| c.is_ascii_alphanumeric())
        };
        if name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(bad(&format!(
                "{name:?} is not a Kubernetes name (lower-case letters, digits, '-', '.')"
            )));
        }
        Ok(Workload {
            pool,
            kind,
            name: name.to_owned(),
        })
    }
}

/// Parse the `--workload` flags: each pool at most once.
///
/// # Errors
/// A malformed flag, or two workloads for one pool (named).
pub fn parse_workloads(flags: &[String]) -> Result<Vec<Workload>, String> {
    let mut out: Vec<Workload> = Vec::new();
    for f in flags {
        let w: Workload = f.parse()?;
        if let Some(prev) = out.iter().find(|p| p.pool == w.pool) {
            return Err(format!(
                "--workload: the {} pool is given twice ({prev} and {w})",
                w.pool
            ));
        }
        out.push(w);
    }
    Ok(out)
}

/// What one pool's reconcile did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub workload: Workload,
    /// `spec.replicas` before (nodes).
    pub from: u32,
    /// `spec.replicas` now (nodes).
    pub to: u32,
    /// Pods the workload runs now (`status.replicas`).
    pub running: u32,
}

/// A failed call to the API server, in words that say what to fix.
#[derive(Debug, thiserror::Error)]
#[error("{workload}: {message}")]
pub struct ApiError {
    pub workload: String,
    pub message: String,
}

/// An error and its sources, `a: b: c`, each said once (kube repeats its causes).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = err.source();
    }
    parts.join(": ")
}

fn api_error(w: &Workload, namespace: &str, verb: &str, e: kube::Error) -> ApiError {
    let message = match &e {
        kube::Error::Api(s) if s.code == 404 => format!(
            "not found in namespace {namespace:?} (check --workload and --namespace; \
             deploy/k8s/ names them)"
        ),
        kube::Error::Api(s) if s.code == 403 => format!(
            "forbidden to {verb} {}s/scale in namespace {namespace:?}: the reconciler's \
             service account needs get and patch on it (deploy/k8s/rbac.yaml): {}",
            w.kind.as_str(),
            s.message
        ),
        kube::Error::Api(s) => format!(
            "{verb} scale: the API server answered {}: {}",
            s.code, s.message
        ),
        kube::Error::SerdeError(e) => {
            format!("{verb} scale: the API server's answer is not a Scale object ({e})")
        }
        other => format!(
            "{verb} scale: cannot reach the Kubernetes API: {}",
            chain(other)
        ),
    };
    ApiError {
        workload: w.to_string(),
        message,
    }
}

/// A Scale object's `spec.replicas` (negative reads as 0).
fn spec_replicas(s: &k8s_openapi::api::autoscaling::v1::Scale) -> Option<u32> {
    s.spec.as_ref()?.replicas.map(|n| n.max(0) as u32)
}

/// The Kubernetes side: reads and patches the workloads' `scale`.
pub struct Kubernetes {
    client: kube::Client,
    namespace: String,
}

impl Kubernetes {
    /// A client on `client`, in `namespace` (else the client's default namespace).
    pub fn new(client: kube::Client, namespace: Option<String>) -> Self {
        let namespace = namespace.unwrap_or_else(|| client.default_namespace().to_owned());
        Self { client, namespace }
    }

    /// The namespace the workloads are in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    async fn get_scale(
        &self,
        w: &Workload,
    ) -> Result<k8s_openapi::api::autoscaling::v1::Scale, kube::Error> {
        match w.kind {
            WorkloadKind::StatefulSet => {
                Api::<StatefulSet>::namespaced(self.client.clone(), &self.namespace)
                    .get_scale(&w.name)
                    .await
            }
            WorkloadKind::Deployment => {
                Api::<Deployment>::namespaced(self.client.clone(), &self.namespace)
                    .get_scale(&w.name)
                    .await
            }
        }
    }

    async fn patch_scale(
        &self,
        w: &Workload,
        replicas: u32,
    ) -> Result<k8s_openapi::api::autoscaling::v1::Scale, kube::Error> {
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let patch = Patch::Merge(serde_json::json!({ "spec": { "replicas": replicas } }));
        match w.kind {
            WorkloadKind::StatefulSet => {
                Api::<StatefulSet>::namespaced(self.client.clone(), &self.namespace)
                    .patch_scale(&w.name, &pp, &patch)
                    .await
            }
            WorkloadKind::Deployment => {
                Api::<Deployment>::namespaced(self.client.clone(), &self.namespace)
                    .patch_scale(&w.name, &pp, &patch)
                    .await
            }
        }
    }

    /// Apply the planner's decisions `pending` (oldest first) to `w`, the workload of pool
    /// `role`: read its scale, and patch it when they change it ([`target`]: only a down
    /// decision lowers a pool).
    ///
    /// # Errors
    /// The API server refused or could not be reached ([`ApiError`] says which and why).
    pub async fn reconcile(
        &self,
        w: &Workload,
        pending: &[&crate::control::planner::Decision],
        replicas_per_node: u32,
    ) -> Result<Applied, ApiError> {
        let scale = self
            .get_scale(w)
            .await
            .map_err(|e| api_error(w, &self.namespace, "get", e))?;
        let from = spec_replicas(&scale).unwrap_or(0);
        let running = |s: &k8s_openapi::api::autoscaling::v1::Scale| {
            s.status
                .as_ref()
                .map(|s| s.replicas.max(0) as u32)
                .unwrap_or(0)
        };
        let Some(nodes) = target(pending, w.pool, from, replicas_per_node) else {
            return Ok(Applied {
                workload: w.clone(),
                from,
                to: from,
                running: running(&scale),
            });
        };
        let after = self
            .patch_scale(w, nodes)
            .await
            .map_err(|e| api_error(w, &self.namespace, "patch", e))?;
        let to = spec_replicas(&after).unwrap_or(nodes);
        Ok(Applied {
            workload: w.clone(),
            from,
            to,
            running: running(&after),
        })
    }
}

/// The reconcile loop's state: which decision was applied last, and the back-off.
pub struct Reconciler {
    pub kube: Kubernetes,
    pub workloads: Vec<Workload>,
    pub replicas_per_node: u32,
    last_applied_ms: Option<u64>,
    /// The highest planner term seen: a deposed leader's decisions are refused.
    fence: crate::control::reconcile::Fence,
    warned_unmapped: Vec<Role>,
}

/// One pass's outcome.
#[derive(Debug, Default)]
pub struct Pass {
    /// The decision applied (its `at_ms`), if there was a new one.
    pub decision_ms: Option<u64>,
    /// Per mapped pool.
    pub applied: Vec<Applied>,
    /// Per pool that failed (the decision is tried again).
    pub errors: Vec<ApiError>,
}

impl Reconciler {
    /// A reconciler for `workloads`.
    pub fn new(kube: Kubernetes, workloads: Vec<Workload>, replicas_per_node: u32) -> Self {
        Self {
            kube,
            workloads,
            replicas_per_node: replicas_per_node.max(1),
            last_applied_ms: None,
            fence: Default::default(),
            warned_unmapped: Vec::new(),
        }
    }

    /// Apply the planner's decisions not applied yet (see [`pending`]). They are marked
    /// applied only when every mapped pool succeeded; otherwise the next pass folds them again
    /// with the newer ones.
    pub async fn pass<'a>(
        &mut self,
        planners: impl IntoIterator<Item = &'a crate::control::planner::PlannerView>,
    ) -> Pass {
        let mut out = Pass::default();
        let refused = self.fence.refused;
        let pending = pending(planners, self.last_applied_ms, &mut self.fence);
        if self.fence.refused > refused {
            eprintln!(
                "reconcile: refused the decisions of a planner leading in a term below {} \
                 (a deposed leader)",
                self.fence.term
            );
        }
        let Some(d) = pending.last().copied() else {
            return out;
        };
        out.decision_ms = Some(d.at_ms);
        for pd in &d.pools {
            let Some(w) = self.workloads.iter().find(|w| w.pool == pd.role) else {
                if !self.warned_unmapped.contains(&pd.role) {
                    self.warned_unmapped.push(pd.role);
                    eprintln!(
                        "reconcile: the planner sizes the {} pool, which has no --workload: left alone",
                        pd.role
                    );
                }
                continue;
            };
            match self
                .kube
                .reconcile(w, &pending, self.replicas_per_node)
                .await
            {
                Ok(a) => {
                    if a.from != a.to {
                        println!(
                            "reconcile: {}: {} {} -> {} node(s) (planner wants {} replica(s): {})",
                            pd.role, a.workload, a.from, a.to, pd.desired, pd.reason
                        );
                    }
                    out.applied.push(a);
                }
                Err(e) => out.errors.push(e),
            }
        }
        if out.errors.is_empty() {
            self.last_applied_ms = Some(d.at_ms);
        }
        out
    }
}

/// Timeouts on every call to the API server: a server that hangs is an error to retry, not
/// a reconciler that stalls.
pub const API_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// See [`API_CONNECT_TIMEOUT`].
pub const API_READ_TIMEOUT: Duration = Duration::from_secs(15);

/// Why the latest decision in the view is not applied, in words (`None`: it is, or it was).
fn not_applied(planners: &[&crate::control::planner::PlannerView]) -> Option<&'static str> {
    use crate::control::planner::PlannerMode;
    let latest = planners
        .iter()
        .filter_map(|p| p.latest())
        .max_by_key(|d| d.at_ms);
    match latest {
        None => Some("no planner decision in the fleet view yet (is a planner node up?)"),
        Some(d) if d.mode == PlannerMode::Advisory => {
            Some("the planner is advisory (planner.mode): nothing to apply")
        }
        Some(d) if d.stale => Some("the planner's signals are stale: it holds, so do we"),
        Some(_) => None,
    }
}

/// Run `flotilla reconcile` until SIGTERM / Ctrl-C (or once, with `--once`).
///
/// # Errors
/// Bad flags; no Kubernetes configuration; with `--once`, a gateway or API failure.
pub async fn run(a: ReconcileArgs) -> anyhow::Result<std::process::ExitCode> {
    let workloads = parse_workloads(&a.workloads).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(a.interval_ms > 0, "--interval-ms must be at least 1");
    anyhow::ensure!(
        a.replicas_per_node > 0,
        "--replicas-per-node must be at least 1 (the nodes' worker.replicas)"
    );
    let gateway = crate::cli::status::base_url(&a.gateway);
    match reqwest::Url::parse(&gateway) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
        _ => anyhow::bail!("--gateway {:?}: not an http(s) URL or host:port", a.gateway),
    }
    let mut config = kube::Config::infer().await.map_err(|e| {
        anyhow::anyhow!(
            "no Kubernetes configuration ({}): in a pod, the service account's; elsewhere \
             KUBECONFIG or ~/.kube/config",
            chain(&e)
        )
    })?;
    config.connect_timeout = Some(API_CONNECT_TIMEOUT);
    config.read_timeout = Some(API_READ_TIMEOUT);
    config.write_timeout = Some(API_READ_TIMEOUT);
    let client = kube::Client::try_from(config)
        .map_err(|e| anyhow::anyhow!("cannot build a Kubernetes client: {}", chain(&e)))?;
    let kube = Kubernetes::new(client, a.namespace.clone());
    eprintln!(
        "reconcile: namespace {:?}, gateway {}, {}",
        kube.namespace(),
        gateway,
        workloads
            .iter()
            .map(|w| format!("{}={w}", w.pool))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut r = Reconciler::new(kube, workloads, a.replicas_per_node);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let every = Duration::from_millis(a.interval_ms);
    let mut backoff = every;
    let mut last_problem = String::new();
    let mut last_state: Option<&'static str> = None;
    loop {
        // One pass: read the view, apply. A signal ends it at once, mid-call or not.
        let pass = async {
            match crate::cli::status::fetch(&gateway).await {
                Err(e) => (format!("cannot read the fleet view: {e:#}"), None, None),
                Ok((fleet, _)) => {
                    let planners: Vec<_> = fleet
                        .nodes
                        .iter()
                        .filter_map(|n| n.planner.as_ref())
                        .collect();
                    let state = not_applied(&planners);
                    let pass = r.pass(planners).await;
                    let failed: Vec<String> = pass.errors.iter().map(|e| e.to_string()).collect();
                    (failed.join("; "), Some(pass), state)
                }
            }
        };
        let (problem, pass, state) = tokio::select! {
            out = pass => out,
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        };
        if problem.is_empty() {
            if !last_problem.is_empty() {
                eprintln!("reconcile: recovered");
                last_problem.clear();
            }
            if state != last_state && !a.once {
                if let Some(why) = state {
                    eprintln!("reconcile: {why}");
                }
                last_state = state;
            }
            if a.once {
                let pass = pass.unwrap_or_default();
                if pass.decision_ms.is_none() {
                    println!(
                        "reconcile: nothing to apply ({})",
                        state.unwrap_or("the latest decision was applied")
                    );
                }
                for ap in &pass.applied {
                    println!(
                        "reconcile: {}: {} at {} node(s), {} running",
                        ap.workload.pool, ap.workload, ap.to, ap.running
                    );
                }
                return Ok(std::process::ExitCode::SUCCESS);
            }
            backoff = every;
        } else if a.once {
            anyhow::bail!("{problem}");
        } else if problem != last_problem {
            eprintln!("reconcile: {problem} (retrying with back-off)");
            last_problem = problem;
        }
        // Every interval while all is well; after an error, 1 s doubling to 30 s.
        let wait = if last_problem.is_empty() {
            every
        } else {
            let w = backoff;
            backoff = (backoff * 2).min(MAX_BACKOFF);
            w
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_flags_parse_and_bad_ones_are_named() {
        let w = parse_workloads(&[
            "prefill=statefulset/flotilla-prefill".into(),
            "decode=Deployment/flotilla-decode".into(),
        ])
        .unwrap();
        assert_eq!(w[0].pool, Role::Prefill);
        assert_eq!(w[0].kind, WorkloadKind::StatefulSet);
        assert_eq!(w[1].to_string(), "deployment/flotilla-decode");
        for (flag, says) in [
            ("decode", "no '='"),
            ("decode=flotilla", "no '/'"),
            ("decode=daemonset/x", "unknown kind"),
            ("decode=statefulset/Bad_Name", "not a Kubernetes name"),
            ("decode=statefulset/", "not a Kubernetes name"),
            ("decode=statefulset/a..b", "not a Kubernetes name"),
            ("decode=statefulset/-a", "not a Kubernetes name"),
            ("gpu=statefulset/x", "unknown pool"),
        ] {
            let e = parse_workloads(&[flag.into()]).unwrap_err();
            assert!(e.contains(says) && e.contains(flag), "{flag}: {e}");
        }
        let e = parse_workloads(&["decode=sts/a".into(), "decode=sts/b".into()]).unwrap_err();
        assert!(e.contains("given twice"), "{e}");
    }
}
