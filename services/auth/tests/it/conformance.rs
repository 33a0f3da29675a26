//! The store conformance suite: every body runs against SQLite and Postgres.

use std::sync::Arc;

use avm_auth::{
    ApiKeyRecord, AuthError, AuthStore, NewApiKey, QuotaState, Reach, ReserveOutcome, SigningKeyRecord, TenantRecord,
    TenantUpdate, TokenReservation, TombstoneKind, UsageReport, UserRecord,
};
use avm_common::auth::{Limits, Role, Scopes};

/// Expands each body into `sqlite::<name>` and `postgres::<name>` tests.
macro_rules! conformance_suite {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    let db = crate::support::TestDb::sqlite().await;
                    super::$name(db.store.clone()).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(db) = crate::support::TestDb::postgres().await else { return };
                    super::$name(db.store.clone()).await;
                }
            )*
        }
    };
}

conformance_suite!(
    tenants_round_trip_within_reach,
    bootstrap_happens_only_on_an_empty_store,
    users_round_trip_within_reach,
    keys_round_trip_within_reach,
    deletes_cascade_and_leave_tombstones,
    credentials_stay_alive_until_revoked_or_deleted,
    usage_counts_each_report_once,
    token_reservations_hold_until_reported_or_expired,
    signing_keys_rotate_and_stay_published,
    external_users_are_provisioned_once,
    events_travel_as_the_store_says,
);

fn tenant(id: &str, name: &str, created_at_ms: i64) -> TenantRecord {
    TenantRecord {
        tenant_id: id.to_owned(),
        name: name.to_owned(),
        operator: false,
        limits: Limits {
            requests_per_minute: 60,
            tokens_per_month: 1000,
        },
        created_at_ms,
        updated_at_ms: created_at_ms,
    }
}

fn user(id: &str, tenant_id: &str, role: Role, created_at_ms: i64) -> UserRecord {
    UserRecord {
        user_id: id.to_owned(),
        tenant_id: tenant_id.to_owned(),
        name: format!("name of {id}"),
        role,
        external_subject: None,
        created_at_ms,
    }
}

fn key(id: &str, user: &UserRecord, created_at_ms: i64) -> NewApiKey {
    NewApiKey {
        key: ApiKeyRecord {
            key_id: id.to_owned(),
            tenant_id: user.tenant_id.clone(),
            user_id: user.user_id.clone(),
            name: "default".to_owned(),
            prefix: "avm_0123abcd".to_owned(),
            scopes: Scopes::READ.union(Scopes::WRITE),
            limits: Limits {
                requests_per_minute: 10,
                tokens_per_month: 100,
            },
            created_at_ms,
            expires_at_ms: Some(created_at_ms + 1_000_000),
            revoked_at_ms: None,
        },
        secret_hash: format!("hash-of-{id}"),
    }
}

/// Creates tenant `t` with admin `t-admin` and key `t-key`.
async fn seed(store: &Arc<dyn AuthStore>, t: &str, at: i64) -> (TenantRecord, UserRecord, NewApiKey) {
    let tenant = tenant(t, &format!("tenant {t}"), at);
    let admin = user(&format!("{t}-admin"), t, Role::Admin, at);
    let key = key(&format!("{t}-key"), &admin, at);
    store.create_tenant(&tenant, &admin, &key).await.unwrap();
    (tenant, admin, key)
}

fn reason<T: std::fmt::Debug>(result: Result<T, AuthError>) -> String {
    crate::support::reason(result)
}

async fn tenants_round_trip_within_reach(store: Arc<dyn AuthStore>) {
    let (a, _, _) = seed(&store, "ten_a", 2_000).await;
    let (b, _, _) = seed(&store, "ten_b", 1_000).await;
    assert_eq!(store.get_tenant(&Reach::all(), "ten_a").await.unwrap(), a);
    assert_eq!(store.get_tenant(&Reach::tenant("ten_a"), "ten_a").await.unwrap(), a);
    assert_eq!(
        reason(store.get_tenant(&Reach::tenant("ten_a"), "ten_b").await),
        "TENANT_NOT_FOUND"
    );
    assert_eq!(
        reason(store.get_tenant(&Reach::all(), "ten_x").await),
        "TENANT_NOT_FOUND"
    );

    // Oldest first, whatever the ids; reach narrows to one.
    let all = store.list_tenants(&Reach::all()).await.unwrap();
    assert_eq!(all, [b.clone(), a.clone()]);
    assert_eq!(
        store.list_tenants(&Reach::tenant("ten_a")).await.unwrap(),
        std::slice::from_ref(&a)
    );
    assert_eq!(
        store.find_tenant_by_name("tenant ten_b").await.unwrap(),
        Some(b.clone())
    );
    assert_eq!(store.find_tenant_by_name("nobody").await.unwrap(), None);

    let update = TenantUpdate {
        name: Some("renamed".into()),
        limits: Some(Limits {
            requests_per_minute: 5,
            tokens_per_month: 0,
        }),
    };
    let (before, after) = store
        .update_tenant(&Reach::all(), "ten_a", &update, 3_000)
        .await
        .unwrap();
    assert_eq!(before.name, a.name);
    assert_eq!(before.limits, a.limits);
    assert_eq!(after.name, "renamed");
    assert_eq!(after.limits, update.limits.unwrap());
    assert_eq!(after.updated_at_ms, 3_000);
    let only_name = TenantUpdate {
        name: Some("again".into()),
        limits: None,
    };
    let (_, after) = store
        .update_tenant(&Reach::tenant("ten_a"), "ten_a", &only_name, 4_000)
        .await
        .unwrap();
    assert_eq!(after.limits, update.limits.unwrap(), "unset fields stay");
    assert_eq!(
        reason(
            store
                .update_tenant(&Reach::tenant("ten_a"), "ten_b", &only_name, 5_000)
                .await
        ),
        "TENANT_NOT_FOUND"
    );
    assert_eq!(
        store.get_tenant(&Reach::all(), "ten_b").await.unwrap(),
        b,
        "refused updates change nothing"
    );
    assert_eq!(
        store.tenants_updated_since(3_500).await.unwrap(),
        [("ten_a".to_owned(), 4_000)]
    );
}

async fn bootstrap_happens_only_on_an_empty_store(store: Arc<dyn AuthStore>) {
    let mut operator = tenant("ten_op", "admin", 1);
    operator.operator = true;
    let admin = user("usr_op", "ten_op", Role::Admin, 1);
    let admin_key = key("key_op", &admin, 1);
    assert!(store.bootstrap(&operator, &admin, &admin_key).await.unwrap());
    assert_eq!(store.get_tenant(&Reach::all(), "ten_op").await.unwrap(), operator);
    assert!(store.key_credential("key_op").await.unwrap().is_some());

    let mut second = tenant("ten_op2", "admin", 2);
    second.operator = true;
    let admin2 = user("usr_op2", "ten_op2", Role::Admin, 2);
    let key2 = key("key_op2", &admin2, 2);
    assert!(!store.bootstrap(&second, &admin2, &key2).await.unwrap());
    assert_eq!(store.list_tenants(&Reach::all()).await.unwrap().len(), 1);
    assert_eq!(reason(store.get_user(&Reach::all(), "usr_op2").await), "USER_NOT_FOUND");

    // The operator tenant is never deleted by the store either.
    assert_eq!(reason(store.delete_tenant("ten_op", 3).await), "TENANT_NOT_FOUND");
}

async fn users_round_trip_within_reach(store: Arc<dyn AuthStore>) {
    let (_, a_admin, _) = seed(&store, "ten_a", 1).await;
    seed(&store, "ten_b", 1).await;
    let member = user("usr_m", "ten_a", Role::Member, 5);
    store.create_user(&Reach::tenant("ten_a"), &member).await.unwrap();
    assert_eq!(
        reason(
            store
                .create_user(&Reach::tenant("ten_b"), &user("usr_x", "ten_a", Role::Member, 5))
                .await
        ),
        "TENANT_NOT_FOUND",
        "a tenant out of reach is missing"
    );
    assert_eq!(
        reason(
            store
                .create_user(&Reach::all(), &user("usr_y", "ten_zz", Role::Member, 5))
                .await
        ),
        "TENANT_NOT_FOUND"
    );

    assert_eq!(store.get_user(&Reach::all(), "usr_m").await.unwrap(), member);
    assert_eq!(store.get_user(&Reach::tenant("ten_a"), "usr_m").await.unwrap(), member);
    assert_eq!(
        store.get_user(&Reach::user("ten_a", "usr_m"), "usr_m").await.unwrap(),
        member
    );
    for reach in [Reach::tenant("ten_b"), Reach::user("ten_a", "ten_a-admin")] {
        assert_eq!(reason(store.get_user(&reach, "usr_m").await), "USER_NOT_FOUND");
    }

    assert_eq!(
        store.list_users(&Reach::tenant("ten_a"), "ten_a").await.unwrap(),
        [a_admin.clone(), member.clone()]
    );
    assert_eq!(
        reason(store.list_users(&Reach::tenant("ten_b"), "ten_a").await),
        "TENANT_NOT_FOUND"
    );
    assert_eq!(
        reason(store.list_users(&Reach::all(), "ten_zz").await),
        "TENANT_NOT_FOUND"
    );
}

async fn keys_round_trip_within_reach(store: Arc<dyn AuthStore>) {
    let (_, a_admin, a_key) = seed(&store, "ten_a", 1).await;
    seed(&store, "ten_b", 1).await;
    let member = user("usr_m", "ten_a", Role::Member, 2);
    store.create_user(&Reach::all(), &member).await.unwrap();
    let newer = key("key_new", &member, 10);
    store.create_api_key(&newer).await.unwrap();
    let orphan = key("key_orphan", &user("usr_gone", "ten_a", Role::Member, 2), 10);
    assert_eq!(reason(store.create_api_key(&orphan).await), "USER_NOT_FOUND");

    assert_eq!(store.get_api_key(&Reach::all(), "key_new").await.unwrap(), newer.key);
    assert_eq!(
        store
            .get_api_key(&Reach::user("ten_a", "usr_m"), "key_new")
            .await
            .unwrap(),
        newer.key
    );
    for reach in [Reach::tenant("ten_b"), Reach::user("ten_a", "ten_a-admin")] {
        assert_eq!(reason(store.get_api_key(&reach, "key_new").await), "API_KEY_NOT_FOUND");
    }

    // Newest first.
    assert_eq!(
        store.list_api_keys(&Reach::tenant("ten_a")).await.unwrap(),
        [newer.key.clone(), a_key.key.clone()]
    );
    assert_eq!(
        store.list_api_keys(&Reach::user("ten_a", "usr_m")).await.unwrap(),
        std::slice::from_ref(&newer.key)
    );
    assert_eq!(
        store.list_api_keys(&Reach::user("ten_b", "usr_m")).await.unwrap(),
        Vec::<ApiKeyRecord>::new()
    );

    let credential = store.key_credential("key_new").await.unwrap().unwrap();
    assert_eq!(credential.secret_hash, "hash-of-key_new");
    assert_eq!(credential.user, member);
    assert_eq!(credential.tenant.tenant_id, "ten_a");
    assert!(store.key_credential("key_nope").await.unwrap().is_none());

    // Out of reach: refused and unchanged.
    assert_eq!(
        reason(
            store
                .revoke_api_key(&Reach::user("ten_a", "usr_m"), "ten_a-key", 20)
                .await
        ),
        "API_KEY_NOT_FOUND"
    );
    assert_eq!(
        store
            .get_api_key(&Reach::all(), "ten_a-key")
            .await
            .unwrap()
            .revoked_at_ms,
        None
    );
    let (revoked, now) = store
        .revoke_api_key(&Reach::tenant("ten_a"), "key_new", 20)
        .await
        .unwrap();
    assert!(now);
    assert_eq!(revoked.revoked_at_ms, Some(20));
    let (again, now) = store
        .revoke_api_key(&Reach::tenant("ten_a"), "key_new", 30)
        .await
        .unwrap();
    assert!(!now, "a second revocation changes nothing");
    assert_eq!(again.revoked_at_ms, Some(20));
    assert_eq!(
        store.revoked_keys_since(15).await.unwrap(),
        [("key_new".to_owned(), 20)]
    );

    let mut dev = key("key_dev", &a_admin, 40);
    dev.key.name = "dev".into();
    store.create_api_key(&dev).await.unwrap();
    assert_eq!(
        store.revoke_api_keys_named("ten_a-admin", "dev", 50).await.unwrap(),
        ["key_dev".to_owned()]
    );
    assert!(
        store
            .revoke_api_keys_named("ten_a-admin", "dev", 60)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn deletes_cascade_and_leave_tombstones(store: Arc<dyn AuthStore>) {
    seed(&store, "ten_a", 1).await;
    seed(&store, "ten_b", 1).await;
    let member = user("usr_m", "ten_a", Role::Member, 2);
    store.create_user(&Reach::all(), &member).await.unwrap();
    store.create_api_key(&key("key_m", &member, 3)).await.unwrap();
    let report = UsageReport {
        tenant_id: "ten_b".into(),
        key_id: Some("ten_b-key".into()),
        input_tokens: 1,
        output_tokens: 1,
        report_id: "r1".into(),
    };
    store.record_usage(&report, "2030-01", 3).await.unwrap();

    assert_eq!(
        reason(store.delete_user(&Reach::tenant("ten_b"), "usr_m", 10).await),
        "USER_NOT_FOUND"
    );
    let deleted = store.delete_user(&Reach::tenant("ten_a"), "usr_m", 10).await.unwrap();
    assert_eq!(deleted, member);
    assert_eq!(
        reason(store.get_api_key(&Reach::all(), "key_m").await),
        "API_KEY_NOT_FOUND"
    );
    assert_eq!(
        reason(store.delete_user(&Reach::all(), "usr_m", 11).await),
        "USER_NOT_FOUND"
    );

    store.delete_tenant("ten_b", 20).await.unwrap();
    assert_eq!(
        reason(store.get_tenant(&Reach::all(), "ten_b").await),
        "TENANT_NOT_FOUND"
    );
    assert_eq!(
        reason(store.get_user(&Reach::all(), "ten_b-admin").await),
        "USER_NOT_FOUND"
    );
    assert!(store.key_credential("ten_b-key").await.unwrap().is_none());
    assert_eq!(
        store.usage("ten_b", None, "2030-01").await.unwrap(),
        0,
        "usage goes with the tenant"
    );
    assert_eq!(reason(store.delete_tenant("ten_b", 21).await), "TENANT_NOT_FOUND");

    let tombstones = store.tombstones_since(0).await.unwrap();
    let seen: Vec<_> = tombstones.iter().map(|t| (t.kind, t.id.as_str(), t.at_ms)).collect();
    assert_eq!(
        seen,
        [(TombstoneKind::User, "usr_m", 10), (TombstoneKind::Tenant, "ten_b", 20)]
    );
    assert_eq!(store.tombstones_since(15).await.unwrap().len(), 1);
    // The other tenant is untouched.
    assert_eq!(store.list_users(&Reach::all(), "ten_a").await.unwrap().len(), 1);
}

async fn credentials_stay_alive_until_revoked_or_deleted(store: Arc<dyn AuthStore>) {
    seed(&store, "ten_a", 1).await;
    seed(&store, "ten_b", 1).await;
    assert!(
        store
            .credential_alive("ten_a", "ten_a-admin", Some("ten_a-key"), false)
            .await
            .unwrap()
    );
    assert!(
        store
            .credential_alive("ten_a", "ten_a-admin", None, false)
            .await
            .unwrap()
    );
    assert!(
        !store
            .credential_alive("ten_b", "ten_a-admin", None, false)
            .await
            .unwrap()
    );
    // An operator's credential only for an admin of the operator tenant.
    assert!(
        !store
            .credential_alive("ten_a", "ten_a-admin", None, true)
            .await
            .unwrap()
    );
    assert!(
        !store
            .credential_alive("ten_a", "ten_a-admin", Some("ten_b-key"), false)
            .await
            .unwrap()
    );
    store.revoke_api_key(&Reach::all(), "ten_a-key", 5).await.unwrap();
    assert!(
        !store
            .credential_alive("ten_a", "ten_a-admin", Some("ten_a-key"), false)
            .await
            .unwrap()
    );
    store.delete_tenant("ten_b", 6).await.unwrap();
    assert!(
        !store
            .credential_alive("ten_b", "ten_b-admin", None, false)
            .await
            .unwrap()
    );
}

async fn usage_counts_each_report_once(store: Arc<dyn AuthStore>) {
    seed(&store, "ten_a", 1).await; // tenant quota 1000, key quota 100
    let report = |id: &str, tokens: u64, key: Option<&str>| UsageReport {
        tenant_id: "ten_a".into(),
        key_id: key.map(str::to_owned),
        input_tokens: tokens / 2,
        output_tokens: tokens - tokens / 2,
        report_id: id.into(),
    };
    let month = "2030-01";
    let first = store
        .record_usage(&report("r1", 60, Some("ten_a-key")), month, 2)
        .await
        .unwrap();
    assert!(first.counted);
    assert_eq!(
        (first.tenant.before, first.tenant.after, first.tenant.quota),
        (0, 60, 1000)
    );
    let key = first.key.unwrap();
    assert_eq!((key.before, key.after, key.quota), (0, 60, 100));
    assert!(!key.exhausted_now());

    let repeat = store
        .record_usage(&report("r1", 60, Some("ten_a-key")), month, 3)
        .await
        .unwrap();
    assert!(!repeat.counted, "a repeated report id counts once");
    assert_eq!(repeat.tenant.after, 60);
    assert_eq!(repeat.key, None);

    let second = store
        .record_usage(&report("r2", 50, Some("ten_a-key")), month, 4)
        .await
        .unwrap();
    assert_eq!(second.tenant.after, 110);
    assert!(second.key.unwrap().exhausted_now());
    assert!(!second.tenant.exhausted_now());
    assert_eq!(store.usage("ten_a", None, month).await.unwrap(), 110);
    assert_eq!(store.usage("ten_a", Some("ten_a-key"), month).await.unwrap(), 110);
    assert_eq!(store.usage("ten_a", None, "2030-02").await.unwrap(), 0);

    let big = store.record_usage(&report("r3", 900, None), month, 5).await.unwrap();
    assert!(big.tenant.exhausted_now());
    assert_eq!(big.key, None);
    let mut exhausted = store.exhausted_quotas(month).await.unwrap();
    exhausted.sort_by(|a, b| a.key_id.cmp(&b.key_id));
    let state = |key_id: Option<&str>| QuotaState {
        tenant_id: "ten_a".into(),
        key_id: key_id.map(str::to_owned),
        month: month.into(),
    };
    assert_eq!(exhausted, [state(None), state(Some("ten_a-key"))]);
    assert!(store.exhausted_quotas("2030-02").await.unwrap().is_empty());

    let missing = UsageReport {
        tenant_id: "ten_zz".into(),
        ..report("r4", 1, None)
    };
    assert_eq!(reason(store.record_usage(&missing, month, 6).await), "TENANT_NOT_FOUND");
}

/// Issue 26 item 9: calls in flight hold their estimates against the
/// quotas until their reports settle them, or until they expire.
async fn token_reservations_hold_until_reported_or_expired(store: Arc<dyn AuthStore>) {
    seed(&store, "ten_a", 1).await; // tenant quota 1000, key quota 100
    let month = "2030-01";
    let key = Some("ten_a-key");
    let reserve = |id: &str, key: Option<&str>, tokens: u64, now_ms: i64| {
        let store = Arc::clone(&store);
        let reservation = TokenReservation {
            tenant_id: "ten_a".into(),
            key_id: key.map(str::to_owned),
            reservation_id: id.into(),
            tokens,
        };
        async move { store.reserve_tokens(&reservation, month, now_ms, 1_000).await }
    };
    let report = |id: &str, tokens: u64| UsageReport {
        tenant_id: "ten_a".into(),
        key_id: key.map(str::to_owned),
        input_tokens: tokens,
        output_tokens: 0,
        report_id: id.into(),
    };
    let refused = |key_id: Option<&str>, used_up: bool| ReserveOutcome::Refused {
        quota: QuotaState {
            tenant_id: "ten_a".into(),
            key_id: key_id.map(str::to_owned),
            month: month.into(),
        },
        used_up,
    };
    // Two calls of 60 fit under the key's 100 while nothing is used...
    assert_eq!(reserve("c1", key, 60, 10).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(reserve("c2", key, 60, 10).await.unwrap(), ReserveOutcome::Reserved);
    // ...and then hold all of it; the tenant's 1000 still has room.
    assert_eq!(reserve("c3", key, 1, 10).await.unwrap(), refused(key, false));
    assert_eq!(reserve("c3", None, 1, 10).await.unwrap(), ReserveOutcome::Reserved);
    // A retried reservation does not count against itself.
    assert_eq!(reserve("c1", key, 60, 10).await.unwrap(), ReserveOutcome::Reserved);
    // A report settles its call's estimate with its real use: 40 used + 60 held.
    store.record_usage(&report("c1", 40), month, 20).await.unwrap();
    assert_eq!(reserve("c4", key, 1, 20).await.unwrap(), refused(key, false));
    store.record_usage(&report("c2", 20), month, 30).await.unwrap();
    assert_eq!(reserve("c5", key, 40, 30).await.unwrap(), ReserveOutcome::Reserved);
    assert_eq!(reserve("c6", key, 1, 30).await.unwrap(), refused(key, false));
    // A reservation never reported stops holding when it expires.
    assert_eq!(reserve("c6", key, 1, 1_000).await.unwrap(), ReserveOutcome::Reserved);
    // A quota used up by counted tokens says so.
    store.record_usage(&report("c7", 50), month, 1_001).await.unwrap();
    assert_eq!(reserve("c8", key, 1, 1_001).await.unwrap(), refused(key, true));
    let missing = TokenReservation {
        tenant_id: "ten_zz".into(),
        key_id: None,
        reservation_id: "c9".into(),
        tokens: 1,
    };
    assert_eq!(
        reason(store.reserve_tokens(&missing, month, 1, 1_000).await),
        "TENANT_NOT_FOUND"
    );
}

fn signing_key(kid: &str, created_at_ms: i64) -> SigningKeyRecord {
    SigningKeyRecord {
        kid: kid.to_owned(),
        private_key: vec![1, 2, 3, kid.len() as u8],
        public_jwk: format!("{{\"kid\":\"{kid}\"}}"),
        created_at_ms,
        retired_at_ms: None,
    }
}

async fn signing_keys_rotate_and_stay_published(store: Arc<dyn AuthStore>) {
    assert_eq!(store.current_signing_key().await.unwrap(), None);
    let first = signing_key("sk_1", 100);
    store.insert_signing_key(&first, 100).await.unwrap();
    assert_eq!(store.current_signing_key().await.unwrap(), Some(first.clone()));

    let second = signing_key("sk_2", 200);
    store.insert_signing_key(&second, 250).await.unwrap();
    assert_eq!(store.current_signing_key().await.unwrap(), Some(second.clone()));
    // The retired key stays published while its tokens may live.
    assert_eq!(
        store.public_keys(250).await.unwrap(),
        [second.public_jwk.clone(), first.public_jwk.clone()]
    );
    assert_eq!(
        store.public_keys(251).await.unwrap(),
        std::slice::from_ref(&second.public_jwk)
    );
    // Every key, retired ones too, oldest first; a private half changes only
    // from what was read.
    let mut retired = first.clone();
    retired.retired_at_ms = Some(250);
    assert_eq!(store.signing_keys().await.unwrap(), [retired.clone(), second.clone()]);
    assert!(!store.replace_private_key("sk_1", &[9], &[7, 7]).await.unwrap());
    assert!(
        store
            .replace_private_key("sk_1", &first.private_key, &[7, 7])
            .await
            .unwrap()
    );
    assert!(
        !store
            .replace_private_key("sk_1", &first.private_key, &[8, 8])
            .await
            .unwrap()
    );
    assert_eq!(store.signing_keys().await.unwrap()[0].private_key, [7, 7]);
}

async fn external_users_are_provisioned_once(store: Arc<dyn AuthStore>) {
    seed(&store, "ten_a", 1).await;
    let mut first = user("usr_ext1", "ten_a", Role::Member, 5);
    first.external_subject = Some("sub-123".into());
    assert_eq!(store.upsert_external_user(&first).await.unwrap(), first);

    let mut again = user("usr_ext2", "ten_a", Role::Admin, 6);
    again.external_subject = Some("sub-123".into());
    let stored = store.upsert_external_user(&again).await.unwrap();
    assert_eq!(stored.user_id, "usr_ext1", "one user per subject");
    assert_eq!(stored.role, Role::Admin, "the issuer's current role wins");
    assert_eq!(store.list_users(&Reach::all(), "ten_a").await.unwrap().len(), 2);

    let mut elsewhere = user("usr_ext3", "ten_zz", Role::Member, 7);
    elsewhere.external_subject = Some("sub-123".into());
    assert_eq!(reason(store.upsert_external_user(&elsewhere).await), "TENANT_NOT_FOUND");
}

async fn events_travel_as_the_store_says(store: Arc<dyn AuthStore>) {
    use futures::StreamExt;
    let transport = store.event_transport();
    let shared = transport.shares_events();
    let bus = Arc::new(avm_store::events::EventBus::<serde_json::Value>::new("test", transport));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let listener = Arc::clone(&bus).spawn_listener(shutdown.clone());
    bus.wait_live(std::time::Duration::from_secs(10))
        .await
        .expect("the feed goes live");
    let mut events = Box::pin(bus.subscribe());
    bus.emit(serde_json::json!({"hello": 1})).await;
    let event = tokio::time::timeout(std::time::Duration::from_secs(10), events.next())
        .await
        .expect("event in time")
        .expect("the stream goes on")
        .expect("no feed error");
    assert_eq!(
        event,
        serde_json::json!({"hello": 1}),
        "shared through the database: {shared}"
    );
    shutdown.cancel();
    listener.await.unwrap();
}
