//! Monthly spend budgets: caps that refuse at once, their removal, the
//! month boundary, and the watch of every replica.

use std::time::Duration;

use avm_common::Code;
use avm_common::testing::{admin_ctx, operator_ctx, service_ctx};
use avm_observability::{BudgetUpdate, UsageRecord};
use tokio_util::sync::CancellationToken;

use crate::support::{A, B, Harness, OPS, api_err, next, usage};

conformance!(
    tenant_caps_refuse_right_after_the_report_that_reached_them,
    key_caps_apply_to_their_key,
    a_new_month_starts_at_zero,
    watchers_see_every_budget_then_each_change,
    calls_in_flight_hold_their_estimates_until_their_records_come,
);

fn billed(call_id: &str, tenant_id: &str, key_id: &str, billed_pico_usd: i64) -> UsageRecord {
    UsageRecord {
        key_id: key_id.to_owned(),
        billed_pico_usd,
        ..usage(call_id, tenant_id)
    }
}

async fn tenant_caps_refuse_right_after_the_report_that_reached_them(h: Harness) {
    let runtime = service_ctx(A);
    let budget = h
        .service
        .set_budget(&admin_ctx(A), "", "", 1_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((budget.spent_pico_usd, budget.exhausted), (0, false));
    assert!(h.service.check_budget(&runtime, A, "").await.unwrap().allowed);

    h.service
        .record_usage(&runtime, vec![billed("c1", A, "", 600)])
        .await
        .unwrap();
    assert!(h.service.check_budget(&runtime, "", "key_1").await.unwrap().allowed);
    h.service
        .record_usage(&runtime, vec![billed("c2", A, "", 400)])
        .await
        .unwrap();
    // Not yet written, already counted.
    let refused = h.service.check_budget(&runtime, A, "key_1").await.unwrap();
    assert!(!refused.allowed);
    let exhausted = refused.exhausted.unwrap();
    assert_eq!(
        (
            exhausted.tenant_id.as_str(),
            exhausted.key_id.as_str(),
            exhausted.spent_pico_usd
        ),
        (A, "", 1_000)
    );
    assert!(exhausted.exhausted);
    h.service.flush().await.unwrap();
    assert!(
        !h.service.check_budget(&runtime, A, "").await.unwrap().allowed,
        "and once written"
    );
    let listed = h.service.list_budgets(&admin_ctx(A), "").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].spent_pico_usd, listed[0].exhausted), (1_000, true));
    // Another tenant is not held back.
    assert!(h.service.check_budget(&service_ctx(B), B, "").await.unwrap().allowed);

    // Raising the cap lets calls go again; removing it too.
    h.service.set_budget(&admin_ctx(A), "", "", 1_001).await.unwrap();
    assert!(h.service.check_budget(&runtime, A, "").await.unwrap().allowed);
    h.service.set_budget(&admin_ctx(A), "", "", 500).await.unwrap();
    assert!(!h.service.check_budget(&runtime, A, "").await.unwrap().allowed);
    let removed = h.service.set_budget(&admin_ctx(A), "", "", 0).await.unwrap();
    assert!(removed.is_none());
    assert!(h.service.check_budget(&runtime, A, "").await.unwrap().allowed);
    assert!(h.service.list_budgets(&admin_ctx(A), "").await.unwrap().is_empty());
    // Removing what does not exist is not an error.
    assert!(h.service.set_budget(&admin_ctx(A), "", "", 0).await.unwrap().is_none());

    let negative = api_err(h.service.set_budget(&admin_ctx(A), "", "", -1).await);
    assert_eq!(
        (negative.code, negative.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_BUDGET_LIMIT")
    );
}

async fn key_caps_apply_to_their_key(h: Harness) {
    let runtime = service_ctx(A);
    h.service.set_budget(&admin_ctx(A), "", "key_1", 500).await.unwrap();
    h.service
        .record_usage(
            &runtime,
            vec![
                billed("c1", A, "key_1", 300),
                billed("c2", A, "key_2", 1_000),
                billed("c3", A, "", 50),
            ],
        )
        .await
        .unwrap();
    assert!(h.service.check_budget(&runtime, A, "key_1").await.unwrap().allowed);
    h.service.flush().await.unwrap();
    h.service
        .record_usage(&runtime, vec![billed("c4", A, "key_1", 200)])
        .await
        .unwrap();
    let refused = h.service.check_budget(&runtime, A, "key_1").await.unwrap();
    assert!(!refused.allowed);
    let exhausted = refused.exhausted.unwrap();
    assert_eq!(
        (
            exhausted.key_id.as_str(),
            exhausted.monthly_limit_pico_usd,
            exhausted.spent_pico_usd
        ),
        ("key_1", 500, 500)
    );
    assert!(
        h.service.check_budget(&runtime, A, "key_2").await.unwrap().allowed,
        "another key"
    );
    assert!(h.service.check_budget(&runtime, A, "").await.unwrap().allowed, "no key");

    // A tenant cap covers every key: 300 + 1000 + 50 + 200 spent.
    h.service.set_budget(&admin_ctx(A), "", "", 1_550).await.unwrap();
    let refused = h.service.check_budget(&runtime, A, "key_2").await.unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.exhausted.unwrap().key_id, "", "the tenant's budget refuses");
    let budgets = h.service.list_budgets(&admin_ctx(A), "").await.unwrap();
    let summary: Vec<(&str, i64, bool)> = budgets
        .iter()
        .map(|b| (b.key_id.as_str(), b.spent_pico_usd, b.exhausted))
        .collect();
    assert_eq!(summary, [("", 1_550, true), ("key_1", 500, true)]);
    h.service.flush().await.unwrap();
    let budgets = h.service.list_budgets(&admin_ctx(A), "").await.unwrap();
    assert_eq!(budgets[0].spent_pico_usd, 1_550, "the same once written");

    h.service.set_budget(&admin_ctx(A), "", "key_1", 0).await.unwrap();
    h.service.set_budget(&admin_ctx(A), "", "", 0).await.unwrap();
    assert!(h.service.check_budget(&runtime, A, "key_1").await.unwrap().allowed);
}

async fn a_new_month_starts_at_zero(h: Harness) {
    let runtime = service_ctx(A);
    // Calls that started last month count against last month's budget only.
    let now = avm_common::now_ms();
    let last_month = avm_common::calendar::month_of(now);
    let mut started_at_ms = now - 28 * 86_400_000;
    while avm_common::calendar::month_of(started_at_ms) == last_month {
        started_at_ms -= 86_400_000;
    }
    let old = UsageRecord {
        started_at_ms,
        ended_at_ms: started_at_ms + 1_000,
        ..billed("old", A, "key_1", 1_000_000)
    };
    h.service.set_budget(&admin_ctx(A), "", "", 1_000).await.unwrap();
    h.service.set_budget(&admin_ctx(A), "", "key_1", 1_000).await.unwrap();
    h.service.record_usage(&runtime, vec![old]).await.unwrap();
    assert!(
        h.service.check_budget(&runtime, A, "key_1").await.unwrap().allowed,
        "while buffered"
    );
    h.service.flush().await.unwrap();
    assert!(
        h.service.check_budget(&runtime, A, "key_1").await.unwrap().allowed,
        "once written"
    );
    let budgets = h.service.list_budgets(&admin_ctx(A), "").await.unwrap();
    assert!(
        budgets.iter().all(|b| b.spent_pico_usd == 0 && !b.exhausted),
        "{budgets:?}"
    );
    // This month's calls count.
    h.service
        .record_usage(&runtime, vec![billed("new", A, "key_1", 1_000)])
        .await
        .unwrap();
    assert!(!h.service.check_budget(&runtime, A, "key_1").await.unwrap().allowed);
}

/// Returns the budgets of an update as (tenant, key, limit).
fn limits(update: &BudgetUpdate) -> Vec<(String, String, i64)> {
    update
        .budgets
        .iter()
        .map(|b| (b.tenant_id.clone(), b.key_id.clone(), b.monthly_limit_pico_usd))
        .collect()
}

async fn watchers_see_every_budget_then_each_change(h: Harness) {
    // Made before any replica listens, so no watcher hears of it but in its snapshot.
    h.service.set_budget(&admin_ctx(A), "", "", 5_000).await.unwrap();
    h.service
        .record_usage(&service_ctx(A), vec![billed("c1", A, "", 1_200)])
        .await
        .unwrap();
    h.service.flush().await.unwrap();

    let shutdown = CancellationToken::new();
    let background = h.service.spawn_background(shutdown.clone());
    // On Postgres a second replica shares the database: changes made on one
    // reach the watchers of the other. A SQLite file has one process.
    let replica = if h.shares_events() {
        h.replica().await
    } else {
        h.service.clone()
    };
    let replica_background = replica.spawn_background(shutdown.clone());

    let mut watch = replica.watch_budgets(&service_ctx(OPS)).await.unwrap();
    let first = next(&mut watch).await;
    assert!(first.snapshot && !first.removed);
    assert_eq!(limits(&first), [(A.into(), String::new(), 5_000)]);
    assert_eq!(first.budgets[0].spent_pico_usd, 1_200);

    h.service.set_budget(&operator_ctx(OPS), B, "key_b", 700).await.unwrap();
    let added = next(&mut watch).await;
    assert!(!added.snapshot && !added.removed);
    assert_eq!(limits(&added), [(B.into(), "key_b".into(), 700)]);

    h.service.set_budget(&admin_ctx(A), "", "", 1_000).await.unwrap();
    let lowered = next(&mut watch).await;
    assert_eq!(limits(&lowered), [(A.into(), String::new(), 1_000)]);
    assert!(lowered.budgets[0].exhausted, "1,200 spent of 1,000");

    h.service.set_budget(&operator_ctx(OPS), B, "key_b", 0).await.unwrap();
    let removed = next(&mut watch).await;
    assert!(removed.removed && !removed.snapshot);
    assert_eq!(
        (
            removed.budgets[0].tenant_id.as_str(),
            removed.budgets[0].key_id.as_str()
        ),
        (B, "key_b")
    );

    // A new watcher starts from what exists now.
    let mut again = replica.watch_budgets(&service_ctx(OPS)).await.unwrap();
    let snapshot = next(&mut again).await;
    assert_eq!(limits(&snapshot), [(A.into(), String::new(), 1_000)]);

    let refused = api_err(replica.watch_budgets(&admin_ctx(A)).await.map(|_| ()));
    assert_eq!(refused.reason, "SERVICE_REQUIRED");
    drop(watch);
    drop(again);
    shutdown.cancel();
    background.await.unwrap();
    replica_background.await.unwrap();
}

/// Postgres only: one process owns a SQLite file, so it has no other replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_written_by_another_replica_count() {
    let Some(db) = avm_store::testing::TestDatabase::postgres("avm_obs_test").await else {
        return;
    };
    let h = Harness::on(db).await;
    let replica = h.replica().await;
    let runtime = service_ctx(A);
    h.service.set_budget(&admin_ctx(A), "", "", 1_000).await.unwrap();
    // This replica caches the month spend...
    assert!(h.service.check_budget(&runtime, A, "").await.unwrap().allowed);
    // ...another one writes a call that exhausts it...
    replica
        .record_usage(&runtime, vec![billed("c1", A, "", 1_000)])
        .await
        .unwrap();
    replica.flush().await.unwrap();
    // ...and this one sees it once its cache is reloaded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while h.service.check_budget(&runtime, A, "").await.unwrap().allowed {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the other replica's spend counted in time"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Postgres only: the writing replica announces whose spend it changed, so
/// the others count it well before their cache would expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_spends_count_on_other_replicas_before_their_cache_expires() {
    let Some(db) = avm_store::testing::TestDatabase::postgres("avm_obs_test").await else {
        return;
    };
    let h = Harness::on(db).await;
    let replica = h.replica().await;
    let shutdown = CancellationToken::new();
    let background = h.service.spawn_background(shutdown.clone());
    let replica_background = replica.spawn_background(shutdown.clone());
    // Both feeds live (a budget watch waits for its replica's).
    drop(h.service.watch_budgets(&service_ctx(OPS)).await.unwrap());
    drop(replica.watch_budgets(&service_ctx(OPS)).await.unwrap());
    let runtime = service_ctx(A);
    h.service.set_budget(&admin_ctx(A), "", "", 1_000).await.unwrap();
    // This replica caches the month spend for a second...
    assert!(h.service.check_budget(&runtime, A, "").await.unwrap().allowed);
    // ...another one writes a call that exhausts it...
    replica
        .record_usage(&runtime, vec![billed("c1", A, "", 1_000)])
        .await
        .unwrap();
    replica.flush().await.unwrap();
    let written = tokio::time::Instant::now();
    // ...and announces it, which drops this replica's cached spend.
    let limit = Duration::from_millis(500);
    while h.service.check_budget(&runtime, A, "").await.unwrap().allowed {
        assert!(
            written.elapsed() < limit,
            "the other replica's spend counted within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    background.await.unwrap();
    replica_background.await.unwrap();
}

/// Issue 26 item 9: concurrent checks each reserve their call's estimate,
/// atomically, so only the calls the budget has room for go ahead; a call's
/// record settles its reservation.
async fn calls_in_flight_hold_their_estimates_until_their_records_come(h: Harness) {
    let runtime = service_ctx(A);
    h.service
        .set_budget(&admin_ctx(A), "", "", 1_000)
        .await
        .unwrap()
        .unwrap();
    let checks = futures::future::join_all((0..20).map(|n| {
        let service = h.service.clone();
        let runtime = runtime.clone();
        async move {
            let call_id = format!("call_{n}");
            let check = service
                .reserve_budget(&runtime, A, "key_1", &call_id, price(600))
                .await
                .unwrap();
            (call_id, check.allowed)
        }
    }))
    .await;
    let allowed: Vec<&String> = checks
        .iter()
        .filter(|(_, allowed)| *allowed)
        .map(|(id, _)| id)
        .collect();
    // The first goes (nothing spent), the second too (600 of 1,000 held),
    // then the budget is taken: never more than one call past it.
    assert_eq!(allowed.len(), 2, "{checks:?}");
    // A plain check counts the reservation too, and so does the key's.
    assert!(!h.service.check_budget(&runtime, A, "").await.unwrap().allowed);

    // The calls billed less than their estimates: their records free the rest.
    h.service
        .record_usage(
            &runtime,
            vec![billed(allowed[0], A, "key_1", 300), billed(allowed[1], A, "key_1", 300)],
        )
        .await
        .unwrap();
    assert!(
        h.service
            .reserve_budget(&runtime, A, "", "call_a", price(600))
            .await
            .unwrap()
            .allowed
    );
    let refused = h
        .service
        .reserve_budget(&runtime, A, "", "call_b", price(600))
        .await
        .unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.exhausted.unwrap().spent_pico_usd, 600);
    // Another tenant's reservations are its own.
    h.service
        .set_budget(&admin_ctx(B), "", "", 1_000)
        .await
        .unwrap()
        .unwrap();
    assert!(
        h.service
            .reserve_budget(&service_ctx(B), B, "", "call_c", price(600))
            .await
            .unwrap()
            .allowed
    );

    let negative = api_err(h.service.reserve_budget(&runtime, A, "", "call_d", price(-1)).await);
    assert_eq!(
        (negative.code, negative.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_BUDGET_CHECK")
    );
}

/// Returns an estimate of `pico_usd` and no tokens (no token quota applies).
fn price(pico_usd: i64) -> avm_observability::CallEstimate {
    avm_observability::CallEstimate { pico_usd, tokens: 0 }
}
