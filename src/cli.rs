//! The command-line tools: one module per `flotilla` subcommand (`main.rs` parses the flags and
//! calls in here). This is where `anyhow` lives; the runtime below returns typed errors.
//! - `up.rs` — `flotilla up`: a local cluster of node processes, restarted on failure.
//! - `status.rs` — `flotilla status`: the fleet view from a gateway, once or `--watch`ed.
//! - `generate.rs` — `flotilla generate`: the engine in-process, no cluster.
//! - `chaos.rs` — `flotilla chaos`: a client of the gateway's chaos API.
//! - `config.rs` — `flotilla config --reference`: the configuration reference (every key, its
//!   type, default, unit and doc), generated from the configuration types.
//! - `bench/` — `flotilla bench`: replay a trace or dataset, report latency, goodput, prefix hits;
//!   a progress bar while it runs; charts of the latencies (`bench/charts.rs`, plotters).
//! - `plot.rs` — `flotilla plot`: runs (live and simulated) side by side on one figure.
//! - `profile.rs` — `flotilla profile`: time the CPU engine, write the sim engine's profile.
//! - `sim.rs` — `flotilla sim`: a workload on a simulated fleet (`crate::sim`), reported as `bench` does.
//! - `reconcile.rs` — `flotilla reconcile`: the planner's decisions applied to Kubernetes
//!   workloads (feature `kubernetes`).
//! - `soak.rs` — `flotilla chaos soak`: kills under load, then proof that nothing was lost.
//! - `transport.rs` — `flotilla transport`: a peer serving a KV region; the transfer benchmark.
//! - `client.rs` — the streaming OpenAI client the tools and tests share.
//! - `cuda.rs` — `flotilla cuda`: the CUDA libraries, kernels to PTX, GPU checks.

/// The gateway `flotilla status` and `flotilla chaos` talk to unless told otherwise
/// (`--gateway` or `FLOTILLA_GATEWAY`): `flotilla up`'s default address.
pub const DEFAULT_GATEWAY: &str = "http://127.0.0.1:8080";

/// Writes `text` to `out` (standard output) and flushes it; a reader that closed the pipe
/// early (`flotilla status --json | head`) is not an error: `println!` would panic there.
///
/// # Errors
/// Any other write error.
pub fn print_out(out: &mut impl std::io::Write, text: &str) -> std::io::Result<()> {
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}

/// Parses `--gateway` / `FLOTILLA_GATEWAY`: an empty value (`export FLOTILLA_GATEWAY=`) means
/// [`DEFAULT_GATEWAY`], as if unset, instead of an address ""; anything else is kept as given
/// (`host:port` or a URL), trimmed.
pub fn gateway_arg(s: &str) -> Result<String, std::convert::Infallible> {
    let s = s.trim();
    Ok(if s.is_empty() {
        DEFAULT_GATEWAY.to_string()
    } else {
        s.to_string()
    })
}

pub mod bench;
pub mod chaos;
pub mod client;
pub mod config;
pub mod cuda;
pub mod generate;
pub mod plot;
pub mod profile;
#[cfg(feature = "kubernetes")]
pub mod reconcile;
pub mod sim;
pub mod soak;
pub mod status;
pub mod transport;
pub mod up;

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        chaos: super::chaos::ChaosArgs,
    }

    /// A writer whose reader has gone, after `room` bytes.
    struct ClosedAfter {
        room: usize,
    }

    impl std::io::Write for ClosedAfter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_reader_that_stops_early_is_not_an_error() {
        let text = "line\n".repeat(1000);
        super::print_out(&mut ClosedAfter { room: 10 }, &text).expect("a closed pipe is fine");
        let mut all = Vec::new();
        super::print_out(&mut all, &text).expect("written");
        assert_eq!(all, text.as_bytes());
    }

    #[test]
    fn an_empty_gateway_means_the_default_one() {
        for (given, want) in [
            ("", super::DEFAULT_GATEWAY),
            ("  ", super::DEFAULT_GATEWAY),
            ("10.0.0.1:8080", "10.0.0.1:8080"),
            ("http://h:1 ", "http://h:1"),
        ] {
            let cli = Cli::try_parse_from(["flotilla", "--gateway", given, "list"])
                .unwrap_or_else(|e| panic!("{given:?}: {e}"));
            assert_eq!(cli.chaos.gateway, want, "{given:?}");
        }
    }
}
