//! `ExchangeExternalToken` against a mock issuer whose JWKS an axum server
//! serves on a `bind(0)` port, signing with a committed test-only RSA key.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use avm_auth::AuthService;
use avm_common::auth::{OidcConfig, Role};
use avm_common::{ApiError, Code};
use avm_proto::auth::v1 as pb;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::support::{Harness, TestDb, config, reason};

const ISSUER: &str = "https://issuer.test";
const AUDIENCE: &str = "agentvm-test";
const KID: &str = "test-rsa";

/// Returns the committed test-only RSA key (PKCS#1 DER).
fn test_rsa_key() -> EncodingKey {
    let pem = include_str!("../fixtures/oidc-test-rsa-key.pem");
    let body: String = pem
        .lines()
        .skip_while(|line| !line.starts_with("-----BEGIN"))
        .skip(1)
        .take_while(|line| !line.starts_with("-----END"))
        .collect();
    EncodingKey::from_rsa_der(&STANDARD.decode(body).unwrap())
}

/// A mock issuer: its JWKS url and how often it was fetched.
struct Issuer {
    jwks_url: String,
    fetches: Arc<AtomicUsize>,
    key: EncodingKey,
    _server: tokio::task::JoinHandle<()>,
}

async fn issuer() -> Issuer {
    let key = test_rsa_key();
    let mut jwk = Jwk::from_encoding_key(&key, Algorithm::RS256).unwrap();
    jwk.common.key_id = Some(KID.to_owned());
    let body = serde_json::to_string(&JwkSet { keys: vec![jwk] }).unwrap();
    let fetches = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&fetches);
    let app = axum::Router::new().route(
        "/jwks.json",
        axum::routing::get(move || {
            counter.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            async move { ([(axum::http::header::CONTENT_TYPE, "application/json")], body) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Issuer {
        jwks_url: format!("http://{addr}/jwks.json"),
        fetches,
        key,
        _server: server,
    }
}

fn oidc_config(jwks_url: &str, algorithms: &[&str]) -> OidcConfig {
    OidcConfig {
        issuer: ISSUER.to_owned(),
        jwks_url: jwks_url.to_owned(),
        audience: AUDIENCE.to_owned(),
        algorithms: algorithms.iter().map(|a| (*a).to_owned()).collect(),
        tenant_claim: "tenant_id".to_owned(),
        role_claim: "role".to_owned(),
    }
}

fn claims(tenant_id: &str, sub: &str) -> Value {
    let now = avm_common::now_ms() / 1000;
    json!({
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": sub,
        "tenant_id": tenant_id,
        "name": "Alice Example",
        "iat": now,
        "nbf": now - 10,
        "exp": now + 600,
    })
}

fn rs256(claims: &Value, kid: &str, key: &EncodingKey) -> String {
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(kid.to_owned());
    jsonwebtoken::encode(&header, claims, key).unwrap()
}

#[tokio::test]
async fn external_tokens_are_exchanged_and_users_provisioned_once() {
    let issuer = issuer().await;
    let mut settings = config();
    settings.oidc = Some(oidc_config(&issuer.jwks_url, &["RS256"]));
    let h = Harness::start(TestDb::sqlite().await, settings).await;
    let op = h.operator().await;
    let tenant = h.service.create_tenant(&op, "sso", None, "").await.unwrap().tenant;
    let tenant_id = tenant.tenant_id.as_str();

    let mut admin_claims = claims(tenant_id, "alice");
    admin_claims["role"] = json!("admin");
    let token = h
        .service
        .exchange_external_token(&rs256(&admin_claims, KID, &issuer.key))
        .await
        .unwrap();
    let principal = h.service.verifier().verify(&token.token).await.unwrap();
    assert_eq!((principal.tenant_id.as_str(), principal.role), (tenant_id, Role::Admin));
    assert!(!principal.operator);
    assert_eq!(principal.key_id, None);
    assert_eq!(principal.tenant_limits, tenant.limits);
    let ctx = h.ctx(&h.admin.secret).await;
    let alice = h.service.get_user(&ctx, &principal.user_id).await.unwrap();
    assert_eq!(alice.name, "Alice Example");

    // The same subject is the same user; over gRPC too.
    let mut client = h.client().await;
    let again = client
        .exchange_external_token(pb::ExchangeExternalTokenRequest {
            subject_token: rs256(&admin_claims, KID, &issuer.key),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.caller.unwrap().user_id, principal.user_id);
    let bob = h
        .service
        .exchange_external_token(&rs256(&claims(tenant_id, "bob"), KID, &issuer.key))
        .await
        .unwrap();
    assert_eq!(bob.principal.role, Role::Member, "no role claim means member");
    assert_ne!(bob.principal.user_id, principal.user_id);

    let now = avm_common::now_ms() / 1000;
    let with = |field: &str, value: Value| {
        let mut claims = claims(tenant_id, "carol");
        claims[field] = value;
        claims
    };
    let mut no_nbf = claims(tenant_id, "carol");
    no_nbf.as_object_mut().unwrap().remove("nbf");
    let none_header = json!({"alg": "none", "typ": "JWT", "kid": KID});
    let b64 = |v: &Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap());
    let alg_none = format!("{}.{}.", b64(&none_header), b64(&claims(tenant_id, "carol")));
    let mut hs_header = Header::new(Algorithm::HS256);
    hs_header.kid = Some(KID.to_owned());
    let hs256 = jsonwebtoken::encode(&hs_header, &claims(tenant_id, "carol"), &EncodingKey::from_secret(b"x")).unwrap();
    let forged = [
        ("wrong aud", rs256(&with("aud", json!("other")), KID, &issuer.key)),
        (
            "wrong iss",
            rs256(&with("iss", json!("https://evil.test")), KID, &issuer.key),
        ),
        ("expired", rs256(&with("exp", json!(now - 3600)), KID, &issuer.key)),
        ("future nbf", rs256(&with("nbf", json!(now + 3600)), KID, &issuer.key)),
        (
            "nbf as a string",
            rs256(&with("nbf", json!((now + 3600).to_string())), KID, &issuer.key),
        ),
        (
            "unknown tenant",
            rs256(&with("tenant_id", json!("ten_nope")), KID, &issuer.key),
        ),
        ("unknown role", rs256(&with("role", json!("root")), KID, &issuer.key)),
        ("alg none", alg_none),
        ("hs256", hs256),
        (
            "unknown kid",
            rs256(&claims(tenant_id, "carol"), "other-kid", &issuer.key),
        ),
        (
            "unknown kid again",
            rs256(&claims(tenant_id, "carol"), "third-kid", &issuer.key),
        ),
    ];
    // Issuers that send no `nbf` (Google, Auth0) are accepted.
    let carol = h
        .service
        .exchange_external_token(&rs256(&no_nbf, KID, &issuer.key))
        .await
        .unwrap();
    assert_eq!(carol.principal.tenant_id, tenant_id);
    for (what, token) in forged {
        let err = crate::support::api_err(h.service.exchange_external_token(&token).await);
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::Unauthenticated, "INVALID_EXTERNAL_TOKEN"),
            "{what}"
        );
    }
    assert!(
        issuer.fetches.load(Ordering::SeqCst) <= 3,
        "unknown kids refetch at most once a second, fetched {}",
        issuer.fetches.load(Ordering::SeqCst)
    );
    let users = h.service.list_users(&ctx, tenant_id).await.unwrap();
    assert_eq!(
        users.len(),
        4,
        "the admin, alice, bob and carol: refused tokens provision nobody"
    );
}

#[tokio::test]
async fn oidc_needs_configuration_and_safe_algorithms() {
    let h = Harness::sqlite().await;
    let err = crate::support::api_err(h.service.exchange_external_token("a.b.c").await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::FailedPrecondition, "OIDC_NOT_CONFIGURED")
    );
    for algorithms in [&["HS256"][..], &["none"], &[], &["RS256", "HS512"]] {
        let mut settings = config();
        settings.oidc = Some(oidc_config("http://127.0.0.1:9/jwks.json", algorithms));
        let db = TestDb::sqlite().await;
        let refused: ApiError = match AuthService::new(db.store.clone(), settings, crate::support::seal()).await {
            Ok(_) => panic!("{algorithms:?} accepted"),
            Err(err) => err,
        };
        assert_eq!(refused.reason, "OIDC_ALGORITHM_NOT_ALLOWED", "{algorithms:?}");
    }
    let mut weak = config();
    weak.service_key = avm_common::config::Secret::new("short");
    let db = TestDb::sqlite().await;
    let refused = AuthService::new(db.store.clone(), weak, crate::support::seal())
        .await
        .err()
        .map(|e| e.reason);
    assert_eq!(refused.as_deref(), Some("WEAK_SERVICE_KEY"));
    assert_eq!(reason(h.service.exchange_api_key("").await), "INVALID_API_KEY");
}
