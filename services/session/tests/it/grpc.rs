//! The gRPC adapter over a real listener and the generated client.

use avm_common::config::GrpcConfig;
use avm_common::testing::{TestKeys, bearer, serve_grpc};
use avm_common::{ApiError, Code};
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_session::{SessionService, grpc_server};
use tonic::transport::Server;

use crate::support::TestDb;

/// Serves the session service over gRPC on a fresh SQLite store; returns the
/// store (kept alive), the token keys it trusts and a channel to it.
pub(crate) async fn serve() -> (TestDb, TestKeys, tonic::transport::Channel) {
    let db = TestDb::sqlite().await;
    let keys = TestKeys::new();
    let server = grpc_server(
        SessionService::new(db.store.clone()),
        keys.verifier(),
        &GrpcConfig::default(),
    );
    let channel = serve_grpc(Server::builder().add_service(server)).await;
    (db, keys, channel)
}

#[tokio::test]
async fn grpc_round_trip_and_typed_errors() {
    let (_db, keys, channel) = serve().await;

    // Without a token nothing is answered but UNAUTHENTICATED.
    let anonymous = SessionServiceClient::new(channel.clone())
        .list_containers(pb::ListContainersRequest {})
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&anonymous).code, Code::Unauthenticated);

    // The runtime's identity: it alone writes assistant messages.
    let ctx = avm_common::testing::service_ctx("tenant-grpc");
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
            metadata_json: r#"{"pinned":true}"#.into(),
            parent_image_id: None,
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
            context_only: false,
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(listed, [stored]);

    let images = client
        .list_images(pb::ListImagesRequest::default())
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

#[tokio::test]
async fn grpc_groups_round_trip_and_typed_errors() {
    let (_db, keys, channel) = serve().await;
    let ctx = crate::support::ctx("tenant-grpc");
    let mut client = SessionServiceClient::with_interceptor(channel.clone(), bearer(&keys.token(&ctx)));
    let other_tenant = crate::support::ctx("tenant-other");
    let mut outsider = SessionServiceClient::with_interceptor(channel.clone(), bearer(&keys.token(&other_tenant)));
    // Only the runtime posts as an agent and moves its cursor.
    let runtime_ctx = avm_common::testing::service_ctx("tenant-grpc");
    let mut runtime = SessionServiceClient::with_interceptor(channel, bearer(&keys.token(&runtime_ctx)));

    client
        .create_container(pb::CreateContainerRequest {
            container_id: "room".into(),
        })
        .await
        .unwrap();
    let image = client
        .create_image(pb::CreateImageRequest {
            container_id: "room".into(),
            ..pb::CreateImageRequest::default()
        })
        .await
        .unwrap()
        .into_inner()
        .image
        .unwrap();
    let agent = pb::GroupMemberRef {
        kind: pb::GroupMemberKind::Agent.into(),
        member_id: image.image_id.clone(),
    };
    let me = pb::GroupMemberRef {
        kind: pb::GroupMemberKind::User.into(),
        member_id: "usr_admin".into(),
    };
    let group = client
        .create_group(pb::CreateGroupRequest {
            container_id: "room".into(),
            name: "team".into(),
            wake_mode: pb::GroupWakeMode::Mentions.into(),
            members: vec![agent.clone()],
        })
        .await
        .unwrap()
        .into_inner()
        .group
        .unwrap();
    assert_eq!(group.wake_mode(), pb::GroupWakeMode::Mentions);
    let joined = client
        .add_group_member(pb::AddGroupMemberRequest {
            group_id: group.group_id.clone(),
            member: Some(me.clone()),
        })
        .await
        .unwrap()
        .into_inner()
        .member
        .unwrap();
    assert_eq!((joined.member.as_ref(), joined.read_seq), (Some(&me), 0));
    let again = client
        .add_group_member(pb::AddGroupMemberRequest {
            group_id: group.group_id.clone(),
            member: Some(me.clone()),
        })
        .await
        .unwrap_err();
    let again = ApiError::from_status(&again);
    assert_eq!(
        (again.code, again.reason.as_ref()),
        (Code::AlreadyExists, "GROUP_MEMBER_EXISTS")
    );

    // The runtimes learn of each new message from the session's changes.
    let mut changes = runtime
        .watch_session_events(pb::WatchSessionEventsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(changes.message().await.unwrap().is_some_and(|first| first.live));
    let posted = client
        .post_group_message(pb::PostGroupMessageRequest {
            group_id: group.group_id.clone(),
            message_id: "q1".into(),
            sender: Some(me.clone()),
            content: "what do you think?".into(),
            mentions: vec![image.image_id.clone()],
            read_seq: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(posted.created);
    let question = posted.message.unwrap();
    assert_eq!((question.seq, question.consecutive_agent_messages), (1, 0));
    let reply = pb::PostGroupMessageRequest {
        group_id: group.group_id.clone(),
        message_id: "a1".into(),
        sender: Some(agent.clone()),
        content: "I think so".into(),
        mentions: Vec::new(),
        // Written without reading the question: the question stays unread to it.
        read_seq: Some(0),
    };
    let forged = client.post_group_message(reply.clone()).await.unwrap_err();
    assert_eq!(forged.code(), tonic::Code::PermissionDenied);
    let answer = runtime.post_group_message(reply.clone()).await.unwrap().into_inner();
    assert_eq!(
        answer.message.as_ref().map(|m| (m.seq, m.consecutive_agent_messages)),
        Some((2, 1))
    );
    assert_eq!(
        answer.sender_read_seq,
        Some(0),
        "the agent's cursor stays before the question it did not read"
    );
    let replayed = runtime.post_group_message(reply).await.unwrap().into_inner();
    assert_eq!((replayed.created, replayed.message), (false, answer.message.clone()));
    // Each new message is announced once; the re-post is not.
    let announced = |change: Option<pb::WatchSessionEventsResponse>| {
        change.and_then(|change| Some((change.tenant_id, change.posted?.seq)))
    };
    let tenant = || ctx.tenant_id.clone();
    assert_eq!(announced(changes.message().await.unwrap()), Some((tenant(), 1)));
    assert_eq!(announced(changes.message().await.unwrap()), Some((tenant(), 2)));
    // The members in the order they joined. The sender of the question read
    // up to it; the agent, which said it read nothing, has both unread.
    let members = client
        .list_group_members(pb::ListGroupMembersRequest {
            group_id: group.group_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .members;
    assert_eq!(
        members
            .iter()
            .map(|m| (m.member.clone().unwrap(), m.read_seq))
            .collect::<Vec<_>>(),
        [(agent.clone(), 0), (me.clone(), 1)]
    );

    let unread = client
        .list_unread(pb::ListUnreadRequest {
            member: Some(agent.clone()),
            message_limit: 10,
        })
        .await
        .unwrap()
        .into_inner()
        .groups;
    assert_eq!(unread.len(), 1);
    assert_eq!((unread[0].unread_count, unread[0].messages.len()), (2, 2));
    assert_eq!(unread[0].messages[0], question);
    let advanced = runtime
        .advance_read_cursor(pb::AdvanceReadCursorRequest {
            group_id: group.group_id.clone(),
            member: Some(agent.clone()),
            seq: 2,
        })
        .await
        .unwrap()
        .into_inner()
        .member
        .unwrap();
    assert_eq!(advanced.read_seq, 2);
    let history = client
        .list_group_messages(pb::ListGroupMessagesRequest {
            group_id: group.group_id.clone(),
            after_seq: 1,
            limit: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .messages;
    assert_eq!(history, [answer.message.unwrap()]);
    // The next announcement is the next new message: the re-post had none.
    client
        .post_group_message(pb::PostGroupMessageRequest {
            group_id: group.group_id.clone(),
            message_id: "q2".into(),
            sender: Some(me.clone()),
            content: "and now?".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(announced(changes.message().await.unwrap()), Some((tenant(), 3)));
    // A sender claiming to have read past the end reads to the newest
    // message, never beyond; and moves only its own cursor.
    let read_all = client
        .post_group_message(pb::PostGroupMessageRequest {
            group_id: group.group_id.clone(),
            message_id: "q3".into(),
            sender: Some(me.clone()),
            content: "read it all".into(),
            read_seq: Some(u64::MAX),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        read_all.sender_read_seq,
        Some(4),
        "the post answers with its sender's cursor"
    );
    let cursors: Vec<u64> = client
        .list_group_members(pb::ListGroupMembersRequest {
            group_id: group.group_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .members
        .iter()
        .map(|m| m.read_seq)
        .collect();
    assert_eq!(
        cursors,
        [2, 4],
        "the agent's cursor (moved to 2 above), then the sender's"
    );
    assert_eq!(announced(changes.message().await.unwrap()), Some((tenant(), 4)));
    // New tools are announced, whoever changes them (a new name is not), so
    // the runtimes restart the image's agent with them.
    for tools in [None, Some(vec!["write_file".to_owned()])] {
        client
            .update_image(pb::UpdateImageRequest {
                image_id: image.image_id.clone(),
                name: Some("renamed".into()),
                description: None,
                tools: tools.map(|tools| pb::ToolList { tools }),
                metadata_json: None,
            })
            .await
            .unwrap();
    }
    let retooled = changes.message().await.unwrap().and_then(|change| change.retooled);
    assert_eq!(
        retooled,
        Some(pb::ImageRetooled {
            image_id: image.image_id.clone(),
            tools: vec!["write_file".into()],
        })
    );

    let updated = client
        .update_group(pb::UpdateGroupRequest {
            group_id: group.group_id.clone(),
            name: Some("renamed".into()),
            wake_mode: Some(pb::GroupWakeMode::All.into()),
        })
        .await
        .unwrap()
        .into_inner()
        .group
        .unwrap();
    assert_eq!(
        (updated.name.as_str(), updated.wake_mode()),
        ("renamed", pb::GroupWakeMode::All)
    );
    let listed = client
        .list_groups(pb::ListGroupsRequest {
            container_id: "room".into(),
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (listed.groups, listed.next_page_token),
        (vec![updated.clone()], String::new())
    );

    // Typed refusals: a kind is required, a foreign tenant sees nothing.
    let kindless = client
        .remove_group_member(pb::RemoveGroupMemberRequest {
            group_id: group.group_id.clone(),
            member: Some(pb::GroupMemberRef {
                kind: pb::GroupMemberKind::Unspecified.into(),
                member_id: "usr_admin".into(),
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&kindless).reason, "INVALID_MEMBER_KIND");
    let foreign = outsider
        .get_group(pb::GetGroupRequest {
            group_id: group.group_id.clone(),
        })
        .await
        .unwrap_err();
    let foreign = ApiError::from_status(&foreign);
    assert_eq!(
        (foreign.code, foreign.reason.as_ref()),
        (Code::NotFound, "GROUP_NOT_FOUND")
    );

    client
        .remove_group_member(pb::RemoveGroupMemberRequest {
            group_id: group.group_id.clone(),
            member: Some(me),
        })
        .await
        .unwrap();
    client
        .delete_group(pb::DeleteGroupRequest {
            group_id: group.group_id.clone(),
        })
        .await
        .unwrap();
    let gone = client
        .get_group(pb::GetGroupRequest {
            group_id: group.group_id,
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound);
}
