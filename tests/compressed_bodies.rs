//! B25 against a live cluster (real processes, raw HTTP over TCP): compressed request bodies
//! are decoded (gzip, deflate, br, zstd; identity as is) with the same answer as the plain
//! body, or refused by name (an unknown or stacked `Content-Encoding` 415, a transfer coding
//! other than chunked 501, a charset other than UTF-8 415, a corrupt body 400); the size limit
//! applies to the decoded bytes (a 1 GiB gzip bomb is a 413 and the gateway's memory stays
//! bounded), on every POST route.

#[path = "common/http.rs"]
mod http;
#[path = "common/poll.rs"]
mod poll;
#[path = "common/process.rs"]
mod process;

use crate::{http::MODEL, process::Cluster};
use serde_json::{Value, json};
use std::io::Write;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response read off the wire: status, lower-cased header lines, body.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The OpenAI error object's message, after checking the shape.
    fn error_message(&self) -> String {
        let v = self.json();
        for key in ["message", "type", "param", "code"] {
            assert!(v["error"].get(key).is_some(), "missing error.{key}: {v}");
        }
        v["error"]["message"].as_str().unwrap().to_owned()
    }
}

/// POST `body` to `path` with `headers` (besides host, length and `Connection: close`) over a
/// fresh connection, writing and reading at once (a server that answers before reading the
/// whole body is read, not reset), the response read to the connection's close.
async fn raw_post(addr: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    raw(addr, [head.into_bytes(), body.to_vec()].concat()).await
}

/// Send `bytes` and read the response to the connection's close.
async fn raw(addr: &str, bytes: Vec<u8>) -> Reply {
    let s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        // The server may answer and close before it has read everything: not an error here.
        let _ = wr.write_all(&bytes).await;
        let _ = wr.flush().await;
        wr
    });
    let mut out = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(300),
        rd.read_to_end(&mut out),
    )
    .await;
    assert!(read.is_ok(), "no response within 300 s");
    drop(writer);
    parse_reply(&out)
}

fn parse_reply(raw: &[u8]) -> Reply {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let mut body = raw[end + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn deflate(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn brotli(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
        w.write_all(data).unwrap();
    }
    out
}

fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::encode_all(data, 3).unwrap()
}

/// A gzip body of `gib` GiB of zeros (about 1 MB per GiB), built in 1 MiB steps.
fn gzip_bomb(gib: usize) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..gib * 1024 {
        e.write_all(&zeros).unwrap();
    }
    e.finish().unwrap()
}

/// `VmHWM` (peak resident set) of a process, in KiB.
fn peak_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compressed_bodies_are_decoded_or_refused_by_name() {
    let c = Cluster::start(2, &["worker.kv_blocks=128", "chaos.enabled=true"]);
    http::wait_routable(&c, 1).await;
    let addr = c.gateway.trim_start_matches("http://").to_owned();
    let chat = serde_json::to_vec(&json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8,
        "temperature": 0,
    }))
    .unwrap();

    // The plain body's answer is the reference.
    let plain = raw_post(&addr, "/v1/chat/completions", &[JSON], &chat).await;
    assert_eq!(
        plain.status,
        200,
        "{}",
        String::from_utf8_lossy(&plain.body)
    );
    let want = plain.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(!want.is_empty());

    // ----- Every supported coding decodes to the same answer (names case-insensitive).
    type Codec = fn(&[u8]) -> Vec<u8>;
    let codecs: [(&str, Codec); 6] = [
        ("gzip", gzip),
        ("GZip", gzip),
        ("x-gzip", gzip),
        ("deflate", deflate),
        ("br", brotli),
        ("zstd", zstd),
    ];
    for (name, encode) in codecs {
        let r = raw_post(
            &addr,
            "/v1/chat/completions",
            &[JSON, ("content-encoding", name)],
            &encode(&chat),
        )
        .await;
        assert_eq!(
            r.status,
            200,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let got = r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(got, want, "{name}: same answer as the plain body");
    }
    for name in ["identity", "Identity"] {
        let r = raw_post(
            &addr,
            "/v1/chat/completions",
            &[JSON, ("content-encoding", name)],
            &chat,
        )
        .await;
        assert_eq!(r.status, 200, "{name}");
        assert_eq!(r.json()["choices"][0]["message"]["content"], want.as_str());
    }
    // The other generation route too, and a streamed answer.
    let comp = serde_json::to_vec(&json!({
        "model": MODEL, "prompt": "One, two, three,", "max_tokens": 5, "temperature": 0,
    }))
    .unwrap();
    let plain = raw_post(&addr, "/v1/completions", &[JSON], &comp).await;
    assert_eq!(plain.status, 200);
    let r = raw_post(
        &addr,
        "/v1/completions",
        &[JSON, ("content-encoding", "zstd")],
        &zstd(&comp),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        r.json()["choices"][0]["text"],
        plain.json()["choices"][0]["text"]
    );
    let mut streamed: Value = serde_json::from_slice(&comp).unwrap();
    streamed["stream"] = json!(true);
    let r = raw_post(
        &addr,
        "/v1/completions",
        &[JSON, ("content-encoding", "br")],
        &brotli(&serde_json::to_vec(&streamed).unwrap()),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("data: [DONE]"));

    // ----- Unsupported codings: 415 naming them, with the codings that are accepted; each
    // counted once as a request (`rejected`), as the route's own refusals are.
    let counted = http::metric_sum(&c, "flotilla_requests_total").await;
    for (value, named) in [
        ("x-unknown", "'x-unknown'"),
        ("compress", "'compress'"),
        ("gzip, br", "'gzip, br'"),
    ] {
        let r = raw_post(
            &addr,
            "/v1/chat/completions",
            &[JSON, ("content-encoding", value)],
            &chat,
        )
        .await;
        assert_eq!(r.status, 415, "{value}");
        let m = r.error_message();
        assert!(m.contains(named), "{value}: {m}");
        assert_eq!(r.json()["error"]["code"], "unsupported_content_encoding");
        assert!(r.header("accept-encoding").unwrap().contains("zstd"));
        assert!(
            r.header("x-request-id").is_some(),
            "the edge's id on a refusal"
        );
    }
    assert_eq!(
        http::metric_sum(&c, "flotilla_requests_total").await - counted,
        3
    );

    // ----- A body that does not decode: 400 naming the coding, never "could not parse".
    for (name, body) in [
        ("gzip", b"definitely not gzip".to_vec()),
        ("zstd", gzip(&chat)),
        ("br", vec![0xff; 64]),
    ] {
        let r = raw_post(
            &addr,
            "/v1/chat/completions",
            &[JSON, ("content-encoding", name)],
            &body,
        )
        .await;
        assert_eq!(
            r.status,
            400,
            "{name}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let m = r.error_message();
        assert!(
            m.contains(&format!("Content-Encoding: {name}")),
            "{name}: {m}"
        );
        assert!(!m.contains("could not parse"), "{name}: {m}");
        assert_eq!(r.json()["error"]["code"], "invalid_content_encoding");
    }
    // A truncated gzip body too.
    let whole = gzip(&chat);
    let r = raw_post(
        &addr,
        "/v1/chat/completions",
        &[JSON, ("content-encoding", "gzip")],
        &whole[..whole.len() / 2],
    )
    .await;
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error_message().contains("gzip"));

    // ----- Other headers that change how the body is read: refused by name.
    // A transfer coding other than chunked would hand the route still-encoded bytes.
    let gz = gzip(&chat);
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         content-type: application/json\r\ntransfer-encoding: gzip, chunked\r\n\r\n{:x}\r\n",
        gz.len()
    )
    .into_bytes();
    req.extend_from_slice(&gz);
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    let r = raw(&addr, req).await;
    assert_eq!(r.status, 501, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error_message().contains("'gzip'"));
    // Plain chunked is what hyper decodes.
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
         content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
        chat.len()
    )
    .into_bytes();
    req.extend_from_slice(&chat);
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    assert_eq!(raw(&addr, req).await.status, 200);
    // JSON is UTF-8: another charset is named.
    let r = raw_post(
        &addr,
        "/v1/chat/completions",
        &[("content-type", "application/json; charset=utf-16")],
        &chat,
    )
    .await;
    assert_eq!(r.status, 415);
    assert!(r.error_message().contains("'utf-16'"));

    // ----- The control API's POST routes read bodies the same way.
    let fault = serde_json::to_vec(&json!({
        "kind": "slow", "delay_ms": 1, "target": {"worker": "node-1/replica-0"}, "duration_ms": 1000,
    }))
    .unwrap();
    let r = raw_post(
        &addr,
        "/chaos/faults",
        &[JSON, ("content-encoding", "gzip")],
        &gzip(&fault),
    )
    .await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    for path in ["/chaos/faults", "/v1/workers/role"] {
        let r = raw_post(
            &addr,
            path,
            &[JSON, ("content-encoding", "x-unknown")],
            &fault,
        )
        .await;
        assert_eq!(r.status, 415, "{path}");
        assert!(r.error_message().contains("'x-unknown'"), "{path}");
    }

    // ----- A decompression bomb: 1 GiB of zeros in about 1 MB. The limit counts decoded
    // bytes (413), and the gateway stops inflating there: its peak memory does not grow by
    // anything near a gibibyte.
    let gateway_node = http::fleet(&c).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| {
            n["roles"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x == "gateway"))
        })
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let pid = process::node_pid(&c, &gateway_node).await;
    let bomb = gzip_bomb(1);
    assert!(bomb.len() < 2 << 20, "{} bytes", bomb.len());
    let before = peak_rss_kib(pid);
    for path in ["/v1/chat/completions", "/v1/completions", "/chaos/faults"] {
        let r = raw_post(&addr, path, &[JSON, ("content-encoding", "gzip")], &bomb).await;
        assert_eq!(
            r.status,
            413,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(r.error_message().contains("exceeds the limit"), "{path}");
    }
    let after = peak_rss_kib(pid);
    eprintln!(
        "gzip bomb: {} bytes compressed, 1 GiB decoded; the gateway's peak RSS {before} KiB \
         before, {after} KiB after",
        bomb.len()
    );
    assert!(
        after < before + 256 * 1024,
        "the gateway's peak RSS grew from {before} KiB to {after} KiB on a 1 GiB bomb"
    );
    // And it still answers.
    let r = raw_post(&addr, "/v1/chat/completions", &[JSON], &chat).await;
    assert_eq!(r.status, 200);
}
