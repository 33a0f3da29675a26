//! The SQLite file keeps everything across a close and reopen.

use avm_session::{ImageUpdate, NewImage, SessionService, SqliteSessionStore, open_store};

use crate::support::{ctx, user};

#[tokio::test]
async fn sqlite_data_survives_reopen() {
    let db = avm_store::testing::TestDatabase::sqlite("session.db");
    let url = db.url.clone();

    let pool = avm_store::db::open_sqlite(&url, None).await.unwrap();
    let service = SessionService::new(std::sync::Arc::new(
        SqliteSessionStore::new(pool.clone()).await.unwrap(),
    ));
    service.create_container(&ctx("t"), "default").await.unwrap();
    let image = NewImage {
        container_id: "default".into(),
        name: Some("kept".into()),
        ..NewImage::default()
    };
    let image = service.create_image(&ctx("t"), image).await.unwrap();
    let update = ImageUpdate {
        name: None,
        description: Some("still here".into()),
        tools: None,
        metadata_json: None,
    };
    let image = service.update_image(&ctx("t"), &image.image_id, update).await.unwrap();
    let mut appended = Vec::new();
    for n in 0..5 {
        appended.push(
            service
                .append_message(&ctx("t"), &image.session_id, user(&format!("msg_{n}"), "hi"))
                .await
                .unwrap(),
        );
    }
    drop(service);
    pool.close().await;

    // Reopening runs the migrations again, which must be a no-op.
    let service = SessionService::new(open_store(&url, None).await.unwrap());
    let (container, created) = service.create_container(&ctx("t"), "default").await.unwrap();
    assert!(!created);
    assert_eq!(container.container_id, "default");
    assert_eq!(service.get_image(&ctx("t"), &image.image_id).await.unwrap(), image);
    assert_eq!(
        service.list_messages(&ctx("t"), &image.session_id).await.unwrap(),
        appended
    );
    let next = service
        .append_message(&ctx("t"), &image.session_id, user("msg_5", "hi"))
        .await
        .unwrap();
    assert_eq!(next.seq, 6);
}

#[tokio::test]
async fn unknown_database_urls_are_refused() {
    let err = open_store("mysql://localhost/x", None)
        .await
        .err()
        .expect("mysql is not supported");
    assert_eq!(err.reason, "UNSUPPORTED_DATABASE_URL");
}
