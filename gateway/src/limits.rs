//! Requests per minute per tenant and per API key, enforced at the edge with
//! GCRA: a tenant with a limit of N may burst N requests, then one more every
//! 60/N seconds. Limits travel in the caller's token, so checking needs no
//! lookup; service principals are not limited.
//!
//! One gateway counts in memory with governor. Replicas share their counters
//! in Redis (`AVM_REDIS_URL`) through one atomic script per request; should
//! Redis fail, each replica falls back to its own counters rather than
//! refusing every request.
//!
//! Failed token exchanges are counted per client address the same way (in
//! Redis when configured): a client past its burst of failures is refused
//! before its next credential is even looked at, so guessing costs time.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use avm_common::ApiError;
use avm_common::auth::{Principal, Role};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

/// How many checks pass between two sweeps of idle in-memory buckets.
const SWEEP_EVERY: u64 = 4096;

/// GCRA over several buckets at once, with Redis's clock so every replica
/// agrees: admits only when every bucket has room, then charges them all.
/// KEYS: the buckets; ARGV: per bucket its emission interval and tolerance
/// (microseconds). Returns 0 when admitted, else the wait in microseconds.
///
/// Written here because no maintained crate offers a shared multi-bucket
/// GCRA on plain Redis (redis-cell needs a server module).
const GCRA_SCRIPT: &str = r"
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local next_tats = {}
for i, key in ipairs(KEYS) do
  local interval = tonumber(ARGV[2 * i - 1])
  local tolerance = tonumber(ARGV[2 * i])
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local allow_at = tat - tolerance
  if now < allow_at then return allow_at - now end
  next_tats[i] = tat + interval
end
for i, key in ipairs(KEYS) do
  redis.call('SET', key, next_tats[i], 'PX', math.ceil((next_tats[i] - now) / 1000) + 1)
end
return 0
";

/// The wait a GCRA bucket asks before its next cell, without charging it.
/// KEYS[1]: the bucket; ARGV[1]: its tolerance (microseconds). Returns 0
/// when a cell is free, else the wait in microseconds.
const GCRA_PEEK_SCRIPT: &str = r"
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
local allow_at = tat - tonumber(ARGV[1])
if now < allow_at then return allow_at - now end
return 0
";

/// Per-tenant and per-key request limits, and failed token exchanges per client.
#[derive(Clone, Default)]
pub struct RateLimiter {
    local: LocalLimiter,
    shared: Option<SharedLimiter>,
    failures: LocalFailures,
}

impl RateLimiter {
    /// Returns a limiter counting in this process.
    pub fn new() -> Self {
        Self::default()
    }

    /// Returns a limiter sharing its counters through the Redis at `url`,
    /// under keys starting with `prefix`.
    pub async fn shared(url: &str, prefix: &str) -> Result<Self, ApiError> {
        let client = redis::Client::open(url)
            .map_err(|_| ApiError::invalid("INVALID_REDIS_URL", "the redis url cannot be parsed"))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Duration::from_secs(2))
            .set_response_timeout(Duration::from_millis(500))
            .set_number_of_retries(2);
        let connection = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(|err| {
                tracing::error!(error = %err, "cannot reach redis");
                ApiError::unavailable("REDIS_UNAVAILABLE", "cannot reach redis (AVM_REDIS_URL)")
            })?;
        Ok(Self {
            local: LocalLimiter::default(),
            shared: Some(SharedLimiter {
                connection,
                prefix: format!("{prefix}rl:"),
                script: Arc::new(redis::Script::new(GCRA_SCRIPT)),
                peek: Arc::new(redis::Script::new(GCRA_PEEK_SCRIPT)),
            }),
            failures: LocalFailures::default(),
        })
    }

    /// Returns how long `client` must wait before its next token exchange
    /// when its failures used up the burst of `per_minute`; `Ok` otherwise
    /// (and always when `per_minute` is 0).
    pub async fn check_failures(&self, client: IpAddr, per_minute: u32) -> Result<(), Duration> {
        let Some(bucket) = FailureBucket::new(client, per_minute) else {
            return Ok(());
        };
        if let Some(shared) = &self.shared {
            match shared.peek(&bucket).await {
                Ok(result) => return result,
                Err(err) => tracing::warn!(error = %err, "redis rate limiting failed; counting in this process"),
            }
        }
        self.failures.peek(&bucket)
    }

    /// Counts one failed token exchange of `client`.
    pub async fn record_failure(&self, client: IpAddr, per_minute: u32) {
        let Some(bucket) = FailureBucket::new(client, per_minute) else {
            return;
        };
        if let Some(shared) = &self.shared {
            let charged = shared.check(&[(bucket.key.clone(), per_minute)]).await;
            match charged {
                Ok(_) => return,
                Err(err) => tracing::warn!(error = %err, "redis rate limiting failed; counting in this process"),
            }
        }
        self.failures.charge(&bucket);
    }

    /// Admits one request of `principal`, or returns how long to wait.
    pub async fn check(&self, principal: &Principal) -> Result<(), Duration> {
        if principal.role == Role::Service {
            return Ok(());
        }
        let mut buckets: Vec<(String, u32)> = Vec::with_capacity(2);
        if principal.tenant_limits.requests_per_minute > 0 {
            buckets.push((
                format!("t:{}", principal.tenant_id),
                principal.tenant_limits.requests_per_minute,
            ));
        }
        if let Some(key_id) = &principal.key_id
            && principal.key_limits.requests_per_minute > 0
        {
            buckets.push((format!("k:{key_id}"), principal.key_limits.requests_per_minute));
        }
        if buckets.is_empty() {
            return Ok(());
        }
        if let Some(shared) = &self.shared {
            match shared.check(&buckets).await {
                Ok(result) => return result,
                Err(err) => {
                    tracing::warn!(error = %err, "redis rate limiting failed; counting in this process");
                }
            }
        }
        self.local.check(&buckets)
    }
}

/// In-memory GCRA: one governor keyed limiter per distinct limit value
/// (governor's keyed limiters share one quota).
#[derive(Clone, Default)]
struct LocalLimiter {
    by_rate: Arc<Mutex<HashMap<u32, Arc<DefaultKeyedRateLimiter<String>>>>>,
    checks: Arc<AtomicU64>,
}

impl LocalLimiter {
    fn check(&self, buckets: &[(String, u32)]) -> Result<(), Duration> {
        if self.checks.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == SWEEP_EVERY - 1 {
            self.sweep();
        }
        for (key, per_minute) in buckets {
            let Some(rate) = NonZeroU32::new(*per_minute) else {
                continue;
            };
            let limiter = {
                let mut by_rate = self.by_rate.lock().unwrap_or_else(|poison| poison.into_inner());
                Arc::clone(
                    by_rate
                        .entry(*per_minute)
                        .or_insert_with(|| Arc::new(DefaultKeyedRateLimiter::keyed(Quota::per_minute(rate)))),
                )
            };
            limiter
                .check_key(key)
                .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))?;
        }
        Ok(())
    }

    /// Forgets buckets that are full again (their history no longer matters).
    fn sweep(&self) {
        let limiters: Vec<_> = {
            let by_rate = self.by_rate.lock().unwrap_or_else(|poison| poison.into_inner());
            by_rate.values().cloned().collect()
        };
        for limiter in limiters {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
    }
}

/// The failure bucket of one client: a burst of `per_minute` failures,
/// then one more every 60/`per_minute` seconds.
struct FailureBucket {
    key: String,
    interval: Duration,
    tolerance: Duration,
}

impl FailureBucket {
    fn new(client: IpAddr, per_minute: u32) -> Option<Self> {
        let per_minute = NonZeroU32::new(per_minute)?;
        let interval = Duration::from_secs(60) / per_minute.get();
        Some(Self {
            // An IPv6 client is counted by its /64, which one host usually holds whole.
            key: match client {
                IpAddr::V4(ip) => format!("fx:{ip}"),
                IpAddr::V6(ip) => format!("fx:{:x}", u128::from(ip) >> 64),
            },
            interval,
            tolerance: interval * (per_minute.get() - 1),
        })
    }
}

/// Failure buckets in this process: GCRA written out, since governor cannot
/// tell whether a bucket has room without charging it.
#[derive(Clone, Default)]
struct LocalFailures {
    /// Theoretical arrival time of each client's next failure.
    tats: Arc<Mutex<HashMap<String, Instant>>>,
}

impl LocalFailures {
    /// Most clients remembered; full buckets are forgotten first.
    const MAX_CLIENTS: usize = 100_000;

    fn peek(&self, bucket: &FailureBucket) -> Result<(), Duration> {
        let now = Instant::now();
        let tats = self.tats.lock().unwrap_or_else(|poison| poison.into_inner());
        match tats.get(&bucket.key) {
            Some(tat) if now + bucket.tolerance < *tat => Err(*tat - bucket.tolerance - now),
            _ => Ok(()),
        }
    }

    fn charge(&self, bucket: &FailureBucket) {
        let now = Instant::now();
        let mut tats = self.tats.lock().unwrap_or_else(|poison| poison.into_inner());
        if tats.len() >= Self::MAX_CLIENTS {
            tats.retain(|_, tat| *tat > now);
        }
        let tat = tats.get(&bucket.key).copied().filter(|tat| *tat > now).unwrap_or(now);
        // Past the burst the bucket is not charged further: a client waits
        // out its limit, not every attempt it made while refused.
        if now + bucket.tolerance >= tat {
            tats.insert(bucket.key.clone(), tat + bucket.interval);
        }
    }
}

#[derive(Clone)]
struct SharedLimiter {
    connection: ConnectionManager,
    prefix: String,
    script: Arc<redis::Script>,
    peek: Arc<redis::Script>,
}

impl SharedLimiter {
    async fn check(&self, buckets: &[(String, u32)]) -> redis::RedisResult<Result<(), Duration>> {
        let mut invocation = self.script.prepare_invoke();
        for (key, per_minute) in buckets {
            let interval = 60_000_000 / u64::from(*per_minute);
            let tolerance = interval * u64::from(per_minute.saturating_sub(1));
            invocation
                .key(format!("{}{key}", self.prefix))
                .arg(interval)
                .arg(tolerance);
        }
        let wait_us: u64 = invocation.invoke_async(&mut self.connection.clone()).await?;
        Ok(if wait_us == 0 {
            Ok(())
        } else {
            Err(Duration::from_micros(wait_us))
        })
    }

    async fn peek(&self, bucket: &FailureBucket) -> redis::RedisResult<Result<(), Duration>> {
        let tolerance = u64::try_from(bucket.tolerance.as_micros()).unwrap_or(u64::MAX);
        let wait_us: u64 = self
            .peek
            .key(format!("{}{}", self.prefix, bucket.key))
            .arg(tolerance)
            .invoke_async(&mut self.connection.clone())
            .await?;
        Ok(if wait_us == 0 {
            Ok(())
        } else {
            Err(Duration::from_micros(wait_us))
        })
    }
}

/// Returns the `Retry-After` seconds for a wait, rounded up, at least 1.
pub fn retry_after_secs(wait: Duration) -> u64 {
    wait.as_secs() + u64::from(wait.subsec_nanos() > 0).max(u64::from(wait.is_zero()))
}

#[cfg(test)]
mod tests {
    use avm_common::auth::{Limits, Scopes};

    use super::*;

    fn principal(tenant_rpm: u32, key_rpm: u32) -> Principal {
        Principal {
            tenant_id: "ten_1".into(),
            user_id: "usr_1".into(),
            role: Role::Member,
            operator: false,
            key_id: Some("key_1".into()),
            scopes: Scopes::ALL,
            tenant_limits: Limits {
                requests_per_minute: tenant_rpm,
                tokens_per_month: 0,
            },
            key_limits: Limits {
                requests_per_minute: key_rpm,
                tokens_per_month: 0,
            },
        }
    }

    async fn admitted(limiter: &RateLimiter, caller: &Principal, tries: usize) -> usize {
        let mut admitted = 0;
        for _ in 0..tries {
            if limiter.check(caller).await.is_ok() {
                admitted += 1;
            }
        }
        admitted
    }

    #[tokio::test]
    async fn a_burst_of_the_limit_passes_and_the_next_waits() {
        let limiter = RateLimiter::new();
        let caller = principal(10, 0);
        assert_eq!(admitted(&limiter, &caller, 100).await, 10);
        let wait = limiter.check(&caller).await.err().unwrap_or_default();
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(6), "{wait:?}");
    }

    #[tokio::test]
    async fn the_tighter_of_tenant_and_key_limits_applies() {
        let limiter = RateLimiter::new();
        assert_eq!(admitted(&limiter, &principal(100, 3), 20).await, 3);
        assert_eq!(admitted(&limiter, &principal(0, 0), 1000).await, 1000);
    }

    /// Issue 26 item 15: failed token exchanges are limited per client: a
    /// burst passes, the next attempt must wait, whatever its credential,
    /// and another client is not held back.
    #[tokio::test]
    async fn failed_exchanges_of_a_client_are_limited_after_a_burst() {
        let limiter = RateLimiter::new();
        let client: IpAddr = [192, 0, 2, 1].into();
        let other: IpAddr = [192, 0, 2, 2].into();
        for _ in 0..10 {
            assert!(limiter.check_failures(client, 10).await.is_ok());
            limiter.record_failure(client, 10).await;
        }
        let wait = limiter.check_failures(client, 10).await.err().unwrap_or_default();
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(6), "{wait:?}");
        // Refused attempts are not counted on top: the wait does not grow.
        for _ in 0..100 {
            limiter.record_failure(client, 10).await;
        }
        let later = limiter.check_failures(client, 10).await.err().unwrap_or_default();
        assert!(later <= wait, "{later:?} > {wait:?}");
        assert!(limiter.check_failures(other, 10).await.is_ok());
        assert!(limiter.check_failures(client, 0).await.is_ok(), "0 turns it off");
    }

    #[test]
    fn retry_after_rounds_up() {
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(5_999)), 6);
        assert_eq!(retry_after_secs(Duration::from_secs(6)), 6);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }
}
