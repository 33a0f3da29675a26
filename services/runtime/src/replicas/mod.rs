//! Several runtime processes sharing the agents, through Redis (set
//! `AVM_REDIS_URL` on every runtime).
//!
//! - Each replica registers itself: a heartbeat key holding the address the
//!   others and the gateways reach it at (`AVM_SERVER_ADVERTISE`), renewed
//!   every second and gone three seconds after the replica is.
//! - An image's agent runs on the replica holding the image's lease: the
//!   lease names the replica and a fencing token (a counter per image, raised
//!   at every claim). A lease is good while its replica's heartbeat lives, so
//!   one renewal per replica keeps all its leases, however many agents it
//!   holds; it is released when the agent leaves the pool. A replica whose
//!   own heartbeat lapsed (paused, cut off) drops every agent before it takes
//!   another turn, since survivors may have claimed them.
//! - Group messages wake agents through a stream all replicas consume
//!   (`wakes.rs`): a wake is acknowledged once the agent read the message,
//!   and a dead replica's unacknowledged wakes are taken over.
//! - The turns a replica runs are recorded under its name, so when it dies a
//!   survivor ends each of them in history and on the event streams
//!   (`RUNTIME_LOST`); each record is taken by exactly one survivor.
//!
//! The scripts read keys they are not handed (the owner's heartbeat), so the
//! Redis must not be a cluster.

mod fanout;
mod remote;
mod wakes;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use avm_common::ApiError;
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};

pub use fanout::Fanout;
pub(crate) use fanout::Followers;
use fanout::Outgoing;
pub use remote::{forwarded, relay_message};
pub use wakes::{RECLAIM_AFTER, WakeEntry};

/// How long a replica's heartbeat outlives its last renewal.
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(3);
/// How often a replica renews its heartbeat and looks for dead ones.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// Where a replica's peers find it and how they share Redis.
#[derive(Clone, Debug)]
pub struct ReplicaSettings {
    pub redis_url: String,
    /// Prefix of every key (`[redis] key_prefix`).
    pub key_prefix: String,
    /// The gRPC address other replicas and gateways reach this one at.
    pub advertise: String,
    /// How this replica calls the others.
    pub grpc: avm_common::config::GrpcConfig,
}

/// Who holds an image's agent, as a claim found.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim {
    /// This replica (it holds, or just took, the lease).
    Here {
        /// A replica that held the lease and is gone: its turn for the image
        /// (if it ran one) is lost.
        lost_from: Option<String>,
    },
    /// Another live replica, at this address.
    Elsewhere(String),
}

/// A turn as the other replicas learn of it, to end it if its replica dies.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TurnRecord {
    pub tenant_id: String,
    pub container_id: String,
    pub image_id: String,
    pub agent_id: String,
    pub session_id: String,
    /// The user message that started the turn (empty in records of older
    /// replicas): its lost turn's error message is named after it.
    #[serde(default)]
    pub user_message_id: String,
    /// The group whose messages the turn answered (empty for a direct
    /// message): a survivor wakes the agent again to answer them.
    #[serde(default)]
    pub group_id: String,
}

/// The Redis side of one runtime replica; cheap to clone.
#[derive(Clone)]
pub struct Replicas {
    inner: Arc<Inner>,
}

struct Inner {
    id: String,
    settings: ReplicaSettings,
    client: redis::Client,
    conn: ConnectionManager,
    fanout: Fanout,
    /// Clients of the other replicas.
    remotes: remote::Remotes,
    /// The leases this replica holds, by (tenant, image): the lease's value.
    leases: Mutex<HashMap<(String, String), String>>,
    /// The ids of the wakes this replica works on.
    wakes_in_flight: Mutex<std::collections::HashSet<String>>,
    draining: AtomicBool,
}

const CLAIM: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  local owner = string.match(current, '^(%S+)')
  if owner == ARGV[1] then return {1, current, ''} end
  local addr = redis.call('GET', ARGV[2] .. owner)
  if addr then return {0, addr, owner} end
end
local fence = redis.call('INCR', KEYS[2])
local lease = ARGV[1] .. ' ' .. fence
redis.call('SET', KEYS[1], lease)
local previous = ''
if current then previous = string.match(current, '^(%S+)') end
return {1, lease, previous}
";

const OWNER: &str = r"
local current = redis.call('GET', KEYS[1])
if not current then return '' end
local owner = string.match(current, '^(%S+)')
if owner == ARGV[1] then return '' end
return redis.call('GET', ARGV[2] .. owner) or ''
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

fn redis_error(what: &str, err: &redis::RedisError) -> ApiError {
    // The error names the command, never the URL or its password.
    tracing::warn!(error = %err, "{what}");
    ApiError::unavailable(
        "REPLICAS_UNAVAILABLE",
        format!("{what}: the runtimes' shared store does not answer"),
    )
}

impl Replicas {
    /// Connects to Redis and registers this replica.
    pub async fn connect(
        settings: ReplicaSettings,
        retention: usize,
        retention_period: Duration,
    ) -> Result<Self, ApiError> {
        let client = redis::Client::open(settings.redis_url.as_str())
            .map_err(|_| ApiError::invalid("INVALID_REDIS_URL", "AVM_REDIS_URL is not a redis:// URL"))?;
        // Bounded, so a call that needs Redis while it is down fails
        // (UNAVAILABLE) within 2 s rather than waiting for it to return.
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_millis(500))
            .set_response_timeout(Duration::from_millis(500))
            .set_number_of_retries(1)
            .set_max_delay(200);
        let conn = ConnectionManager::new_with_config(client.clone(), config)
            .await
            .map_err(|err| redis_error("cannot connect to redis", &err))?;
        let id = avm_common::ids::new_id("rt");
        let fanout = Fanout::new(&id, &settings.key_prefix, conn.clone(), retention, retention_period);
        let remotes = remote::Remotes::new(settings.grpc.clone());
        let replicas = Self {
            inner: Arc::new(Inner {
                id,
                settings,
                client,
                conn,
                fanout,
                remotes,
                leases: Mutex::new(HashMap::new()),
                wakes_in_flight: Mutex::new(std::collections::HashSet::new()),
                draining: AtomicBool::new(false),
            }),
        };
        replicas.register().await?;
        tracing::info!(
            replica = %replicas.inner.id,
            advertise = %replicas.inner.settings.advertise,
            "runtime replica registered"
        );
        Ok(replicas)
    }

    /// Returns the client of the replica at `addr`.
    pub fn remote(&self, addr: &str) -> Result<avm_proto::runtime::v1::RuntimeServiceRemote, ApiError> {
        self.inner.remotes.client(addr)
    }

    /// Returns this replica's id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// Returns the address this replica advertises.
    pub fn advertise(&self) -> &str {
        &self.inner.settings.advertise
    }

    /// Returns the fan-out of this replica's session events.
    pub fn fanout(&self) -> &Fanout {
        &self.inner.fanout
    }

    /// Returns the Redis client (for the fan-out's pub/sub connection).
    pub fn client(&self) -> redis::Client {
        self.inner.client.clone()
    }

    /// Returns the Redis connection (for the outbox).
    pub(crate) fn connection(&self) -> ConnectionManager {
        self.inner.conn.clone()
    }

    /// Returns the Redis key of `name` under the runtimes' prefix.
    pub(crate) fn key(&self, name: &str) -> String {
        format!("{}runtime:{name}", self.inner.settings.key_prefix)
    }

    fn heartbeat_prefix(&self) -> String {
        self.key("replica:")
    }

    fn lease_key(&self, tenant_id: &str, image_id: &str) -> String {
        self.key(&format!("lease:{tenant_id}/{image_id}"))
    }

    fn fence_key(&self, tenant_id: &str, image_id: &str) -> String {
        self.key(&format!("fence:{tenant_id}/{image_id}"))
    }

    fn turns_key(&self, replica_id: &str) -> String {
        self.key(&format!("turns:{replica_id}"))
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), String>> {
        self.inner.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn register(&self) -> Result<(), ApiError> {
        let mut conn = self.inner.conn.clone();
        redis::pipe()
            .cmd("SET")
            .arg(format!("{}{}", self.heartbeat_prefix(), self.inner.id))
            .arg(&self.inner.settings.advertise)
            .arg("PX")
            .arg(HEARTBEAT_TTL.as_millis() as u64)
            .ignore()
            .cmd("SADD")
            .arg(self.key("replicas"))
            .arg(&self.inner.id)
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(|err| redis_error("cannot register the runtime replica", &err))
    }

    /// Renews this replica's heartbeat; `false` when it had lapsed, so its
    /// leases may be another's now (it is registered again).
    pub async fn heartbeat(&self) -> Result<bool, ApiError> {
        let mut conn = self.inner.conn.clone();
        let renewed: Option<String> = redis::cmd("SET")
            .arg(format!("{}{}", self.heartbeat_prefix(), self.inner.id))
            .arg(&self.inner.settings.advertise)
            .arg("PX")
            .arg(HEARTBEAT_TTL.as_millis() as u64)
            .arg("XX")
            .query_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot renew the runtime replica's heartbeat", &err))?;
        if renewed.is_some() {
            return Ok(true);
        }
        self.leases().clear();
        self.register().await?;
        Ok(false)
    }

    /// Claims an image's agent for this replica unless a live replica holds it.
    pub async fn claim(&self, tenant_id: &str, image_id: &str) -> Result<Claim, ApiError> {
        let key = (tenant_id.to_owned(), image_id.to_owned());
        if self.leases().contains_key(&key) {
            return Ok(Claim::Here { lost_from: None });
        }
        let mut conn = self.inner.conn.clone();
        let (won, value, previous): (i64, String, String) = redis::Script::new(CLAIM)
            .key(self.lease_key(tenant_id, image_id))
            .key(self.fence_key(tenant_id, image_id))
            .arg(&self.inner.id)
            .arg(self.heartbeat_prefix())
            .invoke_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot claim the image's agent", &err))?;
        if won == 0 {
            return Ok(Claim::Elsewhere(value));
        }
        self.leases().insert(key, value);
        let lost_from = Some(previous).filter(|previous| !previous.is_empty() && *previous != self.inner.id);
        Ok(Claim::Here { lost_from })
    }

    /// Returns the address of the live replica holding an image's agent, when
    /// it is not this one.
    pub async fn owner(&self, tenant_id: &str, image_id: &str) -> Result<Option<String>, ApiError> {
        if self.leases().contains_key(&(tenant_id.to_owned(), image_id.to_owned())) {
            return Ok(None);
        }
        let mut conn = self.inner.conn.clone();
        let addr: String = redis::Script::new(OWNER)
            .key(self.lease_key(tenant_id, image_id))
            .arg(&self.inner.id)
            .arg(self.heartbeat_prefix())
            .invoke_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot find the image's agent", &err))?;
        Ok(Some(addr).filter(|addr| !addr.is_empty()))
    }

    /// Returns whether this replica holds an image's lease.
    pub fn holds(&self, tenant_id: &str, image_id: &str) -> bool {
        self.leases().contains_key(&(tenant_id.to_owned(), image_id.to_owned()))
    }

    /// Releases an image's lease (when its agent leaves the pool).
    pub async fn release(&self, tenant_id: &str, image_id: &str) {
        let Some(value) = self.leases().remove(&(tenant_id.to_owned(), image_id.to_owned())) else {
            return;
        };
        let mut conn = self.inner.conn.clone();
        let released: Result<i64, _> = redis::Script::new(RELEASE)
            .key(self.lease_key(tenant_id, image_id))
            .arg(value)
            .invoke_async(&mut conn)
            .await;
        if let Err(err) = released {
            tracing::warn!(image_id, error = %err, "cannot release the image's lease; it lapses with this replica");
        }
    }

    /// Returns the images whose leases this replica holds.
    pub fn held(&self) -> Vec<(String, String)> {
        self.leases().keys().cloned().collect()
    }

    /// Records a turn this replica runs.
    pub fn turn_started(&self, record: &TurnRecord) {
        let Ok(json) = serde_json::to_string(record) else {
            return;
        };
        self.inner.fanout.send(Outgoing::TurnStarted {
            key: self.turns_key(&self.inner.id),
            field: format!("{}/{}", record.tenant_id, record.image_id),
            record: json,
        });
    }

    /// Forgets a turn this replica ran.
    pub fn turn_ended(&self, tenant_id: &str, image_id: &str) {
        self.inner.fanout.send(Outgoing::TurnEnded {
            key: self.turns_key(&self.inner.id),
            field: format!("{tenant_id}/{image_id}"),
        });
    }

    /// Returns the registered replicas whose heartbeat is gone.
    pub async fn dead_replicas(&self) -> Result<Vec<String>, ApiError> {
        let others = self.other_heartbeats().await?;
        Ok(others
            .into_iter()
            .filter(|(_, addr)| addr.is_none())
            .map(|(id, _)| id)
            .collect())
    }

    /// Returns every other registered replica with its advertised address,
    /// `None` once its heartbeat is gone.
    async fn other_heartbeats(&self) -> Result<Vec<(String, Option<String>)>, ApiError> {
        let mut conn = self.inner.conn.clone();
        let members: Vec<String> = redis::cmd("SMEMBERS")
            .arg(self.key("replicas"))
            .query_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot list the runtime replicas", &err))?;
        let others: Vec<String> = members.into_iter().filter(|id| *id != self.inner.id).collect();
        if others.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &others {
            pipe.cmd("GET").arg(format!("{}{id}", self.heartbeat_prefix()));
        }
        let addrs: Vec<Option<String>> = pipe
            .query_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot check the runtime replicas", &err))?;
        Ok(others.into_iter().zip(addrs).collect())
    }

    /// Returns the turns a dead replica was running, by record field.
    pub async fn lost_turns(&self, replica_id: &str) -> Result<Vec<(String, TurnRecord)>, ApiError> {
        let mut conn = self.inner.conn.clone();
        let turns: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(self.turns_key(replica_id))
            .query_async(&mut conn)
            .await
            .map_err(|err| redis_error("cannot read a dead replica's turns", &err))?;
        Ok(turns
            .into_iter()
            .filter_map(|(field, json)| Some((field, serde_json::from_str(&json).ok()?)))
            .collect())
    }

    /// Takes a dead replica's turn record; `true` for exactly one taker.
    pub async fn take_lost_turn(&self, replica_id: &str, field: &str) -> bool {
        let mut conn = self.inner.conn.clone();
        let taken: Result<i64, _> = redis::cmd("HDEL")
            .arg(self.turns_key(replica_id))
            .arg(field)
            .query_async(&mut conn)
            .await;
        matches!(taken, Ok(1))
    }

    /// Forgets a dead replica whose turns were all taken.
    pub async fn forget(&self, replica_id: &str) {
        let mut conn = self.inner.conn.clone();
        let forgotten: Result<(), _> = redis::pipe()
            .cmd("SREM")
            .arg(self.key("replicas"))
            .arg(replica_id)
            .ignore()
            .query_async(&mut conn)
            .await;
        if let Err(err) = forgotten {
            tracing::warn!(replica = replica_id, error = %err, "cannot forget a dead runtime replica");
        }
    }

    /// Returns the addresses of the other live replicas.
    pub async fn others(&self) -> Result<Vec<String>, ApiError> {
        let others = self.other_heartbeats().await?;
        Ok(others.into_iter().filter_map(|(_, addr)| addr).collect())
    }

    /// Stops taking agents (SIGTERM).
    pub fn drain(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    /// Returns whether the replica stopped taking agents.
    pub fn draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Leaves: removes the heartbeat and the replica's registration (its
    /// leases should have been released first).
    pub async fn deregister(&self) {
        let mut conn = self.inner.conn.clone();
        let left: Result<(), _> = redis::pipe()
            .cmd("DEL")
            .arg(format!("{}{}", self.heartbeat_prefix(), self.inner.id))
            .ignore()
            .cmd("SREM")
            .arg(self.key("replicas"))
            .arg(&self.inner.id)
            .ignore()
            .query_async(&mut conn)
            .await;
        if let Err(err) = left {
            tracing::warn!(error = %err, "cannot deregister the runtime replica; it lapses in 3 s");
        }
    }
}
