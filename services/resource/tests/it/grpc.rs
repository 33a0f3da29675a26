//! The gRPC adapter over a real listener and the generated client.

use avm_common::config::GrpcConfig;
use avm_common::testing::{TestKeys, admin_ctx, bearer, serve_grpc};
use avm_common::{ApiError, Code};
use avm_proto::resource::v1 as pb;
use avm_proto::resource::v1::resource_service_client::ResourceServiceClient;
use avm_resource::{ResourceService, grpc_server};
use tonic::transport::Server;

use crate::support::TestStore;

#[tokio::test]
async fn grpc_round_trip_and_typed_errors() {
    let db = TestStore::sqlite().await;
    let keys = TestKeys::new();
    let server = grpc_server(
        ResourceService::new(db.store.clone()),
        keys.verifier(),
        &GrpcConfig::default(),
    );
    let channel = serve_grpc(Server::builder().add_service(server)).await;

    // Without a token nothing is answered but UNAUTHENTICATED.
    let anonymous = ResourceServiceClient::new(channel.clone())
        .list_resources(pb::ListResourcesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&anonymous).code, Code::Unauthenticated);

    let ctx = admin_ctx("tenant-grpc");
    let mut client = ResourceServiceClient::with_interceptor(channel, bearer(&keys.token(&ctx)));

    let prompt = r#"{"template":"Hi {{who}}","variables":[{"name":"who","default":"there"}]}"#;
    let registered = client
        .register_resource(pb::RegisterResourceRequest {
            kind: pb::Kind::Prompt.into(),
            name: "greeting".into(),
            version: "1.0.0".into(),
            content_json: prompt.into(),
            description: "says hi".into(),
            tags: vec!["hello".into()],
            dependencies: Vec::new(),
            public: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(registered.created);
    let resource = registered.resource.unwrap();
    assert_eq!(
        (resource.kind, resource.visibility),
        (i32::from(pb::Kind::Prompt), i32::from(pb::Visibility::Private))
    );
    assert_eq!(resource.uri, "resource://prompts/greeting");
    assert_eq!(resource.tenant_id, "tenant-grpc");
    let version = registered.version.unwrap();
    assert_eq!(version.uri, "resource://prompts/greeting@1.0.0");
    assert_eq!(version.created_by, "usr_admin");

    let published = client
        .publish_version(pb::PublishVersionRequest {
            resource_id: resource.resource_id.clone(),
            version: "1.1.0".into(),
            content_json: r#"{"template":"Hello"}"#.into(),
            dependencies: Vec::new(),
            description: None,
            tags: Vec::new(),
            replace_tags: true,
        })
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    assert_eq!(published.latest_version, "1.1.0");
    assert_eq!(published.description, "says hi", "no description: kept");
    assert!(published.tags.is_empty(), "replace_tags with none clears them");

    let agent = r#"{"prompt":"resource://prompts/greeting@1.0.0","variables":{"who":"agent"}}"#;
    client
        .register_resource(pb::RegisterResourceRequest {
            kind: pb::Kind::Agent.into(),
            name: "greeter".into(),
            version: "0.1.0".into(),
            content_json: agent.into(),
            ..pb::RegisterResourceRequest::default()
        })
        .await
        .unwrap();

    let got = client
        .get_resource(pb::GetResourceRequest {
            resource_id: resource.resource_id.clone(),
            version: "^1.0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let versions: Vec<&str> = got
        .resource
        .as_ref()
        .unwrap()
        .versions
        .iter()
        .map(|v| v.version.as_str())
        .collect();
    assert_eq!(versions, ["1.1.0", "1.0.0"]);
    assert_eq!(got.version.unwrap().content_json, r#"{"template":"Hello"}"#);

    let listed = client
        .list_resources(pb::ListResourcesRequest {
            kind: pb::Kind::Agent.into(),
            ..pb::ListResourcesRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.resources.len(), 1);
    assert_eq!(listed.resources[0].uri, "resource://agents/greeter");
    assert!(listed.resources[0].versions.is_empty());
    assert_eq!(listed.next_page_token, "");

    let resolved = client
        .resolve_resource(pb::ResolveResourceRequest {
            uri: "resource://agents/greeter".into(),
            variables_json: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resolved.root.unwrap().uri, "resource://agents/greeter@0.1.0");
    let dependencies: Vec<&str> = resolved.dependencies.iter().map(|d| d.uri.as_str()).collect();
    assert_eq!(dependencies, ["resource://prompts/greeting@1.0.0"]);
    assert_eq!(resolved.rendered_prompt.as_deref(), Some("Hi agent"));

    // Errors arrive typed, with their stable reason.
    let typed = |status: tonic::Status| {
        let err = ApiError::from_status(&status);
        (err.code, err.reason.into_owned())
    };
    let unspecified = client
        .register_resource(pb::RegisterResourceRequest {
            name: "x".into(),
            version: "1.0.0".into(),
            ..pb::RegisterResourceRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(typed(unspecified), (Code::InvalidArgument, "INVALID_KIND".into()));
    let exists = client
        .publish_version(pb::PublishVersionRequest {
            resource_id: resource.resource_id.clone(),
            version: "1.0.0".into(),
            content_json: prompt.into(),
            ..pb::PublishVersionRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(typed(exists), (Code::AlreadyExists, "VERSION_EXISTS".into()));
    let missing = client
        .get_resource(pb::GetResourceRequest {
            resource_id: "res_missing".into(),
            version: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.message(), "resource res_missing not found");
    assert_eq!(typed(missing), (Code::NotFound, "RESOURCE_NOT_FOUND".into()));
    let in_use = client
        .delete_resource(pb::DeleteResourceRequest {
            resource_id: resource.resource_id.clone(),
            version: String::new(),
            force: false,
        })
        .await
        .unwrap_err();
    assert_eq!(typed(in_use), (Code::FailedPrecondition, "RESOURCE_IN_USE".into()));

    let deleted = client
        .delete_resource(pb::DeleteResourceRequest {
            resource_id: resource.resource_id.clone(),
            version: "1.1.0".into(),
            force: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deleted.deleted_versions, ["1.1.0"]);
    assert!(!deleted.resource_deleted);
}
