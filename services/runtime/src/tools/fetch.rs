//! `fetch_url`: an HTTP GET of a public address, under time and size caps.
//!
//! The address guard (`avm_common::address`, shared with the services that
//! check MCP servers' addresses at registration) refuses loopback, private, link-local (cloud metadata
//! included), shared, multicast and unspecified addresses before any
//! connection is made: an address literal is checked as it is, a name after
//! DNS resolution (the connection goes to the checked addresses, so a second
//! resolution cannot swap them), and again on every redirect, which is
//! followed here rather than by the HTTP client. The operator's allow-list
//! (`[runtime.fetch] allow`) names hosts, addresses or networks fetched
//! anyway. No proxy is used: a proxy would resolve names out of the guard's
//! sight.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};

pub use avm_common::address::AddressGuard;
use avm_common::address::Unreachable;

use crate::config::FetchConfig;
use crate::error::RuntimeError;
use avm_sandbox::ToolFailure;

/// Resolves names for the HTTP client, keeping only the addresses the guard
/// lets through; a name with none left fails with the refusal.
struct GuardedResolver(Arc<AddressGuard>);

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let guard = Arc::clone(&self.0);
        Box::pin(async move {
            let addrs = guard.resolve(name.as_str()).await?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// Fetches URLs for agents: one HTTP client for the runtime.
#[derive(Clone, Debug)]
pub struct Fetcher {
    client: reqwest::Client,
    /// The same guard, for MCP servers' HTTP sessions.
    mcp: reqwest::Client,
    guard: Arc<AddressGuard>,
    config: FetchConfig,
}

impl Fetcher {
    /// Returns the fetcher of these settings.
    pub fn new(config: &FetchConfig) -> Result<Self, RuntimeError> {
        let guard = Arc::new(AddressGuard::new(&config.allow)?);
        let guarded = |agent: &str| {
            reqwest::Client::builder()
                .no_proxy()
                .redirect(reqwest::redirect::Policy::none())
                .dns_resolver(Arc::new(GuardedResolver(Arc::clone(&guard))))
                .connect_timeout(Duration::from_secs(10))
                .user_agent(format!("AgentVM/{} {agent}", env!("CARGO_PKG_VERSION")))
        };
        let client = guarded("fetch_url").build();
        // No idle connections kept: a session's next request may be long after.
        let mcp = guarded("mcp").pool_max_idle_per_host(0).build();
        let (Ok(client), Ok(mcp)) = (client, mcp) else {
            return Err(RuntimeError::invalid(
                "INVALID_CONFIG",
                "the HTTP client of tools cannot be built",
            ));
        };
        Ok(Self {
            client,
            mcp,
            guard,
            config: config.clone(),
        })
    }

    /// Returns the address guard.
    pub fn guard(&self) -> &Arc<AddressGuard> {
        &self.guard
    }

    /// Refuses a URL the guard would refuse, names resolved: for a clear
    /// reason before a client whose errors hide it connects (the client's
    /// own resolution is guarded as well).
    pub async fn precheck(&self, url: &str) -> Result<(), ToolFailure> {
        let url = Url::parse(url).map_err(|err| format!("{url:?} is not a URL: {err}"))?;
        self.guard.check_url(&url)?;
        let host = url.host_str().unwrap_or_default();
        if host.starts_with('[') || host.parse::<IpAddr>().is_ok() {
            return Ok(());
        }
        match self.guard.resolve(host).await {
            Ok(_) => Ok(()),
            Err(Unreachable::Refused(refusal)) => Err(refusal),
            Err(Unreachable::Lookup(err)) => Err(format!("{url}: {err}")),
        }
    }

    /// Returns the HTTP client MCP servers are reached with: behind the
    /// same guard, no proxy, no redirect followed.
    pub fn mcp_client(&self) -> reqwest::Client {
        self.mcp.clone()
    }

    /// Fetches `url`; the text is the status line, the content type and the
    /// body (text, cut at the size cap). A status of 400 or more is an error
    /// result, with the body the server sent.
    pub async fn fetch(&self, url: &str) -> Result<(String, bool), ToolFailure> {
        let timeout = Duration::from_secs(self.config.timeout_seconds);
        match tokio::time::timeout(timeout, self.follow(url)).await {
            Ok(result) => result,
            Err(_) => Err(format!("{url}: no complete answer within {} s", timeout.as_secs())),
        }
    }

    async fn follow(&self, url: &str) -> Result<(String, bool), ToolFailure> {
        let mut url = Url::parse(url).map_err(|err| format!("{url:?} is not a URL: {err}"))?;
        let mut redirects = 0;
        loop {
            self.guard.check_url(&url)?;
            let response = self
                .client
                .get(url.clone())
                .send()
                .await
                .map_err(|err| failure(&url, &err))?;
            if response.status().is_redirection()
                && let Some(location) = response.headers().get(reqwest::header::LOCATION)
            {
                if redirects == self.config.max_redirects {
                    return Err(format!("{url}: more than {redirects} redirects"));
                }
                redirects += 1;
                let location = location.to_str().unwrap_or_default();
                url = url
                    .join(location)
                    .map_err(|err| format!("{url} redirects to {location:?}, not a URL: {err}"))?;
                continue;
            }
            return self.read(url, response).await;
        }
    }

    async fn read(&self, url: Url, response: reqwest::Response) -> Result<(String, bool), ToolFailure> {
        let status = response.status();
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("unknown")
            .to_owned();
        let mut body = Vec::new();
        let mut cut = false;
        let mut stream = response.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|err| failure(&url, &err))?;
            let room = self.config.max_bytes - body.len();
            if chunk.len() > room {
                body.extend_from_slice(&chunk[..room]);
                cut = true;
                break;
            }
            body.extend_from_slice(&chunk);
        }
        let mut text = format!("{url}\nHTTP {status}\ncontent-type: {content_type}\n\n");
        match std::str::from_utf8(&body) {
            Ok(body) => text.push_str(body),
            // A cut may fall inside a character: keep the valid part.
            Err(err) if cut && err.error_len().is_none() => {
                text.push_str(&String::from_utf8_lossy(&body[..err.valid_up_to()]));
            }
            Err(_) => text.push_str(&format!("[{} bytes of binary content, not shown]", body.len())),
        }
        if cut {
            text.push_str(&format!("\n[cut at {} bytes]", self.config.max_bytes));
        }
        Ok((text, status.as_u16() >= 400))
    }
}

/// Says why a request failed: the guard's refusal when it was that, else the
/// client's error with its causes (no URL credentials: reqwest strips none,
/// but agents' URLs are their own).
fn failure(url: &Url, err: &reqwest::Error) -> String {
    if let Some(refused) = refusal_in(err) {
        return refused;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    let mut causes = Vec::new();
    while let Some(cause) = source {
        causes.push(cause.to_string());
        source = cause.source();
    }
    format!("{url}: {}", causes.last().map_or("request failed", String::as_str))
}

/// Returns the guard's refusal if it is among an error's causes.
pub fn refusal_in(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut source = Some(err);
    while let Some(cause) = source {
        if let Some(Unreachable::Refused(refusal)) = cause.downcast_ref::<Unreachable>() {
            return Some(refusal.clone());
        }
        source = cause.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A bare HTTP server answering every request with `response`, counting
    /// the connections it accepts.
    async fn server(ip: &str, response: String) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let response = response.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = socket.write_all(response.as_bytes()).await;
                });
            }
        });
        (addr, accepted)
    }

    fn ok(body: &str) -> String {
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    fn fetcher(allow: &[&str]) -> Fetcher {
        Fetcher::new(&FetchConfig {
            allow: allow.iter().map(|entry| (*entry).to_owned()).collect(),
            ..FetchConfig::default()
        })
        .unwrap()
    }

    #[tokio::test]
    async fn internal_addresses_are_refused_before_any_connection() {
        let (addr, accepted) = server("127.0.0.1", ok("secret")).await;
        let port = addr.port();
        let fetcher = fetcher(&[]);
        for (url, says) in [
            (format!("http://127.0.0.1:{port}/"), "loopback"),
            (format!("http://localhost:{port}/"), "loopback"),
            (format!("http://[::1]:{port}/"), "loopback"),
            (format!("http://[::ffff:127.0.0.1]:{port}/"), "loopback"),
            (format!("http://127.1:{port}/"), "loopback"),
            (format!("http://2130706433:{port}/"), "loopback"),
            ("http://169.254.169.254/latest/meta-data/".to_owned(), "link-local"),
            ("http://10.1.2.3/".to_owned(), "private"),
            ("http://192.168.0.1/".to_owned(), "private"),
            ("http://[fd00:ec2::254]/".to_owned(), "private"),
            ("http://100.100.100.200/".to_owned(), "shared"),
            ("http://0.0.0.0/".to_owned(), "unspecified"),
        ] {
            let err = fetcher.fetch(&url).await.unwrap_err();
            assert!(err.starts_with("refused: ") && err.contains(says), "{url}: {err}");
        }
        let err = fetcher.fetch("file:///etc/passwd").await.unwrap_err();
        assert!(err.contains("not an http:// or https:// URL"), "{err}");
        assert_eq!(accepted.load(Ordering::SeqCst), 0, "no connection reached the server");
    }

    #[tokio::test]
    async fn a_redirect_to_an_internal_address_is_refused() {
        let (inner, inner_accepted) = server("127.0.0.1", ok("secret")).await;
        let (outer, outer_accepted) = server(
            "127.0.0.2",
            format!(
                "HTTP/1.1 302 Found\r\nlocation: http://localhost:{}/admin\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                inner.port()
            ),
        )
        .await;
        // The operator allows the first host (standing in for a public one).
        let err = fetcher(&["127.0.0.2"])
            .fetch(&format!("http://{outer}/start"))
            .await
            .unwrap_err();
        assert!(err.starts_with("refused: localhost is a loopback address"), "{err}");
        assert_eq!(outer_accepted.load(Ordering::SeqCst), 1);
        assert_eq!(
            inner_accepted.load(Ordering::SeqCst),
            0,
            "the redirect was not followed"
        );
    }

    #[tokio::test]
    async fn allowed_addresses_are_fetched_and_bodies_capped() {
        let (addr, accepted) = server("127.0.0.1", ok(&"x".repeat(100))).await;
        let capped = Fetcher::new(&FetchConfig {
            allow: vec!["127.0.0.0/8".into()],
            max_bytes: 10,
            ..FetchConfig::default()
        })
        .unwrap();
        let (text, failed) = capped.fetch(&format!("http://{addr}/page")).await.unwrap();
        assert!(!failed);
        assert!(
            text.contains("HTTP 200 OK\ncontent-type: text/plain\n\nxxxxxxxxxx\n[cut at 10 bytes]"),
            "{text}"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);

        let (addr, _) = server(
            "127.0.0.1",
            "HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\nconnection: close\r\n\r\ngone".to_owned(),
        )
        .await;
        let (text, failed) = capped.fetch(&format!("http://{addr}/")).await.unwrap();
        assert!(
            failed && text.contains("HTTP 404 Not Found") && text.ends_with("gone"),
            "{text}"
        );

        // An allowed name reaches its internal addresses.
        let (text, _) = fetcher(&["localhost"])
            .fetch(&format!("http://localhost:{}/", addr.port()))
            .await
            .unwrap();
        assert!(text.contains("HTTP 404"), "{text}");
    }
}
