//! What the replicas of the observability service tell each other over the
//! shared feed (`avm_store::events`, `NOTIFY` / `LISTEN` on Postgres): budget
//! changes, which budget watchers hear, and the month spends a replica's
//! writes changed, which the other replicas' spend caches drop.

use serde::{Deserialize, Serialize};

/// Largest payload of one spend event: Postgres refuses notifications of
/// 8000 bytes or more, so long lists of tenants go in several events.
const MAX_SPEND_PAYLOAD_BYTES: usize = 6000;

/// One event of the feed.
///
/// Untagged, so a budget change reads the same as before spend events
/// existed: replicas of the previous release and of this one still hear each
/// other's budget changes during a rolling update (the older ones skip spend
/// events as unreadable, and keep their one-second spend cache).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum ObservabilityEvent {
    Budget(BudgetChanged),
    Spent(SpendChanged),
}

/// A budget change, as every replica's watchers hear it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BudgetChanged {
    pub(crate) tenant_id: String,
    pub(crate) key_id: String,
    /// Zero when the budget was removed.
    pub(crate) monthly_limit_pico_usd: i64,
    pub(crate) updated_at_ms: i64,
}

/// A replica wrote usage records of these tenants: what they (and their
/// keys) spent this month changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SpendChanged {
    /// The replica that wrote them; its own cache is already current.
    pub(crate) writer: String,
    pub(crate) spent_tenants: Vec<String>,
}

impl SpendChanged {
    /// Returns the events announcing `tenants`, each small enough for one
    /// notification.
    pub(crate) fn announcing(writer: &str, tenants: Vec<String>) -> Vec<SpendChanged> {
        let mut events = Vec::new();
        let mut batch = Vec::new();
        let mut bytes = writer.len();
        for tenant in tenants {
            // The id, its quotes and a comma.
            let size = tenant.len() + 3;
            if !batch.is_empty() && bytes + size > MAX_SPEND_PAYLOAD_BYTES {
                events.push(SpendChanged {
                    writer: writer.to_owned(),
                    spent_tenants: std::mem::take(&mut batch),
                });
                bytes = writer.len();
            }
            bytes += size;
            batch.push(tenant);
        }
        if !batch.is_empty() {
            events.push(SpendChanged {
                writer: writer.to_owned(),
                spent_tenants: batch,
            });
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_changes_read_as_before_and_spends_apart() {
        let budget = r#"{"tenant_id":"ten_a","key_id":"","monthly_limit_pico_usd":5,"updated_at_ms":1}"#;
        let ObservabilityEvent::Budget(change) = serde_json::from_str(budget).unwrap() else {
            panic!("a budget change");
        };
        assert_eq!(change.monthly_limit_pico_usd, 5);
        let spent = ObservabilityEvent::Spent(SpendChanged {
            writer: "obs_1".into(),
            spent_tenants: vec!["ten_a".into()],
        });
        let json = serde_json::to_string(&spent).unwrap();
        assert_eq!(serde_json::from_str::<ObservabilityEvent>(&json).unwrap(), spent);
    }

    #[test]
    fn many_tenants_go_in_several_notifications() {
        let tenants: Vec<String> = (0..1000).map(|i| format!("ten_{i:0>28}")).collect();
        let events = SpendChanged::announcing("obs_writer", tenants.clone());
        assert!(events.len() > 1);
        for event in &events {
            let payload = serde_json::to_string(&ObservabilityEvent::Spent(event.clone())).unwrap();
            assert!(payload.len() < 8000, "{} bytes", payload.len());
        }
        let all: Vec<String> = events.into_iter().flat_map(|event| event.spent_tenants).collect();
        assert_eq!(all, tenants);
        assert!(SpendChanged::announcing("obs_writer", Vec::new()).is_empty());
    }
}
