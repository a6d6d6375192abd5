//! A real OTLP/HTTP receiver: what an OpenTelemetry exporter sends to
//! `/v1/traces` and `/v1/metrics`, decoded from protobuf and kept.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// A span with the `service.name` of the process that sent it.
#[derive(Debug, Clone)]
pub struct Received {
    pub service: String,
    pub span: Span,
}

impl Received {
    pub fn attr(&self, key: &str) -> Option<String> {
        attr(&self.span.attributes, key)
    }
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }
    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }
    pub fn parent_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }
    /// (trace id, span id) of each link.
    pub fn links(&self) -> Vec<(String, String)> {
        self.span
            .links
            .iter()
            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
            .collect()
    }
    /// The status code: 0 unset, 1 ok, 2 error.
    pub fn status(&self) -> i32 {
        self.span.status.as_ref().map_or(0, |s| s.code)
    }
}

#[derive(Default)]
struct Kept {
    spans: Vec<Received>,
    metrics: BTreeSet<String>,
    requests: usize,
}

#[derive(Clone)]
struct Shared {
    kept: Arc<Mutex<Kept>>,
    /// How long each answer takes: a slow collector.
    delay: Duration,
}

pub struct Receiver {
    pub endpoint: String,
    kept: Arc<Mutex<Kept>>,
}

impl Receiver {
    /// Listens on a port of its own; answers after `delay`.
    pub async fn start(delay: Duration) -> Receiver {
        let shared = Shared {
            kept: Arc::default(),
            delay,
        };
        let kept = shared.kept.clone();
        let app = Router::new()
            .route("/v1/traces", post(traces))
            .route("/v1/metrics", post(metrics))
            .with_state(shared);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { endpoint, kept }
    }

    pub fn spans(&self) -> Vec<Received> {
        self.kept.lock().unwrap().spans.clone()
    }

    pub fn metric_names(&self) -> BTreeSet<String> {
        self.kept.lock().unwrap().metrics.clone()
    }

    pub fn requests(&self) -> usize {
        self.kept.lock().unwrap().requests
    }
}

async fn traces(State(shared): State<Shared>, body: Bytes) -> Vec<u8> {
    tokio::time::sleep(shared.delay).await;
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace request");
    let mut kept = shared.kept.lock().unwrap();
    kept.requests += 1;
    for resource in request.resource_spans {
        let service = resource
            .resource
            .as_ref()
            .and_then(|r| attr(&r.attributes, "service.name"))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                kept.spans.push(Received {
                    service: service.clone(),
                    span,
                });
            }
        }
    }
    Vec::new()
}

async fn metrics(State(shared): State<Shared>, body: Bytes) -> Vec<u8> {
    tokio::time::sleep(shared.delay).await;
    let request = ExportMetricsServiceRequest::decode(body).expect("an OTLP metrics request");
    let mut kept = shared.kept.lock().unwrap();
    kept.requests += 1;
    for resource in request.resource_metrics {
        for scope in resource.scope_metrics {
            for metric in scope.metrics {
                kept.metrics.insert(metric.name);
            }
        }
    }
    Vec::new()
}

pub fn attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    let value = attributes.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    Some(render(value))
}

fn render(value: &AnyValue) -> String {
    match &value.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
