//! The service's rules, called in process: bootstrap, exchange, who may see
//! and do what, and foreign ids answering exactly like missing ones.

use std::time::Duration;

use avm_auth::{ApiKeySpec, CreatedTenant, TenantUpdate};
use avm_common::auth::{Limits, Role, Scopes};
use avm_common::{Code, RequestContext};

use crate::support::{Harness, api_err, assert_same_answer, eventually, reason};

/// Two tenants, each with an admin and a member, and their contexts.
struct World {
    h: Harness,
    a: CreatedTenant,
    b: CreatedTenant,
    a_admin: RequestContext,
    a_member: RequestContext,
    a_member_id: String,
    a_member_key: String,
    a_member_key_id: String,
    b_member_id: String,
    b_member_key_id: String,
}

async fn world() -> World {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let a = h.service.create_tenant(&op, "tenant a", None, "").await.unwrap();
    let b = h.service.create_tenant(&op, "tenant b", None, "boss").await.unwrap();
    let a_admin = h.ctx(&a.api_key.secret).await;
    let b_admin = h.ctx(&b.api_key.secret).await;
    let (a_member_id, a_member_key, a_member_key_id) = member(&h, &a_admin).await;
    let (b_member_id, _, b_member_key_id) = member(&h, &b_admin).await;
    let a_member = h.ctx(&a_member_key).await;
    World {
        h,
        a,
        b,
        a_admin,
        a_member,
        a_member_id,
        a_member_key,
        a_member_key_id,
        b_member_id,
        b_member_key_id,
    }
}

/// Creates a member of the admin's tenant with a key; returns (user, key, key id).
async fn member(h: &Harness, admin: &RequestContext) -> (String, String, String) {
    let user = h.service.create_user(admin, "", "member", Role::Member).await.unwrap();
    let spec = ApiKeySpec {
        user_id: Some(user.user_id.clone()),
        name: "laptop".into(),
        ..ApiKeySpec::default()
    };
    let key = h.service.create_api_key(admin, spec).await.unwrap();
    (user.user_id, key.secret, key.api_key.key_id)
}

#[tokio::test]
async fn bootstrap_happens_once_and_makes_an_operator() {
    let h = Harness::sqlite().await;
    assert!(
        h.service.bootstrap().await.unwrap().is_none(),
        "a second bootstrap makes nothing"
    );
    assert!(h.admin.secret.starts_with("avm_"));
    assert!(
        format!("{:?}", h.admin).find(&h.admin.secret).is_none(),
        "debug output hides the key"
    );

    let token = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    let principal = h.service.verifier().verify(&token.token).await.unwrap();
    assert_eq!(principal, token.principal);
    assert_eq!(
        (principal.tenant_id.as_str(), principal.user_id.as_str(), principal.role),
        (h.admin.tenant_id.as_str(), h.admin.user_id.as_str(), Role::Admin)
    );
    assert!(principal.operator);
    assert_eq!(principal.key_id.as_deref(), Some(h.admin.key_id.as_str()));
    assert_eq!(principal.scopes, Scopes::ALL);
    let ttl_ms = i64::try_from(h.config.token_ttl.as_millis()).unwrap();
    let life = token.expires_at_ms - avm_common::now_ms();
    assert!(
        life > ttl_ms - 5_000 && life <= ttl_ms + 1_000,
        "token lives for the ttl: {life}"
    );

    let tenants = h.service.list_tenants(&h.operator().await).await.unwrap();
    assert_eq!(tenants.len(), 1);
    assert!(tenants[0].operator);
    assert_eq!(tenants[0].limits, Limits::default(), "the operator tenant is unlimited");
}

#[tokio::test]
async fn exchange_refuses_every_bad_key_alike() {
    let w = world().await;
    let good = &w.a_member_key;
    let mut wrong_secret = good.clone();
    let last = wrong_secret.pop().unwrap();
    wrong_secret.push(if last == 'A' { 'B' } else { 'A' });
    let unknown_id = format!("avm_{}{}", "0".repeat(24), &good[28..]);
    for bad in [
        "",
        "nonsense",
        "avm_short",
        wrong_secret.as_str(),
        unknown_id.as_str(),
        &good[..good.len() - 1],
    ] {
        let err = api_err(w.h.service.exchange_api_key(bad).await);
        assert_eq!(
            (err.code, err.reason.as_ref(), err.message.as_str()),
            (
                Code::Unauthenticated,
                "INVALID_API_KEY",
                "the API key is invalid, revoked or expired"
            ),
            "for {bad:?}"
        );
        // The canary: no part of the secret comes back.
        assert!(!err.message.contains(&good[29..]));
    }
    let token = w.h.service.exchange_api_key(good).await.unwrap();
    assert_eq!(token.principal.role, Role::Member);
    assert!(!token.principal.operator);
    assert_eq!(token.principal.scopes, Scopes::READ.union(Scopes::WRITE));
    assert_eq!(
        token.principal.tenant_limits.requests_per_minute, 600,
        "configured defaults"
    );
}

#[tokio::test]
async fn members_see_only_themselves_and_cannot_manage() {
    let w = world().await;
    let s = &w.h.service;
    let m = &w.a_member;
    assert_eq!(reason(s.create_tenant(m, "mine", None, "").await), "MISSING_SCOPE");
    assert_eq!(
        reason(s.create_tenant(&w.a_admin, "mine", None, "").await),
        "OPERATOR_REQUIRED",
        "tenant admins are not operators"
    );
    let tenants = s.list_tenants(m).await.unwrap();
    assert_eq!(tenants.len(), 1);
    assert_eq!(tenants[0].tenant_id, w.a.tenant.tenant_id);
    assert_eq!(reason(s.get_tenant(m, &w.b.tenant.tenant_id).await), "TENANT_NOT_FOUND");
    assert_eq!(s.get_user(m, &w.a_member_id).await.unwrap().user_id, w.a_member_id);
    assert_eq!(reason(s.get_user(m, &w.a.admin.user_id).await), "USER_NOT_FOUND");
    assert_eq!(reason(s.list_users(m, "").await), "MISSING_SCOPE");
    assert_eq!(reason(s.create_user(m, "", "x", Role::Member).await), "MISSING_SCOPE");

    let keys = s.list_api_keys(m, None).await.unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].key_id, w.a_member_key_id);
    assert_eq!(
        reason(s.list_api_keys(m, Some(&w.a.admin.user_id)).await),
        "USER_NOT_FOUND"
    );
    assert_eq!(
        reason(s.get_api_key(m, &w.a.api_key.api_key.key_id).await),
        "API_KEY_NOT_FOUND"
    );
    assert_eq!(
        reason(s.revoke_api_key(m, &w.a.api_key.api_key.key_id).await),
        "API_KEY_NOT_FOUND"
    );
    let admin_spec = ApiKeySpec {
        user_id: Some(w.a.admin.user_id.clone()),
        ..ApiKeySpec::default()
    };
    assert_eq!(reason(s.create_api_key(m, admin_spec).await), "MISSING_SCOPE");
    let update = TenantUpdate {
        name: Some("mine".into()),
        limits: None,
    };
    assert_eq!(
        reason(s.update_tenant(m, &w.a.tenant.tenant_id, update).await),
        "MISSING_SCOPE"
    );
    assert_eq!(reason(s.rotate_signing_key(m).await), "MISSING_SCOPE");
    assert_eq!(reason(s.watch_events(m).await.map(|_| ())), "SERVICE_REQUIRED");

    // A member manages their own keys, within their role.
    let own = ApiKeySpec {
        name: "ci".into(),
        scopes: vec!["read".into()],
        ..ApiKeySpec::default()
    };
    let created = s.create_api_key(m, own).await.unwrap();
    assert_eq!(created.api_key.scopes, Scopes::READ);
    assert_eq!(created.api_key.user_id, w.a_member_id);
    let too_much = ApiKeySpec {
        scopes: vec!["admin".into()],
        ..ApiKeySpec::default()
    };
    let err = api_err(s.create_api_key(m, too_much).await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::InvalidArgument, "SCOPE_NOT_ALLOWED")
    );
    let unknown = ApiKeySpec {
        scopes: vec!["root".into()],
        ..ApiKeySpec::default()
    };
    let err = api_err(s.create_api_key(m, unknown).await);
    assert_eq!(err.reason, "INVALID_SCOPE");
    assert!(err.message.contains("root"), "{}", err.message);

    // A read-only key reads but cannot make keys.
    let read_only = w.h.ctx(&created.secret).await;
    assert!(s.get_user(&read_only, &w.a_member_id).await.is_ok());
    assert_eq!(
        reason(s.create_api_key(&read_only, ApiKeySpec::default()).await),
        "MISSING_SCOPE"
    );
    s.revoke_api_key(m, &created.api_key.key_id).await.unwrap();
}

#[tokio::test]
async fn admins_manage_their_tenant_only() {
    let w = world().await;
    let s = &w.h.service;
    let admin = &w.a_admin;
    let users = s.list_users(admin, "").await.unwrap();
    assert_eq!(users.len(), 2);
    assert_eq!(users[0].name, "admin", "the first admin, oldest first");
    assert_eq!(s.list_api_keys(admin, None).await.unwrap().len(), 2);
    assert_eq!(
        s.list_api_keys(admin, Some(&w.a_member_id)).await.unwrap()[0].key_id,
        w.a_member_key_id
    );
    let renamed = TenantUpdate {
        name: Some("  tenant a2 ".into()),
        limits: None,
    };
    assert_eq!(
        s.update_tenant(admin, &w.a.tenant.tenant_id, renamed)
            .await
            .unwrap()
            .name,
        "tenant a2"
    );
    let limits = TenantUpdate {
        name: None,
        limits: Some(Limits::default()),
    };
    assert_eq!(
        reason(s.update_tenant(admin, &w.a.tenant.tenant_id, limits).await),
        "OPERATOR_REQUIRED",
        "limits change only by operators"
    );
    assert_eq!(
        reason(s.delete_user(admin, &w.a.admin.user_id).await),
        "CANNOT_DELETE_SELF"
    );
    assert_eq!(
        reason(s.create_user(admin, "", "x", Role::Service).await),
        "INVALID_ROLE"
    );
    assert_eq!(
        reason(s.create_user(admin, "", "   ", Role::Member).await),
        "INVALID_USER_NAME"
    );

    // Deleting the member revokes their keys: exchange and the token both stop.
    let member_token = w.a_member.clone();
    s.delete_user(admin, &w.a_member_id).await.unwrap();
    assert_eq!(reason(s.exchange_api_key(&w.a_member_key).await), "INVALID_API_KEY");
    assert_eq!(reason(s.caller(&member_token).await), "CREDENTIAL_REVOKED");
    assert_eq!(
        reason(s.get_api_key(admin, &w.a_member_key_id).await),
        "API_KEY_NOT_FOUND"
    );
}

#[tokio::test]
async fn operators_manage_every_tenant_but_their_own_stays() {
    let w = world().await;
    let s = &w.h.service;
    let op = w.h.operator().await;
    assert_eq!(s.list_tenants(&op).await.unwrap().len(), 3);
    assert_eq!(
        s.get_user(&op, &w.b_member_id).await.unwrap().tenant_id,
        w.b.tenant.tenant_id
    );
    assert_eq!(s.list_users(&op, &w.b.tenant.tenant_id).await.unwrap().len(), 2);
    let limits = Limits {
        requests_per_minute: 5,
        tokens_per_month: 50,
    };
    let update = TenantUpdate {
        name: None,
        limits: Some(limits),
    };
    assert_eq!(
        s.update_tenant(&op, &w.b.tenant.tenant_id, update)
            .await
            .unwrap()
            .limits,
        limits
    );
    let err = api_err(s.delete_tenant(&op, &w.h.admin.tenant_id).await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::FailedPrecondition, "OPERATOR_TENANT_PROTECTED")
    );
    let b_admin_key = w.b.api_key.secret.clone();
    let b_admin = w.h.ctx(&b_admin_key).await;
    s.delete_tenant(&op, &w.b.tenant.tenant_id).await.unwrap();
    assert_eq!(reason(s.exchange_api_key(&b_admin_key).await), "INVALID_API_KEY");
    assert_eq!(reason(s.caller(&b_admin).await), "CREDENTIAL_REVOKED");
    assert_eq!(
        reason(s.get_tenant(&op, &w.b.tenant.tenant_id).await),
        "TENANT_NOT_FOUND"
    );
    assert_eq!(reason(s.get_user(&op, &w.b_member_id).await), "USER_NOT_FOUND");
}

#[tokio::test]
async fn foreign_ids_answer_exactly_like_missing_ones() {
    let w = world().await;
    let s = &w.h.service;
    let b_tenant = w.b.tenant.tenant_id.as_str();
    let b_admin_id = w.b.admin.user_id.as_str();
    let b_key = w.b_member_key_id.as_str();
    let (no_tenant, no_user, no_key) = ("ten_00000000000000000000000000000000", "usr_missing", "key_missing");
    for ctx in [&w.a_admin, &w.a_member] {
        macro_rules! same {
            ($call:ident, $foreign:expr, $missing:expr $(, $rest:expr)*) => {{
                let foreign = api_err(s.$call(ctx, $foreign $(, $rest)*).await);
                let missing = api_err(s.$call(ctx, $missing $(, $rest)*).await);
                assert_same_answer(&foreign, $foreign, &missing, $missing);
            }};
        }
        same!(get_tenant, b_tenant, no_tenant);
        same!(get_usage_of, b_tenant, no_tenant);
        same!(get_user, b_admin_id, no_user);
        same!(get_user, w.b_member_id.as_str(), no_user);
        same!(get_api_key, b_key, no_key);
        same!(revoke_api_key, b_key, no_key);
        same!(delete_user, b_admin_id, no_user);
        same!(list_users, b_tenant, no_tenant);
        same!(create_user, b_tenant, no_tenant, "x", Role::Member);
        same!(delete_tenant, b_tenant, no_tenant);
        let rename = || TenantUpdate {
            name: Some("stolen".into()),
            limits: None,
        };
        same!(update_tenant, b_tenant, no_tenant, rename());
        let foreign = api_err(s.list_api_keys(ctx, Some(b_admin_id)).await);
        let missing = api_err(s.list_api_keys(ctx, Some(no_user)).await);
        assert_same_answer(&foreign, b_admin_id, &missing, no_user);
        let spec = |user: &str| ApiKeySpec {
            user_id: Some(user.to_owned()),
            ..ApiKeySpec::default()
        };
        let foreign = api_err(s.create_api_key(ctx, spec(b_admin_id)).await);
        let missing = api_err(s.create_api_key(ctx, spec(no_user)).await);
        assert_same_answer(&foreign, b_admin_id, &missing, no_user);
    }
    // Nothing of tenant b changed.
    let op = w.h.operator().await;
    assert_eq!(s.get_tenant(&op, b_tenant).await.unwrap().name, "tenant b");
    assert_eq!(s.list_users(&op, b_tenant).await.unwrap().len(), 2);
    assert_eq!(s.get_api_key(&op, b_key).await.unwrap().revoked_at_ms, None);
}

/// `usage` under a name the `same!` macro can tell from `get_user`.
trait UsageOf {
    async fn get_usage_of(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
    ) -> Result<avm_auth::UsageRecord, avm_auth::AuthError>;
}

impl UsageOf for avm_auth::AuthService {
    async fn get_usage_of(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
    ) -> Result<avm_auth::UsageRecord, avm_auth::AuthError> {
        self.usage(ctx, tenant_id).await
    }
}

#[tokio::test]
async fn keys_expire() {
    let w = world().await;
    let s = &w.h.service;
    let expires_at_ms = avm_common::now_ms() + 1_500;
    let spec = ApiKeySpec {
        name: "short".into(),
        expires_at_ms: Some(expires_at_ms),
        ..ApiKeySpec::default()
    };
    let key = s.create_api_key(&w.a_member, spec).await.unwrap();
    assert_eq!(key.api_key.expires_at_ms, Some(expires_at_ms));
    let token = s.exchange_api_key(&key.secret).await.unwrap();
    assert!(
        token.expires_at_ms <= expires_at_ms + 1_000,
        "a token never outlives its key by more than rounding"
    );
    let past = ApiKeySpec {
        expires_at_ms: Some(avm_common::now_ms() - 1),
        ..ApiKeySpec::default()
    };
    assert_eq!(reason(s.create_api_key(&w.a_member, past).await), "INVALID_EXPIRY");
    let refused = eventually(Duration::from_secs(10), "the key to expire", || async {
        s.exchange_api_key(&key.secret).await.err()
    })
    .await;
    assert_eq!(avm_common::ApiError::from(refused).reason, "INVALID_API_KEY");
}

#[tokio::test]
async fn dev_key_replaces_the_previous_one() {
    let h = Harness::sqlite().await;
    let first = h.service.dev_key().await.unwrap();
    let second = h.service.dev_key().await.unwrap();
    assert_ne!(first, second);
    assert_eq!(reason(h.service.exchange_api_key(&first).await), "INVALID_API_KEY");
    let dev = h.service.exchange_api_key(&second).await.unwrap().principal;
    assert_eq!(dev.role, Role::Admin);
    assert!(!dev.operator, "the dev tenant is not the operator tenant");
    let tenants = h.service.list_tenants(&h.operator().await).await.unwrap();
    assert_eq!(tenants.iter().filter(|t| t.name == "dev").count(), 1);
}

#[tokio::test]
async fn service_principals_act_for_any_tenant() {
    let w = world().await;
    let s = &w.h.service;
    let service = w.h.ctx(crate::support::SERVICE_KEY).await;
    assert_eq!(service.principal.role, Role::Service);
    assert_eq!(service.tenant_id, avm_auth::SERVICE_TENANT);
    assert_eq!(service.principal.key_id, None);
    assert_eq!(
        s.get_tenant(&service, &w.b.tenant.tenant_id).await.unwrap().name,
        "tenant b"
    );
    let caller = s.caller(&service).await.unwrap();
    assert_eq!(caller.role, Role::Service);
    // A key that starts with the service key is not the service key.
    let near = format!("{}x", crate::support::SERVICE_KEY);
    assert_eq!(reason(s.exchange_api_key(&near).await), "INVALID_API_KEY");
}
