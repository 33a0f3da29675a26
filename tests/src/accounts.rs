//! Tenants, users and API keys made through the public REST API, as an
//! operator or a tenant admin would make them.

use anyhow::{Context, ensure};
use serde_json::{Value, json};

use crate::cluster::{Cluster, http_client};

/// A tenant made for a test, with its first admin.
#[derive(Clone, Debug)]
pub struct Tenant {
    pub tenant_id: String,
    pub admin: Account,
}

/// A user and an API key of theirs.
#[derive(Clone, Debug)]
pub struct Account {
    pub tenant_id: String,
    pub user_id: String,
    pub key_id: String,
    /// The full API key.
    pub key: String,
}

/// Creates a tenant as the operator; `limits` is the REST `limits` object, if any.
pub async fn create_tenant(cluster: &Cluster, name: &str, limits: Option<Value>) -> anyhow::Result<Tenant> {
    let mut body = json!({"name": name});
    if let Some(limits) = limits {
        body["limits"] = limits;
    }
    let response = cluster
        .http()?
        .post(cluster.url("/v1/tenants"))
        .json(&body)
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 201,
        "create tenant: {}",
        response.text().await?
    );
    let created: Value = response.json().await?;
    let tenant_id = text(&created["tenant"]["tenantId"])?;
    Ok(Tenant {
        admin: Account {
            tenant_id: tenant_id.clone(),
            user_id: text(&created["admin"]["userId"])?,
            key_id: text(&created["key"]["keyId"])?,
            key: text(&created["secret"])?,
        },
        tenant_id,
    })
}

/// Creates a user of `tenant` with `role`, and an API key for them, as the tenant's admin.
pub async fn create_user(cluster: &Cluster, tenant: &Tenant, name: &str, role: &str) -> anyhow::Result<Account> {
    let admin = http_client(&tenant.admin.key)?;
    let response = admin
        .post(cluster.url(&format!("/v1/tenants/{}/users", tenant.tenant_id)))
        .json(&json!({"name": name, "role": role}))
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 201,
        "create user: {}",
        response.text().await?
    );
    let user: Value = response.json().await?;
    let user_id = text(&user["userId"])?;
    let (key_id, key) = create_key(cluster, &tenant.admin.key, json!({"userId": user_id, "name": name})).await?;
    Ok(Account {
        tenant_id: tenant.tenant_id.clone(),
        user_id,
        key_id,
        key,
    })
}

/// Creates an API key with `credential` from a `POST /v1/auth/keys` body;
/// returns its id and the full key.
pub async fn create_key(cluster: &Cluster, credential: &str, body: Value) -> anyhow::Result<(String, String)> {
    let response = http_client(credential)?
        .post(cluster.url("/v1/auth/keys"))
        .json(&body)
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 201,
        "create key: {}",
        response.text().await?
    );
    let created: Value = response.json().await?;
    Ok((text(&created["key"]["keyId"])?, text(&created["secret"])?))
}

fn text(value: &Value) -> anyhow::Result<String> {
    value.as_str().map(str::to_owned).context("missing string in response")
}
