//! Loopback ports for the nodes a launcher starts (`flotilla up`, the tests).
//!
//! A launcher picks a node's ports before the node runs, so it must release them before the
//! node binds them. A port found by binding port 0 comes from the kernel's ephemeral range,
//! and the kernel hands a released port out again: to the next `bind(…:0)` (a gateway asked
//! for `127.0.0.1:0`) or to an outgoing connection's local end. CI saw exactly that: node-0's
//! gateway took the cluster port `up` had picked for node-1, and the cluster never formed.
//! So ports are picked **outside** the ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`; Linux's default is 32768–60999), from which the
//! kernel never chooses by itself. What is left is two launchers picking the same port at the
//! same moment; a node that then cannot bind exits with [`PORT_TAKEN_EXIT`], and `up` starts
//! the cluster again on new ports.

use rand::Rng;
use std::net::TcpListener;

/// Exit status of `flotilla node` when a port it was told to bind (cluster, KV transport) is
/// taken: `up` picked the port and may pick another. (2 is every other start-up error.)
pub const PORT_TAKEN_EXIT: u8 = 3;

/// Lowest port picked: above the registered ports most local services use.
const LOWEST: u16 = 20_000;

/// The kernel's ephemeral port range, inclusive (Linux's default when it cannot be read).
#[must_use]
pub fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(str::parse::<u16>);
            Some((it.next()?.ok()?, it.next()?.ok()?))
        })
        .unwrap_or((32_768, 60_999))
}

/// The ranges outside the ephemeral range that ports are drawn from, inclusive.
fn pick_ranges((lo, hi): (u16, u16)) -> Vec<(u16, u16)> {
    let mut out = Vec::new();
    if lo > LOWEST {
        out.push((LOWEST, lo - 1));
    }
    if hi < u16::MAX {
        out.push((hi.saturating_add(1).max(LOWEST), u16::MAX));
    }
    out.retain(|(a, b)| a <= b);
    out
}

/// `n` distinct free loopback ports outside the ephemeral range, each held until all are
/// picked (so they differ), then released for the nodes to bind. Where the ephemeral range
/// leaves fewer than 1024 ports outside it, the kernel picks (port 0) instead.
///
/// # Errors
/// Binding a loopback socket fails (no network stack), or no free port is found.
pub fn free_loopback_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let ranges = pick_ranges(ephemeral_range());
    let size: u32 = ranges.iter().map(|(a, b)| u32::from(b - a) + 1).sum();
    let mut held: Vec<TcpListener> = Vec::with_capacity(n);
    if size < 1024 {
        for _ in 0..n {
            held.push(TcpListener::bind("127.0.0.1:0")?);
        }
    } else {
        let mut rng = rand::rng();
        let mut tries = 0;
        while held.len() < n {
            tries += 1;
            if tries > 64 * n + 1024 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrNotAvailable,
                    "no free loopback port outside the ephemeral range",
                ));
            }
            let mut k = rng.random_range(0..size);
            let mut port = 0;
            for (a, b) in &ranges {
                let len = u32::from(b - a) + 1;
                if k < len {
                    port = a + k as u16;
                    break;
                }
                k -= len;
            }
            // A port held already fails to bind, so the ports differ.
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                held.push(l);
            }
        }
    }
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_free_and_outside_the_ephemeral_range() {
        let (lo, hi) = ephemeral_range();
        let ports = free_loopback_ports(32).unwrap();
        let set: std::collections::HashSet<_> = ports.iter().collect();
        assert_eq!(set.len(), 32);
        for p in ports {
            assert!(!(lo..=hi).contains(&p), "{p} in {lo}-{hi}");
            assert!(p >= LOWEST);
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }

    #[test]
    fn ranges_leave_the_ephemeral_range_out() {
        assert_eq!(
            pick_ranges((32_768, 60_999)),
            vec![(20_000, 32_767), (61_000, 65_535)]
        );
        assert_eq!(pick_ranges((1024, 65_535)), vec![]);
        assert_eq!(pick_ranges((10_000, 60_999)), vec![(61_000, 65_535)]);
    }
}
