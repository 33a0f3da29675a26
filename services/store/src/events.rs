//! A service's change events and their feed: an in-process broadcast that, on
//! Postgres, every replica fills from `LISTEN`, so each replica's watchers see
//! each event exactly once, whichever replica made the change.

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// Events a slow watcher may fall behind by before its stream ends.
const FEED_CAPACITY: usize = 1024;

/// How events travel between the replicas of a service.
#[derive(Clone, Debug)]
pub enum EventTransport {
    /// One process owns the data (SQLite): events stay in process.
    InProcess,
    /// Every replica on the database hears every event by `NOTIFY` / `LISTEN`.
    Postgres { pool: PgPool, channel: String },
}

impl EventTransport {
    /// Returns the transport of a Postgres pool: the notification channel
    /// `base`, made distinct per schema.
    ///
    /// Notification channels are per database, not per schema, so
    /// deployments (and tests) sharing a database in separate schemas would
    /// hear each other; any schema but `public` gets its own channel, hashed
    /// to stay within Postgres's 63-byte identifiers.
    pub async fn postgres(pool: &PgPool, base: &str) -> Result<Self, sqlx::Error> {
        let schema: Option<String> = sqlx::query_scalar("SELECT current_schema()").fetch_one(pool).await?;
        let channel = match schema.as_deref() {
            None | Some("public") => base.to_owned(),
            Some(schema) => {
                let digest = Sha256::digest(schema.as_bytes());
                let suffix: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
                format!("{base}_{suffix}")
            }
        };
        Ok(EventTransport::Postgres {
            pool: pool.clone(),
            channel,
        })
    }

    /// Returns whether events travel through the database.
    pub fn shares_events(&self) -> bool {
        matches!(self, EventTransport::Postgres { .. })
    }
}

/// Why a watcher's stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedError {
    /// The watcher fell too far behind; it must start over from a snapshot.
    Lagged,
    /// Events may have been lost (the feed is not live, or its database
    /// connection dropped); the watcher must start over from a snapshot.
    Unavailable,
}

#[derive(Clone, Debug)]
enum FeedItem<T> {
    Event(Arc<T>),
    Interrupted,
}

/// The local feed of one service's events of type `T`.
pub struct EventBus<T> {
    /// Names the service in logs (`auth`, `config`).
    name: &'static str,
    transport: EventTransport,
    sender: broadcast::Sender<FeedItem<T>>,
    /// Whether events published now will reach this replica's watchers.
    live: watch::Sender<bool>,
}

impl<T> EventBus<T>
where
    T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static,
{
    /// Returns the feed of a service; in-process feeds are live at once,
    /// shared ones once [`EventBus::spawn_listener`] listens.
    pub fn new(name: &'static str, transport: EventTransport) -> Self {
        let (sender, _) = broadcast::channel(FEED_CAPACITY);
        let (live, _) = watch::channel(!transport.shares_events());
        Self {
            name,
            transport,
            sender,
            live,
        }
    }

    /// Returns whether events travel between replicas (through the database).
    pub fn shares_events(&self) -> bool {
        self.transport.shares_events()
    }

    /// Sends an event to every watcher of every replica.
    ///
    /// On Postgres the event goes only through `NOTIFY`, which this replica's
    /// listener hears too; sending it locally as well would deliver it twice.
    /// A failed publish is logged, not returned: the change it reports is
    /// committed, and watchers that reconnect find it in their snapshot.
    pub async fn emit(&self, event: T) {
        let EventTransport::Postgres { pool, channel } = &self.transport else {
            // No receivers is not an error: nobody is watching yet.
            let _ = self.sender.send(FeedItem::Event(Arc::new(event)));
            return;
        };
        let published = match serde_json::to_string(&event) {
            Ok(payload) => sqlx::query("SELECT pg_notify($1, $2)")
                .bind(channel)
                .bind(payload)
                .execute(pool)
                .await
                .map(|_| ())
                .map_err(|err| err.to_string()),
            Err(err) => Err(format!("cannot encode event: {err}")),
        };
        if let Err(error) = published {
            tracing::error!(service = self.name, %error, "event not published");
        }
    }

    /// Waits until the feed is live, for at most `timeout`.
    pub async fn wait_live(&self, timeout: Duration) -> Result<(), FeedError> {
        let mut live = self.live.subscribe();
        match tokio::time::timeout(timeout, live.wait_for(|live| *live)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(FeedError::Unavailable),
        }
    }

    /// Returns the live events from now on, ending with an error when the
    /// watcher lags or events may have been lost.
    pub fn subscribe(&self) -> impl Stream<Item = Result<T, FeedError>> + Send + 'static {
        let name = self.name;
        futures::stream::unfold(Some(self.sender.subscribe()), move |receiver| async move {
            let mut receiver = receiver?;
            match receiver.recv().await {
                Ok(FeedItem::Event(event)) => Some((Ok((*event).clone()), Some(receiver))),
                Ok(FeedItem::Interrupted) | Err(broadcast::error::RecvError::Closed) => {
                    Some((Err(FeedError::Unavailable), None))
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::warn!(service = name, missed, "event watcher lagged; ending its stream");
                    Some((Err(FeedError::Lagged), None))
                }
            }
        })
    }

    /// Follows every replica's events (Postgres `LISTEN`) until `shutdown`,
    /// reconnecting with backoff; a finished task when events stay in process.
    pub fn spawn_listener(self: Arc<Self>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let EventTransport::Postgres { pool, channel } = self.transport.clone() else {
                return;
            };
            let mut backoff = avm_common::backoff::Backoff::default();
            loop {
                let listener = tokio::select! {
                    () = shutdown.cancelled() => break,
                    listener = listen(&pool, &channel) => listener,
                };
                match listener {
                    Ok(listener) => {
                        backoff.reset();
                        if self.relay(listener, &shutdown).await {
                            break;
                        }
                    }
                    Err(error) => tracing::warn!(service = self.name, %error, "cannot listen for events; retrying"),
                }
                if !backoff.wait(&shutdown).await {
                    break;
                }
            }
            self.live.send_replace(false);
        })
    }

    /// Relays notifications to the local feed; returns true on shutdown,
    /// false when the listener broke and must be reopened.
    async fn relay(&self, mut listener: PgListener, shutdown: &CancellationToken) -> bool {
        self.live.send_replace(true);
        tracing::info!(service = self.name, "listening for events");
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return true,
                // `try_recv` says `None` when the connection dropped (and
                // reconnects), which is exactly when notifications may be lost.
                next = listener.try_recv() => next,
            };
            match next {
                Ok(Some(notification)) => match serde_json::from_str::<T>(notification.payload()) {
                    Ok(event) => {
                        let _ = self.sender.send(FeedItem::Event(Arc::new(event)));
                    }
                    Err(error) => tracing::warn!(service = self.name, %error, "unreadable event skipped"),
                },
                Ok(None) => {
                    tracing::warn!(service = self.name, "event listener reconnected; watchers must resync");
                    let _ = self.sender.send(FeedItem::Interrupted);
                }
                Err(error) => {
                    tracing::warn!(service = self.name, %error, "event listener failed");
                    self.live.send_replace(false);
                    let _ = self.sender.send(FeedItem::Interrupted);
                    return false;
                }
            }
        }
    }
}

async fn listen(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}
