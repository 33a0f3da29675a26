//! Rewinding and clearing a conversation, against SQLite and Postgres: what
//! is deleted and what stays, where a rewind may stop, who may rewind, and
//! the search index, read markers and seqs after it.

use std::sync::Arc;

use avm_common::testing::service_ctx;
use avm_session::{Compaction, MessageBody, SessionService, SessionStore, ShareRole};

use crate::search::{assistant, conversation, query, said, say};
use crate::support::{ctx, member, reason};

conformance_suite!(
    a_rewind_keeps_what_came_before_and_a_clear_keeps_the_record,
    a_rewind_stops_only_where_a_turn_ended,
    only_who_manages_a_conversation_rewinds_it,
    a_compaction_is_where_the_context_starts,
);

const A: &str = "tenant-a";

fn tool_call(id: &str) -> MessageBody {
    MessageBody::ToolCall {
        tool_call_id: id.to_owned(),
        tool_name: "read_file".to_owned(),
        input_json: "{}".to_owned(),
        parent_id: "a1".to_owned(),
    }
}

fn tool_result(id: &str) -> MessageBody {
    MessageBody::ToolResult {
        tool_call_id: id.to_owned(),
        tool_name: "read_file".to_owned(),
        output: "ok".to_owned(),
        is_error: false,
    }
}

/// u1 a1 u2 a2 u3 a3 in a conversation of `cx`'s container `box`.
async fn six_messages(service: &SessionService, cx: &avm_common::RequestContext) -> (String, String) {
    let (image, session) = conversation(service, cx, "box", "Planning").await;
    for (n, (id, body)) in [
        ("u1", said("first question about herons")),
        ("a1", assistant("first answer")),
        ("u2", said("second question about ospreys")),
        ("a2", assistant("second answer about ospreys")),
        ("u3", said("third question")),
        ("a3", assistant("third answer")),
    ]
    .into_iter()
    .enumerate()
    {
        say(service, A, &session, id, 1_000 + n as i64, body).await;
    }
    (image, session)
}

async fn a_rewind_keeps_what_came_before_and_a_clear_keeps_the_record(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let (image, session) = six_messages(&service, &admin).await;
    assert_eq!(service.mark_read(&admin, &image, None).await.unwrap(), 6);

    let truncated = service.truncate_messages(&admin, &session, Some("a1")).await.unwrap();
    assert_eq!((truncated.removed_messages, truncated.last_seq), (4, 2));
    let kept = service.list_messages(&admin, &session).await.unwrap();
    assert_eq!(
        kept.iter().map(|m| (m.message_id.as_str(), m.seq)).collect::<Vec<_>>(),
        [("u1", 1), ("a1", 2)]
    );
    // The deleted text is no longer found; what is kept still is.
    let hits = |text: &str| {
        let service = &service;
        let admin = &admin;
        let text = text.to_owned();
        async move { service.search(admin, query(&text)).await.unwrap().hits.len() }
    };
    assert_eq!(hits("ospreys").await, 0);
    assert_eq!(hits("herons").await, 1);
    // The next message follows the kept ones; the read marker came back with them.
    say(&service, A, &session, "u4", 2_000, said("a new direction")).await;
    let kept = service.list_messages(&admin, &session).await.unwrap();
    assert_eq!(kept.last().map(|m| (m.message_id.as_str(), m.seq)), Some(("u4", 3)));
    let recent = service.list_recent(&admin, 0, "").await.unwrap();
    let row = recent.conversations.iter().find(|row| row.image_id == image).unwrap();
    assert_eq!((row.read_seq, row.unread()), (2, 1));
    assert_eq!(row.last_message.as_ref().map(|m| m.message_id.as_str()), Some("u4"));

    // A clear deletes every message and keeps the conversation.
    let cleared = service.truncate_messages(&admin, &session, None).await.unwrap();
    assert_eq!((cleared.removed_messages, cleared.last_seq), (3, 0));
    assert!(service.list_messages(&admin, &session).await.unwrap().is_empty());
    let record = service.get_image(&admin, &image).await.unwrap();
    assert_eq!(record.name, "Planning");
    say(&service, A, &session, "u5", 3_000, said("from scratch")).await;
    let kept = service.list_messages(&admin, &session).await.unwrap();
    assert_eq!(kept.iter().map(|m| m.seq).collect::<Vec<_>>(), [1]);
    // Clearing what is empty removes nothing and is no error.
    service.truncate_messages(&admin, &session, None).await.unwrap();
    assert_eq!(
        service
            .truncate_messages(&admin, &session, None)
            .await
            .unwrap()
            .removed_messages,
        0
    );
}

async fn a_rewind_stops_only_where_a_turn_ended(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let (_, session) = conversation(&service, &admin, "box", "Tools").await;
    for (n, (id, body)) in [
        ("u1", said("list the files")),
        ("c1", tool_call("t1")),
        ("r1", tool_result("t1")),
        ("a1", assistant("two files")),
    ]
    .into_iter()
    .enumerate()
    {
        say(&service, A, &session, id, 1_000 + n as i64, body).await;
    }
    // A user message or a tool call would leave a turn open.
    for open in ["u1", "c1"] {
        assert_eq!(
            reason(service.truncate_messages(&admin, &session, Some(open)).await),
            "REWIND_POINT_OPENS_TURN"
        );
    }
    // Unknown, foreign and malformed ids.
    assert_eq!(
        reason(service.truncate_messages(&admin, &session, Some("nope")).await),
        "MESSAGE_NOT_FOUND"
    );
    let (_, other) = conversation(&service, &admin, "box", "Other").await;
    say(&service, A, &other, "o1", 1_000, assistant("elsewhere")).await;
    assert_eq!(
        reason(service.truncate_messages(&admin, &session, Some("o1")).await),
        "MESSAGE_NOT_FOUND"
    );
    for bad in ["", "a\0b", &"x".repeat(20_000)] {
        assert_eq!(
            reason(service.truncate_messages(&admin, &session, Some(bad)).await),
            "INVALID_MESSAGE_ID"
        );
    }
    assert_eq!(
        reason(service.truncate_messages(&admin, "sess_missing", None).await),
        "SESSION_NOT_FOUND"
    );
    // Nothing was deleted by the refusals.
    assert_eq!(service.list_messages(&admin, &session).await.unwrap().len(), 4);
    // After a tool result is a place a turn may go on from.
    let truncated = service.truncate_messages(&admin, &session, Some("r1")).await.unwrap();
    assert_eq!(truncated.removed_messages, 1);
}

async fn only_who_manages_a_conversation_rewinds_it(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob, carol) = (member(A, "alice"), member(A, "bob"), member(A, "carol"));
    let (_, session) = six_messages(&service, &alice).await;
    service
        .share_container(&alice, "box", "bob", ShareRole::Use)
        .await
        .unwrap();
    // Bob may talk in it but not delete what was said; Carol does not see it.
    assert_eq!(
        reason(service.truncate_messages(&bob, &session, Some("a1")).await),
        "SHARE_ROLE_TOO_LOW"
    );
    assert_eq!(
        reason(service.truncate_messages(&carol, &session, None).await),
        "SESSION_NOT_FOUND"
    );
    // Another tenant's admin neither.
    assert_eq!(
        reason(service.truncate_messages(&ctx("tenant-b"), &session, None).await),
        "SESSION_NOT_FOUND"
    );
    assert_eq!(service.list_messages(&alice, &session).await.unwrap().len(), 6);
    service
        .share_container(&alice, "box", "bob", ShareRole::Manage)
        .await
        .unwrap();
    assert_eq!(
        service
            .truncate_messages(&bob, &session, Some("a2"))
            .await
            .unwrap()
            .removed_messages,
        2
    );
}

fn compaction(from: &str, summary: &str) -> Compaction {
    Compaction {
        from_seq: 0,
        from_message_id: from.to_owned(),
        method: "summarized".to_owned(),
        summary: summary.to_owned(),
        compacted_messages: 4,
        tokens_before: 900,
        tokens_after: 100,
        created_at_ms: 0,
    }
}

async fn a_compaction_is_where_the_context_starts(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (admin, runtime) = (ctx(A), service_ctx(A));
    let (_, session) = six_messages(&service, &admin).await;
    let ids =
        |messages: &[avm_session::MessageRecord]| messages.iter().map(|m| m.message_id.clone()).collect::<Vec<_>>();
    // Without a compaction, the context is every message.
    let (none, all) = service.list_context(&admin, &session).await.unwrap();
    assert!(none.is_none());
    assert_eq!(all.len(), 6);

    let recorded = service
        .record_compaction(&runtime, &session, compaction("u3", "herons and ospreys"))
        .await
        .unwrap();
    assert_eq!(recorded.from_seq, 5);
    let (found, kept) = service.list_context(&admin, &session).await.unwrap();
    let found = found.unwrap();
    assert_eq!(
        (found.from_seq, found.summary.as_str(), found.method.as_str()),
        (5, "herons and ospreys", "summarized")
    );
    assert_eq!(ids(&kept), ["u3", "a3"]);
    // The same point compacted again replaces it; the history stays whole.
    service
        .record_compaction(&runtime, &session, compaction("u3", "birds"))
        .await
        .unwrap();
    let (found, _) = service.list_context(&admin, &session).await.unwrap();
    assert_eq!(found.unwrap().summary, "birds");
    assert_eq!(service.list_messages(&admin, &session).await.unwrap().len(), 6);

    // Only the runtime records one, at a message of the session, of a known method.
    assert_eq!(
        reason(
            service
                .record_compaction(&admin, &session, compaction("u3", "lies"))
                .await
        ),
        "RUNTIME_ONLY"
    );
    assert_eq!(
        reason(
            service
                .record_compaction(&runtime, &session, compaction("nope", "x"))
                .await
        ),
        "MESSAGE_NOT_FOUND"
    );
    let shrunk = Compaction {
        method: "shrunk".to_owned(),
        ..compaction("u3", "x")
    };
    assert_eq!(
        reason(service.record_compaction(&runtime, &session, shrunk).await),
        "INVALID_COMPACTION"
    );
    let huge = compaction("u3", &"x".repeat(300 * 1024));
    assert_eq!(
        reason(service.record_compaction(&runtime, &session, huge).await),
        "INVALID_COMPACTION"
    );
    assert_eq!(
        reason(
            service
                .record_compaction(&service_ctx("tenant-b"), &session, compaction("u3", "x"))
                .await
        ),
        "SESSION_NOT_FOUND"
    );
    let (found, _) = service.list_context(&admin, &session).await.unwrap();
    assert_eq!(found.unwrap().summary, "birds", "nothing refused was written");

    // A rewind to before the compaction's first message forgets it.
    service.truncate_messages(&admin, &session, Some("a2")).await.unwrap();
    let (none, all) = service.list_context(&admin, &session).await.unwrap();
    assert!(none.is_none());
    assert_eq!(ids(&all), ["u1", "a1", "u2", "a2"]);
}
