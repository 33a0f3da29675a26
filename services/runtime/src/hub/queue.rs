//! One subscriber's queue of live events.
//!
//! Written here rather than taken from `tokio::sync::mpsc` because a bounded
//! channel can only refuse an event when full, and refusing cut every client
//! that fell briefly behind a fast reply (issue 26 item 11). This queue
//! instead merges, when it is full, a text delta into the one before it (of
//! the same message: nothing else lies between them), keeping every other
//! event in order; it cuts a subscriber only when it took nothing for the
//! stall timeout while full, or when events that cannot merge overflow a
//! hard bound.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use avm_common::event::{Event, EventKind, data};
use tokio::sync::Notify;

use super::SessionEvent;

/// The event kind whose texts merge when a subscriber falls behind.
const TEXT_DELTA: EventKind = EventKind::TextDelta;
/// The empty mark that follows each text delta: a run of them says no more
/// than one does.
const RESPONDING: EventKind = EventKind::ConversationResponding;

/// How far a subscriber may fall behind, and for how long it may stop reading.
#[derive(Clone, Copy, Debug)]
pub struct QueueLimits {
    /// Events queued before text deltas merge.
    pub capacity: usize,
    /// How long a full queue waits for its subscriber to take an event
    /// before cutting it off.
    pub stall_timeout: Duration,
}

impl QueueLimits {
    /// Events queued at most, counting those that could not merge: past
    /// this the subscriber is cut off whatever the time.
    fn hard_bound(&self) -> usize {
        self.capacity.saturating_mul(2)
    }
}

/// A queued event, or text deltas merged and not yet taken.
enum Queued {
    Event(Arc<SessionEvent>),
    /// Deltas merged into one: their text, kept as text so each merge
    /// costs only the new delta (re-encoding the JSON every time was
    /// quadratic in the reply), and the last of them, whose cursor and
    /// time the merged delta takes.
    Text {
        text: String,
        last: Arc<SessionEvent>,
    },
}

impl Queued {
    fn kind(&self) -> EventKind {
        match self {
            Queued::Event(event) => event.kind,
            Queued::Text { .. } => TEXT_DELTA,
        }
    }

    fn event(&self) -> &Arc<SessionEvent> {
        match self {
            Queued::Event(event) | Queued::Text { last: event, .. } => event,
        }
    }

    /// Returns the event as the subscriber receives it.
    fn into_event(self) -> Arc<SessionEvent> {
        match self {
            Queued::Event(event) => event,
            Queued::Text { text, last } => Arc::new(SessionEvent {
                kind: TEXT_DELTA,
                cursor: last.cursor,
                timestamp_ms: last.timestamp_ms,
                context: Arc::clone(&last.context),
                data_json: Event::from(data::TextDelta { text }).data_json(),
                detail: None,
            }),
        }
    }
}

struct QueueState {
    events: VecDeque<Queued>,
    /// The subscriber was cut off for falling behind.
    cut: bool,
    /// One of the two ends went away.
    closed: bool,
    /// When the queue was last seen full, with how many events had been
    /// taken then: the stall clock restarts whenever the subscriber takes one.
    full_since: Option<(Instant, u64)>,
}

struct Shared {
    state: Mutex<QueueState>,
    /// Events the subscriber took; counted outside the lock's critical
    /// path of the hub.
    taken: AtomicU64,
    notify: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A poisoned lock only means a panic elsewhere; the queue stays consistent.
        self.state.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

/// Returns the two ends of a new subscriber queue.
pub fn queue(limits: QueueLimits) -> (QueueSender, LiveEvents) {
    let shared = Arc::new(Shared {
        state: Mutex::new(QueueState {
            events: VecDeque::new(),
            cut: false,
            closed: false,
            full_since: None,
        }),
        taken: AtomicU64::new(0),
        notify: Notify::new(),
    });
    (
        QueueSender {
            shared: Arc::clone(&shared),
            limits: QueueLimits {
                capacity: limits.capacity.max(2),
                stall_timeout: limits.stall_timeout,
            },
        },
        LiveEvents { shared },
    )
}

/// What offering an event to a subscriber came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Offered {
    /// Queued, or merged into a queued event.
    Kept,
    /// The subscriber went away.
    Gone,
    /// The subscriber was cut off for falling behind.
    Cut,
}

/// The hub's end of a subscriber queue.
pub struct QueueSender {
    shared: Arc<Shared>,
    limits: QueueLimits,
}

impl QueueSender {
    /// Offers an event: queues it, or merges it into the queue's last text
    /// delta when the queue is full, or cuts the subscriber off.
    pub fn offer(&self, event: &Arc<SessionEvent>) -> Offered {
        let mut state = self.shared.lock();
        if state.closed {
            return Offered::Gone;
        }
        if state.events.len() >= self.limits.capacity {
            let taken = self.shared.taken.load(Ordering::Acquire);
            let now = Instant::now();
            match state.full_since {
                Some((since, before)) if before == taken => {
                    if now.duration_since(since) >= self.limits.stall_timeout {
                        return self.cut(&mut state);
                    }
                }
                _ => state.full_since = Some((now, taken)),
            }
            if merge(&mut state.events, event) {
                return Offered::Kept;
            }
            if state.events.len() >= self.limits.hard_bound() {
                return self.cut(&mut state);
            }
        } else {
            state.full_since = None;
        }
        state.events.push_back(Queued::Event(Arc::clone(event)));
        drop(state);
        self.shared.notify.notify_one();
        Offered::Kept
    }

    fn cut(&self, state: &mut QueueState) -> Offered {
        state.cut = true;
        state.closed = true;
        // Its events are dropped with it: a subscriber that stopped reading
        // holds no memory, and learns it was cut as soon as it reads again.
        state.events = VecDeque::new();
        self.shared.notify.notify_one();
        Offered::Cut
    }

    /// Returns whether the subscriber went away.
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }
}

impl Drop for QueueSender {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.notify.notify_one();
    }
}

/// Merges `event` into the queue's tail when both are text deltas of the
/// same message (between them at most the empty mark that follows a delta,
/// which then goes: the merged delta's own mark follows it). The merged
/// event takes the later cursor, so a subscriber resuming after it misses
/// nothing and sees nothing twice. Returns whether it merged.
fn merge(events: &mut VecDeque<Queued>, event: &Arc<SessionEvent>) -> bool {
    let len = events.len();
    let same = |queued: &Queued| {
        let context = &queued.event().context;
        Arc::ptr_eq(context, &event.context) || **context == *event.context
    };
    match event.kind {
        RESPONDING => {
            // A run of marks says no more than its last.
            let Some(last) = events.back_mut() else { return false };
            if last.kind() != RESPONDING || !same(last) {
                return false;
            }
            *last = Queued::Event(Arc::clone(event));
            true
        }
        TEXT_DELTA => {
            let kind_at = |i: Option<usize>| i.map(|i| events[i].kind());
            let (delta_at, mark) = match (kind_at(len.checked_sub(1)), kind_at(len.checked_sub(2))) {
                (Some(TEXT_DELTA), _) => (len - 1, false),
                (Some(RESPONDING), Some(TEXT_DELTA)) if same(&events[len - 1]) => (len - 2, true),
                _ => return false,
            };
            if !same(&events[delta_at]) {
                return false;
            }
            let Some(tail) = delta_text(&event.data_json) else {
                return false;
            };
            let merged = match &mut events[delta_at] {
                Queued::Text { text, last } => {
                    text.push_str(&tail);
                    *last = Arc::clone(event);
                    None
                }
                Queued::Event(queued) => match delta_text(&queued.data_json) {
                    Some(head) => Some(Queued::Text {
                        text: head + &tail,
                        last: Arc::clone(event),
                    }),
                    None => return false,
                },
            };
            if let Some(merged) = merged {
                events[delta_at] = merged;
            }
            if mark {
                events.pop_back();
            }
            true
        }
        _ => false,
    }
}

/// Returns the text of a `text_delta`'s data, when that is all it holds.
fn delta_text(data_json: &str) -> Option<String> {
    serde_json::from_str::<data::TextDelta>(data_json)
        .ok()
        .map(|delta| delta.text)
}

/// The subscriber's end of its queue: live events, in order.
pub struct LiveEvents {
    shared: Arc<Shared>,
}

impl LiveEvents {
    /// Returns the next event; `None` once the hub let the subscriber go
    /// (see [`LiveEvents::was_cut`] for why).
    pub async fn recv(&mut self) -> Option<Arc<SessionEvent>> {
        loop {
            match self.try_take() {
                Ok(event) => return Some(event),
                Err(true) => return None,
                // A single consumer: an event queued after this check leaves
                // a permit, so the wait below returns at once.
                Err(false) => self.shared.notify.notified().await,
            }
        }
    }

    /// Returns the next event if one is queued.
    pub fn try_recv(&mut self) -> Option<Arc<SessionEvent>> {
        self.try_take().ok()
    }

    /// Takes the first queued event, or says whether the queue is closed.
    fn try_take(&mut self) -> Result<Arc<SessionEvent>, bool> {
        let mut state = self.shared.lock();
        match state.events.pop_front() {
            Some(queued) => {
                drop(state);
                self.shared.taken.fetch_add(1, Ordering::Release);
                Ok(queued.into_event())
            }
            None => Err(state.closed),
        }
    }

    /// Returns whether the hub cut this subscriber off for falling behind.
    pub fn was_cut(&self) -> bool {
        self.shared.lock().cut
    }
}

impl Drop for LiveEvents {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.closed = true;
        state.events = VecDeque::new();
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::event::EventContext;

    fn context(session: &str) -> Arc<EventContext> {
        Arc::new(EventContext {
            session_id: session.into(),
            ..EventContext::default()
        })
    }

    fn event(ctx: &Arc<EventContext>, cursor: u64, kind: EventKind, data: Value) -> Arc<SessionEvent> {
        Arc::new(SessionEvent {
            kind,
            cursor,
            timestamp_ms: 0,
            context: Arc::clone(ctx),
            data_json: data.to_string(),
            detail: None,
        })
    }

    fn limits(capacity: usize, stall_timeout: Duration) -> QueueLimits {
        QueueLimits {
            capacity,
            stall_timeout,
        }
    }

    fn drain(live: &mut LiveEvents) -> Vec<(u64, EventKind, String)> {
        std::iter::from_fn(|| live.try_recv())
            .map(|event| (event.cursor, event.kind, event.data_json.clone()))
            .collect()
    }

    #[test]
    fn a_full_queue_merges_text_deltas_and_keeps_every_other_event_in_order() {
        let (sender, mut live) = queue(limits(4, Duration::from_secs(60)));
        let ctx = context("s");
        let mut cursor = 0;
        let mut next = |kind, data| {
            cursor += 1;
            sender.offer(&event(&ctx, cursor, kind, data))
        };
        assert_eq!(next(EventKind::MessageStart, json!({})), Offered::Kept);
        for word in ["a", "b", "c", "d", "e"] {
            assert_eq!(next(TEXT_DELTA, json!({"text": word})), Offered::Kept);
            assert_eq!(next(RESPONDING, json!({})), Offered::Kept);
        }
        assert_eq!(next(EventKind::MessageStop, json!({})), Offered::Kept);
        let seen = drain(&mut live);
        let kinds: Vec<EventKind> = seen.iter().map(|(_, kind, _)| *kind).collect();
        assert_eq!(
            kinds,
            [
                EventKind::MessageStart,
                TEXT_DELTA,
                RESPONDING,
                TEXT_DELTA,
                RESPONDING,
                EventKind::MessageStop
            ]
        );
        let text: String = seen
            .iter()
            .filter(|(_, kind, _)| *kind == TEXT_DELTA)
            .map(|(_, _, data)| {
                serde_json::from_str::<Value>(data).unwrap()["text"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(text, "abcde");
        let cursors: Vec<u64> = seen.iter().map(|(cursor, _, _)| *cursor).collect();
        assert!(cursors.windows(2).all(|pair| pair[0] < pair[1]), "{cursors:?}");
        assert_eq!(seen[3].0, 10, "the merged delta takes the last cursor merged into it");
    }

    #[test]
    fn deltas_of_different_writers_never_merge() {
        let (sender, mut live) = queue(limits(2, Duration::from_secs(60)));
        let (a, b) = (context("a"), context("b"));
        sender.offer(&event(&a, 1, TEXT_DELTA, json!({"text": "a1"})));
        sender.offer(&event(&b, 2, TEXT_DELTA, json!({"text": "b1"})));
        assert_eq!(
            sender.offer(&event(&a, 3, TEXT_DELTA, json!({"text": "a2"}))),
            Offered::Kept
        );
        assert_eq!(drain(&mut live).len(), 3);
    }

    #[test]
    fn a_subscriber_that_stops_reading_is_cut_after_the_stall_timeout() {
        let (sender, mut live) = queue(limits(2, Duration::ZERO));
        let ctx = context("s");
        sender.offer(&event(&ctx, 1, EventKind::MessageStart, json!({})));
        sender.offer(&event(&ctx, 2, TEXT_DELTA, json!({"text": "a"})));
        // Full: the clock starts; nothing was taken since, and no time is allowed.
        assert_eq!(
            sender.offer(&event(&ctx, 3, TEXT_DELTA, json!({"text": "b"}))),
            Offered::Kept
        );
        assert_eq!(
            sender.offer(&event(&ctx, 4, TEXT_DELTA, json!({"text": "c"}))),
            Offered::Cut
        );
        assert!(live.try_recv().is_none(), "a cut subscriber's queue is dropped");
        assert!(live.was_cut());
        assert_eq!(sender.offer(&event(&ctx, 5, TEXT_DELTA, json!({}))), Offered::Gone);
    }

    #[test]
    fn a_reader_that_keeps_taking_is_never_cut() {
        let (sender, mut live) = queue(limits(2, Duration::ZERO));
        let ctx = context("s");
        // Full from the start, and taking one event for every one offered.
        sender.offer(&event(&ctx, 1, EventKind::MessageStart, json!({})));
        sender.offer(&event(&ctx, 2, EventKind::ToolPlanned, json!({})));
        for cursor in 3..100 {
            let kind = if cursor % 2 == 0 {
                TEXT_DELTA
            } else {
                EventKind::ToolPlanned
            };
            assert_eq!(
                sender.offer(&event(&ctx, cursor, kind, json!({"text": "x"}))),
                Offered::Kept
            );
            assert!(live.try_recv().is_some());
        }
        assert!(!live.was_cut());
    }

    #[test]
    fn events_that_cannot_merge_are_bounded() {
        let (sender, live) = queue(limits(2, Duration::from_secs(60)));
        let ctx = context("s");
        let offered: Vec<Offered> = (1..=5)
            .map(|cursor| sender.offer(&event(&ctx, cursor, EventKind::ToolPlanned, json!({}))))
            .collect();
        assert_eq!(
            offered[..4],
            [Offered::Kept, Offered::Kept, Offered::Kept, Offered::Kept]
        );
        assert_eq!(offered[4], Offered::Cut);
        assert!(live.was_cut());
    }

    #[tokio::test]
    async fn the_subscriber_learns_the_hub_let_it_go() {
        let (sender, mut live) = queue(limits(2, Duration::from_secs(60)));
        let ctx = context("s");
        sender.offer(&event(&ctx, 1, TEXT_DELTA, json!({"text": "a"})));
        drop(sender);
        assert!(live.recv().await.is_some(), "what was queued still arrives");
        assert!(live.recv().await.is_none());
        assert!(!live.was_cut());
    }
}
