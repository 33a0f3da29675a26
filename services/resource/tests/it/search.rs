//! Listing: filters by kind, name, tag and text; keyset pages.

use std::collections::BTreeSet;
use std::sync::Arc;

use avm_common::Code;
use avm_common::testing::{admin_ctx, operator_ctx};
use avm_resource::{Kind, ListQuery, NewResource, ResourceRecord, ResourceService, ResourceStore};

use crate::support::{assert_err, conformance_suite, content, new_resource, register};

conformance_suite!(
    search_filters_by_kind_name_tag_and_text,
    pages_return_every_resource_once_in_order,
    bad_filters_and_tokens_are_refused,
);

const A: &str = "tenant-a";

fn names(resources: &[ResourceRecord]) -> Vec<String> {
    resources.iter().map(|r| format!("{}/{}", r.kind, r.name)).collect()
}

async fn described(
    service: &ResourceService,
    tenant: &str,
    kind: Kind,
    name: &str,
    description: &str,
    tags: &[&str],
) -> ResourceRecord {
    service
        .register(
            &admin_ctx(tenant),
            NewResource {
                description: description.to_owned(),
                tags: tags.iter().map(|t| (*t).to_owned()).collect(),
                ..new_resource(kind, name, "1.0.0", content(kind))
            },
        )
        .await
        .unwrap()
        .resource
}

async fn search_filters_by_kind_name_tag_and_text(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    described(
        &service,
        A,
        Kind::Prompt,
        "sales-assistant",
        "Helps SELL things",
        &["sales", "en"],
    )
    .await;
    described(
        &service,
        A,
        Kind::Prompt,
        "support",
        "Answers tickets",
        &["support_desk"],
    )
    .await;
    described(&service, A, Kind::Tool, "crm-lookup", "Finds customers", &["sales"]).await;
    described(
        &service,
        A,
        Kind::Knowledge,
        "pricing",
        "100% accurate prices",
        &["sales-v2"],
    )
    .await;
    described(&service, "tenant-b", Kind::Prompt, "b-sales", "B's sales", &["sales"]).await;
    service
        .register(
            &operator_ctx("tenant-ops"),
            NewResource {
                public: true,
                description: "Shared greeting".into(),
                tags: vec!["official".into()],
                ..new_resource(Kind::Prompt, "greeting", "1.0.0", content(Kind::Prompt))
            },
        )
        .await
        .unwrap();
    let ctx = admin_ctx(A);
    let list = |query: ListQuery| {
        let (service, ctx) = (service.clone(), ctx.clone());
        async move { names(&service.list(&ctx, query).await.unwrap().resources) }
    };

    assert_eq!(
        list(ListQuery::default()).await,
        [
            "knowledge/pricing",
            "prompt/greeting",
            "prompt/sales-assistant",
            "prompt/support",
            "tool/crm-lookup"
        ],
        "own and public, ordered by kind then name"
    );
    assert_eq!(
        list(ListQuery {
            kind: Some(Kind::Prompt),
            ..ListQuery::default()
        })
        .await,
        ["prompt/greeting", "prompt/sales-assistant", "prompt/support"]
    );
    assert_eq!(
        list(ListQuery {
            name: Some("support".into()),
            ..ListQuery::default()
        })
        .await,
        ["prompt/support"]
    );
    assert_eq!(
        list(ListQuery {
            name: Some("sales".into()),
            ..ListQuery::default()
        })
        .await,
        Vec::<String>::new(),
        "the name filter is exact"
    );
    assert_eq!(
        list(ListQuery {
            tag: Some("sales".into()),
            ..ListQuery::default()
        })
        .await,
        ["prompt/sales-assistant", "tool/crm-lookup"],
        "a whole tag: sales-v2 is not sales"
    );
    assert_eq!(
        list(ListQuery {
            tag: Some("support_desk".into()),
            ..ListQuery::default()
        })
        .await,
        ["prompt/support"]
    );
    assert_eq!(
        list(ListQuery {
            tag: Some("support.desk".into()),
            ..ListQuery::default()
        })
        .await,
        Vec::<String>::new(),
        "tag characters are literal, not patterns"
    );
    for (text, expected) in [
        // Name, description or tag; any case.
        (
            "SALES",
            vec!["knowledge/pricing", "prompt/sales-assistant", "tool/crm-lookup"],
        ),
        ("sell", vec!["prompt/sales-assistant"]),
        ("ticket", vec!["prompt/support"]),
        ("desk", vec!["prompt/support"]),
        ("official", vec!["prompt/greeting"]),
        ("100%", vec!["knowledge/pricing"]),
        ("%", vec!["knowledge/pricing"]),
        ("_", vec!["prompt/support"]),
        ("\",\"", vec![]),
        ("nothing like it", vec![]),
    ] {
        assert_eq!(
            list(ListQuery {
                query: Some(text.into()),
                ..ListQuery::default()
            })
            .await,
            expected,
            "query {text:?}"
        );
    }
    assert_eq!(
        list(ListQuery {
            kind: Some(Kind::Prompt),
            tag: Some("sales".into()),
            query: Some("assist".into()),
            ..ListQuery::default()
        })
        .await,
        ["prompt/sales-assistant"],
        "every filter must hold"
    );
    // Listings leave versions to GetResource, but name the latest.
    let page = service.list(&ctx, ListQuery::default()).await.unwrap();
    assert!(page.resources.iter().all(|r| r.latest_version == "1.0.0"));
    assert_eq!(page.next_page_token, None);
}

async fn pages_return_every_resource_once_in_order(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    // Names whose byte order differs from a locale's: digits, dots, dashes, underscores.
    let mut expected = Vec::new();
    for (i, kind) in [Kind::Tool, Kind::Prompt, Kind::Knowledge].into_iter().enumerate() {
        for name in ["a", "a-b", "a.b", "a_b", "ab", "b0", "b10", "b9", "z"] {
            let name = format!("{name}{i}");
            register(&service, &ctx, kind, &name, "1.0.0", &[]).await;
            expected.push(format!("{kind}/{name}"));
        }
    }
    expected.sort();
    let everything = service
        .list(
            &ctx,
            ListQuery {
                page_size: 200,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(names(&everything.resources), expected, "kind, then name, bytewise");
    assert_eq!(everything.next_page_token, None);

    for page_size in [1, 4, 5, 26, 27] {
        let mut seen = Vec::new();
        let mut token = None;
        let mut pages = 0;
        loop {
            let page = service
                .list(
                    &ctx,
                    ListQuery {
                        page_size,
                        page_token: token.clone(),
                        ..ListQuery::default()
                    },
                )
                .await
                .unwrap();
            assert!(page.resources.len() <= page_size as usize);
            seen.extend(page.resources);
            pages += 1;
            match page.next_page_token {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        assert_eq!(names(&seen), expected, "page size {page_size}");
        let unique: BTreeSet<&str> = seen.iter().map(|r| r.resource_id.as_str()).collect();
        assert_eq!(unique.len(), expected.len());
        assert_eq!(
            pages,
            expected.len().div_ceil(page_size as usize).max(1),
            "page size {page_size}"
        );
    }

    // Pages keep their filters; a resource created behind the cursor is not repeated.
    let first = service
        .list(
            &ctx,
            ListQuery {
                kind: Some(Kind::Prompt),
                page_size: 3,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(names(&first.resources), ["prompt/a-b1", "prompt/a.b1", "prompt/a1"]);
    register(&service, &ctx, Kind::Prompt, "0-early", "1.0.0", &[]).await;
    let second = service
        .list(
            &ctx,
            ListQuery {
                kind: Some(Kind::Prompt),
                page_size: 3,
                page_token: first.next_page_token,
                ..ListQuery::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(names(&second.resources), ["prompt/a_b1", "prompt/ab1", "prompt/b01"]);

    // 0 means the default of 50.
    for i in 0..30 {
        register(&service, &ctx, Kind::Sandbox, &format!("s{i:02}"), "1.0.0", &[]).await;
    }
    let default = service.list(&ctx, ListQuery::default()).await.unwrap();
    assert_eq!(default.resources.len(), 50);
    assert!(default.next_page_token.is_some());
}

async fn bad_filters_and_tokens_are_refused(store: Arc<dyn ResourceStore>) {
    let service = ResourceService::new(store);
    let ctx = admin_ctx(A);
    for token in ["not base64!", "bm90IGEga2V5", "cHJvbXB0L0JBRC9yZXNfMQ"] {
        assert_err(
            service
                .list(
                    &ctx,
                    ListQuery {
                        page_token: Some(token.into()),
                        ..ListQuery::default()
                    },
                )
                .await,
            Code::InvalidArgument,
            "INVALID_PAGE_TOKEN",
            "",
        );
    }
    assert_err(
        service
            .list(
                &ctx,
                ListQuery {
                    tag: Some("Not A Tag".into()),
                    ..ListQuery::default()
                },
            )
            .await,
        Code::InvalidArgument,
        "INVALID_TAG",
        "",
    );
    assert_err(
        service
            .list(
                &ctx,
                ListQuery {
                    name: Some("Bad Name".into()),
                    ..ListQuery::default()
                },
            )
            .await,
        Code::InvalidArgument,
        "INVALID_NAME",
        "",
    );
    assert_err(
        service
            .list(
                &ctx,
                ListQuery {
                    query: Some("q".repeat(257)),
                    ..ListQuery::default()
                },
            )
            .await,
        Code::InvalidArgument,
        "INVALID_QUERY",
        "",
    );
}
