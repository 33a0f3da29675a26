//! What operators see of the running processes: one user message is one
//! trace across the gateway, runtime and session service (exported over OTLP
//! to a collector inside the test); every process answers `/metrics` with
//! Prometheus text; no secret shows in either.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options, TEST_API_KEY, TEST_CONFIG_SECRET_KEY, TEST_SERVICE_KEY};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use serde_json::json;

use crate::support::{assert_text_turn, conversation, send_and_finish, serve, stop};

/// How long spans may take to arrive: the exporters' batch delay is set short.
const EXPORT_DEADLINE: Duration = Duration::from_secs(20);

/// One exported span, as the test needs it.
#[derive(Clone, Debug)]
struct SeenSpan {
    service: String,
    name: String,
    trace_id: String,
    attributes: HashMap<String, String>,
}

/// An OTLP trace collector that keeps every span it receives.
#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<SeenSpan>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut seen = self.spans.lock().unwrap_or_else(|poison| poison.into_inner());
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|resource| resource.attributes.iter())
                .find(|attribute| attribute.key == "service.name")
                .and_then(|attribute| attribute.value.as_ref()?.value.as_ref().map(text))
                .unwrap_or_default();
            for span in resource.scope_spans.into_iter().flat_map(|scope| scope.spans) {
                let attributes = span
                    .attributes
                    .iter()
                    .filter_map(|attribute| {
                        let value = attribute.value.as_ref()?.value.as_ref()?;
                        Some((attribute.key.clone(), text(value)))
                    })
                    .collect();
                seen.push(SeenSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: span.trace_id.iter().map(|b| format!("{b:02x}")).collect(),
                    attributes,
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn text(value: &AnyValue) -> String {
    match value {
        AnyValue::StringValue(text) => text.clone(),
        other => format!("{other:?}"),
    }
}

impl Collector {
    /// Serves the collector on a free port; returns its URL.
    async fn start(&self) -> anyhow::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(self.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
        tokio::spawn(server);
        Ok(url)
    }

    fn spans(&self) -> Vec<SeenSpan> {
        self.spans.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
    }

    /// Waits for a trace in which each of `operations` has a span; returns its spans.
    async fn trace_with(&self, operations: &[&str]) -> anyhow::Result<Vec<SeenSpan>> {
        let deadline = tokio::time::Instant::now() + EXPORT_DEADLINE;
        loop {
            let spans = self.spans();
            let mut by_trace: HashMap<&str, Vec<&SeenSpan>> = HashMap::new();
            for span in &spans {
                by_trace.entry(&span.trace_id).or_default().push(span);
            }
            let found = by_trace.values().find(|spans| {
                operations.iter().all(|operation| {
                    spans
                        .iter()
                        .any(|span| span.attributes.get("operation").is_some_and(|o| o == operation))
                })
            });
            if let Some(trace) = found {
                return Ok(trace.iter().map(|span| (*span).clone()).collect());
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "no trace has {operations:?}; spans: {:?}",
                spans
                    .iter()
                    .map(|s| (&s.service, &s.name, s.attributes.get("operation")))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// What sends spans to `collector`, quickly.
fn otel_env(collector: &str) -> Vec<(String, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), collector.to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
    ]
}

/// The operations one user message goes through, gateway to session.
const MESSAGE_HOPS: [&str; 3] = ["message_send_request", "runtime.SendMessage", "session.AppendMessage"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_is_one_trace_across_processes() -> anyhow::Result<()> {
    let collector = Collector::default();
    let url = collector.start().await?;
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options {
        llm: Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        },
        env: otel_env(&url),
        ..Options::default()
    };
    let cluster = Cluster::start(Mode::PerComponent, options).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("trace me")).await?);

    let trace = collector.trace_with(&MESSAGE_HOPS).await?;
    let services: HashSet<&str> = trace.iter().map(|span| span.service.as_str()).collect();
    for service in ["avm-gateway", "avm-runtime", "avm-session"] {
        assert!(
            services.contains(service),
            "{service} is not in the trace: {services:?}"
        );
    }
    no_secret_in(&format!("{:?}", collector.spans()))?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_is_one_trace_in_one_process() -> anyhow::Result<()> {
    let collector = Collector::default();
    let url = collector.start().await?;
    let dir = tempfile::tempdir()?;
    let env = otel_env(&url);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (child, _, gateway) = serve(dir.path(), &[], &env).await?;
    let key = std::fs::read_to_string(dir.path().join("admin.key"))?;
    let ws = format!("{}/ws?token={}", gateway.replace("http://", "ws://"), key.trim());
    let mut client = WsClient::connect(&ws).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("trace me")).await?);
    let trace = collector.trace_with(&MESSAGE_HOPS).await?;
    assert!(trace.iter().all(|span| span.service == "avm-serve"), "{trace:?}");
    drop(client);
    stop(child).await?;
    Ok(())
}

/// Fails when any secret of the test clusters shows in `text`.
fn no_secret_in(text: &str) -> anyhow::Result<()> {
    for (what, secret) in [
        ("llm key", TEST_API_KEY),
        ("service key", TEST_SERVICE_KEY),
        ("config secret key", TEST_CONFIG_SECRET_KEY),
    ] {
        ensure!(!text.contains(secret), "the {what} shows");
    }
    Ok(())
}

crate::both_modes!(every_process_answers_prometheus_metrics, prometheus);

async fn prometheus(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    // Each process's own metrics, so a one-process cluster runs as `avm serve`.
    let options = Options {
        serve_process: true,
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let cluster = Cluster::start(mode, options).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("count me")).await?);

    let http = reqwest::Client::new();
    let mut endpoints = vec![("gateway", cluster.gateway_url.clone())];
    for (name, url) in [
        ("auth", &cluster.auth_grpc),
        ("session", &cluster.session_grpc),
        ("resource", &cluster.resource_grpc),
        ("config", &cluster.config_grpc),
        ("observability", &cluster.observability_grpc),
        ("runtime", &cluster.runtime_grpc),
    ] {
        endpoints.push((name, url.clone()));
    }
    let (mut everything, mut histograms) = (HashSet::new(), HashSet::new());
    for (name, base) in &endpoints {
        let response = http.get(format!("{base}/metrics")).send().await?;
        ensure!(response.status() == 200, "{name} /metrics: {}", response.status());
        let content_type = response.headers().get("content-type").cloned();
        let body = response.text().await?;
        ensure!(
            content_type.is_some_and(|t| t.to_str().is_ok_and(|t| t.starts_with("text/plain"))),
            "{name}: not Prometheus text"
        );
        let lines = body.lines().map(|line| Ok(line.to_owned()));
        let scrape =
            prometheus_parse::Scrape::parse(lines).with_context(|| format!("{name} /metrics does not parse"))?;
        no_secret_in(&body)?;
        for sample in scrape.samples {
            if matches!(sample.value, prometheus_parse::Value::Histogram(_)) {
                histograms.insert(sample.metric.clone());
            }
            everything.insert(sample.metric);
        }
    }
    // Durations are histograms (buckets an operator can aggregate across pods).
    ensure!(
        histograms.contains("avm_session_grpc_request_duration_seconds"),
        "request durations are not histograms: {histograms:?}"
    );
    // Whichever process serves them, every component's series are there.
    for series in [
        "avm_gateway_http_requests_total",
        "avm_gateway_websocket_connections",
        "avm_session_grpc_requests_total",
        "avm_runtime_grpc_requests_total",
        "avm_runtime_llm_calls_total",
        "avm_runtime_llm_tokens_total",
        "avm_runtime_active_agents",
        "avm_observability_grpc_requests_total",
        "avm_db_pool_connections",
        "avm_log_queue_depth",
        "avm_log_events_dropped_total",
    ] {
        ensure!(everything.contains(series), "no {series} in {everything:?}");
    }
    Ok(())
}
