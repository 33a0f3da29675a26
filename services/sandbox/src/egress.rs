//! A fenced command's only way out to the network: an HTTP proxy.
//!
//! Behind the fence (`isolation.rs`) a command with `network: true` runs in
//! a network namespace of its own, so the server's loopback services (the
//! gateway, the gRPC ports, Redis, Postgres) and the host's networks are not
//! there to reach. Inside, a relay (`avm sandbox-relay`, see [`relay`])
//! listens on the namespace's loopback at [`PROXY_PORT`] and hands each
//! connection to this proxy through a Unix socket bound into the command's
//! root; `HTTP_PROXY` and `HTTPS_PROXY` name it, so curl, pip and npm use
//! it. The proxy takes `CONNECT host:port` (HTTPS) and plain `http://`
//! requests, and applies `fetch_url`'s address guard and the operator's
//! allow-list (`[runtime.fetch] allow`) to where they go: a name is resolved
//! here, every address checked, and the connection made to the checked
//! addresses. A refusal is a `403` whose text says why.
//!
//! One proxy per command, gone with it: its listener and every connection it
//! relays end when the command's [`Egress`] is dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use avm_common::address::AddressGuard;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::task::JoinSet;

/// The port the relay listens on inside the command's network namespace.
pub const PROXY_PORT: u16 = 3128;

/// Where the proxy's socket is in the command's root.
pub(super) const SOCKET_INSIDE: &str = "/run/avm/egress.sock";

/// The most a request head may hold.
const MAX_HEAD_BYTES: usize = 16 * 1024;

/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// How long connecting to the destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections one command may have open through the proxy at once.
const MAX_CONNECTIONS: usize = 64;

/// One command's proxy: a Unix socket in a private directory, served until
/// dropped.
#[derive(Debug)]
pub struct Egress {
    dir: tempfile::TempDir,
    serving: tokio::task::JoinHandle<()>,
}

impl Egress {
    /// Opens a proxy that lets through what `guard` lets through.
    pub fn open(guard: Arc<AddressGuard>) -> std::io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("avm-egress-").tempdir()?;
        let listener = UnixListener::bind(dir.path().join("egress.sock"))?;
        let serving = tokio::spawn(serve(listener, guard));
        Ok(Self { dir, serving })
    }

    /// Returns the proxy's socket on the host.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("egress.sock")
    }

    /// Returns the proxy's URL as the command sees it.
    pub fn url() -> String {
        format!("http://127.0.0.1:{PROXY_PORT}")
    }
}

impl Drop for Egress {
    fn drop(&mut self) {
        // The connections are the task's: they end with it.
        self.serving.abort();
    }
}

async fn serve(listener: UnixListener, guard: Arc<AddressGuard>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            return;
        };
        while connections.try_join_next().is_some() {}
        if connections.len() >= MAX_CONNECTIONS {
            let mut client = client;
            let _ = answer(&mut client, 429, "too many connections through the proxy at once").await;
            continue;
        }
        connections.spawn(proxy(client, Arc::clone(&guard)));
    }
}

/// A request head as the proxy needs it.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    /// `CONNECT`, or a plain request to forward.
    tunnel: bool,
    host: String,
    port: u16,
    /// What to send the destination before relaying (empty for a tunnel).
    forward: Vec<u8>,
}

async fn proxy(mut client: UnixStream, guard: Arc<AddressGuard>) {
    let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut client)).await {
        Ok(Ok(read)) => read,
        Ok(Err(refusal)) => {
            let _ = answer(&mut client, 400, &refusal).await;
            return;
        }
        Err(_) => return,
    };
    let head = match parse(&head) {
        Ok(head) => head,
        Err(refusal) => {
            let _ = answer(&mut client, 400, &refusal).await;
            return;
        }
    };
    let mut upstream = match connect(&guard, &head.host, head.port).await {
        Ok(upstream) => upstream,
        Err((status, refusal)) => {
            tracing::debug!(host = %head.host, port = head.port, %refusal, "a command's connection was refused");
            let _ = answer(&mut client, status, &refusal).await;
            return;
        }
    };
    if head.tunnel {
        if client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
    } else if upstream.write_all(&head.forward).await.is_err() {
        return;
    }
    if !rest.is_empty() && upstream.write_all(&rest).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

/// Reads up to the end of the head; returns it and what followed it.
async fn read_head(client: &mut (impl AsyncRead + Unpin)) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut buffer = Vec::with_capacity(1024);
    let mut chunk = [0_u8; 1024];
    loop {
        let read = client
            .read(&mut chunk)
            .await
            .map_err(|err| format!("cannot read the request: {err}"))?;
        if read == 0 {
            return Err("the request ended before its head did".to_owned());
        }
        let from = buffer.len().saturating_sub(3);
        buffer.extend_from_slice(&chunk[..read]);
        if let Some(at) = buffer[from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let end = from + at + 4;
            let rest = buffer.split_off(end);
            return Ok((buffer, rest));
        }
        if buffer.len() > MAX_HEAD_BYTES {
            return Err(format!("the request head is over {MAX_HEAD_BYTES} bytes"));
        }
    }
}

/// Reads a proxy request head: `CONNECT host:port`, or a request with an
/// absolute `http://` target, rewritten for the destination (origin-form
/// target, no hop-by-hop fields, `Connection: close`, so a kept-alive client
/// connection never carries a request to another host).
fn parse(head: &[u8]) -> Result<Head, String> {
    let text = std::str::from_utf8(head).map_err(|_| "the request head is not UTF-8".to_owned())?;
    let mut lines = text.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let mut words = line.split(' ');
    let (Some(method), Some(target), Some(version), None) = (words.next(), words.next(), words.next(), words.next())
    else {
        return Err("a malformed request line".to_owned());
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err("a malformed request line".to_owned());
    }
    if method == "CONNECT" {
        let (host, port) = host_port(target, None)?;
        return Ok(Head {
            tunnel: true,
            host,
            port,
            forward: Vec::new(),
        });
    }
    let Some(after) = target.strip_prefix("http://") else {
        return Err(format!(
            "the proxy takes CONNECT or an absolute http:// URL, not {:?}",
            short(target)
        ));
    };
    let (authority, path) = match after.find(['/', '?']) {
        Some(at) => after.split_at(at),
        None => (after, "/"),
    };
    let path = if path.starts_with('?') {
        format!("/{path}")
    } else {
        path.to_owned()
    };
    if authority.contains('@') {
        return Err("credentials in a proxied URL are refused".to_owned());
    }
    let (host, port) = host_port(authority, Some(80))?;
    let mut forward = format!("{method} {path} {version}\r\n");
    for field in lines.filter(|field| !field.is_empty()) {
        let name = field.split(':').next().unwrap_or_default().trim();
        let hop = ["connection", "proxy-connection", "keep-alive", "proxy-authorization"]
            .iter()
            .any(|hop| name.eq_ignore_ascii_case(hop));
        if !hop {
            forward.push_str(field);
            forward.push_str("\r\n");
        }
    }
    forward.push_str("Connection: close\r\n\r\n");
    Ok(Head {
        tunnel: false,
        host,
        port,
        forward: forward.into_bytes(),
    })
}

/// Splits `host:port` (`[v6]:port`); `default` when the port is left out.
fn host_port(authority: &str, default: Option<u16>) -> Result<(String, u16), String> {
    let bad = || format!("{:?} is not host:port", short(authority));
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(bad)?;
        (host, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    let port = match port {
        Some(port) => port.parse::<u16>().map_err(|_| bad())?,
        None => default.ok_or_else(bad)?,
    };
    if host.is_empty() || host.len() > 253 || port == 0 {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// Connects to `host:port` if the guard lets every address of it through.
async fn connect(guard: &AddressGuard, host: &str, port: u16) -> Result<TcpStream, (u16, String)> {
    let addrs = guard.resolve(host).await.map_err(|err| (403, err.to_string()))?;
    let addrs: Vec<SocketAddr> = addrs.into_iter().map(|addr| SocketAddr::new(addr.ip(), port)).collect();
    if addrs.is_empty() {
        return Err((502, format!("{host} has no address")));
    }
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addrs[..])).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(err)) => Err((502, format!("cannot connect to {host}:{port}: {err}"))),
        Err(_) => Err((504, format!("{host}:{port} did not answer within {CONNECT_TIMEOUT:?}"))),
    }
}

async fn answer(client: &mut (impl AsyncWrite + Unpin), status: u16, text: &str) -> std::io::Result<()> {
    let reason = match status {
        400 => "Bad Request",
        403 => "Forbidden",
        429 => "Too Many Requests",
        504 => "Gateway Timeout",
        _ => "Bad Gateway",
    };
    let body = format!("{text}\n");
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    client.write_all(head.as_bytes()).await?;
    client.write_all(body.as_bytes()).await?;
    client.shutdown().await
}

fn short(text: &str) -> String {
    text.chars().take(100).collect()
}

/// Brings up the loopback of the calling process's network namespace (a new
/// one has it down), over rtnetlink.
fn loopback_up() -> std::io::Result<()> {
    use nix::sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, socket,
    };
    let index = nix::net::if_::if_nametoindex("lo")?;
    let netlink = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )?;
    // nlmsghdr (RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK), then ifinfomsg with IFF_UP set.
    const RTM_NEWLINK: u16 = 16;
    const FLAGS: u16 = 1 | 4;
    const IFF_UP: u32 = 1;
    let mut message = Vec::with_capacity(32);
    message.extend_from_slice(&32_u32.to_ne_bytes());
    message.extend_from_slice(&RTM_NEWLINK.to_ne_bytes());
    message.extend_from_slice(&FLAGS.to_ne_bytes());
    message.extend_from_slice(&1_u32.to_ne_bytes());
    message.extend_from_slice(&0_u32.to_ne_bytes());
    message.extend_from_slice(&[0, 0, 0, 0]);
    message.extend_from_slice(&i32::try_from(index).unwrap_or(1).to_ne_bytes());
    message.extend_from_slice(&IFF_UP.to_ne_bytes());
    message.extend_from_slice(&IFF_UP.to_ne_bytes());
    use std::os::fd::AsRawFd;
    sendto(
        netlink.as_raw_fd(),
        &message,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )?;
    let mut reply = [0_u8; 1024];
    let read = recv(netlink.as_raw_fd(), &mut reply, MsgFlags::empty())?;
    // NLMSG_ERROR carries the errno (0: acknowledged) right after the header.
    const NLMSG_ERROR: u16 = 2;
    let kind = reply.get(4..6).map(|b| u16::from_ne_bytes([b[0], b[1]]));
    let code = reply.get(16..20).map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
    match (read >= 20, kind, code) {
        (true, Some(NLMSG_ERROR), Some(0)) => Ok(()),
        (true, Some(NLMSG_ERROR), Some(code)) => Err(std::io::Error::from_raw_os_error(-code)),
        _ => Err(std::io::Error::other("an unexpected rtnetlink answer")),
    }
}

/// What `avm sandbox-relay` runs inside a command's namespaces: brings the
/// namespace's loopback up (the one capability the fence leaves the relay,
/// over a namespace that holds nothing else), listens on its
/// [`PROXY_PORT`], prints `ready` once it does, and hands every connection
/// to the proxy's `socket` (as the command sees it).
pub async fn relay(socket: &Path) -> std::io::Result<()> {
    loopback_up()?;
    let listener = TcpListener::bind(("127.0.0.1", PROXY_PORT)).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        out.write_all(b"ready\n")?;
        out.flush()?;
    }
    let mut connections = JoinSet::new();
    loop {
        let (mut client, _) = listener.accept().await?;
        while connections.try_join_next().is_some() {}
        let socket = socket.to_owned();
        connections.spawn(async move {
            if let Ok(mut proxy) = UnixStream::connect(&socket).await {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut proxy).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connect_names_its_host_and_port() {
        let head = parse(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\n").unwrap();
        assert_eq!(
            head,
            Head {
                tunnel: true,
                host: "pypi.org".into(),
                port: 443,
                forward: Vec::new()
            }
        );
        let v6 = parse(b"CONNECT [::1]:8443 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 8443));
    }

    #[test]
    fn a_plain_request_is_forwarded_in_origin_form_and_closes() {
        let head = parse(
            b"GET http://example.com:8080/a?b=1 HTTP/1.1\r\nHost: example.com:8080\r\nProxy-Connection: keep-alive\r\n\
              Proxy-Authorization: Basic eA==\r\nAccept: */*\r\n\r\n",
        )
        .unwrap();
        assert!(!head.tunnel);
        assert_eq!((head.host.as_str(), head.port), ("example.com", 8080));
        assert_eq!(
            String::from_utf8(head.forward).unwrap(),
            "GET /a?b=1 HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        let bare = parse(b"GET http://example.com HTTP/1.0\r\n\r\n").unwrap();
        assert_eq!((bare.port, bare.forward.starts_with(b"GET / HTTP/1.0\r\n")), (80, true));
    }

    #[test]
    fn what_is_not_a_proxy_request_is_refused() {
        for bad in [
            &b"GET /local HTTP/1.1\r\n\r\n"[..],
            b"GET https://example.com/ HTTP/1.1\r\n\r\n",
            b"GET http://user:pw@example.com/ HTTP/1.1\r\n\r\n",
            b"CONNECT example.com HTTP/1.1\r\n\r\n",
            b"CONNECT example.com:0 HTTP/1.1\r\n\r\n",
            b"CONNECT example.com:443 HTTP/2\r\n\r\n",
            b"GET  http://example.com/ HTTP/1.1\r\n\r\n",
            b"\xff\xfe\r\n\r\n",
        ] {
            assert!(parse(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[tokio::test]
    async fn internal_addresses_are_refused_with_the_reason_and_public_ones_pass_the_guard() {
        let guard = AddressGuard::new(&[]).unwrap();
        for host in ["127.0.0.1", "localhost", "169.254.169.254", "10.0.0.1", "::1"] {
            let (status, text) = connect(&guard, host, 80).await.unwrap_err();
            assert_eq!(status, 403, "{host}: {text}");
            assert!(text.contains("refused"), "{host}: {text}");
        }
        // Allowed by the operator: connected (here, refused by nobody listening).
        let open = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = open.local_addr().unwrap().port();
        let allowed = AddressGuard::new(&["127.0.0.1".to_owned()]).unwrap();
        assert!(connect(&allowed, "127.0.0.1", port).await.is_ok());
    }

    #[tokio::test]
    async fn a_request_head_is_bounded() {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        client.write_all(&vec![b'a'; MAX_HEAD_BYTES + 2048]).await.unwrap();
        let err = read_head(&mut server).await.unwrap_err();
        assert!(err.contains("over"), "{err}");
        let (mut client, mut server) = tokio::io::duplex(1024);
        client.write_all(b"CONNECT a:1 HTTP/1.1\r\n\r\nhello").await.unwrap();
        let (head, rest) = read_head(&mut server).await.unwrap();
        assert!(head.ends_with(b"\r\n\r\n"));
        assert_eq!(rest, b"hello");
    }
}
