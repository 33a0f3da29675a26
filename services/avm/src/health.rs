//! `avm health`: asks a running process whether it is healthy, for container
//! health checks in an image without a shell or curl. It answers with exit
//! status 0 when the process is healthy, else 1 with the reason on one line.
//!
//! A gRPC component is asked over `grpc.health.v1` (every component serves
//! it, open, on its gRPC port); the gateway, which serves HTTP only, by a GET
//! of its `/health` that must answer 2xx.

use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// What to ask, and how long to wait for the answer.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// Ask the `grpc.health.v1` service at this address (host:port or URL).
    #[arg(long, default_value = "127.0.0.1:7000", conflicts_with = "http")]
    grpc: String,
    /// The gRPC service to ask about (default: the whole server).
    #[arg(long, default_value = "", hide_default_value = true, conflicts_with = "http")]
    service: String,
    /// Instead, GET this URL, which must answer 2xx (the gateway: http://127.0.0.1:8080/health).
    #[arg(long)]
    http: Option<String>,
    /// Give up after this long, e.g. `3s`.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// Returns a one-line description of a healthy target, or fails with why it is not.
pub async fn check(args: &HealthArgs) -> anyhow::Result<String> {
    match &args.http {
        Some(url) => check_http(url, args.timeout).await,
        None => check_grpc(&args.grpc, &args.service, args.timeout).await,
    }
}

/// Asks `grpc.health.v1.Health/Check` at `addr` about `service`.
async fn check_grpc(addr: &str, service: &str, timeout: Duration) -> anyhow::Result<String> {
    let url = if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    let endpoint = tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("invalid gRPC address {addr:?}"))?
        .connect_timeout(timeout)
        .timeout(timeout);
    let call = async {
        let channel = endpoint
            .connect()
            .await
            .with_context(|| format!("cannot reach {url}"))?;
        let request = HealthCheckRequest {
            service: service.to_owned(),
        };
        HealthClient::new(channel).check(request).await.map_err(|status| {
            anyhow::anyhow!(
                "grpc health of {url} answered {:?}: {}",
                status.code(),
                status.message()
            )
        })
    };
    let response = tokio::time::timeout(timeout, call)
        .await
        .with_context(|| format!("no answer from {url} within {timeout:?}"))??;
    let status = ServingStatus::try_from(response.get_ref().status).unwrap_or(ServingStatus::Unknown);
    let what = if service.is_empty() { "the server" } else { service };
    if status != ServingStatus::Serving {
        bail!("{what} at {url} is {}", status.as_str_name());
    }
    Ok(format!("{what} at {url} is SERVING"))
}

/// GETs `url`; healthy when it answers 2xx.
async fn check_http(url: &str, timeout: Duration) -> anyhow::Result<String> {
    // The target is this container's own port: a proxy from the environment
    // would only stand in the way.
    let client = reqwest::Client::builder().no_proxy().timeout(timeout).build()?;
    let response = client
        .get(url)
        .send()
        .await
        .map_err(reqwest::Error::without_url)
        .with_context(|| format!("cannot reach {url}"))?;
    let status = response.status();
    if !status.is_success() {
        bail!("GET {url} answered {status}");
    }
    Ok(format!("GET {url} answered {status}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tonic::transport::Server;
    use tonic::transport::server::TcpIncoming;

    const WAIT: Duration = Duration::from_secs(5);

    /// Serves `grpc.health.v1` on a free port; returns its address and reporter.
    async fn health_server() -> (String, tonic_health::server::HealthReporter) {
        let (reporter, service) = tonic_health::server::health_reporter();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpIncoming::from(listener)),
        );
        (addr, reporter)
    }

    /// Answers every connection on a free port with `status_line` and no body.
    async fn http_server(status_line: &'static str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let response = format!("HTTP/1.1 {status_line}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        format!("http://{addr}/health")
    }

    /// Returns the address of a port nothing listens on.
    async fn closed_port() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap().to_string()
    }

    #[tokio::test]
    async fn grpc_serving_is_healthy_and_not_serving_is_not() {
        let (addr, reporter) = health_server().await;
        let ok = check_grpc(&addr, "", WAIT).await.unwrap();
        assert!(ok.contains("SERVING"), "{ok}");

        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let err = check_grpc(&format!("http://{addr}"), "", WAIT).await.unwrap_err();
        assert!(format!("{err:#}").contains("is NOT_SERVING"), "{err:#}");
    }

    #[tokio::test]
    async fn grpc_unknown_service_is_unhealthy() {
        let (addr, _reporter) = health_server().await;
        let err = check_grpc(&addr, "avm.nothing.v1.Nothing", WAIT).await.unwrap_err();
        assert!(format!("{err:#}").contains("NotFound"), "{err:#}");
    }

    #[tokio::test]
    async fn grpc_nothing_listening_is_unhealthy() {
        let addr = closed_port().await;
        let err = check_grpc(&addr, "", WAIT).await.unwrap_err();
        assert!(format!("{err:#}").starts_with("cannot reach http://"), "{err:#}");
    }

    #[tokio::test]
    async fn http_2xx_is_healthy_and_else_not() {
        let ok = check_http(&http_server("200 OK").await, WAIT).await.unwrap();
        assert!(ok.ends_with("answered 200 OK"), "{ok}");

        let err = check_http(&http_server("503 Service Unavailable").await, WAIT)
            .await
            .unwrap_err();
        assert!(
            format!("{err:#}").ends_with("answered 503 Service Unavailable"),
            "{err:#}"
        );

        let url = format!("http://{}/health", closed_port().await);
        let err = check_http(&url, WAIT).await.unwrap_err();
        assert!(
            format!("{err:#}").starts_with(&format!("cannot reach {url}")),
            "{err:#}"
        );
    }

    #[test]
    fn command_line_picks_one_target() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Cli {
            #[command(flatten)]
            health: HealthArgs,
        }
        let default = Cli::try_parse_from(["health"]).unwrap().health;
        assert_eq!((default.grpc.as_str(), default.http), ("127.0.0.1:7000", None));
        let http = Cli::try_parse_from(["health", "--http", "http://127.0.0.1:8080/health"])
            .unwrap()
            .health;
        assert_eq!(http.http.as_deref(), Some("http://127.0.0.1:8080/health"));
        assert!(Cli::try_parse_from(["health", "--http", "http://x/", "--grpc", "127.0.0.1:1"]).is_err());
    }
}
