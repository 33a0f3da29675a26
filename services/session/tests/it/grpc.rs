//! The gRPC adapter over a real listener and the generated client.

use avm_common::config::GrpcConfig;
use avm_common::testing::{TestKeys, bearer, serve_grpc};
use avm_common::{ApiError, Code};
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_session::{SessionService, grpc_server};
use tonic::transport::Server;

use crate::support::TestDb;

#[tokio::test]
async fn grpc_round_trip_and_typed_errors() {
    let db = TestDb::sqlite().await;
    let keys = TestKeys::new();
    let server = grpc_server(
        SessionService::new(db.store.clone()),
        keys.verifier(),
        &GrpcConfig::default(),
    );
    let channel = serve_grpc(Server::builder().add_service(server)).await;

    // Without a token nothing is answered but UNAUTHENTICATED.
    let anonymous = SessionServiceClient::new(channel.clone())
        .list_containers(pb::ListContainersRequest {})
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&anonymous).code, Code::Unauthenticated);

    let ctx = crate::support::ctx("tenant-grpc");
    let mut client = SessionServiceClient::with_interceptor(channel, bearer(&keys.token(&ctx)));

    let created = client
        .create_container(pb::CreateContainerRequest {
            container_id: "default".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(created.created);
    let image = client
        .create_image(pb::CreateImageRequest {
            container_id: "default".into(),
            name: None,
            description: Some("via grpc".into()),
            system_prompt: Some("be kind".into()),
            mcp_servers_json: String::new(),
            agent: Some("resource://agents/helper@^1".into()),
            variables_json: r#"{"who":"you"}"#.into(),
            tools: vec!["read_file".into()],
        })
        .await
        .unwrap()
        .into_inner()
        .image
        .unwrap();
    assert_eq!(
        (image.name.as_str(), image.mcp_servers_json.as_str()),
        ("New Conversation", "{}")
    );
    assert_eq!(image.description.as_deref(), Some("via grpc"));
    assert_eq!(
        (image.agent.as_deref(), image.variables_json.as_str()),
        (Some("resource://agents/helper@^1"), r#"{"who":"you"}"#)
    );
    assert_eq!(image.tools, ["read_file"]);
    let unknown = client
        .create_image(pb::CreateImageRequest {
            container_id: "default".into(),
            tools: vec!["format_disk".into()],
            ..pb::CreateImageRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::InvalidArgument);
    assert!(unknown.message().contains("format_disk"), "{}", unknown.message());

    let message = pb::Message {
        message_id: "msg_1".into(),
        session_id: image.session_id.clone(),
        body: Some(pb::message::Body::Assistant(pb::AssistantMessage {
            text: "hello".into(),
            usage: Some(pb::Usage {
                input_tokens: 5,
                output_tokens: 1,
            }),
            interrupted: false,
            model: "m".into(),
            stop_reason: "end_turn".into(),
            resources: vec!["resource://prompts/helper@1.0.0".into()],
        })),
        ..pb::Message::default()
    };
    let request = pb::AppendMessageRequest {
        session_id: image.session_id.clone(),
        message: Some(message.clone()),
    };
    let stored = client
        .append_message(request)
        .await
        .unwrap()
        .into_inner()
        .message
        .unwrap();
    assert_eq!(stored.seq, 1);
    assert!(stored.created_at_ms > 0);
    assert_eq!(stored.body, message.body);
    let listed = client
        .list_messages(pb::ListMessagesRequest {
            session_id: image.session_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(listed, [stored]);

    let images = client
        .list_images(pb::ListImagesRequest { container_id: None })
        .await
        .unwrap()
        .into_inner()
        .images;
    assert_eq!(images, std::slice::from_ref(&image));

    // Errors arrive typed, with their stable reason.
    let missing = client
        .get_image(pb::GetImageRequest {
            image_id: "img_missing".into(),
        })
        .await
        .unwrap_err();
    let missing = ApiError::from_status(&missing);
    assert_eq!(
        (missing.code, missing.reason.as_ref()),
        (Code::NotFound, "IMAGE_NOT_FOUND")
    );
    let invalid = client
        .create_container(pb::CreateContainerRequest {
            container_id: "no spaces".into(),
        })
        .await;
    let invalid = ApiError::from_status(&invalid.unwrap_err());
    assert_eq!(
        (invalid.code, invalid.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_CONTAINER_ID")
    );
    let no_body = pb::AppendMessageRequest {
        session_id: image.session_id.clone(),
        message: Some(pb::Message {
            message_id: "msg_2".into(),
            ..pb::Message::default()
        }),
    };
    let no_body = ApiError::from_status(&client.append_message(no_body).await.unwrap_err());
    assert_eq!(no_body.reason, "MESSAGE_BODY_REQUIRED");
    let mismatch = pb::AppendMessageRequest {
        session_id: image.session_id.clone(),
        message: Some(pb::Message {
            session_id: "sess_other".into(),
            ..message
        }),
    };
    let mismatch = ApiError::from_status(&client.append_message(mismatch).await.unwrap_err());
    assert_eq!(mismatch.reason, "SESSION_ID_MISMATCH");

    let deleted = client
        .delete_container(pb::DeleteContainerRequest {
            container_id: "default".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deleted.deleted_image_ids, [image.image_id]);
}
