//! The store conformance suite: every body runs against SQLite and Postgres.

use std::collections::BTreeSet;
use std::sync::Arc;

use avm_common::Code;
use avm_session::{
    AgentState, ImageRecord, ImageUpdate, MessageBody, MessageRecord, NewImage, NewMessage, OpenTurn, Scope,
    SessionService, SessionStore, ShareRole, Usage,
};

use avm_common::auth::{Role, Scopes};

use crate::support::{api_err, ctx, member, principal_ctx, reason, user};

conformance_suite!(
    containers_are_get_or_create,
    container_ids_are_validated,
    tenants_never_see_each_other,
    members_see_their_own_and_shared_containers,
    container_ids_are_one_namespace_per_tenant,
    only_owners_and_admins_delete_and_share,
    read_only_credentials_cannot_write,
    images_have_defaults_and_round_trip,
    images_update_and_delete,
    image_fields_are_validated,
    images_list_newest_first,
    deletes_cascade,
    messages_append_in_order_and_idempotently,
    message_bodies_round_trip,
    messages_are_validated,
    concurrent_appends_get_distinct_seqs,
    ten_thousand_messages_append_and_load,
    open_turns_are_the_histories_left_unanswered,
    images_keep_their_clients_metadata,
);

const A: &str = "tenant-a";

/// The runtime acting for `tenant_id`: it alone writes model, tool and error
/// messages and chooses their time.
fn runtime(tenant_id: &str) -> avm_common::RequestContext {
    avm_common::testing::service_ctx(tenant_id)
}
const B: &str = "tenant-b";

/// The whole tenant, as admins and services see it.
fn whole(tenant_id: &str) -> Scope<'_> {
    Scope {
        tenant_id,
        user_id: None,
    }
}

fn image_in(container_id: &str) -> NewImage {
    NewImage {
        container_id: container_id.to_owned(),
        ..NewImage::default()
    }
}

async fn new_image(service: &SessionService, tenant: &str, container_id: &str) -> ImageRecord {
    service
        .create_container(&ctx(tenant), container_id)
        .await
        .expect("create container");
    service
        .create_image(&ctx(tenant), image_in(container_id))
        .await
        .expect("create image")
}

fn assistant(message_id: &str, text: &str) -> NewMessage {
    NewMessage {
        message_id: message_id.to_owned(),
        created_at_ms: 0,
        body: MessageBody::Assistant {
            text: text.to_owned(),
            usage: Some(Usage {
                input_tokens: 10,
                output_tokens: 3,
            }),
            interrupted: false,
            model: "claude-sonnet-4-20250514".to_owned(),
            stop_reason: "end_turn".to_owned(),
            resources: Vec::new(),
        },
    }
}

fn ids(messages: &[MessageRecord]) -> Vec<&str> {
    messages.iter().map(|m| m.message_id.as_str()).collect()
}

async fn containers_are_get_or_create(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(Arc::clone(&store));
    let (first, created) = service.create_container(&ctx(A), "default").await.unwrap();
    assert!(created);
    assert_eq!(first.container_id, "default");
    assert!(first.created_at_ms > 0);

    let (again, created) = service.create_container(&ctx(A), "default").await.unwrap();
    assert!(!created, "a second create returns the existing container");
    assert_eq!(again, first);
    assert_eq!(service.get_container(&ctx(A), "default", None).await.unwrap(), first);

    let missing = api_err(service.get_container(&ctx(A), "nope", None).await);
    assert_eq!(
        (missing.code, missing.reason.as_ref()),
        (Code::NotFound, "CONTAINER_NOT_FOUND")
    );

    // Oldest first, whatever the ids.
    store
        .create_container(&whole(A), "z-old", "usr_admin", 1_000)
        .await
        .unwrap();
    store
        .create_container(&whole(A), "a-new", "usr_admin", 2_000)
        .await
        .unwrap();
    let listed: Vec<String> = service
        .list_containers(&ctx(A))
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.container_id)
        .collect();
    assert_eq!(listed, ["z-old", "a-new", "default"]);
}

async fn container_ids_are_validated(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let too_long = "c".repeat(129);
    for bad in ["", "has space", "slash/", "tab\t", "naïve", too_long.as_str()] {
        let err = api_err(service.create_container(&ctx(A), bad).await);
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::InvalidArgument, "INVALID_CONTAINER_ID"),
            "{bad:?}"
        );
    }
    let longest = "c".repeat(128);
    for good in ["default", "user@example.com", "team:a.b_c-1", longest.as_str()] {
        assert!(service.create_container(&ctx(A), good).await.unwrap().1, "{good:?}");
    }
    assert_eq!(service.list_containers(&ctx(A)).await.unwrap().len(), 4);
    assert_eq!(
        reason(service.create_image(&ctx(A), image_in("bad id")).await),
        "INVALID_CONTAINER_ID"
    );
}

async fn tenants_never_see_each_other(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (a_default, a_created) = service.create_container(&ctx(A), "default").await.unwrap();
    let (b_default, b_created) = service.create_container(&ctx(B), "default").await.unwrap();
    assert!(a_created && b_created, "both tenants own a container named default");
    assert_eq!(
        (a_default.container_id.as_str(), b_default.container_id.as_str()),
        ("default", "default")
    );
    service.create_container(&ctx(A), "only-a").await.unwrap();

    let a_image = service.create_image(&ctx(A), image_in("default")).await.unwrap();
    service
        .append_message(&ctx(A), &a_image.session_id, user("msg_a1", "secret"))
        .await
        .unwrap();
    let b_image = service.create_image(&ctx(B), image_in("default")).await.unwrap();

    // B sees only its own things.
    let b_containers: Vec<String> = service
        .list_containers(&ctx(B))
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.container_id)
        .collect();
    assert_eq!(b_containers, ["default"]);
    assert_eq!(
        service.list_images(&ctx(B), None).await.unwrap(),
        std::slice::from_ref(&b_image)
    );
    assert_eq!(
        service.list_images(&ctx(B), Some("default")).await.unwrap(),
        std::slice::from_ref(&b_image)
    );
    assert!(service.list_images(&ctx(B), Some("only-a")).await.unwrap().is_empty());

    // A foreign id fails exactly like a missing one.
    let same = |foreign: avm_common::ApiError, missing: avm_common::ApiError| {
        assert_eq!((foreign.code, &foreign.reason), (missing.code, &missing.reason));
        assert_eq!(foreign.code, Code::NotFound);
    };
    let (image_id, session_id) = (a_image.image_id.as_str(), a_image.session_id.as_str());
    let ghost_image = "img_00000000000000000000000000000000";
    let ghost_session = "sess_00000000000000000000000000000000";
    same(
        api_err(service.get_image(&ctx(B), image_id).await),
        api_err(service.get_image(&ctx(B), ghost_image).await),
    );
    same(
        api_err(service.get_session(&ctx(B), session_id).await),
        api_err(service.get_session(&ctx(B), ghost_session).await),
    );
    let rename = || ImageUpdate {
        name: Some("mine now".into()),
        description: None,
        tools: None,
        metadata_json: None,
    };
    same(
        api_err(service.update_image(&ctx(B), image_id, rename()).await),
        api_err(service.update_image(&ctx(B), ghost_image, rename()).await),
    );
    same(
        api_err(service.delete_image(&ctx(B), image_id).await),
        api_err(service.delete_image(&ctx(B), ghost_image).await),
    );
    same(
        api_err(service.append_message(&ctx(B), session_id, user("msg_b1", "hi")).await),
        api_err(
            service
                .append_message(&ctx(B), ghost_session, user("msg_b1", "hi"))
                .await,
        ),
    );
    same(
        api_err(service.list_messages(&ctx(B), session_id).await),
        api_err(service.list_messages(&ctx(B), ghost_session).await),
    );
    same(
        api_err(service.get_container(&ctx(B), "only-a", None).await),
        api_err(service.get_container(&ctx(B), "nowhere", None).await),
    );
    same(
        api_err(service.delete_container(&ctx(B), "only-a").await),
        api_err(service.delete_container(&ctx(B), "nowhere").await),
    );
    same(
        api_err(service.create_image(&ctx(B), image_in("only-a")).await),
        api_err(service.create_image(&ctx(B), image_in("nowhere")).await),
    );

    // B deleting its own "default" leaves A's untouched.
    assert_eq!(
        service.delete_container(&ctx(B), "default").await.unwrap(),
        [b_image.image_id]
    );
    assert_eq!(service.get_image(&ctx(A), image_id).await.unwrap(), a_image);
    let a_messages = service.list_messages(&ctx(A), session_id).await.unwrap();
    assert_eq!(ids(&a_messages), ["msg_a1"]);
    assert_eq!(service.list_containers(&ctx(A)).await.unwrap().len(), 2);
}

async fn images_have_defaults_and_round_trip(store: Arc<dyn SessionStore>) {
    let rules = avm_common::mcp::McpServerRules::new(vec!["mcp-fs".into()], &[]).unwrap();
    let service = SessionService::new(store).with_mcp_rules(rules);
    service.create_container(&ctx(A), "default").await.unwrap();

    let plain = service.create_image(&ctx(A), image_in("default")).await.unwrap();
    assert!(plain.image_id.starts_with("img_"), "{}", plain.image_id);
    assert!(plain.session_id.starts_with("sess_"), "{}", plain.session_id);
    assert_eq!(plain.container_id, "default");
    assert_eq!(plain.name, "New Conversation");
    assert_eq!(
        (plain.description.as_deref(), plain.system_prompt.as_deref()),
        (None, None)
    );
    assert_eq!(plain.mcp_servers_json, "{}");
    assert!(plain.created_at_ms > 0);
    assert_eq!(plain.created_at_ms, plain.updated_at_ms);
    assert_eq!(service.get_image(&ctx(A), &plain.image_id).await.unwrap(), plain);
    assert_eq!(service.get_session(&ctx(A), &plain.session_id).await.unwrap(), plain);
    assert!(
        service
            .list_messages(&ctx(A), &plain.session_id)
            .await
            .unwrap()
            .is_empty()
    );

    // Blank and empty optional fields mean "not given".
    let blank = NewImage {
        container_id: "default".into(),
        name: Some("  ".into()),
        description: Some(String::new()),
        system_prompt: Some(String::new()),
        mcp_servers_json: " ".into(),
        agent: Some(String::new()),
        variables_json: " ".into(),
        tools: Vec::new(),
        parent_image_id: None,
        metadata_json: String::new(),
    };
    let blank = service.create_image(&ctx(A), blank).await.unwrap();
    assert_eq!(blank.name, "New Conversation");
    assert_eq!(
        (
            blank.description,
            blank.system_prompt,
            blank.mcp_servers_json.as_str(),
            blank.agent,
            blank.variables_json.as_str()
        ),
        (None, None, "{}", None, "{}")
    );

    let mcp = r#"{"fs": {"command": "mcp-fs", "args": ["/tmp"]},
                  "web": {"type": "sse", "url": "http://x"}}"#;
    let full = NewImage {
        container_id: "default".into(),
        name: Some("Reviewer ✓".into()),
        description: Some("reads pull requests".into()),
        system_prompt: Some("resource://prompts/reviewer@^2".into()),
        mcp_servers_json: mcp.into(),
        agent: Some("resource://agents/reviewer@1.2.0".into()),
        variables_json: r#"{"team": "core", "tone": "brief"}"#.into(),
        tools: Vec::new(),
        parent_image_id: None,
        metadata_json: String::new(),
    };
    let full = service.create_image(&ctx(A), full).await.unwrap();
    assert_eq!(full.name, "Reviewer ✓");
    assert_eq!(full.description.as_deref(), Some("reads pull requests"));
    assert_eq!(full.system_prompt.as_deref(), Some("resource://prompts/reviewer@^2"));
    assert_eq!(full.mcp_servers_json, mcp, "mcp servers are kept as sent");
    assert_eq!(full.agent.as_deref(), Some("resource://agents/reviewer@1.2.0"));
    assert_eq!(full.variables_json, r#"{"team": "core", "tone": "brief"}"#);
    assert_eq!(service.get_image(&ctx(A), &full.image_id).await.unwrap(), full);
    assert_ne!(full.image_id, plain.image_id);
    assert_ne!(full.session_id, plain.session_id);

    let missing = api_err(service.create_image(&ctx(A), image_in("elsewhere")).await);
    assert_eq!(
        (missing.code, missing.reason.as_ref()),
        (Code::NotFound, "CONTAINER_NOT_FOUND")
    );
    assert_eq!(service.list_images(&ctx(A), None).await.unwrap().len(), 3);
}

async fn images_update_and_delete(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let image = new_image(&service, A, "default").await;
    let described = ImageUpdate {
        name: Some("Renamed".into()),
        description: Some("about it".into()),
        tools: None,
        metadata_json: None,
    };
    let renamed = service.update_image(&ctx(A), &image.image_id, described).await.unwrap();
    assert_eq!(renamed.name, "Renamed");
    assert_eq!(renamed.description.as_deref(), Some("about it"));
    assert!(renamed.updated_at_ms >= image.updated_at_ms);
    assert_eq!(renamed.created_at_ms, image.created_at_ms);
    assert_eq!(
        (&renamed.session_id, &renamed.mcp_servers_json),
        (&image.session_id, &image.mcp_servers_json)
    );
    assert_eq!(service.get_image(&ctx(A), &image.image_id).await.unwrap(), renamed);

    // Unset fields stay; an empty description clears it.
    let untouched = service
        .update_image(&ctx(A), &image.image_id, ImageUpdate::default())
        .await
        .unwrap();
    assert_eq!(
        (untouched.name.as_str(), untouched.description.as_deref()),
        ("Renamed", Some("about it"))
    );
    let cleared = ImageUpdate {
        name: None,
        description: Some(String::new()),
        tools: None,
        metadata_json: None,
    };
    let cleared = service.update_image(&ctx(A), &image.image_id, cleared).await.unwrap();
    assert_eq!((cleared.name.as_str(), cleared.description), ("Renamed", None));

    // Tools are replaced as a whole, checked as at creation; unset, they stay.
    let tools = ImageUpdate {
        tools: Some(vec!["read_file".into(), "run_command".into(), "read_file".into()]),
        ..ImageUpdate::default()
    };
    let tooled = service.update_image(&ctx(A), &image.image_id, tools).await.unwrap();
    assert_eq!(tooled.tools, ["read_file", "run_command"]);
    let kept = service
        .update_image(&ctx(A), &image.image_id, ImageUpdate::default())
        .await
        .unwrap();
    assert_eq!(kept.tools, ["read_file", "run_command"]);
    let unknown = ImageUpdate {
        tools: Some(vec!["format_disk".into()]),
        ..ImageUpdate::default()
    };
    assert_eq!(
        reason(service.update_image(&ctx(A), &image.image_id, unknown).await),
        "UNKNOWN_TOOL"
    );
    let none = ImageUpdate {
        tools: Some(Vec::new()),
        ..ImageUpdate::default()
    };
    let toolless = service.update_image(&ctx(A), &image.image_id, none).await.unwrap();
    assert!(toolless.tools.is_empty());

    service.delete_image(&ctx(A), &image.image_id).await.unwrap();
    assert_eq!(
        reason(service.get_image(&ctx(A), &image.image_id).await),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        reason(service.delete_image(&ctx(A), &image.image_id).await),
        "IMAGE_NOT_FOUND"
    );
    let update = ImageUpdate {
        name: Some("x".into()),
        description: None,
        tools: None,
        metadata_json: None,
    };
    assert_eq!(
        reason(service.update_image(&ctx(A), &image.image_id, update).await),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        reason(service.get_session(&ctx(A), &image.session_id).await),
        "SESSION_NOT_FOUND"
    );
    assert!(service.list_images(&ctx(A), Some("default")).await.unwrap().is_empty());
    service
        .get_container(&ctx(A), "default", None)
        .await
        .expect("deleting an image keeps its container");
}

async fn image_fields_are_validated(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    service.create_container(&ctx(A), "default").await.unwrap();
    let with = |f: fn(&mut NewImage)| {
        let mut image = image_in("default");
        f(&mut image);
        image
    };
    let cases: [(NewImage, &str); 16] = [
        (with(|i| i.name = Some("n".repeat(257))), "INVALID_IMAGE_NAME"),
        // What the runtime would refuse to start or reach (issue 26 item 18).
        (
            with(|i| i.mcp_servers_json = r#"{"sh": {"command": "/bin/sh"}}"#.into()),
            "MCP_COMMAND_NOT_APPROVED",
        ),
        (
            with(|i| i.mcp_servers_json = r#"{"md": {"type": "http", "url": "http://169.254.169.254/"}}"#.into()),
            "MCP_SERVER_REFUSED",
        ),
        (
            with(|i| i.mcp_servers_json = r#"{"lo": {"type": "sse", "url": "http://[::1]:8080/sse"}}"#.into()),
            "MCP_SERVER_REFUSED",
        ),
        (
            with(|i| i.description = Some("d".repeat(4097))),
            "INVALID_IMAGE_DESCRIPTION",
        ),
        (
            with(|i| i.system_prompt = Some("p".repeat(256 * 1024 + 1))),
            "INVALID_SYSTEM_PROMPT",
        ),
        (with(|i| i.mcp_servers_json = "[]".into()), "INVALID_MCP_SERVERS"),
        (with(|i| i.mcp_servers_json = "null".into()), "INVALID_MCP_SERVERS"),
        (with(|i| i.mcp_servers_json = "{\"fs\":".into()), "INVALID_MCP_SERVERS"),
        (
            with(|i| i.mcp_servers_json = format!("{{\"k\":\"{}\"}}", "x".repeat(64 * 1024))),
            "INVALID_MCP_SERVERS",
        ),
        (with(|i| i.container_id = String::new()), "INVALID_CONTAINER_ID"),
        (with(|i| i.agent = Some("sales".into())), "INVALID_AGENT"),
        (
            with(|i| i.agent = Some("resource://prompts/sales".into())),
            "INVALID_AGENT",
        ),
        (
            with(|i| i.agent = Some(format!("resource://agents/{}", "a".repeat(512 - 17)))),
            "INVALID_AGENT",
        ),
        (with(|i| i.variables_json = r#"{"n": 1}"#.into()), "INVALID_VARIABLES"),
        (with(|i| i.variables_json = "[\"x\"]".into()), "INVALID_VARIABLES"),
    ];
    for (image, expected) in cases {
        let err = api_err(service.create_image(&ctx(A), image).await);
        assert_eq!((err.code, err.reason.as_ref()), (Code::InvalidArgument, expected));
    }
    assert!(
        service.list_images(&ctx(A), None).await.unwrap().is_empty(),
        "nothing invalid was stored"
    );

    // The limits are inclusive and counted in characters where they say so.
    let at_limits = NewImage {
        container_id: "default".into(),
        name: Some("é".repeat(256)),
        description: Some("ü".repeat(4096)),
        system_prompt: Some("p".repeat(256 * 1024)),
        mcp_servers_json: format!("{{\"k\":{{\"env\":{{\"E\":\"{}\"}}}}}}", "x".repeat(64 * 1024 - 22)),
        agent: Some(format!("resource://agents/{}", "a".repeat(512 - 18))),
        variables_json: format!("{{\"k\":\"{}\"}}", "v".repeat(16 * 1024 - 8)),
        tools: Vec::new(),
        parent_image_id: None,
        metadata_json: String::new(),
    };
    let image = service.create_image(&ctx(A), at_limits.clone()).await.unwrap();
    assert_eq!(Some(image.name), at_limits.name);
    assert_eq!(image.system_prompt, at_limits.system_prompt);

    for (update, expected) in [
        (
            ImageUpdate {
                name: Some(String::new()),
                description: None,
                tools: None,
                metadata_json: None,
            },
            "INVALID_IMAGE_NAME",
        ),
        (
            ImageUpdate {
                name: Some(" \t".into()),
                description: None,
                tools: None,
                metadata_json: None,
            },
            "INVALID_IMAGE_NAME",
        ),
        (
            ImageUpdate {
                name: Some("n".repeat(257)),
                description: None,
                tools: None,
                metadata_json: None,
            },
            "INVALID_IMAGE_NAME",
        ),
        (
            ImageUpdate {
                name: None,
                description: Some("d".repeat(4097)),
                tools: None,
                metadata_json: None,
            },
            "INVALID_IMAGE_DESCRIPTION",
        ),
    ] {
        let err = api_err(service.update_image(&ctx(A), &image.image_id, update).await);
        assert_eq!((err.code, err.reason.as_ref()), (Code::InvalidArgument, expected));
    }
}

async fn images_list_newest_first(store: Arc<dyn SessionStore>) {
    store.create_container(&whole(A), "one", "usr_admin", 1).await.unwrap();
    store.create_container(&whole(A), "two", "usr_admin", 1).await.unwrap();
    let record = |image_id: &str, container_id: &str, created_at_ms: i64| ImageRecord {
        image_id: image_id.to_owned(),
        container_id: container_id.to_owned(),
        session_id: image_id.replace("img_", "sess_"),
        name: image_id.to_owned(),
        description: None,
        system_prompt: None,
        mcp_servers_json: "{}".to_owned(),
        agent: None,
        variables_json: "{}".to_owned(),
        tools: Vec::new(),
        metadata_json: "{}".to_owned(),
        created_at_ms,
        updated_at_ms: created_at_ms,
        agent_state: AgentState::Active,
        agent_error: None,
        parent_image_id: None,
        depth: 0,
    };
    // Inserted out of order; img_b and img_c tie on time, so the id decides.
    for (id, container, at) in [
        ("img_a", "one", 1_000),
        ("img_d", "two", 3_000),
        ("img_b", "one", 2_000),
        ("img_c", "two", 2_000),
    ] {
        store.create_image(&whole(A), &record(id, container, at)).await.unwrap();
    }
    let names = |images: Vec<ImageRecord>| images.into_iter().map(|i| i.image_id).collect::<Vec<_>>();
    assert_eq!(
        names(store.list_images(&whole(A), None).await.unwrap()),
        ["img_d", "img_c", "img_b", "img_a"]
    );
    assert_eq!(
        names(store.list_images(&whole(A), Some("one")).await.unwrap()),
        ["img_b", "img_a"]
    );
    assert_eq!(
        names(store.list_images(&whole(A), Some("two")).await.unwrap()),
        ["img_d", "img_c"]
    );
    assert!(
        store.list_images(&whole(A), Some("three")).await.unwrap().is_empty(),
        "a missing container has no images"
    );
    assert!(store.list_images(&whole(B), None).await.unwrap().is_empty());
    assert_eq!(
        store.get_image(&whole(A), "img_c").await.unwrap(),
        record("img_c", "two", 2_000)
    );
}

async fn deletes_cascade(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let first = new_image(&service, A, "doomed").await;
    let second = service.create_image(&ctx(A), image_in("doomed")).await.unwrap();
    let survivor = new_image(&service, A, "kept").await;
    for image in [&first, &second, &survivor] {
        for n in 0..3 {
            let message = user(&format!("msg_{n}"), "hello");
            service
                .append_message(&ctx(A), &image.session_id, message)
                .await
                .unwrap();
        }
    }

    let deleted: BTreeSet<String> = service
        .delete_container(&ctx(A), "doomed")
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        deleted,
        BTreeSet::from([first.image_id.clone(), second.image_id.clone()])
    );
    assert_eq!(
        reason(service.get_container(&ctx(A), "doomed", None).await),
        "CONTAINER_NOT_FOUND"
    );
    assert_eq!(
        reason(service.delete_container(&ctx(A), "doomed").await),
        "CONTAINER_NOT_FOUND"
    );
    for image in [&first, &second] {
        assert_eq!(
            reason(service.get_image(&ctx(A), &image.image_id).await),
            "IMAGE_NOT_FOUND"
        );
        assert_eq!(
            reason(service.get_session(&ctx(A), &image.session_id).await),
            "SESSION_NOT_FOUND"
        );
        assert_eq!(
            reason(service.list_messages(&ctx(A), &image.session_id).await),
            "SESSION_NOT_FOUND"
        );
        let late = service
            .append_message(&ctx(A), &image.session_id, user("msg_late", "?"))
            .await;
        assert_eq!(reason(late), "SESSION_NOT_FOUND");
    }

    // A container recreated under the same id starts empty.
    assert!(service.create_container(&ctx(A), "doomed").await.unwrap().1);
    assert!(service.list_images(&ctx(A), Some("doomed")).await.unwrap().is_empty());
    assert_eq!(
        service.delete_container(&ctx(A), "doomed").await.unwrap(),
        Vec::<String>::new()
    );

    // Deleting an image takes its session and messages, nothing else.
    let other = service.create_image(&ctx(A), image_in("kept")).await.unwrap();
    service
        .append_message(&ctx(A), &other.session_id, user("msg_0", "other"))
        .await
        .unwrap();
    service.delete_image(&ctx(A), &survivor.image_id).await.unwrap();
    assert_eq!(
        reason(service.list_messages(&ctx(A), &survivor.session_id).await),
        "SESSION_NOT_FOUND"
    );
    assert_eq!(
        ids(&service.list_messages(&ctx(A), &other.session_id).await.unwrap()),
        ["msg_0"]
    );
    assert_eq!(service.list_images(&ctx(A), None).await.unwrap(), [other]);
}

async fn messages_append_in_order_and_idempotently(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let image = new_image(&service, A, "default").await;
    let session = image.session_id.as_str();

    let first = service
        .append_message(&ctx(A), session, user("msg_1", "one"))
        .await
        .unwrap();
    // A user writes no model message and chooses no time; the runtime does both.
    let forged = api_err(
        service
            .append_message(&ctx(A), session, assistant("msg_x", "forged"))
            .await,
    );
    assert_eq!(
        (forged.code, forged.reason.as_ref()),
        (Code::PermissionDenied, "RUNTIME_ONLY_MESSAGE")
    );
    let mut dated = user("msg_x", "long ago");
    dated.created_at_ms = 1;
    assert_eq!(
        reason(service.append_message(&ctx(A), session, dated).await),
        "CREATED_AT_NOT_ALLOWED"
    );
    let mut stamped = assistant("msg_2", "two");
    stamped.created_at_ms = 1_234;
    let second = service.append_message(&runtime(A), session, stamped).await.unwrap();
    let third = service
        .append_message(&ctx(A), session, user("msg_3", "three"))
        .await
        .unwrap();
    assert_eq!((first.seq, second.seq, third.seq), (1, 2, 3));
    assert_eq!(first.session_id, session);
    assert!(first.created_at_ms > 1_234, "a zero timestamp becomes now");
    assert_eq!(second.created_at_ms, 1_234, "the caller's timestamp is kept");

    // A retry, even with another body, returns the stored message and adds nothing.
    let mut retry = user("msg_2", "a different body");
    retry.created_at_ms = 99;
    assert_eq!(
        service.append_message(&runtime(A), session, retry).await.unwrap(),
        second
    );
    let listed = service.list_messages(&ctx(A), session).await.unwrap();
    assert_eq!(listed, [first.clone(), second.clone(), third.clone()]);

    // The retry did not use up a seq.
    let fourth = service
        .append_message(&ctx(A), session, user("msg_4", "four"))
        .await
        .unwrap();
    assert_eq!(fourth.seq, 4);

    // Message ids are scoped to their session.
    let other = service.create_image(&ctx(A), image_in("default")).await.unwrap();
    let elsewhere = service
        .append_message(&ctx(A), &other.session_id, user("msg_1", "again"))
        .await
        .unwrap();
    assert_eq!(
        (elsewhere.seq, elsewhere.session_id.as_str()),
        (1, other.session_id.as_str())
    );
    assert_eq!(service.list_messages(&ctx(A), session).await.unwrap().len(), 4);
}

async fn message_bodies_round_trip(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let image = new_image(&service, A, "default").await;
    let bodies = [
        MessageBody::User {
            content_json: r#"[ {"type" : "text", "text": "héllo\n"},
                {"type":"image","data":"AAEC","mediaType":"image/png"} ]"#
                .into(),
        },
        MessageBody::User {
            content_json: r#""just a string""#.into(),
        },
        MessageBody::Assistant {
            text: "Here you go: 🦀".into(),
            usage: Some(Usage {
                input_tokens: u64::from(u32::MAX) + 7,
                output_tokens: 42,
            }),
            interrupted: false,
            model: "claude-sonnet-4-20250514".into(),
            stop_reason: "end_turn".into(),
            resources: vec![
                "resource://agents/helper@1.0.0".into(),
                "resource://prompts/helper@2.1.0".into(),
            ],
        },
        MessageBody::Assistant {
            text: "Half an ans".into(),
            usage: None,
            interrupted: true,
            model: String::new(),
            stop_reason: String::new(),
            resources: Vec::new(),
        },
        MessageBody::ToolCall {
            tool_call_id: "toolu_1".into(),
            tool_name: "read_file".into(),
            input_json: r#"{"path": "/etc/hosts"}"#.into(),
            parent_id: "msg_3".into(),
        },
        MessageBody::ToolResult {
            tool_call_id: "toolu_1".into(),
            tool_name: "read_file".into(),
            output: "127.0.0.1 localhost\n\"quoted\" \\ back".into(),
            is_error: false,
        },
        MessageBody::ToolResult {
            tool_call_id: "toolu_2".into(),
            tool_name: "run".into(),
            output: "exit 1".into(),
            is_error: true,
        },
        MessageBody::Error {
            text: "rate limited".into(),
            error_code: "RATE_LIMITED".into(),
        },
        MessageBody::Assistant {
            text: "x".repeat(1024 * 1024),
            usage: None,
            interrupted: false,
            model: "m".into(),
            stop_reason: "max_tokens".into(),
            resources: Vec::new(),
        },
    ];
    let mut appended = Vec::new();
    for (n, body) in bodies.iter().enumerate() {
        let message = NewMessage {
            message_id: format!("msg_{n}"),
            created_at_ms: 0,
            body: body.clone(),
        };
        let stored = service
            .append_message(&runtime(A), &image.session_id, message)
            .await
            .unwrap();
        assert_eq!(&stored.body, body);
        appended.push(stored);
    }
    let listed = service.list_messages(&ctx(A), &image.session_id).await.unwrap();
    assert_eq!(listed, appended);
    let kinds: Vec<&str> = listed.iter().map(|m| m.body.kind()).collect();
    assert_eq!(
        kinds,
        [
            "user",
            "user",
            "assistant",
            "assistant",
            "tool_call",
            "tool_result",
            "tool_result",
            "error",
            "assistant"
        ]
    );
}

async fn messages_are_validated(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let image = new_image(&service, A, "default").await;
    let session = image.session_id.as_str();
    let too_long = format!("msg_{}", "x".repeat(125));
    for bad in ["", "msg 1", "msg/1", too_long.as_str()] {
        let err = api_err(service.append_message(&ctx(A), session, user(bad, "hi")).await);
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::InvalidArgument, "INVALID_MESSAGE_ID"),
            "{bad:?}"
        );
    }
    let huge = assistant("msg_huge", &"x".repeat(8 * 1024 * 1024 + 1));
    let err = api_err(service.append_message(&ctx(A), session, huge).await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::InvalidArgument, "MESSAGE_TOO_LARGE")
    );
    for content_json in ["", "not json", "[1,"] {
        let body = MessageBody::User {
            content_json: content_json.into(),
        };
        let message = NewMessage {
            message_id: "msg_bad".into(),
            created_at_ms: 0,
            body,
        };
        assert_eq!(
            reason(service.append_message(&ctx(A), session, message).await),
            "INVALID_MESSAGE_CONTENT"
        );
    }
    let ghost = service
        .append_message(&ctx(A), "sess_missing", user("msg_1", "hi"))
        .await;
    assert_eq!(reason(ghost), "SESSION_NOT_FOUND");
    assert!(
        service.list_messages(&ctx(A), session).await.unwrap().is_empty(),
        "nothing invalid was stored"
    );

    let longest = format!("msg_{}", "x".repeat(124));
    assert_eq!(
        service
            .append_message(&ctx(A), session, user(&longest, "hi"))
            .await
            .unwrap()
            .seq,
        1
    );
}

async fn concurrent_appends_get_distinct_seqs(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let image = new_image(&service, A, "default").await;
    let mut tasks = tokio::task::JoinSet::new();
    // 40 distinct messages, each sent twice at once: 40 rows, seqs 1..=40.
    for n in 0..80 {
        let (service, session_id) = (service.clone(), image.session_id.clone());
        tasks.spawn(async move {
            service
                .append_message(&ctx(A), &session_id, user(&format!("msg_{}", n % 40), "x"))
                .await
        });
    }
    let mut by_id = std::collections::BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        let stored = joined.unwrap().unwrap();
        if let Some(earlier) = by_id.insert(stored.message_id.clone(), stored.clone()) {
            assert_eq!(earlier, stored, "both sends of one id see the same stored message");
        }
    }
    let listed = service.list_messages(&ctx(A), &image.session_id).await.unwrap();
    assert_eq!(listed.len(), 40);
    assert_eq!(
        listed.iter().map(|m| m.seq).collect::<Vec<_>>(),
        (1..=40).collect::<Vec<u64>>()
    );
    let mut stored: Vec<MessageRecord> = by_id.into_values().collect();
    stored.sort_by_key(|m| m.seq);
    assert_eq!(listed, stored);
}

async fn ten_thousand_messages_append_and_load(store: Arc<dyn SessionStore>) {
    const COUNT: u64 = 10_000;
    let service = SessionService::new(store);
    let image = new_image(&service, A, "default").await;
    let session = image.session_id.as_str();
    for n in 1..=COUNT {
        let message = if n % 2 == 1 {
            user(&format!("msg_{n}"), "question")
        } else {
            assistant(&format!("msg_{n}"), "answer")
        };
        let stored = service.append_message(&runtime(A), session, message).await.unwrap();
        assert_eq!(stored.seq, n);
    }
    let listed = service.list_messages(&ctx(A), session).await.unwrap();
    assert_eq!(listed.len() as u64, COUNT);
    for (n, message) in (1..=COUNT).zip(&listed) {
        assert_eq!(
            (message.seq, message.message_id.as_str()),
            (n, format!("msg_{n}").as_str())
        );
    }
    assert_eq!(listed[1].body.kind(), "assistant");

    // Still idempotent and still counting at the end of a long history.
    let retry = service
        .append_message(&ctx(A), session, user("msg_5000", "again"))
        .await
        .unwrap();
    assert_eq!(retry, listed[4999]);
    let next = service
        .append_message(&ctx(A), session, user("msg_next", "more"))
        .await
        .unwrap();
    assert_eq!(next.seq, COUNT + 1);

    service.delete_image(&ctx(A), &image.image_id).await.unwrap();
    assert_eq!(
        reason(service.list_messages(&ctx(A), session).await),
        "SESSION_NOT_FOUND"
    );
}

async fn members_see_their_own_and_shared_containers(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob) = (member(A, "usr_alice"), member(A, "usr_bob"));
    let (mine, _) = service.create_container(&alice, "alice-box").await.unwrap();
    assert_eq!(mine.owner_id, "usr_alice");
    let image = service.create_image(&alice, image_in("alice-box")).await.unwrap();
    service
        .append_message(&alice, &image.session_id, user("msg_1", "private"))
        .await
        .unwrap();
    service.create_container(&bob, "bob-box").await.unwrap();

    // Bob sees only his own container; Alice's answers exactly like a missing one.
    let names = |list: Vec<avm_session::ContainerRecord>| list.into_iter().map(|c| c.container_id).collect::<Vec<_>>();
    assert_eq!(names(service.list_containers(&bob).await.unwrap()), ["bob-box"]);
    assert!(service.list_images(&bob, None).await.unwrap().is_empty());
    let foreign = api_err(service.get_image(&bob, &image.image_id).await);
    let missing = api_err(service.get_image(&bob, "img_00000000000000000000000000000000").await);
    assert_eq!((foreign.code, &foreign.reason), (missing.code, &missing.reason));
    assert_eq!(
        reason(service.list_messages(&bob, &image.session_id).await),
        "SESSION_NOT_FOUND"
    );
    assert_eq!(
        reason(
            service
                .append_message(&bob, &image.session_id, user("msg_2", "x"))
                .await
        ),
        "SESSION_NOT_FOUND"
    );
    assert_eq!(
        reason(service.create_image(&bob, image_in("alice-box")).await),
        "CONTAINER_NOT_FOUND"
    );
    // The admin sees both.
    assert_eq!(
        names(service.list_containers(&ctx(A)).await.unwrap()),
        ["alice-box", "bob-box"]
    );

    // Shared, Bob sees and uses Alice's container; unshared, it is gone again.
    service
        .share_container(&alice, "alice-box", "usr_bob", ShareRole::Manage)
        .await
        .unwrap();
    assert_eq!(
        names(service.list_containers(&bob).await.unwrap()),
        ["alice-box", "bob-box"]
    );
    assert_eq!(service.list_messages(&bob, &image.session_id).await.unwrap().len(), 1);
    service
        .append_message(&bob, &image.session_id, user("msg_3", "hello alice"))
        .await
        .unwrap();
    let shares = service.list_shares(&alice, "alice-box").await.unwrap();
    assert_eq!(
        shares.iter().map(|s| s.user_id.as_str()).collect::<Vec<_>>(),
        ["usr_bob"]
    );
    service.unshare_container(&alice, "alice-box", "usr_bob").await.unwrap();
    assert_eq!(names(service.list_containers(&bob).await.unwrap()), ["bob-box"]);
    assert_eq!(
        reason(service.get_session(&bob, &image.session_id).await),
        "SESSION_NOT_FOUND"
    );
}

async fn container_ids_are_one_namespace_per_tenant(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob) = (member(A, "usr_alice"), member(A, "usr_bob"));
    service.create_container(&alice, "default").await.unwrap();
    // Get-or-create by the owner is idempotent.
    let (_, created) = service.create_container(&alice, "default").await.unwrap();
    assert!(!created);
    // Another member of the tenant cannot take the id, nor see the container.
    let taken = api_err(service.create_container(&bob, "default").await);
    assert_eq!(
        (taken.code, taken.reason.as_ref()),
        (Code::AlreadyExists, "CONTAINER_ID_TAKEN")
    );
    assert!(!taken.message.contains("usr_alice"), "{}", taken.message);
    assert_eq!(
        reason(service.get_container(&bob, "default", None).await),
        "CONTAINER_NOT_FOUND"
    );
    // Another tenant's member can use the same id freely.
    let (other, created) = service
        .create_container(&member(B, "usr_carol"), "default")
        .await
        .unwrap();
    assert!(created);
    assert_eq!(other.owner_id, "usr_carol");
}

async fn only_owners_and_admins_delete_and_share(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob) = (member(A, "usr_alice"), member(A, "usr_bob"));
    service.create_container(&alice, "shared").await.unwrap();
    service
        .share_container(&alice, "shared", "usr_bob", ShareRole::Manage)
        .await
        .unwrap();
    // Bob may use the container but not delete or re-share it.
    assert_eq!(
        reason(service.delete_container(&bob, "shared").await),
        "NOT_CONTAINER_OWNER"
    );
    assert_eq!(
        reason(
            service
                .share_container(&bob, "shared", "usr_dave", ShareRole::Manage)
                .await
        ),
        "NOT_CONTAINER_OWNER"
    );
    assert_eq!(
        service.get_container(&bob, "shared", None).await.unwrap().owner_id,
        "usr_alice"
    );
    // An admin may share and delete anything of the tenant.
    service
        .share_container(&ctx(A), "shared", "usr_dave", ShareRole::Manage)
        .await
        .unwrap();
    service.delete_container(&ctx(A), "shared").await.unwrap();
    assert_eq!(
        reason(service.get_container(&alice, "shared", None).await),
        "CONTAINER_NOT_FOUND"
    );
    assert_eq!(
        reason(service.list_shares(&ctx(A), "shared").await),
        "CONTAINER_NOT_FOUND"
    );
}

async fn read_only_credentials_cannot_write(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let image = new_image(&service, A, "box").await;
    let reader = principal_ctx(A, "usr_admin", Role::Admin, Scopes::READ);
    assert_eq!(service.list_images(&reader, Some("box")).await.unwrap().len(), 1);
    let denied = api_err(service.create_container(&reader, "other").await);
    assert_eq!(
        (denied.code, denied.reason.as_ref()),
        (Code::PermissionDenied, "MISSING_SCOPE")
    );
    assert_eq!(
        reason(
            service
                .append_message(&reader, &image.session_id, user("msg_1", "x"))
                .await
        ),
        "MISSING_SCOPE"
    );
    assert_eq!(
        reason(service.delete_image(&reader, &image.image_id).await),
        "MISSING_SCOPE"
    );
    let nothing = principal_ctx(A, "usr_admin", Role::Admin, Scopes::NONE);
    assert_eq!(reason(service.list_containers(&nothing).await), "MISSING_SCOPE");
}

/// Issue 26 item 10: the turns a crash left open are found at start-up,
/// across tenants, without loading each conversation: the sessions whose
/// last message is the user's.
async fn open_turns_are_the_histories_left_unanswered(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let open = new_image(&service, A, "default").await;
    let answered = new_image(&service, A, "default").await;
    let _empty = new_image(&service, A, "default").await;
    let other = new_image(&service, B, "default").await;
    let append = |image: &ImageRecord, message: NewMessage, tenant: &'static str| {
        let service = service.clone();
        let session = image.session_id.clone();
        async move {
            // Users write their messages, the runtime the rest.
            let caller = if matches!(message.body, MessageBody::User { .. }) {
                ctx(tenant)
            } else {
                runtime(tenant)
            };
            service.append_message(&caller, &session, message).await.unwrap()
        }
    };
    append(&open, user("msg_open", "cut"), A).await;
    append(&answered, user("msg_q", "asked"), A).await;
    append(&answered, assistant("msg_a", "answered"), A).await;
    append(&other, user("msg_first", "one"), B).await;
    let last = append(&other, user("msg_second", "two"), B).await;

    let turn = |image: &ImageRecord, tenant: &str, user_message_id: &str| OpenTurn {
        tenant_id: tenant.to_owned(),
        container_id: "default".to_owned(),
        image_id: image.image_id.clone(),
        session_id: image.session_id.clone(),
        user_message_id: user_message_id.to_owned(),
    };
    let mut expected = vec![turn(&open, A, "msg_open"), turn(&other, B, "msg_second")];
    expected.sort_by(|a, b| a.session_id.cmp(&b.session_id));
    let after_all = last.created_at_ms + 1;
    let found = service.list_open_turns(&runtime(A), after_all, "", 0).await.unwrap();
    assert_eq!(found, expected);
    // A page at a time, by session id.
    let first = service.list_open_turns(&runtime(A), after_all, "", 1).await.unwrap();
    assert_eq!(first, expected[..1]);
    let next = service
        .list_open_turns(&runtime(A), after_all, &first[0].session_id, 1)
        .await
        .unwrap();
    assert_eq!(next, expected[1..]);
    // Only turns older than the cut-off: a running process's own are not.
    let none = service.list_open_turns(&runtime(A), 0, "", 0).await.unwrap();
    assert!(none.is_empty(), "{none:?}");
    // Only components ask.
    let refused = api_err(service.list_open_turns(&ctx(A), after_all, "", 0).await);
    assert_eq!(refused.code, Code::PermissionDenied);
}

async fn images_keep_their_clients_metadata(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    service.create_container(&admin, "c").await.unwrap();
    let with = |metadata: &str| NewImage {
        container_id: "c".to_owned(),
        metadata_json: metadata.to_owned(),
        ..NewImage::default()
    };
    let plain = service.create_image(&admin, with("")).await.unwrap();
    assert_eq!(plain.metadata_json, "{}");
    let pinned = service
        .create_image(&admin, with(r#"{"pinned":true,"folder":"work"}"#))
        .await
        .unwrap();
    let stored = service.get_image(&admin, &pinned.image_id).await.unwrap();
    assert_eq!(stored.metadata_json, r#"{"pinned":true,"folder":"work"}"#);
    // An update replaces it whole; one that does not name it keeps it.
    let change = |metadata: Option<&str>| ImageUpdate {
        name: Some("renamed".to_owned()),
        metadata_json: metadata.map(str::to_owned),
        ..ImageUpdate::default()
    };
    let kept = service
        .update_image(&admin, &pinned.image_id, change(None))
        .await
        .unwrap();
    assert_eq!(kept.metadata_json, r#"{"pinned":true,"folder":"work"}"#);
    let replaced = service
        .update_image(&admin, &pinned.image_id, change(Some(r#"{"colour":"teal"}"#)))
        .await
        .unwrap();
    assert_eq!(replaced.metadata_json, r#"{"colour":"teal"}"#);
    // Anything but an object, or past 16 KiB, is refused and changes nothing.
    for bad in ["[1]", "\"text\"", "{not json", "7"] {
        assert_eq!(
            reason(service.create_image(&admin, with(bad)).await),
            "INVALID_METADATA",
            "{bad}"
        );
        assert_eq!(
            reason(service.update_image(&admin, &pinned.image_id, change(Some(bad))).await),
            "INVALID_METADATA"
        );
    }
    let huge = format!(r#"{{"x":"{}"}}"#, "y".repeat(16 * 1024));
    assert_eq!(
        reason(service.create_image(&admin, with(&huge)).await),
        "INVALID_METADATA"
    );
    let after = service.get_image(&admin, &pinned.image_id).await.unwrap();
    assert_eq!(after.metadata_json, r#"{"colour":"teal"}"#);
}
