//! HTTP and SSE plumbing shared by the Anthropic and OpenAI drivers: one pooled
//! client per provider, the request bounded by `request_timeout` until the
//! response headers, every chunk of the reply by `idle_timeout`, and HTTP,
//! transport and provider failures mapped to [`LlmError`] with the API key
//! scrubbed from every message.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use avm_common::config::REDACTED;
use bytes::Bytes;
use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::stream::{BoxStream, Stream, StreamExt};
use reqwest::header::{ACCEPT, HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{StatusCode, Url};
use tokio::time::{Instant, Sleep};

use super::{LlmError, LlmErrorKind, LlmEvent, LlmStream};
use crate::config::LlmConfig;

/// How long an idle pooled connection to the provider is kept for the next turn.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Largest error body read from a failed response; the rest is not needed to explain it.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Longest excerpt of the provider's own error message passed on to the user.
const MAX_DETAIL_CHARS: usize = 300;

/// Whether a decoder expects more SSE events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Progress {
    More,
    Complete,
}

/// Turns one provider's SSE events into [`LlmEvent`]s.
pub(super) trait SseDecoder: Send + Unpin + 'static {
    /// Appends the events that `event` carries to `out` and returns whether the
    /// reply is complete.
    fn decode(&mut self, event: &Event, out: &mut VecDeque<LlmEvent>) -> Result<Progress, LlmError>;

    /// Appends the final events to `out` when the body ends before the decoder
    /// reported the reply complete, or returns why the reply is broken.
    fn finish(&mut self, out: &mut VecDeque<LlmEvent>) -> Result<(), LlmError>;
}

/// A provider endpoint and the client that reaches it.
pub(super) struct HttpTransport {
    provider: &'static str,
    client: reqwest::Client,
    endpoint: Url,
    /// `host:port` of the endpoint, for messages (never the credentials of the URL).
    authority: String,
    api_key: Option<Arc<str>>,
    request_timeout: Duration,
    idle_timeout: Duration,
}

impl HttpTransport {
    /// Returns a transport that posts to `path` under the configured base URL
    /// (or `default_base_url`), sending `headers` with every request.
    pub(super) fn new(
        provider: &'static str,
        config: &LlmConfig,
        default_base_url: &str,
        path: &str,
        mut headers: HeaderMap,
    ) -> Result<Self, LlmError> {
        let base = config
            .base_url
            .as_deref()
            .filter(|url| !url.trim().is_empty())
            .unwrap_or(default_base_url);
        let endpoint = endpoint_url(base.trim(), path)?;
        let authority = match (endpoint.host_str(), endpoint.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (Some(host), None) => host.to_owned(),
            (None, _) => endpoint.scheme().to_owned(),
        };
        headers.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .connect_timeout(config.request_timeout)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_nodelay(true)
            .build()
            .map_err(|err| {
                LlmError::new(
                    LlmErrorKind::Unavailable,
                    format!("cannot set up the HTTP client for the LLM provider: {err}"),
                )
            })?;
        Ok(Self {
            provider,
            client,
            endpoint,
            authority,
            api_key: api_key(config).map(Arc::from),
            request_timeout: config.request_timeout,
            idle_timeout: config.idle_timeout,
        })
    }

    /// Posts `body` and returns the decoded event stream once the provider has
    /// answered with a success status.
    pub(super) async fn open<B, D>(&self, body: &B, decoder: D) -> Result<LlmStream, LlmError>
    where
        B: serde::Serialize + Sync + ?Sized,
        D: SseDecoder,
    {
        let response = match self.send(body).await {
            Ok(response) => response,
            Err(err) => {
                let err = scrub(err, self.api_key.as_deref());
                tracing::warn!(
                    provider = self.provider,
                    reason = err.kind.reason(),
                    "llm request failed"
                );
                return Err(err);
            }
        };
        let bytes = response.bytes_stream().map(|chunk| chunk.map_err(body_error)).boxed();
        let events = IdleTimeout::new(bytes, self.idle_timeout)
            .eventsource()
            .map(|event| event.map_err(sse_error))
            .boxed();
        Ok(DecodedStream {
            provider: self.provider,
            events: Some(events),
            decoder,
            pending: VecDeque::new(),
            api_key: self.api_key.clone(),
        }
        .boxed())
    }

    /// Sends the request and checks the status, all within `request_timeout`
    /// (an error body included: a provider that stalls there must not hold the turn).
    async fn send<B: serde::Serialize + Sync + ?Sized>(&self, body: &B) -> Result<reqwest::Response, LlmError> {
        let deadline = Instant::now() + self.request_timeout;
        let request = self.client.post(self.endpoint.clone()).json(body).send();
        let response = match tokio::time::timeout_at(deadline, request).await {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => return Err(self.request_error(&err)),
            Err(_) => return Err(self.request_timed_out()),
        };
        let status = response.status();
        if status.is_success() {
            return check_content_type(response, deadline).await;
        }
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok());
        let detail = tokio::time::timeout_at(deadline, read_limited(response)).await.ok();
        Err(status_error(
            status,
            detail.as_deref().and_then(error_detail),
            retry_after,
            self.api_key.is_some(),
        ))
    }

    fn request_timed_out(&self) -> LlmError {
        LlmError::new(
            LlmErrorKind::Timeout,
            format!(
                "the LLM provider at {} did not answer within {:?}",
                self.authority, self.request_timeout
            ),
        )
    }

    fn request_error(&self, err: &reqwest::Error) -> LlmError {
        if err.is_timeout() || root_io_kind(err) == Some(std::io::ErrorKind::TimedOut) {
            return self.request_timed_out();
        }
        let cause = root_cause(err);
        if err.is_connect() {
            LlmError::new(
                LlmErrorKind::Unreachable,
                format!("cannot reach the LLM provider at {}: {cause}", self.authority),
            )
        } else {
            LlmError::new(
                LlmErrorKind::Unreachable,
                format!(
                    "the connection to the LLM provider at {} broke: {cause}",
                    self.authority
                ),
            )
        }
    }
}

/// Passes an event stream on and turns anything else (a proxy's HTML page, a
/// server that ignored `stream: true`) into an explained failure.
async fn check_content_type(response: reqwest::Response, deadline: Instant) -> Result<reqwest::Response, LlmError> {
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .map(|value| value.as_bytes().to_vec());
    match content_type {
        Some(value) if !value.to_ascii_lowercase().starts_with(b"text/event-stream") => {
            let shown = String::from_utf8_lossy(&value).into_owned();
            let detail = tokio::time::timeout_at(deadline, read_limited(response)).await.ok();
            let mut message = format!("the LLM provider answered with {shown} instead of an event stream");
            if let Some(detail) = detail.as_deref().and_then(error_detail) {
                message.push_str(&format!(" (provider said: \"{detail}\")"));
            }
            Err(LlmError::new(LlmErrorKind::BadResponse, message))
        }
        _ => Ok(response),
    }
}

/// Returns the endpoint URL; `path` is appended so that a base URL with or
/// without a trailing slash (or with a path prefix such as `/v1`) both work.
fn endpoint_url(base: &str, path: &str) -> Result<Url, LlmError> {
    let joined = format!("{}/{}", base.trim_end_matches('/'), path.trim_start_matches('/'));
    let invalid = |why: String| {
        LlmError::new(
            LlmErrorKind::InvalidRequest,
            format!("LLM_BASE_URL is not a valid http(s) URL: {why}"),
        )
    };
    let url = Url::parse(&joined).map_err(|err| invalid(err.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(format!("scheme {} is not http or https", url.scheme())));
    }
    if url.host_str().is_none() {
        return Err(invalid("it has no host".to_owned()));
    }
    Ok(url)
}

/// Returns the configured API key without the surrounding whitespace that a
/// key read from a file or a Kubernetes secret often carries.
pub(super) fn api_key(config: &LlmConfig) -> Option<&str> {
    config.api_key.expose().map(str::trim).filter(|key| !key.is_empty())
}

/// Returns a header value holding `key`, marked sensitive so it is never printed.
pub(super) fn secret_header(key: &str) -> Result<HeaderValue, LlmError> {
    let mut value = HeaderValue::from_str(key).map_err(|_| {
        LlmError::new(
            LlmErrorKind::Unauthenticated,
            "the LLM API key contains characters that cannot be sent in an HTTP header; check LLM_API_KEY",
        )
    })?;
    value.set_sensitive(true);
    Ok(value)
}

/// Reads at most [`MAX_ERROR_BODY`] bytes of a body as text; a body that
/// breaks off is explained by what arrived of it.
async fn read_limited(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = MAX_ERROR_BODY.saturating_sub(body.len());
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() >= MAX_ERROR_BODY {
            break;
        }
    }
    String::from_utf8_lossy(&body).into_owned()
}

/// Returns the provider's own explanation from an error body: `error.message`
/// (both APIs), `message`, a bare `error` string, or the text itself.
fn error_detail(body: &str) -> Option<String> {
    let body = body.trim();
    if body.is_empty() {
        return None;
    }
    let detail = match serde_json::from_str::<serde_json::Value>(body) {
        Ok(json) => json
            .pointer("/error/message")
            .or_else(|| json.get("message"))
            .or_else(|| json.get("error"))
            .and_then(serde_json::Value::as_str)
            .map_or_else(|| body.to_owned(), str::to_owned),
        Err(_) => body.to_owned(),
    };
    Some(truncate(
        detail.split_whitespace().collect::<Vec<_>>().join(" "),
        MAX_DETAIL_CHARS,
    ))
}

/// Returns the error for a non-success HTTP status.
fn status_error(status: StatusCode, detail: Option<String>, retry_after: Option<u64>, key_set: bool) -> LlmError {
    let code = status.as_u16();
    let label = format!("HTTP {code}");
    let (kind, mut message) = match code {
        401 if !key_set => (
            LlmErrorKind::Unauthenticated,
            format!("the LLM provider requires an API key ({label}); set LLM_API_KEY"),
        ),
        401 => (
            LlmErrorKind::Unauthenticated,
            format!("the LLM provider refused the API key ({label}); check LLM_API_KEY"),
        ),
        403 => (
            LlmErrorKind::Unauthenticated,
            format!("the LLM provider denied this API key access ({label})"),
        ),
        429 => {
            let retry = match retry_after {
                Some(seconds) => format!("retry in {seconds}s"),
                None => "retry later".to_owned(),
            };
            (
                LlmErrorKind::RateLimited,
                format!("the LLM provider is rate limiting requests ({label}); {retry}"),
            )
        }
        408 => (
            LlmErrorKind::Timeout,
            format!("the LLM provider timed out waiting for the request ({label})"),
        ),
        404 => (
            LlmErrorKind::InvalidRequest,
            format!(
                "the LLM provider does not know this model or endpoint ({label}); check LLM_MODEL and LLM_BASE_URL"
            ),
        ),
        413 => (
            LlmErrorKind::InvalidRequest,
            format!("the request is too large for the LLM provider ({label})"),
        ),
        529 => (
            LlmErrorKind::Unavailable,
            format!("the LLM provider is overloaded ({label}); retry later"),
        ),
        400..=499 => (
            LlmErrorKind::InvalidRequest,
            format!("the LLM provider rejected the request ({label})"),
        ),
        500..=599 => (
            LlmErrorKind::Unavailable,
            format!("the LLM provider is unavailable ({label}); retry later"),
        ),
        _ => (
            LlmErrorKind::BadResponse,
            format!("the LLM provider answered with an unexpected status ({label})"),
        ),
    };
    if let Some(detail) = detail {
        message.push_str(&format!(" (provider said: \"{detail}\")"));
    }
    LlmError::new(kind, message)
}

/// Returns the error for an `error` event sent mid-reply, classified by the
/// provider's error type (Anthropic's `overloaded_error`, OpenAI's `server_error`, …).
pub(super) fn provider_error(error_type: Option<&str>, detail: Option<&str>) -> LlmError {
    let label = error_type.unwrap_or("error");
    let (kind, mut message) = match label {
        "authentication_error" | "permission_error" | "invalid_api_key" => (
            LlmErrorKind::Unauthenticated,
            format!("the LLM provider refused the API key ({label}); check LLM_API_KEY"),
        ),
        "rate_limit_error" | "rate_limit_exceeded" | "insufficient_quota" | "requests" | "tokens" => (
            LlmErrorKind::RateLimited,
            format!("the LLM provider is rate limiting requests ({label}); retry later"),
        ),
        "invalid_request_error" | "not_found_error" | "request_too_large" => (
            LlmErrorKind::InvalidRequest,
            format!("the LLM provider rejected the request ({label})"),
        ),
        "overloaded_error" => (
            LlmErrorKind::Unavailable,
            format!("the LLM provider is overloaded ({label}); retry later"),
        ),
        // api_error, server_error and anything new: the provider failed, so a retry may work.
        _ => (
            LlmErrorKind::Unavailable,
            format!("the LLM provider failed mid-reply ({label}); retry later"),
        ),
    };
    if let Some(detail) = detail.map(str::trim).filter(|detail| !detail.is_empty()) {
        message.push_str(&format!(
            " (provider said: \"{}\")",
            truncate(detail.to_owned(), MAX_DETAIL_CHARS)
        ));
    }
    LlmError::new(kind, message)
}

/// Returns the error for an SSE event whose data is not what the API documents.
pub(super) fn bad_event(what: &str, err: &serde_json::Error) -> LlmError {
    LlmError::new(
        LlmErrorKind::BadResponse,
        format!("the LLM provider sent a malformed {what} event: {err}"),
    )
}

/// Returns the error for a body that ended before the reply was complete.
pub(super) fn ended_early() -> LlmError {
    LlmError::new(
        LlmErrorKind::BadResponse,
        "the provider's stream ended early, before the reply was complete",
    )
}

fn body_error(err: reqwest::Error) -> LlmError {
    if err.is_timeout() {
        return LlmError::new(LlmErrorKind::Timeout, "the LLM provider stopped sending mid-reply");
    }
    // No content decoding is enabled, so every other body error (reqwest
    // reports a cut chunked body as a decode error) is a broken connection.
    LlmError::new(
        LlmErrorKind::Unreachable,
        format!(
            "the connection to the LLM provider broke mid-reply: {}",
            root_cause(&err)
        ),
    )
}

fn sse_error(err: EventStreamError<LlmError>) -> LlmError {
    match err {
        EventStreamError::Transport(err) => err,
        EventStreamError::Utf8(_) => LlmError::new(
            LlmErrorKind::BadResponse,
            "the LLM provider's event stream is not valid UTF-8",
        ),
        EventStreamError::Parser(_) => LlmError::new(
            LlmErrorKind::BadResponse,
            "the LLM provider's event stream cannot be parsed",
        ),
    }
}

/// Returns the innermost cause of an error, which is the one that explains it
/// ("connection refused", "failed to lookup address information: …").
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    match root_io_kind(err) {
        Some(std::io::ErrorKind::ConnectionRefused) => return "connection refused".to_owned(),
        Some(std::io::ErrorKind::ConnectionReset) => return "connection reset".to_owned(),
        Some(std::io::ErrorKind::UnexpectedEof) => {
            return "the connection closed before the reply was complete".to_owned();
        }
        _ => {}
    }
    let mut cause = err;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

fn root_io_kind(err: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut cause = Some(err);
    while let Some(err) = cause {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cause = err.source();
    }
    None
}

/// Returns the error with the API key replaced, so no message can leak it.
fn scrub(mut err: LlmError, api_key: Option<&str>) -> LlmError {
    if let Some(key) = api_key.filter(|key| !key.is_empty())
        && err.message.contains(key)
    {
        err.message = err.message.replace(key, REDACTED);
    }
    err
}

fn truncate(mut text: String, max_chars: usize) -> String {
    if let Some((cut, _)) = text.char_indices().nth(max_chars) {
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// Ends a byte stream with a [`LlmErrorKind::Timeout`] when no chunk arrives
/// within `idle` of the previous one. One timer is re-armed per chunk rather
/// than a new one created, since this runs for every token of every reply.
struct IdleTimeout {
    inner: BoxStream<'static, Result<Bytes, LlmError>>,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    expired: bool,
}

impl IdleTimeout {
    fn new(inner: BoxStream<'static, Result<Bytes, LlmError>>, idle: Duration) -> Self {
        Self {
            inner,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            expired: false,
        }
    }
}

impl Stream for IdleTimeout {
    type Item = Result<Bytes, LlmError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.expired {
            return Poll::Ready(None);
        }
        if let Poll::Ready(item) = this.inner.poll_next_unpin(cx) {
            let next = Instant::now() + this.idle;
            this.deadline.as_mut().reset(next);
            return Poll::Ready(item);
        }
        ready!(this.deadline.as_mut().poll(cx));
        this.expired = true;
        Poll::Ready(Some(Err(LlmError::new(
            LlmErrorKind::Timeout,
            format!("the LLM provider sent nothing for {:?} mid-reply", this.idle),
        ))))
    }
}

/// The provider's SSE events run through a decoder. The stream ends after the
/// reply is complete or after the first error.
struct DecodedStream<D> {
    provider: &'static str,
    events: Option<BoxStream<'static, Result<Event, LlmError>>>,
    decoder: D,
    pending: VecDeque<LlmEvent>,
    api_key: Option<Arc<str>>,
}

impl<D: SseDecoder> DecodedStream<D> {
    fn fail(&mut self, err: LlmError) -> Poll<Option<Result<LlmEvent, LlmError>>> {
        self.events = None;
        self.pending.clear();
        let err = scrub(err, self.api_key.as_deref());
        tracing::warn!(
            provider = self.provider,
            reason = err.kind.reason(),
            "llm stream failed"
        );
        Poll::Ready(Some(Err(err)))
    }
}

impl<D: SseDecoder> Stream for DecodedStream<D> {
    type Item = Result<LlmEvent, LlmError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(event) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            let Some(events) = this.events.as_mut() else {
                return Poll::Ready(None);
            };
            match ready!(events.poll_next_unpin(cx)) {
                Some(Ok(event)) => match this.decoder.decode(&event, &mut this.pending) {
                    Ok(Progress::More) => {}
                    // Letting go of the body now lets hyper drain its tail
                    // and pool an HTTP/1 connection without making the
                    // caller wait for the end of the body.
                    Ok(Progress::Complete) => this.events = None,
                    Err(err) => return this.fail(err),
                },
                Some(Err(err)) => return this.fail(err),
                None => {
                    this.events = None;
                    if let Err(err) = this.decoder.finish(&mut this.pending) {
                        return this.fail(err);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_base_urls_with_or_without_slash() {
        for base in [
            "http://127.0.0.1:9/v1",
            "http://127.0.0.1:9/v1/",
            "http://127.0.0.1:9/v1//",
        ] {
            let url = endpoint_url(base, "chat/completions").unwrap();
            assert_eq!(url.as_str(), "http://127.0.0.1:9/v1/chat/completions");
        }
        assert_eq!(
            endpoint_url("https://api.anthropic.com", "v1/messages")
                .unwrap()
                .as_str(),
            "https://api.anthropic.com/v1/messages"
        );
        assert_eq!(
            endpoint_url("ftp://x", "v1").unwrap_err().kind,
            LlmErrorKind::InvalidRequest
        );
        assert_eq!(
            endpoint_url("not a url", "v1").unwrap_err().kind,
            LlmErrorKind::InvalidRequest
        );
    }

    #[test]
    fn maps_statuses_to_kinds() {
        let kind = |code: u16| status_error(StatusCode::from_u16(code).unwrap(), None, None, true).kind;
        assert_eq!(kind(401), LlmErrorKind::Unauthenticated);
        assert_eq!(kind(403), LlmErrorKind::Unauthenticated);
        assert_eq!(kind(429), LlmErrorKind::RateLimited);
        for code in [400, 404, 413, 422] {
            assert_eq!(kind(code), LlmErrorKind::InvalidRequest, "{code}");
        }
        for code in [500, 502, 503, 529] {
            assert_eq!(kind(code), LlmErrorKind::Unavailable, "{code}");
        }
        assert_eq!(kind(302), LlmErrorKind::BadResponse);
    }

    #[test]
    fn explains_rate_limits_with_retry_after() {
        let err = status_error(
            StatusCode::TOO_MANY_REQUESTS,
            Some("slow down".to_owned()),
            Some(7),
            true,
        );
        assert_eq!(
            err.message,
            "the LLM provider is rate limiting requests (HTTP 429); retry in 7s (provider said: \"slow down\")"
        );
    }

    #[test]
    fn extracts_and_truncates_provider_detail() {
        assert_eq!(
            error_detail(r#"{"error":{"message":"bad  key"}}"#).as_deref(),
            Some("bad key")
        );
        assert_eq!(error_detail(r#"{"message":"nope"}"#).as_deref(), Some("nope"));
        assert_eq!(error_detail("<html>oops</html>").as_deref(), Some("<html>oops</html>"));
        assert_eq!(error_detail("  ").as_deref(), None);
        let long = error_detail(&"é".repeat(1000)).unwrap();
        assert_eq!(long.chars().count(), MAX_DETAIL_CHARS + 1);
    }

    #[test]
    fn scrubs_the_key() {
        let err = LlmError::new(LlmErrorKind::Unauthenticated, "bad key sk-secret-1 and sk-secret-1");
        let scrubbed = scrub(err, Some("sk-secret-1"));
        assert_eq!(scrubbed.message, "bad key <redacted> and <redacted>");
    }

    #[test]
    fn classifies_provider_error_types() {
        assert_eq!(
            provider_error(Some("overloaded_error"), None).kind,
            LlmErrorKind::Unavailable
        );
        assert_eq!(
            provider_error(Some("rate_limit_error"), None).kind,
            LlmErrorKind::RateLimited
        );
        assert_eq!(
            provider_error(Some("authentication_error"), None).kind,
            LlmErrorKind::Unauthenticated
        );
        assert_eq!(
            provider_error(Some("invalid_request_error"), None).kind,
            LlmErrorKind::InvalidRequest
        );
        assert_eq!(provider_error(None, Some("boom")).kind, LlmErrorKind::Unavailable);
    }
}
