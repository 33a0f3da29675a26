//! Per-session event hubs: every event of a session gets the next cursor, is
//! kept in a bounded window of recent events for resuming subscribers, and is
//! offered to each live subscriber's bounded queue. With several replicas,
//! hubs also send their events to, and take the others' from, the fan-out
//! (`replicas::fanout`).

mod queue;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use avm_common::event::{Event, EventKind};
use tokio::sync::{OnceCell, oneshot};

pub use self::queue::{LiveEvents, QueueLimits};
use self::queue::{Offered, QueueSender};
use crate::event::{Detail, EventContext, SessionEvent};
use crate::replicas::{Fanout, Followers};

/// The receiving end of a subscription.
pub struct Subscription {
    /// Retained events after the requested cursor, oldest first.
    pub replay: Vec<Arc<SessionEvent>>,
    /// Live events after the replay; when the subscriber falls behind, its
    /// text deltas merge (see [`QueueLimits`]).
    pub live: LiveEvents,
    /// The cursor of the latest event when it subscribed: where a follower
    /// that saw nothing yet resumes.
    pub start: u64,
}

struct Subscriber {
    queue: QueueSender,
}

struct HubState {
    /// The cursor of the latest event (published here or taken from another replica).
    next_cursor: u64,
    /// The cursor of the latest event taken from each other replica. A
    /// group's hub has several writers (each runtime running one of its
    /// agents), whose cursors interleave: an event is new when it is past
    /// the last one of its own replica, not past every event seen.
    taken: HashMap<String, u64>,
    recent: VecDeque<Arc<SessionEvent>>,
    subscribers: Vec<Subscriber>,
}

/// The event stream of one session.
pub struct SessionHub {
    state: Mutex<HubState>,
    retention: usize,
    queue_limits: QueueLimits,
    /// The lowest cursor this hub publishes: the time it was made, in
    /// microseconds, so cursors keep rising across hub restarts (a hub is
    /// rebuilt after idling or a process restart).
    floor: u64,
    /// Where its events go for other replicas, when there are any.
    fanout: Option<Fanout>,
    /// Set once the hub follows its session's events on the fan-out and
    /// holds those retained there.
    ready: OnceCell<()>,
    /// The fan-out's confirmation that it follows the session.
    following: Mutex<Option<oneshot::Receiver<()>>>,
    /// How many [`OpenHub`]s hold it: an agent's hub is kept while the
    /// agent lives, and one being opened for a subscriber until it subscribed.
    holders: AtomicUsize,
}

impl SessionHub {
    fn new(retention: usize, queue_limits: QueueLimits, fanout: Option<Fanout>) -> Self {
        let floor = u64::try_from(avm_common::now_ms()).unwrap_or(0).saturating_mul(1000);
        Self {
            state: Mutex::new(HubState {
                // With replicas, a new hub takes the cursors of the events
                // other replicas published (all above what it starts with).
                next_cursor: if fanout.is_some() { 0 } else { floor },
                taken: HashMap::new(),
                recent: VecDeque::new(),
                subscribers: Vec::new(),
            }),
            retention: retention.max(1),
            queue_limits,
            floor,
            fanout,
            ready: OnceCell::new(),
            following: Mutex::new(None),
            holders: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A poisoned lock only means a panic elsewhere; the state itself stays consistent.
        self.state.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Publishes an event to the retained window and every subscriber.
    pub fn publish(&self, context: &Arc<EventContext>, event: impl Into<Event>) -> Arc<SessionEvent> {
        let event = event.into();
        self.publish_json(event.kind(), context, event.data_json(), Detail::of(&event))
    }

    /// Publishes another hub's event again, under `context`.
    pub fn republish(&self, context: &Arc<EventContext>, event: &SessionEvent) -> Arc<SessionEvent> {
        self.publish_json(event.kind, context, event.data_json.clone(), event.detail.clone())
    }

    /// Publishes an event whose data is already serialized.
    fn publish_json(
        &self,
        kind: EventKind,
        context: &Arc<EventContext>,
        mut data_json: String,
        detail: Option<Box<Detail>>,
    ) -> Arc<SessionEvent> {
        // Kept for the retention period: without the slack of its growth.
        data_json.shrink_to_fit();
        let mut state = self.lock();
        state.next_cursor = (state.next_cursor + 1).max(self.floor);
        let event = Arc::new(SessionEvent {
            kind,
            cursor: state.next_cursor,
            timestamp_ms: avm_common::now_ms(),
            context: Arc::clone(context),
            data_json,
            detail,
        });
        self.deliver(&mut state, &event);
        // Still locked: the session's events leave in cursor order.
        if let Some(fanout) = &self.fanout {
            fanout.publish(&event);
        }
        event
    }

    /// Takes an event the replica `origin` published, unless this hub has it.
    pub fn inject(&self, origin: &str, event: Arc<SessionEvent>) {
        let mut state = self.lock();
        match state.taken.get_mut(origin) {
            Some(last) if event.cursor <= *last => return,
            Some(last) => *last = event.cursor,
            None => {
                state.taken.insert(origin.to_owned(), event.cursor);
            }
        }
        // What this hub publishes next comes after everything it has seen.
        state.next_cursor = state.next_cursor.max(event.cursor);
        self.deliver(&mut state, &event);
    }

    /// Adds retained events (from the fan-out, oldest first, each with the
    /// replica that published it) to the window, in cursor order, without
    /// offering them to subscribers.
    pub fn seed(&self, events: Vec<(String, SessionEvent)>) {
        if events.is_empty() {
            return;
        }
        let mut state = self.lock();
        for (origin, event) in &events {
            let last = state.taken.entry(origin.clone()).or_default();
            *last = (*last).max(event.cursor);
        }
        let mut merged: Vec<Arc<SessionEvent>> = state.recent.drain(..).collect();
        merged.extend(events.into_iter().map(|(_, event)| Arc::new(event)));
        merged.sort_by_key(|event| event.cursor);
        merged.dedup_by_key(|event| event.cursor);
        let skip = merged.len().saturating_sub(self.retention);
        state.recent = merged.into_iter().skip(skip).collect();
        let newest = state.recent.back().map_or(0, |event| event.cursor);
        state.next_cursor = state.next_cursor.max(newest);
    }

    /// Keeps an event in the window and offers it to every subscriber.
    fn deliver(&self, state: &mut HubState, event: &Arc<SessionEvent>) {
        if state.recent.len() == self.retention {
            state.recent.pop_front();
        }
        state.recent.push_back(Arc::clone(event));
        state
            .subscribers
            .retain(|subscriber| match subscriber.queue.offer(event) {
                Offered::Kept => true,
                Offered::Cut => {
                    tracing::warn!(
                        session_id = %event.context.session_id,
                        "subscriber stopped reading; cut off"
                    );
                    false
                }
                Offered::Gone => false,
            });
    }

    /// Subscribes, replaying retained events after `after` (when given).
    pub fn subscribe(&self, after: Option<u64>) -> Subscription {
        let (queue, live) = queue::queue(self.queue_limits);
        let mut state = self.lock();
        state.subscribers.retain(|subscriber| !subscriber.queue.is_closed());
        let replay = match after {
            Some(cursor) => state
                .recent
                .iter()
                .filter(|event| event.cursor > cursor)
                .cloned()
                .collect(),
            None => Vec::new(),
        };
        state.subscribers.push(Subscriber { queue });
        Subscription {
            replay,
            live,
            start: state.next_cursor,
        }
    }

    /// Returns the cursor of the latest event (or the starting point when none).
    pub fn last_cursor(&self) -> u64 {
        self.lock().next_cursor
    }

    /// Drops retained events older than `cutoff_ms` and releases their
    /// memory, and the queues of subscribers that went away.
    fn trim(&self, cutoff_ms: i64) {
        let mut state = self.lock();
        state.subscribers.retain(|subscriber| !subscriber.queue.is_closed());
        let stale = state
            .recent
            .iter()
            .take_while(|event| event.timestamp_ms < cutoff_ms)
            .count();
        if stale > 0 {
            state.recent.drain(..stale);
            state.recent.shrink_to_fit();
        }
    }

    /// Returns how many events are retained.
    pub fn retained(&self) -> usize {
        self.lock().recent.len()
    }

    /// Returns whether any subscriber is still listening.
    fn has_subscribers(&self) -> bool {
        let mut state = self.lock();
        state.subscribers.retain(|subscriber| !subscriber.queue.is_closed());
        !state.subscribers.is_empty()
    }
}

/// A hub its runtime keeps while this is held (see [`Hubs::open`]).
pub struct OpenHub(Arc<SessionHub>);

impl std::ops::Deref for OpenHub {
    type Target = SessionHub;

    fn deref(&self) -> &SessionHub {
        &self.0
    }
}

impl Drop for OpenHub {
    fn drop(&mut self) {
        self.0.holders.fetch_sub(1, Ordering::AcqRel);
    }
}

/// All hubs of this runtime, by session id.
pub struct Hubs {
    hubs: Mutex<HashMap<String, Arc<SessionHub>>>,
    retention: usize,
    queue_limits: QueueLimits,
    fanout: Option<Fanout>,
}

impl Hubs {
    /// Returns an empty set of hubs; with a fan-out, they share their
    /// sessions' events with other replicas.
    pub fn new(retention: usize, queue_limits: QueueLimits, fanout: Option<Fanout>) -> Self {
        Self {
            hubs: Mutex::new(HashMap::new()),
            retention,
            queue_limits,
            fanout,
        }
    }

    /// Returns the hub of a session, if there is one.
    pub fn get(&self, session_id: &str) -> Option<Arc<SessionHub>> {
        self.lock().get(session_id).cloned()
    }

    /// Returns the hub of a session, creating it when needed; with a fan-out,
    /// once it follows the session there and holds the events retained there.
    /// The hub stays among this runtime's hubs while the answer is held.
    pub async fn open(&self, session_id: &str) -> OpenHub {
        let hub = {
            let mut hubs = self.lock();
            let hub = self.entry(&mut hubs, session_id);
            // Counted under the lock `prune` takes: it sees the holder.
            hub.holders.fetch_add(1, Ordering::AcqRel);
            OpenHub(hub)
        };
        if let Some(fanout) = &self.fanout {
            hub.ready
                .get_or_init(|| async {
                    let following = hub.following.lock().unwrap_or_else(|p| p.into_inner()).take();
                    if let Some(following) = following {
                        let _ = following.await;
                    }
                    hub.seed(fanout.history(session_id).await);
                })
                .await;
        }
        hub
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<SessionHub>>> {
        self.hubs.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Returns the hub of a session, creating it when needed.
    pub fn get_or_create(&self, session_id: &str) -> Arc<SessionHub> {
        self.entry(&mut self.lock(), session_id)
    }

    /// Returns the hub of a session from the locked map, creating it when needed.
    fn entry(&self, hubs: &mut HashMap<String, Arc<SessionHub>>, session_id: &str) -> Arc<SessionHub> {
        if let Some(hub) = hubs.get(session_id) {
            return Arc::clone(hub);
        }
        let hub = Arc::new(SessionHub::new(self.retention, self.queue_limits, self.fanout.clone()));
        if let Some(fanout) = &self.fanout {
            // Sent under the lock: follows and unfollows stay in order.
            *hub.following.lock().unwrap_or_else(|p| p.into_inner()) = Some(fanout.follow(session_id));
        }
        hubs.insert(session_id.to_owned(), Arc::clone(&hub));
        hub
    }

    /// Drops the hubs nobody listens to or holds (an agent holds its
    /// session's hub).
    pub fn prune(&self) {
        self.lock().retain(|session_id, hub| {
            let keep = hub.holders.load(Ordering::Acquire) > 0 || hub.has_subscribers();
            if !keep && let Some(fanout) = &self.fanout {
                fanout.unfollow(session_id);
            }
            keep
        });
    }

    /// Drops every hub's retained events older than `cutoff_ms`.
    pub fn trim(&self, cutoff_ms: i64) {
        let hubs: Vec<Arc<SessionHub>> = self.lock().values().cloned().collect();
        for hub in hubs {
            hub.trim(cutoff_ms);
        }
    }

    /// Returns how many hubs exist.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Returns whether there are no hubs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Followers for Hubs {
    fn seed(&self, session_id: &str, events: Vec<(String, SessionEvent)>) {
        if let Some(hub) = self.get(session_id) {
            hub.seed(events);
        }
    }

    fn inject(&self, origin: &str, event: SessionEvent) {
        if let Some(hub) = self.get(&event.context.session_id) {
            hub.inject(origin, Arc::new(event));
        }
    }
}

#[cfg(test)]
mod tests {
    use avm_common::event::data;
    use serde_json::{Value, json};

    use super::*;

    fn delta(text: &str) -> data::TextDelta {
        data::TextDelta { text: text.to_owned() }
    }

    fn limits(capacity: usize) -> QueueLimits {
        QueueLimits {
            capacity,
            stall_timeout: std::time::Duration::from_secs(60),
        }
    }

    fn context() -> Arc<EventContext> {
        Arc::new(EventContext {
            session_id: "sess_1".into(),
            ..EventContext::default()
        })
    }

    #[test]
    fn cursors_rise_and_resume_replays_what_was_missed() {
        let hub = SessionHub::new(8, limits(8), None);
        let ctx = context();
        let first = hub.publish(&ctx, delta("a"));
        let second = hub.publish(&ctx, delta("b"));
        assert!(second.cursor > first.cursor);
        let sub = hub.subscribe(Some(first.cursor));
        assert_eq!(sub.replay.len(), 1);
        assert_eq!(sub.replay[0].data_json, r#"{"text":"b"}"#);
    }

    fn event(cursor: u64, text: &str) -> SessionEvent {
        SessionEvent {
            kind: EventKind::TextDelta,
            cursor,
            timestamp_ms: 0,
            context: context(),
            data_json: json!({"text": text}).to_string(),
            detail: None,
        }
    }

    #[test]
    fn events_of_two_writers_interleave_and_each_arrives_once() {
        // A group's hub: two runtimes publish into it, their cursors crossing.
        let hub = SessionHub::new(16, limits(16), None);
        hub.seed(vec![("rt_a".to_owned(), event(10, "seeded"))]);
        let mut sub = hub.subscribe(None);
        hub.inject("rt_a", Arc::new(event(10, "seeded again")));
        hub.inject("rt_a", Arc::new(event(12, "a1")));
        hub.inject("rt_b", Arc::new(event(11, "b1")));
        hub.inject("rt_b", Arc::new(event(11, "b1 again")));
        hub.inject("rt_a", Arc::new(event(13, "a2")));
        let mut seen = Vec::new();
        while let Some(event) = sub.live.try_recv() {
            seen.push(event.data_json.clone());
        }
        let texts: Vec<String> = ["a1", "b1", "a2"]
            .iter()
            .map(|t| json!({"text": t}).to_string())
            .collect();
        assert_eq!(seen, texts);
        // What it publishes itself comes after all it has seen.
        assert!(hub.publish(&context(), delta("")).cursor > 13);
    }

    #[test]
    fn retention_is_bounded() {
        let hub = SessionHub::new(3, limits(8), None);
        let ctx = context();
        for i in 0..10 {
            hub.publish(&ctx, delta(&i.to_string()));
        }
        let sub = hub.subscribe(Some(0));
        assert_eq!(sub.replay.len(), 3);
    }

    #[test]
    fn old_events_are_trimmed() {
        let hub = SessionHub::new(8, limits(8), None);
        let ctx = context();
        let event = hub.publish(&ctx, delta(""));
        hub.trim(event.timestamp_ms);
        assert_eq!(hub.retained(), 1, "events at the cutoff stay");
        hub.trim(event.timestamp_ms + 1);
        assert_eq!(hub.retained(), 0);
        let later = hub.publish(&ctx, delta(""));
        assert!(later.cursor > event.cursor, "cursors keep rising after a trim");
    }

    #[test]
    fn a_finished_subscriber_is_let_go_without_another_event() {
        let hub = SessionHub::new(8, limits(8), None);
        let kept = hub.subscribe(None);
        drop(hub.subscribe(None));
        hub.trim(0);
        assert_eq!(hub.lock().subscribers.len(), 1, "its queue went with it");
        drop(kept);
        assert!(!hub.has_subscribers());
    }

    #[tokio::test]
    async fn a_hub_is_kept_while_held_and_then_while_subscribed() {
        let hubs = Hubs::new(8, limits(8), None);
        // Opened for a subscriber; the reaper passes before it subscribes.
        let opened = hubs.open("sess_1").await;
        hubs.prune();
        let mut sub = opened.subscribe(None);
        drop(opened);
        hubs.prune();
        // An agent of the session publishes into the hub the subscriber took.
        hubs.get_or_create("sess_1").publish(&context(), delta(""));
        assert!(sub.live.try_recv().is_some(), "the subscriber got the agent's event");
        drop(sub);
        hubs.prune();
        assert!(hubs.is_empty(), "neither held nor subscribed: dropped");
    }

    #[tokio::test]
    async fn a_subscriber_behind_a_fast_reply_gets_it_whole_in_fewer_deltas() {
        let hub = SessionHub::new(8, limits(4), None);
        let ctx = context();
        let mut sub = hub.subscribe(None);
        for i in 0..100 {
            hub.publish(&ctx, delta(&format!("w{i} ")));
            hub.publish(&ctx, data::ConversationResponding {});
        }
        let end = hub.publish(
            &ctx,
            data::ConversationEnd {
                reason: "completed".into(),
            },
        );
        drop(hub);
        let mut text = String::new();
        let mut last = None;
        while let Some(event) = sub.live.recv().await {
            if event.kind == EventKind::TextDelta {
                let data: Value = serde_json::from_str(&event.data_json).unwrap();
                text.push_str(data["text"].as_str().unwrap());
            }
            last = Some(event);
        }
        let expected: String = (0..100).map(|i| format!("w{i} ")).collect();
        assert_eq!(text, expected);
        assert_eq!(last.map(|event| event.cursor), Some(end.cursor));
        assert!(!sub.live.was_cut());
    }

    #[tokio::test]
    async fn a_subscriber_far_behind_on_events_that_cannot_merge_is_cut_off() {
        let hub = SessionHub::new(8, limits(2), None);
        let ctx = context();
        let mut sub = hub.subscribe(None);
        for i in 0..5 {
            hub.publish(
                &ctx,
                data::ToolPlanned {
                    tool_id: i.to_string(),
                    tool_name: String::new(),
                },
            );
        }
        assert!(sub.live.was_cut());
        assert!(sub.live.recv().await.is_none());
    }
}
