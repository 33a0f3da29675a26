//! Tenancy and roles: another tenant's data is never visible, members see
//! only their own calls, only components report.

use avm_common::auth::{Role, Scopes};
use avm_common::testing::{admin_ctx, member_ctx, operator_ctx, principal_ctx, service_ctx};
use avm_common::{ApiError, Code};
use avm_observability::{Dimension, UsageQuery, UsageRecord};

use crate::support::{A, B, Harness, OPS, api_err, totals_of, usage};

conformance!(
    tenants_see_only_their_own_usage,
    members_see_only_their_own_calls,
    budgets_stay_within_their_tenant,
    only_components_report_and_check,
);

fn assert_operator_required(err: ApiError) {
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::PermissionDenied, "OPERATOR_REQUIRED"),
        "{err:?}"
    );
}

async fn seed(h: &Harness) -> Vec<UsageRecord> {
    let records = vec![
        UsageRecord {
            user_id: "usr_1".into(),
            ..usage("a1", A)
        },
        UsageRecord {
            user_id: "usr_2".into(),
            billed_pico_usd: 7,
            ..usage("a2", A)
        },
        UsageRecord {
            user_id: "usr_1".into(),
            ..usage("b1", B)
        },
    ];
    h.service.record_usage(&service_ctx(A), records.clone()).await.unwrap();
    h.service.flush().await.unwrap();
    records
}

async fn tenants_see_only_their_own_usage(h: Harness) {
    let records = seed(&h).await;
    let b_admin = admin_ctx(B);
    let own = UsageQuery::default();
    let report = h
        .service
        .query_usage(&b_admin, &own, &[Dimension::Tenant])
        .await
        .unwrap();
    assert_eq!(report.totals, totals_of(&records[2..]));
    assert_eq!(report.groups.len(), 1);
    assert_eq!(report.groups[0].keys, [B]);
    let page = h.service.list_usage(&b_admin, &own, 0, "").await.unwrap();
    assert_eq!(page.records, records[2..]);
    let summary = h.service.usage_summary(&b_admin, "", false, 0).await.unwrap();
    assert_eq!(summary.totals.calls, 1);

    // Naming A, or every tenant: refused the same way whether A exists or not.
    for tenant in [A, "ten_nobody"] {
        let named = UsageQuery {
            tenant_id: tenant.into(),
            ..UsageQuery::default()
        };
        assert_operator_required(api_err(h.service.query_usage(&b_admin, &named, &[]).await));
        assert_operator_required(api_err(h.service.list_usage(&b_admin, &named, 0, "").await));
        assert_operator_required(api_err(h.service.usage_summary(&b_admin, tenant, false, 0).await));
    }
    let all = UsageQuery {
        all_tenants: true,
        ..UsageQuery::default()
    };
    assert_operator_required(api_err(h.service.query_usage(&b_admin, &all, &[]).await));
    assert_operator_required(api_err(h.service.list_usage(&b_admin, &all, 0, "").await));
    assert_operator_required(api_err(h.service.usage_summary(&b_admin, "", true, 0).await));

    // Operators see any tenant, and all of them.
    let ops = operator_ctx(OPS);
    let everyone = h.service.query_usage(&ops, &all, &[Dimension::Tenant]).await.unwrap();
    assert_eq!(everyone.totals, totals_of(&records));
    let keys: Vec<&str> = everyone.groups.iter().map(|g| g.keys[0].as_str()).collect();
    assert_eq!(keys, [A, B]);
    let a = UsageQuery {
        tenant_id: A.into(),
        ..UsageQuery::default()
    };
    assert_eq!(
        h.service.query_usage(&ops, &a, &[]).await.unwrap().totals,
        totals_of(&records[..2])
    );
    // Components act for the tenant they name.
    let runtime = h.service.query_usage(&service_ctx(A), &own, &[]).await.unwrap();
    assert_eq!(runtime.totals, totals_of(&records[..2]));
}

async fn members_see_only_their_own_calls(h: Harness) {
    let records = seed(&h).await;
    let member = member_ctx(A, "usr_1");
    let own = UsageQuery::default();
    let report = h.service.query_usage(&member, &own, &[Dimension::User]).await.unwrap();
    assert_eq!(report.totals, totals_of(&records[..1]));
    assert_eq!(report.groups.len(), 1);
    assert_eq!(report.groups[0].keys, ["usr_1"]);
    let page = h.service.list_usage(&member, &own, 0, "").await.unwrap();
    assert_eq!(page.records, records[..1]);
    let summary = h.service.usage_summary(&member, "", false, 0).await.unwrap();
    assert_eq!(summary.totals.calls, 1);
    // Naming another user answers nothing.
    let other = UsageQuery {
        user_id: "usr_2".into(),
        ..UsageQuery::default()
    };
    let report = h.service.query_usage(&member, &other, &[]).await.unwrap();
    assert_eq!((report.totals.calls, report.groups.len()), (0, 0));
    assert!(
        h.service
            .list_usage(&member, &other, 0, "")
            .await
            .unwrap()
            .records
            .is_empty()
    );
    // Another tenant: refused, as for admins.
    let foreign = UsageQuery {
        tenant_id: B.into(),
        ..UsageQuery::default()
    };
    assert_operator_required(api_err(h.service.query_usage(&member, &foreign, &[]).await));
    // Admins see every user of their tenant.
    let admin = h
        .service
        .query_usage(&admin_ctx(A), &own, &[Dimension::User])
        .await
        .unwrap();
    assert_eq!(admin.totals, totals_of(&records[..2]));
    // A credential without the read scope sees nothing.
    let write_only = principal_ctx(A, "usr_1", Role::Member, Scopes::WRITE);
    let refused = api_err(h.service.query_usage(&write_only, &own, &[]).await);
    assert_eq!(
        (refused.code, refused.reason.as_ref()),
        (Code::PermissionDenied, "MISSING_SCOPE")
    );
}

async fn budgets_stay_within_their_tenant(h: Harness) {
    h.service.set_budget(&admin_ctx(A), "", "", 1_000).await.unwrap();
    h.service.set_budget(&admin_ctx(A), A, "key_a", 500).await.unwrap();
    assert!(h.service.list_budgets(&admin_ctx(B), "").await.unwrap().is_empty());
    assert_operator_required(api_err(h.service.list_budgets(&admin_ctx(B), A).await));
    assert_operator_required(api_err(h.service.set_budget(&admin_ctx(B), A, "", 1).await));
    assert_operator_required(api_err(h.service.set_budget(&admin_ctx(B), "ten_nobody", "", 1).await));
    // Members read their own key's budget only, not the tenant's spend
    // (issue 26 item 13), and do not set them.
    let member = member_ctx(A, "usr_1");
    assert!(h.service.list_budgets(&member, "").await.unwrap().is_empty());
    let mut with_key = member_ctx(A, "usr_1");
    std::sync::Arc::make_mut(&mut with_key.principal).key_id = Some("key_a".into());
    let own = h.service.list_budgets(&with_key, "").await.unwrap();
    assert_eq!(own.iter().map(|b| b.key_id.as_str()).collect::<Vec<_>>(), ["key_a"]);
    let refused = api_err(h.service.set_budget(&member, "", "", 5).await);
    assert_eq!(refused.code, Code::PermissionDenied);
    // Operators manage any tenant's.
    let ops = operator_ctx(OPS);
    let set = h.service.set_budget(&ops, B, "", 2_000).await.unwrap().unwrap();
    assert_eq!((set.tenant_id.as_str(), set.monthly_limit_pico_usd), (B, 2_000));
    assert_eq!(h.service.list_budgets(&ops, A).await.unwrap().len(), 2);
    let b = h.service.list_budgets(&admin_ctx(B), "").await.unwrap();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0].tenant_id, B);
}

async fn only_components_report_and_check(h: Harness) {
    let callers = [
        admin_ctx(A),
        member_ctx(A, "usr_1"),
        operator_ctx(OPS),
        principal_ctx(A, "usr_x", Role::Admin, Scopes::ALL),
    ];
    for ctx in callers {
        let who = format!("{:?}", ctx.principal);
        let reported = api_err(h.service.record_usage(&ctx, vec![usage("forged", A)]).await);
        assert_eq!(reported.reason, "SERVICE_REQUIRED", "{who}");
        let checked = api_err(h.service.check_budget(&ctx, A, "").await);
        assert_eq!(checked.reason, "SERVICE_REQUIRED", "{who}");
        let watched = api_err(h.service.watch_budgets(&ctx).await.map(|_| ()));
        assert_eq!(watched.reason, "SERVICE_REQUIRED", "{who}");
        assert_eq!(reported.code, Code::PermissionDenied);
    }
    h.service.flush().await.unwrap();
    assert!(h.all_records().await.is_empty());
}
