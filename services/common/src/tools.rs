//! The names of the runtime's built-in tools: what an image's `tools` may
//! name besides `resource://tools/…` URIs. The runtime runs them; the session
//! service checks images against this list when they are created.

/// Every built-in tool, as the model and the image config name it.
pub const BUILTIN_TOOLS: &[&str] = &[
    "read_file",
    "write_file",
    "edit_file",
    "list_files",
    "search_files",
    "run_command",
    "fetch_url",
    "spawn_agent",
];

/// What a tool resource's URI starts with.
pub const TOOL_URI_PREFIX: &str = "resource://tools/";
