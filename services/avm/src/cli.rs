//! `avm tenants|users|keys|whoami`: manage a running server through its REST
//! API. The credential comes from `--token`, `AVM_TOKEN`, or the admin key
//! the first run wrote to the data dir.

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use serde_json::{Map, Value, json};

use crate::{ADMIN_KEY_FILE, AvmConfig};

/// Where the server is and who is asking.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The gateway's URL.
    #[arg(long, env = "AVM_URL", default_value = "http://127.0.0.1:8080", global = true)]
    url: String,
    /// An API key or access token (default: the first run's admin key in the data dir).
    #[arg(long, env = "AVM_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
}

/// `avm tenants …`
#[derive(Debug, Args)]
pub struct Tenants {
    #[command(subcommand)]
    action: TenantAction,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, Subcommand)]
enum TenantAction {
    /// Create a tenant with its first admin; prints the admin's API key once.
    Create {
        name: String,
        /// Requests per minute (0: unlimited; default: the server's default).
        #[arg(long)]
        requests_per_minute: Option<u32>,
        /// LLM tokens per month (0: unlimited; default: the server's default).
        #[arg(long)]
        tokens_per_month: Option<u64>,
        /// Name of the first admin user.
        #[arg(long)]
        admin_name: Option<String>,
    },
    /// List tenants.
    List,
    /// Show one tenant.
    Get { tenant_id: String },
    /// Rename a tenant or change its limits.
    Update {
        tenant_id: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        requests_per_minute: Option<u32>,
        #[arg(long)]
        tokens_per_month: Option<u64>,
    },
    /// Delete a tenant with its users and keys.
    Delete { tenant_id: String },
}

/// `avm users …`
#[derive(Debug, Args)]
pub struct Users {
    #[command(subcommand)]
    action: UserAction,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, Subcommand)]
enum UserAction {
    /// Create a user in a tenant.
    Create {
        #[arg(long)]
        tenant: String,
        name: String,
        /// `admin` or `member`.
        #[arg(long, default_value = "member")]
        role: String,
    },
    /// List a tenant's users.
    List {
        #[arg(long)]
        tenant: String,
    },
    /// Delete a user and revoke their keys.
    Delete {
        #[arg(long)]
        tenant: String,
        user_id: String,
    },
}

/// `avm keys …`
#[derive(Debug, Args)]
pub struct Keys {
    #[command(subcommand)]
    action: KeyAction,
    #[command(flatten)]
    client: ClientArgs,
}

#[derive(Debug, Subcommand)]
enum KeyAction {
    /// Create an API key (for yourself, or as an admin for a user of your tenant); prints it once.
    Create {
        #[arg(long, default_value = "")]
        name: String,
        #[arg(long)]
        user: Option<String>,
        /// Comma-separated scopes: read, write, admin (default: all the user's role allows).
        #[arg(long, value_delimiter = ',')]
        scopes: Vec<String>,
        /// Lifetime, e.g. `30d` or `12h` (default: no expiry).
        #[arg(long)]
        expires_in: Option<String>,
    },
    /// List API keys (prefixes only).
    List {
        #[arg(long)]
        user: Option<String>,
    },
    /// Revoke an API key.
    Revoke { key_id: String },
}

/// Runs `avm tenants …`.
pub async fn tenants(command: Tenants, config: &AvmConfig) -> anyhow::Result<()> {
    let client = Client::new(&command.client, config)?;
    let result = match command.action {
        TenantAction::Create {
            name,
            requests_per_minute,
            tokens_per_month,
            admin_name,
        } => {
            let mut body = json!({"name": name});
            if let Some(admin) = admin_name {
                body["adminName"] = json!(admin);
            }
            if let Some(limits) = limits(requests_per_minute, tokens_per_month) {
                body["limits"] = limits;
            }
            client.send(reqwest::Method::POST, "/v1/tenants", Some(body)).await?
        }
        TenantAction::List => client.send(reqwest::Method::GET, "/v1/tenants", None).await?,
        TenantAction::Get { tenant_id } => {
            client
                .send(reqwest::Method::GET, &format!("/v1/tenants/{tenant_id}"), None)
                .await?
        }
        TenantAction::Update {
            tenant_id,
            name,
            requests_per_minute,
            tokens_per_month,
        } => {
            let mut body = Map::new();
            if let Some(name) = name {
                body.insert("name".into(), json!(name));
            }
            if let Some(limits) = limits(requests_per_minute, tokens_per_month) {
                body.insert("limits".into(), limits);
            }
            let path = format!("/v1/tenants/{tenant_id}");
            client
                .send(reqwest::Method::PATCH, &path, Some(Value::Object(body)))
                .await?
        }
        TenantAction::Delete { tenant_id } => {
            client
                .send(reqwest::Method::DELETE, &format!("/v1/tenants/{tenant_id}"), None)
                .await?
        }
    };
    print_json(&result)
}

/// Runs `avm users …`.
pub async fn users(command: Users, config: &AvmConfig) -> anyhow::Result<()> {
    let client = Client::new(&command.client, config)?;
    let result = match command.action {
        UserAction::Create { tenant, name, role } => {
            let path = format!("/v1/tenants/{tenant}/users");
            client
                .send(reqwest::Method::POST, &path, Some(json!({"name": name, "role": role})))
                .await?
        }
        UserAction::List { tenant } => {
            client
                .send(reqwest::Method::GET, &format!("/v1/tenants/{tenant}/users"), None)
                .await?
        }
        UserAction::Delete { tenant, user_id } => {
            let path = format!("/v1/tenants/{tenant}/users/{user_id}");
            client.send(reqwest::Method::DELETE, &path, None).await?
        }
    };
    print_json(&result)
}

/// Runs `avm keys …`.
pub async fn keys(command: Keys, config: &AvmConfig) -> anyhow::Result<()> {
    let client = Client::new(&command.client, config)?;
    let result = match command.action {
        KeyAction::Create {
            name,
            user,
            scopes,
            expires_in,
        } => {
            let mut body = json!({"name": name});
            if let Some(user) = user {
                body["userId"] = json!(user);
            }
            if !scopes.is_empty() {
                body["scopes"] = json!(scopes);
            }
            if let Some(expires_in) = expires_in {
                body["expiresIn"] = json!(expires_in);
            }
            client.send(reqwest::Method::POST, "/v1/auth/keys", Some(body)).await?
        }
        KeyAction::List { user } => {
            let path = match user {
                Some(user) => format!("/v1/auth/keys?userId={user}"),
                None => "/v1/auth/keys".to_owned(),
            };
            client.send(reqwest::Method::GET, &path, None).await?
        }
        KeyAction::Revoke { key_id } => {
            client
                .send(reqwest::Method::DELETE, &format!("/v1/auth/keys/{key_id}"), None)
                .await?
        }
    };
    print_json(&result)
}

/// Runs `avm whoami`.
pub async fn whoami(args: &ClientArgs, config: &AvmConfig) -> anyhow::Result<()> {
    let client = Client::new(args, config)?;
    print_json(&client.send(reqwest::Method::GET, "/v1/auth/whoami", None).await?)
}

fn limits(requests_per_minute: Option<u32>, tokens_per_month: Option<u64>) -> Option<Value> {
    if requests_per_minute.is_none() && tokens_per_month.is_none() {
        return None;
    }
    Some(json!({
        "requestsPerMinute": requests_per_minute.unwrap_or(0),
        "tokensPerMonth": tokens_per_month.unwrap_or(0),
    }))
}

fn print_json(value: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

struct Client {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Client {
    fn new(args: &ClientArgs, config: &AvmConfig) -> anyhow::Result<Self> {
        let token = match &args.token {
            Some(token) => token.clone(),
            None => {
                let path = config.server.data_dir().join(ADMIN_KEY_FILE);
                std::fs::read_to_string(&path)
                    .with_context(|| {
                        format!(
                            "no credential: pass --token or set AVM_TOKEN (cannot read {})",
                            path.display()
                        )
                    })?
                    .trim()
                    .to_owned()
            }
        };
        Ok(Self {
            http: reqwest::Client::new(),
            url: args.url.trim_end_matches('/').to_owned(),
            token,
        })
    }

    /// Sends one request and returns its JSON body, or fails with the server's error.
    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("cannot reach AgentVM at {}", self.url))?;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let code = body["error"]["code"].as_str().unwrap_or("ERROR");
            let message = body["error"]["message"].as_str().unwrap_or("request failed");
            bail!("{message} ({code}, HTTP {})", status.as_u16());
        }
        Ok(body)
    }
}
