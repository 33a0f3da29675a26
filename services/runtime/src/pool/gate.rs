//! The admission of agents' group turns: at most so many run at once on this
//! replica and of one tenant. The wakes beyond wait in a queue that admits
//! tenants in turn (round-robin) and each tenant's waiters in order (FIFO),
//! so that one tenant's burst of wakes cannot starve another tenant.
//!
//! Written here rather than taken from a crate: semaphores (tokio's among
//! them) admit in one FIFO order across everyone, and limits per key with
//! fairness between keys need a queue that knows the tenants.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tokio::sync::oneshot;

/// Admission of agents' turns: at most `per_replica` at once, at most
/// `per_tenant` of one tenant; waiters are admitted round-robin across
/// tenants, FIFO within a tenant.
pub(crate) struct RunGate {
    state: Arc<Mutex<State>>,
}

/// A slot of the gate, held while a turn runs; dropping it frees the slot
/// for the next waiter.
pub(crate) struct RunPermit {
    state: Arc<Mutex<State>>,
    tenant_id: String,
}

/// What the gate knows; the mutex is never held across an `.await`.
struct State {
    per_replica: usize,
    per_tenant: usize,
    running: usize,
    waiting: usize,
    /// Only tenants with a running turn or a waiter: an idle tenant costs nothing.
    tenants: HashMap<String, Tenant>,
    /// Tenants with waiters, the next to be admitted first; an admitted
    /// tenant with more waiters goes to the back.
    turns: VecDeque<String>,
    next_waiter_id: u64,
}

#[derive(Default)]
struct Tenant {
    running: usize,
    waiters: VecDeque<Waiter>,
}

struct Waiter {
    id: u64,
    since: Instant,
    admitted: oneshot::Sender<()>,
}

/// A waiter in the queue while its `admit` future lives; dropped before
/// admission, it leaves the queue, or gives back the slot it was just given.
struct Queued<'a> {
    gate: &'a RunGate,
    tenant_id: &'a str,
    id: u64,
    admitted: bool,
}

impl RunGate {
    /// Returns a gate with nothing running; a limit of 0 means no limit.
    pub(crate) fn new(per_replica: usize, per_tenant: usize) -> Self {
        let limit = |limit: usize| if limit == 0 { usize::MAX } else { limit };
        Self {
            state: Arc::new(Mutex::new(State {
                per_replica: limit(per_replica),
                per_tenant: limit(per_tenant),
                running: 0,
                waiting: 0,
                tenants: HashMap::new(),
                turns: VecDeque::new(),
                next_waiter_id: 0,
            })),
        }
    }

    /// Waits for a slot for `tenant_id`; the permit frees it on drop.
    /// Cancel-safe: a waiter dropped before admission leaves the queue and
    /// never leaks a slot (also if it was being admitted at the moment it
    /// was dropped).
    pub(crate) async fn admit(&self, tenant_id: &str) -> RunPermit {
        let since = Instant::now();
        let (id, admission) = {
            let mut state = self.lock();
            if state.may_run(tenant_id) {
                state.start(tenant_id, since);
                return self.permit(tenant_id);
            }
            state.enqueue(tenant_id, since)
        };
        let mut queued = Queued {
            gate: self,
            tenant_id,
            id,
            admitted: false,
        };
        // The gate takes a waiter off its queue only to admit it, so an
        // ended channel means the slot is ours whether or not the message came.
        let _ = admission.await;
        queued.admitted = true;
        self.permit(tenant_id)
    }

    /// Returns the turns running.
    #[cfg(test)]
    pub(crate) fn running(&self) -> usize {
        self.lock().running
    }

    /// Returns the turns waiting for a slot.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// Returns the turns of one tenant running.
    #[cfg(test)]
    pub(crate) fn running_of(&self, tenant_id: &str) -> usize {
        self.lock().tenants.get(tenant_id).map_or(0, |tenant| tenant.running)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn permit(&self, tenant_id: &str) -> RunPermit {
        RunPermit {
            state: Arc::clone(&self.state),
            tenant_id: tenant_id.to_owned(),
        }
    }
}

impl Drop for RunPermit {
    fn drop(&mut self) {
        lock(&self.state).finish(&self.tenant_id);
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.admitted {
            return;
        }
        let mut state = self.gate.lock();
        if !state.leave_queue(self.tenant_id, self.id) {
            // Admitted while it was being dropped: the slot goes on.
            state.finish(self.tenant_id);
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl State {
    /// Whether a turn of the tenant may start now. After every change no
    /// waiter may, so a tenant with waiters never may: its new turn waits
    /// behind them.
    fn may_run(&self, tenant_id: &str) -> bool {
        self.running < self.per_replica
            && self
                .tenants
                .get(tenant_id)
                .is_none_or(|tenant| tenant.running < self.per_tenant && tenant.waiters.is_empty())
    }

    /// Counts a turn of the tenant, asked for at `since`, as running.
    fn start(&mut self, tenant_id: &str, since: Instant) {
        self.tenants.entry(tenant_id.to_owned()).or_default().running += 1;
        self.running += 1;
        metrics::gauge!("avm_runtime_group_turns_running").increment(1.0);
        metrics::histogram!("avm_runtime_group_turn_wait_seconds").record(since.elapsed().as_secs_f64());
    }

    /// Queues a waiter of the tenant; returns its id and where its admission arrives.
    fn enqueue(&mut self, tenant_id: &str, since: Instant) -> (u64, oneshot::Receiver<()>) {
        let id = self.next_waiter_id;
        self.next_waiter_id += 1;
        let (admitted, admission) = oneshot::channel();
        let tenant = self.tenants.entry(tenant_id.to_owned()).or_default();
        if tenant.waiters.is_empty() {
            self.turns.push_back(tenant_id.to_owned());
        }
        tenant.waiters.push_back(Waiter { id, since, admitted });
        self.waiting += 1;
        metrics::gauge!("avm_runtime_group_turns_waiting").increment(1.0);
        (id, admission)
    }

    /// Takes a waiter out of the queue; `false` when it is no longer there
    /// (it was admitted).
    fn leave_queue(&mut self, tenant_id: &str, id: u64) -> bool {
        let Some(tenant) = self.tenants.get_mut(tenant_id) else {
            return false;
        };
        let Some(position) = tenant.waiters.iter().position(|waiter| waiter.id == id) else {
            return false;
        };
        tenant.waiters.remove(position);
        if tenant.waiters.is_empty() {
            self.turns.retain(|turn| turn != tenant_id);
        }
        self.waiting -= 1;
        metrics::gauge!("avm_runtime_group_turns_waiting").decrement(1.0);
        self.forget_if_idle(tenant_id);
        true
    }

    /// Ends a running turn of the tenant and admits whom its slot lets in.
    fn finish(&mut self, tenant_id: &str) {
        if let Some(tenant) = self.tenants.get_mut(tenant_id) {
            tenant.running -= 1;
            self.running -= 1;
            metrics::gauge!("avm_runtime_group_turns_running").decrement(1.0);
            self.forget_if_idle(tenant_id);
        }
        self.admit_waiters();
    }

    /// Admits waiters while a slot is free: the first tenant in turn that
    /// is under its own limit (one at it keeps its place), its oldest waiter.
    fn admit_waiters(&mut self) {
        while self.running < self.per_replica {
            let per_tenant = self.per_tenant;
            let tenants = &self.tenants;
            let Some(position) = self
                .turns
                .iter()
                .position(|turn| tenants.get(turn).is_some_and(|tenant| tenant.running < per_tenant))
            else {
                return;
            };
            let Some(tenant_id) = self.turns.remove(position) else {
                return;
            };
            let Some(tenant) = self.tenants.get_mut(&tenant_id) else {
                continue;
            };
            let Some(waiter) = tenant.waiters.pop_front() else {
                continue;
            };
            tenant.running += 1;
            if !tenant.waiters.is_empty() {
                self.turns.push_back(tenant_id);
            }
            self.running += 1;
            self.waiting -= 1;
            metrics::gauge!("avm_runtime_group_turns_running").increment(1.0);
            metrics::gauge!("avm_runtime_group_turns_waiting").decrement(1.0);
            metrics::histogram!("avm_runtime_group_turn_wait_seconds").record(waiter.since.elapsed().as_secs_f64());
            // A waiter whose future was dropped meanwhile gives the slot back
            // from that future's drop, once this lock is released.
            let _ = waiter.admitted.send(());
        }
    }

    fn forget_if_idle(&mut self, tenant_id: &str) {
        if self
            .tenants
            .get(tenant_id)
            .is_some_and(|tenant| tenant.running == 0 && tenant.waiters.is_empty())
        {
            self.tenants.remove(tenant_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::FutureExt;

    use super::*;

    type Admission<'a> = Pin<Box<dyn Future<Output = RunPermit> + Send + 'a>>;

    /// Starts `admit` and polls it once: admitted at once, or queued.
    fn ask<'a>(gate: &'a RunGate, tenant_id: &'a str) -> Result<RunPermit, Admission<'a>> {
        let mut admission: Admission<'a> = Box::pin(gate.admit(tenant_id));
        match (&mut admission).now_or_never() {
            Some(permit) => Ok(permit),
            None => Err(admission),
        }
    }

    fn admitted_now(gate: &RunGate, tenant_id: &str) -> RunPermit {
        match ask(gate, tenant_id) {
            Ok(permit) => permit,
            Err(_) => panic!("{tenant_id} should be admitted at once"),
        }
    }

    fn tenants_held(gate: &RunGate) -> usize {
        let state = gate.lock();
        state.tenants.len() + state.turns.len()
    }

    #[tokio::test]
    async fn the_limits_hold_and_freed_slots_go_to_waiters() {
        let gate = RunGate::new(3, 2);
        let a1 = admitted_now(&gate, "a");
        let _a2 = admitted_now(&gate, "a");
        let mut a3 = ask(&gate, "a").err().unwrap();
        assert_eq!((gate.running(), gate.running_of("a"), gate.waiting()), (2, 2, 1));
        let _b1 = admitted_now(&gate, "b");
        let mut b2 = ask(&gate, "b").err().unwrap();
        assert_eq!((gate.running(), gate.waiting()), (3, 2), "the replica is full");

        // a queued first and is under its limit again: a3 takes a1's slot.
        drop(a1);
        assert!((&mut b2).now_or_never().is_none());
        let a3 = (&mut a3).now_or_never().unwrap();
        assert_eq!((gate.running(), gate.running_of("a"), gate.running_of("b")), (3, 2, 1));
        drop(a3);
        let _b2 = (&mut b2).now_or_never().unwrap();
        assert_eq!(
            (
                gate.running(),
                gate.running_of("a"),
                gate.running_of("b"),
                gate.waiting()
            ),
            (3, 1, 2, 0)
        );
    }

    #[tokio::test]
    async fn waiters_are_admitted_round_robin_across_tenants_fifo_within_one() {
        let gate = RunGate::new(2, 0);
        let mut held = VecDeque::from([admitted_now(&gate, "x"), admitted_now(&gate, "x")]);
        // Each tenant queues its ten at once, a's first: a FIFO queue would
        // run all of a's before any of b's.
        let labels: Vec<(&str, usize)> = ["a", "b", "c"]
            .into_iter()
            .flat_map(|tenant| (0..10).map(move |n| (tenant, n)))
            .collect();
        let mut pending: Vec<((&str, usize), Admission<'_>)> = labels
            .iter()
            .map(|&(tenant, n)| ((tenant, n), ask(&gate, tenant).err().unwrap()))
            .collect();
        assert_eq!(gate.waiting(), 30);

        let mut order = Vec::new();
        while let Some(permit) = held.pop_front() {
            drop(permit);
            let mut admitted = Vec::new();
            pending.retain_mut(|(label, admission)| match admission.now_or_never() {
                Some(permit) => {
                    admitted.push((*label, permit));
                    false
                }
                None => true,
            });
            assert!(admitted.len() <= 1, "one freed slot admits one waiter");
            for (label, permit) in admitted {
                order.push(label);
                held.push_back(permit);
            }
            assert!(gate.running() <= 2);
        }
        let expected: Vec<(&str, usize)> = (0..10)
            .flat_map(|n| ["a", "b", "c"].into_iter().map(move |tenant| (tenant, n)))
            .collect();
        assert_eq!(order, expected);
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
    }

    #[tokio::test]
    async fn a_tenant_at_its_limit_does_not_block_others() {
        let gate = RunGate::new(2, 1);
        let a1 = admitted_now(&gate, "a");
        let mut a2 = ask(&gate, "a").err().unwrap();
        // a waits at its own limit; b, queued after it, takes the free slot.
        let b1 = admitted_now(&gate, "b");
        let mut c1 = ask(&gate, "c").err().unwrap();
        assert_eq!((gate.running(), gate.waiting()), (2, 2));
        drop(b1);
        assert!((&mut a2).now_or_never().is_none(), "a is still at its limit");
        let c1 = (&mut c1).now_or_never().unwrap();
        assert_eq!((gate.running_of("a"), gate.running_of("c"), gate.waiting()), (1, 1, 1));
        drop(a1);
        let a2 = (&mut a2).now_or_never().unwrap();
        drop((a2, c1));
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
    }

    #[tokio::test]
    async fn a_dropped_waiter_leaves_the_queue_and_frees_nothing() {
        let gate = RunGate::new(1, 0);
        let a1 = admitted_now(&gate, "a");
        let b1 = ask(&gate, "b").err().unwrap();
        let mut c1 = ask(&gate, "c").err().unwrap();
        assert_eq!((gate.running(), gate.waiting(), gate.running_of("b")), (1, 2, 0));
        drop(b1);
        assert_eq!((gate.running(), gate.waiting()), (1, 1), "a still runs, c still waits");
        assert!(!gate.lock().tenants.contains_key("b"), "b left no state");
        drop(a1);
        let c1 = (&mut c1).now_or_never().unwrap();
        assert_eq!((gate.running_of("c"), gate.waiting()), (1, 0));
        drop(c1);
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
    }

    #[tokio::test]
    async fn a_waiter_dropped_as_it_is_admitted_passes_its_slot_on() {
        let gate = RunGate::new(1, 0);
        let a1 = admitted_now(&gate, "a");
        let b1 = ask(&gate, "b").err().unwrap();
        let mut c1 = ask(&gate, "c").err().unwrap();
        drop(a1);
        // b holds the slot without having seen it yet.
        assert_eq!((gate.running(), gate.running_of("b"), gate.waiting()), (1, 1, 1));
        drop(b1);
        let c1 = (&mut c1).now_or_never().unwrap();
        assert_eq!((gate.running(), gate.running_of("b"), gate.running_of("c")), (1, 0, 1));
        drop(c1);
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));

        // Never polled: never queued, nothing to undo.
        drop(gate.admit("d"));
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
    }

    #[tokio::test]
    async fn a_limit_of_zero_is_no_limit() {
        let gate = RunGate::new(0, 0);
        let permits: Vec<RunPermit> = (0..1000).map(|_| admitted_now(&gate, "a")).collect();
        assert_eq!(gate.running_of("a"), 1000);
        drop(permits);

        let gate = RunGate::new(0, 2);
        let a: Vec<RunPermit> = (0..2).map(|_| admitted_now(&gate, "a")).collect();
        let b: Vec<RunPermit> = (0..2).map(|_| admitted_now(&gate, "b")).collect();
        assert!(ask(&gate, "a").is_err(), "a is at its own limit");
        drop((a, b));

        let gate = RunGate::new(3, 0);
        let a: Vec<RunPermit> = (0..3).map(|_| admitted_now(&gate, "a")).collect();
        assert!(ask(&gate, "b").is_err(), "the replica is full");
        drop(a);
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
    }

    #[test]
    fn admission_may_run_on_any_thread() {
        fn sendable<T: Send>(_: &T) {}
        let gate = RunGate::new(1, 1);
        sendable(&gate.admit("a"));
    }

    /// Turns observed running, by the tasks themselves rather than the gate.
    #[derive(Default)]
    struct Observed {
        running: AtomicUsize,
        max_running: AtomicUsize,
        of_tenant: [AtomicUsize; 3],
        max_of_tenant: [AtomicUsize; 3],
    }

    impl Observed {
        fn started(&self, tenant: usize) {
            let running = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_running.fetch_max(running, Ordering::SeqCst);
            let of_tenant = self.of_tenant[tenant].fetch_add(1, Ordering::SeqCst) + 1;
            self.max_of_tenant[tenant].fetch_max(of_tenant, Ordering::SeqCst);
        }

        fn ended(&self, tenant: usize) {
            self.running.fetch_sub(1, Ordering::SeqCst);
            self.of_tenant[tenant].fetch_sub(1, Ordering::SeqCst);
        }
    }

    const TENANTS: [&str; 3] = ["a", "b", "c"];

    /// 100 turns of three tenants, queued tenant by tenant, run under a
    /// gate of 5 with 3 a tenant; returns the tenants in admission order.
    async fn hundred_turns(gate: Arc<RunGate>, observed: Arc<Observed>) -> Vec<usize> {
        let order = Arc::new(Mutex::new(Vec::new()));
        let tasks: Vec<_> = (0..100)
            .map(|n| {
                let tenant = n * 3 / 100;
                let (gate, observed, order) = (Arc::clone(&gate), Arc::clone(&observed), Arc::clone(&order));
                tokio::spawn(async move {
                    let permit = gate.admit(TENANTS[tenant]).await;
                    observed.started(tenant);
                    order.lock().unwrap().push(tenant);
                    tokio::task::yield_now().await;
                    observed.ended(tenant);
                    drop(permit);
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        order.lock().unwrap().clone()
    }

    #[tokio::test]
    async fn a_hundred_simultaneous_turns_keep_the_limits_and_take_turns() {
        let gate = Arc::new(RunGate::new(5, 3));
        let observed = Arc::new(Observed::default());
        // Hold every slot until all 100 wait, so that they are truly simultaneous.
        let blockers = [
            admitted_now(&gate, "x"),
            admitted_now(&gate, "x"),
            admitted_now(&gate, "x"),
            admitted_now(&gate, "y"),
            admitted_now(&gate, "y"),
        ];
        let run = tokio::spawn(hundred_turns(Arc::clone(&gate), Arc::clone(&observed)));
        while gate.waiting() < 100 {
            tokio::task::yield_now().await;
        }
        drop(blockers);
        let order = run.await.unwrap();

        assert_eq!(order.len(), 100, "all complete");
        assert!(observed.max_running.load(Ordering::SeqCst) <= 5);
        for tenant in 0..3 {
            assert!(observed.max_of_tenant[tenant].load(Ordering::SeqCst) <= 3);
        }
        // A current-thread runtime runs woken tasks in the order they were
        // woken, so `order` is the order of admission. While every tenant
        // still waits, none is admitted twice in a row: two tenants at their
        // limit would hold 6 slots of 5, so one other is always eligible.
        let last = |tenant: usize| order.iter().rposition(|&t| t == tenant).unwrap_or(0);
        let all_wait_until = (0..3).map(last).min().unwrap_or(0);
        for pair in order[..=all_wait_until].windows(2) {
            assert_ne!(pair[0], pair[1], "admitted in turn: {order:?}");
        }
        assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn turns_on_several_threads_keep_the_limits() {
        for _ in 0..20 {
            let gate = Arc::new(RunGate::new(5, 3));
            let observed = Arc::new(Observed::default());
            let order = hundred_turns(Arc::clone(&gate), Arc::clone(&observed)).await;
            assert_eq!(order.len(), 100);
            assert!(observed.max_running.load(Ordering::SeqCst) <= 5);
            for tenant in 0..3 {
                assert!(observed.max_of_tenant[tenant].load(Ordering::SeqCst) <= 3);
            }
            assert_eq!((gate.running(), gate.waiting(), tenants_held(&gate)), (0, 0, 0));
        }
    }
}
