//! Dependency resolution: from a requirement to an exact version, and from a
//! version to its closure.
//!
//! Requirements resolve as the caller sees the store: its own resource of the
//! kind and name, else the public one; the highest version that matches. A
//! closure is walked depth first, so each (resource, version) comes after
//! everything it needs. Ranges resolve to the newest match, so a graph that
//! had no cycle when published can gain one later; it is reported, not looped.

use std::collections::HashMap;

use semver::Version;

use crate::error::ResourceError;
use crate::kind::Kind;
use crate::record::{ResourceRecord, VersionRecord};
use crate::store::ResourceStore;
use crate::uri::ResourceUri;
use crate::version;

/// What a requirement resolves to.
pub(crate) enum Lookup {
    /// No resource of the kind and name is visible.
    NoResource,
    /// The resource exists but no version matches.
    NoVersion,
    /// The resource and the version picked.
    Found(Box<ResourceRecord>, Version),
}

/// Resolves requirements for one tenant, remembering each answer for the
/// length of one request.
pub(crate) struct Resolver<'a> {
    store: &'a dyn ResourceStore,
    tenant_id: &'a str,
    resources: HashMap<(Kind, String), Option<ResourceRecord>>,
    versions: HashMap<String, Vec<Version>>,
}

/// How far the walk got with a (resource, version).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// On the current path: meeting it again closes a cycle.
    OnPath,
    /// Emitted with everything below it.
    Done,
}

/// A version on the current path and the dependencies it has left to visit.
struct Frame {
    record: VersionRecord,
    next: usize,
}

impl<'a> Resolver<'a> {
    /// Returns a resolver seeing the store as `tenant_id` does.
    pub(crate) fn new(store: &'a dyn ResourceStore, tenant_id: &'a str) -> Self {
        Self {
            store,
            tenant_id,
            resources: HashMap::new(),
            versions: HashMap::new(),
        }
    }

    /// Returns what `uri` resolves to now.
    pub(crate) async fn lookup(&mut self, uri: &ResourceUri) -> Result<Lookup, ResourceError> {
        let key = (uri.kind, uri.name.clone());
        let resource = match self.resources.get(&key) {
            Some(known) => known.clone(),
            None => {
                let found = self.store.find_resource(self.tenant_id, uri.kind, &uri.name).await?;
                self.resources.insert(key, found.clone());
                found
            }
        };
        let Some(resource) = resource else {
            return Ok(Lookup::NoResource);
        };
        let versions = self.versions_of(&resource.resource_id).await?;
        Ok(match uri.spec.select(versions) {
            Some(picked) => Lookup::Found(Box::new(resource), picked.clone()),
            None => Lookup::NoVersion,
        })
    }

    /// Returns whether a version this resolver loaded belongs to a public resource.
    pub(crate) fn is_public(&self, record: &VersionRecord) -> bool {
        self.resources
            .get(&(record.kind, record.name.clone()))
            .is_some_and(|found| found.as_ref().is_some_and(|resource| resource.is_public()))
    }

    /// Returns the published versions of a resource, in no particular order.
    async fn versions_of(&mut self, resource_id: &str) -> Result<&[Version], ResourceError> {
        if !self.versions.contains_key(resource_id) {
            let stored = self.store.version_numbers(self.tenant_id, resource_id).await?;
            let parsed = version::parse_stored(&stored)
                .map_err(|bad| ResourceError::corrupt(format!("resource {resource_id} has version {bad:?}")))?;
            self.versions.insert(resource_id.to_owned(), parsed);
        }
        Ok(self.versions.get(resource_id).map(Vec::as_slice).unwrap_or_default())
    }

    /// Returns the version `uri` resolves to with its content, `None` when
    /// nothing matches.
    async fn load(&mut self, uri: &ResourceUri) -> Result<Option<VersionRecord>, ResourceError> {
        let Lookup::Found(resource, version) = self.lookup(uri).await? else {
            return Ok(None);
        };
        // A version deleted since it was listed is as missing as one never published.
        self.store
            .get_version(self.tenant_id, &resource.resource_id, &version.to_string())
            .await
    }

    /// Returns the closure of `root`: every version it needs, transitively,
    /// each (resource, version) once and after its own dependencies; `root`
    /// is not among them. `MissingDependency` names the chain to a requirement
    /// that resolves to nothing, `DependencyCycle` the path that closes a cycle.
    pub(crate) async fn closure(&mut self, root: &VersionRecord) -> Result<Vec<VersionRecord>, ResourceError> {
        let key = |record: &VersionRecord| (record.resource_id.clone(), record.version.clone());
        let mut marks: HashMap<(String, String), Mark> = HashMap::new();
        let mut closure = Vec::new();
        marks.insert(key(root), Mark::OnPath);
        let mut path = vec![Frame {
            record: root.clone(),
            next: 0,
        }];
        while let Some(top) = path.last_mut() {
            let Some(requirement) = top.record.dependencies.get(top.next).cloned() else {
                if let Some(done) = path.pop() {
                    marks.insert(key(&done.record), Mark::Done);
                    if path.is_empty() {
                        break;
                    }
                    closure.push(done.record);
                }
                continue;
            };
            top.next += 1;
            let Some(record) = self.load(&requirement).await? else {
                return Err(ResourceError::MissingDependency(path_through(
                    &path,
                    requirement.to_string(),
                )));
            };
            match marks.get(&key(&record)) {
                Some(Mark::Done) => {}
                Some(Mark::OnPath) => {
                    let start = path
                        .iter()
                        .position(|frame| key(&frame.record) == key(&record))
                        .unwrap_or_default();
                    let cycle = path_through(&path[start..], record.uri().to_string());
                    return Err(ResourceError::DependencyCycle(cycle));
                }
                None => {
                    marks.insert(key(&record), Mark::OnPath);
                    path.push(Frame { record, next: 0 });
                }
            }
        }
        Ok(closure)
    }
}

/// Names a path of versions and where it leads: `a@1.0.0 → b@1.2.0 → <last>`.
fn path_through(path: &[Frame], last: String) -> String {
    path.iter()
        .map(|frame| frame.record.uri().to_string())
        .chain(std::iter::once(last))
        .collect::<Vec<_>>()
        .join(" → ")
}
