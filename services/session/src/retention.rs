//! Retention: a tenant's policy (how long messages and idle conversations
//! are kept, how many conversations a container keeps), its bounds, and what
//! a sweep deleted or would delete.
//!
//! Only the session service's own rows are ever deleted: messages, and
//! conversations (images with their sessions, messages, read markers and
//! search entries). Usage records live in other services' databases (the
//! observability ledger, auth's quota counters) and are kept for billing
//! whatever the policy says; a sweep never reaches them.

use std::time::Duration;

use crate::error::SessionError;

/// Most days a policy may keep anything (about a hundred years).
pub const MAX_RETENTION_DAYS: u32 = 36_500;
/// Most conversations a policy may keep per container.
pub const MAX_CONVERSATIONS_PER_CONTAINER: u32 = 100_000;
/// Most messages one sweep of one tenant deletes; a larger backlog takes
/// several sweeps.
pub const MESSAGES_PER_SWEEP: u32 = 1_000;
/// Most messages one transaction of a sweep deletes, so no lock is held long.
pub const MESSAGES_PER_TRANSACTION: u32 = 250;
/// Most conversations one sweep of one tenant deletes, each in a
/// transaction of its own.
pub const CONVERSATIONS_PER_SWEEP: u32 = 100;
/// Most image ids a sweep's report lists.
pub const MAX_REPORTED_IMAGE_IDS: usize = 100;
/// How often the sweeper runs unless configured otherwise.
pub const DEFAULT_RETENTION_INTERVAL: Duration = Duration::from_secs(3600);

const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// What a tenant's sweeper deletes; `None` sets no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Messages older than this many days are deleted.
    pub message_days: Option<u32>,
    /// Conversations whose last activity is older than this many days are deleted.
    pub idle_conversation_days: Option<u32>,
    /// Each container keeps this many of its most recently active
    /// conversations; the others are deleted.
    pub max_conversations_per_container: Option<u32>,
}

impl RetentionPolicy {
    /// Returns whether the policy deletes anything at all.
    pub fn is_empty(&self) -> bool {
        self.message_days.is_none()
            && self.idle_conversation_days.is_none()
            && self.max_conversations_per_container.is_none()
    }

    /// Fails with `INVALID_RETENTION_POLICY`, naming the first field out of
    /// its bounds (never echoing the value), unless every field is in them.
    pub fn validate(&self) -> Result<(), SessionError> {
        let checks = [
            ("messageDays", self.message_days, MAX_RETENTION_DAYS, "days"),
            (
                "idleConversationDays",
                self.idle_conversation_days,
                MAX_RETENTION_DAYS,
                "days",
            ),
            (
                "maxConversationsPerContainer",
                self.max_conversations_per_container,
                MAX_CONVERSATIONS_PER_CONTAINER,
                "conversations",
            ),
        ];
        for (field, value, max, unit) in checks {
            if value.is_some_and(|value| value == 0 || value > max) {
                return Err(SessionError::invalid(
                    "INVALID_RETENTION_POLICY",
                    format!("{field} must be 1 to {max} {unit}, or null for no limit"),
                ));
            }
        }
        Ok(())
    }

    /// Returns the instant before which messages are deleted, at `now_ms`.
    pub(crate) fn messages_before(&self, now_ms: i64) -> Option<i64> {
        self.message_days.map(|days| cutoff(now_ms, days))
    }

    /// Returns the instant of last activity before which conversations are
    /// deleted, at `now_ms`.
    pub(crate) fn idle_before(&self, now_ms: i64) -> Option<i64> {
        self.idle_conversation_days.map(|days| cutoff(now_ms, days))
    }
}

fn cutoff(now_ms: i64, days: u32) -> i64 {
    now_ms.saturating_sub(i64::from(days).saturating_mul(DAY_MS))
}

/// A tenant's policy as stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredPolicy {
    pub policy: RetentionPolicy,
    /// When it was last set (Unix ms); 0 when never.
    pub updated_at_ms: i64,
}

/// A conversation a policy deletes: the least recently active first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetentionCandidate {
    pub image_id: String,
    pub container_id: String,
    pub session_id: String,
    /// Its session's last activity when it was chosen: it is deleted only
    /// if that has not changed since.
    pub last_active_at_ms: i64,
}

/// What one sweep of one tenant deleted, or (a dry run) would delete.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    pub dry_run: bool,
    /// Messages deleted on their own (not those that went with a conversation).
    pub messages: u64,
    /// Conversations (images) deleted.
    pub conversations: u64,
    /// The deleted conversations' image ids, at most [`MAX_REPORTED_IMAGE_IDS`].
    pub image_ids: Vec<String>,
    /// Whether a bound stopped the sweep: the next one may find more.
    pub limit_reached: bool,
}

impl SweepReport {
    /// Counts a deleted conversation and lists it while the list has room.
    pub(crate) fn conversation(&mut self, image_id: String) {
        self.conversations += 1;
        if self.image_ids.len() < MAX_REPORTED_IMAGE_IDS {
            self.image_ids.push(image_id);
        }
    }
}

/// What one pass of the sweeper over every tenant with a policy did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionSweeps {
    /// Tenants swept.
    pub tenants: u64,
    /// Tenants whose sweep failed (logged; the next pass tries again).
    pub failed: u64,
    pub messages: u64,
    pub conversations: u64,
    /// Tenants where a bound stopped the sweep: the next pass goes on.
    pub limited: u64,
}

impl RetentionSweeps {
    /// Adds one tenant's sweep.
    pub(crate) fn add(&mut self, report: &SweepReport) {
        self.tenants += 1;
        self.messages += report.messages;
        self.conversations += report.conversations;
        self.limited += u64::from(report.limit_reached);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_out_of_bounds_are_refused_by_field() {
        assert!(RetentionPolicy::default().validate().is_ok());
        let full = RetentionPolicy {
            message_days: Some(MAX_RETENTION_DAYS),
            idle_conversation_days: Some(1),
            max_conversations_per_container: Some(MAX_CONVERSATIONS_PER_CONTAINER),
        };
        assert!(full.validate().is_ok());
        let bad = [
            (
                RetentionPolicy {
                    message_days: Some(0),
                    ..full
                },
                "messageDays",
            ),
            (
                RetentionPolicy {
                    idle_conversation_days: Some(MAX_RETENTION_DAYS + 1),
                    ..full
                },
                "idleConversationDays",
            ),
            (
                RetentionPolicy {
                    max_conversations_per_container: Some(u32::MAX),
                    ..full
                },
                "maxConversationsPerContainer",
            ),
        ];
        for (policy, field) in bad {
            match policy.validate() {
                Err(SessionError::Invalid { reason, message }) => {
                    assert_eq!(reason, "INVALID_RETENTION_POLICY");
                    assert!(message.starts_with(field), "{message}");
                    assert!(!message.contains(&u32::MAX.to_string()), "{message}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn cutoffs_count_whole_days_back() {
        let policy = RetentionPolicy {
            message_days: Some(2),
            idle_conversation_days: Some(MAX_RETENTION_DAYS),
            ..RetentionPolicy::default()
        };
        assert_eq!(policy.messages_before(10 * DAY_MS), Some(8 * DAY_MS));
        assert_eq!(policy.idle_before(0), Some(-i64::from(MAX_RETENTION_DAYS) * DAY_MS));
        assert_eq!(policy.idle_before(i64::MIN), Some(i64::MIN));
    }
}
