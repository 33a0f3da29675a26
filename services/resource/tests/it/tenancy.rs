//! Tenancy: private resources stay unknown to other tenants; public ones are
//! read by all, changed by their owner only, and shadowed by a tenant's own.

use std::sync::Arc;

use avm_common::testing::{admin_ctx, member_ctx, operator_ctx, service_ctx};
use avm_common::{ApiError, Code};
use avm_resource::{Kind, ListQuery, NewResource, ResourceService, ResourceStore, Visibility};

use crate::support::{api_err, assert_err, conformance_suite, content, new_resource, new_version, register};

conformance_suite!(
    another_tenants_private_resource_answers_like_a_missing_one,
    tenants_own_the_same_name_apart,
    public_resources_are_read_by_all_and_changed_by_their_owner,
    a_tenants_own_resource_shadows_a_public_one,
    public_resources_depend_only_on_public_ones,
    deleting_a_public_resource_counts_every_tenants_dependents,
);

const A: &str = "tenant-a";
const B: &str = "tenant-b";
const OPS: &str = "tenant-ops";

/// Asserts two errors are the same answer once `foreign` is written as `missing`.
#[track_caller]
fn same(foreign: ApiError, missing: ApiError, foreign_id: &str, missing_id: &str) {
    assert_eq!(foreign.code, Code::NotFound);
    assert_eq!(
        (
            foreign.code,
            foreign.reason.as_ref(),
            foreign.message.replace(foreign_id, missing_id)
        ),
        (missing.code, missing.reason.as_ref(), missing.message.clone())
    );
}

async fn another_tenants_private_resource_answers_like_a_missing_one(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let a = admin_ctx(A);
    let b = admin_ctx(B);
    let secret = register(&service, &a, Kind::Prompt, "secret", "1.0.0", &[]).await;
    let id = secret.resource.resource_id.clone();
    let ghost = "res_00000000000000000000000000000000";

    same(
        api_err(service.get(&b, &id, "").await),
        api_err(service.get(&b, ghost, "").await),
        &id,
        ghost,
    );
    same(
        api_err(service.get(&b, &id, "1.0.0").await),
        api_err(service.get(&b, ghost, "1.0.0").await),
        &id,
        ghost,
    );
    same(
        api_err(
            service
                .publish(&b, new_version(&id, "2.0.0", content(Kind::Prompt)))
                .await,
        ),
        api_err(
            service
                .publish(&b, new_version(ghost, "2.0.0", content(Kind::Prompt)))
                .await,
        ),
        &id,
        ghost,
    );
    // Even content that would be refused does not tell the two apart.
    same(
        api_err(service.publish(&b, new_version(&id, "2.0.0", "{}")).await),
        api_err(service.publish(&b, new_version(ghost, "2.0.0", "{}")).await),
        &id,
        ghost,
    );
    for force in [false, true] {
        same(
            api_err(service.delete(&b, &id, "", force).await),
            api_err(service.delete(&b, ghost, "", force).await),
            &id,
            ghost,
        );
        same(
            api_err(service.delete(&b, &id, "1.0.0", force).await),
            api_err(service.delete(&b, ghost, "1.0.0", force).await),
            &id,
            ghost,
        );
    }
    for (uri, missing) in [
        ("resource://prompts/secret", "resource://prompts/nothing"),
        ("resource://prompts/secret@1.0.0", "resource://prompts/nothing@1.0.0"),
        ("resource://prompts/secret@^1", "resource://prompts/nothing@^1"),
    ] {
        same(
            api_err(service.resolve(&b, uri, "").await),
            api_err(service.resolve(&b, missing, "").await),
            "secret",
            "nothing",
        );
    }
    assert_err(
        service.get(&b, &id, "").await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        &format!("resource {id} not found"),
    );
    // B cannot depend on it either: it is as missing as any.
    assert_err(
        service
            .register(
                &b,
                new_resource(
                    Kind::Agent,
                    "thief",
                    "1.0.0",
                    r#"{"prompt":"resource://prompts/secret"}"#,
                ),
            )
            .await,
        Code::FailedPrecondition,
        "MISSING_DEPENDENCY",
        "resource://prompts/secret",
    );
    for query in [
        ListQuery::default(),
        ListQuery {
            name: Some("secret".into()),
            ..ListQuery::default()
        },
        ListQuery {
            query: Some("secret".into()),
            ..ListQuery::default()
        },
    ] {
        let page = service.list(&b, query).await.unwrap();
        assert!(page.resources.is_empty(), "{:?}", page.resources);
    }
    // A member of B is no different; A still sees its own.
    let member = member_ctx(B, "usr_b");
    same(
        api_err(service.get(&member, &id, "").await),
        api_err(service.get(&member, ghost, "").await),
        &id,
        ghost,
    );
    assert_eq!(service.get(&a, &id, "").await.unwrap().resource, secret.resource);
}

async fn tenants_own_the_same_name_apart(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let a = register(&service, &admin_ctx(A), Kind::Prompt, "same-name", "1.0.0", &[]).await;
    let b = service
        .register(
            &admin_ctx(B),
            new_resource(Kind::Prompt, "same-name", "1.0.0", r#"{"template":"b's own"}"#),
        )
        .await
        .unwrap();
    assert!(a.created && b.created, "each tenant creates its own");
    assert_ne!(a.resource.resource_id, b.resource.resource_id);
    assert_eq!(a.resource.uri(), b.resource.uri());
    let from_a = service
        .resolve(&admin_ctx(A), "resource://prompts/same-name", "")
        .await
        .unwrap();
    let from_b = service
        .resolve(&member_ctx(B, "usr_b"), "resource://prompts/same-name", "")
        .await
        .unwrap();
    assert_eq!(from_a.root.resource_id, a.resource.resource_id);
    assert_eq!(from_b.root.resource_id, b.resource.resource_id);
    assert_eq!(from_b.rendered_prompt.as_deref(), Some("b's own"));
    // The same version number in each: versions are per resource.
    register(&service, &admin_ctx(B), Kind::Prompt, "same-name", "2.0.0", &[]).await;
    register(&service, &admin_ctx(A), Kind::Prompt, "same-name", "2.0.0", &[]).await;
}

async fn public_resources_are_read_by_all_and_changed_by_their_owner(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ops = operator_ctx(OPS);
    let public = service
        .register(
            &ops,
            NewResource {
                public: true,
                tags: vec!["official".into()],
                ..new_resource(Kind::Prompt, "shared", "1.0.0", content(Kind::Prompt))
            },
        )
        .await
        .unwrap();
    assert_eq!(public.resource.visibility, Visibility::Public);
    assert_eq!(public.resource.tenant_id, OPS);
    let id = public.resource.resource_id.clone();

    for reader in [admin_ctx(A), member_ctx(B, "usr_b")] {
        assert_eq!(service.get(&reader, &id, "").await.unwrap().resource, public.resource);
        let resolved = service.resolve(&reader, "resource://prompts/shared", "").await.unwrap();
        assert_eq!(resolved.root.resource_id, id);
        let listed = service.list(&reader, ListQuery::default()).await.unwrap();
        assert_eq!(listed.resources, std::slice::from_ref(&public.resource));
        // Tenants build on it.
        let agent = format!("agent-of-{}", reader.tenant_id);
        service
            .register(
                &reader,
                new_resource(
                    Kind::Agent,
                    &agent,
                    "1.0.0",
                    r#"{"prompt":"resource://prompts/shared"}"#,
                ),
            )
            .await
            .unwrap();
    }

    // Only operators (and services) publish public resources.
    assert_err(
        service
            .register(
                &admin_ctx(A),
                NewResource {
                    public: true,
                    ..new_resource(Kind::Prompt, "mine", "1.0.0", content(Kind::Prompt))
                },
            )
            .await,
        Code::PermissionDenied,
        "OPERATOR_REQUIRED",
        "operator",
    );
    let by_service = service
        .register(
            &service_ctx("tenant-svc"),
            NewResource {
                public: true,
                ..new_resource(Kind::Tool, "svc-tool", "1.0.0", content(Kind::Tool))
            },
        )
        .await
        .unwrap();
    assert_eq!(by_service.resource.visibility, Visibility::Public);

    // Only the owner tenant's admins change it.
    let other_admin = admin_ctx(A);
    assert_err(
        service
            .publish(&other_admin, new_version(&id, "1.1.0", content(Kind::Prompt)))
            .await,
        Code::PermissionDenied,
        "NOT_RESOURCE_OWNER",
        &id,
    );
    assert_err(
        service.delete(&other_admin, &id, "", true).await,
        Code::PermissionDenied,
        "NOT_RESOURCE_OWNER",
        &id,
    );
    assert_err(
        service
            .publish(
                &member_ctx(OPS, "usr_ops_member"),
                new_version(&id, "1.1.0", content(Kind::Prompt)),
            )
            .await,
        Code::PermissionDenied,
        "MISSING_SCOPE",
        "admin",
    );
    let plain_admin = admin_ctx(OPS);
    let next = service
        .publish(&plain_admin, new_version(&id, "1.1.0", content(Kind::Prompt)))
        .await
        .unwrap();
    assert_eq!(next.resource.latest_version, "1.1.0");
    // Registering again publishes into it; `public` may be left out or repeated.
    let again = service
        .register(
            &ops,
            new_resource(Kind::Prompt, "shared", "1.2.0", content(Kind::Prompt)),
        )
        .await
        .unwrap();
    assert!(!again.created && again.resource.is_public());

    // One public resource per kind and name.
    assert_err(
        service
            .register(
                &operator_ctx("tenant-ops-2"),
                NewResource {
                    public: true,
                    ..new_resource(Kind::Prompt, "shared", "1.0.0", content(Kind::Prompt))
                },
            )
            .await,
        Code::AlreadyExists,
        "PUBLIC_NAME_TAKEN",
        "resource://prompts/shared",
    );
    // Visibility is chosen at creation.
    register(&service, &ops, Kind::Prompt, "ops-private", "1.0.0", &[]).await;
    assert_err(
        service
            .register(
                &ops,
                NewResource {
                    public: true,
                    ..new_resource(Kind::Prompt, "ops-private", "2.0.0", content(Kind::Prompt))
                },
            )
            .await,
        Code::FailedPrecondition,
        "VISIBILITY_MISMATCH",
        "resource://prompts/ops-private",
    );
}

async fn a_tenants_own_resource_shadows_a_public_one(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ops = operator_ctx(OPS);
    let public = service
        .register(
            &ops,
            NewResource {
                public: true,
                ..new_resource(Kind::Prompt, "shared", "2.0.0", r#"{"template":"public"}"#)
            },
        )
        .await
        .unwrap();
    let own = service
        .register(
            &admin_ctx(A),
            new_resource(Kind::Prompt, "shared", "1.0.0", r#"{"template":"a's own"}"#),
        )
        .await
        .unwrap();
    assert!(own.created, "registering the public name makes A's own resource");
    assert_eq!(own.resource.visibility, Visibility::Private);

    let a = admin_ctx(A);
    let resolved = service.resolve(&a, "resource://prompts/shared", "").await.unwrap();
    assert_eq!(resolved.rendered_prompt.as_deref(), Some("a's own"));
    // Own shadows public even when only the public one would match.
    assert_err(
        service.resolve(&a, "resource://prompts/shared@^2", "").await,
        Code::NotFound,
        "VERSION_NOT_FOUND",
        "resource://prompts/shared@^2",
    );
    let listed = service.list(&a, ListQuery::default()).await.unwrap();
    assert_eq!(listed.resources, std::slice::from_ref(&own.resource));
    // The public one is still there by id, and for everyone else.
    assert_eq!(
        service
            .get(&a, &public.resource.resource_id, "")
            .await
            .unwrap()
            .resource,
        public.resource
    );
    let b = admin_ctx(B);
    let from_b = service.resolve(&b, "resource://prompts/shared", "").await.unwrap();
    assert_eq!(from_b.rendered_prompt.as_deref(), Some("public"));
    assert_eq!(
        service.list(&b, ListQuery::default()).await.unwrap().resources,
        std::slice::from_ref(&public.resource)
    );
    // The owner tenant sees its public resource as its own.
    assert_eq!(
        service.list(&ops, ListQuery::default()).await.unwrap().resources,
        std::slice::from_ref(&public.resource)
    );
}

async fn public_resources_depend_only_on_public_ones(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ops = operator_ctx(OPS);
    register(&service, &ops, Kind::Prompt, "internal", "1.0.0", &[]).await;
    let public_agent = |prompt: &str| NewResource {
        public: true,
        ..new_resource(Kind::Agent, "helper", "1.0.0", &format!(r#"{{"prompt":"{prompt}"}}"#))
    };
    assert_err(
        service
            .register(&ops, public_agent("resource://prompts/internal"))
            .await,
        Code::FailedPrecondition,
        "PRIVATE_DEPENDENCY",
        "resource://prompts/internal",
    );
    service
        .register(
            &ops,
            NewResource {
                public: true,
                ..new_resource(Kind::Prompt, "open", "1.0.0", content(Kind::Prompt))
            },
        )
        .await
        .unwrap();
    let helper = service
        .register(&ops, public_agent("resource://prompts/open"))
        .await
        .unwrap();
    let from_b = service
        .resolve(&admin_ctx(B), "resource://agents/helper", "")
        .await
        .unwrap();
    assert_eq!(from_b.root.resource_id, helper.resource.resource_id);
    assert_eq!(
        crate::support::uris(&from_b.dependencies),
        ["resource://prompts/open@1.0.0"]
    );
}

async fn deleting_a_public_resource_counts_every_tenants_dependents(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ops = operator_ctx(OPS);
    let public = service
        .register(
            &ops,
            NewResource {
                public: true,
                ..new_resource(Kind::Knowledge, "facts", "1.0.0", content(Kind::Knowledge))
            },
        )
        .await
        .unwrap();
    let id = public.resource.resource_id.clone();
    // B's tool needs the public facts; A's needs its own, which shadow them.
    register(&service, &admin_ctx(A), Kind::Knowledge, "facts", "1.0.0", &[]).await;
    register(
        &service,
        &admin_ctx(A),
        Kind::Tool,
        "t",
        "1.0.0",
        &["resource://knowledge/facts"],
    )
    .await;
    let b_tool = register(
        &service,
        &admin_ctx(B),
        Kind::Tool,
        "t",
        "1.0.0",
        &["resource://knowledge/facts"],
    )
    .await;

    let ops_tool = register(
        &service,
        &ops,
        Kind::Tool,
        "ops-t",
        "1.0.0",
        &["resource://knowledge/facts@1"],
    )
    .await;

    // The owner sees its own dependents by name and only counts other tenants'.
    assert_err(
        service.delete(&ops, &id, "", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "resource://knowledge/facts is used by resource://tools/ops-t@1.0.0 and 1 resource version of another tenant",
    );
    service
        .delete(&ops, &ops_tool.resource.resource_id, "", false)
        .await
        .unwrap();
    assert_err(
        service.delete(&ops, &id, "", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "resource://knowledge/facts is used by 1 resource version of another tenant",
    );
    service
        .delete(&admin_ctx(B), &b_tool.resource.resource_id, "", false)
        .await
        .unwrap();
    let deleted = service.delete(&ops, &id, "", false).await.unwrap();
    assert!(deleted.resource_deleted, "A's dependent never needed the public one");
    // A's own facts are untouched.
    service.resolve(&admin_ctx(A), "resource://tools/t", "").await.unwrap();
}
