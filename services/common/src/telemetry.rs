//! Telemetry of every process.
//!
//! - Logs: JSON lines when stderr is not a terminal, each with the
//!   `tenant_id`, `request_id` and `trace_id` of the request it belongs to
//!   (taken from the enclosing spans), compact text on a terminal.
//! - Tenant log events: info and above that belong to a tenant are queued for
//!   the observability service (`/v1/logs`); see [`take_log_events`].
//! - Traces: spans join the W3C trace of their request; the binary adds an
//!   exporting layer when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (unset,
//!   nothing is built and spans cost what they cost before).
//! - Metrics: one Prometheus recorder per process, rendered by `/metrics`.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::{Mutex, OnceLock};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Record};
use tracing::{Event, Id, Level, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogConfig, LogFormat};
use crate::trace::TraceParent;

/// Tenant log events waiting for the forwarder; beyond it new ones are dropped.
const LOG_QUEUE: usize = 10_000;

/// Spans whose events are never forwarded (they carry forwarded events).
const UNFORWARDED_SPANS: [&str; 2] = ["observability.record_logs", "observability.record_usage"];

/// What a span knows about the request it serves; inherited by its children.
#[derive(Clone, Debug, Default)]
struct Facts {
    tenant_id: Option<String>,
    request_id: Option<String>,
    trace_id: Option<String>,
}

impl Visit for Facts {
    fn record_str(&mut self, field: &Field, value: &str) {
        let slot = match field.name() {
            "tenant_id" => &mut self.tenant_id,
            "request_id" => &mut self.request_id,
            "trace_id" => &mut self.trace_id,
            _ => return,
        };
        *slot = Some(value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if matches!(field.name(), "tenant_id" | "request_id" | "trace_id") {
            self.record_str(field, &format!("{value:?}"));
        }
    }
}

/// Keeps each span's [`Facts`] in its extensions.
struct FactsLayer;

impl<S> Layer<S> for FactsLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut facts = span
            .parent()
            .and_then(|parent| parent.extensions().get::<Facts>().cloned())
            .unwrap_or_default();
        attrs.record(&mut facts);
        span.extensions_mut().insert(facts);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut extensions = span.extensions_mut();
        if let Some(facts) = extensions.get_mut::<Facts>() {
            values.record(facts);
        }
    }
}

/// An event's fields as JSON values; `message` apart.
#[derive(Default)]
struct Fields {
    message: String,
    fields: Map<String, Value>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            value.clone_into(&mut self.message);
        } else {
            self.fields.insert(field.name().to_owned(), Value::from(value));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.fields.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.fields.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.fields.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.fields.insert(field.name().to_owned(), Value::from(value));
    }
}

/// Returns the facts of the span an event happened in.
fn event_facts<S>(event: &Event<'_>, ctx: &Context<'_, S>) -> Facts
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    ctx.event_span(event)
        .and_then(|span| span.extensions().get::<Facts>().cloned())
        .unwrap_or_default()
}

/// One JSON object per line: time, level, target, span, message, the
/// event's fields, and the request's tenant, request id and trace id.
struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> std::fmt::Result {
        let mut timestamp = String::new();
        tracing_subscriber::fmt::time::SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let mut fields = Fields::default();
        event.record(&mut fields);
        let metadata = event.metadata();
        let mut line = Map::new();
        line.insert("timestamp".into(), Value::from(timestamp));
        line.insert("level".into(), Value::from(metadata.level().as_str()));
        line.insert("target".into(), Value::from(metadata.target()));
        line.insert("message".into(), Value::from(fields.message));
        let span = ctx.event_scope().and_then(|mut scope| scope.next());
        if let Some(span) = &span {
            line.insert("span".into(), Value::from(span.name()));
        }
        let facts = span
            .and_then(|span| span.extensions().get::<Facts>().cloned())
            .unwrap_or_default();
        for (name, value) in [
            ("tenant_id", facts.tenant_id),
            ("request_id", facts.request_id),
            ("trace_id", facts.trace_id),
        ] {
            if let Some(value) = value {
                line.insert(name.into(), Value::from(value));
            }
        }
        for (name, value) in fields.fields {
            line.entry(name).or_insert(value);
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// A log event of a tenant, for `/v1/logs`.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantLogEvent {
    pub tenant_id: String,
    pub at_ms: i64,
    pub level: Level,
    /// The component that logged it (`gateway`, `runtime`, …; `avm` in `avm serve`).
    pub component: &'static str,
    pub target: String,
    pub message: String,
    /// The event's fields, as text.
    pub fields: BTreeMap<String, String>,
    pub request_id: String,
    pub trace_id: String,
}

/// Queues info-and-above events that belong to a tenant.
struct TenantEvents {
    component: &'static str,
    queue: mpsc::Sender<TenantLogEvent>,
}

impl<S> Layer<S> for TenantEvents
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let metadata = event.metadata();
        // Closed: this process forwards no logs, so none are assembled.
        if *metadata.level() > Level::INFO || self.queue.is_closed() {
            return;
        }
        let facts = event_facts(event, &ctx);
        let Some(tenant_id) = facts.tenant_id else { return };
        if let Some(scope) = ctx.event_scope(event)
            && scope.from_root().any(|span| UNFORWARDED_SPANS.contains(&span.name()))
        {
            return;
        }
        let mut recorded = Fields::default();
        event.record(&mut recorded);
        let fields = recorded
            .fields
            .into_iter()
            .map(|(name, value)| match value {
                Value::String(text) => (name, text),
                other => (name, other.to_string()),
            })
            .collect();
        // A full queue (the service away or slow) drops the event, counted:
        // logs must never hold up or grow the process.
        let sent = self.queue.try_send(TenantLogEvent {
            tenant_id,
            at_ms: crate::now_ms(),
            level: *metadata.level(),
            component: self.component,
            target: metadata.target().to_owned(),
            message: recorded.message,
            fields,
            request_id: facts.request_id.unwrap_or_default(),
            trace_id: facts.trace_id.unwrap_or_default(),
        });
        if let Err(mpsc::error::TrySendError::Full(_)) = sent {
            log_events_dropped(1);
        }
    }
}

/// Counts tenant log events that never reached the observability service.
pub fn log_events_dropped(count: usize) {
    metrics::counter!("avm_log_events_dropped_total").increment(count as u64);
}

static LOG_EVENTS: Mutex<Option<mpsc::Receiver<TenantLogEvent>>> = Mutex::new(None);

/// Takes the queue of tenant log events (once): whoever forwards them to
/// the observability service. `None` when taken already or never made.
pub fn take_log_events() -> Option<mpsc::Receiver<TenantLogEvent>> {
    LOG_EVENTS.lock().unwrap_or_else(|poison| poison.into_inner()).take()
}

static EXPORTING: OnceLock<bool> = OnceLock::new();

/// Returns whether spans are exported (OpenTelemetry is on).
pub fn exporting() -> bool {
    EXPORTING.get().copied().unwrap_or(false)
}

/// A layer that exports spans (OpenTelemetry), made by the binary when a
/// collector is configured; it sits right on the registry.
pub type SpanExport = Box<dyn Layer<tracing_subscriber::Registry> + Send + Sync>;

/// Installs the global subscriber for `component`, with `export` (spans to
/// a collector) when given; returns whether it was installed (a second call,
/// as in tests, keeps the first).
pub fn init(config: &LogConfig, component: &'static str, export: Option<SpanExport>) -> bool {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&config.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let json = match config.format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    metrics();
    let (queue, receiver) = mpsc::channel(LOG_QUEUE);
    let depth = queue.downgrade();
    let exporting = export.is_some();
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.event_format(JsonLines).boxed()
    } else {
        fmt.compact().boxed()
    };
    // Each layer filters for itself: the log level chosen for stderr must
    // not silence tenants' logs or the spans of a trace (info and above).
    let facts_level = filter
        .max_level_hint()
        .unwrap_or(LevelFilter::TRACE)
        .max(LevelFilter::INFO);
    let installed = tracing_subscriber::registry()
        .with(export)
        .with(FactsLayer.with_filter(facts_level))
        .with(fmt.with_filter(filter))
        .with(TenantEvents { component, queue }.with_filter(LevelFilter::INFO))
        .try_init()
        .is_ok();
    // Err only means a subscriber is installed already, which is fine.
    if installed {
        *LOG_EVENTS.lock().unwrap_or_else(|poison| poison.into_inner()) = Some(receiver);
        on_scrape(move || {
            let queued = depth.upgrade().map_or(0, |queue| LOG_QUEUE - queue.capacity());
            metrics::gauge!("avm_log_queue_depth").set(queued as f64);
            log_events_dropped(0);
        });
        let _ = EXPORTING.set(exporting);
        if exporting {
            tracing::info!(component, "exporting traces over otlp");
        }
    }
    installed
}

/// Returns the trace context to send on a call made now: the current span's
/// when spans are exported (so the callee's span is its child), else the
/// request's trace with a new span id.
pub fn outgoing_trace(trace: &TraceParent) -> TraceParent {
    if exporting() {
        let context = tracing::Span::current().context();
        let span = context.span();
        let current = span.span_context();
        if current.is_valid() {
            return TraceParent {
                trace_id: u128::from_be_bytes(current.trace_id().to_bytes()),
                span_id: u64::from_be_bytes(current.span_id().to_bytes()),
            };
        }
    }
    trace.child()
}

/// Returns a span for serving one request of `trace`, named `name`, that
/// joins the caller's trace (its exported span is the caller's child). Its
/// `tenant_id` and `request_id` are recorded once the caller is known
/// (`RequestContext::record_in_span`).
pub fn request_span(name: &'static str, operation: &str, trace: &TraceParent) -> tracing::Span {
    let span = tracing::info_span!(
        "request",
        otel.name = name,
        operation,
        trace_id = %trace.trace_id_hex(),
        tenant_id = tracing::field::Empty,
        request_id = tracing::field::Empty,
    );
    if exporting() {
        let parent = SpanContext::new(
            TraceId::from_bytes(trace.trace_id.to_be_bytes()),
            SpanId::from_bytes(trace.span_id.to_be_bytes()),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(parent));
    }
    span
}

static METRICS: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Hooks that bring gauges up to date before a scrape.
static COLLECTORS: Mutex<Vec<Box<dyn Fn() + Send + Sync>>> = Mutex::new(Vec::new());

/// Returns the process's Prometheus recorder, installing it on first use;
/// `None` when another recorder was installed first.
pub fn metrics() -> Option<&'static PrometheusHandle> {
    METRICS
        .get_or_init(|| {
            // Durations from a millisecond to a minute.
            const SECONDS: [f64; 14] = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
            ];
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("seconds".to_owned()), &SECONDS)
                .and_then(PrometheusBuilder::install_recorder)
                .ok()
        })
        .as_ref()
}

/// Adds a hook run before each scrape (to set gauges read from elsewhere).
pub fn on_scrape(collect: impl Fn() + Send + Sync + 'static) {
    COLLECTORS
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .push(Box::new(collect));
}

/// Returns the Prometheus text of every metric of this process.
pub fn render_metrics() -> String {
    for collect in COLLECTORS.lock().unwrap_or_else(|poison| poison.into_inner()).iter() {
        collect();
    }
    match metrics() {
        Some(handle) => {
            handle.run_upkeep();
            handle.render()
        }
        None => String::new(),
    }
}

/// Answers `GET /metrics` with the Prometheus text format.
pub async fn metrics_endpoint() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        render_metrics(),
    )
        .into_response()
}
