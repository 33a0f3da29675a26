//! Who is calling a gRPC service, checked once per call before the service
//! sees it: [`Authenticated`] wraps a generated server, verifies the bearer
//! token and puts the caller (or why it was refused) in the request's
//! extensions; a handler asks with [`caller`].
//!
//! Calls made inside one process (`avm_proto::<Service>Local`) never pass
//! here: their request already carries the caller's context, put there by
//! [`RequestContext::request`]. Extensions never cross the network, so a
//! remote caller cannot bring one of its own.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::server::NamedService;

use super::{TokenVerifier, missing_credentials};
use crate::ApiError;
use crate::context::RequestContext;

/// Why a call's credential was refused, kept for the handler to answer with.
#[derive(Clone, Debug)]
struct Refused(ApiError);

/// A gRPC service whose calls are authenticated before they reach it.
#[derive(Clone)]
pub struct Authenticated<S> {
    inner: S,
    verifier: TokenVerifier,
}

impl<S> Authenticated<S> {
    /// Wraps `inner`, verifying callers with `verifier`.
    pub fn new(inner: S, verifier: TokenVerifier) -> Self {
        Self { inner, verifier }
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<Body>> for Authenticated<S>
where
    S: tower::Service<http::Request<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        // The service that was made ready serves this call; a fresh clone waits for the next.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let verifier = self.verifier.clone();
        Box::pin(async move {
            // A call without a credential may still be one that needs none
            // (exchanging a key, the key set): the handler decides.
            match verifier.context_of(request.headers()).await {
                Ok(ctx) => {
                    request.extensions_mut().insert(ctx);
                }
                Err(err) => {
                    request.extensions_mut().insert(Refused(err));
                }
            }
            inner.call(request).await
        })
    }
}

/// Returns the verified caller of a gRPC request, or why there is none.
pub fn caller<T>(request: &tonic::Request<T>) -> Result<RequestContext, ApiError> {
    if let Some(ctx) = request.extensions().get::<RequestContext>() {
        return Ok(ctx.clone());
    }
    match request.extensions().get::<Refused>() {
        Some(Refused(err)) => Err(err.clone()),
        None => Err(missing_credentials()),
    }
}
