//! Version requirements: exact, caret, tilde, ranges, `=`, latest, none.

use std::sync::Arc;

use avm_common::Code;
use avm_common::testing::admin_ctx;
use avm_resource::{Kind, ResourceService, ResourceStore};

use crate::support::{assert_err, conformance_suite, content, new_version, register};

conformance_suite!(
    requirements_pick_the_highest_matching_version,
    latest_prefers_stable_and_falls_back_to_prereleases,
    malformed_versions_and_requirements_are_refused,
);

const A: &str = "tenant-a";

async fn requirements_pick_the_highest_matching_version(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let first = register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[]).await;
    let id = first.resource.resource_id.clone();
    // Published out of order: "highest" is semver order, not insertion or string order.
    for version in ["2.1.0", "1.2.5", "2.0.0", "1.2.0", "2.2.0-beta.1", "10.0.0-rc.1"] {
        service
            .publish(&ctx, new_version(&id, version, content(Kind::Prompt)))
            .await
            .unwrap();
    }

    for (spec, expected) in [
        ("", "2.1.0"),
        ("latest", "2.1.0"),
        ("2.1.0", "2.1.0"),
        // Exact, where `VersionReq` would read `^2.0.0` and pick 2.1.0.
        ("2.0.0", "2.0.0"),
        ("^2.0.0", "2.1.0"),
        ("^1", "1.2.5"),
        ("~1.2", "1.2.5"),
        ("~1.2.0", "1.2.5"),
        (">=1.0, <2", "1.2.5"),
        (">=1.0, <1.2.5", "1.2.0"),
        ("=1.2.0", "1.2.0"),
        ("2.2.0-beta.1", "2.2.0-beta.1"),
        ("*", "2.1.0"),
    ] {
        let got = service.get(&ctx, &id, spec).await.unwrap();
        assert_eq!(got.version.version, expected, "get {spec:?}");
        let uri = if spec.is_empty() {
            "resource://prompts/p".to_owned()
        } else {
            format!("resource://prompts/p@{spec}")
        };
        let resolved = service.resolve(&ctx, &uri, "").await.unwrap();
        assert_eq!(resolved.root.version, expected, "resolve {uri}");
        assert_eq!(
            resolved.root.uri().to_string(),
            format!("resource://prompts/p@{expected}")
        );
    }

    let detail = service.get(&ctx, &id, "").await.unwrap();
    assert_eq!(detail.resource.latest_version, "2.1.0");
    let listed: Vec<&str> = detail.versions.iter().map(|v| v.version.as_str()).collect();
    assert_eq!(
        listed,
        [
            "10.0.0-rc.1",
            "2.2.0-beta.1",
            "2.1.0",
            "2.0.0",
            "1.2.5",
            "1.2.0",
            "1.0.0"
        ],
        "every version, highest first"
    );

    for spec in ["^3", "1.1.0", "=2.0.1", "<1.0.0"] {
        assert_err(
            service.get(&ctx, &id, spec).await,
            Code::NotFound,
            "VERSION_NOT_FOUND",
            &format!("resource://prompts/p@{spec} matches no published version"),
        );
        let uri = format!("resource://prompts/p@{spec}");
        assert_err(
            service.resolve(&ctx, &uri, "").await,
            Code::NotFound,
            "VERSION_NOT_FOUND",
            &uri,
        );
    }
}

async fn latest_prefers_stable_and_falls_back_to_prereleases(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let first = register(&service, &ctx, Kind::Tool, "t", "1.0.0-alpha", &[]).await;
    assert_eq!(first.resource.latest_version, "1.0.0-alpha");
    let id = first.resource.resource_id;
    let beta = service
        .publish(&ctx, new_version(&id, "1.0.0-beta.2", content(Kind::Tool)))
        .await
        .unwrap();
    assert_eq!(
        beta.resource.latest_version, "1.0.0-beta.2",
        "only pre-releases: the highest"
    );
    let resolved = service.resolve(&ctx, "resource://tools/t@latest", "").await.unwrap();
    assert_eq!(resolved.root.version, "1.0.0-beta.2");
    // A caret requirement does not take pre-releases of other versions.
    assert_err(
        service.resolve(&ctx, "resource://tools/t@^1", "").await,
        Code::NotFound,
        "VERSION_NOT_FOUND",
        "resource://tools/t@^1",
    );

    let stable = service
        .publish(&ctx, new_version(&id, "0.9.0", content(Kind::Tool)))
        .await
        .unwrap();
    assert_eq!(
        stable.resource.latest_version, "0.9.0",
        "a stable version beats higher pre-releases"
    );
    assert_eq!(service.get(&ctx, &id, "latest").await.unwrap().version.version, "0.9.0");
    assert_eq!(
        service
            .resolve(&ctx, "resource://tools/t", "")
            .await
            .unwrap()
            .root
            .version,
        "0.9.0"
    );
}

async fn malformed_versions_and_requirements_are_refused(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    let id = register(&service, &ctx, Kind::Prompt, "p", "1.0.0", &[])
        .await
        .resource
        .resource_id;
    for bad in ["", "1", "1.0", "v1.0.0", "1.0.0+build.7", "latest", "^1"] {
        assert_err(
            service
                .publish(&ctx, new_version(&id, bad, content(Kind::Prompt)))
                .await,
            Code::InvalidArgument,
            "INVALID_VERSION",
            "",
        );
    }
    assert_err(
        service.get(&ctx, &id, "banana").await,
        Code::InvalidArgument,
        "INVALID_VERSION",
        "banana",
    );
    assert_err(
        service.resolve(&ctx, "resource://prompts/p@banana", "").await,
        Code::InvalidArgument,
        "INVALID_URI",
        "invalid version",
    );
    assert_err(
        service.delete(&ctx, &id, "^1", false).await,
        Code::InvalidArgument,
        "INVALID_VERSION",
        "",
    );
}
