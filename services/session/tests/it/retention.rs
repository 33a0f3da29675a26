//! Retention, against SQLite and Postgres: a sweep deletes exactly what the
//! policy says (old messages, idle conversations, the least recently active
//! beyond a container's cap) and nothing of another tenant; a dry run
//! deletes nothing and counts what the sweep then deletes; a backlog beyond
//! one sweep's bounds takes several; a parent waits for its children; only
//! admins set policies and sweep; bad policies are refused with nothing
//! written; one replica sweeps at a time on Postgres.

use std::collections::BTreeSet;
use std::time::Duration;

use avm_common::auth::{Role, Scopes};
use avm_common::{Code, RequestContext, now_ms};
use avm_session::{
    CONVERSATIONS_PER_SWEEP, MESSAGES_PER_SWEEP, NewImage, NewMessage, RetentionPolicy, SessionChange, SessionService,
    WatchItem,
};
use avm_store::db::{DbPool, connect};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::support::{TestDb, api_err, ctx, member, reason, user};

/// Expands each body into `sqlite::<name>` and `postgres::<name>` tests
/// given the whole test database (to write rows the service never would).
macro_rules! retention_suite {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(&crate::support::TestDb::sqlite().await).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(db) = crate::support::TestDb::postgres().await else { return };
                    super::$name(&db).await;
                }
            )*
        }
    };
}

retention_suite!(
    sweeps_delete_exactly_what_the_policy_says,
    a_backlog_takes_several_sweeps,
    a_parent_is_kept_while_a_child_is,
    only_admins_set_policies_and_sweep,
    bad_policies_are_refused_with_nothing_written,
);

const A: &str = "tenant-a";
const B: &str = "tenant-b";
const DAY_MS: i64 = 24 * 60 * 60 * 1000;

fn runtime(tenant_id: &str) -> RequestContext {
    avm_common::testing::service_ctx(tenant_id)
}

/// Makes a conversation in `container_id` (made when missing); returns its
/// image and session ids.
async fn conversation(service: &SessionService, cx: &RequestContext, container_id: &str) -> (String, String) {
    service.create_container(cx, container_id).await.expect("container");
    let image = service
        .create_image(
            cx,
            NewImage {
                container_id: container_id.to_owned(),
                ..NewImage::default()
            },
        )
        .await
        .expect("image");
    (image.image_id, image.session_id)
}

/// Appends user messages `<prefix>-<n>` written at `at_ms`, as the runtime
/// may (it chooses the time); a session's activity never moves back.
async fn say(service: &SessionService, tenant_id: &str, session_id: &str, prefix: &str, count: usize, at_ms: i64) {
    for n in 0..count {
        service
            .append_message(
                &runtime(tenant_id),
                session_id,
                NewMessage {
                    created_at_ms: at_ms,
                    ..user(&format!("{prefix}-{n}"), "hello")
                },
            )
            .await
            .expect("append");
    }
}

/// Moves the last activity of sessions back to `at_ms`: of one session, or
/// of every session of `tenant_id` but `except`. Nothing the service offers
/// makes a conversation idle for months.
async fn backdate(db: &TestDb, tenant_id: &str, only: Option<&str>, except: Option<&str>, at_ms: i64) {
    let statement = "UPDATE sessions SET last_active_at_ms = $1 \
                     WHERE tenant_id = $2 AND ($3 = '' OR session_id = $3) AND session_id <> $4";
    let pool = connect(db.url(), Some(1)).await.expect("connect");
    let (only, except) = (only.unwrap_or(""), except.unwrap_or(""));
    match &pool {
        DbPool::Sqlite(pool) => sqlx::query(statement)
            .bind(at_ms)
            .bind(tenant_id)
            .bind(only)
            .bind(except)
            .execute(pool)
            .await
            .map(drop),
        DbPool::Postgres(pool) => sqlx::query(statement)
            .bind(at_ms)
            .bind(tenant_id)
            .bind(only)
            .bind(except)
            .execute(pool)
            .await
            .map(drop),
    }
    .expect("backdate");
}

async fn set_policy(service: &SessionService, tenant_id: &str, policy: RetentionPolicy) {
    service
        .set_retention_policy(&ctx(tenant_id), policy)
        .await
        .expect("set policy");
}

/// Returns the message ids of a session.
async fn messages(service: &SessionService, tenant_id: &str, session_id: &str) -> Vec<String> {
    service
        .list_messages(&ctx(tenant_id), session_id)
        .await
        .expect("messages")
        .into_iter()
        .map(|message| message.message_id)
        .collect()
}

/// Returns the image ids of a tenant.
async fn images(service: &SessionService, tenant_id: &str) -> BTreeSet<String> {
    service
        .list_images(&ctx(tenant_id), None)
        .await
        .expect("images")
        .into_iter()
        .map(|image| image.image_id)
        .collect()
}

async fn sweeps_delete_exactly_what_the_policy_says(db: &TestDb) {
    let service = SessionService::new(db.store.clone());
    let stop = CancellationToken::new();
    let listener = service.spawn_background(stop.clone());
    let (admin, now) = (ctx(A), now_ms());

    // Container c1: a conversation with old and new messages, an active one
    // and an idle one (three: one past its cap of two, the idle one).
    let (chatty, chatty_session) = conversation(&service, &admin, "c1").await;
    say(&service, A, &chatty_session, "old", 3, now - 40 * DAY_MS).await;
    say(&service, A, &chatty_session, "new", 2, now - 10 * DAY_MS).await;
    let (active, _) = conversation(&service, &admin, "c1").await;
    let (idle, idle_session) = conversation(&service, &admin, "c1").await;
    backdate(db, A, Some(&idle_session), None, now - 90 * DAY_MS).await;
    // Container c2: four conversations active hours apart; two are too many.
    let mut c2 = Vec::new();
    for hours in 1..=4 {
        let (image, session) = conversation(&service, &admin, "c2").await;
        backdate(db, A, Some(&session), None, now - hours * 3_600_000).await;
        c2.push(image);
    }
    // Tenant B holds the same kinds of rows and sets no policy.
    let (b_image, b_session) = conversation(&service, &ctx(B), "c1").await;
    say(&service, B, &b_session, "old", 3, now - 400 * DAY_MS).await;
    let (b_idle, b_idle_session) = conversation(&service, &ctx(B), "c1").await;
    backdate(db, B, Some(&b_idle_session), None, now - 900 * DAY_MS).await;

    set_policy(
        &service,
        A,
        RetentionPolicy {
            message_days: Some(30),
            idle_conversation_days: Some(60),
            max_conversations_per_container: Some(2),
        },
    )
    .await;
    let gone: BTreeSet<String> = [idle.clone(), c2[2].clone(), c2[3].clone()].into();

    let dry = service.sweep_retention(&admin, true).await.expect("dry run");
    assert!(dry.dry_run);
    assert_eq!((dry.messages, dry.conversations), (3, 3), "{dry:?}");
    assert_eq!(dry.image_ids.iter().cloned().collect::<BTreeSet<_>>(), gone);
    assert!(!dry.limit_reached);
    // Nothing changed.
    assert_eq!(messages(&service, A, &chatty_session).await.len(), 5);
    assert_eq!(images(&service, A).await.len(), 7);

    // The runtimes hear of every deletion, as of a user's.
    let mut feed = service.watch(&runtime(A)).await.expect("watch");
    assert!(matches!(feed.next().await, Some(Ok(WatchItem::Live))));

    let swept = service
        .sweep_all_tenants()
        .await
        .expect("sweep")
        .expect("nobody else sweeps");
    assert_eq!((swept.tenants, swept.failed), (1, 0), "only A has a policy");
    assert_eq!((swept.messages, swept.conversations), (dry.messages, dry.conversations));

    assert_eq!(
        messages(&service, A, &chatty_session).await,
        ["new-0", "new-1"],
        "messages older than 30 days go, newer ones stay"
    );
    let left = images(&service, A).await;
    assert_eq!(
        left,
        [chatty.clone(), active.clone(), c2[0].clone(), c2[1].clone()].into(),
        "the idle conversation and the two least active of c2 go"
    );
    assert_eq!(
        reason(service.list_messages(&ctx(A), &idle_session).await),
        "SESSION_NOT_FOUND"
    );

    let mut heard = BTreeSet::new();
    while heard != gone {
        let item = tokio::time::timeout(Duration::from_secs(10), feed.next())
            .await
            .expect("deletions announced")
            .expect("feed open")
            .expect("feed item");
        if let WatchItem::Changed(SessionChange::Deleted { tenant_id, image_ids }) = item {
            assert_eq!(tenant_id, A);
            heard.extend(image_ids);
        }
    }

    // Tenant B is untouched.
    assert_eq!(messages(&service, B, &b_session).await.len(), 3);
    assert_eq!(images(&service, B).await, [b_image, b_idle].into());

    // Once applied, the policy finds nothing more.
    let again = service.sweep_retention(&admin, false).await.expect("sweep again");
    assert_eq!((again.messages, again.conversations), (0, 0));
    stop.cancel();
    listener.await.expect("listener");
}

async fn a_backlog_takes_several_sweeps(db: &TestDb) {
    let service = SessionService::new(db.store.clone());
    let (admin, now) = (ctx(A), now_ms());
    let (_, chatty_session) = conversation(&service, &admin, "c1").await;
    let extra_messages = 30;
    let backlog = MESSAGES_PER_SWEEP as usize + extra_messages;
    say(&service, A, &chatty_session, "old", backlog, now - 40 * DAY_MS).await;
    let extra_conversations = 5;
    for _ in 0..CONVERSATIONS_PER_SWEEP as usize + extra_conversations {
        conversation(&service, &admin, "c2").await;
    }
    backdate(db, A, None, Some(&chatty_session), now - 90 * DAY_MS).await;
    set_policy(
        &service,
        A,
        RetentionPolicy {
            message_days: Some(30),
            idle_conversation_days: Some(60),
            ..RetentionPolicy::default()
        },
    )
    .await;

    let first = service.sweep_retention(&admin, false).await.expect("first sweep");
    assert_eq!(
        (first.messages, first.conversations),
        (u64::from(MESSAGES_PER_SWEEP), u64::from(CONVERSATIONS_PER_SWEEP))
    );
    assert!(first.limit_reached);
    let dry = service.sweep_retention(&admin, true).await.expect("dry run");
    assert_eq!(
        (dry.messages, dry.conversations),
        (extra_messages as u64, extra_conversations as u64)
    );
    let second = service.sweep_retention(&admin, false).await.expect("second sweep");
    assert_eq!(
        (second.messages, second.conversations),
        (dry.messages, dry.conversations)
    );
    assert_eq!(second.image_ids, dry.image_ids);
    assert!(!second.limit_reached);
    let third = service.sweep_retention(&admin, false).await.expect("third sweep");
    assert_eq!((third.messages, third.conversations), (0, 0));
    assert!(messages(&service, A, &chatty_session).await.is_empty());
    assert_eq!(images(&service, A).await.len(), 1);
}

async fn a_parent_is_kept_while_a_child_is(db: &TestDb) {
    let service = SessionService::new(db.store.clone());
    let (admin, now) = (ctx(A), now_ms());
    let (parent, parent_session) = conversation(&service, &admin, "c1").await;
    let child = service
        .create_image(
            &admin,
            NewImage {
                container_id: "c1".to_owned(),
                parent_image_id: Some(parent.clone()),
                ..NewImage::default()
            },
        )
        .await
        .expect("child");
    backdate(db, A, Some(&parent_session), None, now - 90 * DAY_MS).await;
    set_policy(
        &service,
        A,
        RetentionPolicy {
            idle_conversation_days: Some(60),
            ..RetentionPolicy::default()
        },
    )
    .await;

    let kept = service.sweep_retention(&admin, false).await.expect("sweep");
    assert_eq!(kept.conversations, 0, "an idle parent of an active child stays");
    assert_eq!(
        images(&service, A).await,
        [parent.clone(), child.image_id.clone()].into()
    );

    // Once the child is idle too, it goes first, then its parent.
    backdate(db, A, Some(&child.session_id), None, now - 80 * DAY_MS).await;
    let first = service.sweep_retention(&admin, false).await.expect("sweep");
    assert_eq!(first.image_ids, [child.image_id]);
    let second = service.sweep_retention(&admin, false).await.expect("sweep");
    assert_eq!(second.image_ids, [parent]);
}

async fn only_admins_set_policies_and_sweep(db: &TestDb) {
    let service = SessionService::new(db.store.clone());
    let (_, session) = conversation(&service, &member(A, "usr_m"), "mine").await;
    say(&service, A, &session, "old", 2, now_ms() - 40 * DAY_MS).await;
    let policy = RetentionPolicy {
        message_days: Some(30),
        ..RetentionPolicy::default()
    };
    let refused = api_err(service.set_retention_policy(&member(A, "usr_m"), policy).await);
    assert_eq!(refused.code, Code::PermissionDenied, "{refused:?}");
    assert_eq!(
        service.get_retention_policy(&ctx(A)).await.expect("get").policy,
        RetentionPolicy::default(),
        "nothing was written"
    );

    set_policy(&service, A, policy).await;
    // A member reads the policy its data is kept under, and sweeps nothing.
    let seen = service.get_retention_policy(&member(A, "usr_m")).await.expect("get");
    assert_eq!(seen.policy, policy);
    assert!(seen.updated_at_ms > 0);
    for dry_run in [true, false] {
        let refused = api_err(service.sweep_retention(&member(A, "usr_m"), dry_run).await);
        assert_eq!(refused.code, Code::PermissionDenied, "{refused:?}");
    }
    assert_eq!(messages(&service, A, &session).await.len(), 2);
    // A member holding the admin scope is still no admin.
    let scoped = avm_common::testing::principal_ctx(A, "usr_m", Role::Member, Scopes::ALL);
    assert_eq!(reason(service.sweep_retention(&scoped, false).await), "ADMIN_REQUIRED");
    // A key without the admin scope is refused too, even an admin's.
    let read_only = avm_common::testing::principal_ctx(A, "usr_admin", Role::Admin, Scopes::READ.union(Scopes::WRITE));
    assert_eq!(
        reason(service.sweep_retention(&read_only, false).await),
        "MISSING_SCOPE"
    );
    // The admin of another tenant sweeps its own tenant only.
    let other = service.sweep_retention(&ctx(B), false).await.expect("sweep B");
    assert_eq!((other.messages, other.conversations), (0, 0));
    assert_eq!(messages(&service, A, &session).await.len(), 2);
}

async fn bad_policies_are_refused_with_nothing_written(db: &TestDb) {
    let service = SessionService::new(db.store.clone());
    let good = RetentionPolicy {
        message_days: Some(365),
        idle_conversation_days: Some(36_500),
        max_conversations_per_container: Some(100_000),
    };
    set_policy(&service, A, good).await;
    let bad = [
        (
            RetentionPolicy {
                message_days: Some(0),
                ..good
            },
            "messageDays",
        ),
        (
            RetentionPolicy {
                idle_conversation_days: Some(36_501),
                ..good
            },
            "idleConversationDays",
        ),
        (
            RetentionPolicy {
                max_conversations_per_container: Some(100_001),
                ..good
            },
            "maxConversationsPerContainer",
        ),
        (
            RetentionPolicy {
                message_days: Some(u32::MAX),
                ..RetentionPolicy::default()
            },
            "messageDays",
        ),
    ];
    for (policy, field) in bad {
        let err = api_err(service.set_retention_policy(&ctx(A), policy).await);
        assert_eq!(err.code, Code::InvalidArgument);
        assert_eq!(err.reason, "INVALID_RETENTION_POLICY");
        assert!(err.message.contains(field), "{}", err.message);
        assert!(!err.message.contains(&u32::MAX.to_string()), "{}", err.message);
        assert_eq!(service.get_retention_policy(&ctx(A)).await.expect("get").policy, good);
    }
    // Every field unset: nothing is deleted any more.
    set_policy(&service, A, RetentionPolicy::default()).await;
    assert_eq!(
        service.get_retention_policy(&ctx(A)).await.expect("get").policy,
        RetentionPolicy::default()
    );
    let swept = service.sweep_all_tenants().await.expect("sweep").expect("lock");
    assert_eq!(swept.tenants, 0, "a policy without limits is not swept");
}

#[tokio::test]
async fn postgres_replicas_sweep_one_at_a_time() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    let service = SessionService::new(db.store.clone());
    let held = db.store.lock_sweep().await.expect("lock").expect("free");
    assert!(
        service.sweep_all_tenants().await.expect("sweep").is_none(),
        "another replica is sweeping"
    );
    drop(held);
    assert!(service.sweep_all_tenants().await.expect("sweep").is_some());
}
