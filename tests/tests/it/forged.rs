//! The forged-token matrix at the public edges: every forgery of an access
//! token is refused at REST (401, a JSON error, `WWW-Authenticate`), at the
//! WebSocket handshake (`?token=` or `Authorization`: HTTP 401) and directly
//! at each gRPC service (UNAUTHENTICATED), and no refusal echoes the token.
//! The same claims correctly signed are accepted, so the matrix proves the
//! forgeries, not a broken setup.

use std::time::{Duration, Instant};

use anyhow::Context;
use avm_common::auth::{Claims, Limits, Principal, Role, Scopes, SigningKey};
use avm_proto::auth::v1 as au;
use avm_proto::auth::v1::auth_service_client::AuthServiceClient;
use avm_proto::runtime::v1 as rt;
use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use avm_proto::session::v1 as ss;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_tests::accounts::{Tenant, create_key, create_tenant};
use avm_tests::cluster::{Cluster, Mode, http_client};
use avm_tests::ws_client::WsClient;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::both_modes;
use crate::support::cluster;

/// A made-up RSA key (the OIDC tests' fixture), for RS256 forgeries.
const RSA_KEY: &str = include_str!("../../../services/auth/tests/fixtures/oidc-test-rsa-key.pem");

/// How long a revoked key's token may keep working: the promise is 1 s; the
/// rest absorbs a loaded two-core machine running both cluster modes.
const REVOCATION_DEADLINE: Duration = Duration::from_secs(3);

both_modes!(forged_tokens_are_refused_at_every_edge, forged_tokens);

/// How a credential reaches the server.
#[derive(Clone, Debug)]
enum Presented {
    /// `Authorization: Bearer <token>`, or `?token=<token>` at the WebSocket.
    Bearer(String),
    /// A whole `Authorization` header value of another form.
    Header(String),
}

impl Presented {
    fn header(&self) -> String {
        match self {
            Presented::Bearer(token) => format!("Bearer {token}"),
            Presented::Header(value) => value.clone(),
        }
    }

    /// Returns the pieces of the credential that an answer must never contain.
    fn pieces(&self) -> Vec<&str> {
        let text = match self {
            Presented::Bearer(token) => token.as_str(),
            Presented::Header(value) => value.as_str(),
        };
        let mut pieces: Vec<&str> = text.split(['.', ' ']).filter(|piece| piece.len() >= 8).collect();
        pieces.push(text);
        pieces
    }
}

/// A forgery, with the reason it must be refused with.
struct Forgery {
    name: &'static str,
    presented: Presented,
    reason: &'static str,
}

async fn forged_tokens(mode: Mode) -> anyhow::Result<()> {
    let started = Instant::now();
    let cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "forged", None).await?;
    let elsewhere = create_tenant(&cluster, "elsewhere", None).await?;
    let signing = cluster.signing_key().await?;
    let kid = signing.kid().to_owned();
    let real = EncodingKey::from_ed_der(signing.pkcs8_der());

    // Honest claims of a real principal: the tenant's admin.
    let principal = Principal {
        tenant_id: tenant.tenant_id.clone(),
        user_id: tenant.admin.user_id.clone(),
        role: Role::Admin,
        operator: false,
        key_id: Some(tenant.admin.key_id.clone()),
        scopes: Scopes::ALL,
        tenant_limits: Limits::default(),
        key_limits: Limits::default(),
    };
    let now = u64::try_from(avm_common::now_ms() / 1000)?;
    let claims = serde_json::to_value(Claims::new(&principal, "agentvm", now, Duration::from_secs(600)))?;
    let with = |changes: Value| {
        let mut claims = claims.clone();
        if let (Some(claims), Some(changes)) = (claims.as_object_mut(), changes.as_object()) {
            claims.extend(changes.clone());
        }
        claims
    };

    // The control: the same claims, correctly signed, are accepted everywhere.
    let honest = sign(Algorithm::EdDSA, Some(&kid), &claims, &real)?;
    accepted(&cluster, &tenant, &honest).await?;
    let honest_by_the_key = signing.sign(&Claims::new(&principal, "agentvm", now, Duration::from_secs(600)))?;
    accepted(&cluster, &tenant, &honest_by_the_key).await?;

    let jwks: JwkSet = http_client(&cluster.admin_key)?
        .get(cluster.url("/v1/auth/jwks.json"))
        .send()
        .await?
        .json()
        .await?;
    let public = jwks
        .keys
        .iter()
        .find(|jwk| jwk.common.key_id.as_deref() == Some(kid.as_str()))
        .context("the signing key is published")?;
    let raw_public = match &public.algorithm {
        AlgorithmParameters::OctetKeyPair(okp) => URL_SAFE_NO_PAD.decode(&okp.x)?,
        other => anyhow::bail!("the signing key is not an Ed25519 JWK: {other:?}"),
    };
    let other_key = SigningKey::generate()?;
    let other_ed25519 = EncodingKey::from_ed_der(other_key.pkcs8_der());
    let rsa = rsa_key()?;
    let [head, _, signature] = honest.split('.').collect::<Vec<_>>()[..] else {
        anyhow::bail!("a JWT has three parts: {honest}");
    };
    let tampered = format!(
        "{head}.{}.{signature}",
        b64(&with(json!({"tid": elsewhere.tenant_id})))?
    );
    let oversized = sign(
        Algorithm::EdDSA,
        Some(&kid),
        &with(json!({"jti": "x".repeat(7 * 1024)})),
        &real,
    )?;
    anyhow::ensure!(
        oversized.len() > 8 * 1024,
        "the oversized token has {} bytes",
        oversized.len()
    );

    let bearer = |name, token: String, reason| Forgery {
        name,
        presented: Presented::Bearer(token),
        reason,
    };
    let invalid = "INVALID_TOKEN";
    let forgeries = vec![
        bearer(
            "alg none",
            format!(
                "{}.{}.",
                b64(&json!({"alg": "none", "typ": "JWT", "kid": kid}))?,
                b64(&claims)?
            ),
            invalid,
        ),
        bearer(
            "HS256 keyed with the public key's bytes",
            sign(
                Algorithm::HS256,
                Some(&kid),
                &claims,
                &EncodingKey::from_secret(&raw_public),
            )?,
            invalid,
        ),
        bearer(
            "HS256 keyed with the public JWK",
            sign(
                Algorithm::HS256,
                Some(&kid),
                &claims,
                &EncodingKey::from_secret(&serde_json::to_vec(public)?),
            )?,
            invalid,
        ),
        bearer(
            "RS256 with a made-up RSA key",
            sign(Algorithm::RS256, Some(&kid), &claims, &rsa)?,
            invalid,
        ),
        bearer(
            "another Ed25519 key under the real kid",
            sign(Algorithm::EdDSA, Some(&kid), &claims, &other_ed25519)?,
            invalid,
        ),
        bearer(
            "an unknown kid",
            sign(Algorithm::EdDSA, Some(other_key.kid()), &claims, &real)?,
            invalid,
        ),
        bearer("no kid", sign(Algorithm::EdDSA, None, &claims, &real)?, invalid),
        bearer(
            "expired",
            sign(
                Algorithm::EdDSA,
                Some(&kid),
                &with(json!({"iat": now - 7200, "nbf": now - 7200, "exp": now - 3600})),
                &real,
            )?,
            "TOKEN_EXPIRED",
        ),
        bearer(
            "nbf in the future",
            sign(Algorithm::EdDSA, Some(&kid), &with(json!({"nbf": now + 3600})), &real)?,
            invalid,
        ),
        bearer(
            "wrong aud",
            sign(
                Algorithm::EdDSA,
                Some(&kid),
                &with(json!({"aud": "someone-else"})),
                &real,
            )?,
            invalid,
        ),
        bearer(
            "wrong iss",
            sign(Algorithm::EdDSA, Some(&kid), &with(json!({"iss": "evil"})), &real)?,
            invalid,
        ),
        bearer("tid tampered after signing", tampered, invalid),
        bearer("over 8 KiB", oversized, invalid),
        bearer(
            "nbf as a string",
            sign(
                Algorithm::EdDSA,
                Some(&kid),
                &with(json!({"nbf": now.to_string()})),
                &real,
            )?,
            invalid,
        ),
        bearer("a garbage string", "garbage-that-is-no-token-at-all".into(), invalid),
        Forgery {
            name: "Basic instead of Bearer",
            presented: Presented::Header(format!("Basic {}", URL_SAFE_NO_PAD.encode("admin:secret"))),
            reason: invalid,
        },
        Forgery {
            name: "the honest token without a scheme",
            presented: Presented::Header(honest.clone()),
            reason: invalid,
        },
    ];

    let mut problems = Vec::new();
    for forgery in &forgeries {
        problems.extend(refusals(&cluster, forgery).await?);
    }

    // A token of an API key that is then revoked stops working everywhere.
    let (key_id, key) = create_key(&cluster, &tenant.admin.key, json!({"name": "doomed"})).await?;
    let token = cluster.access_token(&key).await?;
    accepted(&cluster, &tenant, &token).await?;
    let revoked = http_client(&tenant.admin.key)?
        .delete(cluster.url(&format!("/v1/auth/keys/{key_id}")))
        .send()
        .await?;
    anyhow::ensure!(revoked.status() == 200, "revoke: {}", revoked.text().await?);
    let revoked_at = Instant::now();
    let forgery = bearer("made from a revoked key", token, "CREDENTIAL_REVOKED");
    loop {
        let left = refusals(&cluster, &forgery).await?;
        if left.is_empty() {
            break;
        }
        if revoked_at.elapsed() > REVOCATION_DEADLINE {
            problems.extend(left);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    eprintln!(
        "forged tokens ({mode:?}): {} forgeries × 2 REST routes, the WebSocket handshake, 3 gRPC services; \
         revocation took {:.0?}; {:.1?} in all",
        forgeries.len() + 1,
        revoked_at.elapsed(),
        started.elapsed()
    );
    assert!(
        problems.is_empty(),
        "{} forged-token problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    Ok(())
}

/// Signs `claims` as a compact JWT.
fn sign(algorithm: Algorithm, kid: Option<&str>, claims: &Value, key: &EncodingKey) -> anyhow::Result<String> {
    let mut header = Header::new(algorithm);
    header.kid = kid.map(str::to_owned);
    Ok(jsonwebtoken::encode(&header, claims, key)?)
}

/// Returns the made-up RSA key (PKCS#1 DER inside the PEM armour).
fn rsa_key() -> anyhow::Result<EncodingKey> {
    let body: String = RSA_KEY
        .lines()
        .skip_while(|line| !line.starts_with("-----BEGIN"))
        .skip(1)
        .take_while(|line| !line.starts_with("-----END"))
        .collect();
    Ok(EncodingKey::from_rsa_der(
        &base64::engine::general_purpose::STANDARD.decode(body)?,
    ))
}

fn b64(value: &Value) -> anyhow::Result<String> {
    Ok(URL_SAFE_NO_PAD.encode(serde_json::to_vec(value)?))
}

/// Checks that `token` works on every surface as the tenant's admin.
async fn accepted(cluster: &Cluster, tenant: &Tenant, token: &str) -> anyhow::Result<()> {
    let whoami = http_client(token)?.get(cluster.url("/v1/auth/whoami")).send().await?;
    anyhow::ensure!(
        whoami.status() == 200,
        "REST refused an honest token: {}",
        whoami.text().await?
    );
    let whoami: Value = whoami.json().await?;
    anyhow::ensure!(whoami["userId"] == tenant.admin.user_id.as_str(), "whoami: {whoami}");

    let mut ws = WsClient::connect(&cluster.ws_url_as(token)).await?;
    let listed = ws.request("container_list", json!({})).await?;
    anyhow::ensure!(listed["containerIds"].is_array(), "WebSocket: {listed}");

    let grpc = Grpc::connect(cluster, &Presented::Bearer(token.to_owned())).await?;
    let caller = grpc.auth().await?.into_inner().caller.context("no caller")?;
    anyhow::ensure!(caller.user_id == tenant.admin.user_id, "GetCaller: {caller:?}");
    grpc.session().await?;
    grpc.runtime().await?;
    grpc.resource().await?;
    grpc.config().await?;
    Ok(())
}

/// Returns what is wrong with how each surface refuses `forgery` (nothing when all refuse it properly).
async fn refusals(cluster: &Cluster, forgery: &Forgery) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    let name = forgery.name;
    let header = forgery.presented.header();
    let echoes = |text: &str| forgery.presented.pieces().into_iter().any(|piece| text.contains(piece));

    for path in ["/v1/auth/whoami", "/v1/containers"] {
        let response = reqwest::Client::new()
            .get(cluster.url(path))
            .header(reqwest::header::AUTHORIZATION, &header)
            .send()
            .await?;
        let status = response.status().as_u16();
        let challenge = response.headers().get(reqwest::header::WWW_AUTHENTICATE).cloned();
        let body = response.text().await?;
        let code = serde_json::from_str::<Value>(&body)
            .ok()
            .map(|b| b["error"]["code"].clone());
        if status != 401 || code != Some(json!(forgery.reason)) || challenge.as_ref().is_none_or(|c| c != "Bearer") {
            problems.push(format!("REST {path} with {name}: {status} {challenge:?} {body}"));
        }
        if echoes(&body) {
            problems.push(format!("REST {path} with {name} echoes the token: {body}"));
        }
    }

    let request = match &forgery.presented {
        Presented::Bearer(token) => cluster.ws_url_as(token).into_client_request()?,
        Presented::Header(value) => {
            let mut request = cluster.ws_base_url().into_client_request()?;
            request.headers_mut().insert("authorization", value.parse()?);
            request
        }
    };
    match tokio_tungstenite::connect_async(request).await {
        Err(tungstenite::Error::Http(response)) => {
            let body = String::from_utf8_lossy(response.body().as_deref().unwrap_or_default()).into_owned();
            let code = serde_json::from_str::<Value>(&body)
                .ok()
                .map(|b| b["error"]["code"].clone());
            let challenge = response.headers().get("www-authenticate").cloned();
            if response.status() != 401 || code != Some(json!(forgery.reason)) || challenge.is_none() {
                problems.push(format!(
                    "WebSocket handshake with {name}: {} {challenge:?} {body}",
                    response.status()
                ));
            }
            if echoes(&body) {
                problems.push(format!("WebSocket handshake with {name} echoes the token: {body}"));
            }
        }
        Err(err) => problems.push(format!("WebSocket handshake with {name}: {err}")),
        Ok(_) => problems.push(format!("WebSocket handshake with {name}: accepted")),
    }

    let grpc = Grpc::connect(cluster, &forgery.presented).await?;
    let answers = [
        ("auth.GetCaller", grpc.auth().await.map(|r| format!("{r:?}"))),
        ("session.ListContainers", grpc.session().await.map(|r| format!("{r:?}"))),
        ("runtime.ListAgents", grpc.runtime().await.map(|r| format!("{r:?}"))),
        (
            "resource.ListResources",
            grpc.resource().await.map(|r| format!("{r:?}")),
        ),
        ("config.GetConfig", grpc.config().await.map(|r| format!("{r:?}"))),
    ];
    for (method, answer) in answers {
        match answer {
            Err(status) if status.code() == tonic::Code::Unauthenticated => {
                let text = format!("{status:?}");
                if echoes(&text) {
                    problems.push(format!("gRPC {method} with {name} echoes the token: {text}"));
                }
            }
            other => problems.push(format!("gRPC {method} with {name}: {other:?}")),
        }
    }
    Ok(problems)
}

/// The gRPC services, called with a given `authorization` header.
struct Grpc {
    session: tonic::transport::Channel,
    runtime: tonic::transport::Channel,
    auth: tonic::transport::Channel,
    resource: tonic::transport::Channel,
    config: tonic::transport::Channel,
    authorization: tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
}

impl Grpc {
    async fn connect(cluster: &Cluster, presented: &Presented) -> anyhow::Result<Grpc> {
        Ok(Grpc {
            session: channel(&cluster.session_grpc).await?,
            runtime: channel(&cluster.runtime_grpc).await?,
            auth: channel(&cluster.auth_grpc).await?,
            resource: channel(&cluster.resource_grpc).await?,
            config: channel(&cluster.config_grpc).await?,
            authorization: presented.header().parse()?,
        })
    }

    fn interceptor(&self) -> impl tonic::service::Interceptor + Clone + use<> {
        let value = self.authorization.clone();
        move |mut request: tonic::Request<()>| {
            request.metadata_mut().insert("authorization", value.clone());
            Ok::<_, tonic::Status>(request)
        }
    }

    async fn auth(&self) -> Result<tonic::Response<au::GetCallerResponse>, tonic::Status> {
        AuthServiceClient::with_interceptor(self.auth.clone(), self.interceptor())
            .get_caller(au::GetCallerRequest {})
            .await
    }

    async fn session(&self) -> Result<tonic::Response<ss::ListContainersResponse>, tonic::Status> {
        SessionServiceClient::with_interceptor(self.session.clone(), self.interceptor())
            .list_containers(ss::ListContainersRequest {})
            .await
    }

    async fn runtime(&self) -> Result<tonic::Response<rt::ListAgentsResponse>, tonic::Status> {
        RuntimeServiceClient::with_interceptor(self.runtime.clone(), self.interceptor())
            .list_agents(rt::ListAgentsRequest { container_id: None })
            .await
    }

    async fn resource(&self) -> Result<tonic::Response<avm_proto::resource::v1::ListResourcesResponse>, tonic::Status> {
        avm_proto::resource::v1::resource_service_client::ResourceServiceClient::with_interceptor(
            self.resource.clone(),
            self.interceptor(),
        )
        .list_resources(avm_proto::resource::v1::ListResourcesRequest::default())
        .await
    }

    async fn config(&self) -> Result<tonic::Response<avm_proto::config::v1::GetConfigResponse>, tonic::Status> {
        avm_proto::config::v1::config_service_client::ConfigServiceClient::with_interceptor(
            self.config.clone(),
            self.interceptor(),
        )
        .get_config(avm_proto::config::v1::GetConfigRequest::default())
        .await
    }
}

/// Connects to a gRPC endpoint.
async fn channel(url: &str) -> anyhow::Result<tonic::transport::Channel> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect()
        .await?)
}
