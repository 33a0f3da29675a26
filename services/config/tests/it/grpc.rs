//! The gRPC adapter over a real listener and the generated client.

use avm_common::config::{GrpcConfig, REDACTED};
use avm_common::settings::{LLM_API_KEY, LLM_MODEL};
use avm_common::testing::{TestKeys, admin_ctx, bearer, serve_grpc, service_ctx};
use avm_common::{ApiError, Code};
use avm_config::grpc_server;
use avm_proto::config::v1 as pb;
use avm_proto::config::v1::config_service_client::ConfigServiceClient;
use avm_store::testing::TestDatabase;
use tonic::transport::Server;

use crate::support::{CANARY, Harness};

#[tokio::test]
async fn grpc_round_trip_and_typed_errors() {
    let harness = Harness::on(TestDatabase::sqlite("config.db")).await;
    let keys = TestKeys::new();
    let server = grpc_server(harness.service.clone(), keys.verifier(), &GrpcConfig::default());
    let channel = serve_grpc(Server::builder().add_service(server)).await;

    let anonymous = ConfigServiceClient::new(channel.clone())
        .get_config(pb::GetConfigRequest::default())
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&anonymous).code, Code::Unauthenticated);

    let mut admin = ConfigServiceClient::with_interceptor(channel.clone(), bearer(&keys.token(&admin_ctx("ten_a"))));
    let mut values = std::collections::HashMap::new();
    values.insert(LLM_MODEL.to_owned(), "\"tenant-model\"".to_owned());
    values.insert(LLM_API_KEY.to_owned(), format!("\"{CANARY}\""));
    let updated = admin
        .update_config(pb::UpdateConfigRequest {
            scope: pb::Scope::Tenant as i32,
            tenant_id: String::new(),
            values,
        })
        .await
        .unwrap()
        .into_inner();
    let model = updated.entries.iter().find(|e| e.key == LLM_MODEL).unwrap();
    assert_eq!(
        (model.value_json.as_str(), model.source),
        ("\"tenant-model\"", pb::Source::Tenant as i32)
    );
    let key = updated.entries.iter().find(|e| e.key == LLM_API_KEY).unwrap();
    assert_eq!(key.value_json, format!("\"{REDACTED}\""));
    assert!(key.secret && key.tenant_overridable && key.writable);
    assert!(!format!("{updated:?}").contains(CANARY));

    let refused = admin
        .update_config(pb::UpdateConfigRequest {
            scope: pb::Scope::System as i32,
            tenant_id: String::new(),
            values: [(LLM_MODEL.to_owned(), "\"x\"".to_owned())].into(),
        })
        .await
        .unwrap_err();
    let refused = ApiError::from_status(&refused);
    assert_eq!(
        (refused.code, refused.reason.as_ref()),
        (Code::PermissionDenied, "OPERATOR_REQUIRED")
    );
    let unspecified = admin
        .update_config(pb::UpdateConfigRequest::default())
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&unspecified).reason, "INVALID_SCOPE");

    // A component watching sees the secret; the stream starts with a snapshot.
    let mut runtime = ConfigServiceClient::with_interceptor(channel, bearer(&keys.token(&service_ctx("ten_a"))));
    let mut watch = runtime
        .watch_config(pb::WatchConfigRequest {
            tenant_id: String::new(),
            all_tenants: false,
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert!(first.snapshot);
    let key = first.entries.iter().find(|e| e.key == LLM_API_KEY).unwrap();
    assert_eq!(key.value_json, format!("\"{CANARY}\""));
}
