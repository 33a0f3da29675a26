//! The process's telemetry: avm-common's subscriber (logs, tenant log
//! events, metrics), and spans exported over OTLP (gRPC) when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` names a collector — the one place that links
//! the exporter (the standard `OTEL_*` variables configure it further).

use std::future::Future;

use avm_common::config::LogConfig;
use opentelemetry::trace::TracerProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;

/// What [`init`] set up, to be shut down at exit (flushes pending spans).
#[derive(Debug, Default)]
pub struct Telemetry {
    tracer: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Exports the spans still buffered; call once at exit, off the async runtime's threads.
    pub fn shutdown(self) {
        if let Some(provider) = self.tracer
            && let Err(err) = provider.shutdown()
        {
            eprintln!("warning: could not flush traces: {err}");
        }
    }
}

/// Installs the process's subscriber for `component`. Must run inside the
/// process's Tokio runtime when a collector is configured (the exporter sends on it).
pub fn init(config: &LogConfig, component: &'static str) -> Telemetry {
    let tracer = otlp_tracer(component);
    let export = tracer.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("agentvm"))
            .with_filter(LevelFilter::INFO)
            .boxed()
    });
    let installed = avm_common::telemetry::init(config, component, export);
    Telemetry {
        tracer: tracer.filter(|_| installed),
    }
}

/// Returns the span exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` names a
/// collector (the standard `OTEL_*` variables configure it further).
fn otlp_tracer(component: &str) -> Option<SdkTracerProvider> {
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|url| !url.is_empty())?;
    let handle = tokio::runtime::Handle::try_current().ok()?;
    let exporter = match opentelemetry_otlp::SpanExporter::builder().with_tonic().build() {
        Ok(exporter) => exporter,
        Err(err) => {
            eprintln!("warning: traces are not exported: {err}");
            return None;
        }
    };
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(format!("avm-{component}"))
        .build();
    Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(OnRuntime { exporter, handle })
            .with_resource(resource)
            .build(),
    )
}

/// Runs an exporter's sends on the process's Tokio runtime: the batch
/// processor exports from a thread of its own, where the gRPC client finds
/// no reactor (open-telemetry/opentelemetry-rust#2673).
#[derive(Debug)]
struct OnRuntime<E> {
    exporter: E,
    handle: tokio::runtime::Handle,
}

impl<E: opentelemetry_sdk::trace::SpanExporter> opentelemetry_sdk::trace::SpanExporter for OnRuntime<E> {
    fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> impl Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        // The runtime is multi-threaded: its drivers run on its workers, so
        // blocking this (non-runtime) thread on it is sound.
        std::future::ready(self.handle.block_on(self.exporter.export(batch)))
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.exporter.set_resource(resource);
    }
}
