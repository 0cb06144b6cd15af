//! `flotilla sim` as a user runs it: a bundled trace on a simulated fleet, written out twice
//! in two processes with the same bytes; bad input refused with the flag named.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn sim(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("sim")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run flotilla sim")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A JSON file of an output folder.
fn json(dir: &std::path::Path, file: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join(file)).unwrap()).unwrap()
}

/// The lines of an output folder's `requests.jsonl`.
fn requests(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Two runs wrote the same bytes.
fn same_outputs(a: &std::path::Path, b: &std::path::Path) {
    for file in ["report.json", "requests.jsonl", "fleet_events.jsonl"] {
        let (x, y) = (
            std::fs::read(a.join(file)).unwrap(),
            std::fs::read(b.join(file)).unwrap(),
        );
        assert!(!x.is_empty(), "{file} is empty");
        assert!(x == y, "{file} differs between two runs");
    }
}

#[test]
fn a_trace_replays_the_same_in_two_processes() {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    for d in &dirs {
        let o = sim(&[
            "--dataset",
            "mooncake-conversation",
            "--max-requests",
            "120",
            "--speedup",
            "20",
            "--workers",
            "8",
            "--kill",
            "2:3",
            "--slow",
            "1-3:1:20",
            "--hang",
            "4-6:2",
            "--out",
            d.path().to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let out = text(&o);
        assert!(
            out.contains("| mooncake_conversation_trace | 120 | 0 |"),
            "{out}"
        );
    }
    same_outputs(dirs[0].path(), dirs[1].path());
    let sim: serde_json::Value = json(dirs[0].path(), "sim.json");
    assert_eq!(sim[0]["counters"]["kills"], 1);
    assert_eq!(sim[0]["leftovers"]["unfinished"], 0);
    assert_eq!(sim[0]["leftovers"]["pinned_blocks"], 0);
}

#[test]
fn impossible_fleets_and_bad_flags_are_refused_by_name() {
    let cases: [(&[&str], &str); 25] = [
        (&["--kill-rate", "1e12", "--turns", "1"], "kill rate draws"),
        (&["--kill-rate=-1"], "--kill-rate"),
        (&["--kill-rate", "3", "--arrival", "fixed"], "open-loop"),
        (&["--hang-rate", "6"], "--hang-rate"),
        (&["--hang-rate", "6:0"], "--hang-rate"),
        (&["--slow-rate", "6:1"], "--slow-rate"),
        (&["--compare", "kill_rate=1,x"], "--compare kill_rate=x"),
        (&["--hang", "5:0"], "--hang"),
        (&["--slow", "1-2:0"], "--slow"),
        (&["--workers", "4", "--hang", "1-2:9"], "--hang …:9"),
        (&["--workers", "0"], "--workers"),
        (&["--prefill", "2", "--decode", "0"], "--decode"),
        (&["--workers", "4", "--kill", "1:9"], "--kill …:9"),
        (&["--kill", "soon:1"], "--kill"),
        (&["--kill", "1e300:0"], "--kill"),
        (&["--drop-kv-events", "3-1"], "--drop-kv-events"),
        (&["--net-delay-ms", "1e300"], "--net-delay-ms"),
        (&["--set", "worker.kv_blocks=0"], "worker.kv_blocks"),
        (&["--set", "worker.sim_speedup=0"], "worker.sim_speedup"),
        (
            &["--turns", "1", "--arrival", "poisson", "--rate", "1e-300"],
            "arrives at",
        ),
        (
            &[
                "--compare",
                "workers=2,4",
                "--prefill",
                "1",
                "--decode",
                "1",
            ],
            "--compare workers",
        ),
        (
            &[
                "--planner",
                "on",
                "--set",
                "planner.aggregated.max=2",
                "--set",
                "planner.aggregated.min=9",
            ],
            "planner.aggregated.min",
        ),
        (
            &["--compare", "planner=on,sometimes"],
            "--compare planner=sometimes",
        ),
        (
            &["--planner", "oracle", "--arrival", "fixed"],
            "--planner oracle",
        ),
        (
            &["--compare", "worker.sim_speedup=1,0"],
            "worker.sim_speedup",
        ),
    ];
    for (args, named) in cases {
        let mut all = vec!["--dataset", "synthetic-sessions", "--max-requests", "4"];
        all.extend_from_slice(args);
        let o = sim(&all);
        assert!(!o.status.success(), "{args:?} was accepted");
        assert!(text(&o).contains(named), "{args:?}: {}", text(&o));
        assert!(!text(&o).contains("panicked"), "{args:?}: {}", text(&o));
        assert!(
            !text(&o).contains("| run |"),
            "{args:?} ran before it was refused"
        );
    }
}

#[test]
fn a_malformed_trace_line_is_named_or_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.jsonl");
    std::fs::write(
        &p,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 10, \"input_length\": oops}\n\
         {\"timestamp\": 20, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 3]}\n",
    )
    .unwrap();
    let o = sim(&["--trace", p.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("line 2"), "{}", text(&o));
    let out = dir.path().join("out");
    let o = sim(&[
        "--trace",
        p.to_str().unwrap(),
        "--skip-bad-lines",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("skipped 1 malformed trace line (--skip-bad-lines): line 2:"),
        "{}",
        text(&o)
    );
    let report: serde_json::Value = json(&out, "report.json");
    assert_eq!(report[0]["workload"]["skipped_lines"], 1, "{report}");
    assert_eq!(report[0]["requests"], 2, "{report}");
}

/// A chat workload (ShareGPT's format) is rendered through the model's chat template and
/// tokenizer, as the gateway renders it: a conversation's second turn repeats its first
/// (system, user, answer), so it hits the prefix cache.
#[test]
fn a_chat_workload_is_rendered_through_the_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("sharegpt.json");
    let conv = |i: usize| {
        serde_json::json!({
            "id": format!("c{i}"),
            "conversations": [
                {"from": "human", "value": format!("Conversation {i}: tell me about sailing ships and how their rigging works, in detail, please.")},
                {"from": "gpt", "value": "Square rig, fore-and-aft rig, stays and shrouds hold the masts; halyards raise the sails and sheets trim them."},
                {"from": "human", "value": "And the flotilla?"},
                {"from": "gpt", "value": "A small fleet of ships sailing together."},
            ]
        })
    };
    let data = serde_json::Value::Array((0..4).map(conv).collect());
    std::fs::write(&p, data.to_string()).unwrap();
    let out = dir.path().join("out");
    let o = sim(&[
        "--dataset",
        "sharegpt",
        "--dataset-path",
        p.to_str().unwrap(),
        "--workers",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = json(&out, "report.json");
    assert_eq!(report[0]["requests"], 8, "{report}");
    assert_eq!(report[0]["errors"], 0, "{report}");
    let lines: Vec<serde_json::Value> = requests(&out);
    for session in 0..4 {
        let turn = |k: u64| {
            lines
                .iter()
                .find(|r| r["session"] == session && r["turn"] == k)
                .unwrap_or_else(|| panic!("session {session} turn {k}: {lines:?}"))
        };
        let (first, second) = (turn(0), turn(1));
        // The template's role markers and the salted system message come with the text.
        assert!(first["prompt_tokens"].as_u64().unwrap() > 30, "{first}");
        assert!(
            second["prompt_tokens"].as_u64() > first["prompt_tokens"].as_u64(),
            "{first} {second}"
        );
        assert!(second["cached_tokens"].as_u64().unwrap() >= 16, "{second}");
    }
}

/// Faults drawn at a rate from the seed: the same seed, the same faults and bytes; every
/// request still ends exactly once, and the sweep's kills grow with the rate.
#[test]
fn faults_at_rates_repeat_from_the_seed_and_nothing_is_lost() {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    for d in &dirs {
        let o = sim(&[
            "--dataset",
            "mooncake-conversation",
            "--max-requests",
            "300",
            "--speedup",
            "10",
            "--workers",
            "6",
            "--restart-ms",
            "500",
            "--hang-rate",
            "20:1",
            "--slow-rate",
            "20:2:30",
            "--drop-kv-events-rate",
            "120:5",
            "--compare",
            "kill_rate=0,600",
            "--out",
            d.path().to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            text(&o).contains("faults drawn at the given rates"),
            "{}",
            text(&o)
        );
    }
    same_outputs(dirs[0].path(), dirs[1].path());
    let sim: serde_json::Value = json(dirs[0].path(), "sim.json");
    let report: serde_json::Value = json(dirs[0].path(), "report.json");
    assert_eq!(sim[0]["counters"]["kills"], 0, "{sim}");
    assert!(sim[1]["counters"]["kills"].as_u64().unwrap() >= 3, "{sim}");
    assert!(
        sim[1]["counters"]["migrations"].as_u64().unwrap() >= 1,
        "{sim}"
    );
    for (run, r) in sim.as_array().unwrap().iter().enumerate() {
        assert_eq!(r["leftovers"]["unfinished"], 0, "{r}");
        assert_eq!(r["leftovers"]["pinned_blocks"], 0, "{r}");
        assert_eq!(report[run]["requests"], 300, "{report}");
    }
}

#[test]
fn a_planner_run_writes_its_decisions_and_costs() {
    let d = tempfile::tempdir().unwrap();
    let o = sim(&[
        "--dataset",
        "azure-conv",
        "--max-requests",
        "400",
        "--speedup",
        "10",
        "--workers",
        "2",
        "--compare",
        "planner=peak,on",
        "--set",
        "planner.interval_s=1",
        "--cold-start-ms",
        "2000",
        "--out",
        d.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("| planner=on |"), "{out}");
    assert!(out.contains("cost / M tokens in SLO"), "{out}");
    let decisions = std::fs::read_to_string(d.path().join("planner.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(decisions.lines().next().unwrap()).unwrap();
    assert_eq!(first["run"], "planner=on");
    let pool = &first["decision"]["pools"][0];
    assert_eq!(pool["role"], "aggregated");
    assert!(pool["reason"].as_str().unwrap().contains("req/s"), "{pool}");
    let sim: serde_json::Value = json(d.path(), "sim.json");
    let on = &sim[1]["planner"];
    assert!(on["decisions"].as_u64().unwrap() > 10, "{on}");
    assert!(on["replica_seconds"].as_f64().unwrap() > 0.0, "{on}");
    assert!(on["cost_per_million_in_slo"].as_f64().is_some(), "{on}");
}

/// A fleet deployed at zero: the planner starts the first replica for the first requests,
/// which wait for it, takes the pool back to zero when idle, and starts one again for a late
/// request.
#[test]
fn a_fleet_can_start_at_zero_under_a_planner() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("gap.jsonl");
    std::fs::write(
        &p,
        "{\"timestamp\": 0, \"input_length\": 500, \"output_length\": 50, \"hash_ids\": [1]}\n\
         {\"timestamp\": 200, \"input_length\": 500, \"output_length\": 50, \"hash_ids\": [2]}\n\
         {\"timestamp\": 60000, \"input_length\": 500, \"output_length\": 50, \"hash_ids\": [3]}\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let o = sim(&[
        "--trace",
        p.to_str().unwrap(),
        "--workers",
        "0",
        "--planner",
        "on",
        "--set",
        "planner.aggregated.min=0",
        "--set",
        "planner.idle_to_zero_s=5",
        "--set",
        "planner.interval_s=1",
        "--cold-start-ms",
        "2000",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines: Vec<serde_json::Value> = requests(&out);
    assert_eq!(lines.len(), 3);
    for r in &lines {
        assert_eq!(r["ok"], true, "{r}");
        // Each waited for a replica to start: the cold start (2 s) at least.
        let ttft = r["ttft_ms"].as_f64().unwrap();
        assert!((2_000.0..4_500.0).contains(&ttft), "{r}");
    }
}
