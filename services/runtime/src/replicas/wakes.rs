//! The wake bus of replicated runtimes: a Redis stream with one consumer
//! group, every replica a consumer.
//!
//! - Every replica hears each new group message from the session service;
//!   the first to claim it (`SET NX`; the replica whose agent posts it
//!   claims it before posting) queues one entry per agent it wakes (`XADD`).
//! - A replica reads entries (`XREADGROUP`) and has each agent's owner read
//!   its messages; it acknowledges (`XACK`, then `XDEL`) once the agent read
//!   them, so the entry stays pending while the reply is being written.
//! - Every heartbeat a replica marks the entries it still works on as fresh
//!   (`XCLAIM … JUSTID` to itself); every few it claims entries idle for
//!   longer than [`RECLAIM_AFTER`] (`XAUTOCLAIM`): those of a replica that
//!   died, or whose delivery failed. Reading again is harmless: a read cursor that passed
//!   the message makes it a no-op, and a reply is named after what it answers.
//! - An entry delivered more than [`MAX_DELIVERIES`] times is dropped with
//!   an error in the log: its messages stay unread for the agent's next wake.

use std::collections::HashSet;
use std::time::Duration;

use avm_common::ApiError;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamReadReply};

use super::{Replicas, redis_error};

/// How long an entry stays unacknowledged and untouched before another
/// replica takes it over: longer than a heartbeat lapse.
pub const RECLAIM_AFTER: Duration = Duration::from_secs(5);
/// How long one read waits for entries: an idle runtime reads this seldom.
pub const READ_BLOCK: Duration = Duration::from_secs(10);
/// Deliveries of one entry before it is dropped.
pub const MAX_DELIVERIES: u64 = 10;
/// How long the claim of a group message is kept.
pub const POST_CLAIM_KEPT: Duration = Duration::from_secs(3600);
/// Entries one read or claim takes.
const BATCH: usize = 64;
const GROUP: &str = "runtimes";

/// One agent to wake for a group message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WakeEntry {
    /// The stream entry's id.
    pub id: String,
    pub tenant_id: String,
    pub image_id: String,
    pub group_id: String,
    pub seq: u64,
}

impl WakeEntry {
    fn of(entry: &StreamId) -> Option<Self> {
        Some(Self {
            id: entry.id.clone(),
            tenant_id: entry.get("tenant")?,
            image_id: entry.get("image")?,
            group_id: entry.get("group")?,
            seq: entry.get("seq")?,
        })
    }
}

impl Replicas {
    fn wakes_key(&self) -> String {
        self.key("wakes")
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.inner.wakes_in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims a group message for this replica (`SET`, `NX` unless
    /// `outright`, kept for [`POST_CLAIM_KEPT`], long past any replica
    /// hearing of it late); `true` when this replica is to act on it.
    pub async fn claim_post(
        &self,
        tenant_id: &str,
        group_id: &str,
        message_id: &str,
        outright: bool,
    ) -> Result<bool, ApiError> {
        let mut conn = self.inner.conn.clone();
        let mut set = redis::cmd("SET");
        set.arg(self.key(&format!("post:{tenant_id}:{group_id}:{message_id}")))
            .arg(&self.inner.id);
        if !outright {
            set.arg("NX");
        }
        let claimed: Option<String> = set
            .arg("EX")
            .arg(POST_CLAIM_KEPT.as_secs())
            .query_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot claim the group message", &err))?;
        Ok(claimed.is_some())
    }

    /// Queues the wakes of `image_ids` for a group message.
    pub async fn queue_wakes(
        &self,
        tenant_id: &str,
        group_id: &str,
        seq: u64,
        image_ids: &[String],
    ) -> Result<(), ApiError> {
        if image_ids.is_empty() {
            return Ok(());
        }
        let key = self.wakes_key();
        let mut pipe = redis::pipe();
        for image_id in image_ids {
            pipe.cmd("XADD")
                .arg(&key)
                .arg("*")
                .arg("tenant")
                .arg(tenant_id)
                .arg("image")
                .arg(image_id)
                .arg("group")
                .arg(group_id)
                .arg("seq")
                .arg(seq)
                .ignore();
        }
        let mut conn = self.inner.conn.clone();
        pipe.query_async::<()>(&mut conn)
            .await
            .map_err(|err| redis_error("cannot queue the group message's wakes", &err))
    }

    /// Opens the connection wakes are read on (a read blocks it), with the
    /// consumer group made if it is not there yet.
    pub async fn wake_reader(&self) -> Result<redis::aio::MultiplexedConnection, ApiError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Duration::from_millis(500))
            .set_response_timeout(READ_BLOCK + Duration::from_secs(2));
        let mut conn = self
            .inner
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|err| redis_error("cannot connect to redis to read wakes", &err))?;
        let made: Result<(), _> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(self.wakes_key())
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await;
        match made {
            Err(err) if err.code() != Some("BUSYGROUP") => {
                Err(redis_error("cannot make the wakes' consumer group", &err))
            }
            _ => Ok(conn),
        }
    }

    /// Takes the next new wakes for this replica, waiting up to [`READ_BLOCK`].
    pub async fn read_wakes(&self, conn: &mut redis::aio::MultiplexedConnection) -> Result<Vec<WakeEntry>, ApiError> {
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(&self.inner.id)
            .arg("COUNT")
            .arg(BATCH)
            .arg("BLOCK")
            .arg(READ_BLOCK.as_millis() as u64)
            .arg("STREAMS")
            .arg(self.wakes_key())
            .arg(">")
            .query_async(conn)
            .await
            .map_err(|err| redis_error("cannot read wakes", &err))?;
        let entries = reply
            .into_iter()
            .flat_map(|reply| reply.keys)
            .flat_map(|key| key.ids)
            .collect::<Vec<_>>();
        Ok(self.parse(entries).await)
    }

    /// Takes over wakes idle for longer than [`RECLAIM_AFTER`]; entries
    /// delivered too often are dropped instead.
    pub async fn reclaim_wakes(&self) -> Result<Vec<WakeEntry>, ApiError> {
        let mut conn = self.inner.conn.clone();
        let reply: Result<StreamAutoClaimReply, _> = redis::cmd("XAUTOCLAIM")
            .arg(self.wakes_key())
            .arg(GROUP)
            .arg(&self.inner.id)
            .arg(RECLAIM_AFTER.as_millis() as u64)
            .arg("0-0")
            .arg("COUNT")
            .arg(BATCH)
            .query_async(&mut conn)
            .await;
        let reply = match reply {
            Ok(reply) => reply,
            // No consumer group yet (the reader makes it), or Redis lost it: nothing pending.
            Err(err) if err.code() == Some("NOGROUP") => return Ok(Vec::new()),
            Err(err) => return Err(redis_error("cannot claim pending wakes", &err)),
        };
        let mut claimed = Vec::with_capacity(reply.claimed.len());
        for entry in reply.claimed {
            if self.deliveries(&entry.id).await > MAX_DELIVERIES {
                tracing::error!(entry = %entry.id, "a group message's wake failed {MAX_DELIVERIES} times; dropped (the agent reads it when woken next)");
                metrics::counter!("avm_runtime_wakes_dropped_total").increment(1);
                self.ack_wake(&entry.id).await;
                continue;
            }
            claimed.push(entry);
        }
        Ok(self.parse(claimed).await)
    }

    /// Returns how many times an entry was delivered (0 if unknown).
    async fn deliveries(&self, id: &str) -> u64 {
        let mut conn = self.inner.conn.clone();
        let pending: Result<Vec<(String, String, u64, u64)>, _> = redis::cmd("XPENDING")
            .arg(self.wakes_key())
            .arg(GROUP)
            .arg(id)
            .arg(id)
            .arg(1)
            .query_async(&mut conn)
            .await;
        pending.ok().and_then(|rows| rows.first().map(|row| row.3)).unwrap_or(0)
    }

    /// Parses entries; one that is not a wake (unreadable) is dropped.
    async fn parse(&self, entries: Vec<StreamId>) -> Vec<WakeEntry> {
        let mut wakes = Vec::with_capacity(entries.len());
        for entry in entries {
            match WakeEntry::of(&entry) {
                Some(wake) => wakes.push(wake),
                None => {
                    tracing::warn!(entry = %entry.id, "an entry of the wakes' stream is not a wake; dropped");
                    self.ack_wake(&entry.id).await;
                }
            }
        }
        wakes
    }

    /// Marks a wake as being worked on here; `false` when it already is.
    pub fn begin_wake(&self, id: &str) -> bool {
        self.in_flight().insert(id.to_owned())
    }

    /// Ends the work on a wake: acknowledged and deleted when `done`, else
    /// left pending for a replica to take over.
    pub async fn end_wake(&self, id: &str, done: bool) {
        if done {
            self.ack_wake(id).await;
        }
        self.in_flight().remove(id);
    }

    async fn ack_wake(&self, id: &str) {
        let mut conn = self.inner.conn.clone();
        let acked: Result<(), _> = redis::pipe()
            .cmd("XACK")
            .arg(self.wakes_key())
            .arg(GROUP)
            .arg(id)
            .ignore()
            .cmd("XDEL")
            .arg(self.wakes_key())
            .arg(id)
            .ignore()
            .query_async(&mut conn)
            .await;
        if let Err(err) = acked {
            // Taken over and done again later: harmless.
            tracing::warn!(entry = id, error = %err, "cannot acknowledge a wake");
        }
    }

    /// Marks the wakes this replica works on as fresh, so no other replica
    /// takes them over while their agents read.
    pub async fn keep_wakes(&self) {
        let ids: Vec<String> = self.in_flight().iter().cloned().collect();
        if ids.is_empty() {
            return;
        }
        let mut conn = self.inner.conn.clone();
        let kept: Result<Vec<String>, _> = redis::cmd("XCLAIM")
            .arg(self.wakes_key())
            .arg(GROUP)
            .arg(&self.inner.id)
            .arg(0)
            .arg(&ids)
            .arg("JUSTID")
            .query_async(&mut conn)
            .await;
        if let Err(err) = kept {
            tracing::warn!(error = %err, "cannot keep this replica's wakes");
        }
    }

    /// Returns how many wakes this replica works on.
    pub fn wakes_in_flight(&self) -> usize {
        self.in_flight().len()
    }
}

impl Replicas {
    /// Forgets the consumers of replicas long gone: none of their wakes
    /// pending, no read for a minute (a live replica reads every few seconds,
    /// and would come back with its next read).
    pub async fn prune_wake_consumers(&self) {
        let mut conn = self.inner.conn.clone();
        let consumers: Result<Vec<std::collections::HashMap<String, redis::Value>>, _> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(self.wakes_key())
            .arg(GROUP)
            .query_async(&mut conn)
            .await;
        let Ok(consumers) = consumers else {
            return;
        };
        for consumer in consumers {
            let field = |name: &str| {
                consumer
                    .get(name)
                    .and_then(|value| redis::from_redis_value::<u64>(value).ok())
            };
            let Some(name) = consumer
                .get("name")
                .and_then(|value| redis::from_redis_value::<String>(value).ok())
            else {
                continue;
            };
            if name == self.inner.id || field("pending") != Some(0) || field("idle").is_none_or(|idle| idle < 60_000) {
                continue;
            }
            let deleted: Result<u64, _> = redis::cmd("XGROUP")
                .arg("DELCONSUMER")
                .arg(self.wakes_key())
                .arg(GROUP)
                .arg(&name)
                .query_async(&mut conn)
                .await;
            if deleted.is_ok() {
                tracing::debug!(consumer = %name, "forgot a gone replica's wake consumer");
            }
        }
    }
}
