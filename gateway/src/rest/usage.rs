//! REST adapters of usage, budgets, the usage summary and the tenant's logs.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::usage::{
    self, BudgetList, BudgetSet, LogList, LogsQuery, NewBudget, RecordPage, Summary, SummaryQuery, Usage, UsageQuery,
};
use crate::http::{Body, Ctx, Query, ok};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(get, path = "/v1/usage", tag = "usage", params(UsageQuery),
    responses((status = 200, description = "Totals of the ledger over a range, grouped", body = Usage)))]
pub async fn query_usage(State(state): St, Ctx(ctx): Ctx, Query(query): Query<UsageQuery>) -> Response {
    ok(&ctx, usage::usage(&state.peers, &ctx, query).await)
}

#[utoipa::path(get, path = "/v1/usage/records", tag = "usage", params(UsageQuery),
    responses((status = 200, description = "A page of the ledger's records", body = RecordPage)))]
pub async fn list_usage_records(State(state): St, Ctx(ctx): Ctx, Query(query): Query<UsageQuery>) -> Response {
    ok(&ctx, usage::records(&state.peers, &ctx, query).await)
}

#[utoipa::path(get, path = "/v1/usage/budgets", tag = "usage", params(UsageQuery),
    responses((status = 200, description = "Monthly budgets", body = BudgetList)))]
pub async fn list_budgets(State(state): St, Ctx(ctx): Ctx, Query(query): Query<UsageQuery>) -> Response {
    ok(&ctx, usage::budgets(&state.peers, &ctx, query).await)
}

#[utoipa::path(put, path = "/v1/usage/budgets", tag = "usage", request_body = NewBudget,
    responses((status = 200, description = "The budget, or `{removed: true}` for a limit of 0", body = BudgetSet)))]
pub async fn set_budget(State(state): St, Ctx(ctx): Ctx, Body(request): Body<NewBudget>) -> Response {
    ok(&ctx, usage::set_budget(&state.peers, &ctx, request).await)
}

#[utoipa::path(get, path = "/v1/metrics", tag = "usage", params(SummaryQuery),
    responses((status = 200, description = "Calls, success and error rates, tokens, latency percentiles, active agents", body = Summary)))]
pub async fn get_usage_summary(State(state): St, Ctx(ctx): Ctx, Query(query): Query<SummaryQuery>) -> Response {
    ok(&ctx, usage::summary(&state.peers, &ctx, query).await)
}

#[utoipa::path(get, path = "/v1/logs", tag = "usage", params(LogsQuery),
    responses((status = 200, description = "The tenant's info-and-above events of the last 24 h (admins)", body = LogList)))]
pub async fn query_logs(State(state): St, Ctx(ctx): Ctx, Query(query): Query<LogsQuery>) -> Response {
    ok(&ctx, usage::logs(&state.peers, &ctx, query).await)
}
