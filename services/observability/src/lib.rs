//! The observability service: the usage ledger (one record per LLM call,
//! with its tokens, provider cost and billed amount), monthly spend budgets
//! and the recent log events of each tenant. Served as `avm.observability.v1`.
//!
//! ```text
//! grpc.rs     proto ⇄ domain, metadata → RequestContext, error → Status
//! service.rs  permissions, validation, queries, budgets, logs, watch
//! ledger.rs   the pending buffer, its background writer, month spends
//! open_calls.rs calls noted as they are made, billed at their estimate if cut
//! events.rs   what replicas tell each other: budget changes, spends written
//! quotas.rs   token quotas at the auth service: reserved per call, settled, counted
//! record.rs   the domain types
//! forwarder.rs every process's tenant log events, sent to this service
//! store.rs    the ObservabilityStore trait; store/{sqlite,postgres}.rs behind it
//! ```

mod config;
mod error;
mod events;
mod forwarder;
mod grpc;
mod ledger;
mod open_calls;
mod quotas;
mod record;
mod service;
mod store;

pub use config::LedgerSettings;
pub use error::ObservabilityError;
pub use forwarder::spawn_log_forwarder;
pub use grpc::{ObservabilityGrpc, grpc_server};
pub use quotas::{AuthQuotas, QuotaSink};
pub use record::{
    Budget, BudgetCheck, BudgetUpdate, BudgetWatch, CallEstimate, CallStatus, CallTiming, Dimension, Latency, Level,
    LogEvent, LogFilter, LogQuery, PageKey, StoredBudget, TokenQuota, UsageFilter, UsageGroup, UsagePage, UsageQuery,
    UsageRecord, UsageReport, UsageSummary, UsageTotals,
};
pub use service::{
    MAX_CALL_ID_BYTES, MAX_LOG_EVENTS_PER_REQUEST, MAX_LOG_FIELDS_BYTES, MAX_LOG_MESSAGE_BYTES,
    MAX_RECORDS_PER_REQUEST, ObservabilityService,
};
pub use store::{ObservabilityStore, PostgresObservabilityStore, SqliteObservabilityStore, open_store};
