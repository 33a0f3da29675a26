//! Prompt templates: `{{name}}` placeholders (`{{ name }}` too) replaced by
//! the values of declared variables.
//!
//! Only braces around an identifier make a placeholder; any other `{{` is
//! text, so prompts may show JSON or code. Written by hand: the syntax is
//! this small, and a template engine would bring loops, filters and escaping
//! that prompts must not grow.

use std::collections::BTreeMap;

use crate::error::ResourceError;

/// A prompt's content: its template and the variables it declares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PromptContent {
    pub template: String,
    pub variables: Vec<Variable>,
}

/// A variable a prompt declares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Variable {
    pub name: String,
    /// Whether rendering needs a value (or a default); true unless declared otherwise.
    pub required: bool,
    pub default: Option<String>,
}

/// Largest JSON of variable values accepted, in bytes.
pub const MAX_VARIABLES_BYTES: usize = 64 * 1024;

/// A piece of a template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Segment<'a> {
    Text(&'a str),
    Variable(&'a str),
}

/// Splits a template into text and placeholders.
fn segments(template: &str) -> Vec<Segment<'_>> {
    let mut segments = Vec::new();
    let (mut text_start, mut search) = (0, 0);
    while let Some(found) = template[search..].find("{{") {
        let open = search + found;
        match placeholder(&template[open + 2..]) {
            Some((name, consumed)) => {
                if open > text_start {
                    segments.push(Segment::Text(&template[text_start..open]));
                }
                segments.push(Segment::Variable(name));
                text_start = open + 2 + consumed;
                search = text_start;
            }
            // `{{{name}}}` is a brace around a placeholder: look again one byte on.
            None => search = open + 1,
        }
    }
    if text_start < template.len() {
        segments.push(Segment::Text(&template[text_start..]));
    }
    segments
}

/// Reads `  name  }}` at the start of `rest`: the name and the bytes read.
fn placeholder(rest: &str) -> Option<(&str, usize)> {
    let start = rest.len() - rest.trim_start().len();
    let name_len = rest[start..]
        .bytes()
        .enumerate()
        .take_while(|&(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()))
        .count();
    if name_len == 0 {
        return None;
    }
    let name = &rest[start..start + name_len];
    let after = &rest[start + name_len..];
    let close = after.len() - after.trim_start().len();
    after[close..]
        .starts_with("}}")
        .then_some((name, start + name_len + close + 2))
}

/// Returns the names of a template's placeholders, in order, repeats included.
pub(crate) fn placeholders(template: &str) -> Vec<&str> {
    segments(template)
        .into_iter()
        .filter_map(|segment| match segment {
            Segment::Variable(name) => Some(name),
            Segment::Text(_) => None,
        })
        .collect()
}

/// Parses variable values: a JSON object of strings; empty means none.
pub fn parse_variables(json: &str) -> Result<BTreeMap<String, String>, ResourceError> {
    if json.trim().is_empty() {
        return Ok(BTreeMap::new());
    }
    if json.len() > MAX_VARIABLES_BYTES {
        return Err(ResourceError::invalid(
            "INVALID_VARIABLES",
            format!("variables must be at most {} KiB", MAX_VARIABLES_BYTES / 1024),
        ));
    }
    let not_strings = || ResourceError::invalid("INVALID_VARIABLES", "variables must be a json object of strings");
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(name, value)| match value {
                serde_json::Value::String(value) => Ok((name, value)),
                _ => Err(ResourceError::invalid(
                    "INVALID_VARIABLES",
                    format!("variable {name} must be a string"),
                )),
            })
            .collect(),
        Ok(_) => Err(not_strings()),
        Err(err) => Err(ResourceError::invalid(
            "INVALID_VARIABLES",
            format!("variables are not valid json: {err}"),
        )),
    }
}

/// Renders a prompt with `values`; `prompt_uri` names it in errors.
///
/// Each placeholder takes its variable's value, else its default; a required
/// variable with neither is `MISSING_VARIABLE`, an optional one renders
/// empty. A value for a variable the prompt does not declare is
/// `UNKNOWN_VARIABLE`.
pub(crate) fn render(
    prompt: &PromptContent,
    values: &BTreeMap<String, String>,
    prompt_uri: &str,
) -> Result<String, ResourceError> {
    if let Some(unknown) = values
        .keys()
        .find(|name| !prompt.variables.iter().any(|declared| &declared.name == *name))
    {
        return Err(ResourceError::invalid(
            "UNKNOWN_VARIABLE",
            format!("{prompt_uri} declares no variable {unknown}"),
        ));
    }
    let mut resolved: BTreeMap<&str, &str> = BTreeMap::new();
    for declared in &prompt.variables {
        let value = values.get(&declared.name).or(declared.default.as_ref());
        match value {
            Some(value) => {
                resolved.insert(&declared.name, value);
            }
            None if declared.required => {
                return Err(ResourceError::invalid(
                    "MISSING_VARIABLE",
                    format!(
                        "variable {} of {prompt_uri} is required and has no value",
                        declared.name
                    ),
                ));
            }
            None => {
                resolved.insert(&declared.name, "");
            }
        }
    }
    let mut out = String::with_capacity(prompt.template.len());
    for segment in segments(&prompt.template) {
        match segment {
            Segment::Text(text) => out.push_str(text),
            // Publishing checked that every placeholder is declared.
            Segment::Variable(name) => out.push_str(resolved.get(name).copied().unwrap_or_default()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(template: &str, variables: &[(&str, bool, Option<&str>)]) -> PromptContent {
        PromptContent {
            template: template.to_owned(),
            variables: variables
                .iter()
                .map(|(name, required, default)| Variable {
                    name: (*name).to_owned(),
                    required: *required,
                    default: default.map(str::to_owned),
                })
                .collect(),
        }
    }

    fn values(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn placeholders_are_braced_identifiers() {
        assert_eq!(
            placeholders("Hi {{name}}, {{ name }} and {{\tx_1 }}!"),
            ["name", "name", "x_1"]
        );
        assert_eq!(placeholders("{{{a}}}"), ["a"]);
        assert!(placeholders(r#"json {{"a": 1}} {{1x}} {{a b}} {{ }} {{a"#).is_empty());
    }

    #[test]
    fn rendering_fills_values_then_defaults() {
        let p = prompt(
            "Dear {{ who }}, {{tone}}{{extra}}. {{{who}}}",
            &[
                ("who", true, None),
                ("tone", true, Some("kindly")),
                ("extra", false, None),
            ],
        );
        assert_eq!(
            render(&p, &values(&[("who", "Ann")]), "p").unwrap(),
            "Dear Ann, kindly. {Ann}"
        );
        assert_eq!(
            render(&p, &values(&[("who", "Bo"), ("tone", "x"), ("extra", "!")]), "p").unwrap(),
            "Dear Bo, x!. {Bo}"
        );
        let missing = render(&p, &values(&[]), "resource://prompts/p@1.0.0").unwrap_err();
        assert!(
            matches!(&missing, ResourceError::Invalid { reason: "MISSING_VARIABLE", message } if message.contains("who"))
        );
        let unknown = render(&p, &values(&[("who", "a"), ("zzz", "b")]), "p").unwrap_err();
        assert!(
            matches!(&unknown, ResourceError::Invalid { reason: "UNKNOWN_VARIABLE", message } if message.contains("zzz"))
        );
    }

    #[test]
    fn variables_must_be_an_object_of_strings() {
        assert!(parse_variables("").unwrap().is_empty());
        assert_eq!(parse_variables(r#"{"a":"b"}"#).unwrap(), values(&[("a", "b")]));
        for bad in ["[]", "1", r#"{"a":1}"#, r#"{"a":null}"#, "{"] {
            assert!(
                matches!(
                    parse_variables(bad),
                    Err(ResourceError::Invalid {
                        reason: "INVALID_VARIABLES",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }
}
