//! `WatchAuthEvents`: snapshot then live events, a verifier that follows
//! them, lagging watchers, and replicas sharing events through Postgres.

use std::sync::Arc;
use std::time::Duration;

use avm_auth::{ApiKeySpec, AuthEventKind, AuthService, TenantUpdate, WatchItem, open_store};
use avm_common::auth::{AuthKeySource, Role, ServiceIdentity, TokenVerifier};
use avm_common::{ApiError, Code};
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceRemote;
use avm_proto::auth::v1::auth_event::Kind;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::support::{Harness, SERVICE_KEY, TestDb, config, context, eventually};

const STEP: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_revoked_key_is_refused_by_a_verifier_following_the_events() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let tenant = h.service.create_tenant(&op, "acme", None, "").await.unwrap();
    let key = tenant.api_key.secret.clone();
    let token = h.service.exchange_api_key(&key).await.unwrap().token;

    // A component's verifier, as every service runs it: keys over GetJwks,
    // events over WatchAuthEvents with the deployment's service key.
    let channel = h.channel();
    let verifier = TokenVerifier::new(
        &config(),
        Arc::new(AuthKeySource::new(
            AuthServiceRemote::new(channel.clone(), usize::MAX).handle(),
        )),
    );
    let identity = ServiceIdentity::new(SERVICE_KEY, AuthServiceRemote::new(channel, usize::MAX).handle());
    let stop = CancellationToken::new();
    let watching = verifier.spawn_watch(identity, stop.clone());
    eventually(STEP, "the verifier to go live", || async {
        verifier.is_watching().then_some(())
    })
    .await;
    assert_eq!(
        verifier.verify(&token).await.unwrap().tenant_id,
        tenant.tenant.tenant_id
    );

    let admin = h.ctx(&key).await;
    h.service
        .revoke_api_key(&admin, &tenant.api_key.api_key.key_id)
        .await
        .unwrap();
    let refused = eventually(STEP, "the revocation to reach the verifier", || async {
        verifier.verify(&token).await.err()
    })
    .await;
    assert_eq!(
        (refused.code, refused.reason.as_ref()),
        (Code::Unauthenticated, "CREDENTIAL_REVOKED")
    );
    let exchange = crate::support::api_err(h.service.exchange_api_key(&key).await);
    assert_eq!(exchange.reason, "INVALID_API_KEY");
    stop.cancel();
    watching.await.unwrap();
}

#[tokio::test]
async fn a_watch_starts_with_a_snapshot_then_goes_live() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let tenant = h.service.create_tenant(&op, "acme", None, "").await.unwrap();
    let tenant_id = tenant.tenant.tenant_id.clone();
    let admin = h.ctx(&tenant.api_key.secret).await;
    let user = h.service.create_user(&admin, "", "leaver", Role::Member).await.unwrap();
    let spec = ApiKeySpec {
        name: "spare".into(),
        ..ApiKeySpec::default()
    };
    let spare = h.service.create_api_key(&admin, spec).await.unwrap().api_key.key_id;
    h.service.revoke_api_key(&admin, &spare).await.unwrap();
    h.service.delete_user(&admin, &user.user_id).await.unwrap();
    let rename = TenantUpdate {
        name: Some("acme 2".into()),
        limits: None,
    };
    h.service.update_tenant(&admin, &tenant_id, rename).await.unwrap();

    let mut client = h.client().await;
    let status = client
        .watch_auth_events(pb::WatchAuthEventsRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "no token, no events");
    let status = client
        .watch_auth_events(admin.request(pb::WatchAuthEventsRequest {}))
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&status).reason, "SERVICE_REQUIRED");

    let service = h.ctx(SERVICE_KEY).await;
    let mut stream = client
        .watch_auth_events(service.request(pb::WatchAuthEventsRequest {}))
        .await
        .unwrap()
        .into_inner();
    let mut snapshot = Vec::new();
    loop {
        let item = tokio::time::timeout(STEP, stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if item.snapshot_complete {
            assert!(item.event.is_none());
            break;
        }
        snapshot.push(item.event.unwrap().kind.unwrap());
    }
    assert!(snapshot.contains(&Kind::KeyRevoked(spare.clone())), "{snapshot:?}");
    assert!(
        snapshot.contains(&Kind::UserDeleted(user.user_id.clone())),
        "{snapshot:?}"
    );
    assert!(
        snapshot.contains(&Kind::TenantUpdated(tenant_id.clone())),
        "{snapshot:?}"
    );

    h.service
        .revoke_api_key(&admin, &tenant.api_key.api_key.key_id)
        .await
        .unwrap();
    let live = tokio::time::timeout(STEP, stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(
        live.event.unwrap().kind,
        Some(Kind::KeyRevoked(tenant.api_key.api_key.key_id.clone()))
    );
    let op = h.operator().await;
    h.service.delete_tenant(&op, &tenant_id).await.unwrap();
    let live = tokio::time::timeout(STEP, stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(live.event.unwrap().kind, Some(Kind::TenantDeleted(tenant_id)));
}

#[tokio::test]
async fn a_lagging_watcher_is_cut_off_with_resource_exhausted() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let service = h.ctx(SERVICE_KEY).await;
    let tenant = h.service.create_tenant(&op, "busy", None, "").await.unwrap().tenant;
    let mut stream = h.service.watch_events(&service).await.unwrap();
    // The watcher reads nothing while more events happen than the feed holds.
    for round in 0..1100 {
        let update = TenantUpdate {
            name: Some(format!("busy {round}")),
            limits: None,
        };
        h.service.update_tenant(&op, &tenant.tenant_id, update).await.unwrap();
    }
    loop {
        match stream
            .next()
            .await
            .expect("the stream ends with an error, not silently")
        {
            Ok(WatchItem::Event(_) | WatchItem::SnapshotComplete) => {}
            Err(err) => {
                let status = tonic::Status::from(err);
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                assert_eq!(ApiError::from_status(&status).reason, "AUTH_EVENTS_LAGGED");
                break;
            }
        }
    }
    assert!(stream.next().await.is_none(), "nothing follows the error");
}

/// Reads a watch until `until` matches; returns how many events matched `count`.
async fn count_until(
    stream: &mut avm_auth::AuthEventStream,
    count: impl Fn(&AuthEventKind) -> bool,
    until: impl Fn(&AuthEventKind) -> bool,
) -> usize {
    let mut seen = 0;
    loop {
        let item = tokio::time::timeout(STEP, stream.next())
            .await
            .expect("event in time")
            .expect("stream open")
            .expect("no error");
        let WatchItem::Event(event) = item else { continue };
        if count(&event.kind) {
            seen += 1;
        }
        if until(&event.kind) {
            return seen;
        }
    }
}

async fn skip_snapshot(stream: &mut avm_auth::AuthEventStream) {
    loop {
        let item = tokio::time::timeout(STEP, stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if item == WatchItem::SnapshotComplete {
            return;
        }
    }
}

#[tokio::test]
async fn postgres_replicas_each_see_every_event_once() {
    let Some(db) = TestDb::postgres().await else { return };
    let url = db.url.clone();
    let a = Harness::start(db, config()).await;
    let store_b = open_store(&url, Some(4)).await.unwrap();
    let b = AuthService::new(store_b, config(), crate::support::seal())
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let listening = b.spawn_background(stop.clone());

    let mut on_a = a.service.watch_events(&a.ctx(SERVICE_KEY).await).await.unwrap();
    let mut on_b = b.watch_events(&context(&b, SERVICE_KEY).await).await.unwrap();
    skip_snapshot(&mut on_a).await;
    skip_snapshot(&mut on_b).await;

    let op_a = a.operator().await;
    let created = a.service.create_tenant(&op_a, "shared", None, "").await.unwrap();
    let key_id = created.api_key.api_key.key_id.clone();
    a.service.revoke_api_key(&op_a, &key_id).await.unwrap();
    // A marker from the other replica, after the revocation.
    let op_b = context(&b, &a.admin.secret).await;
    let rename = TenantUpdate {
        name: Some("marker".into()),
        limits: None,
    };
    b.update_tenant(&op_b, &created.tenant.tenant_id, rename).await.unwrap();

    let revoked = |kind: &AuthEventKind| *kind == AuthEventKind::KeyRevoked(key_id.clone());
    let marker =
        |kind: &AuthEventKind| matches!(kind, AuthEventKind::TenantUpdated(id) if *id == created.tenant.tenant_id);
    assert_eq!(count_until(&mut on_a, revoked, marker).await, 1, "replica a");
    assert_eq!(count_until(&mut on_b, revoked, marker).await, 1, "replica b");

    // The revocation holds on the other replica at once.
    assert_eq!(
        crate::support::reason(b.exchange_api_key(&created.api_key.secret).await),
        "INVALID_API_KEY"
    );
    stop.cancel();
    listening.await.unwrap();
}

#[tokio::test]
async fn a_key_rotated_on_one_postgres_replica_signs_on_the_other_within_a_second() {
    let Some(db) = TestDb::postgres().await else { return };
    let url = db.url.clone();
    let a = Harness::start(db, config()).await;
    let b = AuthService::new(
        open_store(&url, Some(4)).await.unwrap(),
        config(),
        crate::support::seal(),
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let background = b.spawn_background(stop.clone());
    let kid_of = |token: &str| jsonwebtoken::decode_header(token).unwrap().kid.unwrap();
    // Replica B signs with the key it keeps in memory...
    let before = b.exchange_api_key(&a.admin.secret).await.unwrap().token;
    let rotated = a.service.rotate_signing_key(&a.operator().await).await.unwrap();
    assert_ne!(kid_of(&before), rotated);
    // ...until replica A's rotation reaches it (not its minute-long refresh).
    let after = eventually(Duration::from_secs(1), "replica b signing with the new key", || async {
        let token = b.exchange_api_key(&a.admin.secret).await.unwrap().token;
        (kid_of(&token) == rotated).then_some(token)
    })
    .await;
    // Both replicas verify what either signed.
    a.service.verifier().verify(&after).await.unwrap();
    b.verifier().verify(&before).await.unwrap();
    stop.cancel();
    background.await.unwrap();
}
