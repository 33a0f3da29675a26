//! The kinds of resources and the names URIs and messages give them.

use std::fmt;

/// What a resource is; each kind has its own content schema (`content.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A prompt template with declared variables.
    Prompt,
    /// A tool an agent may call: an MCP server's or a built-in one.
    Tool,
    /// The limits of the sandbox an agent's tools run in.
    Sandbox,
    /// An agent definition: a prompt, a model, tools, a sandbox and knowledge.
    Agent,
    /// Documents an agent may consult.
    Knowledge,
}

impl Kind {
    /// Every kind, in the order of the contract's enum.
    pub const ALL: [Kind; 5] = [Kind::Prompt, Kind::Tool, Kind::Sandbox, Kind::Agent, Kind::Knowledge];

    /// Returns the kind's name as stored and written in messages (`prompt`).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Prompt => "prompt",
            Kind::Tool => "tool",
            Kind::Sandbox => "sandbox",
            Kind::Agent => "agent",
            Kind::Knowledge => "knowledge",
        }
    }

    /// Returns the collection name a URI uses for the kind (`prompts`).
    ///
    /// English plurals: `sandboxes` and `knowledge`. [`Kind::from_collection`]
    /// also takes the contract's mechanical `<kind>s` (`sandboxs`, `knowledges`).
    pub fn collection(self) -> &'static str {
        match self {
            Kind::Prompt => "prompts",
            Kind::Tool => "tools",
            Kind::Sandbox => "sandboxes",
            Kind::Agent => "agents",
            Kind::Knowledge => "knowledge",
        }
    }

    /// Parses a kind's name (`prompt`).
    pub fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|kind| kind.as_str() == name)
    }

    /// Parses a URI's collection name (`prompts`), or a kind's name plus `s`.
    pub fn from_collection(collection: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|kind| {
            kind.collection() == collection
                || collection
                    .strip_suffix('s')
                    .is_some_and(|singular| singular == kind.as_str())
        })
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
