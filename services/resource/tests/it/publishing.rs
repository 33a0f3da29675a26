//! Registering and publishing: immutable versions, resource fields, content
//! schemas, permissions.

use std::collections::BTreeSet;
use std::sync::Arc;

use avm_common::Code;
use avm_common::auth::{Role, Scopes};
use avm_common::testing::{admin_ctx, member_ctx, principal_ctx};
use avm_resource::{Kind, NewResource, NewVersion, ResourceService, ResourceStore, Visibility};

use crate::support::{assert_err, conformance_suite, content, new_resource, new_version, register};

conformance_suite!(
    published_versions_never_change,
    registration_round_trips_and_updates_the_resource,
    content_is_checked_against_its_kind,
    names_tags_and_descriptions_are_validated,
    writing_needs_the_write_scope,
    concurrent_registrations_make_one_resource_and_one_version,
);

const A: &str = "tenant-a";

async fn published_versions_never_change(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let v1 = r#"{"template":"version one"}"#;
    let first = service
        .register(&ctx, new_resource(Kind::Prompt, "p", "1.0.0", v1))
        .await
        .unwrap();
    assert!(first.created);
    let id = first.resource.resource_id.clone();

    // The same version again is refused, with the same content or another, by either RPC.
    for again in [
        service
            .register(&ctx, new_resource(Kind::Prompt, "p", "1.0.0", v1))
            .await,
        service
            .register(
                &ctx,
                new_resource(Kind::Prompt, "p", "1.0.0", r#"{"template":"changed"}"#),
            )
            .await,
        service
            .publish(&ctx, new_version(&id, "1.0.0", r#"{"template":"changed"}"#))
            .await,
    ] {
        assert_err(
            again,
            Code::AlreadyExists,
            "VERSION_EXISTS",
            "resource://prompts/p@1.0.0 already exists",
        );
    }

    let second = service
        .register(
            &ctx,
            new_resource(Kind::Prompt, "p", "1.1.0", r#"{"template":"version two"}"#),
        )
        .await
        .unwrap();
    assert!(
        !second.created,
        "a second registration publishes into the same resource"
    );
    assert_eq!(second.resource.resource_id, id);
    let third = service
        .publish(&ctx, new_version(&id, "2.0.0", r#"{"template":"version three"}"#))
        .await
        .unwrap();
    assert_eq!(third.resource.latest_version, "2.0.0");

    let old = service.get(&ctx, &id, "1.0.0").await.unwrap().version;
    assert_eq!(old, first.version, "1.0.0 is exactly as first published");
    assert_eq!(old.content_json, v1);
    assert_eq!(service.get(&ctx, &id, "1.1.0").await.unwrap().version, second.version);
}

async fn registration_round_trips_and_updates_the_resource(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = member_ctx(A, "usr_ann");
    register(&service, &ctx, Kind::Knowledge, "faq", "1.0.0", &[]).await;
    // Content kept byte for byte, spacing included.
    let agent_json = r#"{ "prompt": "resource://prompts/p",  "knowledge": ["resource://knowledge/faq@^1"] }"#;
    register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    let published = service
        .register(
            &ctx,
            NewResource {
                description: "Sells things".into(),
                tags: vec!["sales".into(), "en".into(), "sales".into()],
                dependencies: vec!["resource://knowledge/faq".into(), "resource://prompts/p".into()],
                ..new_resource(Kind::Agent, "seller", "1.0.0", agent_json)
            },
        )
        .await
        .unwrap();
    let resource = &published.resource;
    assert!(published.created);
    assert!(resource.resource_id.starts_with("res_"));
    assert_eq!(
        (resource.tenant_id.as_str(), resource.kind, resource.name.as_str()),
        (A, Kind::Agent, "seller")
    );
    assert_eq!(resource.visibility, Visibility::Private);
    assert_eq!(resource.uri().to_string(), "resource://agents/seller");
    assert_eq!(resource.description, "Sells things");
    assert_eq!(resource.tags, ["sales", "en"], "tags once each, in order");
    assert_eq!(resource.latest_version, "1.0.0");
    assert!(resource.created_at_ms > 0 && resource.updated_at_ms >= resource.created_at_ms);
    let version = &published.version;
    assert_eq!(version.uri().to_string(), "resource://agents/seller@1.0.0");
    assert_eq!(version.content_json, agent_json);
    assert_eq!(version.created_by, "usr_ann");
    let dependencies: Vec<String> = version.dependencies.iter().map(ToString::to_string).collect();
    assert_eq!(
        dependencies,
        [
            "resource://prompts/p",
            "resource://knowledge/faq@^1",
            "resource://knowledge/faq"
        ],
        "the content's first, then the explicit ones, each once as written"
    );
    let detail = service.get(&ctx, &resource.resource_id, "").await.unwrap();
    assert_eq!(&detail.resource, resource);
    assert_eq!(&detail.version, version);
    assert_eq!(detail.versions.len(), 1);
    assert_eq!(detail.versions[0].dependencies, version.dependencies);
    assert_eq!(
        (detail.versions[0].created_by.as_str(), detail.versions[0].created_at_ms),
        ("usr_ann", version.created_at_ms)
    );

    // A registration without description or tags leaves them; one with them replaces them.
    let id = resource.resource_id.clone();
    let plain = service
        .register(&ctx, new_resource(Kind::Agent, "seller", "1.1.0", content(Kind::Agent)))
        .await
        .unwrap();
    assert_eq!(
        (plain.resource.description.as_str(), plain.resource.tags.as_slice()),
        ("Sells things", ["sales".to_owned(), "en".to_owned()].as_slice())
    );
    let retagged = service
        .register(
            &ctx,
            NewResource {
                description: "Sells more".into(),
                tags: vec!["b2b".into()],
                ..new_resource(Kind::Agent, "seller", "1.2.0", content(Kind::Agent))
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (
            retagged.resource.description.as_str(),
            retagged.resource.tags.as_slice()
        ),
        ("Sells more", ["b2b".to_owned()].as_slice())
    );
    // A publish replaces what it sets, and may clear it.
    let kept = service
        .publish(&ctx, new_version(&id, "1.3.0", content(Kind::Agent)))
        .await
        .unwrap();
    assert_eq!(
        (kept.resource.description.as_str(), kept.resource.tags.as_slice()),
        ("Sells more", ["b2b".to_owned()].as_slice())
    );
    let cleared = service
        .publish(
            &ctx,
            NewVersion {
                description: Some(String::new()),
                tags: Some(Vec::new()),
                ..new_version(&id, "1.4.0", content(Kind::Agent))
            },
        )
        .await
        .unwrap();
    assert_eq!(cleared.resource.description, "");
    assert!(cleared.resource.tags.is_empty());
    assert_eq!(cleared.resource.latest_version, "1.4.0");
    assert!(cleared.resource.updated_at_ms >= resource.updated_at_ms);
    assert_eq!(service.get(&ctx, &id, "").await.unwrap().resource, cleared.resource);
}

async fn content_is_checked_against_its_kind(store: Arc<dyn ResourceStore>) {
    let rules = avm_common::mcp::McpServerRules::new(vec!["mcp-fs".into()], &[]).unwrap();
    let service = ResourceService::new(store).with_mcp_rules(rules);
    let ctx = admin_ctx(A);
    register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Tool, "t", "1.0.0", &[]).await;

    let valid = [
        (
            Kind::Prompt,
            r#"{"template":"Hi {{ who }}{{x}}","variables":[{"name":"who","description":"d"},{"name":"x","required":false,"default":"!"}]}"#,
        ),
        (
            Kind::Tool,
            r#"{"name":"fs","description":"files","inputSchema":{"type":"object"},"mcpServer":{"command":"mcp-fs","args":["/"],"env":{"A":"b"}}}"#,
        ),
        (
            Kind::Tool,
            r#"{"name":"web","inputSchema":{"type":"object"},"mcpServer":{"type":"sse","url":"https://mcp.example/sse"}}"#,
        ),
        (
            Kind::Sandbox,
            r#"{"limits":{"cpuMillis":1000,"memoryMb":512,"diskMb":1024,"timeoutSeconds":60,"network":true}}"#,
        ),
        (
            Kind::Agent,
            r#"{"prompt":"resource://prompts/p@^1","model":"m","tools":["resource://tools/t"],"variables":{"who":"you"},"parameters":{"maxTokens":1024,"temperature":0.7}}"#,
        ),
        (
            Kind::Knowledge,
            r#"{"documents":[{"title":"FAQ","text":"Yes.","mediaType":"text/markdown"}]}"#,
        ),
    ];
    for (i, (kind, json)) in valid.into_iter().enumerate() {
        let name = format!("valid-{i}");
        let published = service
            .register(&ctx, new_resource(kind, &name, "1.0.0", json))
            .await
            .unwrap_or_else(|err| panic!("{json}: {err}"));
        assert_eq!(published.version.content_json, json);
    }

    // What the runtime would refuse to start or reach is refused when it is
    // published (issue 26 item 18), by the same rules.
    for (server, reason) in [
        (
            r#"{"command":"/bin/sh","args":["-c","id"]}"#,
            "MCP_COMMAND_NOT_APPROVED",
        ),
        (
            r#"{"type":"http","url":"http://169.254.169.254/latest"}"#,
            "MCP_SERVER_REFUSED",
        ),
        (
            r#"{"type":"sse","url":"http://127.0.0.1:8080/sse"}"#,
            "MCP_SERVER_REFUSED",
        ),
        (r#"{"type":"http","url":"http://localhost/mcp"}"#, "MCP_SERVER_REFUSED"),
    ] {
        let json = format!(r#"{{"name":"x","inputSchema":{{"type":"object"}},"mcpServer":{server}}}"#);
        assert_err(
            service
                .register(&ctx, new_resource(Kind::Tool, "refused", "1.0.0", &json))
                .await,
            Code::InvalidArgument,
            reason,
            "",
        );
    }
    // A later version is checked too.
    let fs = service
        .resolve(&ctx, "resource://tools/valid-1", "")
        .await
        .unwrap()
        .root;
    assert_err(
        service
            .publish(
                &ctx,
                new_version(
                    &fs.resource_id,
                    "2.0.0",
                    r#"{"name":"fs","inputSchema":{"type":"object"},"mcpServer":{"command":"/bin/sh"}}"#,
                ),
            )
            .await,
        Code::InvalidArgument,
        "MCP_COMMAND_NOT_APPROVED",
        "/bin/sh",
    );

    let invalid = [
        (Kind::Prompt, "not json", "content is not valid json"),
        (Kind::Prompt, "[1]", "content: must be a json object"),
        (
            Kind::Prompt,
            r#"{"template":"x","extra":true}"#,
            "content.extra: unknown field",
        ),
        (
            Kind::Prompt,
            r#"{"template":""}"#,
            "content.template: must not be empty",
        ),
        (
            Kind::Prompt,
            r#"{"template":"{{ who }}"}"#,
            "content.template: undeclared variable {{who}}",
        ),
        (
            Kind::Prompt,
            r#"{"template":"x","variables":[{"name":"ok"},{"name":"not ok"}]}"#,
            "content.variables[1].name:",
        ),
        (
            Kind::Prompt,
            r#"{"template":"x","variables":[{"name":"a"},{"name":"a"}]}"#,
            "content.variables[1].name: a is declared twice",
        ),
        (
            Kind::Tool,
            r#"{"name":"t","inputSchema":{"type":"object"}}"#,
            "needs an mcpServer or a builtin",
        ),
        (
            Kind::Tool,
            r#"{"name":"t","inputSchema":{"type":"array"},"builtin":"b"}"#,
            "content.inputSchema.type",
        ),
        (
            Kind::Tool,
            r#"{"name":"t","inputSchema":{"type":"object"},"mcpServer":{"type":"http"}}"#,
            "content.mcpServer.url: is required",
        ),
        (
            Kind::Sandbox,
            r#"{"limits":{"memoryMb":-1}}"#,
            "content.limits.memoryMb: must be a positive integer",
        ),
        (
            Kind::Sandbox,
            r#"{"limits":{"gpus":2}}"#,
            "content.limits.gpus: unknown field",
        ),
        (Kind::Sandbox, r#"{"limit":{}}"#, "content.limit: unknown field"),
        (Kind::Agent, r#"{"model":"m"}"#, "content.prompt: is required"),
        (
            Kind::Agent,
            r#"{"prompt":"resource://tools/t"}"#,
            "content.prompt: must name a prompt",
        ),
        (
            Kind::Agent,
            r#"{"prompt":"resource://prompts/p","tools":["resource://tools/t","resource://sandboxes/s"]}"#,
            "content.tools[1]: must name a tool",
        ),
        (
            Kind::Agent,
            r#"{"prompt":"resource://prompts/p","parameters":{"temperature":2.5}}"#,
            "content.parameters.temperature",
        ),
        (
            Kind::Knowledge,
            r#"{"documents":[]}"#,
            "content.documents: needs at least one document",
        ),
        (
            Kind::Knowledge,
            r#"{"documents":[{"title":"t"}]}"#,
            "content.documents[0].text: is required",
        ),
    ];
    for (kind, json, says) in invalid {
        assert_err(
            service
                .register(&ctx, new_resource(kind, "invalid", "1.0.0", json))
                .await,
            Code::InvalidArgument,
            "INVALID_CONTENT",
            says,
        );
    }
    // Nothing was created by the refusals.
    assert_err(
        service.resolve(&ctx, "resource://prompts/invalid", "").await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        "resource resource://prompts/invalid not found",
    );

    let huge = format!(r#"{{"template":"{}"}}"#, "x".repeat(256 * 1024));
    assert_err(
        service
            .register(&ctx, new_resource(Kind::Prompt, "huge", "1.0.0", &huge))
            .await,
        Code::InvalidArgument,
        "CONTENT_TOO_LARGE",
        "256 KiB",
    );
}

async fn names_tags_and_descriptions_are_validated(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let too_long = "n".repeat(129);
    for bad in ["", "Upper", "-dash", "with space", "slash/y", too_long.as_str()] {
        assert_err(
            service
                .register(&ctx, new_resource(Kind::Prompt, bad, "1.0.0", content(Kind::Prompt)))
                .await,
            Code::InvalidArgument,
            "INVALID_NAME",
            "",
        );
    }
    let longest = "n".repeat(128);
    for good in ["a", "0-start", "dots.and_underscores-1", longest.as_str()] {
        register(&service, &ctx, Kind::Prompt, good, "1.0.0", &[]).await;
    }
    for tags in [
        vec!["Sales".to_owned()],
        vec!["t".repeat(65)],
        (0..33).map(|i| format!("t{i}")).collect(),
    ] {
        assert_err(
            service
                .register(
                    &ctx,
                    NewResource {
                        tags,
                        ..new_resource(Kind::Prompt, "tagged", "1.0.0", content(Kind::Prompt))
                    },
                )
                .await,
            Code::InvalidArgument,
            "INVALID_TAG",
            "",
        );
    }
    assert_err(
        service
            .register(
                &ctx,
                NewResource {
                    description: "d".repeat(2001),
                    ..new_resource(Kind::Prompt, "described", "1.0.0", content(Kind::Prompt))
                },
            )
            .await,
        Code::InvalidArgument,
        "INVALID_DESCRIPTION",
        "2000",
    );
    assert_err(
        service
            .publish(&ctx, new_version("", "1.0.0", content(Kind::Prompt)))
            .await,
        Code::InvalidArgument,
        "INVALID_RESOURCE_ID",
        "",
    );
}

async fn writing_needs_the_write_scope(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let reader = principal_ctx(A, "usr_reader", Role::Member, Scopes::READ);
    let id = register(&service, &admin_ctx(A), Kind::Prompt, "p", "1.0.0", &[])
        .await
        .resource
        .resource_id;
    assert_err(
        service
            .register(&reader, new_resource(Kind::Prompt, "q", "1.0.0", content(Kind::Prompt)))
            .await,
        Code::PermissionDenied,
        "MISSING_SCOPE",
        "write",
    );
    assert_err(
        service
            .publish(&reader, new_version(&id, "1.1.0", content(Kind::Prompt)))
            .await,
        Code::PermissionDenied,
        "MISSING_SCOPE",
        "write",
    );
    // Reading is all it may do.
    assert_eq!(service.get(&reader, &id, "").await.unwrap().version.version, "1.0.0");
    service.resolve(&reader, "resource://prompts/p", "").await.unwrap();

    // Members register their tenant's private resources and publish versions
    // of their own, not of others' (issue 26 item 4), and do not delete them.
    let member = member_ctx(A, "usr_bo");
    assert_err(
        service
            .publish(&member, new_version(&id, "1.1.0", content(Kind::Prompt)))
            .await,
        Code::PermissionDenied,
        "NOT_RESOURCE_OWNER",
        "admin",
    );
    assert_err(
        service
            .register(&member, new_resource(Kind::Prompt, "p", "1.2.0", content(Kind::Prompt)))
            .await,
        Code::PermissionDenied,
        "NOT_RESOURCE_OWNER",
        "admin",
    );
    let own = register(&service, &member, Kind::Prompt, "mine", "1.0.0", &[])
        .await
        .resource
        .resource_id;
    service
        .publish(&member, new_version(&own, "1.1.0", content(Kind::Prompt)))
        .await
        .unwrap();
    service
        .publish(&admin_ctx(A), new_version(&own, "1.2.0", content(Kind::Prompt)))
        .await
        .unwrap();
    assert_err(
        service
            .publish(
                &member_ctx(A, "usr_other"),
                new_version(&own, "1.3.0", content(Kind::Prompt)),
            )
            .await,
        Code::PermissionDenied,
        "NOT_RESOURCE_OWNER",
        "",
    );
    assert_err(
        service.delete(&member, &id, "", false).await,
        Code::PermissionDenied,
        "MISSING_SCOPE",
        "admin",
    );
    let unscoped = principal_ctx(A, "usr_none", Role::Admin, Scopes::NONE);
    assert_err(
        service.get(&unscoped, &id, "").await,
        Code::PermissionDenied,
        "MISSING_SCOPE",
        "read",
    );
    assert_err(
        service.list(&unscoped, avm_resource::ListQuery::default()).await,
        Code::PermissionDenied,
        "MISSING_SCOPE",
        "read",
    );
}

async fn concurrent_registrations_make_one_resource_and_one_version(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    // The same version from eight callers at once: one publishes it.
    let same: Vec<_> = (0..8)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move {
                service
                    .register(
                        &admin_ctx(A),
                        new_resource(Kind::Prompt, "race", "1.0.0", content(Kind::Prompt)),
                    )
                    .await
            })
        })
        .collect();
    let (mut won, mut refused) = (0, 0);
    for task in same {
        match task.await.unwrap() {
            Ok(published) => {
                assert!(published.created);
                won += 1;
            }
            Err(err) => {
                assert_eq!(avm_common::ApiError::from(err).reason, "VERSION_EXISTS");
                refused += 1;
            }
        }
    }
    assert_eq!((won, refused), (1, 7));

    // Eight versions of a new name at once: one resource holds them all.
    let versions: Vec<_> = (0..8)
        .map(|i| {
            let service = service.clone();
            tokio::spawn(async move {
                service
                    .register(
                        &admin_ctx(A),
                        new_resource(Kind::Tool, "busy", &format!("1.{i}.0"), content(Kind::Tool)),
                    )
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut ids = BTreeSet::new();
    let mut created = 0;
    for task in versions {
        let published = task.await.unwrap();
        ids.insert(published.resource.resource_id);
        created += usize::from(published.created);
    }
    assert_eq!((ids.len(), created), (1, 1));
    let id = ids.into_iter().next().unwrap();
    let detail = service.get(&admin_ctx(A), &id, "").await.unwrap();
    assert_eq!(detail.versions.len(), 8);
    assert_eq!(detail.resource.latest_version, "1.7.0");
}
