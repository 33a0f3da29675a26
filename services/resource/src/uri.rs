//! `resource://` URIs: `resource://<collection>/<name>[@<version or requirement>]`,
//! e.g. `resource://prompts/sales-assistant@^2`.
//!
//! The collection is the kind's plural (`prompts`, `tools`, `sandboxes`,
//! `agents`, `knowledge`; the mechanical `sandboxs` and `knowledges` are read
//! too). Nothing is percent-encoded: names cannot need it, and requirements
//! are written as `semver` reads them (`>=1.0, <2`).

use std::fmt;

use crate::kind::Kind;
use crate::version::VersionSpec;

/// What every resource URI starts with.
pub const SCHEME: &str = "resource://";

/// Longest URI accepted, in bytes.
pub const MAX_URI_BYTES: usize = 512;

/// Longest resource name, in characters.
pub const MAX_NAME_CHARS: usize = 128;

/// A parsed `resource://` URI: a kind, a name and a version requirement.
///
/// Displays as written: the requirement keeps its text (`^2` stays `^2`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceUri {
    pub kind: Kind,
    pub name: String,
    /// Empty when the URI names no version (the latest).
    pub spec: VersionSpec,
}

impl ResourceUri {
    /// Returns the URI of a resource without a version.
    pub fn unversioned(kind: Kind, name: &str) -> ResourceUri {
        ResourceUri {
            kind,
            name: name.to_owned(),
            spec: VersionSpec::latest(),
        }
    }

    /// Returns the URI of one exact version.
    ///
    /// `version` is a published, hence valid, semantic version; text that is
    /// not one would make a URI that names the latest version.
    pub fn exact(kind: Kind, name: &str, version: &str) -> ResourceUri {
        let spec = VersionSpec::parse(version).unwrap_or_else(|_| VersionSpec::latest());
        ResourceUri {
            kind,
            name: name.to_owned(),
            spec,
        }
    }

    /// Parses a URI; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<ResourceUri, String> {
        if text.len() > MAX_URI_BYTES {
            return Err(format!("a resource uri is at most {MAX_URI_BYTES} bytes"));
        }
        let Some(rest) = text.strip_prefix(SCHEME) else {
            return Err(format!("{text:?} does not start with {SCHEME}"));
        };
        let (path, spec) = match rest.split_once('@') {
            Some((path, spec)) => (path, Some(spec)),
            None => (rest, None),
        };
        let Some((collection, name)) = path.split_once('/') else {
            return Err(format!(
                "{text:?} has no name: the form is {SCHEME}<kind>s/<name>[@<version>]"
            ));
        };
        let kind = Kind::from_collection(collection).ok_or_else(|| {
            format!(
                "{text:?} names no known kind: {collection:?} is not one of prompts, tools, sandboxes, agents, knowledge"
            )
        })?;
        validate_name(name).map_err(|why| format!("{text:?} has an invalid name: {why}"))?;
        let spec = match spec {
            None => VersionSpec::latest(),
            Some("") => return Err(format!("{text:?} has nothing after @")),
            Some(spec) if spec.trim() != spec => {
                return Err(format!("{text:?} has spaces around its version"));
            }
            Some(spec) => VersionSpec::parse(spec).map_err(|why| format!("{text:?} has an invalid version: {why}"))?,
        };
        Ok(ResourceUri {
            kind,
            name: name.to_owned(),
            spec,
        })
    }

    /// Returns the same URI without its version.
    pub fn without_version(&self) -> ResourceUri {
        ResourceUri::unversioned(self.kind, &self.name)
    }
}

impl fmt::Display for ResourceUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.kind.collection(), self.name)?;
        if !self.spec.is_empty() {
            write!(f, "@{}", self.spec)?;
        }
        Ok(())
    }
}

/// Checks a resource name: `[a-z0-9][a-z0-9._-]{0,127}`; the error says why not.
pub fn validate_name(name: &str) -> Result<(), String> {
    let mut bytes = name.bytes();
    let Some(first) = bytes.next() else {
        return Err("a name must not be empty".to_owned());
    };
    if name.len() > MAX_NAME_CHARS {
        return Err(format!("a name is at most {MAX_NAME_CHARS} characters"));
    }
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return Err(format!("{name:?} must start with a lowercase letter or a digit"));
    }
    if !bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')) {
        return Err(format!("{name:?} may hold only lowercase letters, digits and . _ -"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_round_trip_as_written() {
        for text in [
            "resource://prompts/sales-assistant",
            "resource://prompts/sales-assistant@^2",
            "resource://tools/search.web_v2@1.0.0",
            "resource://sandboxes/small@latest",
            "resource://agents/a@>=1.0, <2",
            "resource://knowledge/faq@~2.1",
        ] {
            let uri = ResourceUri::parse(text).unwrap();
            assert_eq!(uri.to_string(), text);
        }
        let uri = ResourceUri::parse("resource://prompts/p@2.1.0").unwrap();
        assert_eq!((uri.kind, uri.name.as_str()), (Kind::Prompt, "p"));
        assert_eq!(uri.spec.exact().map(ToString::to_string).as_deref(), Some("2.1.0"));
        assert_eq!(ResourceUri::parse("resource://sandboxs/s").unwrap().kind, Kind::Sandbox);
        assert_eq!(
            ResourceUri::parse("resource://knowledges/k").unwrap().kind,
            Kind::Knowledge
        );
        assert_eq!(
            ResourceUri::exact(Kind::Sandbox, "s", "1.0.0").to_string(),
            "resource://sandboxes/s@1.0.0"
        );
    }

    #[test]
    fn bad_uris_say_what_is_wrong() {
        let long = format!("resource://prompts/{}", "a".repeat(600));
        for (text, says) in [
            ("prompts/p", "does not start with"),
            ("http://prompts/p", "does not start with"),
            ("resource://prompts", "has no name"),
            ("resource://widgets/p", "names no known kind"),
            ("resource://prompts/", "invalid name"),
            ("resource://prompts/Sales", "invalid name"),
            ("resource://prompts/-x", "invalid name"),
            ("resource://prompts/a/b", "invalid name"),
            ("resource://prompts/p@", "nothing after @"),
            ("resource://prompts/p@ ^1", "spaces around"),
            ("resource://prompts/p@banana", "invalid version"),
            (long.as_str(), "at most"),
        ] {
            let err = ResourceUri::parse(text).unwrap_err();
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn names_follow_the_documented_alphabet() {
        let longest = "a".repeat(128);
        for good in ["a", "0", "sales-assistant", "v1.2_b", longest.as_str()] {
            assert!(validate_name(good).is_ok(), "{good}");
        }
        let too_long = "a".repeat(129);
        for bad in ["", "A", "_a", ".a", "a b", "a/b", "é", too_long.as_str()] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }
}
