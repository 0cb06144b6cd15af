//! The TCP backend: KV reads over plain tokio sockets, for machines (or peers) without UCX.
//!
//! Every node serves its registered regions on one listener ([`TcpServer`]). A pull splits its
//! segments into requests of at most [`CHUNK_BYTES`] and keeps up to [`WINDOW`] of them in
//! flight on one connection (a writer and a reader run concurrently, so neither side can block
//! the other); the server answers in order.
//!
//! Wire format (all integers little-endian):
//! - request: `u32` length, then a MessagePack [`ReadRequest`];
//! - response: `u8` status; `0` = ok, followed by the requested bytes in request order;
//!   `1` = refused, followed by a `u32` length and a UTF-8 reason (a stale or unknown region, a
//!   range out of bounds). A refusal ends the connection.
//!
//! Received bytes go through a bounce buffer into the destination region
//! ([`KvMemory::write_from`]), never through a reference into it (see `kv/memory.rs`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::TransportError;
use super::{KvMemory, RegionId, Segment};

/// Largest request (bytes of segments) one read asks for.
pub const CHUNK_BYTES: u64 = 4 << 20;
/// Requests in flight per pull.
pub const WINDOW: usize = 8;
/// Largest request frame accepted by the server.
const MAX_REQUEST_FRAME: u32 = 16 << 20;

/// One read: these runs of that region.
#[derive(Debug, Serialize, Deserialize)]
pub struct ReadRequest {
    /// The region, with the epoch the reader believes current.
    pub region: RegionId,
    /// `(offset, len)` runs in the region.
    pub runs: Vec<(u64, u64)>,
}

/// Regions a server may serve, by owner: the epoch and the memory.
pub type ServedRegions = Arc<RwLock<HashMap<String, (u64, Arc<KvMemory>)>>>;

/// A node's TCP listener for KV reads.
#[derive(Debug)]
pub struct TcpServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl TcpServer {
    /// Binds `bind` (port 0 for any) and serves `regions` until dropped.
    ///
    /// # Errors
    /// [`TransportError::Backend`] when the address cannot be bound.
    pub async fn start(bind: &str, regions: ServedRegions) -> Result<Self, TransportError> {
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|e| TransportError::Bind {
                addr: bind.to_owned(),
                reason: e.to_string(),
                kind: e.kind(),
            })?;
        let addr = listener
            .local_addr()
            .map_err(|e| TransportError::Backend(format!("tcp transport: {e}")))?;
        let task = tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // E.g. out of file descriptors: back off instead of spinning.
                        tracing::warn!(error = %e, "tcp transport: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let regions = regions.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve(stream, regions).await {
                        tracing::debug!(error = %e, "tcp transport: connection ended");
                    }
                });
            }
        });
        Ok(Self { addr, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, regions: ServedRegions) -> std::io::Result<()> {
    let mut buf = Vec::new();
    loop {
        let len = match stream.read_u32_le().await {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        if len > MAX_REQUEST_FRAME {
            return refuse(&mut stream, "request frame too large").await;
        }
        let mut frame = vec![0; len as usize];
        stream.read_exact(&mut frame).await?;
        let req: ReadRequest = match rmp_serde::from_slice(&frame) {
            Ok(r) => r,
            Err(e) => return refuse(&mut stream, &format!("malformed request: {e}")).await,
        };
        let memory = {
            let map = regions.read().unwrap_or_else(|p| p.into_inner());
            match map.get(&req.region.owner) {
                Some((epoch, m)) if *epoch == req.region.epoch => Ok(m.clone()),
                Some((epoch, _)) => Err(format!(
                    "stale region {}: the owner's memory is now epoch {epoch}",
                    req.region
                )),
                None => Err(format!("unknown region {}", req.region)),
            }
        };
        let memory = match memory {
            Ok(m) => m,
            Err(reason) => return refuse(&mut stream, &reason).await,
        };
        // Every run inside the region, and no more than one chunk per request (what clients
        // send): a bad request must not make the server allocate without bound.
        let total = req.runs.iter().try_fold(0u64, |acc, &(offset, len)| {
            let end = offset.checked_add(len)?;
            (end <= memory.len() as u64).then_some(acc.checked_add(len)?)
        });
        let total = match total {
            Some(t) if t <= CHUNK_BYTES => t,
            Some(t) => {
                return refuse(
                    &mut stream,
                    &format!("{t} bytes asked at once (at most {CHUNK_BYTES})"),
                )
                .await;
            }
            None => return refuse(&mut stream, "a run leaves the region").await,
        };
        buf.clear();
        buf.resize(total as usize, 0);
        let mut at = 0usize;
        for &(offset, len) in &req.runs {
            let dst = &mut buf[at..at + len as usize];
            // SAFETY: the reader asks only for blocks their owner pinned for this transfer
            // (complete blocks, not written while pinned); `read_into` checks bounds.
            if let Err(e) = unsafe { memory.read_into(offset as usize, dst) } {
                return refuse(&mut stream, &e.to_string()).await;
            }
            at += len as usize;
        }
        stream.write_u8(0).await?;
        stream.write_all(&buf).await?;
    }
}

async fn refuse(stream: &mut TcpStream, reason: &str) -> std::io::Result<()> {
    stream.write_u8(1).await?;
    stream.write_u32_le(reason.len() as u32).await?;
    stream.write_all(reason.as_bytes()).await?;
    stream.flush().await
}

/// Pulls over TCP, reusing one idle connection per peer.
#[derive(Debug, Default)]
pub struct TcpClient {
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
}

impl TcpClient {
    /// Reads `segments` of `region` at `peer` into `local` (offsets in `Segment::local`).
    ///
    /// # Errors
    /// [`TransportError::Stale`] / [`TransportError::Refused`] when the server refuses;
    /// [`TransportError::Peer`] when the connection fails or closes mid-pull.
    pub async fn pull(
        &self,
        peer: &str,
        region: &RegionId,
        segments: &[Segment],
        local: &KvMemory,
    ) -> Result<(), TransportError> {
        let (stream, reused) = self.connect(peer).await?;
        let stream = match self.run(stream, peer, region, segments, local).await {
            Ok(s) => s,
            // An idle connection may have outlived its server (a node restarted on the same
            // port): one more try on a fresh connection. Bytes already written are rewritten.
            Err(TransportError::Peer(e)) if reused => {
                tracing::debug!(%peer, error = %e, "tcp transport: idle connection failed; reconnecting");
                let fresh = self.fresh(peer).await?;
                self.run(fresh, peer, region, segments, local).await?
            }
            Err(e) => return Err(e),
        };
        self.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(peer.to_owned())
            .or_default()
            .push(stream);
        Ok(())
    }

    /// An idle connection to `peer` (`true`) or a new one (`false`).
    async fn connect(&self, peer: &str) -> Result<(TcpStream, bool), TransportError> {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(peer)
            .and_then(Vec::pop);
        match idle {
            Some(s) => Ok((s, true)),
            None => Ok((self.fresh(peer).await?, false)),
        }
    }

    async fn fresh(&self, peer: &str) -> Result<TcpStream, TransportError> {
        let s = TcpStream::connect(peer)
            .await
            .map_err(|e| TransportError::Peer(format!("tcp connect {peer}: {e}")))?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    async fn run(
        &self,
        stream: TcpStream,
        peer: &str,
        region: &RegionId,
        segments: &[Segment],
        local: &KvMemory,
    ) -> Result<TcpStream, TransportError> {
        let chunks = chunk(segments);
        let window = Arc::new(Semaphore::new(WINDOW));
        let (mut rd, mut wr) = stream.into_split();
        let io = |e: std::io::Error| TransportError::Peer(format!("tcp {peer}: {e}"));
        let writer = {
            let window = window.clone();
            let chunks = &chunks;
            async move {
                for c in chunks {
                    let permit = window
                        .acquire()
                        .await
                        .map_err(|_| TransportError::Peer("reader gone".into()))?;
                    permit.forget();
                    let req = ReadRequest {
                        region: region.clone(),
                        runs: c.iter().map(|s| (s.remote, s.len)).collect(),
                    };
                    let frame = rmp_serde::to_vec(&req)
                        .map_err(|e| TransportError::Backend(e.to_string()))?;
                    wr.write_u32_le(frame.len() as u32).await.map_err(io)?;
                    wr.write_all(&frame).await.map_err(io)?;
                }
                Ok::<_, TransportError>(wr)
            }
        };
        let reader = async {
            let mut buf = Vec::new();
            for c in &chunks {
                match rd.read_u8().await.map_err(io)? {
                    0 => {}
                    _ => {
                        let n = rd.read_u32_le().await.map_err(io)?;
                        let mut why = vec![0; n.min(64 << 10) as usize];
                        rd.read_exact(&mut why).await.map_err(io)?;
                        let why = String::from_utf8_lossy(&why).into_owned();
                        window.close();
                        return Err(if why.starts_with("stale") {
                            TransportError::Stale(why)
                        } else {
                            TransportError::Refused(why)
                        });
                    }
                }
                for s in c {
                    buf.resize(s.len as usize, 0);
                    rd.read_exact(&mut buf).await.map_err(io)?;
                    // SAFETY: the destination blocks are allocated for this transfer and not
                    // scheduled until it ends (the pinning contract); bounds are checked.
                    unsafe { local.write_from(s.local as usize, &buf)? };
                }
                window.add_permits(1);
            }
            Ok::<_, TransportError>(rd)
        };
        let (wr, rd) = tokio::try_join!(writer, reader)?;
        rd.reunite(wr)
            .map_err(|e| TransportError::Backend(format!("tcp {peer}: {e}")))
    }
}

/// Splits segments into requests of at most [`CHUNK_BYTES`] (a segment larger than that is cut).
fn chunk(segments: &[Segment]) -> Vec<Vec<Segment>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut bytes = 0;
    for s in segments {
        let mut s = *s;
        while s.len > 0 {
            let take = s.len.min(CHUNK_BYTES - bytes);
            cur.push(Segment { len: take, ..s });
            bytes += take;
            s.remote += take;
            s.local += take;
            s.len -= take;
            if bytes == CHUNK_BYTES {
                out.push(std::mem::take(&mut cur));
                bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_byte_once() {
        let segs = [
            Segment {
                remote: 0,
                local: 100,
                len: CHUNK_BYTES * 2 + 5,
            },
            Segment {
                remote: 1 << 40,
                local: 7,
                len: 3,
            },
        ];
        let chunks = chunk(&segs);
        assert_eq!(chunks.len(), 3);
        assert!(
            chunks
                .iter()
                .all(|c| c.iter().map(|s| s.len).sum::<u64>() <= CHUNK_BYTES)
        );
        let flat: Vec<Segment> = chunks.into_iter().flatten().collect();
        assert_eq!(flat.iter().map(|s| s.len).sum::<u64>(), CHUNK_BYTES * 2 + 8);
        assert_eq!(flat[1].remote, CHUNK_BYTES);
        assert_eq!(flat[1].local, 100 + CHUNK_BYTES);
        assert_eq!(flat.last().map(|s| s.remote), Some(1 << 40));
    }
}
