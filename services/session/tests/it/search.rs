//! Full-text search and the recent list, against SQLite and Postgres: what it finds and in which
//! order, whose it finds, its filters and pages, its index kept on every
//! write (and made by the migration for what was stored before it), and the
//! queries it refuses.

use std::collections::BTreeSet;
use std::sync::Arc;

use avm_session::{
    ImageUpdate, MessageBody, NewImage, NewMessage, SearchHit, SearchPage, SearchRequest, SessionService, SessionStore,
    ShareRole,
};
use avm_store::testing::TestDatabase;

use crate::support::{ctx, member, reason, user};

conformance_suite!(
    search_finds_words_and_phrases_best_first,
    search_sees_only_what_listing_shows,
    search_filters_and_pages,
    search_follows_renames_and_deletions,
    search_refuses_bad_queries,
    recent_lists_the_latest_first_with_unread_counts,
    indexed_writes_at_once_all_land,
);

const A: &str = "tenant-a";
const B: &str = "tenant-b";

fn runtime(tenant_id: &str) -> avm_common::RequestContext {
    avm_common::testing::service_ctx(tenant_id)
}

pub(crate) fn query(text: &str) -> SearchRequest {
    SearchRequest {
        query: text.to_owned(),
        ..SearchRequest::default()
    }
}

/// Makes a conversation named `name` in `container_id` (made when missing).
pub(crate) async fn conversation(
    service: &SessionService,
    cx: &avm_common::RequestContext,
    container_id: &str,
    name: &str,
) -> (String, String) {
    service
        .create_container(cx, container_id)
        .await
        .expect("create container");
    let image = service
        .create_image(
            cx,
            NewImage {
                container_id: container_id.to_owned(),
                name: Some(name.to_owned()),
                ..NewImage::default()
            },
        )
        .await
        .expect("create image");
    (image.image_id, image.session_id)
}

/// Appends a message as the runtime does, at `at_ms`.
pub(crate) async fn say(
    service: &SessionService,
    tenant_id: &str,
    session_id: &str,
    id: &str,
    at_ms: i64,
    body: MessageBody,
) {
    service
        .append_message(
            &runtime(tenant_id),
            session_id,
            NewMessage {
                message_id: id.to_owned(),
                created_at_ms: at_ms,
                body,
            },
        )
        .await
        .expect("append message");
}

pub(crate) fn assistant(text: &str) -> MessageBody {
    MessageBody::Assistant {
        text: text.to_owned(),
        usage: None,
        interrupted: false,
        model: "m".to_owned(),
        stop_reason: "end_turn".to_owned(),
        resources: Vec::new(),
    }
}

pub(crate) fn said(text: &str) -> MessageBody {
    MessageBody::User {
        content_json: serde_json::Value::String(text.to_owned()).to_string(),
    }
}

/// The message ids of a page's hits, `name:<image>` for a name hit.
fn found(page: &SearchPage) -> Vec<String> {
    page.hits.iter().map(hit_key).collect()
}

fn hit_key(hit: &SearchHit) -> String {
    hit.message_id
        .clone()
        .unwrap_or_else(|| format!("name:{}", hit.image_id))
}

async fn search(service: &SessionService, cx: &avm_common::RequestContext, request: SearchRequest) -> SearchPage {
    service.search(cx, request).await.expect("search")
}

async fn search_finds_words_and_phrases_best_first(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let (trip, trip_session) = conversation(&service, &admin, "travel", "Trip to Lisbon").await;
    let (_, chores) = conversation(&service, &admin, "home", "Chores").await;
    say(
        &service,
        A,
        &trip_session,
        "m1",
        1_000,
        said("Where should we eat in Lisbon?"),
    )
    .await;
    say(
        &service,
        A,
        &trip_session,
        "m2",
        2_000,
        assistant("Try pastéis de nata by the river; Lisbon is lovely in May."),
    )
    .await;
    // A list of parts is found by its text parts.
    let parts = serde_json::json!([{"type": "text", "text": "whale whale whale"}, {"type": "image", "data": "AAAA", "mediaType": "image/png"}]);
    say(
        &service,
        A,
        &chores,
        "m3",
        3_000,
        MessageBody::User {
            content_json: parts.to_string(),
        },
    )
    .await;
    let long = format!("{} whale {}", "filler ".repeat(60), "filler ".repeat(60));
    say(&service, A, &chores, "m4", 4_000, assistant(&long)).await;
    say(
        &service,
        A,
        &chores,
        "m5",
        5_000,
        MessageBody::ToolCall {
            tool_call_id: "call_1".to_owned(),
            tool_name: "shell".to_owned(),
            input_json: r#"{"command":"grep -r needle ."}"#.to_owned(),
            parent_id: "m4".to_owned(),
        },
    )
    .await;
    say(
        &service,
        A,
        &chores,
        "m6",
        6_000,
        MessageBody::ToolResult {
            tool_call_id: "call_1".to_owned(),
            tool_name: "shell".to_owned(),
            output: "haystack.txt: a NEEDLE here".to_owned(),
            is_error: false,
        },
    )
    .await;

    // A word, whatever its case, in messages and in a conversation's name.
    let page = search(&service, &admin, query("LISBON")).await;
    let keys: BTreeSet<String> = found(&page).into_iter().collect();
    assert_eq!(
        keys,
        BTreeSet::from(["m1".to_owned(), "m2".to_owned(), format!("name:{trip}")])
    );
    let name_hit = page.hits.iter().find(|hit| hit.message_id.is_none()).unwrap();
    assert_eq!(name_hit.snippet, "Trip to <mark>Lisbon</mark>");
    assert_eq!(
        (name_hit.image_name.as_str(), name_hit.container_id.as_str()),
        ("Trip to Lisbon", "travel")
    );
    let m1 = page
        .hits
        .iter()
        .find(|hit| hit.message_id.as_deref() == Some("m1"))
        .unwrap();
    assert_eq!(m1.snippet, "Where should we eat in <mark>Lisbon</mark>?");
    assert_eq!(
        (m1.role, m1.seq, m1.at_ms, m1.session_id.as_str()),
        (Some("user"), Some(1), 1_000, trip_session.as_str())
    );

    // Every word must appear, in any order; a phrase only as written.
    assert_eq!(found(&search(&service, &admin, query("nata river")).await), ["m2"]);
    assert_eq!(
        found(&search(&service, &admin, query("\"pastéis de nata\"")).await),
        ["m2"]
    );
    assert!(
        search(&service, &admin, query("\"nata de pastéis\""))
            .await
            .hits
            .is_empty()
    );
    assert!(search(&service, &admin, query("nata whale")).await.hits.is_empty());
    // Diacritics are not folded, as neither store folds them.
    assert!(search(&service, &admin, query("pasteis")).await.hits.is_empty());

    // A short message saying it three times ranks above a long one saying it once.
    let page = search(&service, &admin, query("whale")).await;
    assert_eq!(found(&page), ["m3", "m4"]);
    assert!(page.hits[0].score > page.hits[1].score, "{:?}", page.hits);
    assert_eq!(
        page.hits[0].snippet,
        "<mark>whale</mark> <mark>whale</mark> <mark>whale</mark>"
    );
    assert!(
        page.hits[1].snippet.starts_with('…') && page.hits[1].snippet.ends_with('…'),
        "{}",
        page.hits[1].snippet
    );

    // Tool calls by their input, results by their output, each with its role.
    let page = search(&service, &admin, query("needle")).await;
    let roles: BTreeSet<(String, &str)> = page.hits.iter().map(|hit| (hit_key(hit), hit.role.unwrap())).collect();
    assert_eq!(
        roles,
        BTreeSet::from([("m5".to_owned(), "tool_call"), ("m6".to_owned(), "tool_result")])
    );

    // Text that could be markup comes back escaped.
    say(
        &service,
        A,
        &chores,
        "m7",
        7_000,
        said("<script>alert('x')</script> owl"),
    )
    .await;
    let page = search(&service, &admin, query("owl")).await;
    assert_eq!(
        page.hits[0].snippet,
        "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; <mark>owl</mark>"
    );

    // A NUL in a message (which Postgres' JSON functions refuse) is stored and found.
    say(&service, A, &chores, "m8", 8_000, assistant("before\u{0}after kestrel")).await;
    assert_eq!(found(&search(&service, &admin, query("kestrel")).await), ["m8"]);
}

async fn search_sees_only_what_listing_shows(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob) = (member(A, "alice"), member(A, "bob"));
    let (_, alices) = conversation(&service, &alice, "alice-box", "Alice's notes").await;
    let (_, bobs) = conversation(&service, &bob, "bob-box", "Bob's notes").await;
    let (_, b_session) = conversation(&service, &ctx(B), "alice-box", "Other tenant").await;
    say(&service, A, &alices, "a1", 1_000, said("the secret word is marmalade")).await;
    say(&service, A, &bobs, "b1", 2_000, said("bob's marmalade recipe")).await;
    say(&service, B, &b_session, "x1", 3_000, said("tenant b marmalade")).await;

    let keys = |page: SearchPage| found(&page).into_iter().collect::<BTreeSet<_>>();
    let set = |ids: &[&str]| ids.iter().map(|id| (*id).to_owned()).collect::<BTreeSet<_>>();
    // A member finds their own; the admin the whole tenant; the other tenant its own.
    assert_eq!(keys(search(&service, &alice, query("marmalade")).await), set(&["a1"]));
    assert_eq!(keys(search(&service, &bob, query("marmalade")).await), set(&["b1"]));
    assert_eq!(
        keys(search(&service, &ctx(A), query("marmalade")).await),
        set(&["a1", "b1"])
    );
    assert_eq!(keys(search(&service, &ctx(B), query("marmalade")).await), set(&["x1"]));
    // Naming another's container finds nothing, as if it did not exist.
    let mut other = query("marmalade");
    other.container_id = Some("bob-box".to_owned());
    assert!(search(&service, &alice, other).await.hits.is_empty());
    // Shared with read, it is found; unshared, it is gone again.
    service
        .share_container(&bob, "bob-box", "alice", ShareRole::Read)
        .await
        .expect("share");
    assert_eq!(
        keys(search(&service, &alice, query("marmalade")).await),
        set(&["a1", "b1"])
    );
    service
        .unshare_container(&bob, "bob-box", "alice")
        .await
        .expect("unshare");
    assert_eq!(keys(search(&service, &alice, query("marmalade")).await), set(&["a1"]));
}

async fn search_filters_and_pages(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let (first, first_session) = conversation(&service, &admin, "one", "Puffin log").await;
    let (_, second_session) = conversation(&service, &admin, "two", "Elsewhere").await;
    for n in 0..5 {
        say(
            &service,
            A,
            &first_session,
            &format!("u{n}"),
            1_000 + n,
            said("a puffin"),
        )
        .await;
        say(
            &service,
            A,
            &first_session,
            &format!("a{n}"),
            2_000 + n,
            assistant("puffin again"),
        )
        .await;
        say(
            &service,
            A,
            &second_session,
            &format!("s{n}"),
            3_000 + n,
            said("puffin elsewhere"),
        )
        .await;
    }
    let all = search(
        &service,
        &admin,
        SearchRequest {
            page_size: 100,
            ..query("puffin")
        },
    )
    .await;
    assert_eq!(all.hits.len(), 16, "15 messages and one name");
    assert!(all.next_page_token.is_empty());

    let with = |change: &dyn Fn(&mut SearchRequest)| {
        let mut request = SearchRequest {
            page_size: 100,
            ..query("puffin")
        };
        change(&mut request);
        request
    };
    let page = search(&service, &admin, with(&|r| r.container_id = Some("two".to_owned()))).await;
    assert_eq!(page.hits.iter().filter(|hit| hit.container_id == "two").count(), 5);
    assert_eq!(page.hits.len(), 5);
    let page = search(&service, &admin, with(&|r| r.image_id = Some(first.clone()))).await;
    assert_eq!(page.hits.len(), 11, "ten messages and the name");
    // A role leaves names out.
    let page = search(&service, &admin, with(&|r| r.role = Some("assistant".to_owned()))).await;
    assert_eq!(page.hits.len(), 5);
    assert!(page.hits.iter().all(|hit| hit.role == Some("assistant")));
    // From is inclusive, to exclusive.
    let page = search(
        &service,
        &admin,
        with(&|r| {
            r.from_ms = Some(2_001);
            r.to_ms = Some(3_001);
        }),
    )
    .await;
    let keys: BTreeSet<String> = found(&page).into_iter().collect();
    let expected: BTreeSet<String> = ["a1", "a2", "a3", "a4", "s0"]
        .iter()
        .map(|id| (*id).to_owned())
        .collect();
    assert_eq!(keys, expected);

    // Pages of 3 walk all 16 hits once each, in the order of one page of all.
    let mut walked = Vec::new();
    let mut token = String::new();
    loop {
        let page = search(
            &service,
            &admin,
            SearchRequest {
                page_size: 3,
                page_token: token.clone(),
                ..query("puffin")
            },
        )
        .await;
        assert!(page.hits.len() <= 3);
        walked.extend(found(&page));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(walked, found(&all));
    // The default page is 20; more than 100 is 100.
    let page = search(
        &service,
        &admin,
        SearchRequest {
            page_size: 1_000,
            ..query("puffin")
        },
    )
    .await;
    assert_eq!(page.hits.len(), 16);
}

async fn search_follows_renames_and_deletions(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let (image, session) = conversation(&service, &admin, "box", "Heron watch").await;
    let (_, kept) = conversation(&service, &admin, "other", "Kept").await;
    say(&service, A, &session, "m1", 1_000, said("a grey heron")).await;
    say(&service, A, &kept, "k1", 1_000, said("another heron")).await;
    let update = ImageUpdate {
        name: Some("Egret watch".to_owned()),
        ..ImageUpdate::default()
    };
    service.update_image(&admin, &image, update).await.expect("rename");
    let keys = |page: SearchPage| found(&page).into_iter().collect::<BTreeSet<_>>();
    assert_eq!(
        keys(search(&service, &admin, query("egret")).await),
        BTreeSet::from([format!("name:{image}")])
    );
    assert_eq!(
        keys(search(&service, &admin, query("heron")).await),
        BTreeSet::from(["m1".to_owned(), "k1".to_owned()])
    );

    service.delete_image(&admin, &image).await.expect("delete image");
    assert_eq!(
        keys(search(&service, &admin, query("heron")).await),
        BTreeSet::from(["k1".to_owned()])
    );
    assert!(search(&service, &admin, query("egret")).await.hits.is_empty());
    service
        .delete_container(&admin, "other")
        .await
        .expect("delete container");
    assert!(search(&service, &admin, query("heron")).await.hits.is_empty());
    assert!(search(&service, &admin, query("kept")).await.hits.is_empty());
}

async fn search_refuses_bad_queries(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    let refused = |request: SearchRequest| {
        let service = service.clone();
        let admin = admin.clone();
        async move { reason(service.search(&admin, request).await) }
    };
    assert_eq!(refused(query("")).await, "INVALID_QUERY");
    assert_eq!(refused(query("\"\" - *")).await, "INVALID_QUERY");
    assert_eq!(refused(query("a\u{0}b")).await, "INVALID_QUERY");
    assert_eq!(refused(query(&"x".repeat(20_000))).await, "INVALID_QUERY");
    // FTS5 and tsquery syntax are words here, never errors.
    for text in [
        "NEAR(a b)",
        "a AND OR NOT",
        "col:word",
        "a* ^b",
        "((( owl",
        "'\\ owl",
        "\"a\" OR \"b",
    ] {
        service.search(&admin, query(text)).await.expect(text);
    }
    let with = |change: &dyn Fn(&mut SearchRequest)| {
        let mut request = query("word");
        change(&mut request);
        request
    };
    assert_eq!(
        refused(with(&|r| r.role = Some("system".to_owned()))).await,
        "INVALID_ROLE"
    );
    assert_eq!(
        refused(with(&|r| r.page_token = "-5".to_owned())).await,
        "INVALID_PAGE_TOKEN"
    );
    assert_eq!(
        refused(with(&|r| r.page_token = "99999999".to_owned())).await,
        "INVALID_PAGE_TOKEN"
    );
    assert_eq!(
        refused(with(&|r| r.container_id = Some("x".repeat(20_000)))).await,
        "INVALID_CONTAINER_ID"
    );
    assert_eq!(
        refused(with(&|r| r.image_id = Some("x".repeat(20_000)))).await,
        "INVALID_IMAGE_ID"
    );
    assert_eq!(
        refused(with(&|r| {
            r.from_ms = Some(2);
            r.to_ms = Some(1);
        }))
        .await,
        "INVALID_TIME_RANGE"
    );
    // A user message as the gateway stores it is found by its user too.
    let (_, session) = conversation(&service, &admin, "box", "Mine").await;
    service
        .append_message(&admin, &session, user("u1", "plover"))
        .await
        .expect("append");
    assert_eq!(found(&search(&service, &admin, query("plover")).await), ["u1"]);
}

/// What was stored before search existed is found once the migration ran.
#[tokio::test]
async fn sqlite_migration_indexes_what_exists() {
    migration_indexes_what_exists(TestDatabase::sqlite("session.db")).await;
}

#[tokio::test]
async fn postgres_migration_indexes_what_exists() {
    let Some(db) = TestDatabase::postgres("avm_session_test").await else {
        return;
    };
    migration_indexes_what_exists(db).await;
}

async fn migration_indexes_what_exists(db: TestDatabase) {
    use avm_store::db::{DbPool, connect};
    let pool = connect(&db.url, Some(2)).await.expect("connect");
    let before = |all: sqlx::migrate::Migrator| sqlx::migrate::Migrator {
        migrations: all.migrations.iter().filter(|m| m.version < 9).cloned().collect(),
        ..all
    };
    let rows = [
        "INSERT INTO containers (tenant_id, container_id, created_at_ms, owner_id) VALUES ('t', 'c', 1, 'u')",
        "INSERT INTO images (image_id, tenant_id, container_id, name, mcp_servers_json, created_at_ms, updated_at_ms) \
         VALUES ('img_1', 't', 'c', 'Old osprey notes', '{}', 1, 1)",
        "INSERT INTO sessions (session_id, tenant_id, image_id, created_at_ms, last_seq) VALUES ('sess_1', 't', 'img_1', 1, 2)",
        r#"INSERT INTO messages (session_id, seq, message_id, kind, body, created_at_ms) VALUES
           ('sess_1', 1, 'm1', 'user', '{"kind":"user","content_json":"\"an osprey dived\""}', 1),
           ('sess_1', 2, 'm2', 'assistant', '{"kind":"assistant","text":"ospreys eat fish","interrupted":false,"model":"","stop_reason":""}', 2)"#,
    ];
    match &pool {
        DbPool::Sqlite(pool) => {
            before(sqlx::migrate!("./migrations/sqlite"))
                .run(pool)
                .await
                .expect("old schema");
            for row in rows {
                sqlx::query(row).execute(pool).await.expect(row);
            }
        }
        DbPool::Postgres(pool) => {
            before(sqlx::migrate!("./migrations/postgres"))
                .run(pool)
                .await
                .expect("old schema");
            for row in rows {
                sqlx::query(row).execute(pool).await.expect(row);
            }
        }
    }
    let store = avm_session::open_store(&db.url, Some(2)).await.expect("migrate");
    let service = SessionService::new(store);
    let admin = ctx("t");
    let keys: BTreeSet<String> = found(&search(&service, &admin, query("osprey")).await)
        .into_iter()
        .collect();
    assert_eq!(keys, BTreeSet::from(["m1".to_owned(), "name:img_1".to_owned()]));
    assert_eq!(found(&search(&service, &admin, query("fish")).await), ["m2"]);
    // The history reads as before, and grows on.
    let messages = service.list_messages(&admin, "sess_1").await.expect("history");
    assert_eq!(messages.iter().map(|m| m.seq).collect::<Vec<_>>(), [1, 2]);
    service
        .append_message(&admin, "sess_1", user("m3", "osprey again"))
        .await
        .expect("append");
    assert_eq!(search(&service, &admin, query("osprey")).await.hits.len(), 3);
}

async fn recent_lists_the_latest_first_with_unread_counts(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob, admin) = (member(A, "alice"), member(A, "bob"), ctx(A));
    let (first, first_session) = conversation(&service, &alice, "alice-box", "First").await;
    let (second, second_session) = conversation(&service, &alice, "alice-box", "Second").await;
    let (third, _) = conversation(&service, &alice, "alice-box", "Third, quiet").await;
    // Messages written after the conversations were made (the runtime's times).
    let t0 = avm_common::now_ms() + 10_000;
    say(&service, A, &first_session, "f1", t0 + 1, said("hello")).await;
    say(&service, A, &second_session, "s1", t0 + 2, said("hi")).await;
    say(
        &service,
        A,
        &second_session,
        "s2",
        t0 + 3,
        assistant(&format!("a long answer {}", "word ".repeat(100))),
    )
    .await;
    let ids = |page: &avm_session::RecentPage| {
        page.conversations
            .iter()
            .map(|row| row.image_id.clone())
            .collect::<Vec<_>>()
    };

    // By last activity: its last message, or when it was made.
    let page = service.list_recent(&alice, 0, "").await.unwrap();
    assert_eq!(ids(&page), [second.clone(), first.clone(), third.clone()]);
    let row = &page.conversations[0];
    assert_eq!(
        (row.last_seq, row.read_seq, row.unread(), row.last_active_at_ms),
        (2, 0, 2, t0 + 3)
    );
    let last = row.last_message.as_ref().unwrap();
    assert_eq!((last.message_id.as_str(), last.body.kind()), ("s2", "assistant"));
    let preview = avm_session::preview(last);
    assert!(
        preview.starts_with("a long answer word") && preview.ends_with('…'),
        "{preview}"
    );
    assert_eq!(preview.chars().count(), avm_session::PREVIEW_CHARS + 1);
    assert!(page.conversations[2].last_message.is_none());
    assert_eq!(page.conversations[2].unread(), 0);

    // Read markers: forward only, never past the last message, per user.
    assert_eq!(service.mark_read(&alice, &second, Some(1)).await.unwrap(), 1);
    assert_eq!(service.mark_read(&alice, &second, Some(99)).await.unwrap(), 2);
    assert_eq!(service.mark_read(&alice, &second, Some(1)).await.unwrap(), 2);
    assert_eq!(service.mark_read(&alice, &first, None).await.unwrap(), 1);
    let page = service.list_recent(&alice, 0, "").await.unwrap();
    assert!(page.conversations.iter().all(|row| row.unread() == 0), "{page:?}");
    // The admin sees them all, unread by the admin.
    let theirs = service.list_recent(&admin, 0, "").await.unwrap();
    assert_eq!(ids(&theirs), [second.clone(), first.clone(), third.clone()]);
    assert_eq!(theirs.conversations[0].unread(), 2);

    // A new message brings its conversation to the top, unread.
    say(&service, A, &first_session, "f2", t0 + 10, assistant("news")).await;
    let page = service.list_recent(&alice, 0, "").await.unwrap();
    assert_eq!(page.conversations[0].image_id, first);
    assert_eq!(page.conversations[0].unread(), 1);

    // Pages of one walk all three once.
    let mut walked = Vec::new();
    let mut token = String::new();
    loop {
        let page = service.list_recent(&alice, 1, &token).await.unwrap();
        walked.extend(ids(&page));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(walked, [first.clone(), second.clone(), third.clone()]);

    // Nobody else's: another member, another tenant; their ids are unknown.
    assert!(service.list_recent(&bob, 0, "").await.unwrap().conversations.is_empty());
    assert!(
        service
            .list_recent(&ctx(B), 0, "")
            .await
            .unwrap()
            .conversations
            .is_empty()
    );
    assert_eq!(reason(service.mark_read(&bob, &first, None).await), "IMAGE_NOT_FOUND");
    assert_eq!(
        reason(service.mark_read(&ctx(B), &first, None).await),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        reason(service.mark_read(&alice, &"x".repeat(20_000), None).await),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        reason(service.list_recent(&alice, 0, "garbage").await),
        "INVALID_PAGE_TOKEN"
    );
}

/// Writes that reach the search indexes, many at once: each waits its turn
/// for the write lock (SQLite) rather than failing busy.
async fn indexed_writes_at_once_all_land(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let admin = ctx(A);
    service.create_container(&admin, "busy").await.unwrap();
    let writes = (0..32).map(|n| {
        let service = service.clone();
        let admin = admin.clone();
        tokio::spawn(async move {
            let (_, session) = conversation(&service, &admin, "busy", &format!("wren {n}")).await;
            say(&service, A, &session, "m1", 1 + n, said("a wren sang")).await;
        })
    });
    for write in writes.collect::<Vec<_>>() {
        write.await.expect("every write lands");
    }
    let page = search(
        &service,
        &admin,
        SearchRequest {
            page_size: 100,
            ..query("wren")
        },
    )
    .await;
    assert_eq!(page.hits.len(), 64, "32 names and 32 messages");
}
