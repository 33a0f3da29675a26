//! Retention: the tenant's policy (how long messages and idle conversations
//! are kept, how many conversations a container keeps) and sweeps that apply
//! it now. Usage records are never deleted, whatever the policy says.

use avm_common::{ApiError, RequestContext};
use avm_proto::session::v1 as pb;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::peers::Peers;

/// The tenant's retention policy; `null` sets no limit.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetentionPolicy {
    /// Messages older than this many days are deleted.
    pub message_days: Option<u32>,
    /// Conversations (with their messages) whose last activity is older
    /// than this many days are deleted.
    pub idle_conversation_days: Option<u32>,
    /// Each container keeps this many of its most recently active
    /// conversations; the others are deleted.
    pub max_conversations_per_container: Option<u32>,
    /// When it was last set (Unix ms); absent when never.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<i64>,
}

/// The whole new policy; a field left out or `null` sets no limit. Other
/// fields are refused.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetentionPolicyUpdate {
    /// 1 to 36500 days.
    #[serde(default)]
    pub message_days: Option<u32>,
    /// 1 to 36500 days.
    #[serde(default)]
    pub idle_conversation_days: Option<u32>,
    /// 1 to 100000 conversations.
    #[serde(default)]
    pub max_conversations_per_container: Option<u32>,
}

/// Whether a sweep deletes or only counts.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SweepQuery {
    /// Delete nothing; say what a sweep would delete (default false).
    pub dry_run: Option<bool>,
}

/// What a sweep deleted, or would delete. One sweep deletes at most 1000
/// messages and 100 conversations; a larger backlog takes several.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SweepResult {
    pub dry_run: bool,
    /// Messages deleted on their own (those of deleted conversations aside).
    pub deleted_messages: u64,
    /// Conversations deleted.
    pub deleted_conversations: u64,
    /// The deleted conversations' image ids, at most 100.
    pub image_ids: Vec<String>,
    /// A bound stopped the sweep: the next one may delete more.
    pub limit_reached: bool,
}

fn policy(policy: Option<pb::RetentionPolicy>) -> RetentionPolicy {
    let policy = policy.unwrap_or_default();
    RetentionPolicy {
        message_days: policy.message_days,
        idle_conversation_days: policy.idle_conversation_days,
        max_conversations_per_container: policy.max_conversations_per_container,
        updated_at: Some(policy.updated_at_ms).filter(|at| *at > 0),
    }
}

/// Returns the caller's tenant's policy.
pub async fn get(peers: &Peers, ctx: &RequestContext) -> Result<RetentionPolicy, ApiError> {
    let call = ctx.request(pb::GetRetentionPolicyRequest {});
    let response = peers.session.get_retention_policy(call).await?.into_inner();
    Ok(policy(response.policy))
}

/// Sets the caller's tenant's policy (its admins).
pub async fn set(
    peers: &Peers,
    ctx: &RequestContext,
    update: RetentionPolicyUpdate,
) -> Result<RetentionPolicy, ApiError> {
    let call = ctx.request(pb::SetRetentionPolicyRequest {
        message_days: update.message_days,
        idle_conversation_days: update.idle_conversation_days,
        max_conversations_per_container: update.max_conversations_per_container,
    });
    let response = peers.session.set_retention_policy(call).await?.into_inner();
    Ok(policy(response.policy))
}

/// Applies the caller's tenant's policy now (its admins).
pub async fn sweep(peers: &Peers, ctx: &RequestContext, query: SweepQuery) -> Result<SweepResult, ApiError> {
    let call = ctx.request(pb::SweepRetentionRequest {
        dry_run: query.dry_run.unwrap_or(false),
    });
    let report = peers.session.sweep_retention(call).await?.into_inner();
    Ok(SweepResult {
        dry_run: report.dry_run,
        deleted_messages: report.deleted_messages,
        deleted_conversations: report.deleted_conversations,
        image_ids: report.image_ids,
        limit_reached: report.limit_reached,
    })
}
