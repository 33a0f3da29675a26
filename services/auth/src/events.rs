//! Auth events (revocations, deletions, tenant updates, quota changes) and
//! their feed: an in-process broadcast that, on Postgres, every replica fills
//! from `LISTEN`, so each replica's watchers see each event exactly once.

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

use crate::error::AuthError;
use crate::record::QuotaState;
use crate::store::{AuthStore, EventFeed};

/// Events a slow watcher may fall behind by before its stream ends.
const FEED_CAPACITY: usize = 1024;

/// One thing verifiers must act on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthEvent {
    /// When it happened (Unix ms).
    pub at_ms: i64,
    /// What happened.
    pub kind: AuthEventKind,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthEventKind {
    /// Tokens made from this key, and the key itself, are refused.
    KeyRevoked(String),
    /// Tokens of this user are refused.
    UserDeleted(String),
    /// Tokens of this tenant are refused.
    TenantDeleted(String),
    /// The tenant's name or limits changed.
    TenantUpdated(String),
    /// The tenant (or key) used up its monthly tokens.
    QuotaExhausted(QuotaState),
    /// The tenant (or key) may use tokens again.
    QuotaRestored(QuotaState),
}

impl AuthEventKind {
    /// Returns the kind's name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            AuthEventKind::KeyRevoked(_) => "key_revoked",
            AuthEventKind::UserDeleted(_) => "user_deleted",
            AuthEventKind::TenantDeleted(_) => "tenant_deleted",
            AuthEventKind::TenantUpdated(_) => "tenant_updated",
            AuthEventKind::QuotaExhausted(_) => "quota_exhausted",
            AuthEventKind::QuotaRestored(_) => "quota_restored",
        }
    }
}

/// One message of `WatchAuthEvents`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchItem {
    /// An event, of the snapshot or live.
    Event(AuthEvent),
    /// Everything before was the snapshot; live events follow.
    SnapshotComplete,
}

#[derive(Clone, Debug)]
enum FeedItem {
    Event(Arc<AuthEvent>),
    /// Events may have been lost (the database connection dropped): watchers
    /// must reconnect and take a fresh snapshot.
    Interrupted,
}

/// The local feed of auth events.
pub(crate) struct EventBus {
    store: Arc<dyn AuthStore>,
    sender: broadcast::Sender<FeedItem>,
    /// Whether events published now will reach this replica's watchers.
    live: watch::Sender<bool>,
}

impl EventBus {
    /// Returns the feed of `store`'s events; in-process feeds are live at once,
    /// shared ones once `spawn_listener` listens.
    pub(crate) fn new(store: Arc<dyn AuthStore>) -> Self {
        let (sender, _) = broadcast::channel(FEED_CAPACITY);
        let (live, _) = watch::channel(!store.shares_events());
        Self { store, sender, live }
    }

    /// Sends an event to every watcher of every replica.
    ///
    /// On Postgres the event goes only through `NOTIFY`, which this replica's
    /// listener hears too; sending it locally as well would deliver it twice.
    /// A failed publish is logged, not returned: the change it reports is
    /// committed, and watchers that reconnect find it in their snapshot.
    pub(crate) async fn emit(&self, kind: AuthEventKind) {
        let event = AuthEvent {
            at_ms: avm_common::now_ms(),
            kind,
        };
        tracing::debug!(event = event.kind.name(), "auth event");
        if !self.store.shares_events() {
            // No receivers is not an error: nobody is watching yet.
            let _ = self.sender.send(FeedItem::Event(Arc::new(event)));
            return;
        }
        let published = match serde_json::to_string(&event) {
            Ok(payload) => self.store.publish_event(&payload).await,
            Err(err) => Err(AuthError::Corrupt(format!("cannot encode event: {err}"))),
        };
        if let Err(err) = published {
            tracing::error!(event = event.kind.name(), error = %err, "auth event not published");
        }
    }

    /// Waits until the feed is live, for at most `timeout`.
    pub(crate) async fn wait_live(&self, timeout: Duration) -> Result<(), AuthError> {
        let mut live = self.live.subscribe();
        match tokio::time::timeout(timeout, live.wait_for(|live| *live)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(AuthError::EventsUnavailable),
        }
    }

    /// Returns the live events from now on, ending with an error when the
    /// watcher lags or events may have been lost.
    pub(crate) fn subscribe(&self) -> impl Stream<Item = Result<WatchItem, AuthError>> + Send + 'static {
        futures::stream::unfold(Some(self.sender.subscribe()), |receiver| async move {
            let mut receiver = receiver?;
            match receiver.recv().await {
                Ok(FeedItem::Event(event)) => Some((Ok(WatchItem::Event((*event).clone())), Some(receiver))),
                Ok(FeedItem::Interrupted) | Err(broadcast::error::RecvError::Closed) => {
                    Some((Err(AuthError::EventsUnavailable), None))
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::warn!(missed, "auth event watcher lagged; ending its stream");
                    Some((Err(AuthError::EventsLagged), None))
                }
            }
        })
    }

    /// Listens for published events until `shutdown`, reconnecting with backoff.
    pub(crate) fn spawn_listener(self: Arc<Self>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let feed = tokio::select! {
                    () = shutdown.cancelled() => break,
                    feed = self.store.listen_events() => feed,
                };
                match feed {
                    Ok(Some(feed)) => {
                        backoff = Duration::from_millis(100);
                        let stopped = self.relay(feed, &shutdown).await;
                        if stopped {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(err) => tracing::warn!(error = %err, "cannot listen for auth events; retrying"),
                }
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            self.live.send_replace(false);
        })
    }

    /// Relays payloads to the local feed; returns true on shutdown, false when
    /// the feed broke and must be reopened.
    async fn relay(&self, mut feed: Box<dyn EventFeed>, shutdown: &CancellationToken) -> bool {
        self.live.send_replace(true);
        tracing::info!("listening for auth events");
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return true,
                next = feed.next() => next,
            };
            match next {
                Ok(Some(payload)) => match serde_json::from_str::<AuthEvent>(&payload) {
                    Ok(event) => {
                        let _ = self.sender.send(FeedItem::Event(Arc::new(event)));
                    }
                    Err(err) => tracing::warn!(error = %err, "unreadable auth event skipped"),
                },
                // Reconnected: whatever was published meanwhile is lost, so
                // watchers start over from a snapshot.
                Ok(None) => {
                    tracing::warn!("auth event listener reconnected; watchers must resync");
                    let _ = self.sender.send(FeedItem::Interrupted);
                }
                Err(err) => {
                    tracing::warn!(error = %err, "auth event listener failed");
                    self.live.send_replace(false);
                    let _ = self.sender.send(FeedItem::Interrupted);
                    return false;
                }
            }
        }
    }
}
