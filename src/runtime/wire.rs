//! Payloads that cross node boundaries.
//!
//! `ractor_cluster` decodes a remote message inside the receiving actor, and
//! `BytesConvertable::from_bytes` cannot fail. So every remote message variant carries a
//! [`Wire<T>`]: opaque MessagePack bytes (`rmp-serde`, named fields so that adding fields stays
//! compatible) that the handler decodes with [`Wire::decode`], turning a malformed or
//! mismatched payload into a logged, counted error (`flotilla_wire_decode_errors_total`)
//! instead of a panic.

use serde::{Serialize, de::DeserializeOwned};
use std::marker::PhantomData;

/// A serialised `T` in transit between nodes.
#[derive(Debug, Clone)]
pub struct Wire<T> {
    bytes: Vec<u8>,
    _t: PhantomData<fn() -> T>,
}

/// A payload that could not be decoded.
#[derive(Debug, thiserror::Error)]
#[error("malformed {what} payload ({len} bytes): {source}")]
pub struct WireError {
    what: &'static str,
    len: usize,
    #[source]
    source: rmp_serde::decode::Error,
}

impl<T: Serialize + DeserializeOwned> Wire<T> {
    /// Encode `value`. Encoding our own types cannot fail short of a bug; such a bug yields an
    /// empty payload that the receiver reports as malformed.
    pub fn encode(value: &T) -> Self {
        let bytes = rmp_serde::to_vec_named(value).unwrap_or_else(|e| {
            tracing::error!(error = %e, "failed to encode wire payload");
            Vec::new()
        });
        Self {
            bytes,
            _t: PhantomData,
        }
    }

    /// Wrap raw bytes (as received, or for tests of malformed input).
    pub fn from_raw(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            _t: PhantomData,
        }
    }

    /// Decode the payload; on failure log it and count it once.
    ///
    /// # Errors
    /// [`WireError`] when the bytes are not a MessagePack encoding of `T` (a peer running
    /// another version, or a corrupted frame).
    pub fn decode(&self) -> Result<T, WireError> {
        rmp_serde::from_slice(&self.bytes).map_err(|source| {
            let what = std::any::type_name::<T>();
            metrics::counter!("flotilla_wire_decode_errors_total", "type" => what).increment(1);
            tracing::warn!(payload = what, len = self.bytes.len(), error = %source, "dropping malformed cluster payload");
            WireError {
                what,
                len: self.bytes.len(),
                source,
            }
        })
    }

    /// Size in bytes on the wire.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

impl<T: Send + 'static> ractor::BytesConvertable for Wire<T> {
    fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
    fn from_bytes(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            _t: PhantomData,
        }
    }
}
