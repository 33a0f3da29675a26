//! Gateway settings (`[gateway]`, `AVM_GATEWAY_*`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Limits and timings of the public edge.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Largest WebSocket frame or HTTP body accepted; a larger frame gets a
    /// typed error and the connection goes on (up to 4x this, past which the
    /// connection is closed with 1009).
    pub max_frame_bytes: usize,
    /// Interval of WebSocket pings; a connection silent for two intervals is closed.
    #[serde(with = "humantime_serde")]
    pub ping_interval: Duration,
    /// How long one event may wait for a slow client before it is disconnected.
    #[serde(with = "humantime_serde")]
    pub send_timeout: Duration,
    /// Requests one connection may have in flight at once.
    pub max_requests_in_flight: usize,
    /// Sessions one connection may subscribe to.
    pub max_subscriptions: usize,
    /// Frames per second one connection may send.
    pub messages_per_second: u32,
    /// Open WebSocket connections this gateway accepts.
    pub max_connections: usize,
    /// Wrapped (acknowledged) frames a client may leave unacknowledged.
    pub max_unacked: usize,
    /// How long a WebSocket without a credential has to send its `auth` frame.
    #[serde(with = "humantime_serde")]
    pub auth_timeout: Duration,
    /// Failed `POST /v1/auth/token` calls one client may make in a burst;
    /// then one more every 60/N seconds, and 429 meanwhile (0: no limit).
    pub failed_token_exchanges_per_minute: u32,
    /// The header a proxy in front of the gateway names the client in
    /// (`x-forwarded-for`: its last address; `x-real-ip`); unset, the
    /// client is the connection's peer. Set it only behind such a proxy: a
    /// client reaching the gateway directly could name anyone.
    pub client_ip_header: Option<String>,
    /// How long an HTTP connection may wait for its next request's head (or
    /// take to send one) before it is closed.
    #[serde(with = "humantime_serde")]
    pub keep_alive_timeout: Duration,
    /// Largest request head (request line and headers), in bytes; a larger
    /// one is refused with 431 `HEADERS_TOO_LARGE` (a request target over
    /// 32 KiB with 414 `URI_TOO_LONG`). A connection that sent a large head
    /// may keep a read buffer that large while it idles.
    pub max_head_bytes: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: 1024 * 1024,
            ping_interval: Duration::from_secs(25),
            send_timeout: Duration::from_secs(10),
            max_requests_in_flight: 32,
            max_subscriptions: 256,
            messages_per_second: 100,
            max_connections: 10_000,
            max_unacked: 1024,
            auth_timeout: Duration::from_secs(10),
            failed_token_exchanges_per_minute: 10,
            client_ip_header: None,
            keep_alive_timeout: Duration::from_secs(30),
            max_head_bytes: 64 * 1024,
        }
    }
}
