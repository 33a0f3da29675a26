//! Agent states and parent agents: every body runs against SQLite and
//! Postgres; the last test goes through the gRPC adapter.

use std::sync::Arc;

use avm_common::Code;
use avm_common::auth::{Role, Scopes};
use avm_common::testing::bearer;
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_session::{AgentState, ImageRecord, NewImage, SessionService, SessionStore, ShareRole};

use crate::support::{api_err, ctx, member, principal_ctx};

conformance_suite!(
    pause_and_resume_round_trip,
    an_error_is_kept_until_the_agent_is_made_active,
    terminating_cascades_to_every_descendant,
    terminated_agents_stay_terminated,
    children_sit_one_level_below_their_parent,
    a_parent_must_be_in_the_same_container,
    foreign_images_answer_like_missing_ones,
    deleting_a_parent_deletes_its_family,
    no_child_outlives_a_concurrent_termination,
);

const A: &str = "tenant-a";
const B: &str = "tenant-b";
const GHOST_IMAGE: &str = "img_00000000000000000000000000000000";

/// Creates an image in `container_id` (creating the container), under `parent` when set.
async fn image(service: &SessionService, tenant: &str, container_id: &str, parent: Option<&str>) -> ImageRecord {
    service.create_container(&ctx(tenant), container_id).await.unwrap();
    let new = NewImage {
        container_id: container_id.to_owned(),
        parent_image_id: parent.map(str::to_owned),
        ..NewImage::default()
    };
    service.create_image(&ctx(tenant), new).await.unwrap()
}

async fn state_of(service: &SessionService, image_id: &str) -> AgentState {
    service.get_image(&ctx(A), image_id).await.unwrap().agent_state
}

/// Returns the ids of `images`, sorted: images made in the same millisecond
/// have no order a test could know.
fn ids(images: &[ImageRecord]) -> Vec<&str> {
    let mut ids: Vec<&str> = images.iter().map(|image| image.image_id.as_str()).collect();
    ids.sort();
    ids
}

fn sorted(mut ids: Vec<&str>) -> Vec<&str> {
    ids.sort();
    ids
}

async fn pause_and_resume_round_trip(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let agent = image(&service, A, "default", None).await;
    assert_eq!(
        (agent.agent_state, agent.parent_image_id.as_deref(), agent.depth),
        (AgentState::Active, None, 0)
    );

    let paused = service
        .set_agent_state(&ctx(A), &agent.image_id, AgentState::Paused, None)
        .await
        .unwrap();
    assert_eq!(paused.image.agent_state, AgentState::Paused);
    assert!(paused.terminated_image_ids.is_empty());
    assert_eq!(service.get_image(&ctx(A), &agent.image_id).await.unwrap(), paused.image);

    // Setting the state an agent has changes nothing.
    let again = service
        .set_agent_state(&ctx(A), &agent.image_id, AgentState::Paused, None)
        .await
        .unwrap();
    assert_eq!(again.image, paused.image);

    let resumed = service
        .set_agent_state(&ctx(A), &agent.image_id, AgentState::Active, None)
        .await
        .unwrap();
    assert_eq!(resumed.image.agent_state, AgentState::Active);
    assert!(resumed.terminated_image_ids.is_empty());
    assert_eq!(state_of(&service, &agent.image_id).await, AgentState::Active);
    // Only the state changed.
    assert_eq!(
        ImageRecord {
            agent_state: AgentState::Active,
            updated_at_ms: agent.updated_at_ms,
            ..resumed.image
        },
        agent
    );

    // Writing needs the write scope, as every other change of an image.
    let reader = principal_ctx(A, "usr_admin", Role::Admin, Scopes::READ);
    let denied = api_err(
        service
            .set_agent_state(&reader, &agent.image_id, AgentState::Paused, None)
            .await,
    );
    assert_eq!(
        (denied.code, denied.reason.as_ref()),
        (Code::PermissionDenied, "MISSING_SCOPE")
    );
    assert_eq!(state_of(&service, &agent.image_id).await, AgentState::Active);
}

async fn an_error_is_kept_until_the_agent_is_made_active(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let agent = image(&service, A, "default", None).await;
    // Only the runtime puts an agent in the error state.
    let runtime = avm_common::testing::service_ctx(A);
    let forged = api_err(
        service
            .set_agent_state(&ctx(A), &agent.image_id, AgentState::Error, Some("forged"))
            .await,
    );
    assert_eq!(
        (forged.code, forged.reason.as_ref()),
        (Code::PermissionDenied, "RUNTIME_ONLY_STATE")
    );
    let missing = api_err(
        service
            .set_agent_state(&runtime, &agent.image_id, AgentState::Error, Some("  "))
            .await,
    );
    assert_eq!(missing.reason.as_ref(), "MISSING_AGENT_ERROR");

    let failed = service
        .set_agent_state(
            &runtime,
            &agent.image_id,
            AgentState::Error,
            Some("the key was refused"),
        )
        .await
        .unwrap();
    assert_eq!(failed.image.agent_state, AgentState::Error);
    assert_eq!(failed.image.agent_error.as_deref(), Some("the key was refused"));
    assert_eq!(service.get_image(&ctx(A), &agent.image_id).await.unwrap(), failed.image);
    // A later failure replaces it; a long one is cut.
    let long = "x".repeat(5000);
    let again = service
        .set_agent_state(&runtime, &agent.image_id, AgentState::Error, Some(&long))
        .await
        .unwrap();
    assert_eq!(again.image.agent_error.map(|error| error.len()), Some(2048));

    // Pausing and resuming clears it.
    let paused = service
        .set_agent_state(&ctx(A), &agent.image_id, AgentState::Paused, None)
        .await
        .unwrap();
    assert_eq!(
        (paused.image.agent_state, paused.image.agent_error),
        (AgentState::Paused, None)
    );
    // A paused agent's failure (a turn cut by the pause) leaves it paused.
    let still = service
        .set_agent_state(&runtime, &agent.image_id, AgentState::Error, Some("cut"))
        .await
        .unwrap();
    assert_eq!(still.image.agent_state, AgentState::Paused);
    service
        .set_agent_state(&runtime, &agent.image_id, AgentState::Error, Some("late"))
        .await
        .unwrap();
    let resumed = service
        .set_agent_state(&ctx(A), &agent.image_id, AgentState::Active, None)
        .await
        .unwrap();
    assert_eq!(
        (resumed.image.agent_state, resumed.image.agent_error),
        (AgentState::Active, None)
    );

    // An agent in error is terminated like any other, and stays so.
    service
        .set_agent_state(&runtime, &agent.image_id, AgentState::Error, Some("refused"))
        .await
        .unwrap();
    let terminated = service
        .set_agent_state(&ctx(A), &agent.image_id, AgentState::Terminated, None)
        .await
        .unwrap();
    assert_eq!(
        (terminated.image.agent_state, terminated.image.agent_error),
        (AgentState::Terminated, None)
    );
    let refused = api_err(
        service
            .set_agent_state(&runtime, &agent.image_id, AgentState::Error, Some("refused"))
            .await,
    );
    assert_eq!(refused.code, Code::FailedPrecondition);
}

async fn terminating_cascades_to_every_descendant(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let root = image(&service, A, "default", None).await;
    let child = image(&service, A, "default", Some(&root.image_id)).await;
    let grandchild = image(&service, A, "default", Some(&child.image_id)).await;
    let second_child = image(&service, A, "default", Some(&root.image_id)).await;
    let stranger = image(&service, A, "default", None).await;
    service
        .set_agent_state(&ctx(A), &grandchild.image_id, AgentState::Paused, None)
        .await
        .unwrap();

    let change = service
        .set_agent_state(&ctx(A), &root.image_id, AgentState::Terminated, None)
        .await
        .unwrap();
    assert_eq!(change.image.agent_state, AgentState::Terminated);
    // The image first, then its descendants by depth (ids break ties).
    let mut children = [child.image_id.clone(), second_child.image_id.clone()];
    children.sort();
    let expected = [
        vec![root.image_id.clone()],
        children.to_vec(),
        vec![grandchild.image_id.clone()],
    ]
    .concat();
    assert_eq!(change.terminated_image_ids, expected);
    for id in &expected {
        assert_eq!(state_of(&service, id).await, AgentState::Terminated, "{id}");
    }
    assert_eq!(state_of(&service, &stranger.image_id).await, AgentState::Active);

    // A family whose middle is already terminated: only the rest is listed.
    let top = image(&service, A, "default", None).await;
    let middle = image(&service, A, "default", Some(&top.image_id)).await;
    let bottom = image(&service, A, "default", Some(&middle.image_id)).await;
    let first = service
        .set_agent_state(&ctx(A), &middle.image_id, AgentState::Terminated, None)
        .await
        .unwrap();
    assert_eq!(
        first.terminated_image_ids,
        [middle.image_id.clone(), bottom.image_id.clone()]
    );
    assert_eq!(state_of(&service, &top.image_id).await, AgentState::Active);
    let second = service
        .set_agent_state(&ctx(A), &top.image_id, AgentState::Terminated, None)
        .await
        .unwrap();
    assert_eq!(second.terminated_image_ids, [top.image_id.as_str()]);
}

async fn terminated_agents_stay_terminated(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let parent = image(&service, A, "default", None).await;
    let child = image(&service, A, "default", Some(&parent.image_id)).await;
    let terminated = service
        .set_agent_state(&ctx(A), &parent.image_id, AgentState::Terminated, None)
        .await
        .unwrap();

    for state in [AgentState::Active, AgentState::Paused] {
        for id in [&parent.image_id, &child.image_id] {
            let err = api_err(service.set_agent_state(&ctx(A), id, state, None).await);
            assert_eq!(
                (err.code, err.reason.as_ref()),
                (Code::FailedPrecondition, "AGENT_TERMINATED"),
                "{id} to {state:?}"
            );
            assert_eq!(state_of(&service, id).await, AgentState::Terminated);
        }
    }

    // Terminating again succeeds and terminates nothing new.
    let again = service
        .set_agent_state(&ctx(A), &parent.image_id, AgentState::Terminated, None)
        .await
        .unwrap();
    assert_eq!(again.image, terminated.image);
    assert!(again.terminated_image_ids.is_empty());

    // A terminated agent has no new children.
    let orphan = NewImage {
        container_id: "default".into(),
        parent_image_id: Some(child.image_id.clone()),
        ..NewImage::default()
    };
    let err = api_err(service.create_image(&ctx(A), orphan).await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::FailedPrecondition, "AGENT_TERMINATED")
    );
    assert!(
        service
            .list_child_images(&ctx(A), &child.image_id)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn children_sit_one_level_below_their_parent(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let root = image(&service, A, "default", None).await;
    let first = image(&service, A, "default", Some(&root.image_id)).await;
    let second = image(&service, A, "default", Some(&root.image_id)).await;
    let grandchild = image(&service, A, "default", Some(&first.image_id)).await;
    assert_eq!(
        (first.parent_image_id.as_deref(), first.depth),
        (Some(root.image_id.as_str()), 1)
    );
    assert_eq!(
        (grandchild.parent_image_id.as_deref(), grandchild.depth),
        (Some(first.image_id.as_str()), 2)
    );
    assert_eq!(grandchild.agent_state, AgentState::Active);
    assert_eq!(
        service.get_image(&ctx(A), &grandchild.image_id).await.unwrap(),
        grandchild
    );

    // A paused parent may still have children.
    service
        .set_agent_state(&ctx(A), &second.image_id, AgentState::Paused, None)
        .await
        .unwrap();
    let under_paused = image(&service, A, "default", Some(&second.image_id)).await;
    assert_eq!(under_paused.depth, 2);

    // Direct children only; an empty parent means none.
    let children = service.list_child_images(&ctx(A), &root.image_id).await.unwrap();
    assert_eq!(ids(&children), sorted(vec![&second.image_id, &first.image_id]));
    let children = service.list_child_images(&ctx(A), &first.image_id).await.unwrap();
    assert_eq!(ids(&children), [grandchild.image_id.as_str()]);
    assert!(
        service
            .list_child_images(&ctx(A), &grandchild.image_id)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        service
            .list_child_images(&ctx(A), GHOST_IMAGE)
            .await
            .unwrap()
            .is_empty()
    );
    let unparented = NewImage {
        container_id: "default".into(),
        parent_image_id: Some(String::new()),
        ..NewImage::default()
    };
    let unparented = service.create_image(&ctx(A), unparented).await.unwrap();
    assert_eq!((unparented.parent_image_id, unparented.depth), (None, 0));

    // A parent that does not exist answers like any missing image.
    let ghost = NewImage {
        container_id: "default".into(),
        parent_image_id: Some(GHOST_IMAGE.into()),
        ..NewImage::default()
    };
    let err = api_err(service.create_image(&ctx(A), ghost).await);
    assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "IMAGE_NOT_FOUND"));
}

async fn a_parent_must_be_in_the_same_container(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let parent = image(&service, A, "here", None).await;
    service.create_container(&ctx(A), "there").await.unwrap();
    let elsewhere = NewImage {
        container_id: "there".into(),
        parent_image_id: Some(parent.image_id.clone()),
        ..NewImage::default()
    };
    let err = api_err(service.create_image(&ctx(A), elsewhere).await);
    assert_eq!(
        (err.code, err.reason.as_ref()),
        (Code::InvalidArgument, "PARENT_IN_OTHER_CONTAINER")
    );
    assert!(service.list_images(&ctx(A), Some("there")).await.unwrap().is_empty());
    assert!(
        service
            .list_child_images(&ctx(A), &parent.image_id)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn foreign_images_answer_like_missing_ones(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store);
    let theirs = image(&service, A, "default", None).await;
    let child = image(&service, A, "default", Some(&theirs.image_id)).await;

    // Another tenant: the same answer as for an image that does not exist.
    let missing = api_err(
        service
            .set_agent_state(&ctx(B), GHOST_IMAGE, AgentState::Paused, None)
            .await,
    );
    assert_eq!(
        (missing.code, missing.reason.as_ref()),
        (Code::NotFound, "IMAGE_NOT_FOUND")
    );
    for state in [AgentState::Paused, AgentState::Terminated] {
        let foreign = api_err(service.set_agent_state(&ctx(B), &theirs.image_id, state, None).await);
        assert_eq!(
            (foreign.code, foreign.reason.as_ref()),
            (missing.code, missing.reason.as_ref())
        );
    }
    service.create_container(&ctx(B), "default").await.unwrap();
    let adopted = NewImage {
        container_id: "default".into(),
        parent_image_id: Some(theirs.image_id.clone()),
        ..NewImage::default()
    };
    let foreign = api_err(service.create_image(&ctx(B), adopted).await);
    assert_eq!(
        (foreign.code, foreign.reason.as_ref()),
        (Code::NotFound, "IMAGE_NOT_FOUND")
    );
    assert!(
        service
            .list_child_images(&ctx(B), &theirs.image_id)
            .await
            .unwrap()
            .is_empty()
    );

    // A member of the same tenant who does not see the container: the same.
    let bob = member(A, "usr_bob");
    let hidden = api_err(
        service
            .set_agent_state(&bob, &child.image_id, AgentState::Terminated, None)
            .await,
    );
    assert_eq!(
        (hidden.code, hidden.reason.as_ref()),
        (Code::NotFound, "IMAGE_NOT_FOUND")
    );
    assert!(
        service
            .list_child_images(&bob, &theirs.image_id)
            .await
            .unwrap()
            .is_empty()
    );

    // Nothing changed.
    assert_eq!(state_of(&service, &theirs.image_id).await, AgentState::Active);
    assert_eq!(state_of(&service, &child.image_id).await, AgentState::Active);

    // Once shared, the member may.
    service
        .share_container(&ctx(A), "default", "usr_bob", ShareRole::Manage)
        .await
        .unwrap();
    let paused = service
        .set_agent_state(&bob, &child.image_id, AgentState::Paused, None)
        .await
        .unwrap();
    assert_eq!(paused.image.agent_state, AgentState::Paused);
}

async fn deleting_a_parent_deletes_its_family(store: Arc<dyn SessionStore>) {
    let service = SessionService::new(store.clone());
    let root = image(&service, A, "default", None).await;
    let child = image(&service, A, "default", Some(&root.image_id)).await;
    let grandchild = image(&service, A, "default", Some(&child.image_id)).await;
    let kept = image(&service, A, "default", None).await;

    let whole = avm_session::Scope {
        tenant_id: A,
        user_id: None,
    };
    let deleted = store.delete_image(&whole, &child.image_id).await.unwrap();
    assert_eq!(deleted, [child.image_id.clone(), grandchild.image_id.clone()]);
    for gone in [&child, &grandchild] {
        let err = api_err(service.get_image(&ctx(A), &gone.image_id).await);
        assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "IMAGE_NOT_FOUND"));
        let err = api_err(service.list_messages(&ctx(A), &gone.session_id).await);
        assert_eq!((err.code, err.reason.as_ref()), (Code::NotFound, "SESSION_NOT_FOUND"));
    }
    assert_eq!(
        service.get_image(&ctx(A), &kept.image_id).await.unwrap().image_id,
        kept.image_id
    );
    assert!(
        service
            .list_child_images(&ctx(A), &root.image_id)
            .await
            .unwrap()
            .is_empty()
    );

    // A container takes every generation with it, and names each.
    let child = image(&service, A, "default", Some(&root.image_id)).await;
    let grandchild = image(&service, A, "default", Some(&child.image_id)).await;
    let mut deleted = service.delete_container(&ctx(A), "default").await.unwrap();
    deleted.sort();
    let mut expected = vec![root.image_id, child.image_id, grandchild.image_id, kept.image_id];
    expected.sort();
    assert_eq!(deleted, expected);
}

async fn no_child_outlives_a_concurrent_termination(store: Arc<dyn SessionStore>) {
    const CHILDREN: usize = 20;
    let service = SessionService::new(store);
    let root = image(&service, A, "default", None).await;
    let child = image(&service, A, "default", Some(&root.image_id)).await;
    let mut tasks = tokio::task::JoinSet::new();
    // Children and grandchildren are created while the root is terminated:
    // each is either refused or terminated with the family.
    for n in 0..CHILDREN {
        let creator = service.clone();
        let parent = if n % 2 == 0 { &root } else { &child };
        let new = NewImage {
            container_id: "default".into(),
            parent_image_id: Some(parent.image_id.clone()),
            ..NewImage::default()
        };
        tasks.spawn(async move { creator.create_image(&ctx(A), new).await.map(|_| ()) });
        if n == CHILDREN / 2 {
            let terminator = service.clone();
            let root_id = root.image_id.clone();
            tasks.spawn(async move {
                terminator
                    .set_agent_state(&ctx(A), &root_id, AgentState::Terminated, None)
                    .await
                    .map(|_| ())
            });
        }
    }
    while let Some(outcome) = tasks.join_next().await {
        if let Err(err) = outcome.unwrap() {
            let err = avm_common::ApiError::from(err);
            assert_eq!(err.reason, "AGENT_TERMINATED", "{err:?}");
        }
    }
    for parent in [&root, &child] {
        for image in service.list_child_images(&ctx(A), &parent.image_id).await.unwrap() {
            assert_eq!(image.agent_state, AgentState::Terminated, "{}", image.image_id);
        }
    }
}

#[tokio::test]
async fn grpc_agent_state_and_children() {
    let (_db, keys, channel) = crate::grpc::serve().await;
    let ctx = ctx("tenant-grpc");
    let mut client = SessionServiceClient::with_interceptor(channel, bearer(&keys.token(&ctx)));
    client
        .create_container(pb::CreateContainerRequest {
            container_id: "default".into(),
        })
        .await
        .unwrap();
    let create = |parent_image_id: Option<String>| pb::CreateImageRequest {
        container_id: "default".into(),
        parent_image_id,
        ..pb::CreateImageRequest::default()
    };
    let parent = client
        .create_image(create(None))
        .await
        .unwrap()
        .into_inner()
        .image
        .unwrap();
    assert_eq!(
        (parent.agent_state(), parent.parent_image_id.as_deref(), parent.depth),
        (pb::AgentState::Active, None, 0)
    );
    let child = client
        .create_image(create(Some(parent.image_id.clone())))
        .await
        .unwrap()
        .into_inner()
        .image
        .unwrap();
    assert_eq!(
        (child.parent_image_id.as_deref(), child.depth),
        (Some(parent.image_id.as_str()), 1)
    );

    let list = |container_id: Option<&str>, parent_image_id: Option<&str>| pb::ListImagesRequest {
        container_id: container_id.map(str::to_owned),
        parent_image_id: parent_image_id.map(str::to_owned),
    };
    let listed = |images: Vec<pb::Image>| {
        let mut ids: Vec<String> = images.into_iter().map(|image| image.image_id).collect();
        ids.sort();
        ids
    };
    let children = client
        .list_images(list(None, Some(&parent.image_id)))
        .await
        .unwrap()
        .into_inner()
        .images;
    assert_eq!(listed(children), [child.image_id.as_str()]);
    let children = client
        .list_images(list(Some("default"), Some(&parent.image_id)))
        .await
        .unwrap()
        .into_inner()
        .images;
    assert_eq!(listed(children), [child.image_id.as_str()]);
    let elsewhere = client
        .list_images(list(Some("other"), Some(&parent.image_id)))
        .await
        .unwrap()
        .into_inner()
        .images;
    assert!(elsewhere.is_empty());
    let all = client.list_images(list(None, None)).await.unwrap().into_inner().images;
    let mut both = vec![child.image_id.clone(), parent.image_id.clone()];
    both.sort();
    assert_eq!(listed(all), both);

    let set = |image_id: &str, state: pb::AgentState| pb::SetAgentStateRequest {
        image_id: image_id.to_owned(),
        state: state.into(),
        error: String::new(),
    };
    let unspecified = client
        .set_agent_state(set(&parent.image_id, pb::AgentState::Unspecified))
        .await
        .unwrap_err();
    let unspecified = avm_common::ApiError::from_status(&unspecified);
    assert_eq!(
        (unspecified.code, unspecified.reason.as_ref()),
        (Code::InvalidArgument, "INVALID_AGENT_STATE")
    );
    let unknown = client
        .set_agent_state(pb::SetAgentStateRequest {
            image_id: parent.image_id.clone(),
            state: 42,
            error: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::InvalidArgument);

    let paused = client
        .set_agent_state(set(&child.image_id, pb::AgentState::Paused))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(paused.image.unwrap().agent_state(), pb::AgentState::Paused);
    assert!(paused.terminated_image_ids.is_empty());

    let terminated = client
        .set_agent_state(set(&parent.image_id, pb::AgentState::Terminated))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(terminated.image.unwrap().agent_state(), pb::AgentState::Terminated);
    assert_eq!(
        terminated.terminated_image_ids,
        [parent.image_id.clone(), child.image_id.clone()]
    );

    let resume = client
        .set_agent_state(set(&child.image_id, pb::AgentState::Active))
        .await
        .unwrap_err();
    let resume = avm_common::ApiError::from_status(&resume);
    assert_eq!(
        (resume.code, resume.reason.as_ref()),
        (Code::FailedPrecondition, "AGENT_TERMINATED")
    );
    let orphan = client
        .create_image(create(Some(child.image_id.clone())))
        .await
        .unwrap_err();
    assert_eq!(orphan.code(), tonic::Code::FailedPrecondition);
}
