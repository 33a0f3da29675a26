//! The domain logic: validation, ids, timestamps, permissions and logs around the store.
//!
//! Who may do what:
//!
//! - reading (get, list, resolve) needs the `read` scope and sees the caller's
//!   own resources and public ones; another tenant's private resource answers
//!   exactly like a missing one (`RESOURCE_NOT_FOUND`);
//! - publishing (register, publish) needs `write`: admins and members register
//!   their tenant's private resources; a resource's later versions are
//!   published by its owner (the user who published its first version still
//!   kept) or an admin of its tenant, so a member cannot repoint a resource
//!   others use (say, a tool's server, which the tenant's credential goes
//!   to); registering a public one takes an operator (or a service);
//!   publishing to a public one takes an admin of the tenant that owns it;
//! - deleting takes an admin (or operator, or service) of the owning tenant.
//!
//! Another tenant's public resource answers `NOT_RESOURCE_OWNER` to writes.

use std::collections::BTreeMap;
use std::sync::Arc;

use avm_common::auth::Scopes;
use avm_common::ids::new_id;
use avm_common::mcp::McpServerRules;
use avm_common::{RequestContext, now_ms};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use semver::Version;
use tracing::instrument;

use crate::content::{self, AgentContent};
use crate::error::ResourceError;
use crate::kind::Kind;
use crate::record::{
    Deleted, ListQuery, NewResource, NewVersion, Published, Resolution, ResourceDetail, ResourcePage, ResourceRecord,
    ResourceUpdate, VersionRecord, Visibility,
};
use crate::resolve::{Lookup, Resolver};
use crate::store::{ListFilter, PageKey, ResourceStore};
use crate::template;
use crate::template::PromptContent;
use crate::uri::{self, ResourceUri};
use crate::version::{self, VersionSpec};

/// Longest resource description, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 2000;
/// Most tags a resource carries.
pub const MAX_TAGS: usize = 32;
/// Longest tag, in characters.
pub const MAX_TAG_CHARS: usize = 64;
/// Most dependencies one version declares, those its content names included.
pub const MAX_DEPENDENCIES: usize = 256;
/// Longest search text, in characters.
pub const MAX_QUERY_CHARS: usize = 256;
/// Resources on a page when the caller does not say.
pub const DEFAULT_PAGE_SIZE: u32 = 50;
/// Most resources on a page.
pub const MAX_PAGE_SIZE: u32 = 200;
/// Longest resource id accepted, in bytes.
const MAX_RESOURCE_ID_BYTES: usize = 128;

/// Versioned prompts, tools, sandboxes, agents and knowledge of every tenant.
///
/// Cheap to clone: the store sits behind an `Arc`.
#[derive(Clone)]
pub struct ResourceService {
    store: Arc<dyn ResourceStore>,
    /// What a tool's `mcpServer` may start or reach: the runtime's rules.
    mcp_rules: Arc<McpServerRules>,
}

/// A version checked and ready to store, before it knows its resource.
struct Draft {
    version: Version,
    content_json: String,
    dependencies: Vec<ResourceUri>,
}

impl ResourceService {
    /// Returns a service over `store` whose tools' `mcpServer` may start no
    /// command (but in public resources) and reach no internal address.
    pub fn new(store: Arc<dyn ResourceStore>) -> Self {
        Self {
            store,
            mcp_rules: Arc::default(),
        }
    }

    /// Returns the service checking tools' `mcpServer` against `rules` (the
    /// operator's `[runtime.mcp]` and `[runtime.fetch]`) when they are
    /// published, as the runtime does when it uses them (issue 26 item 18).
    pub fn with_mcp_rules(self, rules: McpServerRules) -> Self {
        Self {
            mcp_rules: Arc::new(rules),
            ..self
        }
    }

    /// Refuses a tool version whose `mcpServer` the runtime would refuse.
    fn check_mcp_server(&self, kind: Kind, draft: &Draft, visibility: Visibility) -> Result<(), ResourceError> {
        if kind != Kind::Tool {
            return Ok(());
        }
        let content: serde_json::Value = serde_json::from_str(&draft.content_json).unwrap_or_default();
        let Some(server) = content.get("mcpServer") else {
            return Ok(());
        };
        let name = content["name"].as_str().unwrap_or_default();
        self.mcp_rules
            .check(name, server, visibility == Visibility::Public)
            .map_err(ResourceError::Denied)
    }

    /// Publishes a version of the caller's resource of `kind` and `name`,
    /// creating the resource with its first version.
    ///
    /// On an existing resource a non-empty description or tag list replaces
    /// the resource's. `public` (operators only) applies when the resource is
    /// created; asking it of an existing private resource is `VISIBILITY_MISMATCH`.
    /// The version must be new (`VERSION_EXISTS` otherwise, even with the same
    /// content) and every dependency must resolve now (`MISSING_DEPENDENCY`).
    #[instrument(
        name = "resource.register_resource",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn register(&self, ctx: &RequestContext, new: NewResource) -> Result<Published, ResourceError> {
        allow(ctx, Scopes::WRITE)?;
        if new.public {
            ctx.principal.require_operator().map_err(ResourceError::Denied)?;
        }
        uri::validate_name(&new.name).map_err(|why| ResourceError::invalid("INVALID_NAME", why))?;
        let version = parse_version(&new.version)?;
        let description = validate_description(new.description)?;
        let tags = validate_tags(new.tags)?;
        let draft = draft(new.kind, version, new.content_json, &new.dependencies)?;
        let update = ResourceUpdate {
            description: Some(description).filter(|d| !d.is_empty()),
            tags: Some(tags).filter(|t| !t.is_empty()),
        };
        // Twice at most: a concurrent first registration makes the insert a publish.
        for _ in 0..2 {
            if let Some(existing) = self.own_resource(ctx, new.kind, &new.name).await? {
                if new.public && !existing.is_public() {
                    return Err(ResourceError::VisibilityMismatch(existing.uri().to_string()));
                }
                ensure_owner(ctx, &existing)?;
                return self.add_version(ctx, existing, draft, update).await;
            }
            let visibility = if new.public {
                Visibility::Public
            } else {
                Visibility::Private
            };
            self.check_mcp_server(new.kind, &draft, visibility)?;
            self.check_dependencies(ctx, new.kind, &new.name, visibility, &draft)
                .await?;
            let now = now_ms();
            let resource = ResourceRecord {
                resource_id: new_id("res"),
                tenant_id: ctx.tenant_id.clone(),
                kind: new.kind,
                name: new.name.clone(),
                visibility,
                description: update.description.clone().unwrap_or_default(),
                tags: update.tags.clone().unwrap_or_default(),
                latest_version: draft.version.to_string(),
                created_at_ms: now,
                updated_at_ms: now,
            };
            let version = version_record(ctx, &resource, &draft, now);
            if self.store.create_resource(&resource, &version).await? {
                tracing::info!(
                    resource_id = %resource.resource_id,
                    kind = %resource.kind,
                    name = %resource.name,
                    visibility = resource.visibility.as_str(),
                    version = %version.version,
                    "resource registered"
                );
                return Ok(Published {
                    resource,
                    version,
                    created: true,
                });
            }
        }
        // Inserted by another caller, then deleted before this one could publish into it.
        Err(ResourceError::ResourceNotFound(
            ResourceUri::unversioned(new.kind, &new.name).to_string(),
        ))
    }

    /// Publishes a new version of an existing resource, by id.
    ///
    /// `description` and `tags`, when set, replace the resource's. The same
    /// rules as [`ResourceService::register`] apply to the version.
    #[instrument(
        name = "resource.publish_version",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn publish(&self, ctx: &RequestContext, new: NewVersion) -> Result<Published, ResourceError> {
        allow(ctx, Scopes::WRITE)?;
        validate_resource_id(&new.resource_id)?;
        let version = parse_version(&new.version)?;
        let update = ResourceUpdate {
            description: new.description.map(validate_description).transpose()?,
            tags: new.tags.map(validate_tags).transpose()?,
        };
        let resource = self.readable(ctx, &new.resource_id).await?;
        ensure_owner(ctx, &resource)?;
        let draft = draft(resource.kind, version, new.content_json, &new.dependencies)?;
        self.add_version(ctx, resource, draft, update).await
    }

    /// Returns a resource with its versions (highest first) and the content of
    /// the version `version` picks: exact, `latest`, or a requirement; empty
    /// means latest.
    #[instrument(
        name = "resource.get_resource",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn get(
        &self,
        ctx: &RequestContext,
        resource_id: &str,
        version: &str,
    ) -> Result<ResourceDetail, ResourceError> {
        allow(ctx, Scopes::READ)?;
        validate_resource_id(resource_id)?;
        let spec = VersionSpec::parse(version).map_err(|why| ResourceError::invalid("INVALID_VERSION", why))?;
        let resource = self.readable(ctx, resource_id).await?;
        let mut versions = Vec::new();
        for info in self.store.list_versions(&ctx.tenant_id, resource_id).await? {
            let parsed = Version::parse(&info.version).map_err(|_| {
                ResourceError::corrupt(format!("resource {resource_id} has version {:?}", info.version))
            })?;
            versions.push((parsed, info));
        }
        // Highest first: semver order, which string order is not.
        versions.sort_unstable_by(|a, b| b.0.cmp(&a.0));
        let parsed: Vec<Version> = versions.iter().map(|(parsed, _)| parsed.clone()).collect();
        let not_found = || {
            let uri = ResourceUri {
                spec: spec.clone(),
                ..resource.uri()
            };
            ResourceError::VersionNotFound(uri.to_string())
        };
        let picked = spec.select(&parsed).ok_or_else(not_found)?.to_string();
        let version = self
            .store
            .get_version(&ctx.tenant_id, resource_id, &picked)
            .await?
            .ok_or_else(not_found)?;
        let versions = versions.into_iter().map(|(_, info)| info).collect();
        Ok(ResourceDetail {
            resource,
            versions,
            version,
        })
    }

    /// Returns a page of the resources the caller sees (its own, and public
    /// ones it does not shadow), filtered, ordered by kind name, name and id.
    #[instrument(
        name = "resource.list_resources",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list(&self, ctx: &RequestContext, query: ListQuery) -> Result<ResourcePage, ResourceError> {
        allow(ctx, Scopes::READ)?;
        let name = non_empty(query.name);
        if let Some(name) = &name {
            uri::validate_name(name).map_err(|why| ResourceError::invalid("INVALID_NAME", why))?;
        }
        let tag = non_empty(query.tag);
        if let Some(tag) = &tag {
            validate_tag(tag)?;
        }
        let text = non_empty(query.query);
        if text.as_ref().is_some_and(|text| text.chars().count() > MAX_QUERY_CHARS) {
            return Err(ResourceError::invalid(
                "INVALID_QUERY",
                format!("search text must be at most {MAX_QUERY_CHARS} characters"),
            ));
        }
        let after = non_empty(query.page_token)
            .map(|token| decode_page_token(&token))
            .transpose()?;
        let page_size = match query.page_size {
            0 => DEFAULT_PAGE_SIZE,
            size => size.min(MAX_PAGE_SIZE),
        };
        let filter = ListFilter {
            kind: query.kind,
            name: name.as_deref(),
            tag: tag.as_deref(),
            query: text.as_deref(),
            after,
        };
        // One more than a page says whether another page follows.
        let mut resources = self
            .store
            .list_resources(&ctx.tenant_id, &filter, page_size + 1)
            .await?;
        let next_page_token = if resources.len() > page_size as usize {
            resources.truncate(page_size as usize);
            resources.last().map(encode_page_token)
        } else {
            None
        };
        Ok(ResourcePage {
            resources,
            next_page_token,
        })
    }

    /// Deletes one exact version of a resource, or the whole resource when
    /// `version` is empty; deleting the last version deletes the resource.
    ///
    /// Refused with `RESOURCE_IN_USE` while a version of another resource
    /// requires a deleted version (see `ResourceStore::delete_versions`),
    /// unless `force`: forced deletes leave dependents that then fail to
    /// resolve with `MISSING_DEPENDENCY`.
    #[instrument(
        name = "resource.delete_resource",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn delete(
        &self,
        ctx: &RequestContext,
        resource_id: &str,
        version: &str,
        force: bool,
    ) -> Result<Deleted, ResourceError> {
        ctx.principal.require_admin().map_err(ResourceError::Denied)?;
        validate_resource_id(resource_id)?;
        let version = match version {
            "" => None,
            exact => Some(parse_version(exact)?.to_string()),
        };
        let resource = self.readable(ctx, resource_id).await?;
        ensure_owner(ctx, &resource)?;
        let deleted = self
            .store
            .delete_versions(&resource, version.as_deref(), force, now_ms())
            .await?;
        if deleted.resource_deleted {
            tracing::info!(
                resource_id,
                versions = deleted.deleted_versions.len(),
                force,
                "resource deleted"
            );
        } else {
            for version in &deleted.deleted_versions {
                tracing::info!(resource_id, version = %version, force, "resource version deleted");
            }
        }
        Ok(deleted)
    }

    /// Resolves a `resource://` URI to an exact version and its closure, and
    /// renders the prompt when the root is a prompt or an agent.
    ///
    /// `variables_json` is a JSON object of strings (empty means none). An
    /// agent's prompt is rendered with the agent's `variables` overlaid by
    /// these. When no variables were given and the prompt cannot be rendered
    /// without them, `rendered_prompt` is absent rather than an error.
    #[instrument(
        name = "resource.resolve_resource",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn resolve(
        &self,
        ctx: &RequestContext,
        uri: &str,
        variables_json: &str,
    ) -> Result<Resolution, ResourceError> {
        allow(ctx, Scopes::READ)?;
        let uri = ResourceUri::parse(uri).map_err(|why| ResourceError::invalid("INVALID_URI", why))?;
        let values = template::parse_variables(variables_json)?;
        let mut resolver = Resolver::new(self.store.as_ref(), &ctx.tenant_id);
        let root = match resolver.lookup(&uri).await? {
            Lookup::NoResource => return Err(ResourceError::ResourceNotFound(uri.without_version().to_string())),
            Lookup::NoVersion => return Err(ResourceError::VersionNotFound(uri.to_string())),
            Lookup::Found(resource, version) => self
                .store
                .get_version(&ctx.tenant_id, &resource.resource_id, &version.to_string())
                .await?
                .ok_or_else(|| ResourceError::VersionNotFound(uri.to_string()))?,
        };
        let dependencies = resolver.closure(&root).await?;
        let rendered = render(&mut resolver, &root, &dependencies, values).await;
        let rendered_prompt = match rendered {
            Ok(rendered) => rendered,
            Err(ResourceError::Invalid { .. }) if variables_json.trim().is_empty() => None,
            Err(err) => return Err(err),
        };
        tracing::debug!(
            resource_id = %root.resource_id,
            version = %root.version,
            dependencies = dependencies.len(),
            "resource resolved"
        );
        let public_uris = std::iter::once(&root)
            .chain(&dependencies)
            .filter(|record| resolver.is_public(record))
            .map(|record| record.uri().to_string())
            .collect();
        Ok(Resolution {
            root,
            dependencies,
            rendered_prompt,
            public_uris,
        })
    }

    /// Returns the caller's own resource of `kind` and `name` (not a public one
    /// of another tenant).
    async fn own_resource(
        &self,
        ctx: &RequestContext,
        kind: Kind,
        name: &str,
    ) -> Result<Option<ResourceRecord>, ResourceError> {
        let found = self.store.find_resource(&ctx.tenant_id, kind, name).await?;
        Ok(found.filter(|resource| resource.tenant_id == ctx.tenant_id))
    }

    /// Fails with `NOT_RESOURCE_OWNER` unless the caller is an admin (or
    /// operator, or service) or the resource's owner: the user who published
    /// its oldest version still kept.
    ///
    /// Derived from the versions rather than stored beside the resource, so
    /// resources registered before this rule have an owner too.
    async fn ensure_publisher(&self, ctx: &RequestContext, resource: &ResourceRecord) -> Result<(), ResourceError> {
        if ctx.principal.require_admin().is_ok() {
            return Ok(());
        }
        let versions = self.store.list_versions(&ctx.tenant_id, &resource.resource_id).await?;
        let owner = versions
            .iter()
            .min_by(|a, b| {
                a.created_at_ms
                    .cmp(&b.created_at_ms)
                    .then_with(|| a.version.cmp(&b.version))
            })
            .map(|first| first.created_by.as_str());
        if owner == Some(ctx.principal.user_id.as_str()) {
            return Ok(());
        }
        Err(ResourceError::NotPublisher(resource.resource_id.clone()))
    }

    /// Returns a resource the caller may read, or `RESOURCE_NOT_FOUND`.
    async fn readable(&self, ctx: &RequestContext, resource_id: &str) -> Result<ResourceRecord, ResourceError> {
        self.store
            .get_resource(&ctx.tenant_id, resource_id)
            .await?
            .ok_or_else(|| ResourceError::ResourceNotFound(resource_id.to_owned()))
    }

    /// Publishes a checked draft into an existing resource the caller owns.
    async fn add_version(
        &self,
        ctx: &RequestContext,
        resource: ResourceRecord,
        draft: Draft,
        update: ResourceUpdate,
    ) -> Result<Published, ResourceError> {
        self.ensure_publisher(ctx, &resource).await?;
        self.check_mcp_server(resource.kind, &draft, resource.visibility)?;
        self.check_dependencies(ctx, resource.kind, &resource.name, resource.visibility, &draft)
            .await?;
        let now = now_ms();
        let version = version_record(ctx, &resource, &draft, now);
        let resource = self.store.add_version(&ctx.tenant_id, &version, &update, now).await?;
        tracing::info!(
            resource_id = %resource.resource_id,
            version = %version.version,
            "resource version published"
        );
        Ok(Published {
            resource,
            version,
            created: false,
        })
    }

    /// Checks that a version of the resource of `kind` and `name` may declare
    /// its dependencies: none is the resource itself, each resolves now, and a
    /// public resource's resolve to public ones (other tenants could not
    /// resolve a private one).
    async fn check_dependencies(
        &self,
        ctx: &RequestContext,
        kind: Kind,
        name: &str,
        visibility: Visibility,
        draft: &Draft,
    ) -> Result<(), ResourceError> {
        let publishing = ResourceUri::exact(kind, name, &draft.version.to_string());
        let mut resolver = Resolver::new(self.store.as_ref(), &ctx.tenant_id);
        for dependency in &draft.dependencies {
            if dependency.kind == kind && dependency.name == name {
                return Err(ResourceError::SelfDependency(publishing.to_string()));
            }
            match resolver.lookup(dependency).await? {
                Lookup::Found(found, _) if visibility == Visibility::Public && !found.is_public() => {
                    return Err(ResourceError::PrivateDependency(dependency.to_string()));
                }
                Lookup::Found(..) => {}
                Lookup::NoResource | Lookup::NoVersion => {
                    return Err(ResourceError::MissingDependency(format!("{publishing} → {dependency}")));
                }
            }
        }
        Ok(())
    }
}

/// Renders the root prompt, or an agent root's prompt, found in its closure.
async fn render(
    resolver: &mut Resolver<'_>,
    root: &VersionRecord,
    closure: &[VersionRecord],
    values: BTreeMap<String, String>,
) -> Result<Option<String>, ResourceError> {
    let corrupt =
        |record: &VersionRecord, why: String| ResourceError::corrupt(format!("content of {}: {why}", record.uri()));
    let (prompt, values) = match root.kind {
        Kind::Prompt => (root, values),
        Kind::Agent => {
            let agent = AgentContent::from_json(&root.content_json).map_err(|why| corrupt(root, why))?;
            let Lookup::Found(resource, version) = resolver.lookup(&agent.prompt).await? else {
                return Err(ResourceError::MissingDependency(format!(
                    "{} → {}",
                    root.uri(),
                    agent.prompt
                )));
            };
            let version = version.to_string();
            let prompt = closure
                .iter()
                .find(|record| record.resource_id == resource.resource_id && record.version == version)
                .ok_or_else(|| ResourceError::MissingDependency(format!("{} → {}", root.uri(), agent.prompt)))?;
            let mut merged = agent.variables;
            merged.extend(values);
            (prompt, merged)
        }
        Kind::Tool | Kind::Sandbox | Kind::Knowledge => return Ok(None),
    };
    let content = PromptContent::from_json(&prompt.content_json).map_err(|why| corrupt(prompt, why))?;
    template::render(&content, &values, &prompt.uri().to_string()).map(Some)
}

/// Checks a version's content and gathers its dependencies: those its content
/// names, then the explicit ones, each once as written.
fn draft(kind: Kind, version: Version, content_json: String, explicit: &[String]) -> Result<Draft, ResourceError> {
    let mut dependencies = content::validate(kind, &content_json)?;
    for text in explicit {
        let uri = ResourceUri::parse(text).map_err(|why| ResourceError::invalid("INVALID_DEPENDENCY", why))?;
        dependencies.push(uri);
    }
    let mut unique: Vec<ResourceUri> = Vec::with_capacity(dependencies.len());
    for uri in dependencies {
        if !unique.iter().any(|seen| seen.to_string() == uri.to_string()) {
            unique.push(uri);
        }
    }
    if unique.len() > MAX_DEPENDENCIES {
        return Err(ResourceError::invalid(
            "INVALID_DEPENDENCY",
            format!("a version declares at most {MAX_DEPENDENCIES} dependencies"),
        ));
    }
    Ok(Draft {
        version,
        content_json,
        dependencies: unique,
    })
}

fn version_record(ctx: &RequestContext, resource: &ResourceRecord, draft: &Draft, now: i64) -> VersionRecord {
    VersionRecord {
        resource_id: resource.resource_id.clone(),
        kind: resource.kind,
        name: resource.name.clone(),
        version: draft.version.to_string(),
        content_json: draft.content_json.clone(),
        dependencies: draft.dependencies.clone(),
        created_at_ms: now,
        created_by: ctx.principal.user_id.clone(),
    }
}

/// Fails unless the caller may change `resource`: its tenant must own it, and
/// a public one takes an admin.
fn ensure_owner(ctx: &RequestContext, resource: &ResourceRecord) -> Result<(), ResourceError> {
    if resource.tenant_id != ctx.tenant_id {
        // Only public resources of other tenants are readable, so this reveals nothing.
        return Err(ResourceError::NotOwner(resource.resource_id.clone()));
    }
    if resource.is_public() {
        ctx.principal.require_admin().map_err(ResourceError::Denied)?;
    }
    Ok(())
}

fn allow(ctx: &RequestContext, scope: Scopes) -> Result<(), ResourceError> {
    ctx.require(scope).map_err(ResourceError::Denied)
}

fn parse_version(text: &str) -> Result<Version, ResourceError> {
    version::parse_version(text).map_err(|why| ResourceError::invalid("INVALID_VERSION", why))
}

fn validate_resource_id(resource_id: &str) -> Result<(), ResourceError> {
    if resource_id.is_empty()
        || resource_id.len() > MAX_RESOURCE_ID_BYTES
        || !resource_id.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ResourceError::invalid(
            "INVALID_RESOURCE_ID",
            "resource id must be 1 to 128 printable ascii characters",
        ));
    }
    Ok(())
}

fn validate_description(description: String) -> Result<String, ResourceError> {
    if description.chars().count() > MAX_DESCRIPTION_CHARS {
        return Err(ResourceError::invalid(
            "INVALID_DESCRIPTION",
            format!("description must be at most {MAX_DESCRIPTION_CHARS} characters"),
        ));
    }
    Ok(description)
}

/// Returns the tags, each once, in the order given.
fn validate_tags(tags: Vec<String>) -> Result<Vec<String>, ResourceError> {
    let mut unique: Vec<String> = Vec::with_capacity(tags.len());
    for tag in tags {
        validate_tag(&tag)?;
        if !unique.contains(&tag) {
            unique.push(tag);
        }
    }
    if unique.len() > MAX_TAGS {
        return Err(ResourceError::invalid(
            "INVALID_TAG",
            format!("a resource carries at most {MAX_TAGS} tags"),
        ));
    }
    Ok(unique)
}

/// Checks a tag: `[a-z0-9][a-z0-9._-]{0,63}`.
fn validate_tag(tag: &str) -> Result<(), ResourceError> {
    let starts_well = tag
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !starts_well || tag.len() > MAX_TAG_CHARS || !is_tag_text(tag) {
        return Err(ResourceError::invalid(
            "INVALID_TAG",
            format!(
                "tag {tag:?} must be 1 to {MAX_TAG_CHARS} lowercase letters, digits and . _ -, starting with a letter or digit"
            ),
        ));
    }
    Ok(())
}

/// Returns whether every character of `text` may appear in a tag.
pub(crate) fn is_tag_text(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
}

/// Returns the token of the page after `last`: its order key, base64url.
fn encode_page_token(last: &ResourceRecord) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}/{}/{}", last.kind, last.name, last.resource_id))
}

/// Reads a page token; names and kinds cannot hold `/`, so it splits cleanly.
fn decode_page_token(token: &str) -> Result<PageKey, ResourceError> {
    let invalid = || ResourceError::invalid("INVALID_PAGE_TOKEN", "the page token is not one this service made");
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let mut parts = text.splitn(3, '/');
    let (Some(kind), Some(name), Some(resource_id)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(invalid());
    };
    let kind = Kind::parse(kind).ok_or_else(invalid)?;
    uri::validate_name(name).map_err(|_| invalid())?;
    validate_resource_id(resource_id).map_err(|_| invalid())?;
    Ok(PageKey {
        kind,
        name: name.to_owned(),
        resource_id: resource_id.to_owned(),
    })
}

fn non_empty(value: Option<String>) -> Option<String> {
    value.filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_follow_the_documented_alphabet() {
        let longest = "t".repeat(64);
        for good in ["a", "0", "sales", "v1.2_b-c", longest.as_str()] {
            assert!(validate_tag(good).is_ok(), "{good}");
        }
        let too_long = "t".repeat(65);
        for bad in ["", "A", "-a", "a b", "a\"b", "é", too_long.as_str()] {
            assert!(validate_tag(bad).is_err(), "{bad}");
        }
        let many: Vec<String> = (0..33).map(|i| format!("t{i}")).collect();
        assert!(validate_tags(many).is_err());
        assert_eq!(
            validate_tags(vec!["a".into(), "b".into(), "a".into()]).unwrap(),
            ["a", "b"]
        );
    }

    #[test]
    fn page_tokens_round_trip_and_reject_forgeries() {
        let last = ResourceRecord {
            resource_id: "res_1".into(),
            tenant_id: "t".into(),
            kind: Kind::Tool,
            name: "web.search".into(),
            visibility: Visibility::Private,
            description: String::new(),
            tags: Vec::new(),
            latest_version: "1.0.0".into(),
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        let key = decode_page_token(&encode_page_token(&last)).unwrap();
        assert_eq!(
            (key.kind, key.name.as_str(), key.resource_id.as_str()),
            (Kind::Tool, "web.search", "res_1")
        );
        for forged in ["!!", "bm90IGEga2V5", &URL_SAFE_NO_PAD.encode("widget/a/res_1")] {
            assert!(matches!(
                decode_page_token(forged),
                Err(ResourceError::Invalid {
                    reason: "INVALID_PAGE_TOKEN",
                    ..
                })
            ));
        }
    }
}
