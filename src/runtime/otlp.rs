//! Optional OpenTelemetry export of the tracing spans (`--otlp-endpoint`, off by default).
//!
//! With an endpoint, the process's tracing spans (the gateway's `request` span with its
//! `request_id`, the workers' sequence spans, …) also go to an OpenTelemetry collector over
//! OTLP/HTTP with protobuf bodies (`POST <endpoint>/v1/traces`), sent by the project's reqwest
//! client from a batch span processor on the tokio runtime; resource `service.name=flotilla`
//! and, where known, `service.instance.id` and `flotilla.node` = the node's name. Without one
//! nothing of this runs: no exporter, no background task, no connection.
//! [`Otlp::shutdown`] sends what is still queued (a node's drain and stop, or the end of any
//! command). The exporter itself is behind the cargo feature `otlp` (on by default); a build
//! without it refuses the flag.
//!
//! The parsing of the endpoint ([`OtlpConfig::parse`]) is pure and always built.
//!
//! # One trace across nodes
//! The request plane's messages carry the gateway's `request` span as a W3C `traceparent`
//! (`SubmitRequest::traceparent`, `RouteRequest::traceparent`; [`current_traceparent`]), and
//! the router's `route` span and the worker's `sequence` span take it as their remote parent
//! ([`adopt_remote_parent`]): a collector shows one trace per request with the spans of
//! every node it touched. Without an export both are no-ops (`None`, nothing set), and the
//! receiving side opens no span at all.

use std::time::Duration;

/// The path a collector takes OTLP/HTTP traces on.
pub const TRACES_PATH: &str = "/v1/traces";

/// Time one export (one HTTP request) may take; a collector that does not answer costs a
/// stopping node at most about this much.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where to send the spans.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpConfig {
    /// The full traces URL: the endpoint with `/v1/traces` added.
    pub traces_url: String,
}

impl OtlpConfig {
    /// The configuration of `--otlp-endpoint` (`http://host:port`, optionally with a path
    /// prefix): the OTLP/HTTP base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT`, to which
    /// `/v1/traces` is added (a URL already ending in `/v1/traces` is taken as it is).
    ///
    /// # Errors
    /// A message naming the problem: not a URL, not `http` (this build's HTTP client has no
    /// TLS: a local collector, or a collector's sidecar, over plain HTTP), no host, or a query
    /// or fragment.
    pub fn parse(endpoint: &str) -> Result<Self, String> {
        let url = reqwest::Url::parse(endpoint.trim()).map_err(|e| {
            format!(
                "--otlp-endpoint {endpoint:?}: not a URL ({e}); give the collector's OTLP/HTTP base URL, e.g. http://127.0.0.1:4318"
            )
        })?;
        match url.scheme() {
            "http" => {}
            "https" => {
                return Err(format!(
                    "--otlp-endpoint {endpoint:?}: https is not supported (the HTTP client is built without TLS); give the collector's plain http address, e.g. http://127.0.0.1:4318"
                ));
            }
            s => {
                return Err(format!(
                    "--otlp-endpoint {endpoint:?}: scheme {s:?}, expected http (OTLP over HTTP, e.g. http://127.0.0.1:4318)"
                ));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("--otlp-endpoint {endpoint:?}: no host"));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(format!(
                "--otlp-endpoint {endpoint:?}: a query or fragment is not allowed"
            ));
        }
        let mut s = url.to_string();
        if !url.path().ends_with(TRACES_PATH) {
            let base = s.trim_end_matches('/').len();
            s.truncate(base);
            s.push_str(TRACES_PATH);
        }
        Ok(Self { traces_url: s })
    }
}

#[cfg(feature = "otlp")]
pub use export::Otlp;

/// The current span's place in an exported trace, as a W3C `traceparent` header value
/// (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`); `None` when no OTLP export runs
/// (or the build has none).
pub fn current_traceparent() -> Option<String> {
    #[cfg(feature = "otlp")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let span = tracing::Span::current();
        if span.is_disabled() {
            return None;
        }
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = std::collections::HashMap::new();
        opentelemetry_sdk::propagation::TraceContextPropagator::new()
            .inject_context(&cx, &mut carrier);
        carrier.remove("traceparent")
    }
    #[cfg(not(feature = "otlp"))]
    None
}

/// Make `span` (not yet entered) a child of the remote span `traceparent` names, when an
/// export runs here; otherwise, or for a value that does not parse, nothing.
pub fn adopt_remote_parent(span: &tracing::Span, traceparent: Option<&str>) {
    #[cfg(feature = "otlp")]
    {
        use opentelemetry::propagation::TextMapPropagator;
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let Some(tp) = traceparent else { return };
        if span.is_disabled() {
            return;
        }
        let carrier = std::collections::HashMap::from([("traceparent".to_owned(), tp.to_owned())]);
        let cx = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&carrier);
        if cx.span().span_context().is_valid() {
            // Fails only without the OpenTelemetry layer (no export here) or once the span
            // started: then it stays a root, which is all it can be.
            let _ = span.set_parent(cx);
        }
    }
    #[cfg(not(feature = "otlp"))]
    let _ = (span, traceparent);
}

#[cfg(feature = "otlp")]
mod export {
    use super::{EXPORT_TIMEOUT, OtlpConfig};
    use opentelemetry::KeyValue;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::runtime::Tokio;
    use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
    use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanData, SpanExporter};
    use std::time::Duration;
    use tracing_subscriber::registry::LookupSpan;

    /// The running export: its tracer provider (the batch processor's task on the tokio
    /// runtime, the exporter).
    pub struct Otlp {
        provider: SdkTracerProvider,
        url: String,
    }

    /// The exporter, saying when exports start failing (once, at `warn`: the collector is
    /// down, unreachable or refuses) and when they work again (`info`), so a silent
    /// collector is not a silent loss. Target `flotilla::otlp`.
    #[derive(Debug)]
    struct Reporting<E> {
        inner: E,
        url: String,
        failing: std::sync::atomic::AtomicBool,
    }

    impl<E: SpanExporter> SpanExporter for Reporting<E> {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            use std::sync::atomic::Ordering;
            let n = batch.len();
            let result = self.inner.export(batch).await;
            match &result {
                Err(e) if !self.failing.swap(true, Ordering::Relaxed) => {
                    tracing::warn!(target: "flotilla::otlp", url = %self.url, spans = n, error = %e,
                        "OTLP export failed; spans are dropped until the collector answers (said once)");
                }
                Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                    tracing::info!(target: "flotilla::otlp", url = %self.url, "OTLP export works again");
                }
                _ => {}
            }
            result
        }

        fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
            self.inner.shutdown_with_timeout(timeout)
        }

        fn force_flush(&self) -> OTelSdkResult {
            self.inner.force_flush()
        }

        fn set_resource(&mut self, resource: &Resource) {
            self.inner.set_resource(resource);
        }
    }

    impl Otlp {
        /// Start the export to `cfg`; `node`, the node's name where known, goes into the
        /// resource. Must be called on the tokio runtime (the batch processor's task starts
        /// there). Connects to nothing yet: the first batch does.
        ///
        /// # Errors
        /// The HTTP client or the exporter cannot be built.
        pub fn start(cfg: &OtlpConfig, node: Option<&str>) -> anyhow::Result<Self> {
            let client = reqwest::Client::builder().timeout(EXPORT_TIMEOUT).build()?;
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client)
                .with_protocol(Protocol::HttpBinary)
                .with_endpoint(cfg.traces_url.clone())
                .with_timeout(EXPORT_TIMEOUT)
                .build()?;
            let mut resource = Resource::builder().with_service_name("flotilla");
            if let Some(n) = node {
                resource = resource.with_attributes([
                    KeyValue::new("service.instance.id", n.to_owned()),
                    KeyValue::new("flotilla.node", n.to_owned()),
                ]);
            }
            let exporter = Reporting {
                inner: exporter,
                url: cfg.traces_url.clone(),
                failing: false.into(),
            };
            let processor = BatchSpanProcessor::builder(exporter, Tokio).build();
            let provider = SdkTracerProvider::builder()
                .with_span_processor(processor)
                .with_resource(resource.build())
                .build();
            Ok(Self {
                provider,
                url: cfg.traces_url.clone(),
            })
        }

        /// The traces URL spans go to.
        pub fn url(&self) -> &str {
            &self.url
        }

        /// The tracing layer that turns spans into OpenTelemetry spans of this export.
        pub fn layer<S>(&self) -> tracing_opentelemetry::OpenTelemetryLayer<S, SdkTracer>
        where
            S: tracing::Subscriber + for<'a> LookupSpan<'a>,
        {
            tracing_opentelemetry::layer().with_tracer(self.provider.tracer("flotilla"))
        }

        /// Send what is still queued and stop the export (waits at most about
        /// [`EXPORT_TIMEOUT`] plus a second for a collector that does not answer).
        pub async fn shutdown(self) {
            let provider = self.provider;
            // The processor's shutdown blocks until its task on the runtime has exported.
            let done = tokio::task::spawn_blocking(move || provider.shutdown());
            match tokio::time::timeout(EXPORT_TIMEOUT + Duration::from_secs(1), done).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => eprintln!("flotilla: OTLP export: shutdown: {e}"),
                Ok(Err(e)) => eprintln!("flotilla: OTLP export: shutdown: {e}"),
                Err(_) => eprintln!("flotilla: OTLP export: the last spans were not sent in time"),
            }
        }
    }
}

#[cfg(not(feature = "otlp"))]
pub use no_export::Otlp;

/// A build without the `otlp` feature: the flag is refused.
#[cfg(not(feature = "otlp"))]
mod no_export {
    use super::OtlpConfig;

    /// Never made: [`Otlp::start`] refuses.
    pub enum Otlp {}

    impl Otlp {
        /// Refuses: this build has no OTLP export.
        ///
        /// # Errors
        /// Always.
        pub fn start(_cfg: &OtlpConfig, _node: Option<&str>) -> anyhow::Result<Self> {
            anyhow::bail!(
                "--otlp-endpoint: this flotilla was built without OpenTelemetry export (cargo feature `otlp`)"
            )
        }

        /// Never called.
        pub fn layer(&self) -> tracing_subscriber::layer::Identity {
            match *self {}
        }

        /// Never called.
        pub fn url(&self) -> &str {
            match *self {}
        }

        /// Never called.
        pub async fn shutdown(self) {
            match self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> String {
        OtlpConfig::parse(s).unwrap().traces_url
    }

    #[test]
    fn a_base_url_gets_the_traces_path() {
        assert_eq!(
            url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            url("http://127.0.0.1:4318/"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            url(" http://collector:4318 "),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(url("http://collector"), "http://collector/v1/traces");
    }

    #[test]
    fn a_path_prefix_is_kept_and_a_full_traces_url_taken_as_it_is() {
        assert_eq!(url("http://gw:80/otlp"), "http://gw/otlp/v1/traces");
        assert_eq!(url("http://gw:9000/otlp/"), "http://gw:9000/otlp/v1/traces");
        assert_eq!(
            url("http://127.0.0.1:4318/v1/traces"),
            "http://127.0.0.1:4318/v1/traces"
        );
    }

    #[test]
    fn without_an_export_no_trace_context_is_made_or_taken() {
        // No OpenTelemetry layer here: nothing to carry, and a carried value changes nothing.
        let span = tracing::info_span!("request");
        let _in = span.enter();
        assert_eq!(current_traceparent(), None);
        let child = tracing::info_span!("sequence");
        adopt_remote_parent(
            &child,
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        );
        adopt_remote_parent(&child, Some("not a traceparent"));
        adopt_remote_parent(&child, None);
    }

    #[test]
    fn other_schemes_and_non_urls_are_refused_with_a_reason() {
        let e = OtlpConfig::parse("https://collector:4318").unwrap_err();
        assert!(e.contains("https is not supported"), "{e}");
        let e = OtlpConfig::parse("grpc://collector:4317").unwrap_err();
        assert!(e.contains("expected http"), "{e}");
        let e = OtlpConfig::parse("127.0.0.1:4318").unwrap_err();
        assert!(e.contains("--otlp-endpoint"), "{e}");
        let e = OtlpConfig::parse("collector:4318").unwrap_err();
        assert!(e.contains("expected http"), "{e}");
        let e = OtlpConfig::parse("http://c:4318/?a=b").unwrap_err();
        assert!(e.contains("query"), "{e}");
        assert!(OtlpConfig::parse("").is_err());
    }
}
