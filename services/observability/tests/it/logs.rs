//! Tenants' log events: filters, order, truncation, pruning.

use std::time::Duration;

use avm_common::Code;
use avm_common::testing::{admin_ctx, member_ctx, operator_ctx, service_ctx};
use avm_observability::{LedgerSettings, Level, LogEvent, LogQuery, MAX_LOG_FIELDS_BYTES, MAX_LOG_MESSAGE_BYTES};

use crate::support::{A, B, Harness, OPS, api_err};

conformance!(
    logs_filter_by_level_and_time_newest_first,
    pruning_drops_old_and_excess_events,
    only_admins_read_logs,
);

fn event(tenant_id: &str, at_ms: i64, level: Level, message: &str) -> LogEvent {
    LogEvent {
        tenant_id: tenant_id.to_owned(),
        at_ms,
        level,
        component: "runtime".to_owned(),
        target: "avm_runtime::turn".to_owned(),
        message: message.to_owned(),
        fields_json: r#"{"image_id":"img_1"}"#.to_owned(),
        request_id: "req_1".to_owned(),
        trace_id: "trace_1".to_owned(),
    }
}

fn messages(events: &[LogEvent]) -> Vec<&str> {
    events.iter().map(|e| e.message.as_str()).collect()
}

async fn logs_filter_by_level_and_time_newest_first(h: Harness) {
    let base = avm_common::now_ms() - 60_000;
    let events = vec![
        event(A, base + 1, Level::Info, "a1 info"),
        event(A, base + 2, Level::Debug, "a2 debug"),
        event(A, base + 3, Level::Warn, "a3 warn"),
        event(A, base + 4, Level::Error, "a4 error"),
        event(A, base + 5, Level::Trace, "a5 trace"),
        event(A, base + 6, Level::Info, "a6 info"),
        event(B, base + 7, Level::Error, "b7 error"),
    ];
    h.service.record_logs(&service_ctx(A), events.clone()).await.unwrap();
    let admin = admin_ctx(A);
    let default = h.service.query_logs(&admin, &LogQuery::default()).await.unwrap();
    assert_eq!(
        messages(&default),
        ["a6 info", "a4 error", "a3 warn", "a1 info"],
        "info and above, newest first"
    );
    assert_eq!(default[3], events[0], "stored as recorded");
    let warn = LogQuery {
        min_level: Some(Level::Warn),
        ..LogQuery::default()
    };
    assert_eq!(
        messages(&h.service.query_logs(&admin, &warn).await.unwrap()),
        ["a4 error", "a3 warn"]
    );
    let all_levels = LogQuery {
        min_level: Some(Level::Trace),
        from_ms: base + 2,
        to_ms: base + 5,
        ..LogQuery::default()
    };
    assert_eq!(
        messages(&h.service.query_logs(&admin, &all_levels).await.unwrap()),
        ["a4 error", "a3 warn", "a2 debug"],
        "from inclusive, to exclusive"
    );
    let limited = LogQuery {
        min_level: Some(Level::Trace),
        limit: 2,
        ..LogQuery::default()
    };
    assert_eq!(
        messages(&h.service.query_logs(&admin, &limited).await.unwrap()),
        ["a6 info", "a5 trace"]
    );
    let b = h.service.query_logs(&admin_ctx(B), &LogQuery::default()).await.unwrap();
    assert_eq!(messages(&b), ["b7 error"]);

    // Over-long text is cut, not refused; an event without a time gets one.
    let long = LogEvent {
        message: "m".repeat(MAX_LOG_MESSAGE_BYTES + 100),
        fields_json: format!(r#"{{"big":"{}"}}"#, "x".repeat(MAX_LOG_FIELDS_BYTES)),
        at_ms: 0,
        ..event(A, 0, Level::Error, "")
    };
    h.service.record_logs(&service_ctx(A), vec![long]).await.unwrap();
    let newest = h
        .service
        .query_logs(
            &admin,
            &LogQuery {
                limit: 1,
                ..LogQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(newest[0].message.len(), MAX_LOG_MESSAGE_BYTES);
    assert!(newest[0].fields_json.len() <= MAX_LOG_FIELDS_BYTES);
    let fields: serde_json::Value = serde_json::from_str(&newest[0].fields_json).unwrap();
    assert!(fields["truncated"].as_str().unwrap().starts_with(r#"{"big":"xxx"#));
    assert!(newest[0].at_ms > base + 7);

    let no_tenant = api_err(
        h.service
            .record_logs(&service_ctx(A), vec![event("", base, Level::Info, "x")])
            .await,
    );
    assert_eq!(
        (no_tenant.code, no_tenant.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_LOG_EVENT")
    );
    assert!(no_tenant.message.contains("events[0].tenant_id"));
}

async fn pruning_drops_old_and_excess_events(h: Harness) {
    let service = h.with_settings(LedgerSettings {
        log_retention: Duration::from_secs(3_600),
        max_log_events_per_tenant: 5,
        ..LedgerSettings::default()
    });
    let now = avm_common::now_ms();
    let mut events = Vec::new();
    for i in 0..3 {
        events.push(event(A, now - 2 * 3_600_000 + i, Level::Error, &format!("old {i}")));
    }
    for i in 0..8 {
        events.push(event(A, now - 60_000 + i, Level::Info, &format!("recent {i}")));
    }
    for i in 0..2 {
        events.push(event(B, now - 30_000 + i, Level::Info, &format!("b {i}")));
    }
    service.record_logs(&service_ctx(A), events).await.unwrap();
    assert_eq!(service.prune_logs().await.unwrap(), 3 + 3);
    let everything = LogQuery {
        min_level: Some(Level::Trace),
        ..LogQuery::default()
    };
    let a = service.query_logs(&admin_ctx(A), &everything).await.unwrap();
    assert_eq!(
        messages(&a),
        ["recent 7", "recent 6", "recent 5", "recent 4", "recent 3"],
        "the newest five"
    );
    let b = service.query_logs(&admin_ctx(B), &everything).await.unwrap();
    assert_eq!(b.len(), 2, "another tenant keeps its own");
    assert_eq!(service.prune_logs().await.unwrap(), 0);
}

async fn only_admins_read_logs(h: Harness) {
    let at = avm_common::now_ms();
    h.service
        .record_logs(&service_ctx(A), vec![event(A, at, Level::Warn, "a's")])
        .await
        .unwrap();
    let member = api_err(
        h.service
            .query_logs(&member_ctx(A, "usr_1"), &LogQuery::default())
            .await,
    );
    assert_eq!(member.code, Code::PermissionDenied);
    let foreign = api_err(
        h.service
            .query_logs(
                &admin_ctx(B),
                &LogQuery {
                    tenant_id: A.into(),
                    ..LogQuery::default()
                },
            )
            .await,
    );
    assert_eq!(
        (foreign.code, foreign.reason.as_ref()),
        (Code::PermissionDenied, "OPERATOR_REQUIRED")
    );
    assert!(
        h.service
            .query_logs(&admin_ctx(B), &LogQuery::default())
            .await
            .unwrap()
            .is_empty()
    );
    let seen = h
        .service
        .query_logs(
            &operator_ctx(OPS),
            &LogQuery {
                tenant_id: A.into(),
                ..LogQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(messages(&seen), ["a's"]);
    let runtime = h
        .service
        .query_logs(&service_ctx(A), &LogQuery::default())
        .await
        .unwrap();
    assert_eq!(runtime.len(), 1);
    for ctx in [admin_ctx(A), operator_ctx(OPS), member_ctx(A, "usr_1")] {
        let refused = api_err(
            h.service
                .record_logs(&ctx, vec![event(A, at, Level::Error, "forged")])
                .await,
        );
        assert_eq!(
            (refused.code, refused.reason.as_ref()),
            (Code::PermissionDenied, "SERVICE_REQUIRED")
        );
    }
}
