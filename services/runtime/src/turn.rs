//! One turn of an agent: stream the LLM's reply as events, run the tools it
//! calls and send their results back, until the model ends its turn.
//!
//! Event order follows PROTOCOL.md. A reply that calls tools:
//! `message_start → conversation_start → (tool_use_start → tool_planned →
//! tool_executing → input_json_delta* → tool_use_stop → tool_call_message)* →
//! message_delta → message_stop{tool_use} → (tool_result →
//! tool_result_message)*`, then the next reply. The last reply:
//! `message_start → conversation_start → (text_delta →
//! conversation_responding)* → message_delta → message_stop → assistant_message
//! → conversation_end`. An interrupt emits `interrupted → message_stop →
//! assistant_message → conversation_end{interrupted}`; a failure
//! `error_received → error_message → error_occurred`. Every tool call is
//! stored with a result, an error one when the turn ended before it ran.

use avm_common::backoff::Backoff;
use std::sync::Arc;
use std::time::Instant;

use avm_common::auth::ServiceIdentity;
use avm_common::event::{Event, data};
use avm_common::ids::new_id;
use avm_common::{Code, RequestContext};
use futures::{FutureExt, StreamExt};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::compaction::Compactor;
use crate::config::{LlmConfig, ProviderKind};
use crate::context::{History, request_tokens};
use crate::error::RuntimeError;
use crate::llm::{LlmContent, LlmError, LlmErrorKind, LlmEvent, LlmRequest, LlmRole, StopReason, ToolCall, ToolOutput};
use crate::message::{self, Message, MessageBody};
use crate::metering::{Charge, Metering, Tokens, charge, estimate_tokens};
use crate::outbox::Outbox;
use crate::peers::usage::status_label;
use crate::peers::{CallStatus, Estimate, Sessions, UsageRecord};
use crate::settings::TenantLlm;
use crate::tools::{Builtin, Caller, ServerState, ToolReply, Toolbox};

/// What a turn needs of the world: where messages are stored, where usage
/// is reported, and the runtime's own credential (a reply is stored whether
/// or not its caller's token outlives the turn).
#[derive(Clone)]
pub(crate) struct TurnPorts {
    pub(crate) sessions: Sessions,
    /// Keeps what the session service cannot take when a turn ends.
    pub(crate) outbox: Outbox,
    pub(crate) metering: Metering,
    pub(crate) identity: ServiceIdentity,
    pub(crate) limits: TurnLimits,
    /// Runs `spawn_agent` calls (the pool, set once it exists).
    pub(crate) spawner: Arc<std::sync::OnceLock<Spawner>>,
}

/// Runs a `spawn_agent` call of an agent's turn, as its caller.
pub(crate) type Spawner = Arc<
    dyn Fn(RequestContext, Arc<Agent>, serde_json::Value) -> futures::future::BoxFuture<'static, ToolReply>
        + Send
        + Sync,
>;

/// How far one turn may go.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TurnLimits {
    /// LLM calls per turn.
    pub(crate) max_steps: u32,
    /// Tool calls of one reply running at once.
    pub(crate) tool_concurrency: usize,
}

/// Returns the LLM request for the conversation so far: the tenant's
/// settings, under what the agent's definition chose, and the agent's tools.
/// The offline provider answers as itself, whatever model was chosen, so its
/// replies and their ledger records never name a model that did not answer.
pub(crate) fn request(config: &LlmConfig, agent: &Agent, messages: History) -> LlmRequest {
    let plan = &agent.plan;
    LlmRequest {
        model: config.answering_model(plan.model.as_deref()).to_owned(),
        system: plan.system_prompt.clone(),
        messages,
        max_tokens: plan.max_tokens.unwrap_or(config.max_tokens),
        tools: agent.tools.as_ref().map(|tools| tools.specs()).unwrap_or_default(),
    }
}

enum Outcome {
    Completed(StopReason),
    Interrupted,
    Failed(Failure),
}

/// Why a turn failed, as its error events say it.
struct Failure {
    reason: String,
    message: String,
    recoverable: bool,
}

impl From<LlmError> for Failure {
    fn from(error: LlmError) -> Self {
        Failure {
            reason: error.kind.reason().to_owned(),
            recoverable: error.kind.recoverable(),
            message: error.message,
        }
    }
}

impl From<RuntimeError> for Failure {
    fn from(error: RuntimeError) -> Self {
        let recoverable = error.recoverable();
        let error = avm_common::ApiError::from(error);
        Failure {
            recoverable,
            reason: error.reason.into_owned(),
            message: error.message,
        }
    }
}

/// The reply as it accumulates, and what the ledger needs of its call.
struct Reply {
    message_id: String,
    model: String,
    text: String,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_read_tokens: Option<u64>,
    cache_write_tokens: Option<u64>,
    started_at_ms: i64,
    started: Instant,
    /// Milliseconds from the start to the first text delta.
    first_token_ms: Option<i64>,
    /// Whether the provider accepted the request (it may bill for it).
    accepted: bool,
    /// The reply's complete tool calls, each stored as it completed.
    calls: Vec<ToolCall>,
    /// Whether a tool call could be neither stored nor kept to be stored.
    unstored: bool,
}

impl Reply {
    fn new(model: &str) -> Self {
        Self {
            message_id: new_id("msg"),
            model: model.to_owned(),
            text: String::new(),
            input_tokens: None,
            output_tokens: None,
            cache_read_tokens: None,
            cache_write_tokens: None,
            started_at_ms: avm_common::now_ms(),
            started: Instant::now(),
            first_token_ms: None,
            accepted: false,
            calls: Vec::new(),
            unstored: false,
        }
    }

    /// Takes what an event says of the call: its model and token counts.
    fn count(&mut self, event: &LlmEvent) {
        match event {
            LlmEvent::Start { model, input_tokens } => {
                if !model.is_empty() {
                    self.model.clone_from(model);
                }
                self.input_tokens = input_tokens.or(self.input_tokens);
            }
            LlmEvent::Usage {
                input_tokens,
                output_tokens,
            } => {
                self.input_tokens = input_tokens.or(self.input_tokens);
                self.output_tokens = output_tokens.or(self.output_tokens);
            }
            LlmEvent::CacheUsage {
                read_tokens,
                write_tokens,
            } => {
                self.cache_read_tokens = read_tokens.or(self.cache_read_tokens);
                self.cache_write_tokens = write_tokens.or(self.cache_write_tokens);
            }
            _ => {}
        }
    }

    fn usage(&self) -> Option<message::Usage> {
        (self.input_tokens.is_some() || self.output_tokens.is_some()).then(|| message::Usage {
            input_tokens: self.input_tokens.unwrap_or(0),
            output_tokens: self.output_tokens.unwrap_or(0),
        })
    }
}

/// Reaches the agent's MCP servers with the turn's caller's credentials; a
/// server left unavailable (unreachable, or refusing its credentials:
/// `needs_auth`) is told to the session's subscribers.
async fn prepare_tools(agent: &Agent, tools: &Toolbox, ctx: &RequestContext) {
    let caller = Caller {
        tenant_id: &ctx.tenant_id,
        user_id: &ctx.principal.user_id,
    };
    for (server, state) in tools.prepare(caller).await {
        let reason = match &state {
            ServerState::NeedsAuth => {
                format!("the MCP server {server} refused its credentials; store one with PUT /v1/credentials/{server}")
            }
            ServerState::Failed(why) => format!("the MCP server {server} is unavailable: {why}"),
            _ => String::new(),
        };
        agent.emit(data::McpServerState {
            agent_id: agent.agent_id.clone(),
            server: server.clone(),
            state: state.as_str().to_owned(),
            message: reason,
        });
    }
}

/// Runs one turn to its end, whoever is listening. Returns the text of the
/// last reply when the turn completed (`None` when interrupted or failed).
pub(crate) async fn run(
    ports: TurnPorts,
    agent: Arc<Agent>,
    ctx: RequestContext,
    llm: Arc<TenantLlm>,
    mut request: LlmRequest,
    cancel: CancellationToken,
) -> Option<String> {
    let mut last_reply = None;
    let in_flight = metrics::gauge!("avm_runtime_turns_in_flight");
    in_flight.increment(1.0);
    // MCP servers are reached when the first turn needs them, and listed
    // again when their tools changed.
    if let Some(tools) = &agent.tools {
        prepare_tools(&agent, tools, &ctx).await;
        request.tools = tools.specs();
    }
    let mut steps = 0;
    loop {
        steps += 1;
        let scope = CallScope {
            ports: &ports,
            ctx: &ctx,
            agent: &agent,
            llm: &llm,
        };
        // Near the model's window, older turns give way to a summary.
        let compactor = Compactor {
            sessions: &ports.sessions,
            outbox: &ports.outbox,
            identity: &ports.identity,
            ctx: &ctx,
            agent: &agent,
            config: &llm.config,
            cancel: &cancel,
        };
        let mut input = request_tokens(&request);
        if let Some((messages, tokens)) = compactor
            .compact(&request, input, |ask| summarize(&scope, ask, &cancel))
            .await
        {
            request.messages = messages;
            input = tokens;
        }
        let mut reply = Reply::new(&request.model);
        let outcome = metered_call(&scope, request, input, &cancel, &mut reply, Shown::Events).await;
        // Nothing is reported done that history will not hold: a tool call
        // neither stored nor kept ends the turn before its tools run.
        let outcome = match outcome {
            Outcome::Completed(_) if reply.unstored => Outcome::Failed(reply_not_stored()),
            outcome => outcome,
        };
        match outcome {
            Outcome::Completed(stop) if !reply.calls.is_empty() => {
                let usage = reply.usage().unwrap_or_default();
                agent.emit(data::MessageDelta { usage: usage.object() });
                agent.emit(data::MessageStop {
                    stop_reason: stop.as_str().to_owned(),
                });
                let mut said = Vec::new();
                if !reply.text.is_empty() {
                    let message = assistant_message(&agent, &reply, stop, false);
                    if !persist(&ports, &ctx, &message).await {
                        fail(&ports, &ctx, &agent, reply_not_stored()).await;
                        break;
                    }
                    agent.emit_message(&message);
                    said.push(LlmContent::Text(std::mem::take(&mut reply.text)));
                }
                said.extend(reply.calls.iter().cloned().map(LlmContent::ToolUse));
                agent.extend_history(LlmRole::Assistant, said);
                let Ran {
                    history,
                    interrupted,
                    stored,
                } = run_tools(&ports, &ctx, &agent, &reply.calls, &cancel).await;
                if !stored {
                    fail(&ports, &ctx, &agent, reply_not_stored()).await;
                    break;
                }
                if let Some(tools) = &agent.tools {
                    prepare_tools(&agent, tools, &ctx).await;
                }
                request = self::request(&llm.config, &agent, history);
                if interrupted {
                    agent.emit(interrupted_event(&agent));
                    tracing::info!(image_id = %agent.image.image_id, "turn interrupted while its tools ran");
                    agent.finish_turn(None, Some(conversation_end("interrupted")));
                    break;
                }
                if steps >= ports.limits.max_steps {
                    let failure = Failure {
                        reason: "TOOL_LOOP_LIMIT".to_owned(),
                        message: format!(
                            "the turn reached its limit of {} LLM calls while the model kept calling tools",
                            ports.limits.max_steps
                        ),
                        recoverable: true,
                    };
                    fail(&ports, &ctx, &agent, failure).await;
                    break;
                }
            }
            Outcome::Completed(stop) => {
                let usage = reply.usage().unwrap_or_default();
                agent.emit(data::MessageDelta { usage: usage.object() });
                agent.emit(data::MessageStop {
                    stop_reason: stop.as_str().to_owned(),
                });
                let message = assistant_message(&agent, &reply, stop, false);
                // Completed means stored, or kept to be stored: else the client is told.
                if !persist(&ports, &ctx, &message).await {
                    fail(&ports, &ctx, &agent, reply_not_stored()).await;
                    break;
                }
                agent.emit_message(&message);
                tracing::info!(
                    image_id = %agent.image.image_id,
                    input_tokens = usage.input_tokens,
                    output_tokens = usage.output_tokens,
                    steps,
                    "turn completed"
                );
                last_reply = Some(reply.text.clone());
                agent.finish_turn(Some(reply.text), Some(conversation_end("completed")));
                break;
            }
            Outcome::Interrupted => {
                let (_, answered) = answer_unrun(&ports, &ctx, &agent, &reply.calls).await;
                agent.emit(interrupted_event(&agent));
                agent.emit(data::MessageStop {
                    stop_reason: StopReason::EndTurn.as_str().to_owned(),
                });
                let message = assistant_message(&agent, &reply, StopReason::EndTurn, true);
                let stored = persist(&ports, &ctx, &message).await;
                if !(stored && answered && !reply.unstored) {
                    fail(&ports, &ctx, &agent, reply_not_stored()).await;
                    break;
                }
                agent.emit_message(&message);
                tracing::info!(image_id = %agent.image.image_id, chars = reply.text.len(), "turn interrupted");
                agent.finish_turn(Some(reply.text), Some(conversation_end("interrupted")));
                break;
            }
            Outcome::Failed(error) => {
                answer_unrun(&ports, &ctx, &agent, &reply.calls).await;
                fail(&ports, &ctx, &agent, error).await;
                break;
            }
        }
    }
    in_flight.decrement(1.0);
    // What the turn's tools changed goes to the workspace store, if one is
    // configured (a failure is logged; the next save tries again).
    if let Some(tools) = &agent.tools {
        let _ = tools.workspace().save().await;
    }
    last_reply
}

/// The failure of a turn whose reply the session service did not take and
/// the outbox could not keep.
fn reply_not_stored() -> Failure {
    Failure {
        reason: "REPLY_NOT_STORED".to_owned(),
        message: "the reply could not be stored, nor kept to be stored later (the session service is unavailable \
                  and the runtime's outbox is full or unreachable). Send the message again."
            .to_owned(),
        recoverable: true,
    }
}

/// Ends a turn with an error: `error_received → error_message → error_occurred`.
async fn fail(ports: &TurnPorts, ctx: &RequestContext, agent: &Agent, error: Failure) {
    let reason = error.reason.as_str();
    agent.emit(data::ErrorReceived {
        message: error.message.clone(),
        error_code: reason.to_owned(),
    });
    let body = MessageBody::Error {
        text: error.message.clone(),
        error_code: reason.to_owned(),
    };
    store(ports, ctx, agent, body).await;
    tracing::warn!(image_id = %agent.image.image_id, reason, "turn failed");
    let last = data::ErrorOccurred {
        code: reason.to_owned(),
        message: error.message,
        recoverable: error.recoverable,
    };
    agent.finish_turn(None, Some(last.into()));
}

/// What running a reply's tool calls left.
struct Ran {
    /// The conversation with the results.
    history: History,
    /// Whether the turn was interrupted while they ran.
    interrupted: bool,
    /// Whether every result was stored or kept to be stored.
    stored: bool,
}

/// Runs a reply's tool calls (several at once, results in call order),
/// storing and publishing each result and adding them to the conversation;
/// calls the turn left unrun are answered with an error result.
async fn run_tools(
    ports: &TurnPorts,
    ctx: &RequestContext,
    agent: &Arc<Agent>,
    calls: &[ToolCall],
    cancel: &CancellationToken,
) -> Ran {
    let toolbox = agent.tools.clone();
    let mut results = futures::stream::iter(calls.iter().cloned())
        .map(|call| {
            let toolbox = toolbox.clone();
            async move {
                let reply = match toolbox {
                    Some(toolbox) if call.name == Builtin::SpawnAgent.name() && toolbox.has(Builtin::SpawnAgent) => {
                        match ports.spawner.get() {
                            Some(spawn) => spawn(ctx.clone(), Arc::clone(agent), call.input.clone()).await,
                            None => ToolReply {
                                text: "spawn_agent is not available on this runtime".to_owned(),
                                is_error: true,
                            },
                        }
                    }
                    // A tool that panics fails its call, not the turn.
                    Some(toolbox) => std::panic::AssertUnwindSafe(toolbox.call(&call))
                        .catch_unwind()
                        .await
                        .unwrap_or_else(|_| ToolReply {
                            text: format!("{} failed unexpectedly and did not complete", call.name),
                            is_error: true,
                        }),
                    None => ToolReply {
                        text: format!("this agent has no tools; {:?} was not run", call.name),
                        is_error: true,
                    },
                };
                (call, reply)
            }
        })
        .buffered(ports.limits.tool_concurrency);
    let mut answered = 0;
    let mut outputs = Vec::with_capacity(calls.len());
    let mut stored = true;
    let interrupted = loop {
        let next = tokio::select! {
            biased;
            () = cancel.cancelled() => break true,
            next = results.next() => next,
        };
        let Some((call, reply)) = next else { break false };
        answered += 1;
        let (output, kept) = answer(ports, ctx, agent, &call, reply).await;
        stored &= kept;
        outputs.push(output);
    };
    drop(results);
    let (unrun, kept) = answer_unrun(ports, ctx, agent, &calls[answered..]).await;
    stored &= kept;
    outputs.extend(unrun);
    let history = agent.extend_history(LlmRole::User, outputs.into_iter().map(LlmContent::ToolResult).collect());
    Ran {
        history,
        interrupted,
        stored,
    }
}

/// Stores error results for calls the turn ended before running; returns
/// them, and whether every one was stored or kept.
async fn answer_unrun(
    ports: &TurnPorts,
    ctx: &RequestContext,
    agent: &Agent,
    calls: &[ToolCall],
) -> (Vec<ToolOutput>, bool) {
    let mut outputs = Vec::with_capacity(calls.len());
    let mut stored = true;
    for call in calls {
        let unrun = ToolReply {
            text: crate::context::UNANSWERED.to_owned(),
            is_error: true,
        };
        let (output, kept) = answer(ports, ctx, agent, call, unrun).await;
        stored &= kept;
        outputs.push(output);
    }
    (outputs, stored)
}

/// Publishes and stores one tool result; returns it as the conversation
/// holds it, and whether it was stored or kept to be stored.
async fn answer(
    ports: &TurnPorts,
    ctx: &RequestContext,
    agent: &Agent,
    call: &ToolCall,
    reply: ToolReply,
) -> (ToolOutput, bool) {
    let output = ToolOutput {
        tool_call_id: call.id.clone(),
        text: reply.text,
        is_error: reply.is_error,
    };
    agent.emit(data::ToolResult {
        tool_call_id: call.id.clone(),
        result: output.text.clone(),
        is_error: output.is_error,
    });
    let body = MessageBody::ToolResult {
        output: output.clone(),
        tool_name: call.name.clone(),
    };
    let stored = store(ports, ctx, agent, body).await;
    (output, stored)
}

/// Stores a new message of the turn and publishes the event that shows it;
/// returns whether it was stored or kept to be stored.
async fn store(ports: &TurnPorts, ctx: &RequestContext, agent: &Agent, body: MessageBody) -> bool {
    let message = Message {
        message_id: new_id("msg"),
        session_id: agent.image.session_id.clone(),
        created_at_ms: avm_common::now_ms(),
        body,
    };
    let stored = persist(ports, ctx, &message).await;
    agent.emit_message(&message);
    stored
}

async fn stream_reply(
    scope: &CallScope<'_>,
    request: LlmRequest,
    cancel: &CancellationToken,
    reply: &mut Reply,
    shown: Shown,
) -> Outcome {
    let CallScope { ports, ctx, agent, llm } = *scope;
    let provider = llm.provider.as_ref();
    let shown = shown == Shown::Events;
    let mut stream = tokio::select! {
        biased;
        () = cancel.cancelled() => return Outcome::Interrupted,
        result = provider.stream(request) => match result {
            Ok(stream) => stream,
            Err(error) => return Outcome::Failed(error.into()),
        },
    };
    reply.accepted = true;
    if shown {
        agent.emit(data::MessageStart {
            message_id: reply.message_id.clone(),
            model: reply.model.clone(),
        });
        agent.emit(data::ConversationStart {
            message_id: reply.message_id.clone(),
        });
    }
    loop {
        // Dropping `stream` on return aborts the provider request.
        let item = tokio::select! {
            biased;
            () = cancel.cancelled() => return Outcome::Interrupted,
            item = stream.next() => item,
        };
        match item {
            Some(Ok(LlmEvent::TextDelta(text))) => {
                if text.is_empty() {
                    continue;
                }
                if reply.first_token_ms.is_none() {
                    reply.first_token_ms = Some(elapsed_ms(reply.started));
                }
                reply.text.push_str(&text);
                if shown {
                    agent.emit(data::TextDelta { text });
                    agent.emit(data::ConversationResponding {});
                }
            }
            Some(Ok(event @ (LlmEvent::Start { .. } | LlmEvent::Usage { .. } | LlmEvent::CacheUsage { .. }))) => {
                reply.count(&event);
            }
            // A call not shown offers no tools: one the model makes anyway is not run.
            Some(Ok(LlmEvent::ToolUseStart { .. } | LlmEvent::ToolInputDelta { .. } | LlmEvent::ToolUseStop(_)))
                if !shown => {}
            Some(Ok(LlmEvent::ToolUseStart { id, name })) => {
                if reply.first_token_ms.is_none() {
                    reply.first_token_ms = Some(elapsed_ms(reply.started));
                }
                agent.emit(data::ToolUseStart {
                    tool_call_id: id.clone(),
                    tool_name: name.clone(),
                });
                agent.emit(data::ToolPlanned {
                    tool_id: id.clone(),
                    tool_name: name.clone(),
                });
                agent.emit(data::ToolExecuting {
                    tool_id: id,
                    tool_name: name,
                    input: Value::Object(serde_json::Map::new()),
                });
            }
            Some(Ok(LlmEvent::ToolInputDelta { partial_json, .. })) => {
                agent.emit(data::InputJsonDelta { partial_json });
            }
            Some(Ok(LlmEvent::ToolUseStop(call))) => {
                agent.emit(data::ToolUseStop {
                    tool_call_id: call.id.clone(),
                    tool_name: call.name.clone(),
                    input: call.input.clone(),
                });
                let body = MessageBody::ToolCall {
                    call: call.clone(),
                    parent_id: reply.message_id.clone(),
                };
                if !store(ports, ctx, agent, body).await {
                    reply.unstored = true;
                }
                reply.calls.push(call);
            }
            Some(Ok(LlmEvent::Stop { reason })) => return Outcome::Completed(reason),
            Some(Err(error)) => return Outcome::Failed(error.into()),
            None => {
                return Outcome::Failed(
                    LlmError::new(
                        LlmErrorKind::BadResponse,
                        "the LLM provider's stream ended before the reply was complete",
                    )
                    .into(),
                );
            }
        }
    }
}

/// Whether a call's reply is streamed to the session as events.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// As the turn's reply: deltas, tool calls and their events.
    Events,
    /// Not at all (a summary the agent makes for itself).
    Quiet,
}

/// Who an LLM call is made for and what it runs with.
struct CallScope<'a> {
    ports: &'a TurnPorts,
    ctx: &'a RequestContext,
    agent: &'a Agent,
    llm: &'a TenantLlm,
}

/// Makes one LLM call, metered: the budget check first, which reserves its
/// estimated price and tokens until its record settles them (a refused
/// call is not made); its record opened as it goes out, so a crash during
/// it still bills it; one record in the ledger when it ends, from which
/// the token quota is derived too.
async fn metered_call(
    scope: &CallScope<'_>,
    request: LlmRequest,
    input_tokens: u64,
    cancel: &CancellationToken,
    reply: &mut Reply,
    shown: Shown,
) -> Outcome {
    let CallScope { ports, ctx, agent, llm } = *scope;
    let estimate = estimate(llm, &request, input_tokens);
    let reserved = Estimate {
        pico_usd: estimate.1.billed_pico_usd,
        tokens: estimate.0.input.saturating_add(estimate.0.output),
    };
    if let Err(refused) = ports.metering.check_budget(ctx, &reply.message_id, reserved).await {
        return Outcome::Failed(Failure::from(refused));
    }
    let open = call_record(agent, ctx, llm, reply, estimate);
    ports.metering.open_call(UsageRecord {
        estimated: true,
        ..open
    });
    let outcome = stream_reply(scope, request, cancel, reply, shown).await;
    let record = usage_record(agent, ctx, llm, reply, &outcome, input_tokens);
    ports.metering.record(ctx, record).await;
    outcome
}

/// Asks the model for a summary (a compaction's), metered like any call and
/// not shown to the session; `None` when it fails or is cut short.
async fn summarize(scope: &CallScope<'_>, request: LlmRequest, cancel: &CancellationToken) -> Option<String> {
    let image_id = &scope.agent.image.image_id;
    let mut reply = Reply::new(&request.model);
    let input = request_tokens(&request);
    match metered_call(scope, request, input, cancel, &mut reply, Shown::Quiet).await {
        Outcome::Completed(_) if !reply.text.trim().is_empty() => Some(reply.text),
        Outcome::Completed(_) => {
            tracing::warn!(%image_id, "the model's summary was empty; older turns are dropped");
            None
        }
        Outcome::Interrupted => None,
        Outcome::Failed(failure) => {
            tracing::warn!(%image_id, reason = %failure.reason, "the model could not summarise; older turns are dropped");
            None
        }
    }
}

/// Returns `true` the first time this process meets `model` without a
/// price: the warning is worth one line, not one per call (and each line
/// is a row in the log store). Past 1,024 models (tenants may name
/// models at will) it stays quiet.
fn first_unpriced(model: &str) -> bool {
    static SEEN: std::sync::Mutex<Option<std::collections::HashSet<String>>> = std::sync::Mutex::new(None);
    const UNPRICED_KEPT: usize = 1024;
    let mut seen = SEEN.lock().unwrap_or_else(|poison| poison.into_inner());
    let seen = seen.get_or_insert_with(Default::default);
    seen.len() < UNPRICED_KEPT && seen.insert(model.to_owned())
}

/// Returns the milliseconds since `start`.
fn elapsed_ms(start: Instant) -> i64 {
    i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX)
}

/// The most a call of `request` is expected to use and bill, which its
/// budget check reserves and which is billed if the call is cut by a crash:
/// its `input` tokens ([`request_tokens`]) plus `max_tokens` of output, at
/// the model's price and markup.
fn estimate(llm: &TenantLlm, request: &LlmRequest, input: u64) -> (Tokens, Charge) {
    let tokens = Tokens {
        input,
        output: u64::from(request.max_tokens),
        cache_read: 0,
        cache_write: 0,
    };
    let charged = charge(
        &llm.billing,
        llm.config.provider_kind(),
        &request.model,
        tokens,
        llm.own_key,
    );
    (tokens, charged)
}

/// Returns the ledger record of the turn's LLM call.
///
/// The counts are the provider's own. Where a cut stream left one unknown it
/// is estimated and the record says so: the input of a call the provider
/// accepted but never counted (`input_tokens`, [`request_tokens`]), the
/// output of a reply it streamed without a final count (a quarter of its
/// text's UTF-8 bytes). A call the provider refused outright counts nothing.
fn usage_record(
    agent: &Agent,
    ctx: &RequestContext,
    llm: &TenantLlm,
    reply: &Reply,
    outcome: &Outcome,
    input_tokens: u64,
) -> UsageRecord {
    let mut estimated = false;
    let mut known_or_estimate = |known: Option<u64>, estimate: u64| {
        known.unwrap_or_else(|| {
            if reply.accepted && estimate > 0 {
                estimated = true;
                estimate
            } else {
                0
            }
        })
    };
    let tokens = Tokens {
        input: known_or_estimate(reply.input_tokens, input_tokens),
        output: known_or_estimate(reply.output_tokens, estimate_tokens(reply.text.len())),
        cache_read: reply.cache_read_tokens.unwrap_or(0),
        cache_write: reply.cache_write_tokens.unwrap_or(0),
    };
    let charged = charge(
        &llm.billing,
        llm.config.provider_kind(),
        &reply.model,
        tokens,
        llm.own_key,
    );
    if !charged.priced && llm.config.provider_kind() != ProviderKind::Offline && first_unpriced(&reply.model) {
        tracing::warn!(model = %reply.model, "no price for this model: its calls cost 0 (set billing.prices); said once per model");
    }
    let (status, error_code) = match outcome {
        Outcome::Completed(_) => (CallStatus::Completed, String::new()),
        Outcome::Interrupted => (CallStatus::Interrupted, String::new()),
        Outcome::Failed(failure) => (CallStatus::Failed, failure.reason.clone()),
    };
    let provider = llm.config.provider_kind().as_str();
    metrics::counter!("avm_runtime_llm_calls_total", "provider" => provider, "status" => status_label(status))
        .increment(1);
    for (kind, count) in [
        ("input", tokens.input),
        ("output", tokens.output),
        ("cache_read", tokens.cache_read),
        ("cache_write", tokens.cache_write),
    ] {
        metrics::counter!("avm_runtime_llm_tokens_total", "provider" => provider, "kind" => kind).increment(count);
    }
    if let Some(first) = reply.first_token_ms {
        metrics::histogram!("avm_runtime_llm_first_token_seconds", "provider" => provider)
            .record(first as f64 / 1000.0);
    }
    UsageRecord {
        estimated,
        status: status.into(),
        error_code,
        ended_at_ms: reply.started_at_ms + elapsed_ms(reply.started),
        first_token_ms: reply.first_token_ms.unwrap_or(0),
        ..call_record(agent, ctx, llm, reply, (tokens, charged))
    }
}

/// Returns the record of the reply's call with `usage`, as it stands when
/// the call starts (completed, nothing streamed yet).
fn call_record(
    agent: &Agent,
    ctx: &RequestContext,
    llm: &TenantLlm,
    reply: &Reply,
    (tokens, charged): (Tokens, Charge),
) -> UsageRecord {
    UsageRecord {
        call_id: reply.message_id.clone(),
        tenant_id: ctx.tenant_id.clone(),
        user_id: ctx.principal.user_id.clone(),
        key_id: ctx.principal.key_id.clone().unwrap_or_default(),
        container_id: agent.image.container_id.clone(),
        image_id: agent.image.image_id.clone(),
        agent_id: agent.agent_id.clone(),
        provider: llm.config.provider_kind().as_str().to_owned(),
        model: reply.model.clone(),
        input_tokens: tokens.input,
        output_tokens: tokens.output,
        cache_read_tokens: tokens.cache_read,
        cache_write_tokens: tokens.cache_write,
        estimated: false,
        status: CallStatus::Completed.into(),
        error_code: String::new(),
        started_at_ms: reply.started_at_ms,
        ended_at_ms: reply.started_at_ms,
        first_token_ms: 0,
        cost_pico_usd: charged.cost_pico_usd,
        billed_pico_usd: charged.billed_pico_usd,
        priced: charged.priced,
        own_key: llm.own_key,
    }
}

fn assistant_message(agent: &Agent, reply: &Reply, stop: StopReason, interrupted: bool) -> Message {
    Message {
        message_id: reply.message_id.clone(),
        session_id: agent.image.session_id.clone(),
        created_at_ms: avm_common::now_ms(),
        body: MessageBody::Assistant(message::Reply {
            text: reply.text.clone(),
            usage: reply.usage(),
            interrupted,
            model: reply.model.clone(),
            stop_reason: stop.as_str().to_owned(),
            resources: agent.plan.resources.clone(),
        }),
    }
}

/// How long a turn tries to store one message before it goes on without:
/// a database that is down makes each try wait for its pool, and the turn's
/// subscribers wait meanwhile.
const PERSIST_WITHIN: std::time::Duration = std::time::Duration::from_secs(8);

/// Stores a finished message, retrying while the session service is briefly
/// unavailable (appends are idempotent on the message id), for at most
/// [`PERSIST_WITHIN`]; when it stays unavailable the message is kept in the
/// outbox, stored when the service is back. A message of a session with
/// messages in the outbox goes behind them, so history keeps its order.
/// Returns whether it was stored or kept; otherwise (the outbox full, or a
/// refusal that no retry changes) it is logged and lost.
///
/// The runtime stores it as itself, for the caller's tenant: the caller's
/// token may expire before a long turn ends, and the reply belongs to the
/// conversation whether or not its caller is still there.
async fn persist(ports: &TurnPorts, ctx: &RequestContext, message: &Message) -> bool {
    if ports.outbox.holds(&ctx.tenant_id, &message.session_id) {
        return ports.outbox.keep(&ctx.tenant_id, message).await.is_ok();
    }
    let mut backoff = Backoff::new(std::time::Duration::from_millis(50), PERSIST_WITHIN);
    let mut pause = backoff.next_pause();
    let deadline = tokio::time::Instant::now() + PERSIST_WITHIN;
    for attempt in 1..=5 {
        let appended = tokio::time::timeout_at(deadline, async {
            match ports.identity.context_for(ctx).await {
                Ok(own) => ports.sessions.append(&own, message).await,
                Err(err) => Err(err.into()),
            }
        })
        .await;
        let err = match appended {
            Ok(Ok(_)) => return true,
            Ok(Err(err)) => avm_common::ApiError::from(err),
            Err(_) => {
                avm_common::ApiError::unavailable("PERSIST_TIMEOUT", "the session service did not store it in time")
            }
        };
        let time_left = tokio::time::Instant::now() + pause < deadline;
        let unavailable = matches!(err.code, Code::Unavailable | Code::DeadlineExceeded);
        if attempt < 5 && time_left && unavailable {
            tracing::warn!(message_id = %message.message_id, attempt, error = %err, "retrying message persistence");
            tokio::time::sleep(pause).await;
            pause = backoff.next_pause();
        } else if unavailable {
            return ports.outbox.keep(&ctx.tenant_id, message).await.is_ok();
        } else {
            tracing::error!(message_id = %message.message_id, reason = %err.reason, error = %err, "cannot persist message");
            return false;
        }
    }
    false
}

/// The event of an interrupted turn.
fn interrupted_event(agent: &Agent) -> data::Interrupted {
    data::Interrupted {
        agent_id: agent.agent_id.clone(),
        container_id: agent.image.container_id.clone(),
    }
}

/// The last event of a turn that ended for `reason`.
fn conversation_end(reason: &str) -> Event {
    data::ConversationEnd {
        reason: reason.to_owned(),
    }
    .into()
}
