//! The usage ledger: idempotent, batched, exact sums, pages, summaries.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use avm_common::Code;
use avm_common::calendar::day_of;
use avm_common::testing::{admin_ctx, operator_ctx, service_ctx};
use avm_observability::{
    CallStatus, Dimension, LedgerSettings, ObservabilityService, UsageQuery, UsageRecord, UsageTotals,
};
use tokio_util::sync::CancellationToken;

use crate::support::{A, B, FlakyStore, Harness, OPS, api_err, list_all, totals_of, usage};

conformance!(
    retried_reports_count_once,
    group_totals_equal_the_records,
    pages_return_every_record_once,
    summary_percentiles_follow_the_distribution,
    a_full_buffer_refuses_and_keeps_what_it_accepted,
    failed_writes_keep_their_records,
    a_clean_shutdown_writes_everything,
    invalid_records_name_their_field,
    calls_left_open_are_billed_at_their_estimate,
);

/// 2024-01-31T23:00Z, 2024-02-01T00:00Z, 2024-02-01T01:00Z.
const JAN_31_23H: i64 = 1_706_742_000_000;
const FEB_1: i64 = 1_706_745_600_000;
const FEB_1_01H: i64 = 1_706_749_200_000;

async fn retried_reports_count_once(h: Harness) {
    let runtime = service_ctx(A);
    let first = UsageRecord {
        billed_pico_usd: 700,
        ..usage("call_1", A)
    };
    let second = UsageRecord {
        billed_pico_usd: 300,
        ..usage("call_2", A)
    };
    // The same call twice in one request.
    let recorded = h
        .service
        .record_usage(&runtime, vec![first.clone(), first.clone()])
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    // Again, with another, before anything was written.
    let recorded = h
        .service
        .record_usage(&runtime, vec![first.clone(), second.clone()])
        .await
        .unwrap();
    assert_eq!(recorded, 1);
    h.service.flush().await.unwrap();
    // And again once written: the database keeps the first.
    let retry = UsageRecord {
        billed_pico_usd: 999_999,
        ..first.clone()
    };
    h.service.record_usage(&runtime, vec![retry]).await.unwrap();
    h.service.flush().await.unwrap();

    let report = h
        .service
        .query_usage(&admin_ctx(A), &UsageQuery::default(), &[Dimension::Model])
        .await
        .unwrap();
    assert_eq!(report.totals, totals_of([&first, &second]));
    assert_eq!(report.totals.calls, 2);
    let listed = h.all_records().await;
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&first) && listed.contains(&second), "{listed:?}");

    let budget = h
        .service
        .set_budget(&admin_ctx(A), "", "", 1_000_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(budget.spent_pico_usd, 1_000);
    // A retry of a written call, waiting: at most counted while it waits.
    h.service.record_usage(&runtime, vec![second.clone()]).await.unwrap();
    h.service.flush().await.unwrap();
    let budgets = h.service.list_budgets(&admin_ctx(A), "").await.unwrap();
    assert_eq!(budgets[0].spent_pico_usd, 1_000, "never counted twice once written");
}

async fn group_totals_equal_the_records(h: Harness) {
    let mut records = Vec::new();
    let starts = [JAN_31_23H, JAN_31_23H + 59 * 60_000, FEB_1, FEB_1_01H];
    let statuses = [CallStatus::Completed, CallStatus::Interrupted, CallStatus::Failed];
    for i in 0..24_i64 {
        let index = usize::try_from(i).unwrap();
        let started_at_ms = starts[index % starts.len()] + i;
        records.push(UsageRecord {
            tenant_id: if i % 3 == 0 { B.into() } else { A.into() },
            key_id: ["", "key_1", "key_2"][index % 3].into(),
            user_id: ["usr_1", "usr_2"][index % 2].into(),
            model: ["model-a", "model-b"][(index / 2) % 2].into(),
            provider: ["anthropic", "openai", "offline"][(index / 3) % 3].into(),
            status: statuses[(index / 4) % 3],
            input_tokens: 100 + 7 * i as u64,
            output_tokens: 10 * i as u64,
            cache_read_tokens: i as u64,
            cache_write_tokens: 2 * i as u64,
            estimated: i % 5 == 0,
            started_at_ms,
            ended_at_ms: started_at_ms + 1_000,
            cost_pico_usd: 1_000_000 + i * 12_345,
            billed_pico_usd: 1_050_000 + i * 13_000,
            ..usage(&format!("call_{i:02}"), "")
        });
    }
    h.service.record_usage(&service_ctx(A), records.clone()).await.unwrap();
    h.service.flush().await.unwrap();

    let key_of = |record: &UsageRecord, dimension: Dimension| -> String {
        match dimension {
            Dimension::Tenant => record.tenant_id.clone(),
            Dimension::Key => record.key_id.clone(),
            Dimension::Model => record.model.clone(),
            Dimension::Day => day_of(record.started_at_ms),
            Dimension::Month => avm_common::calendar::month_of(record.started_at_ms),
            Dimension::Status => record.status.as_str().to_owned(),
            Dimension::User => record.user_id.clone(),
            Dimension::Provider => record.provider.clone(),
        }
    };
    let all = UsageQuery {
        all_tenants: true,
        ..UsageQuery::default()
    };
    let combinations: &[&[Dimension]] = &[
        &[],
        &[Dimension::Tenant],
        &[Dimension::Key],
        &[Dimension::Model],
        &[Dimension::Day],
        &[Dimension::Month],
        &[Dimension::Status],
        &[Dimension::User],
        &[Dimension::Tenant, Dimension::Model],
        &[Dimension::Month, Dimension::Key, Dimension::Status],
        &[Dimension::Day, Dimension::User, Dimension::Model],
        &[Dimension::Provider, Dimension::Model],
        &[
            Dimension::User,
            Dimension::Status,
            Dimension::Month,
            Dimension::Day,
            Dimension::Model,
            Dimension::Key,
            Dimension::Tenant,
        ],
    ];
    let everything = totals_of(&records);
    for group_by in combinations {
        let report = h.service.query_usage(&operator_ctx(OPS), &all, group_by).await.unwrap();
        assert_eq!(report.totals, everything, "totals by {group_by:?}");
        let mut expected: BTreeMap<Vec<String>, UsageTotals> = BTreeMap::new();
        for record in &records {
            let keys = group_by.iter().map(|dimension| key_of(record, *dimension)).collect();
            expected.entry(keys).or_default().add(&UsageTotals::of(record));
        }
        let got: Vec<(Vec<String>, UsageTotals)> = report
            .groups
            .iter()
            .map(|group| (group.keys.clone(), group.totals))
            .collect();
        let want: Vec<(Vec<String>, UsageTotals)> = expected.into_iter().collect();
        assert_eq!(got, want, "groups by {group_by:?}, in key order");
    }

    // Two days and two months, as the records span them.
    let by_month = h
        .service
        .query_usage(&operator_ctx(OPS), &all, &[Dimension::Month])
        .await
        .unwrap();
    let months: Vec<&str> = by_month.groups.iter().map(|g| g.keys[0].as_str()).collect();
    assert_eq!(months, ["2024-01", "2024-02"]);
    let by_day = h
        .service
        .query_usage(&operator_ctx(OPS), &all, &[Dimension::Day])
        .await
        .unwrap();
    let days: Vec<&str> = by_day.groups.iter().map(|g| g.keys[0].as_str()).collect();
    assert_eq!(days, ["2024-01-31", "2024-02-01"]);

    // Filters: the tenant's own, a time range, a key, a model, a user.
    let filtered = [
        (
            UsageQuery::default(),
            records.iter().filter(|r| r.tenant_id == A).collect::<Vec<_>>(),
        ),
        (
            UsageQuery {
                from_ms: FEB_1,
                ..UsageQuery::default()
            },
            records
                .iter()
                .filter(|r| r.tenant_id == A && r.started_at_ms >= FEB_1)
                .collect(),
        ),
        (
            UsageQuery {
                from_ms: JAN_31_23H,
                to_ms: FEB_1,
                key_id: "key_1".into(),
                ..UsageQuery::default()
            },
            records
                .iter()
                .filter(|r| r.tenant_id == A && r.started_at_ms < FEB_1 && r.key_id == "key_1")
                .collect(),
        ),
        (
            UsageQuery {
                model: "model-b".into(),
                user_id: "usr_2".into(),
                ..UsageQuery::default()
            },
            records
                .iter()
                .filter(|r| r.tenant_id == A && r.model == "model-b" && r.user_id == "usr_2")
                .collect(),
        ),
    ];
    for (query, expected) in filtered {
        assert!(!expected.is_empty(), "{query:?} selects something");
        let report = h
            .service
            .query_usage(&admin_ctx(A), &query, &[Dimension::Status])
            .await
            .unwrap();
        assert_eq!(report.totals, totals_of(expected.iter().copied()), "{query:?}");
        let listed = list_all(
            &h.service,
            &UsageQuery {
                tenant_id: A.into(),
                ..query.clone()
            },
        )
        .await;
        assert_eq!(listed.len(), expected.len(), "{query:?}");
    }

    let repeated = api_err(
        h.service
            .query_usage(&admin_ctx(A), &UsageQuery::default(), &[Dimension::Day, Dimension::Day])
            .await,
    );
    assert_eq!(repeated.reason, "INVALID_GROUP_BY");
    let backwards = api_err(
        h.service
            .query_usage(
                &admin_ctx(A),
                &UsageQuery {
                    from_ms: FEB_1,
                    to_ms: JAN_31_23H,
                    ..UsageQuery::default()
                },
                &[],
            )
            .await,
    );
    assert_eq!(backwards.reason, "INVALID_TIME_RANGE");
}

async fn pages_return_every_record_once(h: Harness) {
    let mut records = Vec::new();
    for i in 0..23_i64 {
        // Ties on the start time are broken by the call id.
        let started_at_ms = FEB_1 + (i / 3) * 1_000;
        records.push(UsageRecord {
            started_at_ms,
            ended_at_ms: started_at_ms + 10,
            model: if i % 4 == 0 { "model-x".into() } else { "model-y".into() },
            ..usage(&format!("call/{:02}", 22 - i), A)
        });
    }
    records.push(usage("call_b", B));
    h.service.record_usage(&service_ctx(A), records.clone()).await.unwrap();
    h.service.flush().await.unwrap();

    let mut expected: Vec<&UsageRecord> = records.iter().filter(|r| r.tenant_id == A).collect();
    expected.sort_by(|a, b| (b.started_at_ms, &b.call_id).cmp(&(a.started_at_ms, &a.call_id)));
    let admin = admin_ctx(A);
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = h
            .service
            .list_usage(&admin, &UsageQuery::default(), 5, &token)
            .await
            .unwrap();
        pages += 1;
        assert!(page.records.len() <= 5);
        seen.extend(page.records);
        match page.next_page_token {
            Some(next) => token = next,
            None => break,
        }
    }
    assert_eq!(pages, 5);
    let seen_refs: Vec<&UsageRecord> = seen.iter().collect();
    assert_eq!(seen_refs, expected, "every record once, newest first");

    // Filters hold across pages.
    let mut models = Vec::new();
    let mut token = String::new();
    loop {
        let query = UsageQuery {
            model: "model-x".into(),
            ..UsageQuery::default()
        };
        let page = h.service.list_usage(&admin, &query, 2, &token).await.unwrap();
        models.extend(page.records.into_iter().map(|r| r.call_id));
        match page.next_page_token {
            Some(next) => token = next,
            None => break,
        }
    }
    let unique: HashSet<&String> = models.iter().collect();
    assert_eq!((models.len(), unique.len()), (6, 6));

    let default_page = h
        .service
        .list_usage(&admin, &UsageQuery::default(), 0, "")
        .await
        .unwrap();
    assert_eq!(default_page.records.len(), 23, "the default page holds 50");
    assert!(default_page.next_page_token.is_none());
    let forged = api_err(
        h.service
            .list_usage(&admin, &UsageQuery::default(), 5, "not-a-token!")
            .await,
    );
    assert_eq!(
        (forged.code, forged.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_PAGE_TOKEN")
    );
}

async fn summary_percentiles_follow_the_distribution(h: Harness) {
    let now = avm_common::now_ms();
    let mut records = Vec::new();
    for i in 1..=100_i64 {
        let started_at_ms = now - 60_000 - i;
        let status = match i % 10 {
            0 => CallStatus::Failed,
            5 => CallStatus::Interrupted,
            _ => CallStatus::Completed,
        };
        records.push(UsageRecord {
            started_at_ms,
            ended_at_ms: started_at_ms + 10 * i,
            first_token_ms: i,
            status,
            ..usage(&format!("call_{i:03}"), A)
        });
    }
    // Calls that failed before any token: no first token, long durations.
    for i in 0..20_i64 {
        let started_at_ms = now - 120_000 - i;
        records.push(UsageRecord {
            started_at_ms,
            ended_at_ms: started_at_ms + 2_000,
            first_token_ms: 0,
            status: CallStatus::Failed,
            ..usage(&format!("fail_{i:02}"), A)
        });
    }
    let in_window = records.clone();
    // Outside the window, and another tenant's: not in the summary.
    let old_start = now - 2 * 3_600_000;
    records.push(UsageRecord {
        started_at_ms: old_start,
        ended_at_ms: old_start + 999_999,
        ..usage("call_old", A)
    });
    records.push(UsageRecord {
        first_token_ms: 99_999,
        ..usage("call_b", B)
    });
    h.service.record_usage(&service_ctx(A), records).await.unwrap();
    h.service.flush().await.unwrap();

    let summary = h.service.usage_summary(&admin_ctx(A), "", false, 0).await.unwrap();
    assert_eq!(summary.to_ms - summary.from_ms, 3_600_000, "an hour by default");
    assert_eq!(summary.totals, totals_of(&in_window));
    assert_eq!((summary.completed, summary.interrupted, summary.failed), (80, 10, 30));
    assert_eq!(
        (
            summary.first_token.p50_ms,
            summary.first_token.p90_ms,
            summary.first_token.p99_ms,
            summary.first_token.max_ms
        ),
        (50, 90, 99, 100)
    );
    // 120 durations: 10, 20, …, 1000, then twenty of 2000.
    assert_eq!(
        (
            summary.duration.p50_ms,
            summary.duration.p90_ms,
            summary.duration.p99_ms,
            summary.duration.max_ms
        ),
        (600, 2_000, 2_000, 2_000)
    );
    let narrow = h.service.usage_summary(&admin_ctx(A), "", false, 61_000).await.unwrap();
    assert_eq!(narrow.totals.calls, 100, "only the calls of the last 61 s");
    let everyone = h.service.usage_summary(&operator_ctx(OPS), "", true, 0).await.unwrap();
    assert_eq!(everyone.totals.calls, 121);
    assert_eq!(everyone.first_token.max_ms, 99_999);
    let negative = api_err(h.service.usage_summary(&admin_ctx(A), "", false, -1).await);
    assert_eq!(negative.reason, "INVALID_WINDOW");
}

async fn a_full_buffer_refuses_and_keeps_what_it_accepted(h: Harness) {
    let service = h.with_settings(LedgerSettings {
        max_pending_records: 3,
        ..LedgerSettings::default()
    });
    let runtime = service_ctx(A);
    let accepted = service
        .record_usage(&runtime, vec![usage("c1", A), usage("c2", A)])
        .await
        .unwrap();
    assert_eq!(accepted, 2);
    let full = api_err(
        service
            .record_usage(&runtime, vec![usage("c3", A), usage("c4", A)])
            .await,
    );
    assert_eq!(
        (full.code, full.reason.as_ref()),
        (Code::ResourceExhausted, "USAGE_BACKLOG")
    );
    // A retry of what waits takes no room.
    assert_eq!(service.record_usage(&runtime, vec![usage("c1", A)]).await.unwrap(), 0);
    assert_eq!(service.record_usage(&runtime, vec![usage("c3", A)]).await.unwrap(), 1);
    service.flush().await.unwrap();
    let ids: HashSet<String> = h.all_records().await.into_iter().map(|r| r.call_id).collect();
    assert_eq!(ids, HashSet::from(["c1".into(), "c2".into(), "c3".into()]));
    // Written, the room is free again.
    assert_eq!(
        service
            .record_usage(&runtime, vec![usage("c4", A), usage("c5", A)])
            .await
            .unwrap(),
        2
    );
}

async fn failed_writes_keep_their_records(h: Harness) {
    let flaky = FlakyStore::new(h.store.clone());
    let service = ObservabilityService::new(
        flaky.clone(),
        LedgerSettings {
            flush_interval: Duration::from_millis(20),
            ..LedgerSettings::default()
        },
    );
    let runtime = service_ctx(A);
    service.set_budget(&admin_ctx(A), "", "", 10_000).await.unwrap();
    flaky.fail(true);
    service
        .record_usage(&runtime, vec![usage("c1", A), usage("c2", A)])
        .await
        .unwrap();
    let failed = api_err(service.flush().await);
    assert_eq!(failed.code, Code::Unavailable);
    service.record_usage(&runtime, vec![usage("c3", A)]).await.unwrap();
    assert!(h.all_records().await.is_empty());
    let waiting = service.list_budgets(&admin_ctx(A), "").await.unwrap();
    assert_eq!(waiting[0].spent_pico_usd, 3 * 1_050, "what waits still counts");

    flaky.fail(false);
    service.flush().await.unwrap();
    assert_eq!(h.all_records().await.len(), 3, "kept through the failure, then written");
    let budgets = service.list_budgets(&admin_ctx(A), "").await.unwrap();
    assert_eq!(budgets[0].spent_pico_usd, 3 * 1_050, "counted once, written");

    // At shutdown the writer retries until the database takes what is left.
    flaky.fail(true);
    service.record_usage(&runtime, vec![usage("c4", A)]).await.unwrap();
    let shutdown = CancellationToken::new();
    let background = service.spawn_background(shutdown.clone());
    shutdown.cancel();
    flaky.fail(false);
    background.await.unwrap();
    assert_eq!(h.all_records().await.len(), 4);
}

async fn a_clean_shutdown_writes_everything(h: Harness) {
    // Nothing would be written before shutdown but for the shutdown itself.
    let service = h.with_settings(LedgerSettings {
        flush_interval: Duration::from_secs(3_600),
        flush_batch: 1_000_000,
        ..LedgerSettings::default()
    });
    let shutdown = CancellationToken::new();
    let background = service.spawn_background(shutdown.clone());
    let runtime = service_ctx(A);
    let mut expected = HashSet::new();
    for batch in 0..5 {
        let records: Vec<UsageRecord> = (0..40)
            .map(|i| usage(&format!("call_{batch}_{i}"), if i % 2 == 0 { A } else { B }))
            .collect();
        expected.extend(records.iter().map(|r| r.call_id.clone()));
        service.record_usage(&runtime, records).await.unwrap();
    }
    assert!(h.all_records().await.is_empty(), "still buffered");
    shutdown.cancel();
    background.await.unwrap();
    let stored: HashSet<String> = h.all_records().await.into_iter().map(|r| r.call_id).collect();
    assert_eq!(stored, expected);
    // A report arriving while the server drains is written before it is answered.
    service.record_usage(&runtime, vec![usage("late", A)]).await.unwrap();
    assert_eq!(h.all_records().await.len(), expected.len() + 1);
}

async fn invalid_records_name_their_field(h: Harness) {
    let runtime = service_ctx(A);
    let good = usage("good", A);
    let cases: Vec<(&str, UsageRecord)> = vec![
        (
            "call_id",
            UsageRecord {
                call_id: String::new(),
                ..good.clone()
            },
        ),
        (
            "call_id",
            UsageRecord {
                call_id: "c".repeat(129),
                ..good.clone()
            },
        ),
        (
            "tenant_id",
            UsageRecord {
                tenant_id: String::new(),
                ..good.clone()
            },
        ),
        (
            "model",
            UsageRecord {
                model: String::new(),
                ..good.clone()
            },
        ),
        (
            "cost_pico_usd",
            UsageRecord {
                cost_pico_usd: -1,
                ..good.clone()
            },
        ),
        (
            "billed_pico_usd",
            UsageRecord {
                billed_pico_usd: -5,
                ..good.clone()
            },
        ),
        (
            "first_token_ms",
            UsageRecord {
                first_token_ms: -1,
                ..good.clone()
            },
        ),
        (
            "input_tokens",
            UsageRecord {
                input_tokens: u64::MAX,
                ..good.clone()
            },
        ),
        (
            "ended_at_ms",
            UsageRecord {
                ended_at_ms: good.started_at_ms - 1,
                ..good.clone()
            },
        ),
    ];
    for (field, bad) in cases {
        let err = api_err(h.service.record_usage(&runtime, vec![good.clone(), bad]).await);
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::InvalidArgument, "INVALID_USAGE_RECORD"),
            "{field}"
        );
        assert!(err.message.contains(&format!("records[1].{field}")), "{}", err.message);
    }
    let too_many: Vec<UsageRecord> = (0..1001).map(|i| usage(&format!("c{i}"), A)).collect();
    let err = api_err(h.service.record_usage(&runtime, too_many).await);
    assert_eq!(err.reason, "TOO_MANY_USAGE_RECORDS");
    h.service.flush().await.unwrap();
    assert!(h.all_records().await.is_empty(), "an invalid request records nothing");
    let max: Vec<UsageRecord> = (0..1000).map(|i| usage(&format!("c{i}"), A)).collect();
    assert_eq!(h.service.record_usage(&runtime, max).await.unwrap(), 1000);
    h.service.flush().await.unwrap();
    assert_eq!(h.all_records().await.len(), 1000);
}

/// Issue 26 item 10: a call noted open and never recorded (its runtime died)
/// is billed at its estimate, marked, once settled; a recorded one is not
/// billed twice; a call opened after the cut-off stays open.
async fn calls_left_open_are_billed_at_their_estimate(h: Harness) {
    let runtime = service_ctx(A);
    let estimate = |call_id: &str, started_at_ms: i64| UsageRecord {
        input_tokens: 10,
        output_tokens: 4096,
        billed_pico_usd: 5_000,
        started_at_ms,
        ended_at_ms: started_at_ms,
        ..usage(call_id, A)
    };
    let cut = estimate("call_cut", FEB_1);
    let done = estimate("call_done", FEB_1);
    let later = estimate("call_later", FEB_1_01H);
    for open in [&cut, &done, &later] {
        h.service.open_call(&runtime, open.clone()).await.unwrap();
    }
    // The same note again changes nothing.
    h.service.open_call(&runtime, cut.clone()).await.unwrap();
    let recorded = UsageRecord {
        output_tokens: 12,
        billed_pico_usd: 700,
        ..done.clone()
    };
    h.service.record_usage(&runtime, vec![recorded.clone()]).await.unwrap();
    h.service.flush().await.unwrap();

    // Only components settle.
    let refused = h.service.settle_open_calls(&admin_ctx(A), FEB_1 + 1).await;
    assert_eq!(api_err(refused).code, Code::PermissionDenied);
    let settled = h.service.settle_open_calls(&runtime, FEB_1 + 1).await.unwrap();
    assert_eq!(
        settled, 1,
        "the recorded call was no longer open, the later one not yet due"
    );
    let again = h.service.settle_open_calls(&runtime, FEB_1 + 1).await.unwrap();
    assert_eq!(again, 0, "settled once");

    let mut listed = h.all_records().await;
    listed.sort_by(|a, b| a.call_id.cmp(&b.call_id));
    let billed_cut = UsageRecord {
        status: CallStatus::Cut,
        estimated: true,
        ..cut
    };
    assert_eq!(listed, vec![billed_cut.clone(), recorded.clone()]);
    let summary_ctx = admin_ctx(A);
    let report = h
        .service
        .query_usage(&summary_ctx, &UsageQuery::default(), &[Dimension::Status])
        .await
        .unwrap();
    let keys: Vec<&str> = report.groups.iter().map(|group| group.keys[0].as_str()).collect();
    assert_eq!(keys, ["completed", "cut"]);
    assert_eq!(report.totals.estimated_calls, 1);

    // The later call is billed once it is due, and counts in its month.
    assert_eq!(h.service.settle_open_calls(&runtime, i64::MAX).await.unwrap(), 1);
    assert_eq!(h.all_records().await.len(), 3);
}
