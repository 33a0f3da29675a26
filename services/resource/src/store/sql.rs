//! The statements and the `ResourceStore` implementation shared by SQLite and Postgres.
//!
//! Both dialects accept `$N` placeholders, `ON CONFLICT … DO NOTHING`, partial
//! indexes, row-value comparisons and `LIKE … ESCAPE`, so one text serves both.
//! The implementation is a macro expanded once per concrete pool type: code
//! generic over `sqlx::Database` needs higher-ranked `Executor` bounds that the
//! `Send` futures of `async_trait` do not satisfy.
//!
//! Every transaction starts with a write. SQLite then takes its write lock up
//! front, where `busy_timeout` applies, instead of upgrading a read snapshot,
//! which fails at once with `SQLITE_BUSY` when another writer got in between;
//! Postgres locks the resource row, which serializes writes to one resource.

use semver::Version;
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::error::ResourceError;
use crate::kind::Kind;
use crate::record::{ResourceRecord, VersionInfo, Visibility};
use crate::uri::ResourceUri;
use crate::version;

/// How many dependents a `RESOURCE_IN_USE` message names.
const DEPENDENTS_NAMED: usize = 5;

macro_rules! resource_columns {
    () => {
        "r.resource_id, r.tenant_id, r.kind, r.name, r.visibility, r.description, r.tags_json, \
         r.latest_version, r.created_at_ms, r.updated_at_ms"
    };
}

/// The condition that resource `r` is readable by tenant `$1`.
macro_rules! readable {
    () => {
        "(r.tenant_id = $1 OR r.visibility = 'public')"
    };
}

/// The caller's own resource first, else the (single) public one.
pub(super) const FIND_RESOURCE: &str = concat!(
    "SELECT ",
    resource_columns!(),
    " FROM resources r WHERE r.kind = $2 AND r.name = $3 AND ",
    readable!(),
    " ORDER BY CASE WHEN r.tenant_id = $1 THEN 0 ELSE 1 END LIMIT 1"
);
pub(super) const GET_RESOURCE: &str = concat!(
    "SELECT ",
    resource_columns!(),
    " FROM resources r WHERE r.resource_id = $2 AND ",
    readable!()
);
pub(super) const SELECT_RESOURCE: &str = concat!(
    "SELECT ",
    resource_columns!(),
    " FROM resources r WHERE r.resource_id = $1"
);

pub(super) const VERSION_NUMBERS: &str = concat!(
    "SELECT v.version FROM resource_versions v JOIN resources r ON r.resource_id = v.resource_id \
     WHERE v.resource_id = $2 AND ",
    readable!()
);
pub(super) const LIST_VERSIONS: &str = concat!(
    "SELECT v.version, v.created_at_ms, v.created_by FROM resource_versions v \
     JOIN resources r ON r.resource_id = v.resource_id WHERE v.resource_id = $2 AND ",
    readable!()
);
pub(super) const LIST_DEPENDENCIES: &str = "\
    SELECT version, uri FROM resource_dependencies WHERE resource_id = $1 ORDER BY version, position";
pub(super) const GET_VERSION: &str = concat!(
    "SELECT v.resource_id, r.kind, r.name, v.version, v.content_json, v.created_at_ms, v.created_by \
     FROM resource_versions v JOIN resources r ON r.resource_id = v.resource_id \
     WHERE v.resource_id = $2 AND v.version = $3 AND ",
    readable!()
);
pub(super) const VERSION_DEPENDENCIES: &str = "\
    SELECT uri FROM resource_dependencies WHERE resource_id = $1 AND version = $2 ORDER BY position";

/// Inserts nothing when the tenant has the kind and name already; a second
/// public one of the kind and name fails on `resources_public_name`.
pub(super) const INSERT_RESOURCE: &str = "\
    INSERT INTO resources (resource_id, tenant_id, kind, name, visibility, description, tags_json, \
                           latest_version, created_at_ms, updated_at_ms) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
    ON CONFLICT (tenant_id, kind, name) DO NOTHING";
pub(super) const INSERT_VERSION: &str = "\
    INSERT INTO resource_versions (resource_id, version, content_json, created_at_ms, created_by) \
    VALUES ($1, $2, $3, $4, $5) \
    ON CONFLICT (resource_id, version) DO NOTHING";
pub(super) const INSERT_DEPENDENCY: &str = "\
    INSERT INTO resource_dependencies (resource_id, version, position, uri, dep_kind, dep_name) \
    VALUES ($1, $2, $3, $4, $5, $6)";
/// `$3` says whether the description changes to `$4`, `$5` whether the tags change to `$6`.
pub(super) const UPDATE_RESOURCE: &str = "\
    UPDATE resources SET description = CASE WHEN $3 THEN $4 ELSE description END, \
                         tags_json = CASE WHEN $5 THEN $6 ELSE tags_json END, \
                         updated_at_ms = $7 \
    WHERE resource_id = $1 AND tenant_id = $2";
pub(super) const SET_LATEST: &str = "UPDATE resources SET latest_version = $2 WHERE resource_id = $1";
pub(super) const TOUCH_RESOURCE: &str = "\
    UPDATE resources SET updated_at_ms = $3 WHERE resource_id = $1 AND tenant_id = $2";
pub(super) const OWN_VERSION_NUMBERS: &str = "SELECT version FROM resource_versions WHERE resource_id = $1";

/// The versions of other resources that declare a requirement on kind `$1`
/// and name `$2` and would get resource `$3` (of tenant `$4`, public when
/// `$5`): those of its tenant, and when it is public those of tenants without
/// their own resource of that kind and name.
pub(super) const DEPENDENTS: &str = "\
    SELECT r.tenant_id, r.kind, r.name, d.version, d.uri FROM resource_dependencies d \
    JOIN resources r ON r.resource_id = d.resource_id \
    WHERE d.dep_kind = $1 AND d.dep_name = $2 AND d.resource_id <> $3 \
      AND (r.tenant_id = $4 OR ($5 AND NOT EXISTS ( \
          SELECT 1 FROM resources own WHERE own.tenant_id = r.tenant_id \
            AND own.kind = d.dep_kind AND own.name = d.dep_name AND own.resource_id <> $3))) \
    ORDER BY r.kind, r.name, d.version";
pub(super) const DELETE_VERSION: &str = "DELETE FROM resource_versions WHERE resource_id = $1 AND version = $2";
pub(super) const DELETE_RESOURCE: &str = "DELETE FROM resources WHERE resource_id = $1";

/// `$2` kind, `$3` name, `$4` tag pattern, `$5` text pattern, `$6` text pattern
/// for tags (NULL when the text cannot be part of a tag), `$7..$9` the key the
/// page starts after. Patterns are `LIKE` patterns escaped with `\`; text is
/// matched lowercased (SQLite's `LOWER` folds ASCII only).
pub(super) const LIST_RESOURCES: &str = concat!(
    "SELECT ",
    resource_columns!(),
    " FROM resources r \
     WHERE (r.tenant_id = $1 OR (r.visibility = 'public' AND NOT EXISTS ( \
             SELECT 1 FROM resources own WHERE own.tenant_id = $1 AND own.kind = r.kind AND own.name = r.name))) \
       AND ($2 IS NULL OR r.kind = $2) \
       AND ($3 IS NULL OR r.name = $3) \
       AND ($4 IS NULL OR r.tags_json LIKE $4 ESCAPE '\\') \
       AND ($5 IS NULL OR LOWER(r.name) LIKE $5 ESCAPE '\\' OR LOWER(r.description) LIKE $5 ESCAPE '\\' \
            OR r.tags_json LIKE $6 ESCAPE '\\') \
       AND ($7 IS NULL OR (r.kind, r.name, r.resource_id) > ($7, $8, $9)) \
     ORDER BY r.kind, r.name, r.resource_id \
     LIMIT $10"
);

/// Returns `text` as a `LIKE` pattern matching it literally, escaped with `\`.
fn escape_like(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// Returns the pattern of `tags_json` holding `tag` exactly: tags cannot hold
/// quotes, so `"<tag>"` only matches a whole tag.
pub(super) fn tag_pattern(tag: &str) -> String {
    format!("%\"{}\"%", escape_like(tag))
}

/// Returns the patterns of a text search: one for the name and description,
/// and one for the tags when the text could be part of a tag (otherwise it
/// could only match the JSON punctuation between them).
pub(super) fn query_patterns(query: &str) -> (String, Option<String>) {
    let lower = query.to_lowercase();
    let pattern = format!("%{}%", escape_like(&lower));
    let in_tags = crate::service::is_tag_text(&lower).then(|| pattern.clone());
    (pattern, in_tags)
}

/// Returns tags as stored.
pub(super) fn encode_tags(tags: &[String]) -> Result<String, ResourceError> {
    serde_json::to_string(tags).map_err(|err| ResourceError::corrupt(format!("tags do not encode: {err}")))
}

/// Returns the latest of stored version strings, or `None` when there are none.
pub(super) fn latest_of(resource_id: &str, versions: &[String]) -> Result<Option<String>, ResourceError> {
    let parsed = version::parse_stored(versions)
        .map_err(|bad| ResourceError::corrupt(format!("resource {resource_id} has version {bad:?}")))?;
    Ok(crate::version::VersionSpec::latest()
        .select(&parsed)
        .map(Version::to_string))
}

/// Reads a row of `resource_columns!`.
pub(super) fn resource_from_row<'r, R>(row: &'r R) -> Result<ResourceRecord, ResourceError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    &'r str: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let resource_id: String = row.try_get("resource_id")?;
    let corrupt = |what: &str| ResourceError::corrupt(format!("resource {resource_id} has {what}"));
    let kind: &str = row.try_get("kind")?;
    let kind = Kind::parse(kind).ok_or_else(|| corrupt(&format!("kind {kind:?}")))?;
    let visibility: &str = row.try_get("visibility")?;
    let visibility = Visibility::parse(visibility).ok_or_else(|| corrupt(&format!("visibility {visibility:?}")))?;
    let tags: &str = row.try_get("tags_json")?;
    let tags: Vec<String> = serde_json::from_str(tags).map_err(|_| corrupt(&format!("tags {tags:?}")))?;
    Ok(ResourceRecord {
        tenant_id: row.try_get("tenant_id")?,
        kind,
        name: row.try_get("name")?,
        visibility,
        description: row.try_get("description")?,
        tags,
        latest_version: row.try_get("latest_version")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        resource_id,
    })
}

/// Reads a row of `LIST_VERSIONS`, without its dependencies.
pub(super) fn version_info_from_row<'r, R>(row: &'r R) -> Result<VersionInfo, ResourceError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(VersionInfo {
        version: row.try_get("version")?,
        dependencies: Vec::new(),
        created_at_ms: row.try_get("created_at_ms")?,
        created_by: row.try_get("created_by")?,
    })
}

/// Parses a stored dependency URI.
pub(super) fn stored_uri(resource_id: &str, uri: &str) -> Result<ResourceUri, ResourceError> {
    ResourceUri::parse(uri)
        .map_err(|why| ResourceError::corrupt(format!("resource {resource_id} has dependency {uri:?}: {why}")))
}

/// A `DEPENDENTS` row: (tenant_id, kind, name, version, uri).
pub(super) type DependentRow = (String, String, String, String, String);

/// The dependents that hold on to a version a delete would remove.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Dependents {
    /// Exact URIs of the owner tenant's dependents, each once, in order.
    pub own: Vec<String>,
    /// How many versions of other tenants' resources depend on it; their
    /// names are not the owner's to see.
    pub foreign: usize,
}

/// Returns the dependents among `rows` whose requirement holds on to one of
/// `targets` among `versions`; `tenant_id` owns the resource being deleted.
pub(super) fn claiming_dependents(
    rows: Vec<DependentRow>,
    tenant_id: &str,
    targets: &[Version],
    versions: &[Version],
) -> Result<Dependents, ResourceError> {
    let mut dependents = Dependents::default();
    for (dependent_tenant, kind, name, dependent_version, uri) in rows {
        let requirement = stored_uri(&name, &uri)?;
        if !targets.iter().any(|target| requirement.spec.claims(target, versions)) {
            continue;
        }
        if dependent_tenant != tenant_id {
            dependents.foreign += 1;
            continue;
        }
        let kind = Kind::parse(&kind).ok_or_else(|| ResourceError::corrupt(format!("resource kind {kind:?}")))?;
        let dependent = ResourceUri::exact(kind, &name, &dependent_version).to_string();
        if !dependents.own.contains(&dependent) {
            dependents.own.push(dependent);
        }
    }
    Ok(dependents)
}

/// Names the dependents of a refused delete: the first few of the owner's,
/// how many more, and how many of other tenants.
pub(super) fn name_dependents(dependents: &Dependents) -> String {
    let mut parts: Vec<String> = dependents.own.iter().take(DEPENDENTS_NAMED).cloned().collect();
    let more = dependents.own.len().saturating_sub(DEPENDENTS_NAMED);
    if more > 0 {
        parts.push(format!("{more} more"));
    }
    match dependents.foreign {
        0 => {}
        1 => parts.push("1 resource version of another tenant".to_owned()),
        n => parts.push(format!("{n} resource versions of other tenants")),
    }
    match parts.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Implements `ResourceStore` for `$store`, whose `pool` is a `sqlx::Pool<$db>`.
macro_rules! impl_resource_store {
    ($store:ty, $db:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::ResourceStore for $store {
            async fn find_resource(
                &self,
                tenant_id: &str,
                kind: $crate::kind::Kind,
                name: &str,
            ) -> Result<Option<$crate::record::ResourceRecord>, $crate::error::ResourceError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::FIND_RESOURCE)
                    .bind(tenant_id)
                    .bind(kind.as_str())
                    .bind(name)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(|row| sql::resource_from_row(row)).transpose()
            }

            async fn get_resource(
                &self,
                tenant_id: &str,
                resource_id: &str,
            ) -> Result<Option<$crate::record::ResourceRecord>, $crate::error::ResourceError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::GET_RESOURCE)
                    .bind(tenant_id)
                    .bind(resource_id)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(|row| sql::resource_from_row(row)).transpose()
            }

            async fn version_numbers(
                &self,
                tenant_id: &str,
                resource_id: &str,
            ) -> Result<Vec<String>, $crate::error::ResourceError> {
                use $crate::store::sql;
                Ok(sqlx::query_scalar::<$db, String>(sql::VERSION_NUMBERS)
                    .bind(tenant_id)
                    .bind(resource_id)
                    .fetch_all(&self.pool)
                    .await?)
            }

            async fn list_versions(
                &self,
                tenant_id: &str,
                resource_id: &str,
            ) -> Result<Vec<$crate::record::VersionInfo>, $crate::error::ResourceError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_VERSIONS)
                    .bind(tenant_id)
                    .bind(resource_id)
                    .fetch_all(&self.pool)
                    .await?;
                let mut versions = rows
                    .iter()
                    .map(|row| sql::version_info_from_row(row))
                    .collect::<Result<Vec<_>, _>>()?;
                if versions.is_empty() {
                    return Ok(versions);
                }
                let dependencies = sqlx::query_as::<$db, (String, String)>(sql::LIST_DEPENDENCIES)
                    .bind(resource_id)
                    .fetch_all(&self.pool)
                    .await?;
                for (version, uri) in dependencies {
                    let uri = sql::stored_uri(resource_id, &uri)?;
                    if let Some(info) = versions.iter_mut().find(|info| info.version == version) {
                        info.dependencies.push(uri);
                    }
                }
                Ok(versions)
            }

            async fn get_version(
                &self,
                tenant_id: &str,
                resource_id: &str,
                version: &str,
            ) -> Result<Option<$crate::record::VersionRecord>, $crate::error::ResourceError> {
                use $crate::store::sql;
                let row =
                    sqlx::query_as::<$db, (String, String, String, String, String, i64, String)>(sql::GET_VERSION)
                        .bind(tenant_id)
                        .bind(resource_id)
                        .bind(version)
                        .fetch_optional(&self.pool)
                        .await?;
                let Some((resource_id, kind, name, version, content_json, created_at_ms, created_by)) = row else {
                    return Ok(None);
                };
                let kind = $crate::kind::Kind::parse(&kind).ok_or_else(|| {
                    $crate::error::ResourceError::corrupt(format!("resource {resource_id} has kind {kind:?}"))
                })?;
                let dependencies = sqlx::query_scalar::<$db, String>(sql::VERSION_DEPENDENCIES)
                    .bind(&resource_id)
                    .bind(&version)
                    .fetch_all(&self.pool)
                    .await?
                    .iter()
                    .map(|uri| sql::stored_uri(&resource_id, uri))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Some($crate::record::VersionRecord {
                    resource_id,
                    kind,
                    name,
                    version,
                    content_json,
                    dependencies,
                    created_at_ms,
                    created_by,
                }))
            }

            async fn create_resource(
                &self,
                resource: &$crate::record::ResourceRecord,
                version: &$crate::record::VersionRecord,
            ) -> Result<bool, $crate::error::ResourceError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                let inserted = sqlx::query(sql::INSERT_RESOURCE)
                    .bind(&resource.resource_id)
                    .bind(&resource.tenant_id)
                    .bind(resource.kind.as_str())
                    .bind(&resource.name)
                    .bind(resource.visibility.as_str())
                    .bind(&resource.description)
                    .bind(sql::encode_tags(&resource.tags)?)
                    .bind(&version.version)
                    .bind(resource.created_at_ms)
                    .bind(resource.updated_at_ms)
                    .execute(&mut *tx)
                    .await
                    .map_err(|err| match &err {
                        // The only other unique index: one public resource per kind and name.
                        sqlx::Error::Database(db) if db.is_unique_violation() => {
                            $crate::error::ResourceError::PublicNameTaken(resource.uri().to_string())
                        }
                        _ => err.into(),
                    })?
                    .rows_affected();
                if inserted == 0 {
                    tx.rollback().await?;
                    return Ok(false);
                }
                Self::insert_version(&mut tx, version).await?;
                tx.commit().await?;
                Ok(true)
            }

            async fn add_version(
                &self,
                tenant_id: &str,
                version: &$crate::record::VersionRecord,
                update: &$crate::record::ResourceUpdate,
                now_ms: i64,
            ) -> Result<$crate::record::ResourceRecord, $crate::error::ResourceError> {
                use $crate::store::sql;
                let tags = update.tags.as_deref().map(sql::encode_tags).transpose()?;
                let mut tx = self.pool.begin().await?;
                // Locks the resource first: publishes to one resource take turns.
                let updated = sqlx::query(sql::UPDATE_RESOURCE)
                    .bind(&version.resource_id)
                    .bind(tenant_id)
                    .bind(update.description.is_some())
                    .bind(update.description.as_deref().unwrap_or_default())
                    .bind(tags.is_some())
                    .bind(tags.as_deref().unwrap_or_default())
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if updated == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::ResourceError::ResourceNotFound(
                        version.resource_id.clone(),
                    ));
                }
                if !Self::insert_version(&mut tx, version).await? {
                    tx.rollback().await?;
                    return Err($crate::error::ResourceError::VersionExists(
                        version.uri().to_string(),
                    ));
                }
                let versions = sqlx::query_scalar::<$db, String>(sql::OWN_VERSION_NUMBERS)
                    .bind(&version.resource_id)
                    .fetch_all(&mut *tx)
                    .await?;
                let latest = sql::latest_of(&version.resource_id, &versions)?.unwrap_or_default();
                sqlx::query(sql::SET_LATEST)
                    .bind(&version.resource_id)
                    .bind(&latest)
                    .execute(&mut *tx)
                    .await?;
                let row = sqlx::query(sql::SELECT_RESOURCE)
                    .bind(&version.resource_id)
                    .fetch_one(&mut *tx)
                    .await?;
                let resource = sql::resource_from_row(&row)?;
                tx.commit().await?;
                Ok(resource)
            }

            async fn list_resources(
                &self,
                tenant_id: &str,
                filter: &$crate::store::ListFilter<'_>,
                limit: u32,
            ) -> Result<Vec<$crate::record::ResourceRecord>, $crate::error::ResourceError> {
                use $crate::store::sql;
                let tag = filter.tag.map(sql::tag_pattern);
                let (text, text_in_tags) = match filter.query {
                    Some(query) => {
                        let (text, in_tags) = sql::query_patterns(query);
                        (Some(text), in_tags)
                    }
                    None => (None, None),
                };
                let after = filter.after.as_ref();
                let rows = sqlx::query(sql::LIST_RESOURCES)
                    .bind(tenant_id)
                    .bind(filter.kind.map($crate::kind::Kind::as_str))
                    .bind(filter.name)
                    .bind(tag)
                    .bind(text)
                    .bind(text_in_tags)
                    .bind(after.map(|key| key.kind.as_str()))
                    .bind(after.map(|key| key.name.as_str()))
                    .bind(after.map(|key| key.resource_id.as_str()))
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::resource_from_row(row)).collect()
            }

            async fn delete_versions(
                &self,
                resource: &$crate::record::ResourceRecord,
                version: Option<&str>,
                force: bool,
                now_ms: i64,
            ) -> Result<$crate::record::Deleted, $crate::error::ResourceError> {
                use $crate::store::sql;
                let resource_id = resource.resource_id.as_str();
                let corrupt = |bad: String| {
                    $crate::error::ResourceError::corrupt(format!("resource {resource_id} has version {bad:?}"))
                };
                let mut tx = self.pool.begin().await?;
                let touched = sqlx::query(sql::TOUCH_RESOURCE)
                    .bind(resource_id)
                    .bind(&resource.tenant_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if touched == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::ResourceError::ResourceNotFound(
                        resource_id.to_owned(),
                    ));
                }
                let stored = sqlx::query_scalar::<$db, String>(sql::OWN_VERSION_NUMBERS)
                    .bind(resource_id)
                    .fetch_all(&mut *tx)
                    .await?;
                let versions = $crate::version::parse_stored(&stored).map_err(corrupt)?;
                let mut targets: Vec<semver::Version> = match version {
                    Some(exact) => match versions.iter().find(|v| v.to_string() == exact) {
                        Some(found) => vec![found.clone()],
                        None => {
                            tx.rollback().await?;
                            return Err($crate::error::ResourceError::VersionNotFound(
                                $crate::uri::ResourceUri::exact(resource.kind, &resource.name, exact).to_string(),
                            ));
                        }
                    },
                    None => versions.clone(),
                };
                targets.sort_unstable_by(|a, b| b.cmp(a));
                if !force {
                    let rows = sqlx::query_as::<$db, sql::DependentRow>(sql::DEPENDENTS)
                        .bind(resource.kind.as_str())
                        .bind(&resource.name)
                        .bind(resource_id)
                        .bind(&resource.tenant_id)
                        .bind(resource.is_public())
                        .fetch_all(&mut *tx)
                        .await?;
                    let dependents = sql::claiming_dependents(rows, &resource.tenant_id, &targets, &versions)?;
                    if dependents != sql::Dependents::default() {
                        tx.rollback().await?;
                        let target = match version {
                            Some(exact) => $crate::uri::ResourceUri::exact(resource.kind, &resource.name, exact),
                            None => resource.uri(),
                        };
                        return Err($crate::error::ResourceError::InUse {
                            target: target.to_string(),
                            dependents: sql::name_dependents(&dependents),
                        });
                    }
                }
                let resource_deleted = targets.len() == versions.len();
                if resource_deleted {
                    // The cascade takes the versions and their dependencies.
                    sqlx::query(sql::DELETE_RESOURCE)
                        .bind(resource_id)
                        .execute(&mut *tx)
                        .await?;
                } else {
                    for target in &targets {
                        sqlx::query(sql::DELETE_VERSION)
                            .bind(resource_id)
                            .bind(target.to_string())
                            .execute(&mut *tx)
                            .await?;
                    }
                    let remaining: Vec<String> = versions
                        .iter()
                        .filter(|v| !targets.contains(v))
                        .map(ToString::to_string)
                        .collect();
                    let latest = sql::latest_of(resource_id, &remaining)?.unwrap_or_default();
                    sqlx::query(sql::SET_LATEST)
                        .bind(resource_id)
                        .bind(&latest)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok($crate::record::Deleted {
                    deleted_versions: targets.iter().map(ToString::to_string).collect(),
                    resource_deleted,
                })
            }
        }

        impl $store {
            /// Inserts a version and its dependencies; `false` when the version exists.
            async fn insert_version(
                tx: &mut sqlx::Transaction<'static, $db>,
                version: &$crate::record::VersionRecord,
            ) -> Result<bool, $crate::error::ResourceError> {
                use $crate::store::sql;
                let inserted = sqlx::query(sql::INSERT_VERSION)
                    .bind(&version.resource_id)
                    .bind(&version.version)
                    .bind(&version.content_json)
                    .bind(version.created_at_ms)
                    .bind(&version.created_by)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                if inserted == 0 {
                    return Ok(false);
                }
                for (position, uri) in (0_i64..).zip(&version.dependencies) {
                    sqlx::query(sql::INSERT_DEPENDENCY)
                        .bind(&version.resource_id)
                        .bind(&version.version)
                        .bind(position)
                        .bind(uri.to_string())
                        .bind(uri.kind.as_str())
                        .bind(&uri.name)
                        .execute(&mut **tx)
                        .await?;
                }
                Ok(true)
            }
        }
    };
}

pub(super) use impl_resource_store;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn like_patterns_match_literally() {
        assert_eq!(escape_like(r"50%_a\b"), r"50\%\_a\\b");
        assert_eq!(tag_pattern("a_b"), r#"%"a\_b"%"#);
        assert_eq!(
            query_patterns("Sales"),
            ("%sales%".to_owned(), Some("%sales%".to_owned()))
        );
        assert_eq!(query_patterns("a,b").1, None, "a comma can only match between tags");
    }

    #[test]
    fn in_use_messages_name_five_of_the_owners_dependents() {
        let named = |own: usize, foreign: usize| {
            name_dependents(&Dependents {
                own: (1..=own).map(|i| format!("d{i}")).collect(),
                foreign,
            })
        };
        assert_eq!(named(1, 0), "d1");
        assert_eq!(named(2, 0), "d1 and d2");
        assert_eq!(named(7, 0), "d1, d2, d3, d4, d5 and 2 more");
        assert_eq!(named(1, 1), "d1 and 1 resource version of another tenant");
        assert_eq!(
            named(6, 3),
            "d1, d2, d3, d4, d5, 1 more and 3 resource versions of other tenants"
        );
        assert_eq!(named(0, 2), "2 resource versions of other tenants");
    }
}
