//! Groups, their members, messages and read cursors: every body runs against
//! SQLite and Postgres.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use avm_common::Code;
use avm_common::auth::{Role, Scopes};
use avm_common::testing::service_ctx;
use avm_session::{
    GroupMessageRecord, GroupRecord, GroupUpdate, ImageRecord, MAX_MESSAGE_BYTES, MemberKind, MemberRef, NewGroup,
    NewGroupMessage, NewImage, PostedGroupMessage, SessionService, SessionStore, ShareRole, WakeMode,
};

use crate::support::{api_err, member, principal_ctx, reason};

/// The runtime acting for `tenant_id`: it sees the whole tenant, as an admin
/// does, and alone posts as agents and moves their cursors.
fn ctx(tenant_id: &str) -> avm_common::RequestContext {
    service_ctx(tenant_id)
}

conformance_suite!(
    groups_create_get_update_and_delete,
    groups_list_newest_first_in_pages,
    groups_follow_container_visibility,
    members_are_images_of_the_container_or_users,
    posts_need_members_and_valid_content,
    concurrent_posts_get_gapless_seqs,
    reposts_return_the_stored_message,
    unread_is_a_query_and_cursors_only_advance,
    consecutive_agent_messages_reset_on_a_user_message,
    deletions_cascade_to_groups_and_memberships,
);

const A: &str = "tenant-a";
const B: &str = "tenant-b";
const GHOST_GROUP: &str = "grp_00000000000000000000000000000000";

/// The caller of most tests: the tenant's admin, `usr_admin`.
fn admin() -> MemberRef {
    MemberRef::user("usr_admin")
}

async fn image(service: &SessionService, tenant: &str, container_id: &str) -> ImageRecord {
    service.create_container(&ctx(tenant), container_id).await.unwrap();
    let new = NewImage {
        container_id: container_id.to_owned(),
        ..NewImage::default()
    };
    service.create_image(&ctx(tenant), new).await.unwrap()
}

fn new_group(container_id: &str, name: &str, members: Vec<MemberRef>) -> NewGroup {
    NewGroup {
        container_id: container_id.to_owned(),
        name: name.to_owned(),
        wake_mode: None,
        members,
    }
}

fn post(id: Option<&str>, sender: &MemberRef, content: &str, mentions: &[&str]) -> NewGroupMessage {
    NewGroupMessage {
        message_id: id.map(str::to_owned),
        sender: sender.clone(),
        content: content.to_owned(),
        mentions: mentions.iter().map(|m| (*m).to_owned()).collect(),
        created_at_ms: 0,
        read_seq: None,
    }
}

fn seqs(messages: &[GroupMessageRecord]) -> Vec<u64> {
    messages.iter().map(|m| m.seq).collect()
}

/// A group in container "room" with two agents and the admin as members.
async fn two_agents_and_admin(service: &SessionService) -> (GroupRecord, MemberRef, MemberRef) {
    let first = image(service, A, "room").await;
    let second = image(service, A, "room").await;
    let (first, second) = (MemberRef::agent(first.image_id), MemberRef::agent(second.image_id));
    let members = vec![first.clone(), second.clone(), admin()];
    let group = service
        .create_group(&ctx(A), new_group("room", "team", members))
        .await
        .unwrap();
    (group, first, second)
}

async fn groups_create_get_update_and_delete(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    service.create_container(&ctx(A), "default").await.unwrap();
    let group = service
        .create_group(&ctx(A), new_group("default", "Planning ✓", Vec::new()))
        .await
        .unwrap();
    assert!(group.group_id.starts_with("grp_"), "{}", group.group_id);
    assert_eq!(
        (group.container_id.as_str(), group.name.as_str(), group.wake_mode),
        ("default", "Planning ✓", WakeMode::All)
    );
    assert_eq!((group.last_seq, group.consecutive_agent_messages), (0, 0));
    assert!(group.created_at_ms > 0);
    assert_eq!(group.created_at_ms, group.updated_at_ms);
    assert_eq!(service.get_group(&ctx(A), &group.group_id).await.unwrap(), group);
    assert!(
        service
            .list_group_members(&ctx(A), &group.group_id)
            .await
            .unwrap()
            .is_empty()
    );

    let mentions_only = NewGroup {
        wake_mode: Some(WakeMode::Mentions),
        ..new_group("default", "quiet", Vec::new())
    };
    let quiet = service.create_group(&ctx(A), mentions_only).await.unwrap();
    assert_eq!(quiet.wake_mode, WakeMode::Mentions);

    // Names are validated at creation and on update.
    let long = "n".repeat(257);
    for bad in ["", "   ", long.as_str()] {
        let err = api_err(
            service
                .create_group(&ctx(A), new_group("default", bad, Vec::new()))
                .await,
        );
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::InvalidArgument, "INVALID_GROUP_NAME")
        );
        let rename = GroupUpdate {
            name: Some(bad.to_owned()),
            wake_mode: None,
        };
        assert_eq!(
            reason(service.update_group(&ctx(A), &group.group_id, rename).await),
            "INVALID_GROUP_NAME"
        );
    }
    assert_eq!(
        reason(
            service
                .create_group(&ctx(A), new_group("no such", "g", Vec::new()))
                .await
        ),
        "INVALID_CONTAINER_ID"
    );
    let err = api_err(
        service
            .create_group(&ctx(A), new_group("nowhere", "g", Vec::new()))
            .await,
    );
    assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "CONTAINER_NOT_FOUND"));

    // Update changes only what it names.
    let renamed = service
        .update_group(
            &ctx(A),
            &group.group_id,
            GroupUpdate {
                name: Some("Renamed".into()),
                wake_mode: None,
            },
        )
        .await
        .unwrap();
    assert_eq!((renamed.name.as_str(), renamed.wake_mode), ("Renamed", WakeMode::All));
    assert!(renamed.updated_at_ms >= group.updated_at_ms);
    let muted = service
        .update_group(
            &ctx(A),
            &group.group_id,
            GroupUpdate {
                name: None,
                wake_mode: Some(WakeMode::Mentions),
            },
        )
        .await
        .unwrap();
    assert_eq!((muted.name.as_str(), muted.wake_mode), ("Renamed", WakeMode::Mentions));
    assert_eq!(service.get_group(&ctx(A), &group.group_id).await.unwrap(), muted);

    // Read-only credentials read but do not write.
    let reader = principal_ctx(A, "usr_admin", Role::Admin, Scopes::READ);
    assert_eq!(service.get_group(&reader, &group.group_id).await.unwrap(), muted);
    let denied = api_err(service.delete_group(&reader, &group.group_id).await);
    assert_eq!(denied.code, Code::PermissionDenied);
    let denied = api_err(
        service
            .post_group_message(&reader, &group.group_id, post(None, &admin(), "hi", &[]))
            .await,
    );
    assert_eq!(denied.code, Code::PermissionDenied);

    service.delete_group(&ctx(A), &group.group_id).await.unwrap();
    for err in [
        api_err(service.get_group(&ctx(A), &group.group_id).await),
        api_err(service.delete_group(&ctx(A), &group.group_id).await),
        api_err(service.list_group_members(&ctx(A), &group.group_id).await),
        api_err(service.list_group_messages(&ctx(A), &group.group_id, 0, 0).await),
    ] {
        assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "GROUP_NOT_FOUND"));
    }
    assert_eq!(service.get_group(&ctx(A), &quiet.group_id).await.unwrap(), quiet);
}

async fn groups_list_newest_first_in_pages(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    service.create_container(&ctx(A), "default").await.unwrap();
    service.create_container(&ctx(A), "other").await.unwrap();
    let mut made = Vec::new();
    for n in 0..7 {
        let group = service
            .create_group(&ctx(A), new_group("default", &format!("g{n}"), Vec::new()))
            .await
            .unwrap();
        made.push(group);
    }
    service
        .create_group(&ctx(A), new_group("other", "elsewhere", Vec::new()))
        .await
        .unwrap();
    // Newest first: by creation time, then by id, both descending.
    made.sort_by(|a, b| (b.created_at_ms, &b.group_id).cmp(&(a.created_at_ms, &a.group_id)));

    let all = service.list_groups(&ctx(A), "default", 0, "").await.unwrap();
    assert_eq!(all.groups, made);
    assert_eq!(all.next_page_token, None);

    let mut paged = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = service.list_groups(&ctx(A), "default", 3, &token).await.unwrap();
        assert!(page.groups.len() <= 3);
        pages += 1;
        paged.extend(page.groups);
        match page.next_page_token {
            Some(next) => token = next,
            None => break,
        }
    }
    assert_eq!((pages, paged), (3, made.clone()));
    let exact = service.list_groups(&ctx(A), "default", 7, "").await.unwrap();
    assert_eq!((exact.groups.len(), exact.next_page_token), (7, None));

    assert_eq!(
        reason(service.list_groups(&ctx(A), "default", 3, "not-a-token").await),
        "INVALID_PAGE_TOKEN"
    );
    // A missing (or foreign) container has no groups, as with images.
    assert!(
        service
            .list_groups(&ctx(A), "nowhere", 0, "")
            .await
            .unwrap()
            .groups
            .is_empty()
    );
    assert!(
        service
            .list_groups(&ctx(B), "default", 0, "")
            .await
            .unwrap()
            .groups
            .is_empty()
    );
}

async fn groups_follow_container_visibility(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (alice, bob) = (member(A, "usr_alice"), member(A, "usr_bob"));
    service.create_container(&alice, "alice-box").await.unwrap();
    let agent = service
        .create_image(
            &alice,
            NewImage {
                container_id: "alice-box".into(),
                ..NewImage::default()
            },
        )
        .await
        .unwrap();
    let agent = MemberRef::agent(agent.image_id);
    let members = vec![MemberRef::user("usr_alice"), agent.clone()];
    let group = service
        .create_group(&alice, new_group("alice-box", "private", members))
        .await
        .unwrap();
    let alice_post = post(Some("m1"), &MemberRef::user("usr_alice"), "secret", &[]);
    service
        .post_group_message(&alice, &group.group_id, alice_post)
        .await
        .unwrap();
    let id = group.group_id.as_str();

    // Another tenant's admin, and a member the container is not shared with,
    // are answered exactly as for a group that does not exist.
    for (outsider, me) in [(ctx(B), admin()), (bob.clone(), MemberRef::user("usr_bob"))] {
        let same = |foreign: avm_common::ApiError, missing: avm_common::ApiError| {
            assert_eq!((foreign.code, &foreign.reason), (missing.code, &missing.reason));
            assert_eq!(
                (foreign.code, foreign.reason.as_ref()),
                (Code::NotFound, "GROUP_NOT_FOUND")
            );
            assert_eq!(foreign.message.replace(id, GHOST_GROUP), missing.message);
        };
        same(
            api_err(service.get_group(&outsider, id).await),
            api_err(service.get_group(&outsider, GHOST_GROUP).await),
        );
        let rename = || GroupUpdate {
            name: Some("mine".into()),
            wake_mode: None,
        };
        same(
            api_err(service.update_group(&outsider, id, rename()).await),
            api_err(service.update_group(&outsider, GHOST_GROUP, rename()).await),
        );
        same(
            api_err(service.delete_group(&outsider, id).await),
            api_err(service.delete_group(&outsider, GHOST_GROUP).await),
        );
        same(
            api_err(service.add_group_member(&outsider, id, me.clone()).await),
            api_err(service.add_group_member(&outsider, GHOST_GROUP, me.clone()).await),
        );
        same(
            api_err(service.remove_group_member(&outsider, id, agent.clone()).await),
            api_err(service.remove_group_member(&outsider, GHOST_GROUP, agent.clone()).await),
        );
        same(
            api_err(service.list_group_members(&outsider, id).await),
            api_err(service.list_group_members(&outsider, GHOST_GROUP).await),
        );
        same(
            api_err(
                service
                    .post_group_message(&outsider, id, post(None, &me, "hi", &[]))
                    .await,
            ),
            api_err(
                service
                    .post_group_message(&outsider, GHOST_GROUP, post(None, &me, "hi", &[]))
                    .await,
            ),
        );
        same(
            api_err(service.list_group_messages(&outsider, id, 0, 0).await),
            api_err(service.list_group_messages(&outsider, GHOST_GROUP, 0, 0).await),
        );
        same(
            api_err(service.advance_read_cursor(&outsider, id, me.clone(), 1).await),
            api_err(service.advance_read_cursor(&outsider, GHOST_GROUP, me.clone(), 1).await),
        );
        assert!(
            service
                .list_unread(&outsider, agent.clone(), 10)
                .await
                .unwrap()
                .is_empty()
        );
        assert!(
            service
                .list_groups(&outsider, "alice-box", 0, "")
                .await
                .unwrap()
                .groups
                .is_empty()
        );
    }
    // Nothing the outsiders tried changed anything.
    assert_eq!(
        service.get_group(&alice, id).await.unwrap(),
        GroupRecord {
            last_seq: 1,
            ..group.clone()
        }
    );
    assert_eq!(service.list_group_members(&alice, id).await.unwrap().len(), 2);
    assert_eq!(service.list_unread(&alice, agent.clone(), 0).await.unwrap().len(), 1);

    // Shared with Bob, the group is his to see and join; the admin sees everything.
    service
        .share_container(&alice, "alice-box", "usr_bob", ShareRole::Manage)
        .await
        .unwrap();
    assert_eq!(service.get_group(&bob, id).await.unwrap().group_id, id);
    service
        .add_group_member(&bob, id, MemberRef::user("usr_bob"))
        .await
        .unwrap();
    let reply = post(None, &MemberRef::user("usr_bob"), "hello", &["usr_alice"]);
    assert_eq!(
        service.post_group_message(&bob, id, reply).await.unwrap().message.seq,
        2
    );
    assert_eq!(
        service
            .list_groups(&ctx(A), "alice-box", 0, "")
            .await
            .unwrap()
            .groups
            .len(),
        1
    );
}

async fn members_are_images_of_the_container_or_users(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let here = image(&service, A, "room").await;
    let elsewhere = image(&service, A, "other-room").await;
    let foreign = image(&service, B, "room").await;
    let group = service
        .create_group(&ctx(A), new_group("room", "g", Vec::new()))
        .await
        .unwrap();
    let id = group.group_id.as_str();

    let added = service
        .add_group_member(&ctx(A), id, MemberRef::agent(&here.image_id))
        .await
        .unwrap();
    assert_eq!(
        (added.group_id.as_str(), &added.member, added.read_seq),
        (id, &MemberRef::agent(&here.image_id), 0)
    );
    assert!(added.joined_at_ms > 0);
    service
        .add_group_member(&ctx(A), id, MemberRef::user("usr_carol"))
        .await
        .unwrap();

    // An agent is an image of the group's own container.
    let err = api_err(
        service
            .add_group_member(&ctx(A), id, MemberRef::agent(&elsewhere.image_id))
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::InvalidArgument, "IMAGE_NOT_IN_GROUP_CONTAINER")
    );
    for missing in [foreign.image_id.as_str(), "img_00000000000000000000000000000000"] {
        let err = api_err(service.add_group_member(&ctx(A), id, MemberRef::agent(missing)).await);
        assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "IMAGE_NOT_FOUND"));
    }
    // One member per id, whatever the kind.
    for duplicate in [MemberRef::agent(&here.image_id), MemberRef::user("usr_carol")] {
        let err = api_err(service.add_group_member(&ctx(A), id, duplicate).await);
        assert_eq!(
            (err.code, err.reason.as_ref()),
            (Code::AlreadyExists, "GROUP_MEMBER_EXISTS")
        );
    }
    let err = api_err(
        service
            .add_group_member(&ctx(A), id, MemberRef::user(&here.image_id))
            .await,
    );
    assert_eq!(err.code, Code::AlreadyExists);
    for bad in ["", "has space", "slash/"] {
        assert_eq!(
            reason(service.add_group_member(&ctx(A), id, MemberRef::user(bad)).await),
            "INVALID_MEMBER_ID"
        );
    }

    // Members list in the order they joined, each with nothing read.
    let listed = service.list_group_members(&ctx(A), id).await.unwrap();
    let who: Vec<&MemberRef> = listed.iter().map(|m| &m.member).collect();
    assert_eq!(who, [&MemberRef::agent(&here.image_id), &MemberRef::user("usr_carol")]);
    assert!(listed.iter().all(|m| m.read_seq == 0 && m.group_id == id));

    // Removal names the kind too; a non-member is GROUP_MEMBER_NOT_FOUND.
    let err = api_err(
        service
            .remove_group_member(&ctx(A), id, MemberRef::agent("usr_carol"))
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::NotFound, "GROUP_MEMBER_NOT_FOUND")
    );
    service
        .remove_group_member(&ctx(A), id, MemberRef::user("usr_carol"))
        .await
        .unwrap();
    let err = api_err(
        service
            .remove_group_member(&ctx(A), id, MemberRef::user("usr_carol"))
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::NotFound, "GROUP_MEMBER_NOT_FOUND")
    );
    assert_eq!(service.list_group_members(&ctx(A), id).await.unwrap().len(), 1);

    // Initial members follow the same rules, and a refused one creates nothing.
    let twice = vec![MemberRef::user("usr_dan"), MemberRef::user("usr_dan")];
    assert_eq!(
        reason(service.create_group(&ctx(A), new_group("room", "g2", twice)).await),
        "DUPLICATE_GROUP_MEMBER"
    );
    let astray = vec![MemberRef::user("usr_dan"), MemberRef::agent(&elsewhere.image_id)];
    assert_eq!(
        reason(service.create_group(&ctx(A), new_group("room", "g2", astray)).await),
        "IMAGE_NOT_IN_GROUP_CONTAINER"
    );
    let ghost = vec![MemberRef::agent("img_00000000000000000000000000000000")];
    assert_eq!(
        reason(service.create_group(&ctx(A), new_group("room", "g2", ghost)).await),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        service.list_groups(&ctx(A), "room", 0, "").await.unwrap().groups.len(),
        1
    );
    let many = (0..65).map(|n| MemberRef::user(format!("usr_{n}"))).collect();
    assert_eq!(
        reason(service.create_group(&ctx(A), new_group("room", "g2", many)).await),
        "TOO_MANY_GROUP_MEMBERS"
    );
}

async fn posts_need_members_and_valid_content(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (group, first, second) = two_agents_and_admin(&service).await;
    let id = group.group_id.as_str();

    let refused = |sender: &MemberRef, content: &str, mentions: &[&str]| post(None, sender, content, mentions);
    let stranger = MemberRef::agent("img_00000000000000000000000000000000");
    let err = api_err(
        service
            .post_group_message(&ctx(A), id, refused(&stranger, "hi", &[]))
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::FailedPrecondition, "SENDER_NOT_GROUP_MEMBER")
    );
    // The kind is part of who a sender is.
    let posing = MemberRef::user(&first.member_id);
    let err = api_err(
        service
            .post_group_message(&service_ctx(A), id, refused(&posing, "hi", &[]))
            .await,
    );
    assert_eq!(err.reason, "SENDER_NOT_GROUP_MEMBER");
    let err = api_err(
        service
            .post_group_message(&ctx(A), id, refused(&first, "hi", &["usr_nobody"]))
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::FailedPrecondition, "MENTION_NOT_GROUP_MEMBER")
    );
    for blank in ["", "  \n"] {
        assert_eq!(
            reason(
                service
                    .post_group_message(&ctx(A), id, refused(&first, blank, &[]))
                    .await
            ),
            "EMPTY_GROUP_MESSAGE"
        );
    }
    let huge = "x".repeat(MAX_MESSAGE_BYTES + 1);
    assert_eq!(
        reason(
            service
                .post_group_message(&ctx(A), id, refused(&first, &huge, &[]))
                .await
        ),
        "MESSAGE_TOO_LARGE"
    );
    assert_eq!(
        reason(
            service
                .post_group_message(&ctx(A), id, post(Some("bad id"), &first, "hi", &[]))
                .await
        ),
        "INVALID_MESSAGE_ID"
    );
    let crowd: Vec<String> = (0..65).map(|n| format!("m{n}")).collect();
    let crowd: Vec<&str> = crowd.iter().map(String::as_str).collect();
    assert_eq!(
        reason(
            service
                .post_group_message(&ctx(A), id, refused(&first, "hi", &crowd))
                .await
        ),
        "TOO_MANY_MENTIONS"
    );
    // A user posts only as themself; services post for anyone.
    service
        .add_group_member(&ctx(A), id, MemberRef::user("usr_erin"))
        .await
        .unwrap();
    let err = api_err(
        service
            .post_group_message(
                &crate::support::ctx(A),
                id,
                refused(&MemberRef::user("usr_erin"), "hi", &[]),
            )
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::PermissionDenied, "SENDER_NOT_CALLER")
    );
    let group_after_refusals = service.get_group(&ctx(A), id).await.unwrap();
    assert_eq!(
        (
            group_after_refusals.last_seq,
            group_after_refusals.consecutive_agent_messages
        ),
        (0, 0),
        "a refused post takes no seq and moves no counter"
    );

    let PostedGroupMessage {
        message: by_service,
        created,
        ..
    } = service
        .post_group_message(
            &service_ctx(A),
            id,
            refused(&MemberRef::user("usr_erin"), "from erin", &[]),
        )
        .await
        .unwrap();
    assert!(created);
    assert_eq!(by_service.seq, 1, "refused posts left no gap");
    // Mentions are kept once each, in order, and may name any member.
    let mentions = [second.member_id.as_str(), "usr_admin", second.member_id.as_str()];
    let PostedGroupMessage { message: stored, .. } = service
        .post_group_message(&ctx(A), id, post(None, &first, "ping", &mentions))
        .await
        .unwrap();
    assert_eq!(stored.mentions, [second.member_id.clone(), "usr_admin".to_owned()]);
    assert!(stored.message_id.starts_with("gmsg_"), "{}", stored.message_id);
    assert!(stored.created_at_ms > 0);
    assert_eq!(
        (stored.seq, stored.sender.clone(), stored.content.as_str()),
        (2, first, "ping")
    );
    let listed = service.list_group_messages(&ctx(A), id, 0, 0).await.unwrap();
    assert_eq!(listed, [by_service, stored]);
}

async fn concurrent_posts_get_gapless_seqs(store: Arc<dyn SessionStore>) {
    const POSTS: u64 = 50;
    let service = SessionService::new(store);
    let (group, first, second) = two_agents_and_admin(&service).await;
    let mut tasks = tokio::task::JoinSet::new();
    // 50 distinct messages from three senders, each sent twice at once (a
    // redelivery): 50 rows, seqs 1..=50, both sends answered with one message.
    let senders = [first, second, admin()];
    for n in 0..2 * POSTS {
        let (service, group_id) = (service.clone(), group.group_id.clone());
        let k = n % POSTS;
        let message = post(
            Some(&format!("msg_{k}")),
            &senders[(k % 3) as usize],
            &format!("text {k}"),
            &[],
        );
        tasks.spawn(async move { service.post_group_message(&ctx(A), &group_id, message).await });
    }
    let mut by_id: BTreeMap<String, GroupMessageRecord> = BTreeMap::new();
    let mut created = 0;
    while let Some(joined) = tasks.join_next().await {
        let PostedGroupMessage {
            message: stored,
            created: new,
            ..
        } = joined.unwrap().unwrap();
        created += u64::from(new);
        if let Some(earlier) = by_id.insert(stored.message_id.clone(), stored.clone()) {
            assert_eq!(earlier, stored, "both sends of one id see the same stored message");
        }
    }
    assert_eq!(created, POSTS, "each id was stored once");
    let listed = service
        .list_group_messages(&ctx(A), &group.group_id, 0, 1000)
        .await
        .unwrap();
    assert_eq!(seqs(&listed), (1..=POSTS).collect::<Vec<_>>(), "no gaps, no duplicates");
    let mut stored: Vec<GroupMessageRecord> = by_id.into_values().collect();
    stored.sort_by_key(|m| m.seq);
    assert_eq!(listed, stored);
    assert_eq!(
        service.get_group(&ctx(A), &group.group_id).await.unwrap().last_seq,
        POSTS
    );

    // The streak each message carries is the one its place in the order gives.
    let mut streak = 0;
    for message in &listed {
        streak = if message.sender.kind == MemberKind::User {
            0
        } else {
            streak + 1
        };
        assert_eq!(message.consecutive_agent_messages, streak, "seq {}", message.seq);
    }
    // Pages after a seq, with a limit, walk the same order.
    let page = service
        .list_group_messages(&ctx(A), &group.group_id, 45, 3)
        .await
        .unwrap();
    assert_eq!(seqs(&page), [46, 47, 48]);
    let tail = service
        .list_group_messages(&ctx(A), &group.group_id, 48, 0)
        .await
        .unwrap();
    assert_eq!(seqs(&tail), [49, 50]);
}

async fn reposts_return_the_stored_message(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (group, first, second) = two_agents_and_admin(&service).await;
    let id = group.group_id.as_str();
    let PostedGroupMessage {
        message: original,
        created,
        ..
    } = service
        .post_group_message(&ctx(A), id, post(Some("reply-1"), &first, "the answer", &[]))
        .await
        .unwrap();
    assert!(created);
    // A redelivery, even with other content or from another sender, gets the stored message.
    let PostedGroupMessage {
        message: again,
        created,
        ..
    } = service
        .post_group_message(&ctx(A), id, post(Some("reply-1"), &second, "changed", &["usr_admin"]))
        .await
        .unwrap();
    assert!(!created);
    assert_eq!(again, original);
    // ... and after its sender left the group.
    service.remove_group_member(&ctx(A), id, first.clone()).await.unwrap();
    let PostedGroupMessage {
        message: late, created, ..
    } = service
        .post_group_message(&ctx(A), id, post(Some("reply-1"), &first, "the answer", &[]))
        .await
        .unwrap();
    assert_eq!((late, created), (original.clone(), false));
    assert_eq!(
        reason(
            service
                .post_group_message(&ctx(A), id, post(Some("reply-2"), &first, "again", &[]))
                .await
        ),
        "SENDER_NOT_GROUP_MEMBER"
    );

    // Re-posts consumed no seq and moved no counter.
    let PostedGroupMessage { message: next, .. } = service
        .post_group_message(&ctx(A), id, post(Some("reply-2"), &second, "next", &[]))
        .await
        .unwrap();
    assert_eq!((next.seq, next.consecutive_agent_messages), (2, 2));
    let listed = service.list_group_messages(&ctx(A), id, 0, 0).await.unwrap();
    assert_eq!(listed, [original, next]);
    // The same id in another group is another message.
    let third = MemberRef::agent(image(&service, A, "room").await.image_id);
    let other = service
        .create_group(&ctx(A), new_group("room", "other", vec![third.clone()]))
        .await
        .unwrap();
    let PostedGroupMessage {
        message: elsewhere,
        created,
        ..
    } = service
        .post_group_message(&ctx(A), &other.group_id, post(Some("reply-1"), &third, "hi", &[]))
        .await
        .unwrap();
    assert!(created);
    assert_eq!(
        (elsewhere.seq, elsewhere.group_id.as_str()),
        (1, other.group_id.as_str())
    );
}

async fn unread_is_a_query_and_cursors_only_advance(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (team, first, second) = two_agents_and_admin(&service).await;
    // A second group with only the first agent and the admin.
    let pair = service
        .create_group(&ctx(A), new_group("room", "pair", vec![first.clone(), admin()]))
        .await
        .unwrap();
    assert!(
        service
            .list_unread(&ctx(A), first.clone(), 10)
            .await
            .unwrap()
            .is_empty()
    );

    for n in 1..=5 {
        let message = post(None, &admin(), &format!("team {n}"), &[]);
        service
            .post_group_message(&ctx(A), &team.group_id, message)
            .await
            .unwrap();
    }
    for n in 1..=2 {
        let message = post(None, &admin(), &format!("pair {n}"), &[]);
        service
            .post_group_message(&ctx(A), &pair.group_id, message)
            .await
            .unwrap();
    }

    // The first agent has unread messages in both groups, the second in one.
    let unread = service.list_unread(&ctx(A), first.clone(), 0).await.unwrap();
    let counts: BTreeMap<&str, (u64, u64)> = unread
        .iter()
        .map(|u| (u.group.group_id.as_str(), (u.read_seq, u.unread_count)))
        .collect();
    assert_eq!(
        counts,
        BTreeMap::from([(team.group_id.as_str(), (0, 5)), (pair.group_id.as_str(), (0, 2))])
    );
    assert!(
        unread.iter().all(|u| u.messages.is_empty()),
        "a limit of 0 asks for counts only"
    );
    let ordered: Vec<&str> = unread.iter().map(|u| u.group.group_id.as_str()).collect();
    let mut sorted = ordered.clone();
    sorted.sort_unstable();
    assert_eq!(ordered, sorted, "groups come by id");
    let second_unread = service.list_unread(&ctx(A), second.clone(), 3).await.unwrap();
    assert_eq!(second_unread.len(), 1);
    assert_eq!(second_unread[0].unread_count, 5);
    assert_eq!(
        seqs(&second_unread[0].messages),
        [1, 2, 3],
        "the first unread, oldest first"
    );
    assert_eq!(second_unread[0].messages[0].content, "team 1");
    // The count is the messages after the cursor, as listing them shows.
    let after_cursor = service
        .list_group_messages(&ctx(A), &team.group_id, second_unread[0].read_seq, 1000)
        .await
        .unwrap();
    assert_eq!(after_cursor.len() as u64, second_unread[0].unread_count);

    // Forward moves the cursor.
    let moved = service
        .advance_read_cursor(&ctx(A), &team.group_id, first.clone(), 3)
        .await
        .unwrap();
    assert_eq!((moved.member.clone(), moved.read_seq), (first.clone(), 3));
    let unread = service.list_unread(&ctx(A), first.clone(), 10).await.unwrap();
    let team_unread = unread.iter().find(|u| u.group.group_id == team.group_id).unwrap();
    assert_eq!((team_unread.read_seq, team_unread.unread_count), (3, 2));
    assert_eq!(seqs(&team_unread.messages), [4, 5]);
    // Backwards, or to where it is, is a no-op, not an error.
    for earlier in [0, 1, 3] {
        let kept = service
            .advance_read_cursor(&ctx(A), &team.group_id, first.clone(), earlier)
            .await
            .unwrap();
        assert_eq!(kept.read_seq, 3, "advancing to {earlier}");
    }
    // Past the newest message means "read everything", never more.
    let all_read = service
        .advance_read_cursor(&ctx(A), &team.group_id, first.clone(), 1_000)
        .await
        .unwrap();
    assert_eq!(all_read.read_seq, 5);
    let unread = service.list_unread(&ctx(A), first.clone(), 10).await.unwrap();
    assert_eq!(
        unread.iter().map(|u| u.group.group_id.as_str()).collect::<Vec<_>>(),
        [pair.group_id.as_str()],
        "a group with nothing unread is left out"
    );
    // A new message makes the group unread again, from the cursor on.
    let message = post(None, &second, "news", &[&first.member_id]);
    service
        .post_group_message(&ctx(A), &team.group_id, message)
        .await
        .unwrap();
    let unread = service.list_unread(&ctx(A), first.clone(), 10).await.unwrap();
    let team_unread = unread.iter().find(|u| u.group.group_id == team.group_id).unwrap();
    assert_eq!((team_unread.read_seq, team_unread.unread_count), (5, 1));
    assert_eq!(team_unread.messages[0].content, "news");
    assert_eq!(team_unread.messages[0].mentions, std::slice::from_ref(&first.member_id));
    // The cursor is kept per member, and posting moves the sender's: the
    // admin read up to its last message, the second agent (which said
    // nothing of what it read) up to its news.
    let members = service.list_group_members(&ctx(A), &team.group_id).await.unwrap();
    let cursors: BTreeMap<&str, u64> = members
        .iter()
        .map(|m| (m.member.member_id.as_str(), m.read_seq))
        .collect();
    assert_eq!(
        cursors,
        BTreeMap::from([
            (first.member_id.as_str(), 5),
            (second.member_id.as_str(), 6),
            ("usr_admin", 5)
        ])
    );

    // Only members have cursors; the kind is part of who one is.
    let err = api_err(
        service
            .advance_read_cursor(&ctx(A), &pair.group_id, second.clone(), 1)
            .await,
    );
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::NotFound, "GROUP_MEMBER_NOT_FOUND")
    );
    let err = api_err(
        service
            .advance_read_cursor(&ctx(A), &pair.group_id, MemberRef::agent("usr_admin"), 1)
            .await,
    );
    assert_eq!(err.reason, "GROUP_MEMBER_NOT_FOUND");
    assert!(
        service
            .list_unread(&ctx(A), MemberRef::agent("usr_admin"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    // The admin wrote everything in the pair: only the team's news is unread to it.
    let admin_unread = service.list_unread(&ctx(A), admin(), 0).await.unwrap();
    assert_eq!(
        admin_unread
            .iter()
            .map(|u| (u.group.group_id.as_str(), u.unread_count))
            .collect::<Vec<_>>(),
        [(team.group_id.as_str(), 1)]
    );
}

async fn consecutive_agent_messages_reset_on_a_user_message(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (group, first, second) = two_agents_and_admin(&service).await;
    let id = group.group_id.as_str();
    let mut counted = Vec::new();
    let senders = [
        &first,
        &second,
        &first,
        &admin(),
        &second,
        &first,
        &admin(),
        &admin(),
        &first,
    ];
    for (n, sender) in senders.into_iter().enumerate() {
        let PostedGroupMessage { message: stored, .. } = service
            .post_group_message(&ctx(A), id, post(Some(&format!("m{n}")), sender, "x", &[]))
            .await
            .unwrap();
        counted.push(stored.consecutive_agent_messages);
        assert_eq!(
            service.get_group(&ctx(A), id).await.unwrap().consecutive_agent_messages,
            stored.consecutive_agent_messages,
            "the group row moves with each post"
        );
    }
    assert_eq!(counted, [1, 2, 3, 0, 1, 2, 0, 0, 1]);
    // Stored with each message, so history and re-posts answer the same.
    let listed = service.list_group_messages(&ctx(A), id, 0, 0).await.unwrap();
    let listed: Vec<u64> = listed.iter().map(|m| m.consecutive_agent_messages).collect();
    assert_eq!(listed, counted);
    let PostedGroupMessage {
        message: again,
        created,
        ..
    } = service
        .post_group_message(&ctx(A), id, post(Some("m2"), &first, "x", &[]))
        .await
        .unwrap();
    assert_eq!((again.consecutive_agent_messages, created), (3, false));
    assert_eq!(
        service.get_group(&ctx(A), id).await.unwrap().consecutive_agent_messages,
        1
    );
}

async fn deletions_cascade_to_groups_and_memberships(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let (team, first, second) = two_agents_and_admin(&service).await;
    let solo = service
        .create_group(&ctx(A), new_group("room", "solo", vec![first.clone()]))
        .await
        .unwrap();
    for (group_id, sender) in [
        (&team.group_id, &first),
        (&team.group_id, &second),
        (&solo.group_id, &first),
    ] {
        service
            .post_group_message(&ctx(A), group_id, post(None, sender, "hello", &[]))
            .await
            .unwrap();
    }
    // A group in another container, which no deletion here touches.
    let kept_agent = image(&service, A, "kept").await;
    let kept = service
        .create_group(
            &ctx(A),
            new_group("kept", "kept", vec![MemberRef::agent(&kept_agent.image_id)]),
        )
        .await
        .unwrap();

    // Deleting an image removes its memberships; the groups and what it said stay.
    service.delete_image(&ctx(A), &first.member_id).await.unwrap();
    let members: BTreeSet<MemberRef> = service
        .list_group_members(&ctx(A), &team.group_id)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.member)
        .collect();
    assert_eq!(members, BTreeSet::from([second.clone(), admin()]));
    assert!(
        service
            .list_group_members(&ctx(A), &solo.group_id)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        service
            .list_unread(&ctx(A), first.clone(), 10)
            .await
            .unwrap()
            .is_empty()
    );
    let history = service
        .list_group_messages(&ctx(A), &team.group_id, 0, 0)
        .await
        .unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[0].sender, first);
    // A deleted image cannot join again.
    assert_eq!(
        reason(service.add_group_member(&ctx(A), &team.group_id, first.clone()).await),
        "IMAGE_NOT_FOUND"
    );

    // Deleting a group takes its members and messages.
    service.delete_group(&ctx(A), &solo.group_id).await.unwrap();
    assert_eq!(
        reason(service.list_group_messages(&ctx(A), &solo.group_id, 0, 0).await),
        "GROUP_NOT_FOUND"
    );

    // Deleting the container takes its groups, their members and messages.
    service.delete_container(&ctx(A), "room").await.unwrap();
    for group_id in [&team.group_id, &solo.group_id] {
        assert_eq!(reason(service.get_group(&ctx(A), group_id).await), "GROUP_NOT_FOUND");
        assert_eq!(
            reason(service.list_group_members(&ctx(A), group_id).await),
            "GROUP_NOT_FOUND"
        );
        assert_eq!(
            reason(
                service
                    .post_group_message(&ctx(A), group_id, post(None, &admin(), "late", &[]))
                    .await
            ),
            "GROUP_NOT_FOUND"
        );
    }
    assert!(service.list_unread(&ctx(A), admin(), 10).await.unwrap().is_empty());
    assert!(
        service
            .list_unread(&ctx(A), second.clone(), 10)
            .await
            .unwrap()
            .is_empty()
    );
    // A container recreated under the same id starts without groups.
    assert!(service.create_container(&ctx(A), "room").await.unwrap().1);
    assert!(
        service
            .list_groups(&ctx(A), "room", 0, "")
            .await
            .unwrap()
            .groups
            .is_empty()
    );

    // The other container's group is untouched.
    assert_eq!(service.get_group(&ctx(A), &kept.group_id).await.unwrap(), kept);
    assert_eq!(
        service.list_group_members(&ctx(A), &kept.group_id).await.unwrap().len(),
        1
    );
}
