//! The legacy HTTP+SSE transport of MCP (protocol 2024-11-05), which the SDK
//! no longer carries: the client holds a `GET` event stream open; its first
//! event, `endpoint`, names where to `POST` messages; the server's messages
//! come as `message` events. Requests go through the same guarded client as
//! streamable HTTP, and the endpoint must be on the stream's own origin.

use std::collections::BTreeMap;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use futures::stream::BoxStream;
use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use rmcp::RoleClient;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::Transport;

use super::fetch::refusal_in;

/// Why a message could not be posted.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct SseError(String);

/// An open SSE session with a server.
pub struct SseTransport {
    client: reqwest::Client,
    endpoint: Url,
    headers: HeaderMap,
    messages: BoxStream<'static, ServerJsonRpcMessage>,
}

/// Why connecting failed, and whether it was the credentials (401, 403).
pub type ConnectFailure = (String, bool);

impl SseTransport {
    /// Opens the event stream at `url` and waits for the `endpoint` event.
    pub async fn connect(
        client: reqwest::Client,
        url: &str,
        headers: &BTreeMap<String, String>,
    ) -> Result<Self, ConnectFailure> {
        let url = Url::parse(url).map_err(|err| (format!("{url:?} is not a URL: {err}"), false))?;
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            let (Ok(name), Ok(value)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) else {
                return Err((format!("the header {name:?} cannot be sent"), false));
            };
            map.insert(name, value);
        }
        let response = client
            .get(url.clone())
            .headers(map.clone())
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .send()
            .await
            .map_err(|err| (refusal_in(&err).unwrap_or_else(|| format!("{url}: {err}")), false))?;
        let status = response.status();
        if !status.is_success() {
            let refused = matches!(status.as_u16(), 401 | 403);
            return Err((format!("{url} answered {status}"), refused));
        }
        let mut events = response.bytes_stream().eventsource();
        let endpoint = loop {
            match events.next().await {
                Some(Ok(event)) if event.event == "endpoint" => break event.data,
                Some(Ok(_)) => continue,
                Some(Err(err)) => return Err((format!("{url}: the event stream broke: {err}"), false)),
                None => {
                    return Err((
                        format!("{url}: the event stream ended before naming its endpoint"),
                        false,
                    ));
                }
            }
        };
        let endpoint = url
            .join(endpoint.trim())
            .map_err(|err| (format!("{url}: its endpoint {endpoint:?} is not a URL: {err}"), false))?;
        if endpoint.origin() != url.origin() {
            return Err((
                format!("{url}: its endpoint {endpoint} is on another origin; messages go to the stream's own"),
                false,
            ));
        }
        let messages = events
            .filter_map(|event| async move {
                let event = event.ok()?;
                if event.event != "message" && !event.event.is_empty() {
                    return None;
                }
                match serde_json::from_str::<ServerJsonRpcMessage>(&event.data) {
                    Ok(message) => Some(message),
                    Err(err) => {
                        tracing::debug!(error = %err, "an MCP server sent an unreadable message");
                        None
                    }
                }
            })
            .boxed();
        Ok(Self {
            client,
            endpoint,
            headers: map,
            messages,
        })
    }
}

impl Transport<RoleClient> for SseTransport {
    type Error = SseError;

    fn send(&mut self, item: ClientJsonRpcMessage) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let request = self
            .client
            .post(self.endpoint.clone())
            .headers(self.headers.clone())
            .json(&item);
        async move {
            let response = request.send().await.map_err(|err| SseError(err.to_string()))?;
            if response.status().is_success() {
                Ok(())
            } else {
                Err(SseError(format!("the server answered {}", response.status())))
            }
        }
    }

    fn receive(&mut self) -> impl Future<Output = Option<ServerJsonRpcMessage>> + Send {
        self.messages.next()
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}
