//! Deleting versions and resources, and what depends on them.

use std::sync::Arc;

use avm_common::Code;
use avm_common::testing::admin_ctx;
use avm_resource::{Kind, ResourceService, ResourceStore};

use crate::support::{assert_err, conformance_suite, register, register_with};

conformance_suite!(
    delete_is_refused_while_depended_on_unless_forced,
    one_version_or_the_whole_resource,
    latest_requirements_hold_only_the_latest,
    in_use_names_five_dependents,
);

const A: &str = "tenant-a";

async fn delete_is_refused_while_depended_on_unless_forced(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let p = register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Prompt, "p", "2.0.0", &[]).await;
    let id = p.resource.resource_id.clone();
    let agent = register_with(
        &service,
        &ctx,
        Kind::Agent,
        "a",
        "1.0.0",
        r#"{"prompt":"resource://prompts/p@^1"}"#,
    )
    .await;

    assert_err(
        service.delete(&ctx, &id, "", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "resource://prompts/p is used by resource://agents/a@1.0.0",
    );
    assert_err(
        service.delete(&ctx, &id, "1.0.0", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "resource://prompts/p@1.0.0 is used by resource://agents/a@1.0.0",
    );
    // 2.0.0 is outside ^1: nothing holds it.
    let deleted = service.delete(&ctx, &id, "2.0.0", false).await.unwrap();
    assert_eq!(deleted.deleted_versions, ["2.0.0"]);
    assert!(!deleted.resource_deleted);
    assert_eq!(
        service.get(&ctx, &id, "").await.unwrap().resource.latest_version,
        "1.0.0"
    );

    // The dependent's own deletion frees it.
    register_with(
        &service,
        &ctx,
        Kind::Agent,
        "b",
        "1.0.0",
        r#"{"prompt":"resource://prompts/p@1.0.0"}"#,
    )
    .await;
    service
        .delete(&ctx, &agent.resource.resource_id, "", false)
        .await
        .unwrap();
    assert_err(
        service.delete(&ctx, &id, "", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "used by resource://agents/b@1.0.0",
    );
    let forced = service.delete(&ctx, &id, "", true).await.unwrap();
    assert_eq!(forced.deleted_versions, ["1.0.0"]);
    assert!(forced.resource_deleted);
    assert_err(
        service.get(&ctx, &id, "").await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        &format!("resource {id} not found"),
    );
}

async fn one_version_or_the_whole_resource(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let first = register(&service, &ctx, Kind::Tool, "t", "1.0.0", &[]).await;
    let id = first.resource.resource_id.clone();
    for version in ["1.1.0", "2.0.0", "10.0.0"] {
        register(&service, &ctx, Kind::Tool, "t", version, &[]).await;
    }
    assert_err(
        service.delete(&ctx, &id, "3.0.0", false).await,
        Code::NotFound,
        "VERSION_NOT_FOUND",
        "resource://tools/t@3.0.0",
    );
    let one = service.delete(&ctx, &id, "10.0.0", false).await.unwrap();
    assert_eq!(
        (one.deleted_versions.as_slice(), one.resource_deleted),
        (["10.0.0".to_owned()].as_slice(), false)
    );
    let detail = service.get(&ctx, &id, "").await.unwrap();
    assert_eq!(detail.resource.latest_version, "2.0.0", "latest moves down");
    assert_eq!(detail.versions.len(), 3);
    assert_err(
        service.get(&ctx, &id, "10.0.0").await,
        Code::NotFound,
        "VERSION_NOT_FOUND",
        "",
    );

    let all = service.delete(&ctx, &id, "", false).await.unwrap();
    assert_eq!(all.deleted_versions, ["2.0.0", "1.1.0", "1.0.0"], "highest first");
    assert!(all.resource_deleted);
    assert_err(
        service.delete(&ctx, &id, "", false).await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        "",
    );

    // Deleting the last version one at a time deletes the resource too.
    let single = register(&service, &ctx, Kind::Tool, "t", "1.0.0", &[]).await;
    assert_ne!(single.resource.resource_id, id, "a new resource under the old name");
    let last = service
        .delete(&ctx, &single.resource.resource_id, "1.0.0", false)
        .await
        .unwrap();
    assert!(last.resource_deleted);
    assert_err(
        service.resolve(&ctx, "resource://tools/t", "").await,
        Code::NotFound,
        "RESOURCE_NOT_FOUND",
        "",
    );
}

async fn latest_requirements_hold_only_the_latest(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let p = register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    register(&service, &ctx, Kind::Prompt, "p", "2.0.0", &[]).await;
    register(&service, &ctx, Kind::Prompt, "p", "3.0.0-rc.1", &[]).await;
    register_with(
        &service,
        &ctx,
        Kind::Agent,
        "a",
        "1.0.0",
        r#"{"prompt":"resource://prompts/p"}"#,
    )
    .await;
    let id = p.resource.resource_id;
    service.delete(&ctx, &id, "1.0.0", false).await.unwrap();
    service.delete(&ctx, &id, "3.0.0-rc.1", false).await.unwrap();
    assert_err(
        service.delete(&ctx, &id, "2.0.0", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "resource://agents/a@1.0.0",
    );
}

async fn in_use_names_five_dependents(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let k = register(&service, &ctx, Kind::Knowledge, "k", "1.0.0", &[]).await;
    for i in 1..=7 {
        register(
            &service,
            &ctx,
            Kind::Tool,
            &format!("t{i}"),
            "1.0.0",
            &["resource://knowledge/k@1.0.0"],
        )
        .await;
    }
    // A second version of one dependent is a second dependent.
    register(&service, &ctx, Kind::Tool, "t1", "1.1.0", &["resource://knowledge/k"]).await;
    assert_err(
        service.delete(&ctx, &k.resource.resource_id, "", false).await,
        Code::FailedPrecondition,
        "RESOURCE_IN_USE",
        "resource://knowledge/k is used by resource://tools/t1@1.0.0, resource://tools/t1@1.1.0, \
         resource://tools/t2@1.0.0, resource://tools/t3@1.0.0, resource://tools/t4@1.0.0 and 3 more",
    );
}
