//! One turn of an agent: stream the LLM's reply as events, then persist it.
//!
//! Event order follows PROTOCOL.md: `message_start → conversation_start →
//! (text_delta → conversation_responding)* → message_delta → message_stop →
//! assistant_message → conversation_end`; an interrupt emits `interrupted →
//! message_stop → assistant_message → conversation_end{interrupted}`; a failure
//! `error_received → error_message → error_occurred`.

use std::sync::Arc;

use avm_common::ids::new_id;
use avm_common::{Code, RequestContext, wire};
use avm_proto::session::v1 as pb;
use futures::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::LlmConfig;
use crate::llm::{LlmError, LlmErrorKind, LlmEvent, LlmMessage, LlmProvider, LlmRequest, StopReason};
use crate::resources::AgentPlan;
use crate::service::{Agent, PoolInner};

/// Returns the LLM request for the conversation so far: the tenant's
/// settings, under what the agent's definition chose.
pub(crate) fn request(config: &LlmConfig, plan: &AgentPlan, messages: Vec<LlmMessage>) -> LlmRequest {
    LlmRequest {
        model: plan.model.clone().unwrap_or_else(|| config.model.clone()),
        system: plan.system_prompt.clone(),
        messages,
        max_tokens: plan.max_tokens.unwrap_or(config.max_tokens),
    }
}

enum Outcome {
    Completed(StopReason),
    Interrupted,
    Failed(LlmError),
}

/// The reply as it accumulates.
struct Reply {
    message_id: String,
    model: String,
    text: String,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

impl Reply {
    fn usage(&self) -> Option<pb::Usage> {
        (self.input_tokens.is_some() || self.output_tokens.is_some()).then(|| pb::Usage {
            input_tokens: self.input_tokens.unwrap_or(0),
            output_tokens: self.output_tokens.unwrap_or(0),
        })
    }
}

/// Runs one turn to its end, whoever is listening.
pub(crate) async fn run(
    pool: Arc<PoolInner>,
    agent: Arc<Agent>,
    ctx: RequestContext,
    provider: Arc<dyn LlmProvider>,
    request: LlmRequest,
    cancel: CancellationToken,
) {
    let mut reply = Reply {
        message_id: new_id("msg"),
        model: request.model.clone(),
        text: String::new(),
        input_tokens: None,
        output_tokens: None,
    };
    let outcome = stream_reply(provider.as_ref(), &agent, request, &cancel, &mut reply).await;
    report_usage(&pool, &ctx, &reply);
    let session_id = agent.image.session_id.clone();
    match outcome {
        Outcome::Completed(stop) => {
            let usage = reply.usage().unwrap_or_default();
            agent.emit("message_delta", &json!({"usage": wire::usage_object(&usage)}));
            agent.emit("message_stop", &json!({"stopReason": stop.as_str()}));
            let message = assistant_message(&agent, &reply, stop, false);
            persist(&pool, &ctx, &message).await;
            agent.emit("assistant_message", &wire::message_object(&message));
            agent.emit("conversation_end", &json!({"reason": "completed"}));
            tracing::info!(image_id = %agent.image.image_id, output_tokens = ?reply.output_tokens, "turn completed");
            agent.finish_turn(Some(reply.text));
        }
        Outcome::Interrupted => {
            agent.emit(
                "interrupted",
                &json!({"agentId": agent.agent_id, "containerId": agent.image.container_id}),
            );
            agent.emit("message_stop", &json!({"stopReason": StopReason::EndTurn.as_str()}));
            let message = assistant_message(&agent, &reply, StopReason::EndTurn, true);
            persist(&pool, &ctx, &message).await;
            agent.emit("assistant_message", &wire::message_object(&message));
            agent.emit("conversation_end", &json!({"reason": "interrupted"}));
            tracing::info!(image_id = %agent.image.image_id, chars = reply.text.len(), "turn interrupted");
            agent.finish_turn(Some(reply.text));
        }
        Outcome::Failed(error) => {
            let reason = error.kind.reason();
            agent.emit(
                "error_received",
                &json!({"message": error.message, "errorCode": reason}),
            );
            let message = pb::Message {
                message_id: new_id("msg"),
                session_id,
                created_at_ms: avm_common::now_ms(),
                seq: 0,
                body: Some(pb::message::Body::Error(pb::ErrorMessage {
                    text: error.message.clone(),
                    error_code: reason.to_owned(),
                })),
            };
            persist(&pool, &ctx, &message).await;
            agent.emit("error_message", &wire::message_object(&message));
            agent.emit(
                "error_occurred",
                &json!({"code": reason, "message": error.message, "recoverable": error.kind.recoverable()}),
            );
            tracing::warn!(image_id = %agent.image.image_id, reason, "turn failed");
            agent.finish_turn(None);
        }
    }
}

async fn stream_reply(
    provider: &dyn LlmProvider,
    agent: &Agent,
    request: LlmRequest,
    cancel: &CancellationToken,
    reply: &mut Reply,
) -> Outcome {
    let mut stream = tokio::select! {
        biased;
        () = cancel.cancelled() => return Outcome::Interrupted,
        result = provider.stream(request) => match result {
            Ok(stream) => stream,
            Err(error) => return Outcome::Failed(error),
        },
    };
    agent.emit(
        "message_start",
        &json!({"messageId": reply.message_id, "model": reply.model}),
    );
    agent.emit("conversation_start", &json!({"messageId": reply.message_id}));
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
                agent.emit("text_delta", &json!({"text": text}));
                agent.emit("conversation_responding", &json!({}));
                reply.text.push_str(&text);
            }
            Some(Ok(LlmEvent::Start { model, input_tokens })) => {
                if !model.is_empty() {
                    reply.model = model;
                }
                reply.input_tokens = input_tokens.or(reply.input_tokens);
            }
            Some(Ok(LlmEvent::Usage {
                input_tokens,
                output_tokens,
            })) => {
                reply.input_tokens = input_tokens.or(reply.input_tokens);
                reply.output_tokens = output_tokens.or(reply.output_tokens);
            }
            Some(Ok(LlmEvent::Stop { reason })) => return Outcome::Completed(reason),
            Some(Err(error)) => return Outcome::Failed(error),
            None => {
                return Outcome::Failed(LlmError::new(
                    LlmErrorKind::BadResponse,
                    "the LLM provider's stream ended before the reply was complete",
                ));
            }
        }
    }
}

fn assistant_message(agent: &Agent, reply: &Reply, stop: StopReason, interrupted: bool) -> pb::Message {
    pb::Message {
        message_id: reply.message_id.clone(),
        session_id: agent.image.session_id.clone(),
        created_at_ms: avm_common::now_ms(),
        seq: 0,
        body: Some(pb::message::Body::Assistant(pb::AssistantMessage {
            text: reply.text.clone(),
            usage: reply.usage(),
            interrupted,
            model: reply.model.clone(),
            stop_reason: stop.as_str().to_owned(),
            resources: agent.plan.resources.clone(),
        })),
    }
}

/// Stores a finished message, retrying while the session service is briefly
/// unavailable (appends are idempotent on the message id); a lasting failure is
/// logged and the conversation goes on.
///
/// The runtime stores it as itself, for the caller's tenant: the caller's
/// token may expire before a long turn ends, and the reply belongs to the
/// conversation whether or not its caller is still there.
async fn persist(pool: &PoolInner, ctx: &RequestContext, message: &pb::Message) {
    let mut backoff = std::time::Duration::from_millis(50);
    for attempt in 1..=5 {
        let appended = match pool.identity.context_for(&ctx.tenant_id, &ctx.request_id).await {
            Ok(own) => pool.sessions.append(&own, message.clone()).await,
            Err(err) => Err(err),
        };
        match appended {
            Ok(_) => return,
            Err(err) if attempt < 5 && matches!(err.code, Code::Unavailable | Code::DeadlineExceeded) => {
                tracing::warn!(message_id = %message.message_id, attempt, error = %err, "retrying message persistence");
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
            Err(err) => {
                tracing::error!(message_id = %message.message_id, reason = %err.reason, error = %err, "cannot persist message");
                return;
            }
        }
    }
}

/// Reports the tokens of one LLM call to the auth service, which counts them
/// against the tenant's and the key's monthly quota. It runs beside the turn;
/// the report id (the reply's message id) makes a retried report count once.
fn report_usage(pool: &Arc<PoolInner>, ctx: &RequestContext, reply: &Reply) {
    let (input_tokens, output_tokens) = (reply.input_tokens.unwrap_or(0), reply.output_tokens.unwrap_or(0));
    if input_tokens == 0 && output_tokens == 0 {
        return;
    }
    let report = avm_proto::auth::v1::RecordUsageRequest {
        tenant_id: ctx.tenant_id.clone(),
        key_id: ctx.principal.key_id.clone(),
        input_tokens,
        output_tokens,
        report_id: reply.message_id.clone(),
    };
    let pool = Arc::clone(pool);
    let (tenant_id, request_id) = (ctx.tenant_id.clone(), ctx.request_id.clone());
    tokio::spawn(async move {
        let mut backoff = std::time::Duration::from_millis(100);
        for attempt in 1..=5 {
            let result = match pool.identity.context_for(&tenant_id, &request_id).await {
                Ok(own) => pool
                    .identity
                    .client()
                    .record_usage(own.request(report.clone()))
                    .await
                    .map_err(avm_common::ApiError::from),
                Err(err) => Err(err),
            };
            match result {
                Ok(_) => return,
                Err(err)
                    if attempt < 5
                        && matches!(
                            err.code,
                            Code::Unavailable | Code::DeadlineExceeded | Code::Unauthenticated
                        ) =>
                {
                    tracing::warn!(report_id = %report.report_id, attempt, error = %err, "retrying usage report");
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
                Err(err) => {
                    tracing::error!(report_id = %report.report_id, reason = %err.reason, error = %err, "cannot report usage");
                    return;
                }
            }
        }
    });
}
