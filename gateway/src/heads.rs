//! Every request head of an HTTP/1.1 connection, checked before hyper parses
//! it, so that a malformed request line, an over-long URI, too many or too
//! large headers or a bad header get the API's error document with a typed
//! reason (issue 26 item 16) rather than hyper's empty 400/414/431, which it
//! writes itself with no hook to change them.
//!
//! [`Checked`] sits between the socket and hyper. It hands hyper only bytes it
//! has approved: a complete head that `httparse` accepts within the limits,
//! then the body the head announces (`Content-Length` or chunked), then the
//! next head, so every request of a keep-alive connection is checked, not only
//! the first. A head it refuses never reaches hyper: hyper gets, after the
//! requests before it, a stand-in request (`GET /`, `Connection: close`), and
//! [`Verdicts`] tells the connection's service that this request is the
//! refused one, so hyper answers it in turn (after any pipelined answers) with
//! the error document and closes the connection. After a request asking to
//! upgrade (the WebSocket handshake), bytes go through unchecked: they belong
//! to the upgraded protocol.
//!
//! Nothing is buffered while a connection is idle: a head is held here only
//! while it is incomplete, and the buffer is freed once handed on.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use avm_common::ApiError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Longest request target, in bytes (a path and query; ids and paths within
/// it are bounded far lower by [`crate::bounds`]).
pub const MAX_URI_BYTES: usize = 32 * 1024;

/// Most header fields in one head (hyper's own default).
pub const MAX_HEADERS: usize = 100;

/// The most bytes read and thrown away after a refusal, while the client may
/// still be sending the rest of what was refused: closing with unread bytes
/// makes the kernel reset the connection, which can drop the answer before
/// the client reads it.
const LINGER_BYTES: usize = 1024 * 1024;

/// How long a refused connection waits for the client to stop sending.
const LINGER_TIME: Duration = Duration::from_secs(2);

/// What hyper gets in place of a refused head: answered by the service from
/// [`Verdicts`], never by the router.
const STAND_IN: &[u8] = b"GET / HTTP/1.1\r\nconnection: close\r\n\r\n";

/// Why a request head was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request line is not `METHOD target HTTP/1.x`.
    RequestLine,
    /// The request target is longer than [`MAX_URI_BYTES`].
    UriTooLong,
    /// More than [`MAX_HEADERS`] fields, or the head is larger than allowed.
    HeadersTooLarge,
    /// A header's name or value holds a byte HTTP forbids (NUL, a control).
    Header,
    /// The body's framing is unreadable: a bad `Content-Length`, or a
    /// `Transfer-Encoding` that does not end in `chunked`.
    Framing,
}

impl Refusal {
    const ALL: [Self; 5] = [
        Self::RequestLine,
        Self::UriTooLong,
        Self::HeadersTooLarge,
        Self::Header,
        Self::Framing,
    ];

    fn status(self) -> StatusCode {
        match self {
            Self::UriTooLong => StatusCode::URI_TOO_LONG,
            Self::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::RequestLine | Self::Header | Self::Framing => StatusCode::BAD_REQUEST,
        }
    }

    fn error(self, max_head_bytes: usize) -> ApiError {
        match self {
            Self::RequestLine => ApiError::invalid("MALFORMED_REQUEST_LINE", "the request line is malformed"),
            Self::UriTooLong => ApiError::invalid(
                "URI_TOO_LONG",
                format!("the request target is longer than {MAX_URI_BYTES} bytes"),
            ),
            Self::HeadersTooLarge => ApiError::invalid(
                "HEADERS_TOO_LARGE",
                format!("the request has more than {MAX_HEADERS} headers or is larger than {max_head_bytes} bytes"),
            ),
            Self::Header => ApiError::invalid("MALFORMED_HEADER", "a header's name or value holds a forbidden byte"),
            Self::Framing => ApiError::invalid(
                "MALFORMED_REQUEST",
                "the request's Content-Length or Transfer-Encoding is invalid",
            ),
        }
    }

    /// Renders the refusal: the error document with its status, closing the connection.
    pub fn response(self, max_head_bytes: usize) -> Response {
        let request_id = avm_common::ids::new_id("req");
        let mut response = crate::http::error_response(&self.error(max_head_bytes), &request_id);
        *response.status_mut() = self.status();
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    }

    fn code(self) -> u64 {
        self as u64 + 1
    }
}

/// What the reading side tells the connection's service: which request, by
/// its place on the connection, stands in for a refused head.
#[derive(Debug, Default)]
pub struct Verdicts {
    /// Requests the service was called with.
    served: AtomicU64,
    /// The refused request's place (from 1) times 8, plus its refusal's
    /// code; 0 while none was refused.
    refused: AtomicU64,
}

impl Verdicts {
    /// Counts a request the service is called with and returns its refusal
    /// when it is the stand-in for a refused head. Requests reach the service
    /// in the order their heads were read, one at a time.
    pub fn on_request(&self) -> Option<Refusal> {
        let place = self.served.fetch_add(1, Ordering::Relaxed) + 1;
        let refused = self.refused.load(Ordering::Relaxed);
        if refused == 0 || refused >> 3 != place {
            return None;
        }
        Refusal::ALL.into_iter().find(|refusal| refusal.code() == refused & 7)
    }

    fn refuse(&self, place: u64, refusal: Refusal) {
        self.refused.store(place << 3 | refusal.code(), Ordering::Relaxed);
    }
}

/// Where the reading side is in the connection's byte stream.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// At the start of a request head.
    Head,
    /// In a body of this many more bytes.
    Fixed(u64),
    /// In a chunked body, at a chunk's size line.
    ChunkSize,
    /// In a chunk of this many more bytes.
    ChunkData(u64),
    /// At the line end after a chunk's data.
    ChunkEnd,
    /// In the trailers after the last chunk.
    Trailers,
    /// Past an upgrade request: the rest is another protocol's.
    Through,
    /// A head was refused: hyper gets the stand-in from this offset on.
    StandIn(usize),
    /// The stand-in was handed on: nothing more is read for hyper.
    Closed,
}

/// The socket, handing hyper approved bytes only (see the module's doc).
#[derive(Debug)]
pub struct Checked<IO> {
    io: IO,
    verdicts: std::sync::Arc<Verdicts>,
    max_head_bytes: usize,
    framing: Framing,
    /// Heads approved so far.
    heads: u64,
    /// Bytes read and not yet handed on: the first `approved` are checked.
    held: Vec<u8>,
    approved: usize,
    /// After a refusal, while the client's remaining bytes are read and dropped.
    linger: Option<Linger>,
}

#[derive(Debug)]
struct Linger {
    dropped: usize,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<IO> Checked<IO> {
    pub fn new(io: IO, verdicts: std::sync::Arc<Verdicts>, max_head_bytes: usize) -> Self {
        Self {
            io,
            verdicts,
            max_head_bytes,
            framing: Framing::Head,
            heads: 0,
            held: Vec::new(),
            approved: 0,
            linger: None,
        }
    }

    /// Checks `data`, which follows everything checked before, and returns how
    /// many of its bytes are approved; on a refusal, what precedes the refused
    /// head is approved and the stand-in follows.
    fn check(&mut self, data: &[u8]) -> usize {
        let mut at = 0;
        loop {
            let rest = &data[at..];
            let step = match self.framing {
                Framing::Head => self.head(rest),
                Framing::Fixed(left) => Step::skip(rest, left, Framing::Fixed, Framing::Head),
                Framing::ChunkData(left) => Step::skip(rest, left, Framing::ChunkData, Framing::ChunkEnd),
                Framing::ChunkSize => match httparse::parse_chunk_size(rest) {
                    Ok(httparse::Status::Complete((used, 0))) => Step::Next(used, Framing::Trailers),
                    Ok(httparse::Status::Complete((used, size))) => Step::Next(used, Framing::ChunkData(size)),
                    Ok(httparse::Status::Partial) => Step::More,
                    Err(_) => Step::Refuse(Refusal::Framing),
                },
                Framing::ChunkEnd => match rest {
                    [b'\r', b'\n', ..] => Step::Next(2, Framing::ChunkSize),
                    [] | [b'\r'] => Step::More,
                    _ => Step::Refuse(Refusal::Framing),
                },
                Framing::Trailers => {
                    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    match httparse::parse_headers(rest, &mut fields) {
                        Ok(httparse::Status::Complete((used, _))) => Step::Next(used, Framing::Head),
                        Ok(httparse::Status::Partial) if rest.len() <= self.max_head_bytes => Step::More,
                        Ok(httparse::Status::Partial) | Err(_) => Step::Refuse(Refusal::Framing),
                    }
                }
                Framing::Through => Step::Next(rest.len(), Framing::Through),
                Framing::StandIn(_) | Framing::Closed => Step::More,
            };
            match step {
                Step::Next(used, framing) => {
                    at += used;
                    self.framing = framing;
                    if at == data.len() {
                        return at;
                    }
                }
                Step::More => return at,
                Step::Refuse(refusal) => {
                    // The stand-in is the request after the `heads` approved.
                    self.verdicts.refuse(self.heads + 1, refusal);
                    self.framing = Framing::StandIn(0);
                    return at;
                }
            }
        }
    }

    /// Checks the head at the start of `data`.
    fn head(&mut self, data: &[u8]) -> Step {
        if data.is_empty() {
            return Step::More;
        }
        let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut fields);
        let used = match request.parse(data) {
            Ok(httparse::Status::Complete(used)) => used,
            Ok(httparse::Status::Partial) => {
                let line_ended = request.version.is_some();
                return if !line_ended && data.len() > MAX_URI_BYTES + 32 {
                    Step::Refuse(Refusal::UriTooLong)
                } else if data.len() > self.max_head_bytes {
                    Step::Refuse(Refusal::HeadersTooLarge)
                } else {
                    Step::More
                };
            }
            Err(httparse::Error::TooManyHeaders) => return Step::Refuse(Refusal::HeadersTooLarge),
            Err(_) if request_line_is_valid(data) => return Step::Refuse(Refusal::Header),
            Err(_) => return Step::Refuse(Refusal::RequestLine),
        };
        let target = request.path.unwrap_or_default();
        if target.len() > MAX_URI_BYTES {
            return Step::Refuse(Refusal::UriTooLong);
        }
        if used > self.max_head_bytes {
            return Step::Refuse(Refusal::HeadersTooLarge);
        }
        // hyper refuses a target `http` cannot parse with its own empty 400.
        if axum::http::Uri::try_from(target).is_err() {
            return Step::Refuse(Refusal::RequestLine);
        }
        let framing = match body_framing(request.headers) {
            Ok(framing) => framing,
            Err(refusal) => return Step::Refuse(refusal),
        };
        let upgrade = request.method == Some("CONNECT")
            || request
                .headers
                .iter()
                .any(|field| field.name.eq_ignore_ascii_case("upgrade"));
        self.heads += 1;
        Step::Next(used, if upgrade { Framing::Through } else { framing })
    }
}

/// Returns whether the head in `data` starts with a valid request line, so
/// that its error is in a header. Only called on a refused head.
fn request_line_is_valid(data: &[u8]) -> bool {
    let Some(end) = data.iter().position(|&b| b == b'\n') else {
        return false;
    };
    let line = [&data[..=end], b"\r\n"].concat();
    matches!(
        httparse::Request::new(&mut []).parse(&line),
        Ok(httparse::Status::Complete(_))
    )
}

/// One step of checking.
enum Step {
    /// This many bytes are approved; then the stream is here.
    Next(usize, Framing),
    /// What is left needs more bytes to be judged.
    More,
    Refuse(Refusal),
}

impl Step {
    /// Approves up to `left` bytes of a body: `within` while some remain, `then` after.
    fn skip(rest: &[u8], left: u64, within: fn(u64) -> Framing, then: Framing) -> Self {
        let used = usize::try_from(left).map_or(rest.len(), |left| left.min(rest.len()));
        if used == 0 && left > 0 {
            return Self::More;
        }
        let left = left - used as u64;
        Self::Next(used, if left == 0 { then } else { within(left) })
    }
}

/// Returns where a request's body ends, as its head frames it (RFC 9112 §6).
fn body_framing(fields: &[httparse::Header<'_>]) -> Result<Framing, Refusal> {
    let mut length: Option<u64> = None;
    let mut chunked = None;
    for field in fields {
        if field.name.eq_ignore_ascii_case("content-length") {
            let value = std::str::from_utf8(field.value).map_err(|_| Refusal::Framing)?;
            for item in value.split(',').map(str::trim) {
                if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(Refusal::Framing);
                }
                let item: u64 = item.parse().map_err(|_| Refusal::Framing)?;
                if length.is_some_and(|length| length != item) {
                    return Err(Refusal::Framing);
                }
                length = Some(item);
            }
        } else if field.name.eq_ignore_ascii_case("transfer-encoding") {
            let last = field.value.rsplit(|&b| b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        }
    }
    match (chunked, length) {
        (Some(true), _) => Ok(Framing::ChunkSize),
        (Some(false), _) => Err(Refusal::Framing),
        (None, Some(length)) if length > 0 => Ok(Framing::Fixed(length)),
        (None, _) => Ok(Framing::Head),
    }
}

/// The most read at once: half of hyper's initial read buffer of 8 KiB.
/// hyper doubles the buffer after a read that fills it, and an idle
/// connection keeps it; reading a body in halves touches only the first
/// page or two of it, so less of it is resident while the connection idles.
const READ_CHUNK: usize = 4 * 1024;

impl<IO: AsyncRead + Unpin> AsyncRead for Checked<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.approved > 0 {
                let n = this.approved.min(buf.remaining());
                buf.put_slice(&this.held[..n]);
                this.held.drain(..n);
                this.approved -= n;
                if this.held.is_empty() {
                    // Idle connections keep no buffer.
                    this.held = Vec::new();
                }
                return Poll::Ready(Ok(()));
            }
            match this.framing {
                Framing::StandIn(sent) => {
                    let n = (STAND_IN.len() - sent).min(buf.remaining());
                    buf.put_slice(&STAND_IN[sent..sent + n]);
                    this.framing = if sent + n == STAND_IN.len() {
                        Framing::Closed
                    } else {
                        Framing::StandIn(sent + n)
                    };
                    return Poll::Ready(Ok(()));
                }
                // hyper answers the stand-in and closes the connection; it
                // must not see the end of the stream first, which it takes
                // for a client gone mid-request (dropping the answer). What
                // the client still sends is dropped at shutdown.
                Framing::Closed => return Poll::Pending,
                _ => {}
            }
            // Each read is at most READ_CHUNK, under hyper's initial read
            // buffer (8 KiB). The bytes go through a buffer on the stack so
            // that hyper's is touched only as far as filled.
            let mut chunk = [0u8; READ_CHUNK];
            let room = if this.held.is_empty() {
                buf.remaining().min(READ_CHUNK)
            } else {
                READ_CHUNK
            };
            let mut read = ReadBuf::new(&mut chunk[..room]);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut read))?;
            let read = read.filled();
            if read.is_empty() {
                // The end of the stream (a head left incomplete is dropped).
                this.held = Vec::new();
                return Poll::Ready(Ok(()));
            }
            if this.held.is_empty() {
                // The usual case: what is approved goes to hyper at once,
                // only what cannot be judged yet is kept.
                let approved = this.check(read);
                buf.put_slice(&read[..approved]);
                this.held.extend_from_slice(&read[approved..]);
                this.drop_held_after_refusal();
                if approved > 0 {
                    return Poll::Ready(Ok(()));
                }
            } else {
                this.held.extend_from_slice(read);
                let held = std::mem::take(&mut this.held);
                this.approved = this.check(&held);
                this.held = held;
                this.drop_held_after_refusal();
            }
        }
    }
}

impl<IO> Checked<IO> {
    /// After a refusal, nothing past the approved bytes is handed on.
    fn drop_held_after_refusal(&mut self) {
        if matches!(self.framing, Framing::StandIn(_)) {
            self.held.truncate(self.approved);
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Checked<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Ends the connection; after a refusal, first reads and drops what the
    /// client is still sending (up to [`LINGER_BYTES`] or [`LINGER_TIME`]),
    /// so that the answer is not lost to a reset.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
        if !matches!(this.framing, Framing::Closed) {
            return Poll::Ready(Ok(()));
        }
        let linger = this.linger.get_or_insert_with(|| Linger {
            dropped: 0,
            deadline: Box::pin(tokio::time::sleep(LINGER_TIME)),
        });
        let mut chunk = [0u8; READ_CHUNK];
        while linger.dropped < LINGER_BYTES && linger.deadline.as_mut().poll(cx).is_pending() {
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.io).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) if !read.filled().is_empty() => linger.dropped += read.filled().len(),
                Poll::Ready(_) => break,
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checked() -> Checked<()> {
        Checked::new((), std::sync::Arc::default(), 64 * 1024)
    }

    /// Checks `input` fed in pieces of `step` bytes, as reads would deliver
    /// it; returns the approved bytes and the refusal, if any.
    fn run(input: &[u8], step: usize) -> (Vec<u8>, Option<Refusal>) {
        let mut checked = checked();
        let mut approved = Vec::new();
        let mut held = Vec::new();
        for piece in input.chunks(step) {
            held.extend_from_slice(piece);
            let n = checked.check(&held);
            approved.extend(held.drain(..n));
            if matches!(checked.framing, Framing::StandIn(_)) {
                break;
            }
        }
        (approved, checked.verdicts.refusal_for_test())
    }

    impl Verdicts {
        fn refusal_for_test(&self) -> Option<Refusal> {
            let refused = self.refused.load(Ordering::Relaxed);
            Refusal::ALL.into_iter().find(|refusal| refusal.code() == refused & 7)
        }
    }

    #[test]
    fn good_requests_pass_whole_in_any_pieces() {
        let input = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n\
            POST /b HTTP/1.1\r\ncontent-length: 5\r\n\r\nhello\
            POST /c HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nt: 1\r\n\r\n\
            GET /d HTTP/1.1\r\n\r\n";
        for step in [1, 2, 7, input.len()] {
            assert_eq!(run(input, step), (input.to_vec(), None), "pieces of {step}");
        }
    }

    #[test]
    fn bad_heads_are_refused_after_the_good_ones() {
        let good = b"GET /a HTTP/1.1\r\n\r\n".to_vec();
        let long_uri = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(40_000));
        let many = format!("GET / HTTP/1.1\r\n{}\r\n", "x: y\r\n".repeat(200));
        let large = format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "y".repeat(100_000));
        let cases: [(&[u8], Refusal); 9] = [
            (b"GARBAGE\r\n\r\n", Refusal::RequestLine),
            (b"GET / HTTP/9.9\r\n\r\n", Refusal::RequestLine),
            (b"GET / HTTP/1.1 extra\r\n\r\n", Refusal::RequestLine),
            (long_uri.as_bytes(), Refusal::UriTooLong),
            (many.as_bytes(), Refusal::HeadersTooLarge),
            (large.as_bytes(), Refusal::HeadersTooLarge),
            (b"GET / HTTP/1.1\r\nx: a\0b\r\n\r\n", Refusal::Header),
            (b"GET / HTTP/1.1\r\nx(y): z\r\n\r\n", Refusal::Header),
            (b"POST / HTTP/1.1\r\ncontent-length: 1, 2\r\n\r\n", Refusal::Framing),
        ];
        for (bad, refusal) in cases {
            let input = [good.as_slice(), bad].concat();
            assert_eq!(run(&input, 4096), (good.clone(), Some(refusal)));
        }
    }

    #[test]
    fn the_stand_in_is_the_request_after_the_approved_ones() {
        let mut checked = checked();
        checked.check(b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\nBAD\r\n\r\n");
        let verdicts = &checked.verdicts;
        assert_eq!(verdicts.on_request(), None);
        assert_eq!(verdicts.on_request(), None);
        assert_eq!(verdicts.on_request(), Some(Refusal::RequestLine));
    }

    #[test]
    fn an_upgrade_passes_the_rest_unchecked() {
        let input = b"GET /ws HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n\x81\x00\0\0garbage";
        assert_eq!(run(input, 3), (input.to_vec(), None));
    }
}
