//! The address guard: which network addresses AgentVM's components reach on
//! a tenant's behalf (`fetch_url`, MCP servers). It refuses loopback,
//! private, link-local (cloud metadata included), shared, multicast and
//! unspecified addresses, unless the operator's allow-list (`[runtime.fetch]
//! allow`) names the host, address or network. Kept here so the runtime (at
//! use, names resolved) and the services that store MCP server definitions
//! (at registration, literals and `localhost`) apply one rule.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use url::Url;

use crate::ApiError;

/// Why a name cannot be reached.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    /// It did not resolve.
    #[error("{0}")]
    Lookup(String),
    /// An address of it is internal; the text says which and why.
    #[error("{0}")]
    Refused(String),
}

/// What the allow-list names: a host, or a network.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Allowed {
    Host(String),
    Network(IpAddr, u8),
}

/// The address guard: which addresses may be reached.
#[derive(Clone, Debug, Default)]
pub struct AddressGuard {
    allow: Vec<Allowed>,
}

impl AddressGuard {
    /// Returns the guard of an allow-list; an entry that is neither a host
    /// name, an address nor a network is refused.
    pub fn new(allow: &[String]) -> Result<Self, ApiError> {
        let allow = allow
            .iter()
            .map(|entry| parse_allowed(entry))
            .collect::<Result<_, _>>()?;
        Ok(Self { allow })
    }

    /// Returns whether the allow-list names `host` itself.
    pub fn host_allowed(&self, host: &str) -> bool {
        self.allow
            .iter()
            .any(|entry| matches!(entry, Allowed::Host(name) if name.eq_ignore_ascii_case(host)))
    }

    /// Returns why this address may not be reached, `None` when it may.
    pub fn refusal(&self, ip: IpAddr) -> Option<&'static str> {
        let reason = internal(ip)?;
        let allowed = self.allow.iter().any(|entry| match *entry {
            Allowed::Network(network, prefix) => within(ip, network, prefix),
            Allowed::Host(_) => false,
        });
        (!allowed).then_some(reason)
    }

    /// Resolves `host` and returns its addresses if the guard lets them all
    /// through (or the allow-list names the host); a connection goes to the
    /// addresses returned, so a second resolution cannot swap them. One
    /// internal address among public ones refuses the name: which one a
    /// connection would use is not ours to pick.
    pub async fn resolve(&self, host: &str) -> Result<Vec<std::net::SocketAddr>, Unreachable> {
        let found: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host, 0))
            .await
            .map_err(|err| Unreachable::Lookup(err.to_string()))?
            .collect();
        if self.host_allowed(host) {
            return Ok(found);
        }
        for addr in &found {
            if let Some(reason) = self.refusal(addr.ip()) {
                return Err(Unreachable::Refused(refused(host, addr.ip(), reason)));
            }
        }
        Ok(found)
    }

    /// Checks a URL before it is requested: its scheme, and its host when
    /// that is an address literal or `localhost` (always loopback, RFC 6761);
    /// other names are checked once resolved, where they are used.
    pub fn check_url(&self, url: &Url) -> Result<(), String> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("{url} is not an http:// or https:// URL"));
        }
        let host = url.host_str().ok_or_else(|| format!("{url} names no host"))?;
        let literal = host.trim_start_matches('[').trim_end_matches(']');
        let ip = match literal.parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) if is_localhost(host) => Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            Err(_) => None,
        };
        if let Some(ip) = ip
            && let Some(reason) = self.refusal(ip)
            && !self.host_allowed(host)
        {
            return Err(refused(host, ip, reason));
        }
        Ok(())
    }
}

/// Returns whether `host` is `localhost` or a name under it.
fn is_localhost(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost" || host.ends_with(".localhost")
}

/// Returns the refusal of `host`, found to be `ip`, an address of kind `reason`.
pub fn refused(host: &str, ip: IpAddr, reason: &str) -> String {
    format!(
        "refused: {host} is {reason} address ({ip}); fetch_url reaches public addresses only \
         (an operator may allow it in [runtime.fetch] allow)"
    )
}

fn parse_allowed(entry: &str) -> Result<Allowed, ApiError> {
    let invalid = || {
        ApiError::invalid(
            "INVALID_CONFIG",
            format!("runtime.fetch.allow: {entry:?} is not a host name, an address or a network (10.0.0.0/8)"),
        )
    };
    let entry = entry.trim();
    if let Some((address, prefix)) = entry.split_once('/') {
        let ip: IpAddr = address.parse().map_err(|_| invalid())?;
        let prefix: u8 = prefix.parse().map_err(|_| invalid())?;
        let bits = if ip.is_ipv4() { 32 } else { 128 };
        return if prefix <= bits {
            Ok(Allowed::Network(ip, prefix))
        } else {
            Err(invalid())
        };
    }
    if let Ok(ip) = entry.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(Allowed::Network(ip, if ip.is_ipv4() { 32 } else { 128 }));
    }
    let name_like = !entry.is_empty() && entry.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if name_like {
        Ok(Allowed::Host(entry.to_ascii_lowercase()))
    } else {
        Err(invalid())
    }
}

/// Returns whether `ip` lies in `network/prefix` (an IPv4 address in an
/// IPv4 network, an IPv6 address in an IPv6 one).
fn within(ip: IpAddr, network: IpAddr, prefix: u8) -> bool {
    match (canonical(ip), network) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// An IPv4 address written as IPv6 (`::ffff:127.0.0.1`) is the IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Returns what kind of internal address this is, `None` for a public one.
fn internal(ip: IpAddr) -> Option<&'static str> {
    match canonical(ip) {
        IpAddr::V4(v4) => internal_v4(v4),
        IpAddr::V6(v6) => internal_v6(v6),
    }
}

fn internal_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip.is_loopback() {
        Some("a loopback")
    } else if ip.is_private() {
        Some("a private")
    } else if ip.is_link_local() {
        Some("a link-local (cloud metadata)")
    } else if a == 100 && (64..128).contains(&b) {
        Some("a shared (carrier-grade NAT)")
    } else if ip.is_unspecified() || a == 0 {
        Some("an unspecified")
    } else if ip.is_multicast() || ip.is_broadcast() || a >= 240 {
        Some("a multicast or reserved")
    } else {
        None
    }
}

fn internal_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let first = ip.segments()[0];
    if ip.is_loopback() {
        Some("a loopback")
    } else if ip.is_unspecified() {
        Some("an unspecified")
    } else if first & 0xfe00 == 0xfc00 {
        Some("a private (unique local)")
    } else if first & 0xffc0 == 0xfe80 {
        Some("a link-local")
    } else if ip.is_multicast() {
        Some("a multicast")
    } else if let Some(v4) = ip.to_ipv4() {
        // IPv4-compatible (::a.b.c.d) and NAT64 forms name IPv4 hosts.
        internal_v4(v4).filter(|_| first == 0)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_knows_internal_addresses() {
        let guard = AddressGuard::new(&["10.0.0.0/8".into(), "fd00::/8".into()]).unwrap();
        for public in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "100.128.0.1", "172.32.0.1"] {
            assert_eq!(guard.refusal(public.parse().unwrap()), None, "{public}");
        }
        for allowed in ["10.9.8.7", "fd12::1"] {
            assert_eq!(guard.refusal(allowed.parse().unwrap()), None, "{allowed}");
        }
        for internal in [
            "127.0.0.1",
            "172.16.0.1",
            "169.254.169.254",
            "fe80::1",
            "fc00::1",
            "::1",
            "::",
            "224.0.0.1",
            "255.255.255.255",
            "::ffff:192.168.1.1",
            "::127.0.0.1",
        ] {
            assert!(guard.refusal(internal.parse().unwrap()).is_some(), "{internal}");
        }
        let url = |text: &str| Url::parse(text).unwrap();
        for refused in [
            "http://127.0.0.1:9/mcp",
            "http://169.254.169.254/latest/meta-data",
            "http://[::1]/",
            "http://localhost:8080/",
            "http://api.LOCALHOST./",
            "file:///etc/passwd",
        ] {
            assert!(guard.check_url(&url(refused)).is_err(), "{refused}");
        }
        for fine in ["https://mcp.example.com/mcp", "http://10.1.2.3/"] {
            assert_eq!(guard.check_url(&url(fine)), Ok(()), "{fine}");
        }
        let loopback = AddressGuard::new(&["127.0.0.1".into()]).unwrap();
        assert_eq!(loopback.check_url(&url("http://localhost:8080/")), Ok(()));
        for bad in ["10.0.0.0/33", "not a host!", "", "1.2.3.4/x"] {
            assert!(AddressGuard::new(&[bad.into()]).is_err(), "{bad:?}");
        }
    }
}
