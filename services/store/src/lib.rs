//! Storage for the services that keep data (auth, session, resource,
//! config, observability): database pools (SQLite in WAL mode, Postgres),
//! the one store error every service wraps, and the change feeds that carry a
//! service's events between its replicas. The gateway and the runtime keep
//! nothing and never link it.

pub mod db;
mod error;
pub mod events;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::StoreError;
