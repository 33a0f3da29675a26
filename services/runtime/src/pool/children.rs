//! Child agents: `spawn_agent` creates an image below the calling agent's
//! (same container, one level deeper), gives its agent the task as its
//! first message and answers with the child's reply, or at once with the
//! child's id when the caller does not wait. Depth and count are bounded;
//! terminating a parent terminates its children (the session service does).

use std::sync::Arc;

use avm_common::RequestContext;
use avm_common::event::data;
use serde_json::{Value, json};

use super::{AgentPool, PoolInner};
use crate::agent::Agent;
use crate::message::{Content, Part};
use crate::peers::NewChild;
use crate::peers::groups::{agent_member, user_member};
use crate::tools::ToolReply;

/// What a `spawn_agent` call asks for.
struct Spawn {
    task: String,
    prompt: Option<String>,
    agent: Option<String>,
    name: Option<String>,
    tools: Vec<String>,
    group_id: Option<String>,
    /// The name of a new group of the parent and the child.
    new_group: Option<String>,
    wait: bool,
}

impl Spawn {
    fn parse(input: &Value) -> Result<Self, String> {
        let text = |field: &str| -> Result<Option<String>, String> {
            match input.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(text)) if text.trim().is_empty() => Ok(None),
                Some(Value::String(text)) => Ok(Some(text.clone())),
                Some(_) => Err(format!("`{field}` must be a string")),
            }
        };
        let task = text("task")?.ok_or("`task` is required: what the child is to do")?;
        let tools = match input.get("tools") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(names)) => names
                .iter()
                .map(|name| name.as_str().map(str::to_owned).ok_or("`tools` must be strings"))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err("`tools` must be a list of tool names".to_owned()),
        };
        let wait = match input.get("wait") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(wait)) => *wait,
            Some(_) => return Err("`wait` must be true or false".to_owned()),
        };
        let (group_id, new_group) = (text("groupId")?, text("newGroup")?);
        if group_id.is_some() && new_group.is_some() {
            return Err("give `groupId` (a group to join) or `newGroup` (a group to make), not both".to_owned());
        }
        Ok(Self {
            task,
            prompt: text("prompt")?,
            agent: text("agent")?,
            name: text("name")?,
            tools,
            group_id,
            new_group,
            wait,
        })
    }
}

impl AgentPool {
    /// Lets the agents' turns run `spawn_agent` on this pool.
    pub(super) fn serve_spawns(&self) {
        let pool = Arc::downgrade(&self.inner);
        let spawner: crate::turn::Spawner = Arc::new(move |ctx, parent, input| {
            let pool = pool.clone();
            Box::pin(async move {
                match pool.upgrade() {
                    Some(inner) => AgentPool::of(inner).spawn_child(ctx, parent, input).await,
                    None => ToolReply::error("the runtime is stopping".to_owned()),
                }
            })
        });
        let _ = self.inner.ports.spawner.set(spawner);
    }

    fn of(inner: Arc<PoolInner>) -> Self {
        Self { inner }
    }

    /// Runs a `spawn_agent` call of `parent`'s turn; every failure is a
    /// result the parent's model reads.
    async fn spawn_child(&self, ctx: RequestContext, parent: Arc<Agent>, input: Value) -> ToolReply {
        match self.try_spawn(&ctx, &parent, &input).await {
            Ok(reply) => reply,
            Err(failure) => ToolReply::error(failure),
        }
    }

    async fn try_spawn(&self, ctx: &RequestContext, parent: &Agent, input: &Value) -> Result<ToolReply, String> {
        let spawn = Spawn::parse(input)?;
        let config = &self.inner.config;
        if parent.image.depth >= config.max_agent_depth {
            return Err(format!(
                "this agent is {} levels below the first; child agents go at most {} deep",
                parent.image.depth, config.max_agent_depth
            ));
        }
        if let Some(tool) = spawn.tools.iter().find(|tool| !parent.image.tools.contains(tool)) {
            return Err(format!(
                "a child may use only this agent's tools, and {tool:?} is not one"
            ));
        }
        let children = self
            .sessions()
            .children(ctx, &parent.image.image_id)
            .await
            .map_err(|err| format!("cannot count this agent's children: {err}"))?;
        if children.len() >= config.max_children_per_agent {
            return Err(format!(
                "this agent has started {} child agents, its limit",
                config.max_children_per_agent
            ));
        }
        let child = self
            .sessions()
            .create_child_image(
                ctx,
                NewChild {
                    container_id: parent.image.container_id.clone(),
                    parent_image_id: parent.image.image_id.clone(),
                    name: spawn
                        .name
                        .unwrap_or_else(|| format!("{} / child {}", parent.image.name, children.len() + 1)),
                    system_prompt: spawn.prompt,
                    agent: spawn.agent,
                    tools: spawn.tools,
                },
            )
            .await
            .map_err(|err| format!("cannot create the child agent: {err}"))?;
        metrics::counter!("avm_runtime_child_agents_started_total").increment(1);
        tracing::info!(parent_image_id = %parent.image.image_id, child_image_id = %child.image_id, depth = child.depth, "child agent started");
        let made_group = match &spawn.new_group {
            Some(name) => {
                let mut members = vec![agent_member(&parent.image.image_id), agent_member(&child.image_id)];
                // The user whose message the parent answers takes part too.
                if ctx.principal.role != avm_common::auth::Role::Service {
                    members.push(user_member(&ctx.principal.user_id));
                }
                let group_id = self
                    .sessions()
                    .create_group(ctx, &parent.image.container_id, name, &members)
                    .await
                    .map_err(|err| {
                        format!(
                            "the child agent {} was started but the group {name:?} cannot be made: {err}",
                            child.image_id
                        )
                    })?;
                Some(group_id)
            }
            None => None,
        };
        parent.emit(data::AgentSpawned {
            parent_image_id: parent.image.image_id.clone(),
            child_image_id: child.image_id.clone(),
            session_id: child.session_id.clone(),
            depth: child.depth,
            group_id: made_group.clone(),
        });
        if let Some(group_id) = &spawn.group_id {
            self.sessions()
                .add_group_member(ctx, group_id, &agent_member(&child.image_id))
                .await
                .map_err(|err| {
                    format!(
                        "the child agent {} was started but cannot join {group_id}: {err}",
                        child.image_id
                    )
                })?;
        }
        let task = Content {
            parts: vec![Part::Text(spawn.task)],
            plain_text: true,
        };
        let (_, turn) = self
            .start_turn(ctx, &child.image_id, task, None)
            .await
            .map_err(|err| format!("the child agent {} could not start: {err}", child.image_id))?;
        if !spawn.wait {
            let mut started = json!({"childImageId": child.image_id, "sessionId": child.session_id});
            if let Some(group_id) = made_group {
                started["groupId"] = json!(group_id);
            }
            return Ok(ToolReply::ok(started.to_string()));
        }
        match turn.await {
            Ok(Some(answer)) => Ok(ToolReply::ok(answer)),
            _ => Err(format!(
                "the child agent {} ended its turn without an answer (see its session {})",
                child.image_id, child.session_id
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawn_needs_a_task_and_waits_by_default() {
        let spawn = Spawn::parse(&json!({"task": "sum 2 and 2", "tools": ["read_file"]})).map_err(|e| e.to_string());
        let spawn = spawn.as_ref().map(|s| (s.task.as_str(), s.wait, s.tools.clone()));
        assert_eq!(spawn, Ok(("sum 2 and 2", true, vec!["read_file".to_owned()])));
        assert!(Spawn::parse(&json!({})).is_err());
        assert!(Spawn::parse(&json!({"task": "  "})).is_err());
        assert!(Spawn::parse(&json!({"task": "x", "wait": "no"})).is_err());
        assert!(Spawn::parse(&json!({"task": "x", "tools": "read_file"})).is_err());
        let detached = Spawn::parse(&json!({"task": "x", "wait": false})).map(|s| s.wait);
        assert_eq!(detached, Ok(false));
        assert!(Spawn::parse(&json!({"task": "x", "groupId": "grp_1", "newGroup": "pair"})).is_err());
        let grouped = Spawn::parse(&json!({"task": "x", "newGroup": "pair"})).map(|s| s.new_group);
        assert_eq!(grouped, Ok(Some("pair".to_owned())));
    }
}
