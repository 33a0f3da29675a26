//! Issue 29, item 5, through the REST API: a tenant admin sets a retention
//! policy, a dry run says what a sweep would delete and deletes nothing,
//! the sweep then deletes exactly that, the ledger keeps every call, and a
//! member can neither set the policy nor sweep.

use anyhow::{Context, ensure};
use avm_tests::accounts::{create_tenant, create_user};
use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call_as, cluster, conversation, poll, send_and_finish};

both_modes!(a_sweep_deletes_what_the_policy_says_and_no_usage, sweeps);

async fn sweeps(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "retention-t", None).await?;
    let member = create_user(&cluster, &tenant, "mia", "member").await?;
    let admin = &tenant.admin.key;

    // Three conversations, oldest first; one turn in each.
    let mut ws = WsClient::connect(&cluster.ws_url_as(admin)).await?;
    let mut images = Vec::new();
    let first = conversation(&mut ws, "kept", json!({"name": "chat 0"})).await?;
    images.push(first.image_id);
    for n in 1..3 {
        let made = ws
            .request(
                "image_create",
                json!({"containerId": "kept", "config": {"name": format!("chat {n}")}}),
            )
            .await?;
        let session_id = made["__subscriptions"][0].as_str().context("the session")?;
        ws.subscribe(session_id, None).await?;
        images.push(made["record"]["imageId"].as_str().context("imageId")?.to_owned());
    }
    for (n, image_id) in images.iter().enumerate() {
        send_and_finish(&mut ws, image_id, json!(format!("hello {n}"))).await?;
    }
    let usage = poll(std::time::Duration::from_secs(20), "the ledger", || async {
        let (_, usage) = call_as(&cluster, admin, "GET", "/v1/usage", None).await?;
        Ok((usage["totals"]["calls"] == 3).then_some(usage))
    })
    .await?;

    let (status, policy) = call_as(&cluster, admin, "GET", "/v1/retention", None).await?;
    ensure!(
        status == 200 && policy["maxConversationsPerContainer"].is_null(),
        "no policy at first: {status} {policy}"
    );
    // Bad policies are refused with nothing written, the value not echoed.
    for bad in [
        json!({"maxConversationsPerContainer": 0}),
        json!({"messageDays": 99_999_999}),
        json!({"idleConversationDays": "soon"}),
        json!({"keepForever": true}),
    ] {
        let (status, body) = call_as(&cluster, admin, "PUT", "/v1/retention", Some(bad.clone())).await?;
        ensure!(status == 400, "{bad}: {status} {body}");
        ensure!(!body.to_string().contains("99999999"), "{body}");
    }
    // A member may neither set it nor sweep.
    let (status, body) = call_as(
        &cluster,
        &member.key,
        "PUT",
        "/v1/retention",
        Some(json!({"maxConversationsPerContainer": 1})),
    )
    .await?;
    ensure!(status == 403, "a member sets no policy: {status} {body}");
    let (status, body) = call_as(&cluster, &member.key, "POST", "/v1/retention/sweep", None).await?;
    ensure!(status == 403, "a member does not sweep: {status} {body}");

    let (status, policy) = call_as(
        &cluster,
        admin,
        "PUT",
        "/v1/retention",
        Some(json!({"maxConversationsPerContainer": 1})),
    )
    .await?;
    ensure!(
        status == 200 && policy["maxConversationsPerContainer"] == 1,
        "{status} {policy}"
    );

    let listed = |cluster| async move {
        let (_, listed) = call_as(cluster, admin, "GET", "/v1/containers/kept/images", None).await?;
        let mut ids: Vec<String> = listed["images"]
            .as_array()
            .context("images")?
            .iter()
            .filter_map(|image| image["imageId"].as_str().map(str::to_owned))
            .collect();
        ids.sort();
        anyhow::Ok(ids)
    };
    let ids = |sweep: &Value| {
        let mut ids: Vec<String> = sweep["imageIds"]
            .as_array()
            .map(|ids| ids.iter().filter_map(|id| id.as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        ids.sort();
        ids
    };
    let mut oldest = images[..2].to_vec();
    oldest.sort();

    // A dry run says what would go and deletes nothing.
    let (status, dry) = call_as(&cluster, admin, "POST", "/v1/retention/sweep?dryRun=true", None).await?;
    ensure!(
        status == 200 && dry["dryRun"] == true && dry["deletedConversations"] == 2,
        "{status} {dry}"
    );
    ensure!(ids(&dry) == oldest, "the two least recently active: {dry}");
    ensure!(listed(&cluster).await?.len() == 3, "a dry run deletes nothing");

    // The sweep deletes exactly that.
    let (status, swept) = call_as(&cluster, admin, "POST", "/v1/retention/sweep", None).await?;
    ensure!(
        status == 200 && swept["dryRun"] == false && ids(&swept) == oldest,
        "{status} {swept}"
    );
    ensure!(listed(&cluster).await? == [images[2].clone()], "the newest is kept");
    let (status, again) = call_as(&cluster, admin, "POST", "/v1/retention/sweep", None).await?;
    ensure!(
        status == 200 && again["deletedConversations"] == 0,
        "nothing more: {again}"
    );

    // Every call the deleted conversations made is still billed.
    let (_, after) = call_as(&cluster, admin, "GET", "/v1/usage", None).await?;
    ensure!(
        after["totals"] == usage["totals"],
        "usage untouched:\n{}\n{}",
        usage["totals"],
        after["totals"]
    );
    Ok(())
}
