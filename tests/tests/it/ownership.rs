//! The ownership matrix. Three tenants of two users each (the tenant's admin
//! and a member) each own one object of every kind: a user, API keys, a
//! container with an image, its conversation and a running agent, a group
//! with that agent as a member and a message in it, a private prompt
//! resource; each tenant also has a container named `default` and
//! its own configuration overrides. Resources and configuration belong to
//! the whole tenant, so only other tenants attack them. Every principal then tries
//! every public operation that names an object — every REST route, every
//! WebSocket request type and `subscribe`, every gRPC method of the session,
//! runtime and auth services — with the ids of everyone it must not reach,
//! and the same operation with missing ids of the same shape. A foreign id
//! must leak nothing, change nothing, and be answered exactly like a missing
//! one.
//!
//! Admins see their whole tenant, so an admin naming a member of its own
//! tenant is no attack; a member naming its admin's objects is. Container ids
//! are one namespace per tenant, so a member cannot take an id another user
//! holds (`CONTAINER_ID_TAKEN`): the one documented difference between a
//! foreign and a missing id, checked on its own.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use avm_common::ids::new_id;
use avm_proto::auth::v1 as au;
use avm_proto::auth::v1::auth_service_client::AuthServiceClient;
use avm_proto::config::v1 as cf;
use avm_proto::config::v1::config_service_client::ConfigServiceClient;
use avm_proto::observability::v1 as ob;
use avm_proto::observability::v1::observability_service_client::ObservabilityServiceClient;
use avm_proto::resource::v1 as rs;
use avm_proto::resource::v1::resource_service_client::ResourceServiceClient;
use avm_proto::runtime::v1 as rt;
use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use avm_proto::session::v1 as ss;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_tests::accounts::{Account, create_key, create_tenant, create_user};
use avm_tests::cluster::{Cluster, Mode, Options, bearer, http_client};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::both_modes;
use crate::support::{conversation, send_and_finish};

const TENANTS: usize = 3;

/// How long a stream that opened is read: what a reachable session replays
/// arrives at once, and only the control's own streams open.
const STREAM_GLANCE: Duration = Duration::from_millis(500);

/// The tenant whose `default` container its member (not its admin) holds.
const MEMBER_HOLDS_DEFAULT: usize = 1;

both_modes!(no_principal_reaches_what_it_does_not_own, ownership_matrix);

async fn ownership_matrix(mode: Mode) -> anyhow::Result<()> {
    let started = Instant::now();
    // The matrix sends hundreds of frames a second on one connection,
    // thousands of requests a minute per tenant, and guesses keys from one
    // address again and again: none of these limits is under test here.
    let options = Options {
        messages_per_second: Some(100_000),
        failed_token_exchanges_per_minute: Some(0),
        ..Options::default()
    };
    let cluster = Cluster::start(mode, options).await?;
    let channels = Channels::connect(&cluster).await?;
    let parties = set_up(&cluster).await?;
    let mut problems = Vec::new();

    owners_read_their_own(&cluster, &channels, &parties, &mut problems).await?;
    let attacks = attack_everything(&cluster, &channels, &parties, &mut problems).await?;
    tenants_never_meet_on_default(&cluster, &channels, &parties, &mut problems).await?;
    container_ids_are_one_namespace_per_tenant(&cluster, &channels, &parties, &mut problems).await?;
    subscriptions_deliver_nothing_foreign(&cluster, &parties, &mut problems).await?;

    eprintln!(
        "ownership matrix ({mode:?}): {} principals, {} operations, {attacks} attacks in {:.1?}",
        parties.len(),
        OPS.len(),
        started.elapsed()
    );
    assert!(
        problems.is_empty(),
        "{} ownership problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    Ok(())
}

/// The ids an operation can name; `{…}` in the templates of [`OPS`].
#[derive(Clone, Debug)]
struct Ids {
    tenant: String,
    user: String,
    key: String,
    extra_key: String,
    container: String,
    image: String,
    session: String,
    agent: String,
    /// A group in the container, with the image as an agent member.
    group: String,
    /// A private prompt resource (`res_…`) and its name.
    resource: String,
    resource_name: String,
    /// A well-formed API key with the key's id and a wrong secret.
    key_guess: String,
}

impl Ids {
    /// Returns ids of the same shapes that name nothing; the tenant is kept
    /// when it is the attacker's own (it is no secret then).
    fn missing(&self, keep_tenant: bool) -> Ids {
        let key = nothing(&self.key, '0');
        Ids {
            tenant: if keep_tenant {
                self.tenant.clone()
            } else {
                nothing(&self.tenant, '0')
            },
            user: nothing(&self.user, '0'),
            key_guess: key_guess(&key),
            key,
            extra_key: nothing(&self.extra_key, '1'),
            // Of the same length, so even the encoded gRPC details compare.
            container: format!("nil-{}", "x".repeat(self.container.len().saturating_sub(4))),
            image: nothing(&self.image, '0'),
            session: nothing(&self.session, '0'),
            agent: nothing(&self.agent, '0'),
            group: nothing(&self.group, '0'),
            resource: nothing(&self.resource, '0'),
            resource_name: format!("void-{}", "z".repeat(self.resource_name.len().saturating_sub(5))),
        }
    }

    /// Returns the `resource://` URI of the resource.
    fn resource_uri(&self) -> String {
        format!("resource://prompts/{}", self.resource_name)
    }

    /// Returns each id with the placeholder that stands for it.
    fn named(&self) -> [(&str, &'static str); 12] {
        [
            // First: it holds the key's hex digits.
            (self.key_guess.as_str(), "{key_guess}"),
            (self.tenant.as_str(), "{tenant}"),
            (self.user.as_str(), "{user}"),
            (self.key.as_str(), "{key}"),
            (self.extra_key.as_str(), "{extra_key}"),
            (self.container.as_str(), "{container}"),
            (self.image.as_str(), "{image}"),
            (self.session.as_str(), "{session}"),
            (self.agent.as_str(), "{agent}"),
            (self.group.as_str(), "{group}"),
            (self.resource.as_str(), "{resource}"),
            (self.resource_name.as_str(), "{resource_name}"),
        ]
    }

    /// Fills a template with these ids and the caller's own (`{my_user}`,
    /// `{my_tenant}`, `{my_container}`, `{my_group}`).
    fn fill(&self, template: &str, me: &Ids) -> String {
        let mut text = template
            .replace("{my_user}", &me.user)
            .replace("{my_tenant}", &me.tenant)
            .replace("{my_container}", &me.container)
            .replace("{my_group}", &me.group)
            .replace("{resource_uri}", &self.resource_uri());
        for (id, placeholder) in self.named() {
            text = text.replace(placeholder, id);
        }
        text
    }

    /// Replaces these ids by their placeholders, so the answers about two
    /// sets of ids can be compared.
    fn scrub(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for (id, placeholder) in self.named() {
            text = text.replace(id, placeholder);
        }
        text
    }
}

/// Returns an id of the same shape as `id` (`img_` + hex) with every hex digit `digit`.
fn nothing(id: &str, digit: char) -> String {
    match id.rsplit_once('_') {
        Some((prefix, hex)) => format!("{prefix}_{}", digit.to_string().repeat(hex.len())),
        None => format!("{id}-{digit}"),
    }
}

/// Returns an API key of the right format for `key_id` whose secret is wrong.
fn key_guess(key_id: &str) -> String {
    let hex = key_id.strip_prefix("key_").unwrap_or(key_id);
    format!("avm_{hex}_{}", "A".repeat(43))
}

/// A principal of the matrix and what it owns.
struct Party {
    /// `t0-admin`, `t1-member`…
    label: String,
    tenant: usize,
    admin: bool,
    tenant_name: String,
    /// A name unique to this user (admins are all called `admin`).
    user_name: Option<String>,
    account: Account,
    extra_key: String,
    /// Its access token, for calling the gRPC services directly.
    token: String,
    own: Ids,
    image_name: String,
    system_prompt: String,
    /// The text of its first turn, and of its message in its group.
    marker: String,
    group_name: String,
    /// The text of a turn and of a group message sent while others are
    /// subscribed to this party's sessions and group.
    later_marker: String,
    /// The template of its prompt resource.
    resource_marker: String,
    /// The model its tenant's configuration names (set by the admin).
    config_marker: String,
    /// The image in its tenant's `default` container, when it holds that container.
    default: Option<Held>,
}

/// An image in the `default` container and what only its holder may read.
struct Held {
    image: String,
    session: String,
    agent: String,
    image_name: String,
    marker: String,
}

impl Party {
    /// Returns whether `self` must not reach `other`'s objects: everyone
    /// else's, except that an admin sees its whole tenant.
    fn attacks(&self, other: &Party) -> bool {
        self.label != other.label && !(self.admin && self.tenant == other.tenant)
    }

    /// Returns what `reader` must never see of this party, with what it is.
    fn secrets(&self, reader: &Party) -> Vec<(String, String)> {
        let mut secrets = vec![
            ("user id", &self.account.user_id),
            ("key id", &self.account.key_id),
            ("extra key id", &self.own.extra_key),
            ("API key", &self.account.key),
            ("extra API key", &self.extra_key),
            ("access token", &self.token),
            ("container id", &self.own.container),
            ("image id", &self.own.image),
            ("session id", &self.own.session),
            ("agent id", &self.own.agent),
            ("group id", &self.own.group),
            ("group name", &self.group_name),
            ("image name", &self.image_name),
            ("system prompt", &self.system_prompt),
            ("message", &self.marker),
            ("later message", &self.later_marker),
        ];
        let prefixes: Vec<String> = [&self.account.key, &self.extra_key]
            .iter()
            .filter_map(|key| key.get(..12).map(str::to_owned))
            .collect();
        for prefix in &prefixes {
            secrets.push(("key prefix", prefix));
        }
        if let Some(name) = &self.user_name {
            secrets.push(("user name", name));
        }
        if let Some(held) = &self.default {
            secrets.extend([
                ("default image id", &held.image),
                ("default session id", &held.session),
                ("default agent id", &held.agent),
                ("default image name", &held.image_name),
                ("default message", &held.marker),
            ]);
        }
        if reader.tenant != self.tenant {
            // The tenant's resources and configuration are its members' to see.
            secrets.extend([
                ("tenant id", &self.own.tenant),
                ("tenant name", &self.tenant_name),
                ("resource id", &self.own.resource),
                ("resource name", &self.own.resource_name),
                ("resource content", &self.resource_marker),
                ("configured model", &self.config_marker),
            ]);
        }
        secrets
            .into_iter()
            .map(|(what, value)| (format!("{what} of {}", self.label), value.clone()))
            .collect()
    }
}

/// Returns what of `secrets` shows in `text`.
fn leaks(text: &str, secrets: &[(String, String)]) -> Vec<String> {
    secrets
        .iter()
        .filter(|(_, value)| text.contains(value.as_str()))
        .map(|(what, _)| what.clone())
        .collect()
}

/// Creates the tenants and users through the REST API, as the operator and
/// the tenants' admins would, and gives everyone their objects.
async fn set_up(cluster: &Cluster) -> anyhow::Result<Vec<Party>> {
    // Unlimited: the matrix makes thousands of requests a minute per tenant.
    let unlimited = json!({"requestsPerMinute": 0, "tokensPerMonth": 0});
    let mut parties = Vec::new();
    for t in 0..TENANTS {
        let tenant_name = new_id(&format!("tenant-t{t}"));
        let tenant = create_tenant(cluster, &tenant_name, Some(unlimited.clone())).await?;
        let member_name = new_id(&format!("member-t{t}"));
        let member = create_user(cluster, &tenant, &member_name, "member").await?;
        let holder_is_member = t == MEMBER_HOLDS_DEFAULT;
        let admin = Party::set_up(cluster, t, &tenant_name, tenant.admin.clone(), None, !holder_is_member).await?;
        let mut member = Party::set_up(cluster, t, &tenant_name, member, Some(member_name), holder_is_member).await?;
        member.config_marker.clone_from(&admin.config_marker);
        parties.push(admin);
        parties.push(member);
    }
    Ok(parties)
}

impl Party {
    async fn set_up(
        cluster: &Cluster,
        tenant: usize,
        tenant_name: &str,
        account: Account,
        user_name: Option<String>,
        holds_default: bool,
    ) -> anyhow::Result<Party> {
        let admin = user_name.is_none();
        let label = format!("t{tenant}-{}", if admin { "admin" } else { "member" });
        let (extra_key_id, extra_key) =
            create_key(cluster, &account.key, json!({"name": format!("extra-{label}")})).await?;
        let token = cluster.access_token(&account.key).await?;
        let image_name = new_id(&format!("image-{label}"));
        let system_prompt = new_id(&format!("prompt-{label}"));
        let marker = new_id(&format!("marker-{label}"));
        let mut ws = WsClient::connect(&cluster.ws_url_as(&account.key)).await?;
        let container = format!("own-{label}");
        let (image, session, agent) = talk(
            &mut ws,
            &container,
            json!({"name": image_name, "systemPrompt": system_prompt}),
            &marker,
        )
        .await?;
        let group_name = new_id(&format!("group-{label}"));
        let group = start_group(cluster, &account.key, &container, &image, &group_name, &marker).await?;
        let default = if holds_default {
            let image_name = new_id(&format!("default-image-{label}"));
            let marker = new_id(&format!("default-marker-{label}"));
            let (image, session, agent) = talk(&mut ws, "default", json!({"name": image_name}), &marker).await?;
            Some(Held {
                image,
                session,
                agent,
                image_name,
                marker,
            })
        } else {
            None
        };
        let resource_name = new_id(&format!("res-{label}")).replace('_', "-");
        let resource_marker = new_id(&format!("resource-{label}"));
        let registered: Value = http_client(&account.key)?
            .post(cluster.url("/v1/resources"))
            .json(&json!({
                "kind": "prompt",
                "name": resource_name,
                "version": "1.0.0",
                "content": {"template": resource_marker, "variables": []},
            }))
            .send()
            .await?
            .json()
            .await?;
        let resource = registered["resource"]["resourceId"]
            .as_str()
            .with_context(|| format!("register a resource: {registered}"))?
            .to_owned();
        // The tenant's model override is its admin's to set; members share it.
        let config_marker = format!("model-t{tenant}-{}", &new_id("m")[2..18]);
        if admin {
            let response = http_client(&account.key)?
                .put(cluster.url("/v1/config"))
                .json(&json!({"llm.model": config_marker}))
                .send()
                .await?;
            ensure!(
                response.status().is_success(),
                "set the tenant's model: {}",
                response.text().await?
            );
        }
        let own = Ids {
            tenant: account.tenant_id.clone(),
            user: account.user_id.clone(),
            key: account.key_id.clone(),
            extra_key: extra_key_id,
            container,
            image,
            session,
            agent,
            group,
            resource,
            resource_name,
            key_guess: key_guess(&account.key_id),
        };
        Ok(Party {
            later_marker: new_id(&format!("later-{label}")),
            resource_marker,
            config_marker,
            label,
            tenant,
            admin,
            tenant_name: tenant_name.to_owned(),
            user_name,
            account,
            extra_key,
            token,
            own,
            image_name,
            system_prompt,
            marker,
            group_name,
            default,
        })
    }
}

/// Creates a container and an image, holds one turn with `marker` so the
/// image has a history, and starts its agent; returns the image, session
/// and agent ids.
async fn talk(
    ws: &mut WsClient,
    container: &str,
    config: Value,
    marker: &str,
) -> anyhow::Result<(String, String, String)> {
    let talk = conversation(ws, container, config).await?;
    let frames = send_and_finish(ws, &talk.image_id, json!(marker)).await?;
    ensure!(
        frames.last().is_some_and(|frame| frame["type"] == "conversation_end"),
        "the turn in {container} failed: {frames:?}"
    );
    let run = ws.request("image_run", json!({"imageId": talk.image_id})).await?;
    let agent = run["agentId"].as_str().context("image_run without agentId")?;
    Ok((talk.image_id, talk.session_id, agent.to_owned()))
}

/// Creates a group in `container` with `image` as an agent member that only
/// a mention wakes (so nothing runs unasked), and posts `marker` into it;
/// returns the group's id.
async fn start_group(
    cluster: &Cluster,
    key: &str,
    container: &str,
    image: &str,
    name: &str,
    marker: &str,
) -> anyhow::Result<String> {
    let http = http_client(key)?;
    let created: Value = http
        .post(cluster.url(&format!("/v1/containers/{container}/groups")))
        .json(&json!({
            "name": name,
            "wakeMode": "mentions",
            "members": [{"kind": "agent", "memberId": image}],
        }))
        .send()
        .await?
        .json()
        .await?;
    let group = created["groupId"]
        .as_str()
        .with_context(|| format!("create a group in {container}: {created}"))?
        .to_owned();
    let response = http
        .post(cluster.url(&format!("/v1/groups/{group}/messages")))
        .json(&json!({"content": format!("in the group: {marker}")}))
        .send()
        .await?;
    ensure!(
        response.status().is_success(),
        "post into the group in {container}: {}",
        response.text().await?
    );
    Ok(group)
}

/// What a principal sees of its own objects, for telling whether anyone else
/// changed them; an agent's lifecycle state only shows over gRPC.
async fn snapshot(cluster: &Cluster, channels: &Channels, party: &Party) -> anyhow::Result<Value> {
    let http = http_client(&party.account.key)?;
    let get = |path: String| {
        let request = http.get(cluster.url(&path));
        async move {
            let response = request.send().await?;
            let status = response.status().as_u16();
            let mut body: Value = response.json().await.unwrap_or(Value::Null);
            if let Some(error) = body.get_mut("error").and_then(Value::as_object_mut) {
                error.remove("requestId");
            }
            Ok::<_, anyhow::Error>(json!({"status": status, "body": body}))
        }
    };
    let mut session = SessionServiceClient::with_interceptor(channels.session.clone(), bearer(&party.token)?);
    let own = &party.own;
    let mut view = serde_json::Map::new();
    let containers = get("/v1/containers".into()).await?;
    let container_ids: Vec<String> = ids_in(&containers["body"]["containers"], "containerId");
    view.insert("containers".into(), containers);
    for container in &container_ids {
        let images = get(format!("/v1/containers/{container}/images")).await?;
        for image in ids_in(&images["body"]["images"], "imageId") {
            view.insert(
                format!("messages of {image}"),
                get(format!("/v1/images/{image}/messages")).await?,
            );
            let state = match session
                .get_image(ss::GetImageRequest {
                    image_id: image.clone(),
                })
                .await
            {
                Ok(found) => {
                    let state = found.into_inner().image.map(|image| image.agent_state);
                    json!({"status": 200, "body": {"agentState": state}})
                }
                Err(status) => json!({"status": format!("{:?}", status.code()), "body": status.message()}),
            };
            view.insert(format!("agent state of {image}"), state);
        }
        view.insert(format!("images of {container}"), images);
        let groups = get(format!("/v1/containers/{container}/groups")).await?;
        for group in ids_in(&groups["body"]["groups"], "groupId") {
            view.insert(
                format!("members of {group}"),
                get(format!("/v1/groups/{group}/members")).await?,
            );
            view.insert(
                format!("messages of {group}"),
                get(format!("/v1/groups/{group}/messages")).await?,
            );
        }
        view.insert(format!("groups of {container}"), groups);
        view.insert(
            format!("shares of {container}"),
            get(format!("/v1/containers/{container}/shares")).await?,
        );
    }
    view.insert("agents".into(), get("/v1/agents".into()).await?);
    view.insert("keys".into(), get("/v1/auth/keys".into()).await?);
    view.insert("whoami".into(), get("/v1/auth/whoami".into()).await?);
    view.insert(
        "user".into(),
        get(format!("/v1/tenants/{}/users/{}", own.tenant, own.user)).await?,
    );
    view.insert("tenant".into(), get(format!("/v1/tenants/{}", own.tenant)).await?);
    view.insert("resource".into(), get(format!("/v1/resources/{}", own.resource)).await?);
    let mut config = get("/v1/config".into()).await?;
    // The revision counts every tenant's changes; the values are this tenant's.
    if let Some(body) = config["body"].as_object_mut() {
        body.remove("revision");
    }
    view.insert("config".into(), config);
    Ok(Value::Object(view))
}

/// Returns the string `field` of each object in a JSON array.
fn ids_in(list: &Value, field: &str) -> Vec<String> {
    list.as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| item[field].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// One public operation that names objects. `{…}` in its templates are
/// filled from the target's [`Ids`], `{my_user}` and `{my_tenant}` from the
/// caller's own.
#[derive(Clone, Copy)]
enum Op {
    /// An HTTP call: method, path with query, JSON body (`""` for none).
    Rest(&'static str, &'static str, &'static str),
    /// An HTTP GET that asks for server-sent events (`Accept: text/event-stream`).
    Sse(&'static str),
    /// A WebSocket request: its type without `_request`, and its `data`.
    Ws(&'static str, &'static str),
    /// A WebSocket `subscribe` frame without its `type`: a session or a group,
    /// optionally after a cursor.
    Subscribe(&'static str),
    /// A gRPC method, called directly with the caller's access token; see [`Attacker::grpc`].
    Grpc(&'static str),
}

impl Op {
    /// Returns whether the operation only reads, so an owner may run it as a control.
    fn reads(&self) -> bool {
        match self {
            // A workspace file the owner never wrote is missing for the owner too.
            Op::Rest(method, path, _) => *method == "GET" && !path.contains("/workspace/files/"),
            Op::Sse(_) => true,
            Op::Ws(kind, _) => matches!(
                *kind,
                "container_get"
                    | "image_list"
                    | "image_get"
                    | "image_messages"
                    | "agent_get"
                    | "agent_list"
                    | "group_get"
                    | "group_list"
                    | "group_member_list"
                    | "group_message_list"
            ),
            Op::Subscribe(_) => true,
            Op::Grpc(method) => method.split_once('.').is_some_and(|(_, name)| {
                ["Get", "List", "Subscribe", "Resolve", "Watch"]
                    .iter()
                    .any(|verb| name.starts_with(verb))
            }),
        }
    }

    /// Returns whether the operation is about what the whole tenant shares
    /// (resources, configuration): only other tenants attack with it.
    fn tenant_wide(&self) -> bool {
        match self {
            Op::Rest(_, path, _) | Op::Sse(path) => {
                ["/v1/resources", "/v1/config", "/v1/usage", "/v1/logs", "/v1/metrics"]
                    .iter()
                    .any(|prefix| path.starts_with(prefix))
            }
            Op::Ws(_, data) => data.contains("{resource_uri}"),
            Op::Subscribe(_) => false,
            Op::Grpc(method) => ["resource.", "config.", "observability."]
                .iter()
                .any(|prefix| method.starts_with(prefix)),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Rest(method, path, body) => write!(f, "REST {method} {path} {body}"),
            Op::Sse(path) => write!(f, "REST GET {path} (Accept: text/event-stream)"),
            Op::Ws(kind, data) => write!(f, "WS {kind}_request {data}"),
            Op::Subscribe(frame) => write!(f, "WS subscribe {frame}"),
            Op::Grpc(method) => write!(f, "gRPC {method}"),
        }
    }
}

/// Every public operation that takes an id (creating a container is the
/// documented exception, see [`container_ids_are_one_namespace_per_tenant`]).
const OPS: &[Op] = &[
    // REST: every route that takes an id (README, `gateway/src/{rest,admin}.rs`).
    Op::Rest("GET", "/v1/containers/{container}", ""),
    Op::Rest("DELETE", "/v1/containers/{container}", ""),
    Op::Rest("POST", "/v1/containers/{container}/images", r#"{"name":"planted"}"#),
    Op::Rest("GET", "/v1/containers/{container}/images", ""),
    Op::Rest("POST", "/v1/containers/{container}/shares", r#"{"userId":"{my_user}"}"#),
    Op::Rest("GET", "/v1/containers/{container}/shares", ""),
    Op::Rest("DELETE", "/v1/containers/{container}/shares/{my_user}", ""),
    Op::Rest("DELETE", "/v1/containers/{container}/shares/{user}", ""),
    Op::Rest("GET", "/v1/images/{image}", ""),
    Op::Rest(
        "PATCH",
        "/v1/images/{image}",
        r#"{"name":"planted","description":"planted"}"#,
    ),
    Op::Rest("DELETE", "/v1/images/{image}", ""),
    Op::Rest("POST", "/v1/images/{image}/run", ""),
    Op::Rest("POST", "/v1/images/{image}/stop", ""),
    Op::Rest("POST", "/v1/images/{image}/interrupt", ""),
    Op::Rest("GET", "/v1/images/{image}/children", ""),
    Op::Rest("GET", "/v1/images/{image}/messages", ""),
    Op::Rest("POST", "/v1/images/{image}/messages", r#"{"content":"planted"}"#),
    Op::Rest("GET", "/v1/images/{image}/events", ""),
    Op::Rest("GET", "/v1/images/{image}/workspace", ""),
    Op::Rest("GET", "/v1/images/{image}/workspace/files/notes/planted.txt", ""),
    Op::Rest(
        "PUT",
        "/v1/images/{image}/workspace/files/notes/planted.txt",
        r#"{"planted":true}"#,
    ),
    Op::Rest("DELETE", "/v1/images/{image}/workspace/files/notes", ""),
    Op::Rest("GET", "/v1/images/{image}/events?after=0", ""),
    Op::Rest("GET", "/v1/agents?containerId={container}", ""),
    Op::Rest("GET", "/v1/agents/{agent}", ""),
    Op::Rest("DELETE", "/v1/agents/{agent}", ""),
    Op::Rest("POST", "/v1/agents/{image}/pause", ""),
    Op::Rest("POST", "/v1/agents/{image}/resume", ""),
    Op::Rest("POST", "/v1/agents/{image}/terminate", ""),
    Op::Rest("POST", "/v1/agents/{agent}/pause", ""),
    Op::Rest("POST", "/v1/agents/{agent}/resume", ""),
    Op::Rest("POST", "/v1/agents/{agent}/terminate", ""),
    Op::Rest(
        "POST",
        "/v1/containers/{container}/groups",
        r#"{"name":"planted","wakeMode":"mentions"}"#,
    ),
    Op::Rest("GET", "/v1/containers/{container}/groups", ""),
    Op::Rest("GET", "/v1/groups/{group}", ""),
    Op::Rest("PATCH", "/v1/groups/{group}", r#"{"name":"planted","wakeMode":"all"}"#),
    Op::Rest("DELETE", "/v1/groups/{group}", ""),
    Op::Rest("GET", "/v1/groups/{group}/members", ""),
    Op::Rest(
        "POST",
        "/v1/groups/{group}/members",
        r#"{"kind":"user","memberId":"{my_user}"}"#,
    ),
    Op::Rest(
        "POST",
        "/v1/groups/{group}/members",
        r#"{"kind":"agent","memberId":"{image}"}"#,
    ),
    Op::Rest("DELETE", "/v1/groups/{group}/members/{image}", ""),
    Op::Rest("DELETE", "/v1/groups/{group}/members/{user}", ""),
    Op::Rest("GET", "/v1/groups/{group}/messages", ""),
    Op::Rest("GET", "/v1/groups/{group}/messages?after=0&limit=1000", ""),
    Op::Sse("/v1/groups/{group}/messages"),
    Op::Sse("/v1/groups/{group}/messages?after=0"),
    Op::Rest(
        "POST",
        "/v1/groups/{group}/messages",
        r#"{"content":"planted","messageId":"planted"}"#,
    ),
    Op::Rest("GET", "/v1/groups/{group}/events", ""),
    Op::Rest("GET", "/v1/groups/{group}/events?after=0", ""),
    Op::Rest("POST", "/v1/groups/{group}/read", "{}"),
    Op::Rest("POST", "/v1/groups/{group}/read", r#"{"seq":1}"#),
    // The attacker's own group and container, with the target's image as an agent.
    Op::Rest(
        "POST",
        "/v1/groups/{my_group}/members",
        r#"{"kind":"agent","memberId":"{image}"}"#,
    ),
    Op::Rest(
        "POST",
        "/v1/containers/{my_container}/groups",
        r#"{"name":"planted","members":[{"kind":"agent","memberId":"{image}"}]}"#,
    ),
    Op::Rest("GET", "/v1/tenants/{tenant}", ""),
    Op::Rest("PATCH", "/v1/tenants/{tenant}", r#"{"name":"planted"}"#),
    Op::Rest("PATCH", "/v1/tenants/{tenant}", r#"{"limits":{"requestsPerMinute":1}}"#),
    Op::Rest("DELETE", "/v1/tenants/{tenant}", ""),
    Op::Rest(
        "POST",
        "/v1/tenants/{tenant}/users",
        r#"{"name":"planted","role":"admin"}"#,
    ),
    Op::Rest("GET", "/v1/tenants/{tenant}/users", ""),
    Op::Rest("GET", "/v1/tenants/{tenant}/users/{user}", ""),
    Op::Rest("DELETE", "/v1/tenants/{tenant}/users/{user}", ""),
    Op::Rest("GET", "/v1/tenants/{my_tenant}/users/{user}", ""),
    Op::Rest("DELETE", "/v1/tenants/{my_tenant}/users/{user}", ""),
    Op::Rest("POST", "/v1/auth/keys", r#"{"userId":"{user}","name":"planted"}"#),
    Op::Rest("GET", "/v1/auth/keys?userId={user}", ""),
    Op::Rest("GET", "/v1/auth/keys/{key}", ""),
    Op::Rest("GET", "/v1/auth/keys/{extra_key}", ""),
    Op::Rest("DELETE", "/v1/auth/keys/{extra_key}", ""),
    Op::Rest("DELETE", "/v1/auth/keys/{key}", ""),
    Op::Rest("POST", "/v1/auth/token", r#"{"apiKey":"{key_guess}"}"#),
    Op::Rest("GET", "/v1/resources/{resource}", ""),
    Op::Rest("GET", "/v1/resources/{resource}?version=1.0.0", ""),
    Op::Rest(
        "PUT",
        "/v1/resources/{resource}",
        r#"{"version":"9.9.9","content":{"template":"planted","variables":[]}}"#,
    ),
    Op::Rest("DELETE", "/v1/resources/{resource}?force=true", ""),
    Op::Rest("DELETE", "/v1/resources/{resource}?version=1.0.0&force=true", ""),
    Op::Rest("GET", "/v1/resources/resolve?uri={resource_uri}", ""),
    Op::Rest("GET", "/v1/resources?name={resource_name}", ""),
    Op::Rest("GET", "/v1/config?tenantId={tenant}", ""),
    Op::Rest("GET", "/v1/config/llm.model?tenantId={tenant}", ""),
    Op::Rest("PUT", "/v1/config?tenantId={tenant}", r#"{"llm.model":"planted"}"#),
    Op::Rest("GET", "/v1/usage?tenantId={tenant}", ""),
    Op::Rest("GET", "/v1/usage/records?tenantId={tenant}", ""),
    Op::Rest("GET", "/v1/usage/budgets?tenantId={tenant}", ""),
    Op::Rest(
        "PUT",
        "/v1/usage/budgets",
        r#"{"tenantId":"{tenant}","monthlyLimitUsd":"1"}"#,
    ),
    Op::Rest("GET", "/v1/metrics?tenantId={tenant}", ""),
    Op::Rest("GET", "/v1/logs?tenantId={tenant}", ""),
    // WebSocket: every request type that takes an id (`gateway/src/ws.rs`), and `subscribe`.
    Op::Ws("container_get", r#"{"containerId":"{container}"}"#),
    Op::Ws(
        "image_create",
        r#"{"containerId":"{container}","config":{"name":"planted"}}"#,
    ),
    Op::Ws("image_list", r#"{"containerId":"{container}"}"#),
    Op::Ws("image_list", r#"{"parentImageId":"{image}"}"#),
    Op::Ws("image_get", r#"{"imageId":"{image}"}"#),
    Op::Ws("image_update", r#"{"imageId":"{image}","updates":{"name":"planted"}}"#),
    Op::Ws("image_delete", r#"{"imageId":"{image}"}"#),
    Op::Ws("image_run", r#"{"imageId":"{image}"}"#),
    Op::Ws("image_stop", r#"{"imageId":"{image}"}"#),
    Op::Ws("image_messages", r#"{"imageId":"{image}"}"#),
    Op::Ws("workspace_list", r#"{"imageId":"{image}"}"#),
    Op::Ws("workspace_delete", r#"{"imageId":"{image}","path":"notes"}"#),
    Op::Ws("workspace_read", r#"{"imageId":"{image}","path":"notes/planted.txt"}"#),
    Op::Ws(
        "workspace_write",
        r#"{"imageId":"{image}","path":"notes/planted.txt","content":"planted"}"#,
    ),
    Op::Ws("message_send", r#"{"imageId":"{image}","content":"planted"}"#),
    Op::Ws("message_send", r#"{"agentId":"{agent}","content":"planted"}"#),
    Op::Ws("agent_interrupt", r#"{"imageId":"{image}"}"#),
    Op::Ws("agent_interrupt", r#"{"agentId":"{agent}"}"#),
    Op::Ws("agent_get", r#"{"agentId":"{agent}"}"#),
    Op::Ws("agent_list", r#"{"containerId":"{container}"}"#),
    Op::Ws("agent_destroy", r#"{"agentId":"{agent}"}"#),
    Op::Ws("agent_destroy_all", r#"{"containerId":"{container}"}"#),
    Op::Ws("agent_pause", r#"{"imageId":"{image}"}"#),
    Op::Ws("agent_resume", r#"{"imageId":"{image}"}"#),
    Op::Ws("agent_terminate", r#"{"imageId":"{image}"}"#),
    Op::Ws(
        "group_create",
        r#"{"containerId":"{container}","name":"planted","wakeMode":"mentions"}"#,
    ),
    Op::Ws(
        "group_create",
        r#"{"containerId":"{my_container}","name":"planted","members":[{"kind":"agent","memberId":"{image}"}]}"#,
    ),
    Op::Ws("group_list", r#"{"containerId":"{container}"}"#),
    Op::Ws("group_get", r#"{"groupId":"{group}"}"#),
    Op::Ws(
        "group_update",
        r#"{"groupId":"{group}","updates":{"name":"planted","wakeMode":"all"}}"#,
    ),
    Op::Ws("group_delete", r#"{"groupId":"{group}"}"#),
    Op::Ws(
        "group_member_add",
        r#"{"groupId":"{group}","kind":"user","memberId":"{my_user}"}"#,
    ),
    Op::Ws(
        "group_member_add",
        r#"{"groupId":"{my_group}","kind":"agent","memberId":"{image}"}"#,
    ),
    Op::Ws("group_member_remove", r#"{"groupId":"{group}","memberId":"{image}"}"#),
    Op::Ws("group_member_remove", r#"{"groupId":"{group}","memberId":"{user}"}"#),
    Op::Ws("group_member_list", r#"{"groupId":"{group}"}"#),
    Op::Ws(
        "group_message_send",
        r#"{"groupId":"{group}","content":"planted","messageId":"planted"}"#,
    ),
    Op::Ws("group_message_list", r#"{"groupId":"{group}","afterSeq":0}"#),
    Op::Ws("group_read", r#"{"groupId":"{group}"}"#),
    Op::Ws(
        "image_create",
        r#"{"containerId":"{my_container}","config":{"name":"planted","systemPrompt":"{resource_uri}"}}"#,
    ),
    Op::Subscribe(r#"{"sessionId":"{session}"}"#),
    Op::Subscribe(r#"{"sessionId":"{session}","afterCursor":"0"}"#),
    Op::Subscribe(r#"{"groupId":"{group}"}"#),
    Op::Subscribe(r#"{"groupId":"{group}","afterCursor":"0"}"#),
    // gRPC: every method of proto/avm/{session,runtime,auth,resource,config}/v1 that takes an id.
    Op::Grpc("session.GetContainer"),
    Op::Grpc("session.DeleteContainer"),
    Op::Grpc("session.ShareContainer"),
    Op::Grpc("session.UnshareContainer"),
    Op::Grpc("session.ListContainerShares"),
    Op::Grpc("session.CreateImage"),
    Op::Grpc("session.GetImage"),
    Op::Grpc("session.GetSession"),
    Op::Grpc("session.ListImages"),
    Op::Grpc("session.UpdateImage"),
    Op::Grpc("session.DeleteImage"),
    Op::Grpc("session.AppendMessage"),
    Op::Grpc("session.ListMessages"),
    Op::Grpc("session.ListImages children"),
    Op::Grpc("session.CreateImage child"),
    Op::Grpc("session.SetAgentState"),
    Op::Grpc("session.CreateGroup"),
    Op::Grpc("session.CreateGroup with agent"),
    Op::Grpc("session.GetGroup"),
    Op::Grpc("session.ListGroups"),
    Op::Grpc("session.UpdateGroup"),
    Op::Grpc("session.DeleteGroup"),
    Op::Grpc("session.AddGroupMember"),
    Op::Grpc("session.AddGroupMember agent"),
    Op::Grpc("session.RemoveGroupMember"),
    Op::Grpc("session.ListGroupMembers"),
    Op::Grpc("session.PostGroupMessage"),
    Op::Grpc("session.PostGroupMessage as agent"),
    Op::Grpc("session.ListGroupMessages"),
    Op::Grpc("session.AdvanceReadCursor"),
    Op::Grpc("session.ListUnread of agent"),
    Op::Grpc("session.ListUnread of user"),
    Op::Grpc("runtime.GetImage"),
    Op::Grpc("runtime.ListImages"),
    Op::Grpc("runtime.RunImage"),
    Op::Grpc("runtime.StopImage"),
    Op::Grpc("runtime.SendMessage"),
    Op::Grpc("runtime.InterruptAgent by image"),
    Op::Grpc("runtime.InterruptAgent by agent"),
    Op::Grpc("runtime.GetAgent"),
    Op::Grpc("runtime.ListAgents"),
    Op::Grpc("runtime.DestroyAgent"),
    Op::Grpc("runtime.DestroyAllAgents"),
    Op::Grpc("runtime.SubscribeEvents"),
    Op::Grpc("runtime.SubscribeEvents after 0"),
    Op::Grpc("runtime.ListWorkspace"),
    Op::Grpc("runtime.ReadWorkspaceFile"),
    Op::Grpc("runtime.WriteWorkspaceFile"),
    Op::Grpc("runtime.WakeAgent"),
    Op::Grpc("runtime.SubscribeGroupEvents"),
    Op::Grpc("runtime.SubscribeGroupEvents after 0"),
    Op::Grpc("runtime.PauseAgent"),
    Op::Grpc("runtime.ResumeAgent"),
    Op::Grpc("runtime.TerminateAgent"),
    Op::Grpc("auth.GetTenant"),
    Op::Grpc("auth.UpdateTenant name"),
    Op::Grpc("auth.UpdateTenant limits"),
    Op::Grpc("auth.DeleteTenant"),
    Op::Grpc("auth.CreateUser"),
    Op::Grpc("auth.GetUser"),
    Op::Grpc("auth.ListUsers"),
    Op::Grpc("auth.DeleteUser"),
    Op::Grpc("auth.CreateApiKey"),
    Op::Grpc("auth.GetApiKey"),
    Op::Grpc("auth.GetApiKey extra"),
    Op::Grpc("auth.ListApiKeys"),
    Op::Grpc("auth.RevokeApiKey extra"),
    Op::Grpc("auth.RevokeApiKey"),
    Op::Grpc("auth.GetUsage"),
    Op::Grpc("auth.RecordUsage"),
    Op::Grpc("auth.ExchangeApiKey"),
    Op::Grpc("resource.GetResource"),
    Op::Grpc("resource.PublishVersion"),
    Op::Grpc("resource.DeleteResource"),
    Op::Grpc("resource.ResolveResource"),
    Op::Grpc("resource.ListResources"),
    Op::Grpc("config.GetConfig"),
    Op::Grpc("config.UpdateConfig"),
    Op::Grpc("config.WatchConfig"),
    Op::Grpc("observability.QueryUsage"),
    Op::Grpc("observability.ListUsage"),
    Op::Grpc("observability.GetUsageSummary"),
    Op::Grpc("observability.SetBudget"),
    Op::Grpc("observability.ListBudgets"),
    Op::Grpc("observability.QueryLogs"),
];

/// What an operation answered.
#[derive(Clone)]
struct Answer {
    /// Whether the operation succeeded.
    ok: bool,
    /// What must be the same for a foreign and a missing id: status, code,
    /// reason, message (REST, gRPC) or the whole frames without timestamps
    /// and request ids (WebSocket).
    shape: String,
    /// Every byte received, for the leak check.
    full: String,
}

impl Answer {
    fn same(ok: bool, text: String) -> Answer {
        Answer {
            ok,
            shape: text.clone(),
            full: text,
        }
    }

    /// Replaces the ids that were sent by their placeholders.
    fn scrubbed(self, ids: &Ids) -> Answer {
        Answer {
            ok: self.ok,
            shape: ids.scrub(&self.shape),
            full: ids.scrub(&self.full),
        }
    }
}

/// Reasons of requests that never reached an ownership check: an attack
/// answered with one of them proves nothing.
const MALFORMED: &[&str] = &[
    "ROUTE_NOT_FOUND",
    "METHOD_NOT_ALLOWED",
    "UNKNOWN_REQUEST",
    "MISSING_FIELD",
    "INVALID_FIELD",
    "INVALID_JSON",
    "INVALID_BODY",
    "MISSING_ID",
    "InvalidArgument",
];

/// The gRPC channels of the services (one and the same in one-process mode).
struct Channels {
    session: Channel,
    runtime: Channel,
    auth: Channel,
    resource: Channel,
    config: Channel,
    observability: Channel,
}

impl Channels {
    async fn connect(cluster: &Cluster) -> anyhow::Result<Channels> {
        Ok(Channels {
            session: channel(&cluster.session_grpc).await?,
            runtime: channel(&cluster.runtime_grpc).await?,
            auth: channel(&cluster.auth_grpc).await?,
            resource: channel(&cluster.resource_grpc).await?,
            config: channel(&cluster.config_grpc).await?,
            observability: channel(&cluster.observability_grpc).await?,
        })
    }
}

/// A principal on the attack: REST with its API key, a WebSocket, and its
/// access token at the gRPC services.
struct Attacker<'a> {
    cluster: &'a Cluster,
    channels: &'a Channels,
    party: &'a Party,
    http: reqwest::Client,
    ws: WsClient,
}

impl<'a> Attacker<'a> {
    async fn new(cluster: &'a Cluster, channels: &'a Channels, party: &'a Party) -> anyhow::Result<Self> {
        Ok(Attacker {
            cluster,
            channels,
            party,
            http: http_client(&party.account.key)?,
            ws: WsClient::connect(&cluster.ws_url_as(&party.account.key)).await?,
        })
    }

    /// Runs `op` against `ids`; the answer names them by placeholder.
    async fn call(&mut self, op: Op, ids: &Ids) -> anyhow::Result<Answer> {
        let me = &self.party.own;
        let answer = match op {
            Op::Rest(method, path, body) => {
                self.rest(method, &ids.fill(path, me), &ids.fill(body, me), false)
                    .await?
            }
            Op::Sse(path) => self.rest("GET", &ids.fill(path, me), "", true).await?,
            Op::Ws(kind, data) => {
                let data: Value = serde_json::from_str(&ids.fill(data, me))?;
                let request_id = self.ws.send_request(kind, data).await?;
                let frames = frames_until_response(&mut self.ws, &request_id).await?;
                let data = frames.last().map(|frame| &frame["data"]);
                let ok = data.is_some_and(|data| {
                    data.get("error").is_none() && data["exists"] != false && data.get("record") != Some(&Value::Null)
                });
                ws_answer(ok, &frames, &frames)
            }
            Op::Subscribe(frame) => {
                let mut frame: Value = serde_json::from_str(&ids.fill(frame, me))?;
                frame["type"] = json!("subscribe");
                self.ws.send_json(&frame).await?;
                // Whatever the subscription brings arrives before the answer
                // to the next request: the gateway opens it before reading on.
                let request_id = self.ws.send_request("container_list", json!({})).await?;
                let frames = frames_until_response(&mut self.ws, &request_id).await?;
                let before = &frames[..frames.len() - 1];
                let ok = before.iter().all(|frame| frame["type"] != "system_error");
                ws_answer(ok, before, &frames)
            }
            Op::Grpc(method) => self.grpc(method, ids).await?,
        };
        Ok(answer.scrubbed(ids))
    }

    async fn rest(&self, method: &str, path: &str, body: &str, stream: bool) -> anyhow::Result<Answer> {
        let mut request = self
            .http
            .request(reqwest::Method::from_bytes(method.as_bytes())?, self.cluster.url(path));
        if stream {
            request = request.header(reqwest::header::ACCEPT, "text/event-stream");
        }
        if !body.is_empty() {
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_owned());
        }
        let mut response = request.send().await?;
        let status = response.status().as_u16();
        let streaming = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if streaming {
            // Only a reachable image streams; read what it sends at once.
            let first = tokio::time::timeout(STREAM_GLANCE, response.chunk()).await;
            let text = format!("{status} event stream: {first:?}");
            return Ok(Answer::same(status == 200, text));
        }
        let text = response.text().await?;
        let mut shape: Value = serde_json::from_str(&text).unwrap_or_else(|_| Value::String(text.clone()));
        if let Some(error) = shape.get_mut("error").and_then(Value::as_object_mut) {
            error.remove("requestId");
        }
        Ok(Answer {
            ok: (200..300).contains(&status),
            shape: format!("{status} {shape}"),
            full: format!("{status} {text}"),
        })
    }

    /// Calls one gRPC method with the attacker's own token: one line per
    /// method, naming the request it builds from `ids`.
    async fn grpc(&self, method: &str, ids: &Ids) -> anyhow::Result<Answer> {
        use rt::interrupt_agent_request::Target;
        let token = bearer(&self.party.token)?;
        let mut session = SessionServiceClient::with_interceptor(self.channels.session.clone(), token.clone());
        let mut runtime = RuntimeServiceClient::with_interceptor(self.channels.runtime.clone(), token.clone());
        let mut auth = AuthServiceClient::with_interceptor(self.channels.auth.clone(), token.clone());
        let mut resource = ResourceServiceClient::with_interceptor(self.channels.resource.clone(), token.clone());
        let mut config = ConfigServiceClient::with_interceptor(self.channels.config.clone(), token.clone());
        let mut observability =
            ObservabilityServiceClient::with_interceptor(self.channels.observability.clone(), token);
        let resource_id = || ids.resource.clone();
        let tenant = || ids.tenant.clone();
        let user = || ids.user.clone();
        let key = || ids.key.clone();
        let extra_key = || ids.extra_key.clone();
        let container = || ids.container.clone();
        let image = || ids.image.clone();
        let session_id = || ids.session.clone();
        let agent = || ids.agent.clone();
        let group = || ids.group.clone();
        let me = || self.party.own.user.clone();
        let my_container = || self.party.own.container.clone();
        let my_group = || self.party.own.group.clone();
        let as_user = |user_id: String| ss::GroupMemberRef {
            kind: ss::GroupMemberKind::User as i32,
            member_id: user_id,
        };
        let as_agent = |image_id: String| ss::GroupMemberRef {
            kind: ss::GroupMemberKind::Agent as i32,
            member_id: image_id,
        };
        let planted = || "planted".to_owned();
        let message = || ss::Message {
            message_id: "msg_planted".into(),
            session_id: session_id(),
            body: Some(ss::message::Body::User(ss::UserMessage {
                content: planted_content(),
                plain_text: true,
            })),
            ..Default::default()
        };
        // `unary` calls answer with their response or status; `stream` calls
        // with their status or first message.
        macro_rules! table {
            ($($how:ident $name:literal => $call:expr,)*) => {
                match method {
                    $($name => table!(@$how $call),)*
                    other => anyhow::bail!("no gRPC call for {other}"),
                }
            };
            (@unary $call:expr) => { unary($call.await) };
            (@stream $call:expr) => { streaming($call.await).await };
        }
        Ok(table! {
            unary "session.GetContainer" =>
                session.get_container(ss::GetContainerRequest { container_id: container(), need: None }),
            unary "session.DeleteContainer" =>
                session.delete_container(ss::DeleteContainerRequest { container_id: container() }),
            unary "session.ShareContainer" =>
                session.share_container(ss::ShareContainerRequest { container_id: container(), user_id: me(), role: 0 }),
            unary "session.UnshareContainer" =>
                session.unshare_container(ss::UnshareContainerRequest { container_id: container(), user_id: me() }),
            unary "session.ListContainerShares" =>
                session.list_container_shares(ss::ListContainerSharesRequest { container_id: container() }),
            unary "session.CreateImage" =>
                session.create_image(ss::CreateImageRequest {
                    container_id: container(), name: Some(planted()), ..Default::default()
                }),
            unary "session.GetImage" =>
                session.get_image(ss::GetImageRequest { image_id: image() }),
            unary "session.GetSession" =>
                session.get_session(ss::GetSessionRequest { session_id: session_id() }),
            unary "session.ListImages" =>
                session.list_images(ss::ListImagesRequest { container_id: Some(container()), parent_image_id: None }),
            unary "session.UpdateImage" =>
                session.update_image(ss::UpdateImageRequest {
                    image_id: image(), name: Some(planted()), description: Some(planted()),
                    tools: Some(ss::ToolList { tools: vec![] }),
                    metadata_json: Some(json!({"planted": planted()}).to_string()),
                }),
            unary "session.DeleteImage" =>
                session.delete_image(ss::DeleteImageRequest { image_id: image() }),
            unary "session.AppendMessage" =>
                session.append_message(ss::AppendMessageRequest { session_id: session_id(), message: Some(message()) }),
            unary "session.ListMessages" =>
                session.list_messages(ss::ListMessagesRequest {
                    session_id: session_id(),
                    context_only: false,
                }),
            unary "session.ListImages children" =>
                session.list_images(ss::ListImagesRequest { container_id: None, parent_image_id: Some(image()) }),
            unary "session.CreateImage child" =>
                session.create_image(ss::CreateImageRequest {
                    container_id: my_container(), name: Some(planted()), parent_image_id: Some(image()),
                    ..Default::default()
                }),
            unary "session.SetAgentState" =>
                session.set_agent_state(ss::SetAgentStateRequest {
                    image_id: image(), state: ss::AgentState::Paused as i32, error: String::new()
                }),
            unary "session.SetAgentState(error)" =>
                session.set_agent_state(ss::SetAgentStateRequest {
                    image_id: image(), state: ss::AgentState::Error as i32, error: planted()
                }),
            unary "session.CreateGroup" =>
                session.create_group(ss::CreateGroupRequest {
                    container_id: container(), name: planted(),
                    wake_mode: ss::GroupWakeMode::Mentions as i32, members: vec![as_user(me())],
                }),
            unary "session.CreateGroup with agent" =>
                session.create_group(ss::CreateGroupRequest {
                    container_id: my_container(), name: planted(),
                    wake_mode: ss::GroupWakeMode::Mentions as i32, members: vec![as_agent(image())],
                }),
            unary "session.GetGroup" =>
                session.get_group(ss::GetGroupRequest { group_id: group() }),
            unary "session.ListGroups" =>
                session.list_groups(ss::ListGroupsRequest { container_id: container(), ..Default::default() }),
            unary "session.UpdateGroup" =>
                session.update_group(ss::UpdateGroupRequest {
                    group_id: group(), name: Some(planted()), wake_mode: Some(ss::GroupWakeMode::All as i32)
                }),
            unary "session.DeleteGroup" =>
                session.delete_group(ss::DeleteGroupRequest { group_id: group() }),
            unary "session.AddGroupMember" =>
                session.add_group_member(ss::AddGroupMemberRequest { group_id: group(), member: Some(as_user(me())) }),
            unary "session.AddGroupMember agent" =>
                session.add_group_member(ss::AddGroupMemberRequest {
                    group_id: my_group(), member: Some(as_agent(image()))
                }),
            unary "session.RemoveGroupMember" =>
                session.remove_group_member(ss::RemoveGroupMemberRequest {
                    group_id: group(), member: Some(as_agent(image()))
                }),
            unary "session.ListGroupMembers" =>
                session.list_group_members(ss::ListGroupMembersRequest { group_id: group() }),
            unary "session.PostGroupMessage" =>
                session.post_group_message(ss::PostGroupMessageRequest {
                    group_id: group(), message_id: planted(), sender: Some(as_user(me())),
                    content: planted(), mentions: vec![image()], read_seq: None,
                }),
            unary "session.PostGroupMessage as agent" =>
                session.post_group_message(ss::PostGroupMessageRequest {
                    group_id: group(), message_id: planted(), sender: Some(as_agent(image())),
                    content: planted(), mentions: vec![], read_seq: None,
                }),
            unary "session.ListGroupMessages" =>
                session.list_group_messages(ss::ListGroupMessagesRequest { group_id: group(), after_seq: 0, limit: 0 }),
            unary "session.ListUnread of agent" =>
                session.list_unread(ss::ListUnreadRequest { member: Some(as_agent(image())), message_limit: 10 }),
            unary "session.ListUnread of user" =>
                session.list_unread(ss::ListUnreadRequest { member: Some(as_user(user())), message_limit: 10 }),
            unary "session.AdvanceReadCursor" =>
                session.advance_read_cursor(ss::AdvanceReadCursorRequest {
                    group_id: group(), member: Some(as_agent(image())), seq: u64::MAX
                }),
            unary "runtime.GetImage" =>
                runtime.get_image(rt::GetImageRequest { image_id: image() }),
            unary "runtime.ListImages" =>
                runtime.list_images(rt::ListImagesRequest { container_id: Some(container()), parent_image_id: None }),
            unary "runtime.ListImages(children)" =>
                runtime.list_images(rt::ListImagesRequest { container_id: None, parent_image_id: Some(image()) }),
            unary "runtime.UpdateImage" =>
                runtime.update_image(rt::UpdateImageRequest {
                    image_id: image(), name: Some(planted()), description: Some(planted()),
                    tools: Some(ss::ToolList { tools: vec![] }),
                    metadata_json: Some(json!({"planted": planted()}).to_string()),
                }),
            unary "runtime.RunImage" =>
                runtime.run_image(rt::RunImageRequest { image_id: image() }),
            unary "runtime.StopImage" =>
                runtime.stop_image(rt::StopImageRequest { image_id: image() }),
            stream "runtime.SendMessage" =>
                runtime.send_message(rt::SendMessageRequest { image_id: image(), content: planted_content(), plain_text: true }),
            unary "runtime.InterruptAgent by image" =>
                runtime.interrupt_agent(rt::InterruptAgentRequest { target: Some(Target::ImageId(image())) }),
            unary "runtime.InterruptAgent by agent" =>
                runtime.interrupt_agent(rt::InterruptAgentRequest { target: Some(Target::AgentId(agent())) }),
            unary "runtime.GetAgent" =>
                runtime.get_agent(rt::GetAgentRequest { agent_id: agent() }),
            unary "runtime.ListAgents" =>
                runtime.list_agents(rt::ListAgentsRequest { container_id: Some(container()) }),
            unary "runtime.DestroyAgent" =>
                runtime.destroy_agent(rt::DestroyAgentRequest { agent_id: agent() }),
            unary "runtime.DestroyAllAgents" =>
                runtime.destroy_all_agents(rt::DestroyAllAgentsRequest { container_id: container() }),
            stream "runtime.SubscribeEvents" =>
                runtime.subscribe_events(rt::SubscribeEventsRequest { session_id: session_id(), after_cursor: None }),
            stream "runtime.SubscribeEvents after 0" =>
                runtime.subscribe_events(rt::SubscribeEventsRequest {
                    session_id: session_id(), after_cursor: Some("0".into())
                }),
            unary "runtime.ListWorkspace" =>
                runtime.list_workspace(rt::ListWorkspaceRequest { image_id: image(), path: String::new() }),
            unary "runtime.ReadWorkspaceFile" =>
                runtime.read_workspace_file(rt::ReadWorkspaceFileRequest {
                    image_id: image(), path: "notes/planted.txt".into()
                }),
            unary "runtime.WriteWorkspaceFile" =>
                runtime.write_workspace_file(rt::WriteWorkspaceFileRequest {
                    image_id: image(), path: "notes/planted.txt".into(), content: planted().into_bytes()
                }),
            unary "runtime.WakeAgent" =>
                runtime.wake_agent(rt::WakeAgentRequest {
                    image_id: image(),
                    wait: false,
                }),
            stream "runtime.SubscribeGroupEvents" =>
                runtime.subscribe_group_events(rt::SubscribeGroupEventsRequest { group_id: group(), after_cursor: None }),
            stream "runtime.SubscribeGroupEvents after 0" =>
                runtime.subscribe_group_events(rt::SubscribeGroupEventsRequest {
                    group_id: group(), after_cursor: Some("0".into())
                }),
            unary "runtime.PauseAgent" =>
                runtime.pause_agent(rt::PauseAgentRequest { image_id: image() }),
            unary "runtime.ResumeAgent" =>
                runtime.resume_agent(rt::ResumeAgentRequest { image_id: image() }),
            unary "runtime.TerminateAgent" =>
                runtime.terminate_agent(rt::TerminateAgentRequest { image_id: image() }),
            unary "auth.GetTenant" =>
                auth.get_tenant(au::GetTenantRequest { tenant_id: tenant() }),
            unary "auth.UpdateTenant name" =>
                auth.update_tenant(au::UpdateTenantRequest {
                    tenant_id: tenant(), name: Some(planted()), limits: None
                }),
            unary "auth.UpdateTenant limits" =>
                auth.update_tenant(au::UpdateTenantRequest {
                    tenant_id: tenant(),
                    name: None,
                    limits: Some(au::Limits { requests_per_minute: 1, tokens_per_month: 1 }),
                }),
            unary "auth.DeleteTenant" =>
                auth.delete_tenant(au::DeleteTenantRequest { tenant_id: tenant() }),
            unary "auth.CreateUser" =>
                auth.create_user(au::CreateUserRequest {
                    tenant_id: tenant(), name: planted(), role: au::Role::Admin as i32
                }),
            unary "auth.GetUser" =>
                auth.get_user(au::GetUserRequest { user_id: user() }),
            unary "auth.ListUsers" =>
                auth.list_users(au::ListUsersRequest { tenant_id: tenant() }),
            unary "auth.DeleteUser" =>
                auth.delete_user(au::DeleteUserRequest { user_id: user() }),
            unary "auth.CreateApiKey" =>
                auth.create_api_key(au::CreateApiKeyRequest { user_id: user(), name: planted(), ..Default::default() }),
            unary "auth.GetApiKey" =>
                auth.get_api_key(au::GetApiKeyRequest { key_id: key() }),
            unary "auth.GetApiKey extra" =>
                auth.get_api_key(au::GetApiKeyRequest { key_id: extra_key() }),
            unary "auth.ListApiKeys" =>
                auth.list_api_keys(au::ListApiKeysRequest { user_id: Some(user()) }),
            unary "auth.RevokeApiKey extra" =>
                auth.revoke_api_key(au::RevokeApiKeyRequest { key_id: extra_key() }),
            unary "auth.RevokeApiKey" =>
                auth.revoke_api_key(au::RevokeApiKeyRequest { key_id: key() }),
            unary "auth.GetUsage" =>
                auth.get_usage(au::GetUsageRequest { tenant_id: tenant() }),
            unary "auth.RecordUsage" =>
                auth.record_usage(au::RecordUsageRequest {
                    tenant_id: tenant(),
                    key_id: Some(key()),
                    input_tokens: 1 << 20,
                    output_tokens: 1 << 20,
                    report_id: planted(),
                }),
            unary "auth.ExchangeApiKey" =>
                auth.exchange_api_key(au::ExchangeApiKeyRequest { api_key: ids.key_guess.clone() }),
            unary "resource.GetResource" =>
                resource.get_resource(rs::GetResourceRequest { resource_id: resource_id(), version: String::new() }),
            unary "resource.PublishVersion" =>
                resource.publish_version(rs::PublishVersionRequest {
                    resource_id: resource_id(),
                    version: "9.9.9".into(),
                    content_json: r#"{"template":"planted","variables":[]}"#.into(),
                    ..Default::default()
                }),
            unary "resource.DeleteResource" =>
                resource.delete_resource(rs::DeleteResourceRequest {
                    resource_id: resource_id(), version: String::new(), force: true
                }),
            unary "resource.ResolveResource" =>
                resource.resolve_resource(rs::ResolveResourceRequest {
                    uri: ids.resource_uri(), variables_json: String::new()
                }),
            unary "resource.ListResources" =>
                resource.list_resources(rs::ListResourcesRequest { name: ids.resource_name.clone(), ..Default::default() }),
            unary "config.GetConfig" =>
                config.get_config(cf::GetConfigRequest { tenant_id: tenant(), ..Default::default() }),
            unary "config.UpdateConfig" =>
                config.update_config(cf::UpdateConfigRequest {
                    scope: cf::Scope::Tenant as i32,
                    tenant_id: tenant(),
                    values: [("llm.model".to_owned(), r#""planted""#.to_owned())].into(),
                }),
            stream "config.WatchConfig" =>
                config.watch_config(cf::WatchConfigRequest { tenant_id: tenant(), all_tenants: false }),
            unary "observability.QueryUsage" =>
                observability.query_usage(ob::QueryUsageRequest { tenant_id: tenant(), ..Default::default() }),
            unary "observability.ListUsage" =>
                observability.list_usage(ob::ListUsageRequest { tenant_id: tenant(), ..Default::default() }),
            unary "observability.GetUsageSummary" =>
                observability.get_usage_summary(ob::GetUsageSummaryRequest { tenant_id: tenant(), ..Default::default() }),
            unary "observability.SetBudget" =>
                observability.set_budget(ob::SetBudgetRequest {
                    tenant_id: tenant(), key_id: String::new(), monthly_limit_pico_usd: 1
                }),
            unary "observability.ListBudgets" =>
                observability.list_budgets(ob::ListBudgetsRequest { tenant_id: tenant() }),
            unary "observability.QueryLogs" =>
                observability.query_logs(ob::QueryLogsRequest { tenant_id: tenant(), ..Default::default() }),
        })
    }
}

/// The answer of a unary gRPC call.
fn unary<T: fmt::Debug>(result: Result<tonic::Response<T>, tonic::Status>) -> Answer {
    match result {
        Ok(response) => Answer::same(true, format!("ok {:?}", response.into_inner())),
        Err(status) => status_answer(&status),
    }
}

/// The answer of a server-streaming gRPC call: its status, or its first message.
async fn streaming<T: fmt::Debug>(result: Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>) -> Answer {
    match result {
        Ok(response) => {
            let mut stream = response.into_inner();
            // Only a reachable session streams; read what it sends at once.
            let first = tokio::time::timeout(STREAM_GLANCE, stream.message()).await;
            Answer::same(true, format!("ok stream {first:?}"))
        }
        Err(status) => status_answer(&status),
    }
}

/// Code, message and details (the reason) of a status; its metadata only for the leak check.
fn status_answer(status: &tonic::Status) -> Answer {
    let shape = format!(
        "{:?} {:?} {:?}",
        status.code(),
        status.message(),
        String::from_utf8_lossy(status.details())
    );
    Answer {
        ok: false,
        full: format!("{shape} {:?}", status.metadata()),
        shape,
    }
}

/// Returns the frames up to and including the response to `request_id`.
async fn frames_until_response(ws: &mut WsClient, request_id: &str) -> anyhow::Result<Vec<Value>> {
    let mut frames = Vec::new();
    loop {
        let frame = ws.next_frame().await?;
        let done = frame["category"] == "response" && frame["data"]["requestId"] == request_id;
        frames.push(frame);
        if done {
            return Ok(frames);
        }
    }
}

/// The answer of WebSocket frames: `shaped` without timestamps and request ids, `all` whole.
fn ws_answer(ok: bool, shaped: &[Value], all: &[Value]) -> Answer {
    let shape: Vec<String> = shaped
        .iter()
        .map(|frame| {
            let mut frame = frame.clone();
            if let Some(object) = frame.as_object_mut() {
                object.remove("timestamp");
            }
            if let Some(data) = frame.get_mut("data").and_then(Value::as_object_mut) {
                data.remove("requestId");
            }
            frame.to_string()
        })
        .collect();
    let full: Vec<String> = all.iter().map(Value::to_string).collect();
    Answer {
        ok,
        shape: shape.join("\n"),
        full: full.join("\n"),
    }
}

/// The control: each admin reads its own objects with every reading
/// operation of the matrix, and succeeds. The operations reach real routes
/// and methods with well-formed requests, so a refusal in the matrix is an
/// ownership check speaking.
async fn owners_read_their_own(
    cluster: &Cluster,
    channels: &Channels,
    parties: &[Party],
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    for owner in parties.iter().filter(|party| party.admin) {
        let mut caller = Attacker::new(cluster, channels, owner).await?;
        for op in OPS.iter().filter(|op| op.reads()) {
            let answer = caller.call(*op, &owner.own).await?;
            if !answer.ok {
                problems.push(format!(
                    "control: {} reading its own objects: {op}: {}",
                    owner.label, answer.full
                ));
            }
        }
    }
    Ok(())
}

/// Every principal tries every operation with the ids of everyone it must
/// not reach, and with missing ids; returns how many (operation, target)
/// pairs were tried.
async fn attack_everything(
    cluster: &Cluster,
    channels: &Channels,
    parties: &[Party],
    problems: &mut Vec<String>,
) -> anyhow::Result<usize> {
    let mut views = Vec::new();
    for party in parties {
        let view = snapshot(cluster, channels, party).await?;
        let answered = view
            .as_object()
            .is_some_and(|parts| parts.values().all(|part| part["status"] == 200));
        ensure!(answered, "{} cannot see its own objects: {view:#}", party.label);
        views.push(view);
    }
    let mut attacks = 0;
    for attacker in parties {
        let mut caller = Attacker::new(cluster, channels, attacker)
            .await
            .with_context(|| attacker.label.clone())?;
        let mut absent_answers: HashMap<(usize, String), Answer> = HashMap::new();
        // What the attacker must never see, of anyone it attacks.
        let hidden: Vec<(String, String)> = parties
            .iter()
            .filter(|victim| attacker.attacks(victim))
            .flat_map(|victim| victim.secrets(attacker))
            .collect();
        for (victim, view) in parties.iter().zip(views.iter_mut()) {
            if !attacker.attacks(victim) {
                continue;
            }
            let target = &victim.own;
            let missing = target.missing(attacker.tenant == victim.tenant);
            for (index, op) in OPS.iter().enumerate() {
                if op.tenant_wide() && attacker.tenant == victim.tenant {
                    continue;
                }
                let who = format!("{} with {}'s ids: {op}", attacker.label, victim.label);
                let foreign = caller.call(*op, target).await.with_context(|| who.clone())?;
                // Missing ids name nothing whoever the victim is: one answer per shape will do.
                let absent = match absent_answers.entry((index, format!("{missing:?}"))) {
                    Entry::Occupied(known) => known.get().clone(),
                    Entry::Vacant(slot) => slot
                        .insert(caller.call(*op, &missing).await.with_context(|| who.clone())?)
                        .clone(),
                };
                attacks += 1;
                for (answer, which) in [(&foreign, "foreign"), (&absent, "missing")] {
                    let leaked = leaks(&answer.full, &hidden);
                    if !leaked.is_empty() {
                        problems.push(format!("{who}: the {which} answer shows {leaked:?}: {}", answer.full));
                    }
                }
                if MALFORMED.iter().any(|reason| foreign.shape.contains(reason)) {
                    problems.push(format!("{who}: malformed, it proves nothing: {}", foreign.full));
                }
                if foreign.shape != absent.shape {
                    problems.push(format!(
                        "{who}: foreign and missing ids answer differently:\n  foreign: {}\n  missing: {}",
                        foreign.shape, absent.shape
                    ));
                }
            }
            let after = snapshot(cluster, channels, victim).await?;
            if after != *view {
                problems.push(format!(
                    "{} changed {}'s objects:\n  before: {view}\n  after:  {after}",
                    attacker.label, victim.label
                ));
                *view = after;
            }
        }
    }
    Ok(attacks)
}

/// Every tenant has a container `default`: each principal finds its own
/// tenant's (when it may see it) and nothing of the others, on every surface.
async fn tenants_never_meet_on_default(
    cluster: &Cluster,
    channels: &Channels,
    parties: &[Party],
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    for party in parties {
        let holder = parties
            .iter()
            .find(|p| p.tenant == party.tenant && p.default.is_some())
            .context("every tenant has a default holder")?;
        let held = holder.default.as_ref().context("the holder holds default")?;
        let visible = party.admin || party.label == holder.label;
        let expected: Vec<String> = if visible { vec![held.image.clone()] } else { Vec::new() };
        let hidden: Vec<(String, String)> = parties
            .iter()
            .filter(|other| party.attacks(other))
            .flat_map(|other| other.secrets(party))
            .collect();
        let who = &party.label;
        let mut seen = Vec::new();

        let http = http_client(&party.account.key)?;
        let response = http.get(cluster.url("/v1/containers/default")).send().await?;
        let status = response.status().as_u16();
        let body: Value = response.json().await?;
        let (want, owner) = if visible {
            (200, json!(holder.account.user_id))
        } else {
            (404, Value::Null)
        };
        if status != want || (visible && body["ownerId"] != owner) {
            problems.push(format!("{who}: GET /v1/containers/default answered {status} {body}"));
        }
        seen.push(body.to_string());

        let response = http.get(cluster.url("/v1/containers/default/images")).send().await?;
        let status = response.status().as_u16();
        let body: Value = response.json().await?;
        let images = ids_in(&body["images"], "imageId");
        if (visible && (status != 200 || images != expected)) || (!visible && status != 404) {
            problems.push(format!(
                "{who}: GET /v1/containers/default/images answered {status} {body}"
            ));
        }
        seen.push(body.to_string());

        let mut ws = WsClient::connect(&cluster.ws_url_as(&party.account.key)).await?;
        let listed = ws.request("image_list", json!({"containerId": "default"})).await?;
        let records = ids_in(&listed["records"], "imageId");
        if (visible && records != expected) || (!visible && listed["code"] != "CONTAINER_NOT_FOUND") {
            problems.push(format!("{who}: image_list of default answered {listed}"));
        }
        seen.push(listed.to_string());

        let token = bearer(&party.token)?;
        let mut session = SessionServiceClient::with_interceptor(channels.session.clone(), token);
        let listed = session
            .list_images(ss::ListImagesRequest {
                container_id: Some("default".into()),
                parent_image_id: None,
            })
            .await?
            .into_inner();
        let images: Vec<String> = listed.images.iter().map(|i| i.image_id.clone()).collect();
        if images != expected {
            problems.push(format!("{who}: session.ListImages of default answered {listed:?}"));
        }
        seen.push(format!("{listed:?}"));

        for text in seen {
            let leaked = leaks(&text, &hidden);
            if !leaked.is_empty() {
                problems.push(format!("{who}: looking at default shows {leaked:?}: {text}"));
            }
        }
    }
    Ok(())
}

/// Container ids are one namespace per tenant: an admin creating an id a
/// member holds gets that container (admins see the whole tenant); a member
/// creating an id another user holds is refused with `CONTAINER_ID_TAKEN`,
/// on every surface, and learns nothing about the holder.
async fn container_ids_are_one_namespace_per_tenant(
    cluster: &Cluster,
    channels: &Channels,
    parties: &[Party],
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    for party in parties {
        for holder in parties
            .iter()
            .filter(|p| p.tenant == party.tenant && p.label != party.label)
        {
            let mut ids = vec![holder.own.container.clone()];
            if holder.default.is_some() {
                ids.push("default".into());
            }
            for container_id in ids {
                let who = format!("{} creating {}'s {container_id}", party.label, holder.label);
                let mut seen = Vec::new();

                let response = http_client(&party.account.key)?
                    .post(cluster.url("/v1/containers"))
                    .json(&json!({"containerId": container_id}))
                    .send()
                    .await?;
                let status = response.status().as_u16();
                let body: Value = response.json().await?;
                let fine = if party.admin {
                    status == 200 && body["ownerId"] == holder.account.user_id.as_str()
                } else {
                    status == 409 && body["error"]["code"] == "CONTAINER_ID_TAKEN"
                };
                if !fine {
                    problems.push(format!("{who} over REST: {status} {body}"));
                }
                seen.push(body.to_string());

                let mut ws = WsClient::connect(&cluster.ws_url_as(&party.account.key)).await?;
                let created = ws
                    .request("container_create", json!({"containerId": container_id}))
                    .await?;
                let fine = if party.admin {
                    created["containerId"] == container_id.as_str() && created.get("error").is_none()
                } else {
                    created["code"] == "CONTAINER_ID_TAKEN"
                };
                if !fine {
                    problems.push(format!("{who} over WebSocket: {created}"));
                }
                seen.push(created.to_string());

                let token = bearer(&party.token)?;
                let created = SessionServiceClient::with_interceptor(channels.session.clone(), token)
                    .create_container(ss::CreateContainerRequest {
                        container_id: container_id.clone(),
                    })
                    .await;
                let fine = match &created {
                    Ok(response) => {
                        let response = response.get_ref();
                        party.admin
                            && !response.created
                            && response
                                .container
                                .as_ref()
                                .is_some_and(|c| c.owner_user_id == holder.account.user_id)
                    }
                    Err(status) => !party.admin && status.code() == tonic::Code::AlreadyExists,
                };
                if !fine {
                    problems.push(format!("{who} over gRPC: {created:?}"));
                }
                seen.push(format!("{created:?}"));

                if !party.admin {
                    // The refusal names the id it was sent and nothing of who holds it.
                    let mut secrets = holder.secrets(party);
                    secrets.retain(|(_, value)| *value != container_id);
                    for text in seen {
                        let leaked = leaks(&text, &secrets);
                        if !leaked.is_empty() {
                            problems.push(format!("{who}: the refusal shows {leaked:?}: {text}"));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Everyone subscribes to every session and group it must not reach and is
/// refused; then everyone holds a turn and posts into its group; every
/// subscriber's next frame is still the answer to its own next request, with
/// nothing of anyone else.
async fn subscriptions_deliver_nothing_foreign(
    cluster: &Cluster,
    parties: &[Party],
    problems: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut watchers = Vec::new();
    for attacker in parties {
        let mut ws = WsClient::connect(&cluster.ws_url_as(&attacker.account.key)).await?;
        let mut sessions = 0;
        let mut groups = 0;
        for victim in parties.iter().filter(|victim| attacker.attacks(victim)) {
            let held = victim.default.iter().map(|held| held.session.as_str());
            for session in std::iter::once(victim.own.session.as_str()).chain(held) {
                ws.subscribe(session, None).await?;
                sessions += 1;
            }
            ws.send_json(&json!({"type": "subscribe", "groupId": victim.own.group}))
                .await?;
            groups += 1;
        }
        let request_id = ws.send_request("container_list", json!({})).await?;
        let frames = frames_until_response(&mut ws, &request_id).await?;
        let refused = |code: &str| {
            frames
                .iter()
                .filter(|f| f["type"] == "system_error" && f["data"]["code"] == code)
                .count()
        };
        if refused("SESSION_NOT_FOUND") != sessions
            || refused("GROUP_NOT_FOUND") != groups
            || frames.len() != sessions + groups + 1
        {
            problems.push(format!(
                "{}: {sessions} foreign session and {groups} group subscriptions were answered by {frames:?}",
                attacker.label
            ));
        }
        watchers.push((attacker, ws));
    }
    for party in parties {
        let mut ws = WsClient::connect(&cluster.ws_url_as(&party.account.key)).await?;
        ws.subscribe(&party.own.session, None).await?;
        let frames = send_and_finish(&mut ws, &party.own.image, json!(party.later_marker)).await?;
        ensure!(
            frames.last().is_some_and(|frame| frame["type"] == "conversation_end"),
            "{}'s later turn failed: {frames:?}",
            party.label
        );
        let response = http_client(&party.account.key)?
            .post(cluster.url(&format!("/v1/groups/{}/messages", party.own.group)))
            .json(&json!({"content": format!("later in the group: {}", party.later_marker)}))
            .send()
            .await?;
        ensure!(
            response.status().is_success(),
            "{}'s later group message failed: {}",
            party.label,
            response.text().await?
        );
    }
    for (attacker, mut ws) in watchers {
        let hidden: Vec<(String, String)> = parties
            .iter()
            .filter(|victim| attacker.attacks(victim))
            .flat_map(|victim| victim.secrets(attacker))
            .collect();
        let request_id = ws.send_request("container_list", json!({})).await?;
        let next = ws.next_frame().await?;
        let own_answer = next["category"] == "response" && next["data"]["requestId"] == request_id.as_str();
        let leaked = leaks(&next.to_string(), &hidden);
        if !own_answer || !leaked.is_empty() {
            problems.push(format!(
                "{}: after foreign turns the next frame is {next} (shows {leaked:?})",
                attacker.label
            ));
        }
    }
    Ok(())
}

/// Connects to a gRPC endpoint.
async fn channel(url: &str) -> anyhow::Result<tonic::transport::Channel> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_owned())?
        .connect()
        .await?)
}

/// Returns the content `"planted"`, as the services carry it.
fn planted_content() -> Vec<ss::ContentPart> {
    vec![ss::ContentPart {
        part: Some(ss::content_part::Part::Text(ss::TextPart { text: "planted".into() })),
    }]
}
