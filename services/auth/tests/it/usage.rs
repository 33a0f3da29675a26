//! Token usage: idempotent reports, quota events, and who may read usage.

use std::time::Duration;

use avm_auth::{ApiKeySpec, AuthEventKind, QuotaState, TenantUpdate, UsageReport, WatchItem};
use avm_common::auth::Limits;
use avm_common::calendar::month_of;
use futures::StreamExt;

use crate::support::{Harness, SERVICE_KEY, reason};

async fn next_event(stream: &mut avm_auth::AuthEventStream) -> AuthEventKind {
    loop {
        let item = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("event in time")
            .expect("stream open")
            .expect("no error");
        if let WatchItem::Event(event) = item {
            return event.kind;
        }
    }
}

#[tokio::test]
async fn usage_counts_once_and_reports_exhausted_and_restored_quotas() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let service = h.ctx(SERVICE_KEY).await;
    let limits = Limits {
        requests_per_minute: 0,
        tokens_per_month: 100,
    };
    let tenant = h.service.create_tenant(&op, "metered", Some(limits), "").await.unwrap();
    let tenant_id = tenant.tenant.tenant_id.clone();
    let admin = h.ctx(&tenant.api_key.secret).await;
    let key_limits = Limits {
        requests_per_minute: 0,
        tokens_per_month: 30,
    };
    let key = h
        .service
        .create_api_key(
            &admin,
            ApiKeySpec {
                name: "bot".into(),
                limits: Some(key_limits),
                ..ApiKeySpec::default()
            },
        )
        .await
        .unwrap()
        .api_key;
    let too_big = ApiKeySpec {
        limits: Some(Limits {
            requests_per_minute: 0,
            tokens_per_month: 101,
        }),
        ..ApiKeySpec::default()
    };
    assert_eq!(
        reason(h.service.create_api_key(&admin, too_big).await),
        "KEY_LIMITS_EXCEED_TENANT"
    );

    let mut events = h.service.watch_events(&service).await.unwrap();
    while events.next().await.unwrap().unwrap() != WatchItem::SnapshotComplete {}

    let report = |id: &str, input: u64, key_id: Option<&str>| UsageReport {
        tenant_id: tenant_id.clone(),
        key_id: key_id.map(str::to_owned),
        input_tokens: input,
        output_tokens: 10,
        report_id: id.to_owned(),
    };
    assert_eq!(
        h.service.record_usage(&service, report("r1", 50, None)).await.unwrap(),
        60
    );
    assert_eq!(
        h.service.record_usage(&service, report("r1", 50, None)).await.unwrap(),
        60,
        "a retried report counts once"
    );
    assert_eq!(
        reason(h.service.record_usage(&admin, report("r2", 1, None)).await),
        "SERVICE_REQUIRED"
    );
    assert_eq!(
        reason(h.service.record_usage(&service, report("", 1, None)).await),
        "REPORT_ID_REQUIRED"
    );

    // The key's 30 go first, then the tenant's 100.
    assert_eq!(
        h.service
            .record_usage(&service, report("r3", 20, Some(&key.key_id)))
            .await
            .unwrap(),
        90
    );
    let state = |key_id: Option<&str>| QuotaState {
        tenant_id: tenant_id.clone(),
        key_id: key_id.map(str::to_owned),
        month: month_of(avm_common::now_ms()),
    };
    assert_eq!(
        next_event(&mut events).await,
        AuthEventKind::QuotaExhausted(state(Some(&key.key_id)))
    );
    assert_eq!(
        h.service.record_usage(&service, report("r4", 0, None)).await.unwrap(),
        100
    );
    assert_eq!(
        next_event(&mut events).await,
        AuthEventKind::QuotaExhausted(state(None))
    );
    assert_eq!(
        h.service.record_usage(&service, report("r5", 5, None)).await.unwrap(),
        115
    );

    let usage = h.service.usage(&admin, "").await.unwrap();
    assert_eq!(
        (usage.tokens_used, usage.tokens_per_month, usage.month.clone()),
        (115, 100, month_of(avm_common::now_ms()))
    );

    // A new watcher learns of the exhausted quotas from its snapshot.
    let mut late = h.service.watch_events(&service).await.unwrap();
    let mut snapshot = Vec::new();
    while let WatchItem::Event(event) = late.next().await.unwrap().unwrap() {
        snapshot.push(event.kind);
    }
    assert!(
        snapshot.contains(&AuthEventKind::QuotaExhausted(state(None))),
        "{snapshot:?}"
    );
    assert!(snapshot.contains(&AuthEventKind::QuotaExhausted(state(Some(&key.key_id)))));

    // Raising the quota above the use restores it.
    let raise = TenantUpdate {
        name: None,
        limits: Some(Limits {
            requests_per_minute: 0,
            tokens_per_month: 1000,
        }),
    };
    h.service.update_tenant(&op, &tenant_id, raise).await.unwrap();
    assert_eq!(
        next_event(&mut events).await,
        AuthEventKind::TenantUpdated(tenant_id.clone())
    );
    assert_eq!(next_event(&mut events).await, AuthEventKind::QuotaRestored(state(None)));
    assert_eq!(h.service.usage(&admin, "").await.unwrap().tokens_per_month, 1000);
}

#[tokio::test]
async fn usage_is_visible_to_the_tenant_and_operators_only() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let a = h.service.create_tenant(&op, "a", None, "").await.unwrap();
    let b = h.service.create_tenant(&op, "b", None, "").await.unwrap();
    let a_admin = h.ctx(&a.api_key.secret).await;
    assert_eq!(h.service.usage(&a_admin, "").await.unwrap().tokens_used, 0);
    assert_eq!(
        reason(h.service.usage(&a_admin, &b.tenant.tenant_id).await),
        "TENANT_NOT_FOUND"
    );
    assert_eq!(h.service.usage(&op, &b.tenant.tenant_id).await.unwrap().tokens_used, 0);
    let service = h.ctx(SERVICE_KEY).await;
    let missing = UsageReport {
        tenant_id: "ten_missing".into(),
        report_id: "r".into(),
        ..UsageReport::default()
    };
    assert_eq!(
        reason(h.service.record_usage(&service, missing).await),
        "TENANT_NOT_FOUND"
    );
}
