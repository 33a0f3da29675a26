//! Forwards the tenant log events a process queued (see
//! [`avm_common::telemetry::take_log_events`]) to the observability service in
//! batches, as the process's own service identity. Logs are best effort: a
//! batch the service refuses twice is dropped with a warning, so an absent
//! service never holds up or grows the process.

use std::time::Duration;

use avm_common::auth::ServiceIdentity;
use avm_common::telemetry::TenantLogEvent;
use avm_proto::observability::v1 as pb;
use avm_proto::observability::v1::ObservabilityServiceHandle;
use tokio_util::sync::CancellationToken;
use tracing::Level;

/// Most events in one report.
const BATCH: usize = 500;

/// How long events wait for company before they are sent.
const BATCH_DELAY: Duration = Duration::from_secs(1);

/// Sends this process's tenant log events until `shutdown` (then the ones
/// already queued); a finished task when another forwarder took the queue.
pub fn spawn_log_forwarder(
    observability: ObservabilityServiceHandle,
    identity: ServiceIdentity,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let Some(mut queue) = avm_common::telemetry::take_log_events() else {
        return tokio::spawn(async {});
    };
    tokio::spawn(async move {
        let mut batch = Vec::new();
        loop {
            let stopping = tokio::select! {
                () = shutdown.cancelled() => true,
                event = queue.recv() => match event {
                    Some(event) => { batch.push(event_pb(event)); false }
                    None => true,
                },
            };
            if !stopping {
                let deadline = tokio::time::Instant::now() + BATCH_DELAY;
                while batch.len() < BATCH {
                    match tokio::time::timeout_at(deadline, queue.recv()).await {
                        Ok(Some(event)) => batch.push(event_pb(event)),
                        _ => break,
                    }
                }
            } else {
                while let Ok(event) = queue.try_recv() {
                    batch.push(event_pb(event));
                }
            }
            if !batch.is_empty() {
                send(&observability, &identity, std::mem::take(&mut batch)).await;
            }
            if stopping {
                return;
            }
        }
    })
}

async fn send(observability: &ObservabilityServiceHandle, identity: &ServiceIdentity, events: Vec<pb::LogEvent>) {
    for attempt in 1..=2 {
        let result = async {
            let ctx = identity.own_context().await?;
            let request = ctx.request(pb::RecordLogsRequest { events: events.clone() });
            observability.record_logs(request).await?;
            Ok::<_, avm_common::ApiError>(())
        }
        .await;
        match result {
            Ok(()) => return,
            Err(err) if attempt == 1 => {
                tracing::debug!(reason = %err.reason, "log events not forwarded; retrying once");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => {
                tracing::warn!(events = events.len(), reason = %err.reason, "log events dropped");
                avm_common::telemetry::log_events_dropped(events.len());
            }
        }
    }
}

fn event_pb(event: TenantLogEvent) -> pb::LogEvent {
    let level = match event.level {
        Level::TRACE => pb::Level::Trace,
        Level::DEBUG => pb::Level::Debug,
        Level::INFO => pb::Level::Info,
        Level::WARN => pb::Level::Warn,
        Level::ERROR => pb::Level::Error,
    };
    pb::LogEvent {
        tenant_id: event.tenant_id,
        at_ms: event.at_ms,
        level: level as i32,
        component: event.component.to_owned(),
        target: event.target,
        message: event.message,
        fields_json: serde_json::to_string(&event.fields).unwrap_or_default(),
        request_id: event.request_id,
        trace_id: event.trace_id,
    }
}
