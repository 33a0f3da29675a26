//! The gRPC adapter over a real listener and the generated client.

use avm_common::auth::{AuthKeySource, TokenVerifier};
use avm_common::{ApiError, Code};
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceRemote;

use crate::support::{Harness, assert_same_answer, config};

#[tokio::test]
async fn grpc_round_trip_with_bearer_tokens_and_typed_errors() {
    let h = Harness::sqlite().await;
    let mut client = h.client().await;

    // Open RPCs need no token.
    let jwks = client.get_jwks(pb::GetJwksRequest {}).await.unwrap().into_inner();
    assert!(jwks.jwks_json.contains("\"kid\""));
    let exchanged = client
        .exchange_api_key(pb::ExchangeApiKeyRequest {
            api_key: h.admin.secret.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let caller = exchanged.caller.unwrap();
    assert_eq!(
        (caller.role, caller.operator, caller.key_id.as_deref()),
        (pb::Role::Admin as i32, true, Some(h.admin.key_id.as_str()))
    );
    assert!(exchanged.expires_at_ms > avm_common::now_ms());
    let verifier = TokenVerifier::new(
        &config(),
        std::sync::Arc::new(AuthKeySource::new(
            AuthServiceRemote::new(h.channel(), usize::MAX).handle(),
        )),
    );
    let op = verifier.verify(&exchanged.access_token).await.unwrap();
    let op = avm_common::RequestContext::new(op, Some(exchanged.access_token.as_str().into()), "req_grpc".into());

    // Everything else does.
    let status = client.list_tenants(pb::ListTenantsRequest {}).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let mut garbage = tonic::Request::new(pb::ListTenantsRequest {});
    garbage
        .metadata_mut()
        .insert("authorization", "Bearer not-a-token".parse().unwrap());
    let status = client.list_tenants(garbage).await.unwrap_err();
    assert_eq!(ApiError::from_status(&status).reason, "INVALID_TOKEN");

    let created = client
        .create_tenant(op.request(pb::CreateTenantRequest {
            name: "acme".into(),
            limits: Some(pb::Limits {
                requests_per_minute: 60,
                tokens_per_month: 1000,
            }),
            admin_name: "root".into(),
        }))
        .await
        .unwrap()
        .into_inner();
    let tenant = created.tenant.unwrap();
    let admin = created.admin.unwrap();
    let key = created.api_key.unwrap();
    assert_eq!((admin.name.as_str(), admin.role), ("root", pb::Role::Admin as i32));
    assert!(created.secret.starts_with(&key.prefix) && key.prefix.len() == 12);
    assert_eq!(key.scopes, ["read", "write", "admin"]);
    assert_eq!(tenant.limits.unwrap().tokens_per_month, 1000);

    let listed = client
        .list_tenants(op.request(pb::ListTenantsRequest {}))
        .await
        .unwrap()
        .into_inner()
        .tenants;
    assert_eq!(listed.len(), 2);
    assert!(listed[0].operator, "oldest first: the operator tenant");

    // The new tenant's admin: a member, and a foreign id that reads like a missing one.
    let acme = h.ctx(&created.secret).await;
    let user = client
        .create_user(acme.request(pb::CreateUserRequest {
            tenant_id: String::new(),
            name: "mia".into(),
            role: pb::Role::Unspecified as i32,
        }))
        .await
        .unwrap()
        .into_inner()
        .user
        .unwrap();
    assert_eq!(user.role, pb::Role::Member as i32, "unspecified means member");
    let foreign = client
        .get_tenant(acme.request(pb::GetTenantRequest {
            tenant_id: h.admin.tenant_id.clone(),
        }))
        .await
        .unwrap_err();
    let missing = client
        .get_tenant(acme.request(pb::GetTenantRequest {
            tenant_id: "ten_missing".into(),
        }))
        .await
        .unwrap_err();
    let (foreign, missing) = (ApiError::from_status(&foreign), ApiError::from_status(&missing));
    assert_eq!(foreign.code, Code::NotFound);
    assert_same_answer(&foreign, &h.admin.tenant_id, &missing, "ten_missing");

    let member_key = client
        .create_api_key(acme.request(pb::CreateApiKeyRequest {
            user_id: user.user_id.clone(),
            name: "mia's".into(),
            scopes: vec![],
            expires_at_ms: None,
            limits: None,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(member_key.api_key.as_ref().unwrap().scopes, ["read", "write"]);
    let mia = h.ctx(&member_key.secret).await;
    let me = client
        .get_caller(mia.request(pb::GetCallerRequest {}))
        .await
        .unwrap()
        .into_inner()
        .caller
        .unwrap();
    assert_eq!(
        (me.user_id.as_str(), me.role),
        (user.user_id.as_str(), pb::Role::Member as i32)
    );
    assert_eq!(me.tenant_limits.unwrap().requests_per_minute, 60);
    let status = client
        .delete_tenant(mia.request(pb::DeleteTenantRequest {
            tenant_id: tenant.tenant_id.clone(),
        }))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied);

    let revoked = client
        .revoke_api_key(acme.request(pb::RevokeApiKeyRequest {
            key_id: member_key.api_key.unwrap().key_id,
        }))
        .await
        .unwrap()
        .into_inner()
        .api_key
        .unwrap();
    assert!(revoked.revoked_at_ms.is_some());
    let status = client
        .get_caller(mia.request(pb::GetCallerRequest {}))
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&status).reason, "CREDENTIAL_REVOKED");
    let status = client
        .exchange_api_key(pb::ExchangeApiKeyRequest {
            api_key: member_key.secret.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(ApiError::from_status(&status).reason, "INVALID_API_KEY");
    assert!(
        !status.message().contains(&member_key.secret[29..]),
        "no secret in errors"
    );

    let usage = client
        .get_usage(acme.request(pb::GetUsageRequest {
            tenant_id: String::new(),
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((usage.tokens_used, usage.tokens_per_month), (0, 1000));
    let kid = client
        .rotate_signing_key(op.request(pb::RotateSigningKeyRequest {}))
        .await
        .unwrap()
        .into_inner()
        .kid;
    assert!(kid.starts_with("sk_"));
}
