//! The AgentVM gateway: the public HTTP + WebSocket edge, translating to the
//! services' gRPC APIs. It owns nothing persistent and opens no database.
//!
//! ```text
//! router.rs   every route and /ws, each layer with its why
//! http.rs     request id, caller context, typed bodies and queries, errors
//! api/        the operations, once: typed requests and responses, the call
//! rest/       thin axum handlers over api/, with their OpenAPI operations
//! ws/         the socket loop and the AgentX adapter over api/
//! frames.rs   the protocol's event, response and error envelopes
//! openapi.rs  the OpenAPI 3.1 document's fixed parts
//! peers.rs    the services the gateway fronts
//! state.rs    what every handler shares; server.rs: serving it
//! heads.rs    every request head checked before hyper reads it
//! auth.rs     who is calling; limits.rs: requests per minute
//! ```

pub mod api;
pub mod auth;
pub mod bounds;
pub mod config;
pub mod dev;
pub mod frames;
mod heads;
pub mod http;
pub mod limits;
pub mod openapi;
pub mod peers;
pub mod rest;
pub mod router;
mod server;
mod state;
#[cfg(test)]
mod testing;
pub mod users;
pub mod ws;

pub use auth::Authenticator;
pub use config::GatewayConfig;
pub use limits::RateLimiter;
pub use peers::{PeerChannels, Peers};
pub use server::serve;
pub use state::GatewayState;
