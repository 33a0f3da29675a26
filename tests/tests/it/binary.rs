//! The `avm` binary as a user runs it: configuration layers, refusals, gRPC extras.

use avm_tests::cluster::{Cluster, Mode, Options, avm_command};

fn avm() -> anyhow::Result<tokio::process::Command> {
    avm_command()
}

#[tokio::test]
async fn print_config_layers_sources_and_redacts_secrets() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("avm.toml");
    std::fs::write(
        &file,
        "[server]\nport = 1111\ngrpc_port = 2222\n\n[llm]\nmodel = \"from-file\"\n",
    )?;
    let output = avm()?
        .args(["serve", "--port", "3333", "--print-config", "--config"])
        .arg(&file)
        .env("AVM_SERVER_PORT", "4444")
        .env("AVM_SERVER_GRPC_PORT", "5555")
        .env("LLM_API_KEY", "sk-canary-never-print")
        .env("AVM_TEST_SOMETHING", "ignored")
        .output()
        .await?;
    let stdout = String::from_utf8(output.stdout)?;
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let config: toml::Value = toml::from_str(&stdout)?;
    assert_eq!(
        config["server"]["port"].as_integer(),
        Some(3333),
        "flags beat the environment"
    );
    assert_eq!(
        config["server"]["grpc_port"].as_integer(),
        Some(5555),
        "the environment beats the file"
    );
    assert_eq!(
        config["llm"]["model"].as_str(),
        Some("from-file"),
        "the file beats the defaults"
    );
    assert_eq!(config["llm"]["api_key"].as_str(), Some("<redacted>"));
    assert!(!stdout.contains("sk-canary-never-print"));
    Ok(())
}

#[tokio::test]
async fn unknown_settings_and_public_binds_are_refused() -> anyhow::Result<()> {
    let output = avm()?
        .args(["serve", "--print-config"])
        .env("AVM_SERVER_PROT", "1")
        .output()
        .await?;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("prot"));

    // Anonymous access (--dev) never leaves this machine.
    let output = avm()?
        .args(["serve", "--dev", "--host", "0.0.0.0", "--port", "0", "--grpc-port", "0"])
        .output()
        .await?;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("refusing to listen on 0.0.0.0 with --dev"));

    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = taken.local_addr()?.port().to_string();
    let dir = tempfile::tempdir()?;
    let output = avm()?
        .args(["serve", "--port", &port, "--grpc-port", "0", "--data-dir"])
        .arg(dir.path())
        .output()
        .await?;
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains(&format!("cannot listen on 127.0.0.1:{port}")));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_ports_serve_health_and_reflection() -> anyhow::Result<()> {
    let cluster = Cluster::start(Mode::PerComponent, Options::default()).await?;
    for (addr, service) in [
        (&cluster.auth_grpc, "avm.auth.v1.AuthService"),
        (&cluster.session_grpc, "avm.session.v1.SessionService"),
        (&cluster.runtime_grpc, "avm.runtime.v1.RuntimeService"),
    ] {
        let channel = tonic::transport::Endpoint::from_shared(addr.clone())?.connect().await?;
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await?
            .into_inner();
        assert_eq!(
            status.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }
    // Internal callers use the same capabilities over gRPC directly, with an
    // access token their API key exchanges for.
    let channel = tonic::transport::Endpoint::from_shared(cluster.session_grpc.clone())?
        .connect()
        .await?;
    let anonymous = avm_proto::session::v1::session_service_client::SessionServiceClient::new(channel.clone())
        .list_containers(avm_proto::session::v1::ListContainersRequest {})
        .await
        .expect_err("no token, no answer");
    assert_eq!(anonymous.code(), tonic::Code::Unauthenticated);
    let token = cluster.access_token(&cluster.admin_key).await?;
    let mut sessions = avm_proto::session::v1::session_service_client::SessionServiceClient::with_interceptor(
        channel,
        avm_tests::cluster::bearer(&token)?,
    );
    let created = sessions
        .create_container(avm_proto::session::v1::CreateContainerRequest {
            container_id: "grpc".into(),
        })
        .await?
        .into_inner();
    assert!(created.created);
    let missing = sessions
        .get_image(avm_proto::session::v1::GetImageRequest {
            image_id: "img_nope".into(),
        })
        .await
        .expect_err("missing image");
    assert_eq!(missing.code(), tonic::Code::NotFound);
    assert_eq!(avm_common::ApiError::from_status(&missing).reason, "IMAGE_NOT_FOUND");
    Ok(())
}
