//! The one lifecycle every role of the binary runs (after GreptimeDB's
//! start/stop `App`): a role binds its listeners first (a port conflict fails
//! before anything else starts), opens what it serves, and hands this an
//! [`App`] of servers and background work. [`App::run`] then waits for a
//! shutdown signal (or a server that stops on its own) and stops everything
//! in one order, each step bounded by the drain timeout:
//!
//! 0. readiness turns not ready ([`App::stopping`]),
//! 1. drain steps (let running turns finish, interrupting those left so
//!    their partial replies are stored; send the usage of every call),
//! 2. tasks that send what they hold to the services of this process (the
//!    log forwarder),
//! 3. the servers (health turns NOT_SERVING, in-flight calls finish),
//! 4. tasks that write what they hold (the usage ledger), then the rest.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Any error a server ends with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

type Step = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// A background task that finishes its work when told to stop.
struct Flushing {
    what: &'static str,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// What a role runs, and how it stops.
pub struct App {
    name: &'static str,
    drain_timeout: Duration,
    /// Cancelled when the stop begins, before any step: readiness says no.
    stopping: CancellationToken,
    servers_stop: CancellationToken,
    background_stop: CancellationToken,
    servers: Vec<(&'static str, JoinHandle<Result<(), BoxError>>)>,
    drains: Vec<Step>,
    before_servers: Vec<Flushing>,
    after_servers: Vec<Flushing>,
    aborted: Vec<JoinHandle<()>>,
}

impl App {
    /// Returns an empty app named `name` (in logs) whose every stop step
    /// gets at most `drain_timeout`.
    pub fn new(name: &'static str, drain_timeout: Duration) -> Self {
        Self {
            name,
            drain_timeout,
            stopping: CancellationToken::new(),
            servers_stop: CancellationToken::new(),
            background_stop: CancellationToken::new(),
            servers: Vec::new(),
            drains: Vec::new(),
            before_servers: Vec::new(),
            after_servers: Vec::new(),
            aborted: Vec::new(),
        }
    }

    /// Returns the token cancelled as the stop begins, before the drain
    /// steps: a readiness probe answers not ready from then on, so load
    /// balancers send no new work while running turns finish.
    pub fn stopping(&self) -> CancellationToken {
        self.stopping.clone()
    }

    /// Returns the token servers stop on (step 3).
    pub fn servers_stop(&self) -> CancellationToken {
        self.servers_stop.clone()
    }

    /// Returns the token background work stops on (step 4).
    pub fn background_stop(&self) -> CancellationToken {
        self.background_stop.clone()
    }

    /// Runs a server until the servers stop; if it ends before, so does the app.
    pub fn serve<E>(&mut self, what: &'static str, server: impl Future<Output = Result<(), E>> + Send + 'static)
    where
        E: Into<BoxError> + 'static,
    {
        let task = tokio::spawn(async move { server.await.map_err(Into::into) });
        self.servers.push((what, task));
    }

    /// Adds a step that runs first at shutdown, while everything still serves.
    pub fn on_drain<F, Fut>(&mut self, step: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.drains.push(Box::new(move || Box::pin(step())));
    }

    /// Adds a task that sends what it holds when `stop` is cancelled, before
    /// the servers stop (what it sends to may be served by them).
    pub fn flush_before_servers(&mut self, what: &'static str, stop: CancellationToken, task: JoinHandle<()>) {
        self.before_servers.push(Flushing { what, stop, task });
    }

    /// Adds a task that finishes its work when [`App::background_stop`] is
    /// cancelled, after the servers stop.
    pub fn flush_after_servers(&mut self, what: &'static str, task: JoinHandle<()>) {
        self.after_servers.push(Flushing {
            what,
            stop: self.background_stop.clone(),
            task,
        });
    }

    /// Adds a task that finishes its work when its own `stop` is cancelled,
    /// after the servers and the tasks added before it (one that drains what
    /// those produce last).
    pub fn flush_after_servers_on(&mut self, what: &'static str, stop: CancellationToken, task: JoinHandle<()>) {
        self.after_servers.push(Flushing { what, stop, task });
    }

    /// Adds a task that is simply aborted at the end.
    pub fn background(&mut self, task: JoinHandle<()>) {
        self.aborted.push(task);
    }

    /// Runs until `shutdown` is cancelled (or a server stops on its own),
    /// then stops everything in order.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), BoxError> {
        let servers = std::mem::take(&mut self.servers);
        let name = self.name;
        if servers.is_empty() {
            shutdown.cancelled().await;
            self.stop(Vec::new()).await;
            tracing::info!(app = name, "stopped");
            return Ok(());
        }
        let (names, tasks): (Vec<_>, Vec<_>) = servers.into_iter().unzip();
        let mut running = futures::future::select_all(tasks);
        let early = tokio::select! {
            () = shutdown.cancelled() => None,
            (result, index, _) = &mut running => Some((names[index], result)),
        };
        if let Some((what, result)) = early {
            self.stop(running.into_inner()).await;
            tracing::warn!(app = name, what, "stopped because a server ended");
            return match result {
                Ok(Ok(())) => Err(format!("the {what} stopped unexpectedly").into()),
                Ok(Err(err)) => Err(err),
                Err(join) => Err(format!("the {what} failed: {join}").into()),
            };
        }
        self.stop(running.into_inner()).await;
        tracing::info!(app = name, "stopped");
        Ok(())
    }

    async fn stop(self, servers: Vec<JoinHandle<Result<(), BoxError>>>) {
        let limit = self.drain_timeout;
        self.stopping.cancel();
        for step in self.drains {
            if tokio::time::timeout(limit, step()).await.is_err() {
                tracing::warn!(?limit, "a drain step did not finish in time");
            }
        }
        finish(self.before_servers, limit).await;
        self.servers_stop.cancel();
        for server in servers {
            // The servers give their calls the drain timeout themselves; a
            // little more here lets them report it.
            match tokio::time::timeout(limit + Duration::from_secs(1), server).await {
                Ok(Ok(Err(err))) => tracing::warn!(error = %err, "a server stopped with an error"),
                Ok(_) => {}
                Err(_) => tracing::warn!(?limit, "a server did not stop in time"),
            }
        }
        self.background_stop.cancel();
        finish(self.after_servers, limit).await;
        for task in self.aborted {
            task.abort();
        }
    }
}

/// Stops flushing tasks in order, giving each at most `limit`.
async fn finish(tasks: Vec<Flushing>, limit: Duration) {
    for Flushing { what, stop, task } in tasks {
        stop.cancel();
        if tokio::time::timeout(limit, task).await.is_err() {
            tracing::warn!(what, ?limit, "did not finish in time");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[tokio::test]
    async fn stops_in_order_and_flushes() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut app = App::new("test", Duration::from_secs(1));
        let note = |log: &Arc<Mutex<Vec<&'static str>>>, what| log.lock().unwrap_or_else(|p| p.into_inner()).push(what);

        let servers = app.servers_stop();
        let server_log = Arc::clone(&log);
        app.serve("server", async move {
            servers.cancelled().await;
            note(&server_log, "server");
            Ok::<_, BoxError>(())
        });
        let drain_log = Arc::clone(&log);
        app.on_drain(move || async move { note(&drain_log, "drain") });
        let forwarder = CancellationToken::new();
        let forwarder_stop = forwarder.clone();
        let forwarder_log = Arc::clone(&log);
        app.flush_before_servers(
            "forwarder",
            forwarder,
            tokio::spawn(async move {
                forwarder_stop.cancelled().await;
                note(&forwarder_log, "forwarder");
            }),
        );
        let ledger_stop = app.background_stop();
        let ledger_log = Arc::clone(&log);
        app.flush_after_servers(
            "ledger",
            tokio::spawn(async move {
                ledger_stop.cancelled().await;
                note(&ledger_log, "ledger");
            }),
        );

        let shutdown = CancellationToken::new();
        shutdown.cancel();
        assert!(app.run(shutdown).await.is_ok());
        let order = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert_eq!(order, ["drain", "forwarder", "server", "ledger"]);
    }

    #[tokio::test]
    async fn a_server_that_stops_on_its_own_ends_the_app_with_an_error() {
        let mut app = App::new("test", Duration::from_secs(1));
        app.serve("grpc server", async { Err::<(), BoxError>("port gone".into()) });
        let err = app.run(CancellationToken::new()).await.err().map(|err| err.to_string());
        assert_eq!(err.as_deref(), Some("port gone"));
    }
}
