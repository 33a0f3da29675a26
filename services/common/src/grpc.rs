//! gRPC server and channel builders with the settings every component shares:
//! health, reflection, message-size limits, keepalive, request timeout and a
//! bounded graceful drain.

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::ApiError;
use crate::config::GrpcConfig;

/// Errors of serving gRPC.
#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("grpc server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("cannot build reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// Collects services and serves them with health and reflection.
///
/// Services apply `config.max_message_bytes` to their generated server type
/// themselves, since the limit is a method of each generated type.
pub struct GrpcServer {
    config: GrpcConfig,
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    readiness: Option<Readiness>,
}

/// Returns what keeps a component from serving soundly, if anything.
type Readiness = Box<dyn Fn() -> Vec<crate::auth::Unready> + Send + Sync>;

/// A dependency still failing this long after start is logged; one that
/// only takes a moment to connect is not.
const QUIET_START: std::time::Duration = std::time::Duration::from_secs(10);

/// The health service name readiness probes ask: SERVING while the process
/// serves and nothing its readiness check names fails (the empty name, which
/// liveness asks, says only that the process serves).
pub const READY: &str = "ready";

impl GrpcServer {
    /// Returns an empty server using the shared gRPC settings.
    pub fn new(config: &GrpcConfig) -> Self {
        // Metrics recorded before the recorder exists are lost: install it now.
        crate::telemetry::metrics();
        Self {
            config: config.clone(),
            routes: RoutesBuilder::default(),
            names: vec![READY],
            readiness: None,
        }
    }

    /// Makes the [`READY`] health status follow `check`: NOT_SERVING while it
    /// names anything (a peer refusing this component's credentials, a change
    /// stream it depends on being down), each change logged. The check runs
    /// when a probe asks, never on a timer: an idle process stays asleep.
    pub fn with_readiness(mut self, check: impl Fn() -> Vec<crate::auth::Unready> + Send + Sync + 'static) -> Self {
        self.readiness = Some(Box::new(check));
        self
    }

    /// Adds a service; health reports it SERVING until shutdown.
    pub fn add_service<S>(mut self, service: S) -> Self
    where
        S: tower::Service<http::Request<Body>, Error = Infallible> + NamedService + Clone + Send + Sync + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// Serves until `shutdown` is cancelled, then flips health to NOT_SERVING,
    /// stops accepting, and gives in-flight calls `drain_timeout` to finish.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<(), GrpcError> {
        let (port, serving) = GrpcPort::open(listener, &self.config, shutdown).await?;
        port.attach(self).await;
        serving.await
    }
}

/// A gRPC port that answers from the moment it is bound, while its component
/// starts (opens and migrates its store, finds its peers): health says the
/// process lives (the empty name SERVING) and is not ready ([`READY`]
/// NOT_SERVING, its services' names unknown), and any other call is
/// UNAVAILABLE (`STARTING`), which callers retry. [`GrpcPort::attach`] then
/// serves the component's services. A probe thus never waits on a port
/// nobody answers, and a long migration is not taken for a hung process.
pub struct GrpcPort {
    reporter: HealthReporter,
    attached: Arc<OnceLock<Attached>>,
}

/// What a port serves once its component has started.
struct Attached {
    router: axum::Router,
    names: Vec<&'static str>,
    probed: Option<Arc<Probed>>,
}

impl GrpcPort {
    /// Starts answering on `listener`; returns the port and the server,
    /// which runs until `shutdown` is cancelled, then flips health to
    /// NOT_SERVING, stops accepting, and gives in-flight calls
    /// `drain_timeout` to finish.
    pub async fn open(
        listener: TcpListener,
        config: &GrpcConfig,
        shutdown: CancellationToken,
    ) -> Result<(Self, impl Future<Output = Result<(), GrpcError>> + Send + 'static), GrpcError> {
        // Metrics recorded before the recorder exists are lost: install it now.
        crate::telemetry::metrics();
        let (reporter, health) = tonic_health::server::health_reporter();
        // Until attached, and whatever the check says: not ready.
        reporter.set_service_status(READY, ServingStatus::NotServing).await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(avm_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let mut routes = RoutesBuilder::default();
        routes.add_service(health).add_service(reflection);
        let attached: Arc<OnceLock<Attached>> = Arc::new(OnceLock::new());
        // Each call runs in a span of its caller's trace and is counted;
        // `GET /metrics` answers Prometheus on the same port (HTTP/1.1).
        let router = routes
            .routes()
            .into_axum_router()
            .route("/metrics", axum::routing::get(crate::telemetry::metrics_endpoint))
            .fallback({
                let attached = Arc::clone(&attached);
                move |request: axum::extract::Request| dispatch(Arc::clone(&attached), request)
            })
            .layer(axum::middleware::from_fn_with_state(
                Arc::clone(&attached),
                check_on_probe,
            ))
            .layer(axum::middleware::from_fn(observe_call))
            .layer(axum::middleware::from_fn(bound_statuses));

        let config = config.clone();
        let incoming = TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(config.keepalive_interval));
        let stop_accepting = CancellationToken::new();
        let stop = stop_accepting.clone();
        let server = Server::builder()
            .accept_http1(true)
            .timeout(config.request_timeout)
            .http2_keepalive_interval(Some(config.keepalive_interval))
            .http2_keepalive_timeout(Some(config.keepalive_timeout))
            .add_routes(tonic::service::Routes::from(router))
            .serve_with_incoming_shutdown(incoming, async move { stop.cancelled().await });
        let port = Self {
            reporter: reporter.clone(),
            attached: Arc::clone(&attached),
        };
        let serving = async move {
            tokio::pin!(server);
            tokio::select! {
                result = &mut server => return result.map_err(GrpcError::from),
                () = shutdown.cancelled() => {}
            }
            let attached = attached.get();
            let probed = attached.and_then(|attached| attached.probed.as_ref());
            if let Some(probed) = probed {
                probed.draining.cancel();
            }
            // A probe's check under way finishes first: draining is the last word.
            let _probing = match probed {
                Some(probed) => Some(probed.state.lock().await),
                None => None,
            };
            let names = attached.map_or(&[READY][..], |attached| &attached.names[..]);
            set_all(&reporter, names, ServingStatus::NotServing).await;
            stop_accepting.cancel();
            match tokio::time::timeout(config.drain_timeout, server).await {
                Ok(result) => result.map_err(GrpcError::from),
                Err(_) => {
                    tracing::warn!(timeout = ?config.drain_timeout, "grpc drain timed out; closing remaining calls");
                    Ok(())
                }
            }
        };
        Ok((port, serving))
    }

    /// Serves `server`'s services from now on: their health names turn
    /// SERVING, and [`READY`] follows its readiness check (SERVING at once
    /// without one).
    pub async fn attach(self, server: GrpcServer) {
        let probed = server.readiness.map(|check| {
            Arc::new(Probed {
                check,
                reporter: self.reporter.clone(),
                draining: CancellationToken::new(),
                started: std::time::Instant::now(),
                state: tokio::sync::Mutex::new(ProbeState::default()),
            })
        });
        let ready_at_once = probed.is_none();
        let attached = Attached {
            router: server.routes.routes().into_axum_router(),
            names: server.names,
            probed,
        };
        for name in &attached.names {
            if *name != READY || ready_at_once {
                self.reporter.set_service_status(*name, ServingStatus::Serving).await;
            }
        }
        let _ = self.attached.set(attached);
    }
}

/// Hands a call to the component's services once attached; until then it is
/// UNAVAILABLE, which callers retry.
async fn dispatch(attached: Arc<OnceLock<Attached>>, request: axum::extract::Request) -> axum::response::Response {
    use tower::ServiceExt;
    match attached.get() {
        Some(attached) => match attached.router.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        None => {
            let status =
                crate::ApiError::unavailable("STARTING", "this component is starting; try again shortly").to_status();
            axum::response::IntoResponse::into_response(status.into_http::<axum::body::Body>())
        }
    }
}

/// Serves one call inside a span of its caller's trace and records
/// `avm_<component>_grpc_requests_total{method, code}`,
/// `avm_<component>_grpc_request_duration_seconds{method}` (to the response
/// headers) and `avm_<component>_grpc_in_flight`. Health, reflection and
/// `/metrics` go uncounted.
async fn observe_call(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use tracing::Instrument;
    let Some((component, method)) = avm_method(request.uri().path()).map(|(c, m)| (c.to_owned(), m.to_owned())) else {
        return next.run(request).await;
    };
    let trace = request
        .headers()
        .get(crate::trace::TRACEPARENT)
        .and_then(|value| value.to_str().ok())
        .and_then(crate::trace::TraceParent::parse)
        .unwrap_or_else(crate::trace::TraceParent::root);
    let call = CallMetrics::start(&component, method.into(), &trace);
    let span = call.span.clone();
    let response = next.run(request).instrument(span).await;
    // Errors come as trailers-only responses, with the status in the headers.
    let code = response
        .headers()
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<i32>().ok())
        .map_or(tonic::Code::Ok, tonic::Code::from);
    call.finish(code);
    response
}

/// Largest `grpc-message` header a response carries, in bytes once
/// percent-encoded, and largest `grpc-status-details-bin` (base64).
const MAX_STATUS_HEADER_BYTES: usize = 4 * crate::error::MAX_STATUS_MESSAGE_BYTES;

/// Bounds (and classifies, see [`bound_status_headers`]) the status of every response, in its headers (trailers-only
/// answers) and in its trailers, whoever made it: a peer's HTTP/2 client
/// refuses a header block over its limit (16 KiB in hyper) by ending the
/// whole connection, and with it every other call multiplexed on it (issue
/// 26 item 5). [`crate::ApiError::to_status`] already bounds what this
/// crate makes; this is the guarantee for everything else.
async fn bound_statuses(request: axum::extract::Request, next: axum::middleware::Next) -> axum::response::Response {
    use http_body_util::BodyExt;
    let response = next.run(request).await;
    let (mut parts, body) = response.into_parts();
    bound_status_headers(&mut parts.headers);
    let body = body.map_frame(|frame| match frame.into_trailers() {
        Ok(mut trailers) => {
            bound_status_headers(&mut trailers);
            http_body::Frame::trailers(trailers)
        }
        Err(frame) => frame,
    });
    axum::response::Response::from_parts(parts, axum::body::Body::new(body))
}

/// What prost says of a request it cannot decode; tonic answers it as
/// `INTERNAL`, but the fault is the caller's.
const UNDECODABLE: &str = "failed to decode Protobuf message";

/// Rewrites an oversized status in `headers` with its message cut and its
/// reason kept, and tonic's `INTERNAL` for an undecodable request as
/// `INVALID_ARGUMENT` (`INVALID_PROTOBUF`, issue 26 item 16); leaves any
/// other headers alone.
fn bound_status_headers(headers: &mut http::HeaderMap) {
    let oversized = ["grpc-message", "grpc-status-details-bin"].iter().any(|name| {
        headers
            .get(*name)
            .is_some_and(|value| value.len() > MAX_STATUS_HEADER_BYTES)
    });
    let internal = headers
        .get("grpc-status")
        .is_some_and(|value| value.as_bytes() == b"13");
    if !oversized && !internal {
        return;
    }
    let Some(status) = tonic::Status::from_header_map(headers) else {
        return;
    };
    let undecodable = status.code() == tonic::Code::Internal && status.message().starts_with(UNDECODABLE);
    if !oversized && !undecodable {
        return;
    }
    let (code, reason) = if undecodable {
        (tonic::Code::InvalidArgument, Some("INVALID_PROTOBUF".to_owned()))
    } else {
        let reason = tonic_types::StatusExt::get_details_error_info(&status).map(|info| info.reason);
        (status.code(), reason)
    };
    let bounded = crate::error::bounded_status(code, status.message(), reason.as_deref());
    headers.remove("grpc-message");
    headers.remove("grpc-status-details-bin");
    if bounded.add_header(headers).is_err() {
        // Cannot happen for a bounded status; an unreadable status is still better than a dead connection.
        headers.remove("grpc-message");
        headers.remove("grpc-status-details-bin");
    }
}

/// The span and metrics of one call, served over gRPC or made in process.
pub struct CallMetrics {
    span: tracing::Span,
    started: std::time::Instant,
    names: &'static MetricNames,
    method: Cow<'static, str>,
}

/// The metric names of one component, made once.
pub struct MetricNames {
    requests: String,
    duration: String,
    in_flight: String,
}

impl CallMetrics {
    /// Starts observing a call of `component`'s `method` in `trace`.
    pub fn start(component: &str, method: Cow<'static, str>, trace: &crate::trace::TraceParent) -> Self {
        let names = metric_names(component);
        let span = crate::telemetry::request_span("grpc", &format!("{component}.{method}"), trace);
        metrics::gauge!(names.in_flight.as_str()).increment(1.0);
        Self {
            span,
            started: std::time::Instant::now(),
            names,
            method,
        }
    }

    /// Records the call's end with its status code.
    pub fn finish(self, code: tonic::Code) {
        let names = self.names;
        metrics::gauge!(names.in_flight.as_str()).decrement(1.0);
        // A method nobody serves is not a label of its own (callers could make up any number).
        let method = if code == tonic::Code::Unimplemented {
            Cow::Borrowed("other")
        } else {
            self.method
        };
        let code = grpc_code_name(code);
        metrics::counter!(names.requests.as_str(), "method" => method.clone(), "code" => code).increment(1);
        metrics::histogram!(names.duration.as_str(), "method" => method).record(self.started.elapsed().as_secs_f64());
    }
}

/// Returns the metric names of a component (one of [`COMPONENTS`]).
fn metric_names(component: &str) -> &'static MetricNames {
    static NAMES: OnceLock<Vec<(&'static str, MetricNames)>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        COMPONENTS
            .iter()
            .map(|component| {
                (
                    *component,
                    MetricNames {
                        requests: format!("avm_{component}_grpc_requests_total"),
                        duration: format!("avm_{component}_grpc_request_duration_seconds"),
                        in_flight: format!("avm_{component}_grpc_in_flight"),
                    },
                )
            })
            .collect()
    });
    names
        .iter()
        .find(|(known, _)| *known == component)
        .or_else(|| names.first())
        .map(|(_, names)| names)
        .unwrap_or_else(|| unreachable!("COMPONENTS is not empty"))
}

/// Observes the calls components make to each other inside one process (see
/// `avm_proto::Observe`): the same span and metrics as the call would have
/// had over gRPC, so operators see one process as they see the mesh.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalCalls;

impl avm_proto::Observe for LocalCalls {
    type Call = CallMetrics;

    fn begin(
        &self,
        component: &'static str,
        method: &'static str,
        metadata: &tonic::metadata::MetadataMap,
    ) -> CallMetrics {
        let trace = crate::trace::TraceParent::from_metadata(metadata).unwrap_or_else(crate::trace::TraceParent::root);
        CallMetrics::start(component, Cow::Borrowed(method), &trace)
    }

    fn run<T: Send>(
        &self,
        call: CallMetrics,
        future: impl Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send,
    ) -> impl Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send {
        use tracing::Instrument;
        let span = call.span.clone();
        async move {
            let result = future.instrument(span).await;
            call.finish(result.as_ref().map_or_else(tonic::Status::code, |_| tonic::Code::Ok));
            result
        }
    }
}

/// The components whose calls are counted.
const COMPONENTS: [&str; 6] = ["auth", "session", "resource", "config", "observability", "runtime"];

/// Returns the component and method of an AgentVM call path
/// (`/avm.session.v1.SessionService/CreateImage` → `session`, `CreateImage`).
/// Paths of other components are not AgentVM calls here: a caller cannot
/// invent metric names.
fn avm_method(path: &str) -> Option<(&str, &str)> {
    let (service, method) = path.strip_prefix("/avm.")?.split_once('/')?;
    let component = service.split('.').next()?;
    COMPONENTS.contains(&component).then_some((component, method))
}

/// Returns a status code's name as Prometheus labels show it.
fn grpc_code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Ok => "OK",
        tonic::Code::Cancelled => "CANCELLED",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        tonic::Code::NotFound => "NOT_FOUND",
        tonic::Code::AlreadyExists => "ALREADY_EXISTS",
        tonic::Code::PermissionDenied => "PERMISSION_DENIED",
        tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        tonic::Code::FailedPrecondition => "FAILED_PRECONDITION",
        tonic::Code::Aborted => "ABORTED",
        tonic::Code::OutOfRange => "OUT_OF_RANGE",
        tonic::Code::Unimplemented => "UNIMPLEMENTED",
        tonic::Code::Internal => "INTERNAL",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::DataLoss => "DATA_LOSS",
        tonic::Code::Unauthenticated => "UNAUTHENTICATED",
        tonic::Code::Unknown => "UNKNOWN",
    }
}

/// A readiness check and what the last probe found.
struct Probed {
    check: Readiness,
    reporter: HealthReporter,
    draining: CancellationToken,
    started: std::time::Instant,
    state: tokio::sync::Mutex<ProbeState>,
}

#[derive(Default)]
struct ProbeState {
    ready: bool,
    warned: bool,
}

/// Runs the readiness check before a health call answers, and sets
/// [`READY`] from it (not once the server drains: then it stays
/// NOT_SERVING). A dependency failing after start ([`QUIET_START`]) or again
/// after being ready is logged once per spell.
async fn check_on_probe(
    axum::extract::State(attached): axum::extract::State<Arc<OnceLock<Attached>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let probed = match attached.get().and_then(|attached| attached.probed.as_ref()) {
        Some(probed) if request.uri().path().starts_with("/grpc.health.v1.Health/") => Arc::clone(probed),
        _ => return next.run(request).await,
    };
    {
        let failing = (probed.check)();
        let mut state = probed.state.lock().await;
        if probed.draining.is_cancelled() {
            drop(state);
            return next.run(request).await;
        }
        if failing.is_empty() {
            if !state.ready {
                tracing::info!("ready: every dependency answers and accepts this component");
                probed.reporter.set_service_status(READY, ServingStatus::Serving).await;
            }
            *state = ProbeState {
                ready: true,
                warned: false,
            };
        } else {
            if state.ready || (!state.warned && probed.started.elapsed() > QUIET_START) {
                for problem in &failing {
                    tracing::warn!(
                        dependency = problem.dependency,
                        reason = problem.reason,
                        "not ready: {}",
                        problem.message
                    );
                }
                state.warned = true;
            }
            if state.ready {
                probed
                    .reporter
                    .set_service_status(READY, ServingStatus::NotServing)
                    .await;
            }
            state.ready = false;
        }
    }
    next.run(request).await
}

async fn set_all(reporter: &HealthReporter, names: &[&'static str], status: ServingStatus) {
    reporter.set_service_status("", status).await;
    for name in names {
        reporter.set_service_status(*name, status).await;
    }
}

/// Returns a lazily connecting channel to a peer with the shared timeouts and keepalive.
pub fn channel(addr: &str, config: &GrpcConfig) -> Result<Channel, ApiError> {
    let endpoint = Endpoint::from_shared(addr.to_owned())
        .map_err(|_| ApiError::invalid("INVALID_PEER_ADDRESS", format!("invalid peer address {addr:?}")))?;
    Ok(endpoint
        .connect_timeout(config.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(config.keepalive_interval)
        .keep_alive_timeout(config.keepalive_timeout)
        .keep_alive_while_idle(true)
        .connect_lazy())
}

/// Returns one transport over several replicas of a peer: each call goes to
/// a replica picked at random among those not known to be down, and a call
/// that a replica could not take (no connection, or it went away before
/// answering) goes to the next one, so
/// callers keep working while any replica is alive. A replica that failed is
/// skipped for a second, unless every replica is down.
///
/// The request is kept until a replica answered, which the peers' unary
/// requests allow (no RPC here streams its request).
pub fn failover(replicas: &[(String, Channel)]) -> Result<avm_proto::Transport, ApiError> {
    if replicas.is_empty() {
        return Err(ApiError::invalid("INVALID_PEER_ADDRESS", "no peer address given"));
    }
    let replicas = replicas
        .iter()
        .map(|(addr, channel)| Replica {
            addr: addr.clone(),
            channel: channel.clone(),
            down_until_ms: std::sync::atomic::AtomicI64::new(0),
        })
        .collect::<Vec<_>>();
    Ok(avm_proto::Transport::new(Failover {
        replicas: replicas.into(),
    }))
}

/// Returns a channel (as [`channel`]) to each address of a comma-separated list.
pub fn channels(list: &str, config: &GrpcConfig) -> Result<Vec<(String, Channel)>, ApiError> {
    addresses(list)
        .into_iter()
        .map(|addr| Ok((addr.clone(), channel(&addr, config)?)))
        .collect()
}

/// Splits a comma-separated list of peer addresses.
pub fn addresses(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|addr| !addr.is_empty())
        .map(str::to_owned)
        .collect()
}

struct Replica {
    addr: String,
    channel: Channel,
    down_until_ms: std::sync::atomic::AtomicI64,
}

#[derive(Clone)]
struct Failover {
    replicas: std::sync::Arc<[Replica]>,
}

/// How long a replica that failed a call is passed over.
const REPLICA_DOWN_MS: i64 = 1000;

impl Failover {
    /// Returns the replicas to try, in order: from one picked at random,
    /// those known to be down last.
    fn order(&self) -> Vec<usize> {
        use std::sync::atomic::Ordering;
        let count = self.replicas.len();
        let start = rand::random_range(0..count);
        let now = crate::now_ms();
        let (mut up, down): (Vec<usize>, Vec<usize>) = (0..count)
            .map(|offset| (start + offset) % count)
            .partition(|&index| self.replicas[index].down_until_ms.load(Ordering::Relaxed) <= now);
        up.extend(down);
        up
    }

    async fn send(self, request: http::Request<Body>) -> Result<http::Response<Body>, avm_proto::TransportError> {
        use http_body_util::BodyExt;
        use std::sync::atomic::Ordering;
        use tower::ServiceExt;
        let (parts, body) = request.into_parts();
        let bytes = body
            .collect()
            .await
            .map_err(|err| avm_proto::TransportError(Box::new(err)))?
            .to_bytes();
        let mut last = None;
        for index in self.order() {
            let replica = &self.replicas[index];
            let mut request = http::Request::new(Body::new(http_body_util::Full::new(bytes.clone())));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            *request.extensions_mut() = parts.extensions.clone();
            match replica.channel.clone().oneshot(request).await {
                Ok(response) => {
                    replica.down_until_ms.store(0, Ordering::Relaxed);
                    return Ok(response);
                }
                Err(err) => {
                    let now = crate::now_ms();
                    let was_up = replica.down_until_ms.swap(now + REPLICA_DOWN_MS, Ordering::Relaxed) <= now;
                    if was_up {
                        tracing::warn!(peer = %replica.addr, error = %err, "a peer replica did not take a call; using the others");
                    }
                    last = Some(err);
                }
            }
        }
        Err(avm_proto::TransportError(
            last.map_or_else(|| "no peer replica".into(), |err| Box::new(err) as _),
        ))
    }
}

impl tower::Service<http::Request<Body>> for Failover {
    type Response = http::Response<Body>;
    type Error = avm_proto::TransportError;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        Box::pin(self.clone().send(request))
    }
}

#[cfg(test)]
mod tests {
    use super::avm_method;

    /// Issue 26 item 5: a status made anywhere, echoing a 17 kB id, leaves
    /// a server small enough for any peer, its code and reason kept.
    #[test]
    fn oversized_statuses_are_cut_before_they_leave() {
        let id = "x".repeat(17 * 1024);
        let details =
            tonic_types::ErrorDetails::with_error_info("AGENT_NOT_FOUND", "agentvm", std::collections::HashMap::new());
        let status = <tonic::Status as tonic_types::StatusExt>::with_error_details(
            tonic::Code::NotFound,
            format!("agent {id} not found"),
            details,
        );
        let mut headers = http::HeaderMap::new();
        assert!(status.add_header(&mut headers).is_ok());
        headers.insert("x-other", http::HeaderValue::from_static("kept"));
        super::bound_status_headers(&mut headers);
        let size: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum();
        assert!(size < 4 * 1024, "{size} bytes of headers");
        let back = tonic::Status::from_header_map(&headers).unwrap_or_else(|| tonic::Status::unknown("none"));
        assert_eq!(back.code(), tonic::Code::NotFound);
        assert!(back.message().starts_with("agent xxx"), "{}", back.message());
        assert_eq!(crate::ApiError::from_status(&back).reason, "AGENT_NOT_FOUND");
        assert_eq!(headers.get("x-other").map(|v| v.as_bytes()), Some(&b"kept"[..]));
    }

    /// Issue 26 item 16: a request prost cannot decode is the caller's
    /// fault: `INVALID_ARGUMENT`, not tonic's `INTERNAL`; other internal
    /// errors stay as they are.
    #[test]
    fn undecodable_requests_are_invalid_arguments() {
        let mut headers = http::HeaderMap::new();
        let status = tonic::Status::internal("failed to decode Protobuf message: invalid varint");
        assert!(status.add_header(&mut headers).is_ok());
        super::bound_status_headers(&mut headers);
        let back = tonic::Status::from_header_map(&headers).unwrap_or_else(|| tonic::Status::unknown("none"));
        assert_eq!(back.code(), tonic::Code::InvalidArgument);
        assert_eq!(crate::ApiError::from_status(&back).reason, "INVALID_PROTOBUF");

        let mut headers = http::HeaderMap::new();
        assert!(
            tonic::Status::internal("internal error")
                .add_header(&mut headers)
                .is_ok()
        );
        super::bound_status_headers(&mut headers);
        let back = tonic::Status::from_header_map(&headers).unwrap_or_else(|| tonic::Status::unknown("none"));
        assert_eq!(back.code(), tonic::Code::Internal);
    }

    /// Issue 28 item 5: a port answers health at once, not ready until its
    /// services attach; without a readiness check it is ready as they do,
    /// and a call before then is UNAVAILABLE (`STARTING`).
    #[tokio::test]
    async fn a_port_is_not_ready_until_its_services_attach() {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_client::HealthClient;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let config = crate::config::GrpcConfig::default();
        let stop = tokio_util::sync::CancellationToken::new();
        let (port, serving) = super::GrpcPort::open(listener, &config, stop.clone())
            .await
            .expect("open");
        let server = tokio::spawn(serving);
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut health = HealthClient::new(channel.clone());
        let status = |name: &str| HealthCheckRequest { service: name.into() };
        let ask = |answer: tonic::Response<tonic_health::pb::HealthCheckResponse>| answer.into_inner().status;
        let serving_now = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
        let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
        assert_eq!(ask(health.check(status("")).await.expect("live")), serving_now);
        assert_eq!(
            ask(health.check(status(super::READY)).await.expect("ready")),
            not_serving
        );
        let refused = avm_proto::resource::v1::resource_service_client::ResourceServiceClient::new(channel)
            .list_resources(avm_proto::resource::v1::ListResourcesRequest::default())
            .await
            .expect_err("nothing is served yet");
        assert_eq!(refused.code(), tonic::Code::Unavailable);
        assert_eq!(crate::ApiError::from_status(&refused).reason, "STARTING");

        port.attach(super::GrpcServer::new(&config)).await;
        assert_eq!(
            ask(health.check(status(super::READY)).await.expect("ready")),
            serving_now
        );
        stop.cancel();
        server.await.expect("joined").expect("served");

        // Served in one go (as `avm sandbox` is): ready once it answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(super::GrpcServer::new(&config).serve(listener, stop.clone()));
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        let mut health = HealthClient::new(channel);
        assert_eq!(
            ask(health.check(status(super::READY)).await.expect("ready")),
            serving_now
        );
        stop.cancel();
        server.await.expect("joined").expect("served");
    }

    #[test]
    fn only_agentvm_components_name_metrics() {
        assert_eq!(
            avm_method("/avm.session.v1.SessionService/CreateImage"),
            Some(("session", "CreateImage"))
        );
        assert_eq!(
            avm_method("/avm.observability.v1.ObservabilityService/RecordUsage"),
            Some(("observability", "RecordUsage"))
        );
        for made_up in [
            "/avm.x9_evil.v1.S/M",
            "/avm./M",
            "/grpc.health.v1.Health/Check",
            "/metrics",
        ] {
            assert_eq!(avm_method(made_up), None, "{made_up}");
        }
    }
}
