//! Export and import, against SQLite and Postgres: a conversation's round
//! trip field by field, a container's, idempotence on the document id, the
//! documents refused with nothing written, export in pieces, and whose
//! conversations may go out and in.

use std::sync::Arc;

use avm_session::{
    EXPORT_CHUNK_BYTES, ImageRecord, MAX_IMPORT_BYTES, MessageBody, MessageRecord, NewImage, NewMessage,
    SessionService, SessionStore, ShareRole, Usage,
};
use futures::TryStreamExt;
use serde_json::{Value, json};

use crate::support::{ctx, member, reason};

conformance_suite!(
    a_conversation_round_trips_field_by_field,
    a_container_round_trips_as_json_lines,
    imports_are_idempotent_on_the_document_id,
    bad_documents_are_refused_with_nothing_written,
    exports_come_in_bounded_pieces,
    only_readers_export_and_users_import,
);

const A: &str = "tenant-a";

fn runtime(tenant_id: &str) -> avm_common::RequestContext {
    avm_common::testing::service_ctx(tenant_id)
}

/// A conversation with a full configuration and every kind of message.
async fn full_conversation(service: &SessionService, container_id: &str) -> ImageRecord {
    let admin = ctx(A);
    service.create_container(&admin, container_id).await.expect("container");
    let image = service
        .create_image(
            &admin,
            NewImage {
                container_id: container_id.to_owned(),
                name: Some("Réunion « notes »".to_owned()),
                description: Some("with a description".to_owned()),
                system_prompt: Some("You are terse.".to_owned()),
                mcp_servers_json: r#"{"files":{"type":"http","url":"https://mcp.example.com/x"}}"#.to_owned(),
                variables_json: r#"{"who":"ops"}"#.to_owned(),
                tools: vec!["run_command".to_owned(), "read_file".to_owned()],
                metadata_json: r#"{"pinned":true}"#.to_owned(),
                ..NewImage::default()
            },
        )
        .await
        .expect("image");
    let bodies = [
        MessageBody::User {
            content_json: r#""plain \"quoted\" text""#.to_owned(),
        },
        MessageBody::Assistant {
            text: "calling a tool".to_owned(),
            usage: Some(Usage {
                input_tokens: 120,
                output_tokens: 7,
            }),
            interrupted: false,
            model: "claude-sonnet-4-20250514".to_owned(),
            stop_reason: "tool_use".to_owned(),
            resources: vec!["resource://prompts/terse@3".to_owned()],
        },
        MessageBody::ToolCall {
            tool_call_id: "toolu_1".to_owned(),
            tool_name: "shell".to_owned(),
            input_json: r#"{"command":"ls"}"#.to_owned(),
            parent_id: "m2".to_owned(),
        },
        MessageBody::ToolResult {
            tool_call_id: "toolu_1".to_owned(),
            tool_name: "shell".to_owned(),
            output: "a.txt\nb.txt\u{0}".to_owned(),
            is_error: false,
        },
        MessageBody::Assistant {
            text: "two files".to_owned(),
            usage: Some(Usage {
                input_tokens: 140,
                output_tokens: 3,
            }),
            interrupted: true,
            model: "claude-sonnet-4-20250514".to_owned(),
            stop_reason: "end_turn".to_owned(),
            resources: vec![
                "resource://prompts/terse@3".to_owned(),
                "resource://tools/x@1".to_owned(),
            ],
        },
        MessageBody::User {
            content_json:
                json!([{"type": "text", "text": "look"}, {"type": "image", "data": "AAAA", "mediaType": "image/png"}])
                    .to_string(),
        },
        MessageBody::Error {
            text: "the model failed".to_owned(),
            error_code: "LLM_ERROR".to_owned(),
        },
    ];
    for (n, body) in bodies.into_iter().enumerate() {
        service
            .append_message(
                &runtime(A),
                &image.session_id,
                NewMessage {
                    message_id: format!("m{}", n + 1),
                    created_at_ms: 1_700_000_000_000 + n as i64,
                    body,
                },
            )
            .await
            .expect("append");
    }
    image
}

async fn export_bytes(service: &SessionService, cx: &avm_common::RequestContext, image_id: &str) -> Vec<u8> {
    let pieces: Vec<Vec<u8>> = service
        .export_image(cx, image_id)
        .await
        .expect("export")
        .try_collect()
        .await
        .expect("export pieces");
    pieces.concat()
}

/// What must survive a round trip of a message: all but its session.
fn kept(messages: &[MessageRecord]) -> Vec<(String, u64, i64, MessageBody)> {
    messages
        .iter()
        .map(|m| (m.message_id.clone(), m.seq, m.created_at_ms, m.body.clone()))
        .collect()
}

/// What must survive a round trip of an image: its configuration.
fn config(image: &ImageRecord) -> Value {
    json!({
        "name": image.name,
        "description": image.description,
        "systemPrompt": image.system_prompt,
        "mcpServers": image.mcp_servers_json,
        "agent": image.agent,
        "variables": image.variables_json,
        "tools": image.tools,
        "metadata": image.metadata_json,
    })
}

async fn a_conversation_round_trips_field_by_field(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let original = full_conversation(&service, "from").await;
    let document = export_bytes(&service, &admin, &original.image_id).await;
    let parsed: Value = serde_json::from_slice(&document).expect("the export is one JSON document");
    assert_eq!(parsed["format"], "agentvm.conversation");
    assert_eq!(parsed["version"], 1);
    assert_eq!(parsed["source"]["imageId"], original.image_id.as_str());
    assert_eq!(parsed["messages"].as_array().map(Vec::len), Some(7));
    assert_eq!(parsed["usage"], json!({"inputTokens": 260, "outputTokens": 10}));
    assert_eq!(
        parsed["resources"],
        json!(["resource://prompts/terse@3", "resource://tools/x@1"])
    );
    assert_eq!(parsed["image"]["mcpServers"]["files"]["type"], "http");
    assert_eq!(parsed["image"]["metadata"], json!({"pinned": true}));
    assert_eq!(parsed["messages"][5]["body"]["content"][1]["mediaType"], "image/png");

    service.create_container(&admin, "to").await.expect("container");
    let imported = service.import(&admin, "to", &document).await.expect("import");
    assert_eq!(imported.len(), 1);
    let copy = &imported[0];
    assert!(copy.created);
    assert_eq!(copy.document_id, parsed["documentId"].as_str().unwrap());
    assert_ne!(copy.image.image_id, original.image_id, "an import makes new ids");
    assert_ne!(copy.image.session_id, original.session_id);
    assert_eq!(copy.image.container_id, "to");
    assert_eq!(config(&copy.image), config(&original));
    let stored = service.get_image(&admin, &copy.image.image_id).await.expect("get");
    assert_eq!(config(&stored), config(&original));
    let before = service
        .list_messages(&admin, &original.session_id)
        .await
        .expect("history");
    let after = service
        .list_messages(&admin, &copy.image.session_id)
        .await
        .expect("history");
    assert_eq!(kept(&after), kept(&before), "every message, field by field");

    // The copy exports as the original did, but for where and when it was made.
    let again: Value = serde_json::from_slice(&export_bytes(&service, &admin, &copy.image.image_id).await).unwrap();
    for field in ["messages", "usage", "resources", "format", "version"] {
        assert_eq!(again[field], parsed[field], "{field}");
    }
    for field in [
        "name",
        "description",
        "systemPrompt",
        "mcpServers",
        "variables",
        "tools",
        "metadata",
    ] {
        assert_eq!(again["image"][field], parsed["image"][field], "image.{field}");
    }

    // The copy goes on: the next message takes the next seq.
    let next = service
        .append_message(&admin, &copy.image.session_id, crate::support::user("m8", "and on"))
        .await
        .expect("append");
    assert_eq!(next.seq, 8);
}

async fn a_container_round_trips_as_json_lines(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let first = full_conversation(&service, "box").await;
    let second = service
        .create_image(
            &admin,
            NewImage {
                container_id: "box".to_owned(),
                name: Some("Empty".to_owned()),
                ..NewImage::default()
            },
        )
        .await
        .expect("image");
    let pieces: Vec<Vec<u8>> = service
        .export_container(&admin, "box")
        .await
        .expect("export")
        .try_collect()
        .await
        .expect("pieces");
    let text = String::from_utf8(pieces.concat()).expect("utf-8");
    let lines: Vec<Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert!(text.ends_with('\n'));
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["format"], "agentvm.container");
    assert_eq!(lines[0]["containerId"], "box");
    assert_eq!(lines[0]["conversations"], 2);
    // Oldest first.
    assert_eq!(lines[1]["source"]["imageId"], first.image_id.as_str());
    assert_eq!(lines[2]["source"]["imageId"], second.image_id.as_str());
    assert_eq!(lines[2]["messages"], json!([]));

    service.create_container(&admin, "copy").await.expect("container");
    let imported = service.import(&admin, "copy", text.as_bytes()).await.expect("import");
    assert_eq!(imported.len(), 2);
    let images = service.list_images(&admin, Some("copy")).await.expect("list");
    assert_eq!(images.len(), 2);
    let copy = imported
        .iter()
        .find(|item| item.image.name == first.name)
        .expect("first")
        .image
        .clone();
    let before = service.list_messages(&admin, &first.session_id).await.unwrap();
    let after = service.list_messages(&admin, &copy.session_id).await.unwrap();
    assert_eq!(kept(&after), kept(&before));
}

async fn imports_are_idempotent_on_the_document_id(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let original = full_conversation(&service, "from").await;
    let document = export_bytes(&service, &admin, &original.image_id).await;
    service.create_container(&admin, "to").await.unwrap();
    let first = service.import(&admin, "to", &document).await.unwrap();
    let second = service.import(&admin, "to", &document).await.unwrap();
    assert!(first[0].created && !second[0].created);
    assert_eq!(first[0].image.image_id, second[0].image.image_id);
    assert_eq!(service.list_images(&admin, Some("to")).await.unwrap().len(), 1);
    // Racing imports of one document make one conversation.
    service.create_container(&admin, "raced").await.unwrap();
    let (a, b) = tokio::join!(
        service.import(&admin, "raced", &document),
        service.import(&admin, "raced", &document)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a[0].image.image_id, b[0].image.image_id);
    assert!(a[0].created != b[0].created);
    // Another container is another copy; deleting a copy lets it come back.
    service.delete_image(&admin, &first[0].image.image_id).await.unwrap();
    let third = service.import(&admin, "to", &document).await.unwrap();
    assert!(third[0].created);
    assert_ne!(third[0].image.image_id, first[0].image.image_id);
}

async fn bad_documents_are_refused_with_nothing_written(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let original = full_conversation(&service, "from").await;
    let good: Value = serde_json::from_slice(&export_bytes(&service, &admin, &original.image_id).await).unwrap();
    service.create_container(&admin, "to").await.unwrap();
    let import = |document: Vec<u8>| {
        let service = service.clone();
        let admin = admin.clone();
        async move { reason(service.import(&admin, "to", &document).await) }
    };
    let with = |change: &dyn Fn(&mut Value)| {
        let mut document = good.clone();
        change(&mut document);
        serde_json::to_vec(&document).unwrap()
    };
    assert_eq!(import(b"{not json".to_vec()).await, "INVALID_DOCUMENT");
    assert_eq!(import(vec![0xff, 0xfe]).await, "INVALID_DOCUMENT");
    assert_eq!(import(b"[]".to_vec()).await, "INVALID_DOCUMENT");
    assert_eq!(
        import(with(&|d| d["format"] = json!("other"))).await,
        "INVALID_DOCUMENT"
    );
    assert_eq!(import(with(&|d| d["version"] = json!(2))).await, "UNSUPPORTED_VERSION");
    // A newer version is named as such even with fields this server does not know.
    assert_eq!(
        import(with(&|d| {
            d["version"] = json!(7);
            d["somethingNew"] = json!(true);
        }))
        .await,
        "UNSUPPORTED_VERSION"
    );
    assert_eq!(import(with(&|d| d["version"] = json!(0))).await, "INVALID_DOCUMENT");
    assert_eq!(import(with(&|d| d["extra"] = json!(1))).await, "INVALID_DOCUMENT");
    assert_eq!(
        import(with(&|d| d["documentId"] = json!("x".repeat(20_000)))).await,
        "INVALID_DOCUMENT"
    );
    assert_eq!(
        import(with(&|d| d["messages"][2]["seq"] = json!(1))).await,
        "INVALID_DOCUMENT"
    );
    assert_eq!(
        import(with(&|d| d["messages"][1]["id"] = json!("m1"))).await,
        "INVALID_DOCUMENT"
    );
    assert_eq!(
        import(with(&|d| d["messages"][1]["body"]["kind"] = json!("system"))).await,
        "INVALID_DOCUMENT"
    );
    assert_eq!(
        import(with(&|d| d["messages"][1]["id"] = json!("bad id\u{0}"))).await,
        "INVALID_MESSAGE_ID"
    );
    assert_eq!(
        import(with(&|d| d["image"]["name"] = json!("n".repeat(300)))).await,
        "INVALID_IMAGE_NAME"
    );
    assert_eq!(
        import(with(&|d| d["image"]["tools"] = json!(["rm_rf"]))).await,
        "UNKNOWN_TOOL"
    );
    assert_eq!(
        import(with(&|d| d["image"]["variables"] = json!([1]))).await,
        "INVALID_VARIABLES"
    );
    let mut huge = serde_json::to_vec(&good).unwrap();
    huge.resize(MAX_IMPORT_BYTES + 1, b' ');
    assert_eq!(import(huge).await, "DOCUMENT_TOO_LARGE");
    // A container export with one bad line writes none of its good ones.
    let line = serde_json::to_string(&good).unwrap();
    let mut bad = good.clone();
    bad["documentId"] = json!("another");
    bad["messages"][0]["createdAt"] = json!(-1);
    let header = json!({"format": "agentvm.container", "version": 1, "containerId": "from", "exportedAt": 1, "conversations": 2});
    let lines = format!("{header}\n{line}\n{}\n", serde_json::to_string(&bad).unwrap());
    assert_eq!(import(lines.into_bytes()).await, "INVALID_DOCUMENT");
    let repeated = format!("{header}\n{line}\n{line}\n");
    assert_eq!(import(repeated.into_bytes()).await, "INVALID_DOCUMENT");
    assert!(
        service.list_images(&admin, Some("to")).await.unwrap().is_empty(),
        "nothing was written"
    );
    // A missing container is refused too, after reading.
    assert_eq!(
        reason(service.import(&admin, "nowhere", line.as_bytes()).await),
        "CONTAINER_NOT_FOUND"
    );
}

async fn exports_come_in_bounded_pieces(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    service.create_container(&admin, "big").await.unwrap();
    let image = service
        .create_image(
            &admin,
            NewImage {
                container_id: "big".to_owned(),
                ..NewImage::default()
            },
        )
        .await
        .unwrap();
    let text = "word ".repeat(EXPORT_CHUNK_BYTES / 2);
    for n in 0..200 {
        let body = if n % 50 == 0 {
            MessageBody::Error {
                text: text.clone(),
                error_code: "X".to_owned(),
            }
        } else {
            MessageBody::Error {
                text: format!("short {n}"),
                error_code: "X".to_owned(),
            }
        };
        service
            .append_message(
                &runtime(A),
                &image.session_id,
                NewMessage {
                    message_id: format!("m{n}"),
                    created_at_ms: 1 + n,
                    body,
                },
            )
            .await
            .unwrap();
    }
    let pieces: Vec<Vec<u8>> = service
        .export_image(&admin, &image.image_id)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert!(pieces.len() > 4, "{} pieces", pieces.len());
    assert!(pieces.iter().all(|piece| piece.len() <= EXPORT_CHUNK_BYTES));
    let document: Value = serde_json::from_slice(&pieces.concat()).unwrap();
    let seqs: Vec<u64> = document["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=200).collect::<Vec<u64>>());
}

async fn only_readers_export_and_users_import(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob) = (member(A, "alice"), member(A, "bob"));
    service.create_container(&alice, "alices").await.unwrap();
    let image = service
        .create_image(
            &alice,
            NewImage {
                container_id: "alices".to_owned(),
                ..NewImage::default()
            },
        )
        .await
        .unwrap();
    service.create_container(&bob, "bobs").await.unwrap();
    assert_eq!(
        reason(service.export_image(&bob, &image.image_id).await.map(|_| ())),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        reason(service.export_container(&bob, "alices").await.map(|_| ())),
        "CONTAINER_NOT_FOUND"
    );
    let document = export_bytes(&service, &alice, &image.image_id).await;
    assert_eq!(
        reason(service.import(&bob, "alices", &document).await),
        "CONTAINER_NOT_FOUND"
    );
    // Shared to read: exported, not imported into.
    service
        .share_container(&alice, "alices", "bob", ShareRole::Read)
        .await
        .unwrap();
    let copy = export_bytes(&service, &bob, &image.image_id).await;
    assert_eq!(
        reason(service.import(&bob, "alices", &copy).await),
        "SHARE_ROLE_TOO_LOW"
    );
    let mine = service.import(&bob, "bobs", &copy).await.unwrap();
    assert_eq!(mine[0].image.container_id, "bobs");
    // Another tenant sees neither.
    assert_eq!(
        reason(
            service
                .export_image(&ctx("tenant-b"), &image.image_id)
                .await
                .map(|_| ())
        ),
        "IMAGE_NOT_FOUND"
    );
}
