//! The gRPC adapter over a real listener and the generated client.

use avm_common::config::GrpcConfig;
use avm_common::testing::{TestKeys, admin_ctx, bearer, member_ctx, serve_grpc, service_ctx};
use avm_common::{ApiError, Code};
use avm_observability::grpc_server;
use avm_proto::observability::v1 as pb;
use avm_proto::observability::v1::observability_service_client::ObservabilityServiceClient;
use avm_store::testing::TestDatabase;
use tonic::transport::Server;

use crate::support::{A, Harness};

fn record(call_id: &str, billed_pico_usd: i64) -> pb::UsageRecord {
    let now = avm_common::now_ms();
    pb::UsageRecord {
        call_id: call_id.to_owned(),
        tenant_id: A.to_owned(),
        user_id: "usr_1".to_owned(),
        key_id: "key_1".to_owned(),
        provider: "anthropic".to_owned(),
        model: "claude-sonnet-4".to_owned(),
        input_tokens: 1_000,
        output_tokens: 500,
        status: pb::CallStatus::Completed as i32,
        started_at_ms: now - 3_000,
        ended_at_ms: now - 1_000,
        first_token_ms: 400,
        cost_pico_usd: billed_pico_usd * 100 / 105,
        billed_pico_usd,
        priced: true,
        ..pb::UsageRecord::default()
    }
}

#[tokio::test]
async fn grpc_round_trip_and_typed_errors() {
    let harness = Harness::on(TestDatabase::sqlite("observability.db")).await;
    let keys = TestKeys::new();
    let server = grpc_server(harness.service.clone(), keys.verifier(), &GrpcConfig::default());
    let channel = serve_grpc(Server::builder().add_service(server)).await;

    let anonymous = ObservabilityServiceClient::new(channel.clone())
        .query_usage(pb::QueryUsageRequest::default())
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&anonymous).code, Code::Unauthenticated);

    let mut runtime =
        ObservabilityServiceClient::with_interceptor(channel.clone(), bearer(&keys.token(&service_ctx(A))));
    let mut admin = ObservabilityServiceClient::with_interceptor(channel.clone(), bearer(&keys.token(&admin_ctx(A))));
    let mut member =
        ObservabilityServiceClient::with_interceptor(channel.clone(), bearer(&keys.token(&member_ctx(A, "usr_1"))));

    let set = admin
        .set_budget(pb::SetBudgetRequest {
            tenant_id: String::new(),
            key_id: String::new(),
            monthly_limit_pico_usd: 2_000,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(set.budget.unwrap().monthly_limit_pico_usd, 2_000);

    let recorded = runtime
        .record_usage(pb::RecordUsageRequest {
            records: vec![record("c1", 1_050), record("c1", 1_050), record("c2", 1_050)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(recorded.recorded, 2);
    let check = runtime
        .check_budget(pb::CheckBudgetRequest {
            tenant_id: A.to_owned(),
            key_id: "key_1".to_owned(),
            ..pb::CheckBudgetRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!check.allowed, "2,100 of 2,000 spent, before any write");
    assert_eq!(check.exhausted.unwrap().spent_pico_usd, 2_100);
    harness.service.flush().await.unwrap();

    let report = admin
        .query_usage(pb::QueryUsageRequest {
            group_by: vec![pb::Dimension::Model as i32, pb::Dimension::Status as i32],
            ..pb::QueryUsageRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(report.groups.len(), 1);
    assert_eq!(report.groups[0].keys, ["claude-sonnet-4", "completed"]);
    let totals = report.totals.unwrap();
    assert_eq!(
        (totals.calls, totals.input_tokens, totals.billed_pico_usd),
        (2, 2_000, 2_100)
    );

    let listed = member
        .list_usage(pb::ListUsageRequest {
            page_size: 1,
            ..pb::ListUsageRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.records.len(), 1);
    assert_eq!(listed.records[0].status, pb::CallStatus::Completed as i32);
    let rest = member
        .list_usage(pb::ListUsageRequest {
            page_size: 1,
            page_token: listed.next_page_token.clone(),
            ..pb::ListUsageRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.records.len(), 1);
    assert_ne!(rest.records[0].call_id, listed.records[0].call_id);
    assert!(rest.next_page_token.is_empty());

    let summary = admin
        .get_usage_summary(pb::GetUsageSummaryRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summary.completed, 2);
    assert_eq!(summary.first_token.unwrap().p50_ms, 400);
    assert_eq!(summary.duration.unwrap().max_ms, 2_000);

    // Typed reasons survive the wire.
    let refused = member
        .record_usage(pb::RecordUsageRequest {
            records: vec![record("forged", 1)],
        })
        .await
        .unwrap_err();
    let refused = ApiError::from_status(&refused);
    assert_eq!(
        (refused.code, refused.reason.as_ref()),
        (Code::PermissionDenied, "SERVICE_REQUIRED")
    );
    let unspecified = runtime
        .record_usage(pb::RecordUsageRequest {
            records: vec![pb::UsageRecord {
                status: pb::CallStatus::Unspecified as i32,
                ..record("c3", 1)
            }],
        })
        .await
        .unwrap_err();
    let unspecified = ApiError::from_status(&unspecified);
    assert_eq!(
        (unspecified.code, unspecified.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_USAGE_RECORD")
    );
    assert!(unspecified.message.contains("records[0].status"));
    let foreign = admin
        .list_budgets(pb::ListBudgetsRequest {
            tenant_id: "ten_b".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&foreign).reason, "OPERATOR_REQUIRED");
    let bad_group = admin
        .query_usage(pb::QueryUsageRequest {
            group_by: vec![pb::Dimension::Unspecified as i32],
            ..pb::QueryUsageRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&bad_group).reason, "INVALID_GROUP_BY");
    let member_logs = member.query_logs(pb::QueryLogsRequest::default()).await.unwrap_err();
    assert_eq!(ApiError::from_status(&member_logs).code, Code::PermissionDenied);

    // Logs go in through components and come out for admins.
    runtime
        .record_logs(pb::RecordLogsRequest {
            events: vec![pb::LogEvent {
                tenant_id: A.to_owned(),
                at_ms: avm_common::now_ms(),
                level: pb::Level::Warn as i32,
                component: "runtime".to_owned(),
                message: "tool timed out".to_owned(),
                fields_json: r#"{"tool":"web.search"}"#.to_owned(),
                ..pb::LogEvent::default()
            }],
        })
        .await
        .unwrap();
    let logs = admin
        .query_logs(pb::QueryLogsRequest {
            min_level: pb::Level::Warn as i32,
            ..pb::QueryLogsRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(logs.events.len(), 1);
    assert_eq!(
        (logs.events[0].level, logs.events[0].message.as_str()),
        (pb::Level::Warn as i32, "tool timed out")
    );

    // Components watch every budget, starting with a snapshot.
    let mut watch = runtime
        .watch_budgets(pb::WatchBudgetsRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert!(first.snapshot);
    assert_eq!(first.budgets.len(), 1);
    assert!(first.budgets[0].exhausted);
    admin
        .set_budget(pb::SetBudgetRequest {
            tenant_id: String::new(),
            key_id: String::new(),
            monthly_limit_pico_usd: 0,
        })
        .await
        .unwrap();
    let removed = watch.message().await.unwrap().unwrap();
    assert!(removed.removed && !removed.snapshot);
    let refused = admin.watch_budgets(pb::WatchBudgetsRequest {}).await.unwrap_err();
    assert_eq!(ApiError::from_status(&refused).reason, "SERVICE_REQUIRED");
}
