//! Dependencies: checked at publish, resolved to a closure, cycles found.

use std::sync::Arc;

use avm_common::Code;
use avm_common::testing::admin_ctx;
use avm_resource::{Kind, NewResource, ResourceService, ResourceStore};

use crate::support::{assert_err, conformance_suite, new_resource, new_version, register, register_with, uris};

conformance_suite!(
    closure_has_exact_versions_dependencies_first,
    diamond_lists_a_shared_dependency_once,
    two_versions_of_one_resource_are_both_listed,
    dependencies_must_resolve_when_published,
    a_forced_delete_leaves_a_missing_dependency_at_resolve,
    cycles_are_reported_with_their_path,
    resolve_refuses_bad_and_unknown_uris,
);

const A: &str = "tenant-a";

async fn closure_has_exact_versions_dependencies_first(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let p = register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    service
        .publish(
            &ctx,
            new_version(&p.resource.resource_id, "1.1.0", r#"{"template":"newer"}"#),
        )
        .await
        .unwrap();
    register(&service, &ctx, Kind::Prompt, "p", "2.0.0", &[]).await;
    register(&service, &ctx, Kind::Tool, "search", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Sandbox, "small", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Sandbox, "small", "1.5.0", &[]).await;
    register(&service, &ctx, Kind::Knowledge, "faq", "3.0.0", &[]).await;
    let agent = r#"{"prompt":"resource://prompts/p@^1","tools":["resource://tools/search"],
        "sandbox":"resource://sandboxes/small@1.0.0","knowledge":["resource://knowledge/faq@>=3.0.0, <4"]}"#;
    register_with(&service, &ctx, Kind::Agent, "seller", "1.0.0", agent).await;

    let resolved = service.resolve(&ctx, "resource://agents/seller@1", "").await.unwrap();
    assert_eq!(resolved.root.uri().to_string(), "resource://agents/seller@1.0.0");
    assert_eq!(
        uris(&resolved.dependencies),
        [
            "resource://prompts/p@1.1.0",
            "resource://tools/search@1.0.0",
            "resource://sandboxes/small@1.0.0",
            "resource://knowledge/faq@3.0.0",
        ],
        "the highest match of each requirement, in declaration order"
    );
    assert_eq!(resolved.dependencies[0].content_json, r#"{"template":"newer"}"#);
    // The root keeps its requirements as written.
    let declared: Vec<String> = resolved.root.dependencies.iter().map(ToString::to_string).collect();
    assert_eq!(
        declared,
        [
            "resource://prompts/p@^1",
            "resource://tools/search",
            "resource://sandboxes/small@1.0.0",
            "resource://knowledge/faq@>=3.0.0, <4",
        ]
    );
    // Resolving a leaf gives it alone.
    let leaf = service.resolve(&ctx, "resource://tools/search", "").await.unwrap();
    assert!(leaf.dependencies.is_empty());
}

async fn diamond_lists_a_shared_dependency_once(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    register(&service, &ctx, Kind::Knowledge, "base", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Knowledge, "base", "1.1.0", &[]).await;
    register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    register(
        &service,
        &ctx,
        Kind::Tool,
        "left",
        "1.0.0",
        &["resource://knowledge/base@^1"],
    )
    .await;
    register(
        &service,
        &ctx,
        Kind::Tool,
        "right",
        "1.0.0",
        &["resource://knowledge/base"],
    )
    .await;
    let agent = r#"{"prompt":"resource://prompts/p","tools":["resource://tools/left","resource://tools/right"]}"#;
    register_with(&service, &ctx, Kind::Agent, "a", "1.0.0", agent).await;

    let resolved = service.resolve(&ctx, "resource://agents/a", "").await.unwrap();
    assert_eq!(
        uris(&resolved.dependencies),
        [
            "resource://prompts/p@1.0.0",
            "resource://knowledge/base@1.1.0",
            "resource://tools/left@1.0.0",
            "resource://tools/right@1.0.0",
        ],
        "the shared dependency once, before both dependents"
    );
}

async fn two_versions_of_one_resource_are_both_listed(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    register(&service, &ctx, Kind::Knowledge, "k", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Knowledge, "k", "2.0.0", &[]).await;
    register(
        &service,
        &ctx,
        Kind::Tool,
        "old",
        "1.0.0",
        &["resource://knowledge/k@1.0.0"],
    )
    .await;
    register(
        &service,
        &ctx,
        Kind::Tool,
        "new",
        "1.0.0",
        &["resource://knowledge/k@^2"],
    )
    .await;
    register(
        &service,
        &ctx,
        Kind::Sandbox,
        "both",
        "1.0.0",
        &["resource://tools/old", "resource://tools/new"],
    )
    .await;
    let resolved = service.resolve(&ctx, "resource://sandboxes/both", "").await.unwrap();
    assert_eq!(
        uris(&resolved.dependencies),
        [
            "resource://knowledge/k@1.0.0",
            "resource://tools/old@1.0.0",
            "resource://knowledge/k@2.0.0",
            "resource://tools/new@1.0.0",
        ]
    );
}

async fn dependencies_must_resolve_when_published(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;

    assert_err(
        service
            .register(
                &ctx,
                new_resource(Kind::Agent, "a", "1.0.0", r#"{"prompt":"resource://prompts/nope"}"#),
            )
            .await,
        Code::FailedPrecondition,
        "MISSING_DEPENDENCY",
        "resource://agents/a@1.0.0 → resource://prompts/nope",
    );
    assert_err(
        service
            .register(
                &ctx,
                new_resource(Kind::Agent, "a", "1.0.0", r#"{"prompt":"resource://prompts/p@^2"}"#),
            )
            .await,
        Code::FailedPrecondition,
        "MISSING_DEPENDENCY",
        "resource://agents/a@1.0.0 → resource://prompts/p@^2",
    );
    let with = |dependencies: &[&str]| NewResource {
        dependencies: dependencies.iter().map(|d| (*d).to_owned()).collect(),
        ..new_resource(Kind::Tool, "t", "1.0.0", crate::support::content(Kind::Tool))
    };
    assert_err(
        service
            .register(&ctx, with(&["resource://knowledge/ghost@1.0.0"]))
            .await,
        Code::FailedPrecondition,
        "MISSING_DEPENDENCY",
        "resource://knowledge/ghost@1.0.0",
    );
    for bad in [
        "prompts/p",
        "resource://prompts/P",
        "resource://gadgets/p",
        "resource://prompts/p@nope",
    ] {
        assert_err(
            service.register(&ctx, with(&[bad])).await,
            Code::InvalidArgument,
            "INVALID_DEPENDENCY",
            bad,
        );
    }
    // Any kind may be an explicit dependency, but not the resource itself.
    assert!(
        service
            .register(&ctx, with(&["resource://prompts/p@1.0.0"]))
            .await
            .unwrap()
            .created
    );
    assert_err(
        service.register(&ctx, with(&["resource://tools/t@^1"])).await,
        Code::InvalidArgument,
        "SELF_DEPENDENCY",
        "resource://tools/t@1.0.0 cannot depend on itself",
    );
    assert_err(
        service
            .register(
                &ctx,
                NewResource {
                    version: "1.1.0".into(),
                    ..with(&["resource://tools/t"])
                },
            )
            .await,
        Code::InvalidArgument,
        "SELF_DEPENDENCY",
        "",
    );
    // A refused publish stored nothing.
    let resolved = service.resolve(&ctx, "resource://tools/t", "").await.unwrap();
    assert_eq!(resolved.root.version, "1.0.0");
}

async fn a_forced_delete_leaves_a_missing_dependency_at_resolve(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let p = register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    let k = register(&service, &ctx, Kind::Knowledge, "k", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Tool, "t", "1.0.0", &["resource://knowledge/k@^1"]).await;
    let agent = r#"{"prompt":"resource://prompts/p@^1","tools":["resource://tools/t"]}"#;
    register_with(&service, &ctx, Kind::Agent, "a", "1.0.0", agent).await;
    service.resolve(&ctx, "resource://agents/a", "").await.unwrap();

    // Two levels down: the chain names every step.
    service.delete(&ctx, &k.resource.resource_id, "", true).await.unwrap();
    assert_err(
        service.resolve(&ctx, "resource://agents/a", "").await,
        Code::FailedPrecondition,
        "MISSING_DEPENDENCY",
        "resource://agents/a@1.0.0 → resource://tools/t@1.0.0 → resource://knowledge/k@^1",
    );
    register(&service, &ctx, Kind::Knowledge, "k", "1.2.0", &[]).await;
    service.resolve(&ctx, "resource://agents/a", "").await.unwrap();

    // A version gone with its resource still there: no version matches.
    register(&service, &ctx, Kind::Prompt, "p", "2.0.0", &[]).await;
    service
        .delete(&ctx, &p.resource.resource_id, "1.0.0", true)
        .await
        .unwrap();
    assert_err(
        service.resolve(&ctx, "resource://agents/a", "").await,
        Code::FailedPrecondition,
        "MISSING_DEPENDENCY",
        "resource://agents/a@1.0.0 → resource://prompts/p@^1",
    );
}

async fn cycles_are_reported_with_their_path(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    // No cycle when each was published; the range makes one once k 1.1.0 exists.
    register(&service, &ctx, Kind::Knowledge, "k", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Tool, "t", "1.0.0", &["resource://knowledge/k@^1"]).await;
    register(&service, &ctx, Kind::Sandbox, "s", "1.0.0", &["resource://tools/t@^1"]).await;
    register(
        &service,
        &ctx,
        Kind::Knowledge,
        "k",
        "1.1.0",
        &["resource://sandboxes/s"],
    )
    .await;

    assert_err(
        service.resolve(&ctx, "resource://tools/t", "").await,
        Code::FailedPrecondition,
        "DEPENDENCY_CYCLE",
        "resource://tools/t@1.0.0 → resource://knowledge/k@1.1.0 → resource://sandboxes/s@1.0.0 \
         → resource://tools/t@1.0.0",
    );
    // Entering the cycle from outside names the cycle only.
    register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    let agent = r#"{"prompt":"resource://prompts/p","tools":["resource://tools/t"]}"#;
    register_with(&service, &ctx, Kind::Agent, "a", "1.0.0", agent).await;
    let err = crate::support::api_err(service.resolve(&ctx, "resource://agents/a", "").await);
    assert_eq!(err.reason, "DEPENDENCY_CYCLE");
    assert!(
        err.message.ends_with(
            "resource://tools/t@1.0.0 → resource://knowledge/k@1.1.0 → resource://sandboxes/s@1.0.0 → resource://tools/t@1.0.0"
        ),
        "{}",
        err.message
    );
    assert!(!err.message.contains("agents"), "{}", err.message);
    // The older k is outside the cycle and resolves.
    let old = service.resolve(&ctx, "resource://knowledge/k@1.0.0", "").await.unwrap();
    assert!(old.dependencies.is_empty());
}

async fn resolve_refuses_bad_and_unknown_uris(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    for (bad, says) in [
        ("", "does not start with resource://"),
        ("resource://prompts", "has no name"),
        ("resource://things/p", "names no known kind"),
        ("resource://prompts/Bad", "invalid name"),
        ("resource://prompts/p@", "nothing after @"),
    ] {
        assert_err(
            service.resolve(&ctx, bad, "").await,
            Code::InvalidArgument,
            "INVALID_URI",
            says,
        );
    }
    assert_err(
        service.resolve(&ctx, "resource://prompts/ghost@^1", "").await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        "resource resource://prompts/ghost not found",
    );
    assert_err(
        service.resolve(&ctx, "resource://tools/p", "").await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        "resource resource://tools/p not found",
    );
}
