//! The services the runtime calls, each as a client of its own that speaks
//! the runtime's domain types: the only place besides `grpc.rs` that sees
//! protos. Each wraps the service's handle, which `avm serve` fills with the
//! service object itself and a mesh with a gRPC client.

mod config;
pub mod groups;
mod resource;
mod session;
pub mod usage;

pub use config::{ConfigEntry, ConfigSource, ConfigUpdate, Configs, StoredCredentials};
pub use groups::{AgentPost, Group, GroupMessage, Member, UnreadGroup};
pub use resource::{Resolved, Resources};
pub(crate) use session::content;
pub use session::{Compaction, Image, ImageChanges, Lifecycle, NewChild, OpenTurn, Role, SessionChange, Sessions};
pub(crate) use session::{decode_message, encode_message};
pub use usage::{BudgetAnswer, BudgetUpdate, CallStatus, Estimate, UsageRecord, Usages};
