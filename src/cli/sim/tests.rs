use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    sim: super::SimArgs,
}

#[test]
fn an_empty_fleet_is_refused_before_the_trace_is_read() {
    // Not a trace at all: reading it first would fail on the trace, not on the fleet.
    let not_a_trace = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let cli =
        Cli::try_parse_from(["sim", "--trace", not_a_trace, "--workers", "0"]).expect("flags");
    let e = super::run(cli.sim).expect_err("a fleet without workers");
    let msg = format!("{e:#}");
    assert!(
        msg.contains("--workers: the fleet needs at least one worker"),
        "{msg}"
    );
}
