//! What every connection of a user hears besides its subscriptions: the
//! containers and conversations made, renamed and deleted by that user or in
//! their containers (`container_created`, `image_created`, `image_updated`,
//! `image_deleted`, `session_destroyed`), so a second device keeps its
//! conversation list without asking.
//!
//! One watch of the session service (`WatchUserEvents`) per user this
//! gateway serves, opened with the first connection's credential and shared
//! by all of that user's connections; it ends with the last of them. A
//! change made while the watch reconnects (the session service restarting)
//! is not replayed: a list fetched then is current again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use avm_common::RequestContext;
use avm_common::event::{Event, data};
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::SessionServiceHandle;
use futures::StreamExt;
use serde_json::json;
use tokio::sync::broadcast;

use crate::frames::notification_frame;

/// Frames one user's feed holds for a connection that falls behind.
const FEED_QUEUE: usize = 32;
/// The longest wait before the watch is opened again.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// The feeds of the users this gateway serves, by tenant and user.
#[derive(Default)]
pub struct UserFeeds {
    feeds: Mutex<HashMap<(String, String), Weak<UserFeed>>>,
}

/// One frame of a user's feed, with the id of the request that made its change.
pub struct FeedFrame {
    pub origin: String,
    pub frame: String,
}

/// One user's feed; the watch stops when the last holder drops it.
pub struct UserFeed {
    sender: broadcast::Sender<Arc<FeedFrame>>,
    /// Whether the watch is live: every change from now on reaches the feed.
    live: tokio::sync::watch::Receiver<bool>,
    task: tokio::task::AbortHandle,
}

impl Drop for UserFeed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl UserFeed {
    /// Returns a receiver of the feed's frames from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<FeedFrame>> {
        self.sender.subscribe()
    }

    /// Waits until the watch is live, at most `limit`: a connection then
    /// hears every change made after it was answered.
    pub async fn wait_live(&self, limit: Duration) {
        let mut live = self.live.clone();
        let _ = tokio::time::timeout(limit, live.wait_for(|live| *live)).await;
    }
}

impl UserFeeds {
    /// Returns the feed of the caller of `ctx`, starting its watch when the
    /// user has none on this gateway yet.
    pub fn join(&self, session: &SessionServiceHandle, ctx: &RequestContext) -> Arc<UserFeed> {
        let key = (ctx.tenant_id.clone(), ctx.principal.user_id.clone());
        let mut feeds = self.feeds.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(feed) = feeds.get(&key).and_then(Weak::upgrade) {
            return feed;
        }
        // Forget the users who left since, before adding one.
        feeds.retain(|_, feed| feed.strong_count() > 0);
        let (sender, _) = broadcast::channel(FEED_QUEUE);
        let (set_live, live) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(follow(Arc::clone(session), ctx.clone(), sender.clone(), set_live)).abort_handle();
        let feed = Arc::new(UserFeed { sender, live, task });
        feeds.insert(key, Arc::downgrade(&feed));
        feed
    }

    /// How many users have a feed open.
    pub fn len(&self) -> usize {
        let feeds = self.feeds.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        feeds.values().filter(|feed| feed.strong_count() > 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Follows the user's changes into `sender`, opening the watch again when it
/// ends (waiting longer each time, up to [`MAX_RETRY`]) unless the credential
/// is refused.
async fn follow(
    session: SessionServiceHandle,
    ctx: RequestContext,
    sender: broadcast::Sender<Arc<FeedFrame>>,
    live: tokio::sync::watch::Sender<bool>,
) {
    let mut retry = Duration::from_millis(100);
    loop {
        match session
            .watch_user_events(ctx.request(pb::WatchUserEventsRequest {}))
            .await
        {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                while let Some(item) = stream.next().await {
                    let Ok(item) = item else { break };
                    if item.live {
                        retry = Duration::from_millis(100);
                        live.send_replace(true);
                    }
                    let origin = item.origin_request_id.clone();
                    for frame in frames(item) {
                        let frame = FeedFrame {
                            origin: origin.clone(),
                            frame,
                        };
                        // None listening right now is fine: the feed ends with its last holder.
                        let _ = sender.send(Arc::new(frame));
                    }
                }
            }
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
                ) =>
            {
                tracing::info!(code = ?status.code(), "a user's change feed was refused; it stops");
                // Nobody waits on a feed that will not come.
                live.send_replace(true);
                return;
            }
            Err(status) => tracing::debug!(code = ?status.code(), "a user's change feed is away"),
        }
        live.send_replace(false);
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(MAX_RETRY);
    }
}

/// Returns the frames of one change: each event with its `context`.
fn frames(item: pb::WatchUserEventsResponse) -> Vec<String> {
    use pb::watch_user_events_response::Change;
    let record = |image: &pb::ImageSummary| {
        json!({
            "imageId": image.image_id,
            "containerId": image.container_id,
            "sessionId": image.session_id,
            "name": image.name,
            "createdAt": image.created_at_ms,
            "updatedAt": image.updated_at_ms,
        })
    };
    let of_image = |image: &pb::ImageSummary| json!({"containerId": image.container_id, "imageId": image.image_id, "sessionId": image.session_id});
    match item.change {
        None => Vec::new(),
        Some(Change::ContainerCreated(container)) => {
            let context = json!({"containerId": container.container_id});
            let event = Event::from(data::ContainerCreated {
                container_id: container.container_id,
                created_at: container.created_at_ms,
            });
            vec![notification_frame(&event, context)]
        }
        Some(Change::ImageCreated(image)) => {
            let event = Event::from(data::ImageCreated { record: record(&image) });
            vec![notification_frame(&event, of_image(&image))]
        }
        Some(Change::ImageUpdated(image)) => {
            let event = Event::from(data::ImageUpdated { record: record(&image) });
            vec![notification_frame(&event, of_image(&image))]
        }
        Some(Change::ImageDeleted(image)) => {
            let context =
                json!({"containerId": image.container_id, "imageId": image.image_id, "sessionId": image.session_id});
            let deleted = Event::from(data::ImageDeleted {
                image_id: image.image_id,
                container_id: image.container_id,
                session_id: image.session_id,
            });
            let destroyed = Event::from(data::SessionDestroyed {});
            vec![
                notification_frame(&deleted, context.clone()),
                notification_frame(&destroyed, context),
            ]
        }
    }
}
