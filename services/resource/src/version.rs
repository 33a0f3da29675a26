//! Semantic versions and the requirements that pick one of them.
//!
//! A requirement is `latest` (or nothing), an exact version (`2.1.0`, which
//! `semver::VersionReq` alone would read as `^2.1.0`), or a `semver`
//! requirement (`^2`, `~2.1`, `>=1.0, <2`, `=1.2.3`). Each resource has few
//! versions, so choosing among them happens here rather than in SQL.

use std::fmt;

use semver::{Version, VersionReq};

/// A requirement on a resource's version, as written after `@` in a URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionSpec {
    /// The text as written; empty when none was.
    text: String,
    rule: Rule,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Rule {
    Latest,
    Exact(Version),
    Range(VersionReq),
}

impl VersionSpec {
    /// Returns the requirement that picks the latest version.
    pub fn latest() -> VersionSpec {
        VersionSpec {
            text: String::new(),
            rule: Rule::Latest,
        }
    }

    /// Parses a requirement; empty and `latest` mean the latest version.
    ///
    /// The error says what is wrong, for the caller's message.
    pub fn parse(text: &str) -> Result<VersionSpec, String> {
        let trimmed = text.trim();
        let rule = if trimmed.is_empty() || trimmed == "latest" {
            Rule::Latest
        } else if let Ok(version) = Version::parse(trimmed) {
            Rule::Exact(version)
        } else {
            match VersionReq::parse(trimmed) {
                Ok(req) => Rule::Range(req),
                Err(err) => {
                    return Err(format!(
                        "{text:?} is neither a version nor a version requirement: {err}"
                    ));
                }
            }
        };
        Ok(VersionSpec {
            text: text.to_owned(),
            rule,
        })
    }

    /// Returns whether nothing was written (which means the latest version).
    pub fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    /// Returns the exact version this requirement names, if it names one.
    pub fn exact(&self) -> Option<&Version> {
        match &self.rule {
            Rule::Exact(version) => Some(version),
            _ => None,
        }
    }

    /// Returns the version this requirement picks among `versions`: the
    /// highest one that matches. The latest is the highest that is not a
    /// pre-release, or the highest pre-release when there are only those.
    pub fn select<'a>(&self, versions: &'a [Version]) -> Option<&'a Version> {
        match &self.rule {
            Rule::Latest => versions
                .iter()
                .filter(|v| v.pre.is_empty())
                .max()
                .or_else(|| versions.iter().max()),
            Rule::Exact(exact) => versions.iter().find(|v| *v == exact),
            Rule::Range(req) => versions.iter().filter(|v| req.matches(v)).max(),
        }
    }

    /// Returns whether this requirement holds on to `version`, one of
    /// `versions`: an exact or range requirement when it matches it, `latest`
    /// when it is the version `latest` picks now.
    pub fn claims(&self, version: &Version, versions: &[Version]) -> bool {
        match &self.rule {
            Rule::Latest => self.select(versions) == Some(version),
            Rule::Exact(exact) => exact == version,
            Rule::Range(req) => req.matches(version),
        }
    }
}

impl fmt::Display for VersionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Parses a version to publish: semantic, without build metadata (which
/// semver precedence ignores, so two versions could not be told apart).
pub fn parse_version(text: &str) -> Result<Version, String> {
    let version = Version::parse(text).map_err(|err| format!("{text:?} is not a semantic version: {err}"))?;
    if !version.build.is_empty() {
        return Err(format!("{text:?} has build metadata, which versions may not carry"));
    }
    Ok(version)
}

/// Parses stored version strings, skipping none: a stored one that does not
/// parse is returned as the error.
pub fn parse_stored(versions: &[String]) -> Result<Vec<Version>, String> {
    versions
        .iter()
        .map(|text| Version::parse(text).map_err(|_| text.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn versions(texts: &[&str]) -> Vec<Version> {
        texts.iter().map(|t| Version::parse(t).unwrap()).collect()
    }

    fn pick(spec: &str, texts: &[&str]) -> Option<String> {
        let all = versions(texts);
        VersionSpec::parse(spec).unwrap().select(&all).map(Version::to_string)
    }

    #[test]
    fn requirements_pick_the_highest_match() {
        let all = [
            "1.0.0",
            "1.2.0",
            "1.2.5",
            "2.0.0",
            "2.1.0",
            "2.2.0-beta.1",
            "3.0.0-rc.1",
        ];
        assert_eq!(pick("", &all).as_deref(), Some("2.1.0"));
        assert_eq!(pick("latest", &all).as_deref(), Some("2.1.0"));
        assert_eq!(pick("2.1.0", &all).as_deref(), Some("2.1.0"), "exact, not ^2.1.0");
        assert_eq!(pick("2.0.0", &all).as_deref(), Some("2.0.0"), "exact, not ^2.0.0");
        assert_eq!(pick("^1", &all).as_deref(), Some("1.2.5"));
        assert_eq!(pick("~1.2", &all).as_deref(), Some("1.2.5"));
        assert_eq!(pick(">=1.0, <1.2.5", &all).as_deref(), Some("1.2.0"));
        assert_eq!(pick("=1.2.0", &all).as_deref(), Some("1.2.0"));
        assert_eq!(pick("2.2.0-beta.1", &all).as_deref(), Some("2.2.0-beta.1"));
        assert_eq!(pick("^4", &all), None);
        assert_eq!(pick("1.1.0", &all), None);
        assert_eq!(
            pick("latest", &["1.0.0-alpha", "1.0.0-beta"]).as_deref(),
            Some("1.0.0-beta")
        );
        assert_eq!(pick("latest", &[]), None);
    }

    #[test]
    fn bad_requirements_and_versions_are_refused() {
        for bad in ["y", "^", "1.0.0.0", ">= one", "banana"] {
            assert!(VersionSpec::parse(bad).is_err(), "{bad}");
        }
        for bad in ["1", "1.0", "v1.0.0", "1.0.0+build.5", ""] {
            assert!(parse_version(bad).is_err(), "{bad}");
        }
        assert!(parse_version("1.0.0-rc.1").is_ok());
    }

    #[test]
    fn latest_claims_only_what_it_picks() {
        let all = versions(&["1.0.0", "2.0.0"]);
        let latest = VersionSpec::latest();
        assert!(latest.claims(&all[1], &all));
        assert!(!latest.claims(&all[0], &all));
        let caret = VersionSpec::parse("^1").unwrap();
        assert!(caret.claims(&all[0], &all));
        assert!(!caret.claims(&all[1], &all));
    }
}
