//! `--dev` lets requests without credentials act as the admin of the local
//! `dev` tenant, and only on loopback. A web page the operator opens can
//! reach loopback as well: through a cross-site form or `fetch` (a "simple"
//! request needs no preflight), through a WebSocket (which browsers open to
//! any origin), or by rebinding its own name to 127.0.0.1. So in dev mode
//! the gateway answers only requests that name this machine as their `Host`
//! and come from its own origin, or from a tool that sends no `Origin`
//! (issue 26 item 12).

use std::net::IpAddr;

use avm_common::{ApiError, Code};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, ORIGIN};
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;

use crate::http::{RequestId, error_response, request_id_from_headers};

/// Refuses, in dev mode, a request from anywhere but this machine's own
/// pages and tools, with the error document.
pub async fn guard(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if let Err(err) = check(request.headers(), request.method(), request.uri()) {
        let request_id = request
            .extensions()
            .get::<RequestId>()
            .map_or_else(|| request_id_from_headers(request.headers()), |id| id.0.clone());
        return error_response(&err, &request_id);
    }
    next.run(request).await
}

/// Returns why a request may not reach a dev-mode gateway, if it may not:
/// a `Host` other than a loopback name or address (DNS rebinding), an
/// `Origin` other than the server's own (a foreign page, a WebSocket
/// included), `Sec-Fetch-Site` other than `same-origin` or `none`, or an
/// uncredentialed state change in a content type any page may send
/// without a preflight (`text/plain`, forms), which older browsers send
/// without `Origin`.
pub fn check(headers: &HeaderMap, method: &Method, uri: &Uri) -> Result<(), ApiError> {
    let host = match headers.get(HOST) {
        Some(value) => Some(value.to_str().map_err(|_| foreign_host())?),
        None => uri.authority().map(|authority| authority.as_str()),
    };
    if let Some(host) = host
        && !is_loopback_host(host)
    {
        return Err(foreign_host());
    }
    if let Some(origin) = headers.get(ORIGIN) {
        let own = host.is_some_and(|host| origin.as_bytes() == format!("http://{host}").as_bytes());
        if !own {
            return Err(cross_site());
        }
    }
    if let Some(site) = headers.get("sec-fetch-site")
        && !matches!(site.as_bytes(), b"same-origin" | b"none")
    {
        return Err(cross_site());
    }
    let changes = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
    if changes && headers.get(AUTHORIZATION).is_none() {
        let essence = headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.split(';').next())
            .map(|value| value.trim().to_ascii_lowercase());
        if let Some(essence) = essence
            && matches!(
                essence.as_str(),
                "text/plain" | "application/x-www-form-urlencoded" | "multipart/form-data"
            )
        {
            return Err(ApiError::invalid(
                "UNSUPPORTED_CONTENT_TYPE",
                "dev mode takes request bodies as application/json only",
            ));
        }
    }
    Ok(())
}

/// Whether a `Host` names this machine: `localhost` or a loopback address,
/// with or without a port. Dev mode binds only to loopback, so its own
/// address is one of these.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((address, port)) if port.is_empty() || is_port(port) => address,
            _ => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        },
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn is_port(text: &str) -> bool {
    text.strip_prefix(':').unwrap_or(text).parse::<u16>().is_ok()
}

fn foreign_host() -> ApiError {
    ApiError::new(
        Code::PermissionDenied,
        "FOREIGN_HOST",
        "dev mode answers only requests to localhost or a loopback address",
    )
}

fn cross_site() -> ApiError {
    ApiError::new(
        Code::PermissionDenied,
        "CROSS_SITE_REFUSED",
        "dev mode answers only this server's own pages and tools that send no Origin",
    )
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn reason(pairs: &[(&str, &str)], method: Method) -> String {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            if let (Ok(name), Ok(value)) = (
                axum::http::HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                headers.insert(name, value);
            }
        }
        check(&headers, &method, &Uri::from_static("/v1/containers"))
            .err()
            .map(|err| err.reason.into_owned())
            .unwrap_or_default()
    }

    #[test]
    fn only_this_machines_own_pages_and_tools_pass() {
        for host in ["127.0.0.1:8080", "localhost", "LOCALHOST:1", "[::1]:8080", "127.0.0.2"] {
            assert_eq!(reason(&[("host", host)], Method::GET), "", "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "0.0.0.0:8080",
            "127.0.0.1.nip.io",
            "[::1]x",
            "localhost:x",
        ] {
            assert_eq!(reason(&[("host", host)], Method::GET), "FOREIGN_HOST", "{host}");
        }
        let own = [("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:8080")];
        assert_eq!(reason(&own, Method::POST), "");
        for origin in [
            "https://evil.example",
            "null",
            "http://127.0.0.1:3000",
            "http://localhost:8080",
        ] {
            let pairs = [("host", "127.0.0.1:8080"), ("origin", origin)];
            assert_eq!(reason(&pairs, Method::GET), "CROSS_SITE_REFUSED", "{origin}");
        }
        assert_eq!(
            reason(&[("sec-fetch-site", "cross-site")], Method::GET),
            "CROSS_SITE_REFUSED"
        );
        assert_eq!(
            reason(&[("sec-fetch-site", "same-site")], Method::GET),
            "CROSS_SITE_REFUSED"
        );
        assert_eq!(reason(&[("sec-fetch-site", "none")], Method::GET), "");
        let simple = [("content-type", "text/plain;charset=UTF-8")];
        assert_eq!(reason(&simple, Method::POST), "UNSUPPORTED_CONTENT_TYPE");
        assert_eq!(reason(&simple, Method::GET), "");
        let credentialed = [("content-type", "text/plain"), ("authorization", "Bearer x")];
        assert_eq!(reason(&credentialed, Method::POST), "");
        assert_eq!(reason(&[("content-type", "application/json")], Method::POST), "");
    }
}
