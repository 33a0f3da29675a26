//! The rules live in the services that own them, so a caller of the gRPC
//! APIs gets what REST and WebSocket callers get: deleting stops agents,
//! images show their agent, references and content are checked, and the
//! message events are the objects the history returns.

use std::time::Duration;

use anyhow::ensure;
use avm_common::ApiError;
use avm_proto::runtime::v1 as rt;
use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use avm_proto::session::v1 as ss;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_tests::cluster::{Cluster, Mode};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::both_modes;
use crate::support::{assert_text_turn, cluster, conversation, send_and_finish};

/// How long an agent may take to stop after its image was deleted behind the runtime's back.
const DEADLINE: Duration = Duration::from_secs(10);

async fn channel(url: &str) -> anyhow::Result<Channel> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect()
        .await?)
}

type Interceptor = Box<dyn FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Send>;
type RuntimeClient = RuntimeServiceClient<tonic::service::interceptor::InterceptedService<Channel, Interceptor>>;

/// Clients of the session and runtime services as the operator admin.
async fn clients(
    cluster: &Cluster,
) -> anyhow::Result<(
    SessionServiceClient<tonic::service::interceptor::InterceptedService<Channel, Interceptor>>,
    RuntimeClient,
)> {
    let token: tonic::metadata::MetadataValue<tonic::metadata::Ascii> =
        format!("Bearer {}", cluster.access_token(&cluster.admin_key).await?).parse()?;
    let interceptor = |token: tonic::metadata::MetadataValue<tonic::metadata::Ascii>| -> Interceptor {
        Box::new(move |mut request: tonic::Request<()>| {
            request.metadata_mut().insert("authorization", token.clone());
            Ok(request)
        })
    };
    let (session, runtime) = (interceptor(token.clone()), interceptor(token));
    Ok((
        SessionServiceClient::with_interceptor(channel(&cluster.session_grpc).await?, session),
        RuntimeServiceClient::with_interceptor(channel(&cluster.runtime_grpc).await?, runtime),
    ))
}

fn reason(status: &tonic::Status) -> String {
    ApiError::from_status(status).reason.into_owned()
}

both_modes!(deleting_through_any_api_stops_the_agents, deleting);

async fn deleting(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let (mut session, mut runtime) = clients(&cluster).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;

    // The public API deletes through the session service; the runtime
    // hears of it and stops the agent.
    let first = conversation(&mut client, "rules", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &first.image_id, json!("hello")).await?);
    client
        .request("image_delete", json!({"imageId": first.image_id}))
        .await?;
    stopped(&mut runtime, &first.image_id, "a deleted image").await?;
    let agents = client.request("agent_list", json!({"containerId": "rules"})).await?;
    assert_eq!(agents["agents"], json!([]), "no agent outlives its image");

    // The session service's own DeleteContainer, called directly, stops them alike.
    let second = conversation(&mut client, "rules", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &second.image_id, json!("hello again")).await?);
    let running = client.request("agent_list", json!({"containerId": "rules"})).await?;
    ensure!(
        running["agents"].as_array().is_some_and(|agents| agents.len() == 1),
        "{running}"
    );
    session
        .delete_container(ss::DeleteContainerRequest {
            container_id: "rules".into(),
        })
        .await?;
    stopped(&mut runtime, &second.image_id, "a deleted container").await?;
    // And deleting a missing container says so.
    let missing = session
        .delete_container(ss::DeleteContainerRequest {
            container_id: "rules".into(),
        })
        .await
        .err()
        .map(|status| reason(&status));
    assert_eq!(missing.as_deref(), Some("CONTAINER_NOT_FOUND"));
    Ok(())
}

both_modes!(new_tools_through_any_api_restart_the_agent, retooling);

async fn retooling(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let (mut session, mut runtime) = clients(&cluster).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "retool", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("hello")).await?);

    // A new name alone leaves the running agent be.
    session
        .update_image(ss::UpdateImageRequest {
            image_id: chat.image_id.clone(),
            name: Some("renamed".into()),
            ..Default::default()
        })
        .await?;
    ensure!(
        runs(&mut runtime, &chat.image_id).await?,
        "a renamed image's agent runs on"
    );
    // New tools through the session service itself: the runtime hears of
    // them and stops the agent, so the next message starts it with them.
    session
        .update_image(ss::UpdateImageRequest {
            image_id: chat.image_id.clone(),
            tools: Some(ss::ToolList {
                tools: vec!["write_file".into()],
            }),
            ..Default::default()
        })
        .await?;
    stopped(&mut runtime, &chat.image_id, "an image with new tools").await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("again")).await?;
    assert_text_turn(&frames);
    ensure!(
        runs(&mut runtime, &chat.image_id).await?,
        "the next message starts the agent again"
    );
    Ok(())
}

/// Returns whether an agent of `image_id` runs, as the runtime lists them.
async fn runs(runtime: &mut RuntimeClient, image_id: &str) -> anyhow::Result<bool> {
    let agents = runtime
        .list_agents(rt::ListAgentsRequest { container_id: None })
        .await?
        .into_inner()
        .agents;
    Ok(agents.iter().any(|agent| agent.image_id == image_id))
}

/// Waits until no agent of `image_id` runs (the runtime acts on the
/// session service's announcement of the deletion), for at most [`DEADLINE`].
async fn stopped(runtime: &mut RuntimeClient, image_id: &str, what: &str) -> anyhow::Result<()> {
    let start = tokio::time::Instant::now();
    loop {
        if !runs(runtime, image_id).await? {
            return Ok(());
        }
        ensure!(start.elapsed() < DEADLINE, "the agent of {what} still runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

both_modes!(images_show_their_agent_to_every_api, online);

async fn online(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let (_, mut runtime) = clients(&cluster).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    let view = |image: Option<rt::ImageView>| image.map(|view| (view.image.is_some(), view.agent.map(|a| a.agent_id)));
    let before = runtime
        .get_image(rt::GetImageRequest {
            image_id: chat.image_id.clone(),
        })
        .await?
        .into_inner()
        .image;
    assert_eq!(view(before), Some((true, None)), "no agent yet");
    let run = client.request("image_run", json!({"imageId": chat.image_id})).await?;
    let agent_id = run["agentId"].as_str().unwrap_or_default().to_owned();
    let after = runtime
        .get_image(rt::GetImageRequest {
            image_id: chat.image_id.clone(),
        })
        .await?
        .into_inner()
        .image;
    assert_eq!(view(after), Some((true, Some(agent_id.clone()))));
    let listed = runtime
        .list_images(rt::ListImagesRequest {
            container_id: Some("default".into()),
            parent_image_id: None,
        })
        .await?
        .into_inner()
        .images;
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].agent.as_ref().map(|a| a.agent_id.as_str()),
        Some(agent_id.as_str())
    );
    let rest: Value = cluster
        .http()?
        .get(cluster.url(&format!("/v1/images/{}", chat.image_id)))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(
        (rest["online"].clone(), rest["agentId"].clone()),
        (json!(true), json!(agent_id))
    );
    Ok(())
}

both_modes!(references_and_content_are_checked_for_every_caller, checked);

async fn checked(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let (mut session, mut runtime) = clients(&cluster).await?;
    session
        .create_container(ss::CreateContainerRequest {
            container_id: "checks".into(),
        })
        .await?;
    // A reference that does not resolve is refused at creation, over gRPC as over REST.
    let grpc = session
        .create_image(ss::CreateImageRequest {
            container_id: "checks".into(),
            system_prompt: Some("resource://prompts/nowhere".into()),
            ..Default::default()
        })
        .await
        .err()
        .map(|status| reason(&status));
    let (status, body) = crate::support::call(
        &cluster,
        "POST",
        "/v1/containers/checks/images",
        Some(json!({"systemPrompt": "resource://prompts/nowhere"})),
    )
    .await?;
    assert_eq!(status, 404);
    assert_eq!(grpc.as_deref(), body["error"]["code"].as_str());
    assert_eq!(grpc.as_deref(), Some("RESOURCE_NOT_FOUND"));

    // Content is checked by the runtime, whoever sends it.
    let image = session
        .create_image(ss::CreateImageRequest {
            container_id: "checks".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .image
        .map(|image| image.image_id)
        .unwrap_or_default();
    let part = |part: ss::content_part::Part| ss::ContentPart { part: Some(part) };
    for (content, expected) in [
        (
            vec![part(ss::content_part::Part::Text(ss::TextPart { text: "  ".into() }))],
            "EMPTY_CONTENT",
        ),
        (Vec::new(), "EMPTY_CONTENT"),
        (
            vec![part(ss::content_part::Part::Image(ss::ImagePart {
                data: "AAA=".into(),
                media_type: String::new(),
            }))],
            "INVALID_CONTENT",
        ),
    ] {
        let refused = runtime
            .send_message(rt::SendMessageRequest {
                image_id: image.clone(),
                content,
                plain_text: false,
            })
            .await
            .err()
            .map(|status| reason(&status));
        assert_eq!(refused.as_deref(), Some(expected));
    }
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let answer = client
        .request(
            "message_send",
            json!({"imageId": image, "content": [{"type": "image", "data": "AAA="}]}),
        )
        .await?;
    assert_eq!(answer["code"], "INVALID_CONTENT", "{answer}");
    Ok(())
}

both_modes!(message_events_are_the_history_objects, history_objects);

async fn history_objects(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    let frames = send_and_finish(
        &mut client,
        &chat.image_id,
        json!([{"type": "text", "text": "parts, please"}]),
    )
    .await?;
    assert_text_turn(&frames);
    let event = frames
        .iter()
        .find(|frame| frame["type"] == "assistant_message")
        .map(|frame| frame["data"].clone())
        .unwrap_or_default();
    let history = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let messages = history["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(messages.len(), 2, "{history}");
    assert_eq!(messages[1], event, "the event is the stored message");
    assert_eq!(
        messages[0]["content"],
        json!([{"type": "text", "text": "parts, please"}])
    );
    Ok(())
}
