//! Several replicas of the services that keep data, on one Postgres: what one
//! replica changes, every other replica (and every gateway, whichever
//! replica it talks to) acts on within a second; replicas started together
//! on an empty database migrate it once and make one operator tenant.
//!
//! Latencies are measured from the moment the change was answered to the
//! first poll that sees it, and asserted under the one-second budget.

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use avm_proto::auth::v1 as au;
use avm_proto::auth::v1::auth_service_client::AuthServiceClient;
use avm_proto::config::v1 as cf;
use avm_proto::config::v1::config_service_client::ConfigServiceClient;
use avm_proto::observability::v1 as ob;
use avm_proto::observability::v1::observability_service_client::ObservabilityServiceClient;
use avm_proto::session::v1 as se;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_tests::accounts::{create_tenant, create_user};
use avm_tests::cluster::{
    Cluster, Mode, Options, TEST_CONFIG_SECRET_KEY, TEST_SERVICE_KEY, bearer, http_client, spawn_process,
};
use futures::StreamExt;
use futures::future::try_join_all;
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::postgres::postgres_configured;

/// What every replica must see a change within.
const BUDGET: Duration = Duration::from_secs(1);

/// How long a poll goes on before the test gives up (beyond the budget, so a
/// slow change fails the assertion with its measured time).
const DEADLINE: Duration = Duration::from_secs(10);

/// The pause between two polls.
const POLL: Duration = Duration::from_millis(5);

/// Polls `check` until it finds what it looks for; returns that with the
/// time since `start`.
async fn seen_after<T, F, Fut>(start: Instant, what: &str, mut check: F) -> anyhow::Result<(T, Duration)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    loop {
        if let Some(found) = check().await? {
            let elapsed = start.elapsed();
            eprintln!("{what}: after {elapsed:?}");
            return Ok((found, elapsed));
        }
        ensure!(start.elapsed() < DEADLINE, "{what}: not within {DEADLINE:?}");
        tokio::time::sleep(POLL).await;
    }
}

async fn channel(url: &str) -> anyhow::Result<Channel> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect()
        .await?)
}

/// Exchanges `key` for an access token at the auth replica at `url`.
async fn exchange(url: &str, key: &str) -> Result<String, tonic::Status> {
    let channel = channel(url)
        .await
        .map_err(|err| tonic::Status::unavailable(err.to_string()))?;
    let response = AuthServiceClient::new(channel)
        .exchange_api_key(au::ExchangeApiKeyRequest {
            api_key: key.to_owned(),
        })
        .await?;
    Ok(response.into_inner().access_token)
}

/// Returns the `kid` an access token was signed with.
fn kid_of(token: &str) -> anyhow::Result<String> {
    jsonwebtoken::decode_header(token)?.kid.context("token without kid")
}

/// Returns the status of `GET <gateway><path>` with `credential`.
async fn status(gateway: &str, path: &str, credential: &str) -> anyhow::Result<u16> {
    let response = http_client(credential)?.get(format!("{gateway}{path}")).send().await?;
    Ok(response.status().as_u16())
}

/// Starts a per-component cluster on its own Postgres schemas.
async fn postgres_cluster() -> anyhow::Result<Cluster> {
    Cluster::start(Mode::PerComponent, Options::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_on_one_auth_replica_is_refused_through_the_other_within_a_second() -> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    let mut cluster = postgres_cluster().await?;
    // The cluster's own auth service is replica A (its gateway talks to it).
    let auth_b = cluster.spawn_replica("auth", &[]).await?;
    let gateway_b = cluster.spawn_replica("gateway", &[("AVM_AUTH_ADDR", &auth_b)]).await?;
    let tenant = create_tenant(&cluster, "replicated", None).await?;
    let member = create_user(&cluster, &tenant, "temp", "member").await?;

    // Everything works through B first, and the gateway caches the exchange.
    let token = exchange(&auth_b, &member.key).await?;
    assert_eq!(status(&gateway_b, "/v1/containers", &member.key).await?, 200);
    assert_eq!(status(&gateway_b, "/v1/containers", &token).await?, 200);
    let mut caller_b = AuthServiceClient::with_interceptor(channel(&auth_b).await?, bearer(&token)?);
    caller_b.get_caller(au::GetCallerRequest {}).await?;

    let revoked = http_client(&tenant.admin.key)?
        .delete(cluster.url(&format!("/v1/auth/keys/{}", member.key_id)))
        .send()
        .await?;
    assert_eq!(revoked.status().as_u16(), 200, "revoked through replica A");
    let start = Instant::now();

    let ((), exchanged) = seen_after(start, "the key refused by auth replica B's exchange", || async {
        let refused = exchange(&auth_b, &member.key).await;
        Ok(refused
            .is_err_and(|status| status.code() == tonic::Code::Unauthenticated)
            .then_some(()))
    })
    .await?;
    let ((), by_key) = seen_after(start, "the key refused by the gateway on replica B", || async {
        Ok((status(&gateway_b, "/v1/containers", &member.key).await? == 401).then_some(()))
    })
    .await?;
    let ((), by_token) = seen_after(start, "its token refused by the gateway on replica B", || async {
        Ok((status(&gateway_b, "/v1/containers", &token).await? == 401).then_some(()))
    })
    .await?;
    let ((), by_auth) = seen_after(start, "its token refused by auth replica B", || {
        let mut caller_b = caller_b.clone();
        async move {
            let refused = caller_b.get_caller(au::GetCallerRequest {}).await;
            Ok(refused
                .is_err_and(|status| status.code() == tonic::Code::Unauthenticated)
                .then_some(()))
        }
    })
    .await?;
    for (what, elapsed) in [
        ("exchange at B", exchanged),
        ("key at gateway B", by_key),
        ("token at gateway B", by_token),
        ("token at B", by_auth),
    ] {
        assert!(elapsed < BUDGET, "{what}: the revoked key worked for {elapsed:?}");
    }
    // The cluster's own gateway (on replica A) refuses it too.
    assert_eq!(status(&cluster.gateway_url, "/v1/containers", &member.key).await?, 401);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signing_key_rotated_on_one_auth_replica_is_used_and_accepted_everywhere_within_a_second()
-> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    let mut cluster = postgres_cluster().await?;
    let auth_b = cluster.spawn_replica("auth", &[]).await?;
    let gateway_b = cluster.spawn_replica("gateway", &[("AVM_AUTH_ADDR", &auth_b)]).await?;
    let tenant = create_tenant(&cluster, "rotating", None).await?;
    let before = exchange(&auth_b, &tenant.admin.key).await?;
    assert_eq!(status(&gateway_b, "/v1/containers", &before).await?, 200);

    let rotated = cluster
        .http()?
        .post(cluster.url("/v1/auth/signing-keys/rotate"))
        .send()
        .await?;
    ensure!(rotated.status().as_u16() == 200, "rotate: {}", rotated.text().await?);
    let start = Instant::now();
    let kid = rotated.json::<Value>().await?["kid"]
        .as_str()
        .context("no kid")?
        .to_owned();
    assert_ne!(kid_of(&before)?, kid);

    // Replica B signs with the new key...
    let (after, signed) = seen_after(start, "auth replica B signing with the new key", || async {
        let token = exchange(&auth_b, &tenant.admin.key).await?;
        Ok((kid_of(&token)? == kid).then_some(token))
    })
    .await?;
    // ...and its tokens are accepted by a gateway following B and by a
    // service following A, as are the tokens signed before.
    let ((), at_gateway) = seen_after(
        start,
        "a new-key token accepted by the gateway on replica B",
        || async { Ok((status(&gateway_b, "/v1/containers", &after).await? == 200).then_some(())) },
    )
    .await?;
    let sessions = SessionServiceClient::with_interceptor(channel(&cluster.session_grpc).await?, bearer(&after)?);
    let ((), at_session) = seen_after(start, "a new-key token accepted by the session service", || {
        let mut sessions = sessions.clone();
        async move {
            let listed = sessions.list_containers(se::ListContainersRequest {}).await;
            Ok(listed.is_ok().then_some(()))
        }
    })
    .await?;
    assert_eq!(
        status(&gateway_b, "/v1/containers", &before).await?,
        200,
        "old tokens live on"
    );
    for (what, elapsed) in [
        ("signing at B", signed),
        ("accepted at gateway B", at_gateway),
        ("accepted at the session service", at_session),
    ] {
        assert!(elapsed < BUDGET, "{what}: after {elapsed:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_limits_changed_on_one_auth_replica_reach_a_gateway_on_the_other_within_a_second() -> anyhow::Result<()>
{
    if !postgres_configured()? {
        return Ok(());
    }
    let mut cluster = postgres_cluster().await?;
    let auth_b = cluster.spawn_replica("auth", &[]).await?;
    let gateway_b = cluster.spawn_replica("gateway", &[("AVM_AUTH_ADDR", &auth_b)]).await?;
    let tenant = create_tenant(&cluster, "growing", Some(json!({"requestsPerMinute": 100}))).await?;
    let whoami = |credential: String| {
        let url = format!("{gateway_b}/v1/auth/whoami");
        async move {
            let caller: Value = http_client(&credential)?.get(url).send().await?.json().await?;
            anyhow::Ok(caller["limits"]["tenant"]["requestsPerMinute"].as_u64())
        }
    };
    // Gateway B caches the exchange of the admin's key with the old limits.
    assert_eq!(whoami(tenant.admin.key.clone()).await?, Some(100));

    let changed = cluster
        .http()?
        .patch(cluster.url(&format!("/v1/tenants/{}", tenant.tenant_id)))
        .json(&json!({"limits": {"requestsPerMinute": 5000}}))
        .send()
        .await?;
    ensure!(changed.status().as_u16() == 200, "update: {}", changed.text().await?);
    let start = Instant::now();
    let ((), elapsed) = seen_after(start, "new tenant limits at the gateway on replica B", || {
        let whoami = whoami(tenant.admin.key.clone());
        async move { Ok((whoami.await? == Some(5000)).then_some(())) }
    })
    .await?;
    assert!(elapsed < BUDGET, "the old limits held for {elapsed:?}");
    Ok(())
}

/// Returns a service token (the components' own credential) from `auth`.
async fn service_token(auth: &str) -> anyhow::Result<String> {
    Ok(exchange(auth, TEST_SERVICE_KEY).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_changed_through_one_replica_reaches_watchers_of_the_other_within_a_second() -> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    let mut cluster = postgres_cluster().await?;
    let config_b = cluster.spawn_replica("config", &[]).await?;
    let tenant = create_tenant(&cluster, "configured", None).await?;
    // What a runtime following replica B watches: the system layers and
    // every tenant's change; and what a tenant's own watch sees.
    let service = service_token(&cluster.auth_grpc).await?;
    let mut runtime_view = ConfigServiceClient::with_interceptor(channel(&config_b).await?, bearer(&service)?)
        .watch_config(cf::WatchConfigRequest {
            tenant_id: String::new(),
            all_tenants: true,
        })
        .await?
        .into_inner();
    let admin = exchange(&cluster.auth_grpc, &tenant.admin.key).await?;
    let mut tenant_view = ConfigServiceClient::with_interceptor(channel(&config_b).await?, bearer(&admin)?)
        .watch_config(cf::WatchConfigRequest::default())
        .await?
        .into_inner();
    for watch in [&mut runtime_view, &mut tenant_view] {
        let first = watch.next().await.context("watch ended")??;
        assert!(first.snapshot);
    }

    // Through replica A (the cluster's own, behind its gateway).
    let updated = http_client(&tenant.admin.key)?
        .put(cluster.url("/v1/config"))
        .json(&json!({"llm.model": "replicated-model"}))
        .send()
        .await?;
    ensure!(updated.status().as_u16() == 200, "update: {}", updated.text().await?);
    let start = Instant::now();
    let notice = tokio::time::timeout(DEADLINE, runtime_view.next())
        .await?
        .context("watch ended")??;
    let noticed = start.elapsed();
    assert_eq!(notice.changed_tenant_id, tenant.tenant_id);
    let change = tokio::time::timeout(DEADLINE, tenant_view.next())
        .await?
        .context("watch ended")??;
    let seen = start.elapsed();
    let model = change
        .entries
        .iter()
        .find(|entry| entry.key == "llm.model")
        .context("no llm.model")?;
    assert_eq!(model.value_json, json!("replicated-model").to_string());
    eprintln!("config change noticed on replica B after {noticed:?}, its entries after {seen:?}");
    assert!(noticed < BUDGET && seen < BUDGET, "{noticed:?} / {seen:?}");
    // A read on replica B agrees at once (it keeps no cache).
    let read = ConfigServiceClient::with_interceptor(channel(&config_b).await?, bearer(&admin)?)
        .get_config(cf::GetConfigRequest {
            key: "llm.model".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(read.entries[0].value_json, json!("replicated-model").to_string());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_recorded_on_one_observability_replica_counts_on_the_other_within_a_second() -> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    let mut cluster = postgres_cluster().await?;
    let observability_b = cluster.spawn_replica("observability", &[]).await?;
    let tenant = create_tenant(&cluster, "thrifty", None).await?;
    let service = service_token(&cluster.auth_grpc).await?;
    let admin = exchange(&cluster.auth_grpc, &tenant.admin.key).await?;
    let (on_a, on_b) = (
        channel(&cluster.observability_grpc).await?,
        channel(&observability_b).await?,
    );
    let mut admin_a = ObservabilityServiceClient::with_interceptor(on_a.clone(), bearer(&admin)?);
    let mut service_a = ObservabilityServiceClient::with_interceptor(on_a, bearer(&service)?);
    let mut service_b = ObservabilityServiceClient::with_interceptor(on_b, bearer(&service)?);
    let mut watch_b = service_b.watch_budgets(ob::WatchBudgetsRequest {}).await?.into_inner();
    assert!(watch_b.next().await.context("watch ended")??.snapshot);

    // A budget set through replica A reaches replica B's watchers...
    const LIMIT: i64 = 1_000_000;
    admin_a
        .set_budget(ob::SetBudgetRequest {
            tenant_id: String::new(),
            key_id: String::new(),
            monthly_limit_pico_usd: LIMIT,
        })
        .await?;
    let start = Instant::now();
    let update = tokio::time::timeout(DEADLINE, watch_b.next())
        .await?
        .context("watch ended")??;
    let budget_seen = start.elapsed();
    eprintln!("budget set on replica A watched on replica B after {budget_seen:?}");
    assert_eq!(update.budgets[0].tenant_id, tenant.tenant_id);
    assert_eq!(update.budgets[0].monthly_limit_pico_usd, LIMIT);

    // ...and a call recorded on replica A counts in replica B's checks,
    // though B just cached the tenant's spend.
    let check = ob::CheckBudgetRequest {
        tenant_id: tenant.tenant_id.clone(),
        key_id: String::new(),
        ..ob::CheckBudgetRequest::default()
    };
    assert!(service_b.check_budget(check.clone()).await?.into_inner().allowed);
    let now = avm_common::now_ms();
    let record = ob::UsageRecord {
        call_id: avm_common::ids::new_id("call"),
        tenant_id: tenant.tenant_id.clone(),
        model: "replica-model".into(),
        provider: "anthropic".into(),
        input_tokens: 10,
        output_tokens: 10,
        status: ob::CallStatus::Completed as i32,
        started_at_ms: now - 10,
        ended_at_ms: now,
        cost_pico_usd: 2 * LIMIT,
        billed_pico_usd: 2 * LIMIT,
        priced: true,
        ..Default::default()
    };
    service_a
        .record_usage(ob::RecordUsageRequest { records: vec![record] })
        .await?;
    let start = Instant::now();
    let ((), spent_seen) = seen_after(
        start,
        "a call recorded on replica A refused by replica B's check",
        || {
            let mut service_b = service_b.clone();
            let check = check.clone();
            async move { Ok((!service_b.check_budget(check).await?.into_inner().allowed).then_some(())) }
        },
    )
    .await?;
    assert!(budget_seen < BUDGET, "budget watched after {budget_seen:?}");
    assert!(spent_seen < BUDGET, "spend counted after {spent_seen:?}");
    Ok(())
}

/// Drops the schemas a test made itself, whatever its outcome.
struct Schemas {
    url: String,
    names: Vec<String>,
}

impl Drop for Schemas {
    fn drop(&mut self) {
        avm_store::testing::drop_schemas(&self.url, &self.names);
    }
}

/// The services that keep tables, each in its own schema.
const STORE_SERVICES: [&str; 5] = ["auth", "session", "resource", "config", "observability"];

/// Returns how many Postgres migrations `service` has.
fn migrations_of(service: &str) -> anyhow::Result<i64> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../services")
        .join(service)
        .join("migrations/postgres");
    let count = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count();
    Ok(i64::try_from(count)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_started_together_on_an_empty_database_migrate_it_once_and_make_one_operator() -> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    const REPLICAS: usize = 3;
    let url = std::env::var("AVM_TEST_DATABASE_URL")?;
    let base = avm_common::ids::new_id("avm_rep");
    let _schemas = Schemas {
        url: url.clone(),
        names: STORE_SERVICES
            .iter()
            .map(|service| format!("{base}_{service}"))
            .collect(),
    };
    let separator = if url.contains('?') { '&' } else { '?' };
    let database = format!("{url}{separator}options=-c%20search_path%3D{base}");
    let dirs: Vec<tempfile::TempDir> = (0..REPLICAS).map(|_| tempfile::tempdir()).collect::<Result<_, _>>()?;
    for dir in &dirs {
        // As `avm` makes its own data dir: readable only by the user.
        #[cfg(unix)]
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    }
    let env = |replica: usize| -> Vec<(String, String)> {
        vec![
            ("AVM_DATABASE_URL".into(), database.clone()),
            ("AVM_AUTH_SERVICE_KEY".into(), TEST_SERVICE_KEY.into()),
            ("AVM_CONFIG_SECRET_KEY".into(), TEST_CONFIG_SECRET_KEY.into()),
            ("LLM_PROVIDER".into(), "offline".into()),
            ("AVM_LOG_LEVEL".into(), "warn".into()),
            ("AVM_LOG_FORMAT".into(), "text".into()),
            // Each replica its own data dir, as each pod has: the admin key
            // file tells which replica made the operator tenant.
            ("AVM_SERVER_DATA_DIR".into(), dirs[replica].path().display().to_string()),
        ]
    };

    // The auth replicas together on the empty database...
    let auth_envs: Vec<_> = (0..REPLICAS).map(env).collect();
    let auths = try_join_all(auth_envs.iter().map(|env| spawn_process("auth", env))).await?;
    // ...then every other service's replicas together.
    let auth_url = auths[0].1.clone();
    let mut others = Vec::new();
    for service in &STORE_SERVICES[1..] {
        for replica in 0..REPLICAS {
            let mut env = env(replica);
            env.push(("AVM_AUTH_ADDR".into(), auth_url.clone()));
            // The session service's peer for images' references; not called here.
            env.push(("AVM_RESOURCE_ADDR".into(), auth_url.clone()));
            others.push((*service, env));
        }
    }
    let others = try_join_all(others.iter().map(|(service, env)| spawn_process(service, env))).await?;
    ensure!(others.len() == REPLICAS * 4);

    let admin_keys: Vec<String> = dirs
        .iter()
        .filter_map(|dir| std::fs::read_to_string(dir.path().join(avm::ADMIN_KEY_FILE)).ok())
        .collect();
    assert_eq!(
        admin_keys.len(),
        1,
        "exactly one replica printed and saved an admin key"
    );
    let mut db = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await?;
    for service in STORE_SERVICES {
        let schema = format!("{base}_{service}");
        let (applied, versions): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*), count(DISTINCT version) FROM \"{schema}\"._sqlx_migrations WHERE success"
        ))
        .fetch_one(&mut db)
        .await?;
        let expected = migrations_of(service)?;
        assert_eq!(
            (applied, versions),
            (expected, expected),
            "{service}: each migration once"
        );
    }
    let (operators, tenants, keys): (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT (SELECT count(*) FROM \"{base}_auth\".tenants WHERE operator), \
                (SELECT count(*) FROM \"{base}_auth\".tenants), \
                (SELECT count(*) FROM \"{base}_auth\".api_keys)"
    ))
    .fetch_one(&mut db)
    .await?;
    assert_eq!(
        (operators, tenants, keys),
        (1, 1, 1),
        "one operator tenant with one admin key"
    );

    // The key works at every auth replica.
    for (_, auth) in &auths {
        exchange(auth, admin_keys[0].trim()).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_opening_a_missing_schema_at_once_all_succeed() -> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    let url = std::env::var("AVM_TEST_DATABASE_URL")?;
    let schema = avm_common::ids::new_id("avm_race");
    let _schemas = Schemas {
        url: url.clone(),
        names: vec![schema.clone()],
    };
    let separator = if url.contains('?') { '&' } else { '?' };
    let database = format!("{url}{separator}options=-c%20search_path%3D{schema}");
    let pools = try_join_all((0..16).map(|_| avm_store::db::open_postgres(&database, Some(1)))).await?;
    assert_eq!(pools.len(), 16);
    Ok(())
}
