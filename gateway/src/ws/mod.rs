//! `GET /ws`: the AgentX-compatible WebSocket protocol (PROTOCOL.md).
//!
//! `connection.rs` owns a socket: frames in order, requests concurrently,
//! subscriptions merged in, acknowledged delivery, limits. `dispatch.rs` is
//! the AgentX adapter over the same operations REST uses; its `Request` is
//! the one list of request names and the data each decodes.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use avm_common::{ApiError, Code};
use axum::extract::State;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;

use crate::http::{Query, RequestId, bearer_credential, error_response};
use crate::state::GatewayState;

mod connection;
mod dispatch;

use connection::Connection;

/// Query parameters of the upgrade request.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct WsQuery {
    /// `1` or `true` wraps every frame for acknowledged delivery (`__msgId`/`__ack`).
    #[serde(default)]
    ack: Option<String>,
    /// The credential (API key or access token), for clients that cannot set headers.
    #[serde(default)]
    token: Option<String>,
}

/// Upgrades to a WebSocket with small buffers (an idle connection stays a few KiB).
///
/// A credential in `?token=` or `Authorization` is checked before the upgrade
/// (401 with a JSON error when refused); without one, the first frame must
/// be an `auth` event.
#[utoipa::path(get, path = "/ws", tag = "system", params(WsQuery), security((), ("bearer" = [])),
    responses((status = 101, description = "Switching to the AgentX 1.9 WebSocket protocol (PROTOCOL.md)")))]
pub async fn upgrade(
    State(state): State<Arc<GatewayState>>,
    RequestId(request_id): RequestId,
    Query(query): Query<WsQuery>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let config = &state.config;
    let credential = match (query.token.as_deref(), bearer_credential(&headers)) {
        (Some(token), _) => Some(token.to_owned()),
        (None, Ok(header)) => header.map(str::to_owned),
        (None, Err(err)) => return error_response(&err, &request_id),
    };
    let caller = match &credential {
        Some(credential) => match state.auth.authenticate(Some(credential)).await {
            Ok(caller) => Some(caller),
            Err(err) => return error_response(&err, &request_id),
        },
        // Anonymous access (`--dev`) needs no credential at all.
        None => state.auth.authenticate(None).await.ok(),
    };
    if state.connections.load(Ordering::Relaxed) >= config.max_connections {
        let err = ApiError::new(
            Code::ResourceExhausted,
            "TOO_MANY_CONNECTIONS",
            "the gateway is at its connection limit",
        );
        return error_response(&err, &request_id);
    }
    let ws = match ws {
        Ok(ws) => ws,
        Err(rejection) => {
            let err = ApiError::invalid(
                "NOT_A_WEBSOCKET_UPGRADE",
                format!("not a websocket upgrade: {rejection}"),
            );
            return error_response(&err, &request_id);
        }
    };
    // Frames up to the transport limit are read whole, so even a frame that
    // ends the connection is answered with a clean 1009 close; only beyond it
    // does the transport give up mid-frame.
    let transport_limit = config.max_frame_bytes.saturating_mul(16);
    let ack = matches!(query.ack.as_deref(), Some("1" | "true"));
    ws.read_buffer_size(1024)
        .write_buffer_size(0)
        .max_write_buffer_size(transport_limit.max(64 * 1024))
        .max_message_size(transport_limit)
        .max_frame_size(transport_limit)
        .on_upgrade(move |socket| Connection::new(state, ack, credential, caller).run(socket))
        .into_response()
}
