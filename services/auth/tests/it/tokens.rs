//! Access tokens: what the verifier accepts, every forgery it refuses, and
//! signing-key rotation.

use std::time::Duration;

use avm_common::auth::{AUDIENCE, Claims, Role};
use avm_common::{ApiError, Code};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::support::{Harness, config};

/// PKCS#8 header of an Ed25519 private key; a 32-byte seed follows.
const ED25519_PKCS8_HEADER: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

fn ed25519_key(seed: u8) -> EncodingKey {
    let mut der = ED25519_PKCS8_HEADER.to_vec();
    der.extend_from_slice(&[seed; 32]);
    EncodingKey::from_ed_der(&der)
}

fn kid_of(token: &str) -> String {
    jsonwebtoken::decode_header(token).unwrap().kid.unwrap()
}

fn sign(kid: &str, claims: &Value, key: &EncodingKey) -> String {
    let mut header = Header::new(Algorithm::EdDSA);
    header.kid = Some(kid.to_owned());
    jsonwebtoken::encode(&header, claims, key).unwrap()
}

fn b64(value: &Value) -> String {
    URL_SAFE_NO_PAD.encode(serde_json::to_vec(value).unwrap())
}

async fn refused(h: &Harness, token: &str, what: &str) -> ApiError {
    match h.service.verifier().verify(token).await {
        Ok(principal) => panic!("{what}: forged token accepted as {principal:?}"),
        Err(err) => {
            assert_eq!(err.code, Code::Unauthenticated, "{what}: {err:?}");
            err
        }
    }
}

#[tokio::test]
async fn forged_tokens_are_refused() {
    let h = Harness::sqlite().await;
    let real = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    let kid = kid_of(&real.token);
    let stored = h.db.store.current_signing_key().await.unwrap().unwrap();
    assert_eq!(stored.kid, kid);
    let real_key = EncodingKey::from_ed_der(crate::support::seal().open(&stored).unwrap().pkcs8_der());
    let now = avm_common::now_ms() as u64 / 1000;
    let claims = serde_json::to_value(Claims::new(&real.principal, "agentvm", now, Duration::from_secs(600))).unwrap();
    let with = |field: &str, value: Value| {
        let mut claims = claims.clone();
        claims[field] = value;
        claims
    };

    // The control: the real key and honest claims pass.
    let honest = sign(&kid, &claims, &real_key);
    assert_eq!(h.service.verifier().verify(&honest).await.unwrap(), real.principal);

    let none = format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT", "kid": kid})),
        b64(&claims)
    );
    refused(&h, &none, "alg none").await;

    let jwks: JwkSet = serde_json::from_str(&h.service.jwks_json().await.unwrap()).unwrap();
    let public = serde_json::to_vec(&jwks.keys[0]).unwrap();
    let mut hs = Header::new(Algorithm::HS256);
    hs.kid = Some(kid.clone());
    let confused = jsonwebtoken::encode(&hs, &claims, &EncodingKey::from_secret(&public)).unwrap();
    refused(&h, &confused, "HS256 with the public key").await;

    refused(
        &h,
        &sign("sk_0000000000000000", &claims, &ed25519_key(7)),
        "unknown kid",
    )
    .await;
    refused(&h, &sign(&kid, &claims, &ed25519_key(7)), "wrong key, real kid").await;
    let expired = refused(&h, &sign(&kid, &with("exp", json!(now - 3600)), &real_key), "expired").await;
    assert_eq!(expired.reason, "TOKEN_EXPIRED");
    refused(
        &h,
        &sign(&kid, &with("nbf", json!(now + 3600)), &real_key),
        "nbf in the future",
    )
    .await;
    refused(
        &h,
        &sign(&kid, &with("aud", json!("someone-else")), &real_key),
        "wrong aud",
    )
    .await;
    refused(&h, &sign(&kid, &with("iss", json!("evil")), &real_key), "wrong iss").await;
    refused(
        &h,
        &sign(&kid, &with("nbf", json!(now.to_string())), &real_key),
        "nbf as a string",
    )
    .await;
    refused(
        &h,
        &sign(&kid, &with("jti", json!("x".repeat(9 * 1024))), &real_key),
        "over 8 KiB",
    )
    .await;

    let parts: Vec<&str> = honest.split('.').collect();
    let impersonated = with("sub", json!("usr_someone_else"));
    let tampered = format!("{}.{}.{}", parts[0], b64(&with("tid", json!("ten_other"))), parts[2]);
    refused(&h, &tampered, "tampered payload").await;
    let tampered = format!("{}.{}.{}", parts[0], b64(&impersonated), parts[2]);
    refused(&h, &tampered, "tampered subject").await;
    assert_eq!(claims["aud"], AUDIENCE);
}

#[tokio::test]
async fn rotation_keeps_old_tokens_valid_and_signs_new_ones_with_the_new_key() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let tenant = h.service.create_tenant(&op, "t", None, "").await.unwrap();
    let tenant_admin = h.ctx(&tenant.api_key.secret).await;
    let before = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    let old_kid = kid_of(&before.token);

    let new_kid = h.service.rotate_signing_key(&op).await.unwrap();
    assert_ne!(new_kid, old_kid);
    let after = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    assert_eq!(kid_of(&after.token), new_kid);

    // A verifier that never saw either key fetches them from the JWKS.
    let fresh = avm_common::auth::TokenVerifier::new(
        &config(),
        std::sync::Arc::new(avm_common::auth::AuthKeySource::new(
            avm_proto::auth::v1::AuthServiceRemote::new(h.channel(), usize::MAX).handle(),
        )),
    );
    assert_eq!(fresh.verify(&before.token).await.unwrap().role, Role::Admin);
    assert_eq!(fresh.verify(&after.token).await.unwrap().role, Role::Admin);
    let jwks: JwkSet = serde_json::from_str(&h.service.jwks_json().await.unwrap()).unwrap();
    let mut kids: Vec<_> = jwks.keys.iter().filter_map(|k| k.common.key_id.clone()).collect();
    kids.sort();
    let mut expected = vec![old_kid, new_kid];
    expected.sort();
    assert_eq!(kids, expected, "the retired key stays published while its tokens live");
    assert!(
        !h.service.jwks_json().await.unwrap().contains("\"d\""),
        "no private part"
    );

    assert_eq!(
        crate::support::reason(h.service.rotate_signing_key(&tenant_admin).await),
        "OPERATOR_REQUIRED"
    );
}

#[tokio::test]
async fn an_old_signing_key_is_replaced_at_the_next_mint() {
    let mut settings = config();
    settings.key_rotation = Duration::ZERO;
    let h = Harness::start(crate::support::TestDb::sqlite().await, settings).await;
    let first = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    let second = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    assert_ne!(
        kid_of(&first.token),
        kid_of(&second.token),
        "a due key rotates before signing"
    );
    assert!(h.service.verifier().verify(&first.token).await.is_ok());
    assert!(h.service.verifier().verify(&second.token).await.is_ok());
}

/// Issue 26 item 15: the Ed25519 signing keys lie in the database sealed, never
/// as plain PKCS#8 a database reader could sign with; a key an earlier version
/// stored plain is sealed when the service starts, and the current one among
/// them is replaced, its tokens still verifying until they expire.
#[tokio::test]
async fn signing_keys_are_sealed_at_rest_and_plain_ones_are_sealed_at_start() {
    let db = crate::support::TestDb::sqlite().await;
    // As an earlier version stored it: the private half in the clear.
    let plain = avm_common::auth::SigningKey::generate().unwrap();
    let record = avm_auth::SigningKeyRecord {
        kid: plain.kid().to_owned(),
        private_key: plain.pkcs8_der().to_vec(),
        public_jwk: serde_json::to_string(plain.public_jwk()).unwrap(),
        created_at_ms: avm_common::now_ms(),
        retired_at_ms: None,
    };
    db.store
        .insert_signing_key(&record, record.created_at_ms)
        .await
        .unwrap();
    let principal = avm_common::auth::Principal {
        tenant_id: "ten_1".into(),
        user_id: "usr_1".into(),
        role: Role::Admin,
        operator: false,
        key_id: None,
        scopes: avm_common::auth::Scopes::ALL,
        tenant_limits: avm_common::auth::Limits::default(),
        key_limits: avm_common::auth::Limits::default(),
    };
    let now = avm_common::now_ms() as u64 / 1000;
    let earlier = plain
        .sign(&Claims::new(&principal, "agentvm", now, Duration::from_secs(600)))
        .unwrap();

    let h = Harness::start(db, config()).await;
    let stored = h.db.store.signing_keys().await.unwrap();
    assert_eq!(stored.len(), 2, "the plain key and its replacement: {stored:?}");
    let seal = crate::support::seal();
    for key in &stored {
        assert_ne!(
            key.private_key.first(),
            Some(&0x30),
            "{} is stored as plain PKCS#8 (a DER sequence)",
            key.kid
        );
        assert!(
            !key.private_key.windows(32).any(|w| plain.pkcs8_der().ends_with(w)),
            "the old key's seed is not in the row"
        );
        assert!(seal.open(key).is_ok(), "{} opens under the deployment's key", key.kid);
    }
    let current = h.db.store.current_signing_key().await.unwrap().unwrap();
    assert_ne!(current.kid, plain.kid(), "the key that lay in the clear signs no more");
    let minted = h.service.exchange_api_key(&h.admin.secret).await.unwrap();
    assert_eq!(kid_of(&minted.token), current.kid);
    assert!(h.service.verifier().verify(&minted.token).await.is_ok());
    assert!(
        h.service.verifier().verify(&earlier).await.is_ok(),
        "tokens of the replaced key verify until they expire"
    );
    // Another deployment key cannot open them: the service refuses to start.
    let wrong = avm_auth::KeySeal::new("another-seal-key-0123456789abcdef0123456789").unwrap();
    let refused = avm_auth::AuthService::new(h.db.store.clone(), config(), wrong)
        .await
        .err();
    assert_eq!(refused.map(|err| err.reason).as_deref(), Some("SIGNING_KEY_UNREADABLE"));
}

/// Issue 26 item 15: a token claiming `op` for the admin of an ordinary tenant
/// is refused by the auth service even when the real key signed it: every
/// auth RPC checks the claim against the tenant, so a token never reaches
/// further than the user it names.
#[tokio::test]
async fn an_operator_claim_the_tenant_does_not_back_is_refused() {
    let h = Harness::sqlite().await;
    let op = h.operator().await;
    let tenant = h.service.create_tenant(&op, "ordinary", None, "").await.unwrap();
    let honest = h.service.exchange_api_key(&tenant.api_key.secret).await.unwrap();
    assert!(!honest.principal.operator);
    let stored = h.db.store.current_signing_key().await.unwrap().unwrap();
    let key = crate::support::seal().open(&stored).unwrap();
    let now = avm_common::now_ms() as u64 / 1000;
    let mut claims = Claims::new(&honest.principal, "agentvm", now, Duration::from_secs(600));
    claims.op = true;
    let claimed = key.sign(&claims).unwrap();
    let principal = h.service.verifier().verify(&claimed).await.unwrap();
    assert!(principal.operator, "the signature is the real key's");
    let ctx = avm_common::RequestContext::new(
        principal,
        Some(std::sync::Arc::from(claimed.as_str())),
        "req_op".to_owned(),
    );
    assert_eq!(
        crate::support::reason(h.service.list_tenants(&ctx).await),
        "CREDENTIAL_REVOKED"
    );
    assert_eq!(
        crate::support::reason(h.service.create_tenant(&ctx, "mine", None, "").await),
        "CREDENTIAL_REVOKED"
    );
    // The operator's own token passes the same check.
    assert!(h.service.list_tenants(&op).await.unwrap().len() >= 2);
}
