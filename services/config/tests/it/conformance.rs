//! What the config service promises, on SQLite and on Postgres.

use std::time::Duration;

use avm_common::settings::{
    DEFAULTS_MAX_TOKENS, DEFAULTS_TIMEOUT, LLM_API_KEY, LLM_BASE_URL, LLM_MODEL, SYSTEM_DATA_DIR,
};
use avm_common::testing::{admin_ctx, member_ctx, operator_ctx, service_ctx};
use avm_common::{Code, config::REDACTED};
use avm_config::{ConfigService, SYSTEM_SCOPE, Source, UpdateScope, WatchStream, WatchUpdate};
use futures::StreamExt;
use serde_json::json;

use crate::support::{CANARY, Harness, api_err, entry, values};

const OPS: &str = "ten_ops";
const A: &str = "ten_a";
const B: &str = "ten_b";

/// Runs each body on a fresh SQLite database and, when configured, on a
/// fresh Postgres schema.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::on(avm_store::testing::TestDatabase::sqlite("config.db")).await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(db) = avm_store::testing::TestDatabase::postgres("avm_config_test").await else {
                        return;
                    };
                    super::$name(super::Harness::on(db).await).await;
                }
            )*
        }
    };
}

conformance!(
    layers_stack_in_order,
    tenants_see_only_their_own_overrides,
    errors_name_the_key,
    secrets_are_write_only_and_sealed,
    only_the_right_callers_change_what,
    watchers_see_the_changes_that_concern_them,
    credentials_belong_to_a_user_or_the_tenant,
    secrets_are_the_tenants_sealed_and_resolved_by_components_only,
);

/// Issue 27 item 5: a tenant's secrets for its agents' sandboxes.
async fn secrets_are_the_tenants_sealed_and_resolved_by_components_only(h: Harness) {
    let names = |list: &[&str]| list.iter().map(|name| (*name).to_owned()).collect::<Vec<_>>();
    // Admins set them; members may not; values are bounded, never echoed.
    h.service.set_secret(&admin_ctx(A), "github", CANARY).await.unwrap();
    let err = api_err(
        h.service
            .set_secret(&member_ctx(A, "usr_bob"), "github", "member-value")
            .await,
    );
    assert_eq!(err.code, Code::PermissionDenied);
    for (name, value, reason) in [
        ("a/b", "long enough", "INVALID_SECRET_NAME"),
        ("short", "abc", "INVALID_SECRET"),
        ("nul", "ab\0cdef", "INVALID_SECRET"),
    ] {
        let err = api_err(h.service.set_secret(&admin_ctx(A), name, value).await);
        assert_eq!(err.reason, reason, "{name}");
        assert!(!err.message.contains(value), "{}", err.message);
    }
    // Listed by name to the tenant's users, not to another tenant's.
    assert_eq!(
        h.service.list_secrets(&member_ctx(A, "usr_bob")).await.unwrap(),
        ["github"]
    );
    assert!(h.service.list_secrets(&admin_ctx(B)).await.unwrap().is_empty());
    // Resolved for components only, within the tenant named.
    let resolved = h
        .service
        .resolve_secrets(&service_ctx(A), A, &names(&["github", "absent"]))
        .await
        .unwrap();
    assert_eq!(
        resolved.into_iter().collect::<Vec<_>>(),
        [("github".to_owned(), CANARY.to_owned())]
    );
    assert!(
        h.service
            .resolve_secrets(&service_ctx(A), B, &names(&["github"]))
            .await
            .unwrap()
            .is_empty()
    );
    for ctx in [member_ctx(A, "usr_bob"), admin_ctx(A), operator_ctx(OPS)] {
        let err = api_err(h.service.resolve_secrets(&ctx, A, &names(&["github"])).await);
        assert_eq!(err.code, Code::PermissionDenied);
    }
    // Sealed at rest.
    let sealed = h.store.overrides(&format!("secrets/{A}")).await.unwrap();
    assert!(sealed[0].encrypted && !sealed[0].value.contains("canary"));
    // Removed once; then SECRET_NOT_FOUND.
    h.service.delete_secret(&admin_ctx(A), "github").await.unwrap();
    let err = api_err(h.service.delete_secret(&admin_ctx(A), "github").await);
    assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "SECRET_NOT_FOUND"));
}

/// The server the credentials of these tests are for.
const SEARCH_URL: &str = "https://search.example/mcp";

async fn credentials_belong_to_a_user_or_the_tenant(h: Harness) {
    use avm_config::CredentialScope::{Tenant, User};
    let headers = |value: &str| std::collections::BTreeMap::from([("Authorization".to_owned(), value.to_owned())]);
    let (alice, bob) = (member_ctx(A, "usr_alice"), member_ctx(A, "usr_bob"));
    let stored = h
        .service
        .set_credential(&alice, "search", User, SEARCH_URL, headers(CANARY))
        .await
        .unwrap();
    assert_eq!(stored.header_names, ["Authorization"]);
    // Members may not set the tenant's; admins may.
    let err = api_err(
        h.service
            .set_credential(&bob, "search", Tenant, SEARCH_URL, headers("x"))
            .await,
    );
    assert_eq!(err.code, Code::PermissionDenied);
    h.service
        .set_credential(
            &admin_ctx(A),
            "search",
            Tenant,
            SEARCH_URL,
            headers("Bearer tenant-wide"),
        )
        .await
        .unwrap();

    // The runtime reads a user's own, else the tenant's; another tenant's users get none.
    let runtime = service_ctx(A);
    let resolve = |user: &'static str, tenant: &'static str| {
        let service = h.service.clone();
        let runtime = runtime.clone();
        async move {
            service
                .resolve_credential(&runtime, tenant, user, "search", SEARCH_URL)
                .await
                .unwrap()
        }
    };
    assert_eq!(resolve("usr_alice", A).await, Some(headers(CANARY)));
    assert_eq!(resolve("usr_bob", A).await, Some(headers("Bearer tenant-wide")));
    assert_eq!(resolve("usr_alice", B).await, None);
    // Bound to the origin it was stored for (issue 26 item 4): another host
    // or port gets nothing, whatever the path.
    for elsewhere in [
        "https://search.example:8443/mcp",
        "http://search.example/mcp",
        "https://evil.example/mcp",
    ] {
        let found = h
            .service
            .resolve_credential(&runtime, A, "usr_alice", "search", elsewhere)
            .await
            .unwrap();
        assert_eq!(found, None, "{elsewhere}");
    }
    let found = h
        .service
        .resolve_credential(&runtime, A, "usr_alice", "search", "https://search.example/other?x=1")
        .await
        .unwrap();
    assert_eq!(found, Some(headers(CANARY)));
    let err = api_err(
        h.service
            .set_credential(&alice, "search", User, "search.example", headers(CANARY))
            .await,
    );
    assert_eq!(err.reason, "INVALID_CREDENTIAL_URL");
    // Nobody else reads them: not a user, not an admin, not an operator.
    for ctx in [alice.clone(), admin_ctx(A), operator_ctx(OPS)] {
        let err = api_err(
            h.service
                .resolve_credential(&ctx, A, "usr_alice", "search", SEARCH_URL)
                .await,
        );
        assert_eq!(err.code, Code::PermissionDenied);
    }

    // Listed by name, never by value; sealed at rest.
    let listed = h.service.list_credentials(&alice).await.unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(!format!("{listed:?}").contains(CANARY));
    assert_eq!(h.service.list_credentials(&bob).await.unwrap().len(), 1);
    assert!(
        h.service
            .list_credentials(&member_ctx(B, "usr_alice"))
            .await
            .unwrap()
            .is_empty()
    );
    let sealed = h.store.overrides(&format!("credentials/{A}/usr_alice")).await.unwrap();
    assert!(sealed[0].encrypted && !sealed[0].value.contains("canary"));

    // Removed, the tenant's applies again; a second removal is NOT_FOUND.
    h.service.delete_credential(&alice, "search", User).await.unwrap();
    assert_eq!(resolve("usr_alice", A).await, Some(headers("Bearer tenant-wide")));
    let err = api_err(h.service.delete_credential(&alice, "search", User).await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::NotFound, "CREDENTIAL_NOT_FOUND")
    );
}

async fn layers_stack_in_order(h: Harness) {
    let config = h.service.get(&admin_ctx(A), "", false, "").await.unwrap();
    assert_eq!(
        entry(&config, LLM_MODEL),
        (json!("claude-sonnet-4-20250514"), Source::Default)
    );
    assert_eq!(entry(&config, DEFAULTS_MAX_TOKENS), (json!(2048), Source::Deployment));
    // Where the LLM is reached and the data directory are the operator's:
    // tenants are not shown them (issue 26 item 13), operators and components are.
    for ctx in [admin_ctx(A), member_ctx(A, "usr_m")] {
        let shown = h.service.get(&ctx, "", false, "").await.unwrap();
        assert!(
            shown.entries.iter().all(|e| e.spec.tenant_overridable),
            "{:?}",
            shown.entries.iter().map(|e| e.spec.key).collect::<Vec<_>>()
        );
        let err = api_err(h.service.get(&ctx, "", false, LLM_BASE_URL).await);
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::PermissionDenied, "OPERATOR_REQUIRED")
        );
    }
    for ctx in [operator_ctx(OPS), service_ctx(A)] {
        let config = h.service.get(&ctx, "", false, "").await.unwrap();
        assert_eq!(entry(&config, LLM_BASE_URL), (json!(null), Source::Default));
    }

    let system = h
        .service
        .update(
            &operator_ctx(OPS),
            UpdateScope::System,
            &values(&[(LLM_MODEL, json!("system-model"))]),
        )
        .await
        .unwrap();
    assert_eq!(entry(&system, LLM_MODEL), (json!("system-model"), Source::System));
    let tenant = h
        .service
        .update(
            &admin_ctx(A),
            UpdateScope::Tenant(String::new()),
            &values(&[(LLM_MODEL, json!("tenant-model")), (DEFAULTS_TIMEOUT, json!("90s"))]),
        )
        .await
        .unwrap();
    assert!(tenant.revision > system.revision, "every change moves the revision");
    assert_eq!(entry(&tenant, LLM_MODEL), (json!("tenant-model"), Source::Tenant));
    assert_eq!(
        entry(&tenant, DEFAULTS_TIMEOUT),
        (json!("1m 30s"), Source::Tenant),
        "canonical form"
    );

    let only = h.service.get(&admin_ctx(A), "", false, LLM_MODEL).await.unwrap();
    assert_eq!(only.entries.len(), 1);
    assert_eq!(entry(&only, LLM_MODEL).0, json!("tenant-model"));
    let system_only = h.service.get(&admin_ctx(A), "", true, LLM_MODEL).await.unwrap();
    assert_eq!(entry(&system_only, LLM_MODEL), (json!("system-model"), Source::System));

    // Null removes an override: the layer below shows again.
    let removed = h
        .service
        .update(
            &admin_ctx(A),
            UpdateScope::Tenant(String::new()),
            &values(&[(LLM_MODEL, json!(null))]),
        )
        .await
        .unwrap();
    assert_eq!(entry(&removed, LLM_MODEL), (json!("system-model"), Source::System));
}

async fn tenants_see_only_their_own_overrides(h: Harness) {
    let a = values(&[(LLM_MODEL, json!("a-model")), (LLM_API_KEY, json!(CANARY))]);
    h.service
        .update(&admin_ctx(A), UpdateScope::Tenant(String::new()), &a)
        .await
        .unwrap();
    let b = h.service.get(&admin_ctx(B), "", false, "").await.unwrap();
    assert_eq!(
        entry(&b, LLM_MODEL),
        (json!("claude-sonnet-4-20250514"), Source::Default)
    );
    assert_eq!(entry(&b, LLM_API_KEY).1, Source::Deployment);
    let foreign = api_err(h.service.get(&admin_ctx(B), A, false, "").await);
    assert_eq!(foreign.code, Code::PermissionDenied);
    let write_foreign = api_err(
        h.service
            .update(
                &admin_ctx(B),
                UpdateScope::Tenant(A.into()),
                &values(&[(LLM_MODEL, json!("x"))]),
            )
            .await,
    );
    assert_eq!(write_foreign.code, Code::PermissionDenied);
    // Operators and components may look at any tenant.
    let seen = h.service.get(&operator_ctx(OPS), A, false, "").await.unwrap();
    assert_eq!(entry(&seen, LLM_MODEL).0, json!("a-model"));
    let runtime = h.service.get(&service_ctx(A), "", false, "").await.unwrap();
    assert_eq!(entry(&runtime, LLM_API_KEY).0, json!(CANARY));
    let a_again = h.service.get(&admin_ctx(A), "", false, LLM_MODEL).await.unwrap();
    assert_eq!(entry(&a_again, LLM_MODEL).0, json!("a-model"));
}

async fn errors_name_the_key(h: Harness) {
    let operator = operator_ctx(OPS);
    let cases = [
        (UpdateScope::System, "llm.modle", "\"x\"", "UNKNOWN_CONFIG_KEY"),
        (UpdateScope::System, SYSTEM_DATA_DIR, "\"/tmp\"", "READ_ONLY_CONFIG_KEY"),
        (UpdateScope::System, DEFAULTS_MAX_TOKENS, "0", "INVALID_CONFIG_VALUE"),
        (
            UpdateScope::System,
            DEFAULTS_MAX_TOKENS,
            "\"many\"",
            "INVALID_CONFIG_VALUE",
        ),
        (
            UpdateScope::System,
            DEFAULTS_TIMEOUT,
            "\"forever\"",
            "INVALID_CONFIG_VALUE",
        ),
        (UpdateScope::System, LLM_BASE_URL, "\"ftp://x\"", "INVALID_CONFIG_VALUE"),
        (UpdateScope::System, LLM_MODEL, "{not json", "INVALID_CONFIG_VALUE"),
        (
            UpdateScope::Tenant(A.into()),
            LLM_BASE_URL,
            "\"http://10.0.0.1\"",
            "NOT_TENANT_OVERRIDABLE",
        ),
    ];
    for (scope, key, json, reason) in cases {
        let err = api_err(
            h.service
                .update(&operator, scope, &[(key.to_owned(), json.to_owned())])
                .await,
        );
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::InvalidArgument, reason),
            "{key}={json}"
        );
        assert!(err.message.contains(key), "the error names {key}: {}", err.message);
    }
    let empty = api_err(h.service.update(&operator, UpdateScope::System, &[]).await);
    assert_eq!(empty.reason, "NO_CONFIG_VALUES");
    // One bad key refuses the whole update.
    let mixed = values(&[(LLM_MODEL, json!("kept-out")), (DEFAULTS_MAX_TOKENS, json!(-1))]);
    let err = api_err(h.service.update(&operator, UpdateScope::System, &mixed).await);
    assert!(err.message.contains(DEFAULTS_MAX_TOKENS));
    let config = h.service.get(&operator, "", true, LLM_MODEL).await.unwrap();
    assert_eq!(entry(&config, LLM_MODEL).1, Source::Default, "nothing was stored");
    let unknown = api_err(h.service.get(&operator, "", false, "nope.key").await);
    assert_eq!(unknown.reason, "UNKNOWN_CONFIG_KEY");
}

async fn secrets_are_write_only_and_sealed(h: Harness) {
    let operator = operator_ctx(OPS);
    let written = h
        .service
        .update(&operator, UpdateScope::System, &values(&[(LLM_API_KEY, json!(CANARY))]))
        .await
        .unwrap();
    assert_eq!(entry(&written, LLM_API_KEY), (json!(REDACTED), Source::System));
    for ctx in [operator.clone(), admin_ctx(A), member_ctx(A, "usr_m")] {
        let shown = h.service.get(&ctx, "", false, "").await.unwrap();
        assert!(
            !format!("{shown:?}").contains(CANARY),
            "{:?} sees the secret",
            ctx.principal.role
        );
        assert_eq!(entry(&shown, LLM_API_KEY).0, json!(REDACTED));
    }
    // Even the deployment's key is redacted.
    let tenant_view = h.service.get(&admin_ctx(B), "", true, LLM_API_KEY).await.unwrap();
    assert_eq!(entry(&tenant_view, LLM_API_KEY).0, json!(REDACTED));
    // The runtime reads it.
    let runtime = h.service.get(&service_ctx(A), "", false, LLM_API_KEY).await.unwrap();
    assert_eq!(entry(&runtime, LLM_API_KEY).0, json!(CANARY));

    // Writing back the redacted form keeps the secret.
    let round_trip = values(&[(LLM_API_KEY, json!(REDACTED)), (LLM_MODEL, json!("m2"))]);
    h.service
        .update(&operator, UpdateScope::System, &round_trip)
        .await
        .unwrap();
    let runtime = h.service.get(&service_ctx(A), "", false, "").await.unwrap();
    assert_eq!(entry(&runtime, LLM_API_KEY).0, json!(CANARY));
    assert_eq!(entry(&runtime, LLM_MODEL).0, json!("m2"));

    // At rest it is sealed.
    let stored = h.store.overrides(SYSTEM_SCOPE).await.unwrap();
    let row = stored.iter().find(|row| row.key == LLM_API_KEY).unwrap();
    assert!(row.encrypted && !row.value.contains("canary"), "{row:?}");

    // Another key cannot open it, and says which secret, not what it holds.
    let wrong = ConfigService::new(h.store.clone(), crate::support::deployment(), &"k".repeat(40)).unwrap();
    let err = api_err(wrong.get(&service_ctx(A), "", false, "").await);
    assert_eq!(err.reason, "CONFIG_SECRET_UNREADABLE");
    assert!(err.message.contains(LLM_API_KEY) && !err.message.contains("canary"));
    let redacted = wrong.get(&admin_ctx(A), "", false, LLM_API_KEY).await.unwrap();
    assert_eq!(
        entry(&redacted, LLM_API_KEY).0,
        json!(REDACTED),
        "others never needed to open it"
    );

    // Null removes the stored secret; the deployment's shows again.
    h.service
        .update(&operator, UpdateScope::System, &values(&[(LLM_API_KEY, json!(null))]))
        .await
        .unwrap();
    let runtime = h.service.get(&service_ctx(A), "", false, LLM_API_KEY).await.unwrap();
    assert_eq!(
        entry(&runtime, LLM_API_KEY),
        (json!("sk-deployment-key-0001"), Source::Deployment)
    );
}

async fn only_the_right_callers_change_what(h: Harness) {
    let model = values(&[(LLM_MODEL, json!("x"))]);
    let cases = [
        (admin_ctx(A), UpdateScope::System, "OPERATOR_REQUIRED"),
        // Members hold no admin scope at all.
        (
            member_ctx(A, "usr_m"),
            UpdateScope::Tenant(String::new()),
            "MISSING_SCOPE",
        ),
        (member_ctx(A, "usr_m"), UpdateScope::System, "MISSING_SCOPE"),
    ];
    for (ctx, scope, reason) in cases {
        let err = api_err(h.service.update(&ctx, scope, &model).await);
        assert_eq!((err.code, err.reason.as_ref()), (Code::PermissionDenied, reason));
    }
    // Members read their tenant's configuration, redacted.
    let member = h.service.get(&member_ctx(A, "usr_m"), "", false, "").await.unwrap();
    assert_eq!(entry(&member, LLM_API_KEY).0, json!(REDACTED));
    h.service
        .update(&operator_ctx(OPS), UpdateScope::Tenant(B.into()), &model)
        .await
        .expect("operators manage any tenant's overrides");
    let b = h.service.get(&admin_ctx(B), "", false, LLM_MODEL).await.unwrap();
    assert_eq!(entry(&b, LLM_MODEL), (json!("x"), Source::Tenant));
}

/// Returns the next update of a watch, failing after a generous deadline.
async fn next(watch: &mut WatchStream) -> WatchUpdate {
    tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("an update in time")
        .expect("the watch goes on")
        .expect("no watch error")
}

async fn watchers_see_the_changes_that_concern_them(h: Harness) {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let listener = h.service.spawn_background(shutdown.clone());
    // On Postgres a second replica shares the database: changes made on one
    // reach the watchers of the other. A SQLite file has one process.
    let replica = if h.store.event_transport().shares_events() {
        h.replica().await
    } else {
        h.service.clone()
    };
    let replica_listener = replica.spawn_background(shutdown.clone());

    let mut tenant_watch = replica.watch(&admin_ctx(A), "", false).await.unwrap();
    let mut all = replica.watch(&service_ctx(OPS), "", true).await.unwrap();
    let WatchUpdate::Entries { snapshot: true, state } = next(&mut tenant_watch).await else {
        panic!("a snapshot first");
    };
    assert_eq!(entry(&state, LLM_MODEL).1, Source::Default);
    let WatchUpdate::Entries { snapshot: true, state } = next(&mut all).await else {
        panic!("a snapshot first");
    };
    assert_eq!(
        entry(&state, LLM_API_KEY).0,
        json!("sk-deployment-key-0001"),
        "components see secrets"
    );

    // Another tenant's change reaches only the whole-deployment watcher.
    h.service
        .update(
            &admin_ctx(B),
            UpdateScope::Tenant(String::new()),
            &values(&[(LLM_MODEL, json!("b"))]),
        )
        .await
        .unwrap();
    match next(&mut all).await {
        WatchUpdate::TenantChanged { tenant_id, .. } => assert_eq!(tenant_id, B),
        other => panic!("expected B's notice, got {other:?}"),
    }
    // A's own change reaches A's watcher (and nothing of B's came before it).
    h.service
        .update(
            &admin_ctx(A),
            UpdateScope::Tenant(String::new()),
            &values(&[(LLM_MODEL, json!("a"))]),
        )
        .await
        .unwrap();
    let WatchUpdate::Entries { snapshot: false, state } = next(&mut tenant_watch).await else {
        panic!("entries after a change");
    };
    assert_eq!(entry(&state, LLM_MODEL), (json!("a"), Source::Tenant));
    let _ = next(&mut all).await;
    // A system change reaches both, with the new effective values.
    h.service
        .update(
            &operator_ctx(OPS),
            UpdateScope::System,
            &values(&[(LLM_API_KEY, json!(CANARY))]),
        )
        .await
        .unwrap();
    let WatchUpdate::Entries { state, .. } = next(&mut tenant_watch).await else {
        panic!("entries after a system change");
    };
    assert_eq!(entry(&state, LLM_API_KEY).0, json!(REDACTED), "tenants see it redacted");
    let WatchUpdate::Entries { state, .. } = next(&mut all).await else {
        panic!("entries after a system change");
    };
    assert_eq!(entry(&state, LLM_API_KEY).0, json!(CANARY));

    let refused = avm_common::ApiError::from(replica.watch(&admin_ctx(A), "", true).await.err().expect("refused"));
    assert_eq!(refused.reason, "SERVICE_REQUIRED");
    shutdown.cancel();
    listener.await.unwrap();
    replica_listener.await.unwrap();
}

/// Postgres only: each replica announces its changes after their commit, so
/// announcements may arrive out of revision order; none is lost for that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_announced_out_of_order_all_reach_watchers() {
    use avm_config::{Change, ConfigChanged, StoredValue};
    use avm_store::events::EventTransport;

    let Some(db) = avm_store::testing::TestDatabase::postgres("avm_config_test").await else {
        return;
    };
    let h = Harness::on(db).await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let listener = h.service.spawn_background(shutdown.clone());
    let mut all = h.service.watch(&service_ctx(OPS), "", true).await.unwrap();
    let mut tenant_a = h.service.watch(&admin_ctx(A), "", false).await.unwrap();
    assert!(matches!(
        next(&mut all).await,
        WatchUpdate::Entries { snapshot: true, .. }
    ));
    assert!(matches!(
        next(&mut tenant_a).await,
        WatchUpdate::Entries { snapshot: true, .. }
    ));

    // Changes committed as replicas would commit them (A's tenant, the
    // system, B's tenant), announced in the reverse order.
    let set = |key: &str, value: serde_json::Value| Change {
        key: key.to_owned(),
        value: Some(StoredValue {
            key: key.to_owned(),
            value: value.to_string(),
            encrypted: false,
        }),
    };
    let now = avm_common::now_ms();
    let first = h
        .store
        .apply(A, &[set(LLM_MODEL, json!("a"))], "usr_a", now)
        .await
        .unwrap();
    let second = h
        .store
        .apply(SYSTEM_SCOPE, &[set(DEFAULTS_MAX_TOKENS, json!(100))], "usr_ops", now)
        .await
        .unwrap();
    let third = h
        .store
        .apply(B, &[set(LLM_MODEL, json!("b"))], "usr_b", now)
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&h.db.url).await.unwrap();
    let EventTransport::Postgres { channel, .. } = EventTransport::postgres(&pool, "avm_config_events").await.unwrap()
    else {
        panic!("a postgres transport");
    };
    for (revision, tenant_id) in [(third, Some(B)), (second, None), (first, Some(A))] {
        let change = ConfigChanged {
            revision,
            tenant_id: tenant_id.map(str::to_owned),
        };
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&channel)
            .bind(serde_json::to_string(&change).unwrap())
            .execute(&pool)
            .await
            .unwrap();
    }

    // The whole-deployment watcher hears of every change, late ones too.
    match next(&mut all).await {
        WatchUpdate::TenantChanged { tenant_id, revision } => assert_eq!((tenant_id.as_str(), revision), (B, third)),
        other => panic!("expected B's notice, got {other:?}"),
    }
    let WatchUpdate::Entries { snapshot: false, state } = next(&mut all).await else {
        panic!("the system change after B's notice");
    };
    assert_eq!(entry(&state, DEFAULTS_MAX_TOKENS), (json!(100), Source::System));
    match next(&mut all).await {
        WatchUpdate::TenantChanged { tenant_id, revision } => assert_eq!((tenant_id.as_str(), revision), (A, first)),
        other => panic!("expected A's late notice, got {other:?}"),
    }
    // Tenant A's watcher gets both its changes from the state read after
    // the system one; A's late announcement adds nothing.
    let WatchUpdate::Entries { snapshot: false, state } = next(&mut tenant_a).await else {
        panic!("entries after the system change");
    };
    assert_eq!(entry(&state, LLM_MODEL), (json!("a"), Source::Tenant));
    assert_eq!(entry(&state, DEFAULTS_MAX_TOKENS), (json!(100), Source::System));
    h.service
        .update(
            &admin_ctx(A),
            UpdateScope::Tenant(String::new()),
            &values(&[(LLM_MODEL, json!("a2"))]),
        )
        .await
        .unwrap();
    let WatchUpdate::Entries { state, .. } = next(&mut tenant_a).await else {
        panic!("entries after A's next change");
    };
    assert_eq!(entry(&state, LLM_MODEL), (json!("a2"), Source::Tenant));
    shutdown.cancel();
    listener.await.unwrap();
}
