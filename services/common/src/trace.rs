//! W3C trace context (`traceparent`), carried by every request from the
//! gateway through each gRPC hop, so the log lines and spans of one user
//! request share one trace id across components — whether or not spans are
//! exported (OpenTelemetry is off unless `OTEL_EXPORTER_OTLP_ENDPOINT` is set).

use tonic::metadata::MetadataMap;

/// The header and metadata key of the trace context.
pub const TRACEPARENT: &str = "traceparent";

/// The trace a request belongs to, and the span that made it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: u128,
    pub span_id: u64,
}

impl std::fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.header())
    }
}

impl TraceParent {
    /// Returns the start of a new trace.
    pub fn root() -> TraceParent {
        TraceParent {
            trace_id: nonzero(rand::random()),
            span_id: nonzero(rand::random()),
        }
    }

    /// Parses a `traceparent` value (`00-<32 hex>-<16 hex>-<2 hex>`);
    /// anything else, or all-zero ids, is no trace context.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |part: &str, len: usize| part.len() == len && part.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex(version, 2) || version == "ff" || !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
            return None;
        }
        // Version 00 has exactly four parts; later versions may add more.
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|id| *id != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|id| *id != 0)?;
        Some(TraceParent { trace_id, span_id })
    }

    /// Returns the trace context of HTTP (or gRPC) headers, if they carry a valid one.
    pub fn from_headers(headers: &http::HeaderMap) -> Option<TraceParent> {
        headers
            .get(TRACEPARENT)
            .and_then(|value| value.to_str().ok())
            .and_then(TraceParent::parse)
    }

    /// Returns the trace context of gRPC metadata, when valid.
    pub fn from_metadata(metadata: &MetadataMap) -> Option<TraceParent> {
        metadata
            .get(TRACEPARENT)
            .and_then(|value| value.to_str().ok())
            .and_then(TraceParent::parse)
    }

    /// Returns the same trace with a new span id, for a call this span makes.
    pub fn child(&self) -> TraceParent {
        TraceParent {
            trace_id: self.trace_id,
            span_id: nonzero(rand::random()),
        }
    }

    /// Returns the `traceparent` value (sampled).
    pub fn header(&self) -> String {
        format!("00-{:032x}-{:016x}-01", self.trace_id, self.span_id)
    }

    /// Returns the trace id as 32 hex digits, as logs and exporters show it.
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

/// Returns `id`, or 1 for the (astronomically unlikely) zero that means "none".
fn nonzero<T: From<u8> + PartialEq>(id: T) -> T {
    if id == T::from(0) { T::from(1) } else { id }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_no_context() {
        let trace = TraceParent::root();
        assert_eq!(TraceParent::parse(&trace.header()), Some(trace));
        let child = trace.child();
        assert_eq!(child.trace_id, trace.trace_id);
        assert_ne!(child.span_id, trace.span_id);
        let known = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parsed = TraceParent::parse(known);
        assert_eq!(
            parsed.map(|p| p.trace_id_hex()).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-xyz92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
    }
}
