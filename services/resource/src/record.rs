//! The domain types of the resource service: what the store keeps and the
//! service hands out. Proto types stay in `grpc.rs`; rows stay in `store`.

use crate::kind::Kind;
use crate::uri::ResourceUri;

/// Who may read a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Visibility {
    /// Only its tenant.
    Private,
    /// Every tenant; published by an operator.
    Public,
}

impl Visibility {
    /// Returns the name stored in the `visibility` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Visibility::Private => "private",
            Visibility::Public => "public",
        }
    }

    /// Parses a stored visibility name.
    pub fn parse(name: &str) -> Option<Visibility> {
        match name {
            "private" => Some(Visibility::Private),
            "public" => Some(Visibility::Public),
            _ => None,
        }
    }
}

/// A named, versioned thing of one kind, owned by a tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceRecord {
    /// `res_…`, unique across tenants.
    pub resource_id: String,
    /// The tenant that owns it.
    pub tenant_id: String,
    pub kind: Kind,
    /// Unique per tenant and kind: `[a-z0-9][a-z0-9._-]{0,127}`.
    pub name: String,
    pub visibility: Visibility,
    /// Empty when none; the latest write wins.
    pub description: String,
    /// The latest write wins.
    pub tags: Vec<String>,
    /// The highest published version (stable before pre-release).
    pub latest_version: String,
    pub created_at_ms: i64,
    /// When a version was last published or deleted, or the description or tags changed.
    pub updated_at_ms: i64,
}

impl ResourceRecord {
    /// Returns the resource's URI without a version: `resource://<kind>s/<name>`.
    pub fn uri(&self) -> ResourceUri {
        ResourceUri::unversioned(self.kind, &self.name)
    }

    /// Returns whether every tenant may read it.
    pub fn is_public(&self) -> bool {
        self.visibility == Visibility::Public
    }
}

/// One published version without its content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionInfo {
    /// A semantic version, without build metadata.
    pub version: String,
    /// The requirements this version declared, as written.
    pub dependencies: Vec<ResourceUri>,
    pub created_at_ms: i64,
    /// The user who published it.
    pub created_by: String,
}

/// One published version with its content; never changes once stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionRecord {
    pub resource_id: String,
    pub kind: Kind,
    pub name: String,
    /// A semantic version, without build metadata.
    pub version: String,
    /// The validated content, a JSON object of the kind's schema, kept as sent.
    pub content_json: String,
    /// The requirements the content names and those declared beside it, as
    /// written (ranges stay ranges), each once.
    pub dependencies: Vec<ResourceUri>,
    pub created_at_ms: i64,
    /// The user who published it.
    pub created_by: String,
}

impl VersionRecord {
    /// Returns the exact URI of this version: `resource://<kind>s/<name>@<version>`.
    pub fn uri(&self) -> ResourceUri {
        ResourceUri::exact(self.kind, &self.name, &self.version)
    }
}

/// A resource with every published version (highest first) and one version's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceDetail {
    pub resource: ResourceRecord,
    pub versions: Vec<VersionInfo>,
    pub version: VersionRecord,
}

/// What `RegisterResource` asks for; validated by the service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewResource {
    pub kind: Kind,
    pub name: String,
    /// A semantic version such as `1.0.0`.
    pub version: String,
    pub content_json: String,
    /// Replaces the resource's description when not empty.
    pub description: String,
    /// Replaces the resource's tags when not empty.
    pub tags: Vec<String>,
    /// Requirements beyond those the content names, as `resource://` URIs.
    pub dependencies: Vec<String>,
    /// Whether every tenant may read it (operators only, at creation).
    pub public: bool,
}

/// What `PublishVersion` asks for; validated by the service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewVersion {
    pub resource_id: String,
    /// A semantic version such as `1.1.0`.
    pub version: String,
    pub content_json: String,
    /// Requirements beyond those the content names, as `resource://` URIs.
    pub dependencies: Vec<String>,
    /// Replaces the resource's description when set (empty clears it).
    pub description: Option<String>,
    /// Replaces the resource's tags when set (empty clears them).
    pub tags: Option<Vec<String>>,
}

/// The changes a publish makes to its resource; `None` leaves a field as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceUpdate {
    pub description: Option<String>,
    pub tags: Option<Vec<String>>,
}

/// The outcome of a registration or a publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    /// The resource after the publish.
    pub resource: ResourceRecord,
    pub version: VersionRecord,
    /// Whether the publish created the resource (its first version).
    pub created: bool,
}

/// Which resources a listing returns; every set filter must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListQuery {
    pub kind: Option<Kind>,
    /// Exact name.
    pub name: Option<String>,
    /// Resources carrying this tag.
    pub tag: Option<String>,
    /// Case-insensitive text in the name, description or a tag.
    pub query: Option<String>,
    /// At most this many; 0 means the default (50), more than 200 means 200.
    pub page_size: u32,
    /// From a previous page's `next_page_token`.
    pub page_token: Option<String>,
}

/// One page of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourcePage {
    /// Ordered by kind name, then name, then resource id.
    pub resources: Vec<ResourceRecord>,
    /// `None` on the last page.
    pub next_page_token: Option<String>,
}

/// The outcome of a delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deleted {
    /// Highest first.
    pub deleted_versions: Vec<String>,
    /// Whether the resource itself is gone (its last version was deleted).
    pub resource_deleted: bool,
}

/// A resolved URI: the exact version it named and everything it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolution {
    pub root: VersionRecord,
    /// The transitive dependencies, each (resource, version) once, each after
    /// its own dependencies; the root is not repeated.
    pub dependencies: Vec<VersionRecord>,
    /// The root prompt, or an agent's prompt, rendered with the variables.
    pub rendered_prompt: Option<String>,
    /// The exact URIs, among the root and its dependencies, of public resources.
    pub public_uris: Vec<String>,
}
