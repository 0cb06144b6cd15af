//! ZMQ transport of vLLM-format KV events (`kv/vllm.rs`): a PUB socket a replica publishes
//! on (`worker.kv_events_endpoint`), and the SUB side that reads one (tests, and routers that
//! follow external engines).
//!
//! Frames per message, as vLLM's `ZmqEventPublisher` sends them: `[topic, sequence number (8
//! bytes big-endian, from 0), payload]`. A PUB socket drops messages nobody subscribed to, and
//! a subscriber that connects late misses what came before: vLLM offers a replay socket for
//! that (not built here); a Flotilla router resynchronises from snapshots instead.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::vllm::{VllmBatch, WireError, decode_batch, encode_batch_as};

/// How long a re-bind of the same port is retried (the previous socket of a restarted replica
/// may still be closing).
pub const REBIND_FOR: Duration = Duration::from_secs(2);

/// A ZMQ PUB socket publishing vLLM-format batches; its sender task ends (and the port is
/// released) when this is dropped.
pub struct ZmqPublisher {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

/// A ZMQ publisher or subscriber failed to start.
#[derive(Debug, thiserror::Error)]
pub enum ZmqError {
    /// The port could not be bound.
    #[error("cannot bind the KV event socket on {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// The socket library refused.
    #[error("KV event socket: {0}")]
    Socket(String),
    /// A message that is not a vLLM KV event batch.
    #[error("KV event message: {0}")]
    Message(String),
    /// A payload that did not decode.
    #[error(transparent)]
    Wire(#[from] WireError),
}

impl ZmqPublisher {
    /// Bind `addr` (port 0: any free port) and start publishing with `topic`.
    ///
    /// # Errors
    /// [`ZmqError::Bind`] when the port stays taken for [`REBIND_FOR`].
    pub async fn bind(addr: SocketAddr, topic: &str) -> Result<Self, ZmqError> {
        let deadline = tokio::time::Instant::now() + REBIND_FOR;
        let listener = loop {
            match std::net::TcpListener::bind(addr) {
                Ok(l) => break l,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(ZmqError::Bind { addr, source: e });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let bound = listener
            .local_addr()
            .map_err(|e| ZmqError::Bind { addr, source: e })?;
        let mut socket = zeromq::PubSocket::new();
        socket
            .bind_listener(listener)
            .await
            .map_err(|e| ZmqError::Socket(e.to_string()))?;
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let task = tokio::spawn(async move {
            let mut seq: u64 = 0;
            while let Some(payload) = rx.recv().await {
                let frames = vec![
                    topic.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(payload),
                ];
                seq += 1;
                let Ok(msg) = ZmqMessage::try_from(frames) else {
                    continue;
                };
                if let Err(e) = socket.send(msg).await {
                    metrics::counter!("flotilla_kv_zmq_send_errors_total").increment(1);
                    tracing::debug!(error = %e, "KV event publish failed");
                }
            }
        });
        Ok(Self {
            tx,
            addr: bound,
            task,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The endpoint a subscriber connects to (`tcp://host:port`).
    pub fn endpoint(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    /// Queue one batch (sent in order; never blocks), events as maps.
    pub fn publish(&self, batch: &VllmBatch) {
        self.publish_as(batch, super::vllm::EventLayout::Map);
    }

    /// Queue one batch with events in `layout`.
    pub fn publish_as(&self, batch: &VllmBatch, layout: super::vllm::EventLayout) {
        let _ = self.tx.send(encode_batch_as(batch, layout));
    }
}

impl Drop for ZmqPublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A ZMQ SUB socket reading vLLM-format batches from one publisher.
pub struct ZmqSubscriber {
    socket: zeromq::SubSocket,
}

impl ZmqSubscriber {
    /// Connect to `endpoint` (`tcp://host:port`) and subscribe to every topic.
    ///
    /// # Errors
    /// [`ZmqError::Socket`] when the endpoint is malformed or does not answer.
    pub async fn connect(endpoint: &str) -> Result<Self, ZmqError> {
        let mut socket = zeromq::SubSocket::new();
        socket
            .connect(endpoint)
            .await
            .map_err(|e| ZmqError::Socket(e.to_string()))?;
        socket
            .subscribe("")
            .await
            .map_err(|e| ZmqError::Socket(e.to_string()))?;
        Ok(Self { socket })
    }

    /// The next message: its sequence number and batch.
    ///
    /// # Errors
    /// The socket failed, or the message is not `[topic, seq, payload]` with a decodable
    /// payload (the next call reads the next message).
    pub async fn next(&mut self) -> Result<(u64, VllmBatch), ZmqError> {
        let msg = self
            .socket
            .recv()
            .await
            .map_err(|e| ZmqError::Socket(e.to_string()))?;
        let frames = msg.into_vec();
        let [_, seq, payload] = frames.as_slice() else {
            return Err(ZmqError::Message(format!(
                "{} frames, expected 3",
                frames.len()
            )));
        };
        let seq: [u8; 8] = seq[..]
            .try_into()
            .map_err(|_| ZmqError::Message("sequence frame is not 8 bytes".into()))?;
        Ok((u64::from_be_bytes(seq), decode_batch(payload)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::vllm::VllmEvent;

    #[tokio::test]
    async fn a_subscriber_reads_what_is_published_in_order_with_sequence_numbers() {
        let publisher = ZmqPublisher::bind("127.0.0.1:0".parse().unwrap(), "")
            .await
            .unwrap();
        let mut sub = ZmqSubscriber::connect(&publisher.endpoint()).await.unwrap();
        // PUB drops what is sent before the subscription arrives: publish until heard.
        let batch = |n: u64| VllmBatch {
            ts: n as f64,
            events: vec![VllmEvent::BlockRemoved {
                block_hashes: vec![n],
                medium: None,
            }],
            data_parallel_rank: Some(0),
        };
        let first = loop {
            publisher.publish(&batch(0));
            match tokio::time::timeout(Duration::from_millis(100), sub.next()).await {
                Ok(r) => break r.unwrap(),
                Err(_) => continue,
            }
        };
        for n in 1..=3 {
            publisher.publish(&batch(n));
        }
        let mut last = first.0;
        let mut seen = 0;
        while seen < 3 {
            let (seq, b) = sub.next().await.unwrap();
            if b.ts == 0.0 {
                last = seq; // a retry of the first batch still in flight
                continue;
            }
            assert_eq!(seq, last + 1);
            assert_eq!(b, batch(b.ts as u64));
            last = seq;
            seen += 1;
        }
        // Dropping the publisher frees its port for a restarted replica.
        let addr = publisher.addr();
        drop(publisher);
        ZmqPublisher::bind(addr, "").await.unwrap();
    }
}
