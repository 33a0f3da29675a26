//! The gRPC adapter: proto ⇄ domain, metadata → `RequestContext`, error → `Status`.

use avm_common::ApiError;
use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::observability::v1 as pb;
use avm_proto::observability::v1::observability_service_server::{
    ObservabilityService as ObservabilityApi, ObservabilityServiceServer,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::{Request, Response, Status};

use crate::record::{
    Budget, CallEstimate, CallStatus, Dimension, Latency, Level, LogEvent, LogQuery, UsageQuery, UsageRecord,
    UsageTotals,
};
use crate::service::ObservabilityService;

/// Returns the `avm.observability.v1.ObservabilityService` server over
/// `service`, with the configured message-size limits. Every call's caller is
/// verified from its bearer token.
pub fn grpc_server(
    service: ObservabilityService,
    verifier: TokenVerifier,
    config: &GrpcConfig,
) -> Authenticated<ObservabilityServiceServer<ObservabilityGrpc>> {
    let server = ObservabilityServiceServer::new(ObservabilityGrpc::new(service))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    Authenticated::new(server, verifier)
}

/// Serves `ObservabilityService` over gRPC.
#[derive(Clone)]
pub struct ObservabilityGrpc {
    service: ObservabilityService,
}

impl ObservabilityGrpc {
    /// Returns the adapter over `service`: what the gRPC server serves, and
    /// what `avm serve` calls in process.
    pub fn new(service: ObservabilityService) -> Self {
        Self { service }
    }
}

#[tonic::async_trait]
impl ObservabilityApi for ObservabilityGrpc {
    async fn record_usage(
        &self,
        request: Request<pb::RecordUsageRequest>,
    ) -> Result<Response<pb::RecordUsageResponse>, Status> {
        let ctx = caller(&request)?;
        // Only components report usage: refuse others before looking at the records.
        ctx.principal.require_service()?;
        let records = request
            .into_inner()
            .records
            .into_iter()
            .enumerate()
            .map(|(index, record)| record_from_pb(index, record))
            .collect::<Result<Vec<_>, _>>()?;
        let recorded = self.service.record_usage(&ctx, records).await?;
        Ok(Response::new(pb::RecordUsageResponse { recorded }))
    }

    async fn query_usage(
        &self,
        request: Request<pb::QueryUsageRequest>,
    ) -> Result<Response<pb::QueryUsageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let group_by = request
            .group_by
            .iter()
            .map(|value| dimension_from_pb(*value))
            .collect::<Result<Vec<_>, _>>()?;
        let query = UsageQuery {
            tenant_id: request.tenant_id,
            all_tenants: request.all_tenants,
            from_ms: request.from_ms,
            to_ms: request.to_ms,
            key_id: request.key_id,
            model: request.model,
            user_id: request.user_id,
        };
        let report = self.service.query_usage(&ctx, &query, &group_by).await?;
        Ok(Response::new(pb::QueryUsageResponse {
            groups: report
                .groups
                .into_iter()
                .map(|group| pb::UsageGroup {
                    keys: group.keys,
                    totals: Some(totals_pb(&group.totals)),
                })
                .collect(),
            totals: Some(totals_pb(&report.totals)),
        }))
    }

    async fn list_usage(
        &self,
        request: Request<pb::ListUsageRequest>,
    ) -> Result<Response<pb::ListUsageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let query = UsageQuery {
            tenant_id: request.tenant_id,
            all_tenants: request.all_tenants,
            from_ms: request.from_ms,
            to_ms: request.to_ms,
            key_id: request.key_id,
            model: request.model,
            user_id: request.user_id,
        };
        let page = self
            .service
            .list_usage(&ctx, &query, request.page_size, &request.page_token)
            .await?;
        Ok(Response::new(pb::ListUsageResponse {
            records: page.records.into_iter().map(record_pb).collect(),
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }

    async fn get_usage_summary(
        &self,
        request: Request<pb::GetUsageSummaryRequest>,
    ) -> Result<Response<pb::GetUsageSummaryResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let summary = self
            .service
            .usage_summary(&ctx, &request.tenant_id, request.all_tenants, request.window_ms)
            .await?;
        Ok(Response::new(pb::GetUsageSummaryResponse {
            from_ms: summary.from_ms,
            to_ms: summary.to_ms,
            totals: Some(totals_pb(&summary.totals)),
            completed: summary.completed,
            interrupted: summary.interrupted,
            failed: summary.failed,
            first_token: Some(latency_pb(summary.first_token)),
            duration: Some(latency_pb(summary.duration)),
        }))
    }

    async fn set_budget(
        &self,
        request: Request<pb::SetBudgetRequest>,
    ) -> Result<Response<pb::SetBudgetResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let budget = self
            .service
            .set_budget(
                &ctx,
                &request.tenant_id,
                &request.key_id,
                request.monthly_limit_pico_usd,
            )
            .await?;
        Ok(Response::new(pb::SetBudgetResponse {
            budget: budget.map(budget_pb),
        }))
    }

    async fn list_budgets(
        &self,
        request: Request<pb::ListBudgetsRequest>,
    ) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        let ctx = caller(&request)?;
        let budgets = self.service.list_budgets(&ctx, &request.get_ref().tenant_id).await?;
        Ok(Response::new(pb::ListBudgetsResponse {
            budgets: budgets.into_iter().map(budget_pb).collect(),
        }))
    }

    async fn check_budget(
        &self,
        request: Request<pb::CheckBudgetRequest>,
    ) -> Result<Response<pb::CheckBudgetResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let check = self
            .service
            .reserve_budget(
                &ctx,
                &request.tenant_id,
                &request.key_id,
                &request.call_id,
                CallEstimate {
                    pico_usd: request.estimated_pico_usd,
                    tokens: request.estimated_tokens,
                },
            )
            .await?;
        Ok(Response::new(pb::CheckBudgetResponse {
            allowed: check.allowed,
            exhausted: check.exhausted.map(budget_pb),
            quota_exceeded: check.quota_exceeded.map(|quota| pb::TokenQuota {
                key_id: quota.key_id,
                used_up: quota.used_up,
            }),
        }))
    }

    async fn open_call(&self, request: Request<pb::OpenCallRequest>) -> Result<Response<pb::OpenCallResponse>, Status> {
        let ctx = caller(&request)?;
        ctx.principal.require_service()?;
        let record = request
            .into_inner()
            .record
            .ok_or_else(|| ApiError::invalid("INVALID_USAGE_RECORD", "record is required"))?;
        self.service.open_call(&ctx, record_from_pb(0, record)?).await?;
        Ok(Response::new(pb::OpenCallResponse {}))
    }

    async fn settle_open_calls(
        &self,
        request: Request<pb::SettleOpenCallsRequest>,
    ) -> Result<Response<pb::SettleOpenCallsResponse>, Status> {
        let ctx = caller(&request)?;
        let opened_before_ms = request.get_ref().opened_before_ms;
        let settled = self.service.settle_open_calls(&ctx, opened_before_ms).await?;
        Ok(Response::new(pb::SettleOpenCallsResponse { settled }))
    }

    type WatchBudgetsStream = BoxStream<'static, Result<pb::WatchBudgetsResponse, Status>>;

    async fn watch_budgets(
        &self,
        request: Request<pb::WatchBudgetsRequest>,
    ) -> Result<Response<Self::WatchBudgetsStream>, Status> {
        let ctx = caller(&request)?;
        let updates = self.service.watch_budgets(&ctx).await?;
        let stream = updates.map(|update| match update {
            Ok(update) => Ok(pb::WatchBudgetsResponse {
                budgets: update.budgets.into_iter().map(budget_pb).collect(),
                snapshot: update.snapshot,
                removed: update.removed,
            }),
            Err(err) => Err(Status::from(err)),
        });
        Ok(Response::new(stream.boxed()))
    }

    async fn record_logs(
        &self,
        request: Request<pb::RecordLogsRequest>,
    ) -> Result<Response<pb::RecordLogsResponse>, Status> {
        let ctx = caller(&request)?;
        ctx.principal.require_service()?;
        let events = request
            .into_inner()
            .events
            .into_iter()
            .enumerate()
            .map(|(index, event)| log_from_pb(index, event))
            .collect::<Result<Vec<_>, _>>()?;
        self.service.record_logs(&ctx, events).await?;
        Ok(Response::new(pb::RecordLogsResponse {}))
    }

    async fn query_logs(
        &self,
        request: Request<pb::QueryLogsRequest>,
    ) -> Result<Response<pb::QueryLogsResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let min_level = match pb::Level::try_from(request.min_level) {
            Ok(pb::Level::Unspecified) => None,
            Ok(level) => level_from_pb(level),
            Err(_) => return Err(ApiError::invalid("INVALID_LEVEL", "min_level is not a known level").into()),
        };
        let query = LogQuery {
            tenant_id: request.tenant_id,
            min_level,
            from_ms: request.from_ms,
            to_ms: request.to_ms,
            limit: request.limit,
        };
        let events = self.service.query_logs(&ctx, &query).await?;
        Ok(Response::new(pb::QueryLogsResponse {
            events: events.into_iter().map(log_pb).collect(),
        }))
    }
}

fn record_from_pb(index: usize, record: pb::UsageRecord) -> Result<UsageRecord, ApiError> {
    let status = match pb::CallStatus::try_from(record.status) {
        Ok(pb::CallStatus::Completed) => CallStatus::Completed,
        Ok(pb::CallStatus::Interrupted) => CallStatus::Interrupted,
        Ok(pb::CallStatus::Failed) => CallStatus::Failed,
        Ok(pb::CallStatus::Cut) => CallStatus::Cut,
        Ok(pb::CallStatus::Unspecified) | Err(_) => {
            return Err(ApiError::invalid(
                "INVALID_USAGE_RECORD",
                format!("records[{index}].status must be completed, interrupted, failed or cut"),
            ));
        }
    };
    Ok(UsageRecord {
        call_id: record.call_id,
        tenant_id: record.tenant_id,
        user_id: record.user_id,
        key_id: record.key_id,
        container_id: record.container_id,
        image_id: record.image_id,
        agent_id: record.agent_id,
        provider: record.provider,
        model: record.model,
        input_tokens: record.input_tokens,
        output_tokens: record.output_tokens,
        cache_read_tokens: record.cache_read_tokens,
        cache_write_tokens: record.cache_write_tokens,
        estimated: record.estimated,
        status,
        error_code: record.error_code,
        started_at_ms: record.started_at_ms,
        ended_at_ms: record.ended_at_ms,
        first_token_ms: record.first_token_ms,
        cost_pico_usd: record.cost_pico_usd,
        billed_pico_usd: record.billed_pico_usd,
        priced: record.priced,
        own_key: record.own_key,
    })
}

fn record_pb(record: UsageRecord) -> pb::UsageRecord {
    let status = match record.status {
        CallStatus::Completed => pb::CallStatus::Completed,
        CallStatus::Interrupted => pb::CallStatus::Interrupted,
        CallStatus::Failed => pb::CallStatus::Failed,
        CallStatus::Cut => pb::CallStatus::Cut,
    };
    pb::UsageRecord {
        call_id: record.call_id,
        tenant_id: record.tenant_id,
        user_id: record.user_id,
        key_id: record.key_id,
        container_id: record.container_id,
        image_id: record.image_id,
        agent_id: record.agent_id,
        provider: record.provider,
        model: record.model,
        input_tokens: record.input_tokens,
        output_tokens: record.output_tokens,
        cache_read_tokens: record.cache_read_tokens,
        cache_write_tokens: record.cache_write_tokens,
        estimated: record.estimated,
        status: status as i32,
        error_code: record.error_code,
        started_at_ms: record.started_at_ms,
        ended_at_ms: record.ended_at_ms,
        first_token_ms: record.first_token_ms,
        cost_pico_usd: record.cost_pico_usd,
        billed_pico_usd: record.billed_pico_usd,
        priced: record.priced,
        own_key: record.own_key,
    }
}

fn dimension_from_pb(value: i32) -> Result<Dimension, ApiError> {
    match pb::Dimension::try_from(value) {
        Ok(pb::Dimension::Tenant) => Ok(Dimension::Tenant),
        Ok(pb::Dimension::Key) => Ok(Dimension::Key),
        Ok(pb::Dimension::Model) => Ok(Dimension::Model),
        Ok(pb::Dimension::Day) => Ok(Dimension::Day),
        Ok(pb::Dimension::Month) => Ok(Dimension::Month),
        Ok(pb::Dimension::Status) => Ok(Dimension::Status),
        Ok(pb::Dimension::User) => Ok(Dimension::User),
        Ok(pb::Dimension::Provider) => Ok(Dimension::Provider),
        Ok(pb::Dimension::Unspecified) | Err(_) => Err(ApiError::invalid(
            "INVALID_GROUP_BY",
            "group_by takes tenant, key, provider, model, day, month, status and user",
        )),
    }
}

fn totals_pb(totals: &UsageTotals) -> pb::UsageTotals {
    pb::UsageTotals {
        calls: totals.calls,
        input_tokens: totals.input_tokens,
        output_tokens: totals.output_tokens,
        cache_read_tokens: totals.cache_read_tokens,
        cache_write_tokens: totals.cache_write_tokens,
        cost_pico_usd: totals.cost_pico_usd,
        billed_pico_usd: totals.billed_pico_usd,
        estimated_calls: totals.estimated_calls,
    }
}

fn latency_pb(latency: Latency) -> pb::Latency {
    pb::Latency {
        p50_ms: latency.p50_ms,
        p90_ms: latency.p90_ms,
        p99_ms: latency.p99_ms,
        max_ms: latency.max_ms,
    }
}

fn budget_pb(budget: Budget) -> pb::Budget {
    pb::Budget {
        tenant_id: budget.tenant_id,
        key_id: budget.key_id,
        monthly_limit_pico_usd: budget.monthly_limit_pico_usd,
        spent_pico_usd: budget.spent_pico_usd,
        exhausted: budget.exhausted,
        updated_at_ms: budget.updated_at_ms,
    }
}

fn level_from_pb(level: pb::Level) -> Option<Level> {
    match level {
        pb::Level::Unspecified => None,
        pb::Level::Trace => Some(Level::Trace),
        pb::Level::Debug => Some(Level::Debug),
        pb::Level::Info => Some(Level::Info),
        pb::Level::Warn => Some(Level::Warn),
        pb::Level::Error => Some(Level::Error),
    }
}

fn level_pb(level: Level) -> pb::Level {
    match level {
        Level::Trace => pb::Level::Trace,
        Level::Debug => pb::Level::Debug,
        Level::Info => pb::Level::Info,
        Level::Warn => pb::Level::Warn,
        Level::Error => pb::Level::Error,
    }
}

fn log_from_pb(index: usize, event: pb::LogEvent) -> Result<LogEvent, ApiError> {
    let level = pb::Level::try_from(event.level)
        .ok()
        .and_then(level_from_pb)
        .ok_or_else(|| {
            ApiError::invalid(
                "INVALID_LOG_EVENT",
                format!("events[{index}].level must be trace, debug, info, warn or error"),
            )
        })?;
    Ok(LogEvent {
        tenant_id: event.tenant_id,
        at_ms: event.at_ms,
        level,
        component: event.component,
        target: event.target,
        message: event.message,
        fields_json: event.fields_json,
        request_id: event.request_id,
        trace_id: event.trace_id,
    })
}

fn log_pb(event: LogEvent) -> pb::LogEvent {
    pb::LogEvent {
        tenant_id: event.tenant_id,
        at_ms: event.at_ms,
        level: level_pb(event.level) as i32,
        component: event.component,
        target: event.target,
        message: event.message,
        fields_json: event.fields_json,
        request_id: event.request_id,
        trace_id: event.trace_id,
    }
}
