//! The live fleet page (`GET /`) in headless Chromium, driven through WebDriver
//! (`chromedriver`, Debian's `chromium-driver`) against a live cluster of node processes
//! (`flotilla up --engine sim --chaos`): the page loads with no console errors and shows the
//! fleet's node and worker counts; in-flight counts rise under load; a fault injected from the
//! page's form shows up in `/chaos/faults` and clears from the page's button; a worker node
//! killed through the chaos API turns down on the page within the liveness bound. Screenshots
//! (idle, under load, during a fault) are written to `$CARGO_TARGET_TMPDIR/fleet-page/`, or to
//! `FLOTILLA_SCREENSHOTS` when set.
//!
//! Without `chromedriver` and `chromium` the test says so and passes, unless
//! `FLOTILLA_REQUIRE_CHROMIUM=1` (`make test` sets it, after `scripts/deps.sh` installed them).

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::http::MODEL;
use crate::poll::poll_until;
use crate::process::Cluster;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The cluster's liveness timeout (ms, the default `cluster.liveness_timeout_ms`).
const LIVENESS_MS: u64 = 3_000;

/// Where Debian puts them.
fn browser_paths() -> Option<(PathBuf, PathBuf)> {
    let driver = std::env::var_os("FLOTILLA_CHROMEDRIVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromedriver"));
    let chrome = std::env::var_os("FLOTILLA_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    (driver.exists() && chrome.exists()).then_some((driver, chrome))
}

/// `chromedriver` on a free port, killed on drop.
struct Driver {
    child: std::process::Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_driver(path: &Path) -> Driver {
    let port = poll::free_port();
    let child = std::process::Command::new(path)
        .arg(format!("--port={port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("chromedriver starts");
    let url = format!("http://127.0.0.1:{port}");
    let status = format!("{url}/status");
    poll_until(Duration::from_secs(30), "chromedriver ready", || async {
        let r = reqwest::get(&status).await.ok()?;
        let v: Value = r.json().await.ok()?;
        (v["value"]["ready"] == true).then_some(())
    })
    .await;
    Driver { child, url }
}

async fn browser(driver: &Driver, chrome: &Path, profile: &Path) -> Client {
    let caps = json!({
        "browserName": "chrome",
        "goog:chromeOptions": {
            "binary": chrome,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1400,1100",
                format!("--user-data-dir={}", profile.display()),
            ],
        },
        "goog:loggingPrefs": {"browser": "ALL"},
    });
    let serde_json::Value::Object(caps) = caps else {
        unreachable!()
    };
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a Chromium session")
}

/// Chromium's console log since the last call (chromedriver's `se/log`, type `browser`).
#[derive(Debug)]
struct BrowserLog;

impl fantoccini::wd::WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base: &url::Url,
        session: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base.join(&format!("session/{}/se/log", session.unwrap_or_default()))
    }
    fn method_and_body(&self, _: &url::Url) -> (::http::Method, Option<String>) {
        (::http::Method::POST, Some(r#"{"type":"browser"}"#.into()))
    }
}

/// The console entries at level SEVERE (errors, failed loads, uncaught exceptions).
async fn console_errors(c: &Client) -> Vec<Value> {
    let log = c.issue_cmd(BrowserLog).await.expect("browser log");
    log.as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["level"] == "SEVERE")
        .cloned()
        .collect()
}

/// Evaluate `expr` in the page.
async fn eval(c: &Client, expr: &str) -> Value {
    c.execute(&format!("return {expr};"), vec![])
        .await
        .unwrap_or(Value::Null)
}

async fn text(c: &Client, id: &str) -> String {
    eval(c, &format!("document.getElementById('{id}').textContent"))
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn screenshot(c: &Client, dir: &Path, name: &str) {
    let png = c.screenshot().await.expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let path = dir.join(name);
    std::fs::write(&path, png).expect("screenshot written");
    eprintln!("screenshot: {}", path.display());
}

async fn chaos(c: &Cluster, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
    let mut r = reqwest::Client::new().request(method, c.url(path));
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await.expect("chaos API answers");
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.json().await.expect("json")
}

async fn active_faults(c: &Cluster) -> Vec<Value> {
    let v = chaos(c, reqwest::Method::GET, "/chaos/faults", None).await;
    v["faults"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["active"] == true)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_page_follows_a_live_cluster_under_load_and_chaos() {
    let Some((driver_path, chrome)) = browser_paths() else {
        assert!(
            std::env::var("FLOTILLA_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "FLOTILLA_REQUIRE_CHROMIUM=1 but /usr/bin/chromedriver or /usr/bin/chromium is \
             missing (scripts/deps.sh installs Debian's chromium and chromium-driver)"
        );
        eprintln!(
            "skipped: no chromedriver/chromium (Debian: apt-get install chromium chromium-driver)"
        );
        return;
    };
    let shots = std::env::var_os("FLOTILLA_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_TARGET_TMPDIR")).join("fleet-page"));
    std::fs::create_dir_all(&shots).expect("screenshot folder");
    let profile = tempfile::tempdir().expect("a profile folder");

    // A gateway + router node and two simulated worker nodes; a dead node stays dead.
    let cluster = Cluster::start_with(3, &["--engine", "sim", "--chaos", "--no-restart"], &[]);
    http::wait_routable(&cluster, 2).await;
    let fleet = http::fleet(&cluster).await;
    let nodes = fleet["nodes"].as_array().map_or(0, Vec::len);
    let workers: Vec<String> = fleet["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|n| n["workers"].as_array().cloned().unwrap_or_default())
        .filter_map(|w| w["id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!((nodes, workers.len()), (3, 2), "{fleet}");

    let driver = start_driver(&driver_path).await;
    let c = browser(&driver, &chrome, profile.path()).await;
    c.goto(&cluster.url("/")).await.expect("the page loads");

    // Idle: the counts of the fleet.
    poll_until(
        Duration::from_secs(20),
        "the page shows the fleet",
        || async {
            let live = eval(&c, "document.getElementById('conn').dataset.state").await == "open";
            let n = text(&c, "nodes-total").await;
            let w = text(&c, "workers-total").await;
            let rows = eval(&c, "document.querySelectorAll('#workers tbody tr').length").await;
            (live && n == "3" && w == "2" && rows == 2).then_some(())
        },
    )
    .await;
    assert_eq!(text(&c, "nodes-up").await, "3");
    assert_eq!(text(&c, "workers-ready").await, "2");
    // The restarts card counts actor and node restarts, and says how many of each.
    assert_eq!(text(&c, "restarts").await, "0");
    assert_eq!(
        eval(&c, "document.getElementById('restarts').title").await,
        "0 actor restarts, 0 node restarts"
    );
    assert_eq!(
        eval(&c, "document.getElementById('chaos-section').hidden").await,
        false,
        "the chaos panel shows when the API is on"
    );
    screenshot(&c, &shots, "fleet-idle.png").await;
    let errors = console_errors(&c).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");

    // Under load: long streams keep requests in flight; the page shows them and the
    // placements (with the router's cost terms) as they happen.
    let load_until = Instant::now() + Duration::from_secs(600);
    let mut load = Vec::new();
    for i in 0..12 {
        let url = cluster.url("/v1/completions");
        load.push(tokio::spawn(async move {
            let http = reqwest::Client::new();
            while Instant::now() < load_until {
                let body = json!({"model": MODEL, "prompt": format!("load {i}: tell a long story"),
                                  "max_tokens": 400, "ignore_eos": true, "stream": true});
                if let Ok(r) = http.post(&url).json(&body).send().await {
                    let _ = r.text().await;
                }
            }
        }));
    }
    poll_until(
        Duration::from_secs(30),
        "in-flight requests on the page",
        || async {
            let n: u64 = text(&c, "in-flight").await.parse().unwrap_or(0);
            let placed = eval(
                &c,
                "document.querySelectorAll('#decisions tbody tr').length",
            )
            .await;
            (n > 0 && placed.as_u64().unwrap_or(0) > 0).then_some(n)
        },
    )
    .await;
    let cost = eval(
        &c,
        "document.querySelector('#decisions tbody tr td:last-child').textContent",
    )
    .await;
    assert!(
        cost.as_str().is_some_and(|s| s.parse::<f64>().is_ok()),
        "a placement shows its cost: {cost}"
    );
    // For the screenshots in docs/: more time under load fills the charts.
    if let Some(s) = std::env::var("FLOTILLA_PAGE_LOAD_S")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        tokio::time::sleep(Duration::from_secs(s)).await;
    }
    screenshot(&c, &shots, "fleet-load.png").await;

    // A fault injected from the page: slow steps on the first worker.
    let target = format!("worker:{}", workers[0]);
    c.find(Locator::Css("#chaos-kind"))
        .await
        .expect("kind")
        .select_by_value("slow")
        .await
        .expect("slow");
    c.find(Locator::Css("#chaos-target"))
        .await
        .expect("target")
        .select_by_value(&target)
        .await
        .expect("the worker is listed");
    c.find(Locator::Css("#chaos-inject"))
        .await
        .expect("inject")
        .click()
        .await
        .expect("click");
    let fault = poll_until(
        Duration::from_secs(20),
        "the fault in /chaos/faults",
        || async { active_faults(&cluster).await.into_iter().next() },
    )
    .await;
    assert_eq!(fault["spec"]["kind"], "slow", "{fault}");
    assert_eq!(fault["hit"][0], workers[0].as_str(), "{fault}");
    let id = fault["id"].as_u64().expect("fault id");
    let row = format!("#faults tr[data-fault='{id}'] button.clear");
    poll_until(Duration::from_secs(20), "the fault on the page", || async {
        c.find(Locator::Css(&row)).await.ok()
    })
    .await;
    // The fault was installed by the worker's node: its event reaches this gateway's page
    // (relayed by Discovery), naming that node.
    let installed = poll_until(Duration::from_secs(20), "the fault's event on the page", || async {
        let v = eval(&c, "[...document.querySelectorAll('#events li[data-event=fault_installed]')].map(e => e.textContent).join('|')").await;
        v.as_str().filter(|s| !s.is_empty()).map(str::to_owned)
    })
    .await;
    let worker_node = workers[0].split('/').next().expect("node");
    assert!(
        installed.contains(&format!("on {worker_node}")),
        "{installed}"
    );
    screenshot(&c, &shots, "fleet-fault.png").await;
    c.find(Locator::Css(&row))
        .await
        .expect("clear button")
        .click()
        .await
        .expect("click");
    poll_until(Duration::from_secs(20), "the fault cleared", || async {
        active_faults(&cluster).await.is_empty().then_some(())
    })
    .await;
    poll_until(
        Duration::from_secs(20),
        "the page shows no fault",
        || async {
            let rows = eval(&c, "document.querySelectorAll('#faults tbody tr').length").await;
            (rows == 0).then_some(())
        },
    )
    .await;

    // A worker node killed through the chaos API turns down on the page within the liveness
    // bound (plus a heartbeat, a page frame and room for a busy machine).
    let victim = workers[1].split('/').next().expect("node").to_owned();
    chaos(
        &cluster,
        reqwest::Method::POST,
        "/chaos/faults",
        Some(json!({"kind": "kill_node", "target": {"node": victim}})),
    )
    .await;
    let t0 = Instant::now();
    let sel = format!("#nodes tr[data-node='{victim}']");
    poll_until(
        Duration::from_millis(LIVENESS_MS + 12_000),
        "the killed node down on the page",
        || async {
            let state = eval(
                &c,
                &format!("(document.querySelector(\"{sel}\") || {{dataset: {{}}}}).dataset.state"),
            )
            .await;
            (state == "down").then_some(())
        },
    )
    .await;
    let took = t0.elapsed();
    eprintln!(
        "killed node {victim} down on the page after {} ms (liveness timeout {LIVENESS_MS} ms)",
        took.as_millis()
    );
    let health = eval(
        &c,
        &format!(
            "document.querySelector(\"#workers tr[data-worker='{}']\").dataset.health",
            workers[1]
        ),
    )
    .await;
    assert_eq!(health, "unreachable", "its worker is shown unreachable");
    // A page loaded now starts with the recent past: the fault installed earlier is in its
    // event log at once (replayed from the gateway's history: no fault comes after the reload).
    c.goto(&cluster.url("/")).await.expect("the page reloads");
    poll_until(
        Duration::from_secs(10),
        "the earlier fault in a fresh page's event log",
        || async {
            let n = eval(
                &c,
                "document.querySelectorAll('#events li[data-event=fault_installed]').length",
            )
            .await;
            (n.as_u64().unwrap_or(0) >= 1).then_some(())
        },
    )
    .await;
    let errors = console_errors(&c).await;
    assert!(errors.is_empty(), "console errors: {errors:?}");
    for l in load {
        l.abort();
    }
    let _ = c.close().await;
}
