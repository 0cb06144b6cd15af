//! `flotilla chaos …`: a client of the gateway's chaos API (`/chaos/faults`).

use clap::{Args, Subcommand};

/// Options of `flotilla chaos`.
#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// Gateway base URL (or host:port).
    #[arg(
        long,
        env = "FLOTILLA_GATEWAY",
        default_value = crate::cli::DEFAULT_GATEWAY,
        value_parser = crate::cli::gateway_arg,
        global = true
    )]
    pub gateway: String,
    /// Bearer token, when the gateway requires one (`chaos.token`).
    #[arg(long, env = "FLOTILLA_CHAOS_TOKEN", global = true)]
    pub token: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub cmd: ChaosCmd,
}

/// Chaos subcommands.
#[derive(Subcommand, Debug)]
pub enum ChaosCmd {
    /// List every fault, active or not.
    List,
    /// Add a delay before every engine step of the target.
    Slow {
        /// `any_busy`, `node:NAME` or a worker id (`node-1/replica-0`).
        #[arg(long)]
        target: String,
        /// Added delay per step (ms).
        #[arg(long)]
        delay_ms: u64,
        /// Clear by itself after this long (ms).
        #[arg(long)]
        duration_ms: Option<u64>,
    },
    /// Make the target's engine steps fail after N more steps.
    FailEngine {
        /// `any_busy`, `node:NAME` or a worker id.
        #[arg(long)]
        target: String,
        /// Steps that still succeed.
        #[arg(long, default_value_t = 0)]
        after_steps: u64,
        /// Clear by itself after this long (ms).
        #[arg(long)]
        duration_ms: Option<u64>,
    },
    /// Kill an actor of the target (`--actor replica|scheduler|engine|kv_publisher|router|
    /// http_gateway|token_sink|discovery`); its supervisor reacts.
    Kill {
        /// `any_busy`, `node:NAME` or a worker id.
        #[arg(long, default_value = "any_busy")]
        target: String,
        /// Which actor.
        #[arg(long, default_value = "replica")]
        actor: String,
    },
    /// Kill the target's node process (an abrupt exit, status 75); `flotilla up` starts it again.
    KillNode {
        /// `any_busy`, `node:NAME` or a worker id (its node).
        #[arg(long, default_value = "any_busy")]
        target: String,
    },
    /// Hang the target's engine until cleared or until its watchdog restarts the replica.
    Hang {
        /// `any_busy`, `node:NAME` or a worker id.
        #[arg(long, default_value = "any_busy")]
        target: String,
        /// Clear by itself after this long (ms).
        #[arg(long)]
        duration_ms: Option<u64>,
    },
    /// Steady load while busy workers are killed; checks nothing is lost (see `soak.rs`).
    Soak(crate::cli::soak::SoakOptions),
    /// Clear a fault by id.
    Clear {
        /// Fault id.
        id: u64,
    },
}

fn target(t: &str) -> serde_json::Value {
    if t == "any_busy" {
        serde_json::json!("any_busy")
    } else if let Some(n) = t.strip_prefix("node:") {
        serde_json::json!({ "node": n })
    } else {
        serde_json::json!({ "worker": t.strip_prefix("worker:").unwrap_or(t) })
    }
}

/// Run a chaos subcommand; prints the gateway's JSON answer.
///
/// # Errors
/// The gateway cannot be reached or answers with an error status; a soak that
/// cannot run or finds lost or changed requests.
pub async fn run(a: ChaosArgs) -> anyhow::Result<()> {
    let base = crate::cli::status::base_url(&a.gateway);
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(10))
        .build()?;
    let auth = |r: reqwest::RequestBuilder| match &a.token {
        Some(t) => r.bearer_auth(t),
        None => r,
    };
    let req = match &a.cmd {
        ChaosCmd::List => auth(client.get(format!("{base}/chaos/faults"))),
        ChaosCmd::Slow { target: t, delay_ms, duration_ms } => auth(client.post(format!("{base}/chaos/faults")))
            .json(&serde_json::json!({"kind": "slow", "delay_ms": delay_ms, "target": target(t), "duration_ms": duration_ms})),
        ChaosCmd::FailEngine { target: t, after_steps, duration_ms } => auth(client.post(format!("{base}/chaos/faults")))
            .json(&serde_json::json!({"kind": "fail_engine", "after_steps": after_steps, "target": target(t), "duration_ms": duration_ms})),
        ChaosCmd::Kill { target: t, actor } => auth(client.post(format!("{base}/chaos/faults")))
            .json(&serde_json::json!({"kind": "kill_actor", "actor": actor, "target": target(t)})),
        ChaosCmd::KillNode { target: t } => auth(client.post(format!("{base}/chaos/faults")))
            .json(&serde_json::json!({"kind": "kill_node", "target": target(t)})),
        ChaosCmd::Hang { target: t, duration_ms } => auth(client.post(format!("{base}/chaos/faults")))
            .json(&serde_json::json!({"kind": "hang", "target": target(t), "duration_ms": duration_ms})),
        ChaosCmd::Clear { id } => auth(client.delete(format!("{base}/chaos/faults/{id}"))),
        ChaosCmd::Soak(opts) => {
            let report = crate::cli::soak::run(&base, a.token.clone(), opts).await?;
            println!("{}", report.markdown());
            for f in &report.faults {
                println!(
                    "fault at {:>6} ms: {:<10} {:<24} back to capacity in {}",
                    f.at_ms,
                    f.kind,
                    f.hit.join(","),
                    f.back_to_capacity_ms.map_or("never".into(), |m| format!("{m} ms"))
                );
            }
            for p in &report.problems {
                println!("problem: {p}");
            }
            println!("SOAK_REPORT {}", serde_json::to_string(&report)?);
            if let Some(why) = report.failure() {
                anyhow::bail!("the soak failed: {why}");
            }
            return Ok(());
        }
    };
    let resp = req
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the gateway at {base}: {e}"))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
    println!("{}", serde_json::to_string_pretty(&body)?);
    anyhow::ensure!(status.is_success(), "the gateway answered {status}");
    Ok(())
}
