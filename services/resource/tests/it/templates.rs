//! Rendering prompts on resolve: values, defaults, agent variables.

use std::sync::Arc;

use avm_common::Code;
use avm_common::testing::admin_ctx;
use avm_resource::{Kind, ResourceService, ResourceStore};

use crate::support::{assert_err, conformance_suite, register, register_with};

conformance_suite!(
    prompts_render_with_values_and_defaults,
    agents_overlay_their_variables_with_the_request,
    only_prompts_and_agents_render,
);

const A: &str = "tenant-a";

const GREETING: &str = r#"{"template":"Dear {{ who }}, {{tone}} regards{{sign}}.","variables":[
    {"name":"who"},
    {"name":"tone","default":"kind"},
    {"name":"sign","required":false}]}"#;

async fn prompts_render_with_values_and_defaults(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    register_with(&service, &ctx, Kind::Prompt, "greeting", "1.0.0", GREETING).await;
    let render = |vars: &'static str| {
        let service = service.clone();
        let ctx = ctx.clone();
        async move {
            service
                .resolve(&ctx, "resource://prompts/greeting", vars)
                .await
                .map(|resolution| resolution.rendered_prompt)
        }
    };

    assert_eq!(
        render(r#"{"who":"Ann"}"#).await.unwrap().as_deref(),
        Some("Dear Ann, kind regards."),
        "a default fills tone, an optional variable without one renders empty"
    );
    assert_eq!(
        render(r#"{"who":"Bo","tone":"warm","sign":", Cy"}"#)
            .await
            .unwrap()
            .as_deref(),
        Some("Dear Bo, warm regards, Cy.")
    );
    assert_err(
        render("{}").await,
        Code::InvalidArgument,
        "MISSING_VARIABLE",
        "variable who of resource://prompts/greeting@1.0.0 is required",
    );
    assert_err(
        render(r#"{"who":"Ann","mood":"x"}"#).await,
        Code::InvalidArgument,
        "UNKNOWN_VARIABLE",
        "resource://prompts/greeting@1.0.0 declares no variable mood",
    );
    for bad in [r#"{"who":1}"#, "[]", "{"] {
        assert_err(render(bad).await, Code::InvalidArgument, "INVALID_VARIABLES", "");
    }
    // Without variables the closure still resolves; the prompt is rendered only if it can be.
    assert_eq!(render("").await.unwrap(), None);
    register(&service, &ctx, Kind::Prompt, "plain", "1.0.0", &[]).await;
    let plain = service.resolve(&ctx, "resource://prompts/plain", "").await.unwrap();
    assert_eq!(plain.rendered_prompt.as_deref(), Some("hello"));
}

async fn agents_overlay_their_variables_with_the_request(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    register_with(&service, &ctx, Kind::Prompt, "greeting", "1.0.0", GREETING).await;
    let newer = GREETING.replace("Dear", "Hello");
    register_with(&service, &ctx, Kind::Prompt, "greeting", "1.1.0", &newer).await;
    register_with(
        &service,
        &ctx,
        Kind::Prompt,
        "greeting",
        "2.0.0",
        r#"{"template":"v2"}"#,
    )
    .await;
    let agent = r#"{"prompt":"resource://prompts/greeting@^1","variables":{"who":"Agent","tone":"calm"}}"#;
    register_with(&service, &ctx, Kind::Agent, "greeter", "1.0.0", agent).await;

    let own = service.resolve(&ctx, "resource://agents/greeter", "").await.unwrap();
    assert_eq!(
        own.rendered_prompt.as_deref(),
        Some("Hello Agent, calm regards."),
        "the agent's prompt version (^1 → 1.1.0) with the agent's own variables"
    );
    let overlaid = service
        .resolve(&ctx, "resource://agents/greeter", r#"{"tone":"bold","sign":"!"}"#)
        .await
        .unwrap();
    assert_eq!(overlaid.rendered_prompt.as_deref(), Some("Hello Agent, bold regards!."));
    assert_err(
        service
            .resolve(&ctx, "resource://agents/greeter", r#"{"nope":"x"}"#)
            .await,
        Code::InvalidArgument,
        "UNKNOWN_VARIABLE",
        "nope",
    );

    // An agent without variables for a required one renders only when the request gives them.
    register_with(
        &service,
        &ctx,
        Kind::Agent,
        "bare",
        "1.0.0",
        r#"{"prompt":"resource://prompts/greeting@1.0.0"}"#,
    )
    .await;
    let bare = service.resolve(&ctx, "resource://agents/bare", "").await.unwrap();
    assert_eq!(bare.rendered_prompt, None);
    assert_eq!(bare.dependencies.len(), 1);
    assert_err(
        service.resolve(&ctx, "resource://agents/bare", "{}").await,
        Code::InvalidArgument,
        "MISSING_VARIABLE",
        "who",
    );
    let given = service
        .resolve(&ctx, "resource://agents/bare", r#"{"who":"Req"}"#)
        .await
        .unwrap();
    assert_eq!(given.rendered_prompt.as_deref(), Some("Dear Req, kind regards."));
}

async fn only_prompts_and_agents_render(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    for kind in [Kind::Tool, Kind::Sandbox, Kind::Knowledge] {
        register(&service, &ctx, kind, "x", "1.0.0", &[]).await;
        let uri = format!("resource://{}/x", kind.collection());
        let resolved = service.resolve(&ctx, &uri, "").await.unwrap();
        assert_eq!(resolved.rendered_prompt, None, "{uri}");
        // Variables are checked even when there is nothing to render.
        assert_err(
            service.resolve(&ctx, &uri, "[]").await,
            Code::InvalidArgument,
            "INVALID_VARIABLES",
            "",
        );
    }
}
