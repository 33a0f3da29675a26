//! The REST API, with server-sent events for a turn and for resuming.

use avm_tests::cluster::Mode;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, assert_typed_events, cluster};

/// Reads an SSE body until an event of type `until`; returns (id, event, data) triples.
async fn read_sse(response: reqwest::Response, until: &str) -> anyhow::Result<Vec<(Option<String>, String, Value)>> {
    let mut stream = crate::support::SseStream::new(response);
    let mut events = Vec::new();
    loop {
        let event = stream.next_event().await?;
        let done = event.1 == until;
        events.push(event);
        if done {
            return Ok(events);
        }
    }
}

both_modes!(the_rest_api_runs_a_conversation, rest);

async fn rest(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let http = cluster.http()?;
    let url = |path: &str| cluster.url(path);

    let health: Value = http.get(url("/health")).send().await?.json().await?;
    assert_eq!(health["status"], "ok");
    assert_eq!(health["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(http.get(url("/ready")).send().await?.status(), StatusCode::OK);

    let created = http
        .post(url("/v1/containers"))
        .json(&json!({"containerId": "web"}))
        .send()
        .await?;
    assert_eq!(created.status(), StatusCode::CREATED);
    let again = http
        .post(url("/v1/containers"))
        .json(&json!({"containerId": "web"}))
        .send()
        .await?;
    assert_eq!(again.status(), StatusCode::OK);
    let response = http
        .post(url("/v1/containers/web/images"))
        .json(&json!({"name": "rest", "systemPrompt": "hi"}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::CREATED);
    let record: Value = response.json().await?;
    let image_id = record["imageId"].as_str().unwrap_or_default().to_owned();
    assert_eq!(record["name"], "rest");

    let patched: Value = http
        .patch(url(&format!("/v1/images/{image_id}")))
        .json(&json!({"name": "renamed"}))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(patched["name"], "renamed");
    let listed: Value = http.get(url("/v1/containers/web/images")).send().await?.json().await?;
    assert_eq!(listed["images"][0]["imageId"], image_id.as_str());

    // POST a message: the turn streams back as server-sent events with cursors.
    let response = http
        .post(url(&format!("/v1/images/{image_id}/messages")))
        .json(&json!({"content": "over http"}))
        .send()
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()["content-type"]
            .to_str()?
            .starts_with("text/event-stream")
    );
    let events = read_sse(response, "conversation_end").await?;
    assert_eq!(events[0].1, "message_send_response");
    let mut frames = vec![
        json!({"type": "message_persisted"}),
        json!({"type": "message_send_response"}),
    ];
    frames.extend(events.iter().skip(1).map(|(_, _, data)| data.clone()));
    assert_typed_events(&frames[2..]);
    assert_text_turn(&frames);
    assert!(
        events
            .iter()
            .skip(1)
            .all(|(id, kind, data)| id.as_deref() == data["cursor"].as_str() && data["type"] == kind.as_str())
    );

    let history: Value = http
        .get(url(&format!("/v1/images/{image_id}/messages")))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(history["messages"].as_array().map(Vec::len), Some(2));

    // Resume from a cursor: everything after message_start, in order.
    let start = events
        .iter()
        .find(|(_, kind, _)| kind == "message_start")
        .and_then(|(id, _, _)| id.clone())
        .unwrap_or_default();
    let response = http
        .get(url(&format!("/v1/images/{image_id}/events?after={start}")))
        .send()
        .await?;
    let resumed = read_sse(response, "conversation_end").await?;
    let expected: Vec<&String> = events
        .iter()
        .skip_while(|(_, kind, _)| kind != "message_start")
        .skip(1)
        .map(|(_, kind, _)| kind)
        .collect();
    assert_eq!(resumed.iter().map(|(_, kind, _)| kind).collect::<Vec<_>>(), expected);

    let interrupt: Value = http
        .post(url(&format!("/v1/images/{image_id}/interrupt")))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(interrupt["interrupted"], false);
    let agents: Value = http.get(url("/v1/agents?containerId=web")).send().await?.json().await?;
    let agent_id = agents["agents"][0]["agentId"].as_str().unwrap_or_default().to_owned();
    assert!(agent_id.starts_with("agent_"));
    assert_eq!(
        http.get(url(&format!("/v1/agents/{agent_id}"))).send().await?.status(),
        StatusCode::OK
    );
    let stopped: Value = http
        .post(url(&format!("/v1/images/{image_id}/stop")))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(stopped["stopped"], true);
    assert_eq!(
        http.get(url(&format!("/v1/agents/{agent_id}"))).send().await?.status(),
        StatusCode::NOT_FOUND
    );

    // Errors are typed documents with the request id.
    let missing = http
        .get(url("/v1/images/img_missing"))
        .header("x-request-id", "req_mine")
        .send()
        .await?;
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let body: Value = missing.json().await?;
    assert_eq!(body["error"]["code"], "IMAGE_NOT_FOUND");
    assert_eq!(body["error"]["requestId"], "req_mine");
    let bad = http.post(url("/v1/containers")).body("{not json").send().await?;
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert_eq!(bad.json::<Value>().await?["error"]["code"], "INVALID_JSON");
    let nowhere = http.get(url("/v1/nowhere")).send().await?;
    assert_eq!(nowhere.status(), StatusCode::NOT_FOUND);
    assert_eq!(nowhere.json::<Value>().await?["error"]["code"], "ROUTE_NOT_FOUND");
    let wrong = http
        .post(url(&format!("/v1/images/{image_id}/messages")))
        .json(&json!({"content": 5}))
        .send()
        .await?;
    assert_eq!(wrong.status(), StatusCode::BAD_REQUEST);

    let deleted = http.delete(url(&format!("/v1/images/{image_id}"))).send().await?;
    assert_eq!(deleted.status(), StatusCode::OK);
    assert_eq!(
        http.get(url(&format!("/v1/images/{image_id}"))).send().await?.status(),
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        http.delete(url("/v1/containers/web")).send().await?.status(),
        StatusCode::OK
    );
    assert_eq!(
        http.get(url("/v1/containers/web")).send().await?.status(),
        StatusCode::NOT_FOUND
    );
    Ok(())
}
