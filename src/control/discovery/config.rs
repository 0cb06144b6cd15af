//! The `[cluster]` section: membership, heartbeats and liveness, read by the node's Discovery
//! actor (through the membership table of `membership.rs`), its cluster server and `flotilla
//! sim` (the fleet view's refresh, the owners' grace).

use crate::runtime::config::ConfigError;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Membership, heartbeats and liveness.
///
/// A peer that has not been heard from for `suspect_after_ms` is *suspect* (still routed to);
/// after `liveness_timeout_ms` it is *down*: subscribers are told and its workers leave
/// routing. With the defaults a killed node is declared down at most 3 s + one heartbeat
/// interval after its last heartbeat.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Interval between heartbeats sent to every peer.
    pub heartbeat_interval_ms: u64,
    /// Silence after which a peer is suspect.
    pub suspect_after_ms: u64,
    /// Silence after which a peer is declared down (the liveness timeout).
    pub liveness_timeout_ms: u64,
    /// How long a down node stays listed (as `down`) in the fleet view.
    pub down_retention_ms: u64,
    /// How long a joining node keeps trying to reach its seeds before giving up.
    pub connect_timeout_ms: u64,
    /// Largest inbound cluster frame accepted (ractor_cluster's default is 16 MiB; a larger
    /// frame tears the session down, so every node must use the same value).
    pub max_frame_bytes: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 250,
            suspect_after_ms: 1_000,
            liveness_timeout_ms: 3_000,
            down_retention_ms: 60_000,
            connect_timeout_ms: 15_000,
            max_frame_bytes: 64 * 1024 * 1024,
        }
    }
}

impl ClusterConfig {
    /// Heartbeat interval.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    /// Check ranges and the order of the three silences.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first field (`cluster.<field>`) that is out of
    /// range or inconsistent with another.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.heartbeat_interval_ms == 0 {
            return Err(ConfigError::invalid(
                "cluster.heartbeat_interval_ms",
                "must be at least 1",
            ));
        }
        if self.suspect_after_ms <= self.heartbeat_interval_ms {
            return Err(ConfigError::invalid(
                "cluster.suspect_after_ms",
                format!(
                    "must exceed cluster.heartbeat_interval_ms ({} <= {})",
                    self.suspect_after_ms, self.heartbeat_interval_ms
                ),
            ));
        }
        if self.liveness_timeout_ms < self.suspect_after_ms {
            return Err(ConfigError::invalid(
                "cluster.liveness_timeout_ms",
                format!(
                    "must be at least cluster.suspect_after_ms ({} < {})",
                    self.liveness_timeout_ms, self.suspect_after_ms
                ),
            ));
        }
        if self.max_frame_bytes < 1024 * 1024 {
            return Err(ConfigError::invalid(
                "cluster.max_frame_bytes",
                "must be at least 1 MiB",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inconsistent_timeouts_name_the_field() {
        ClusterConfig::default().validate().unwrap();
        let c = ClusterConfig {
            liveness_timeout_ms: 10,
            ..Default::default()
        };
        let err = c.validate().unwrap_err();
        assert_eq!(err.field(), Some("cluster.liveness_timeout_ms"), "{err}");
        let c = ClusterConfig {
            suspect_after_ms: 250,
            ..Default::default()
        };
        let err = c.validate().unwrap_err();
        assert_eq!(err.field(), Some("cluster.suspect_after_ms"), "{err}");
    }
}
