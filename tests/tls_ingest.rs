//! The optional TCP ingest with TLS: a client that trusts the agent's CA
//! streams markers; a plaintext client is refused; with --grpc-tls-client-ca
//! a client without a certificate is refused too.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use stepwatch_client::{Client, ClientOptions};
use stepwatch_proto::v1::{Hello, Identity};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made by
/// tests/make-test-certs.sh (shared with the Python TLS tests).
fn make_certs(dir: &Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/make-test-certs.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(dir)
        .output()
        .expect("run make-test-certs.sh");
    assert!(
        out.status.success(),
        "make-test-certs.sh (needs the openssl CLI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn hello(job: &str) -> Hello {
    Hello {
        identity: Some(Identity {
            job_id: job.into(),
            rank: 0,
            world_size: 1,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn one_step(client: &Client) {
    for kind in
        stepwatch_core::MarkerKind::STEP_ORDER.map(stepwatch_proto::convert::marker_kind_to_wire)
    {
        client.mark_now(kind, 1, 0);
    }
}

#[test]
fn tcp_ingest_with_tls_accepts_trusting_clients_only() {
    let certs = TempDir::new("tls");
    make_certs(&certs.0);
    let cert = certs.0.join("server.pem");
    let key = certs.0.join("server.key");
    let agent = Agent::start_with(
        "tls",
        1,
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--grpc-tls-cert",
            cert.to_str().unwrap(),
            "--grpc-tls-key",
            key.to_str().unwrap(),
        ],
        |_| {},
    );
    let grpc = agent.grpc.expect("the agent reports its gRPC address");
    assert!(
        agent.log().contains("TCP ingest enabled with TLS"),
        "{}",
        agent.log()
    );

    // Trusting the CA: markers arrive.
    let mut options = ClientOptions::new(
        format!("https://127.0.0.1:{}", grpc.port()),
        hello("tls-ok"),
    );
    options.tls_ca_pem = Some(std::fs::read(certs.0.join("ca.pem")).unwrap());
    let client = Client::start(options);
    one_step(&client);
    agent.wait_metrics("the TLS client's step", Duration::from_secs(15), |m| {
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "tls-ok")],
        ) == Some(1.0)
    });
    client.close(Duration::from_secs(2));

    // Plaintext to the TLS port: nothing gets in.
    let mut options =
        ClientOptions::new(format!("http://127.0.0.1:{}", grpc.port()), hello("plain"));
    options.reconnect_max = Duration::from_millis(200);
    let plain = Client::start(options);
    one_step(&plain);
    // It tried, and tried again: a refusal, not a client that never called.
    wait_until(
        "the plaintext client's retries",
        Duration::from_secs(20),
        || plain.stats().reconnects >= 2,
    );
    assert!(!plain.connected());
    assert_eq!(plain.stats().sent, 0);
    let m = Metrics(agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "plain")]
        ),
        None
    );
}

#[test]
fn mutual_tls_admits_only_clients_with_a_signed_certificate() {
    let certs = TempDir::new("mtls");
    make_certs(&certs.0);
    let (cert, key, ca) = (
        certs.0.join("server.pem"),
        certs.0.join("server.key"),
        certs.0.join("ca.pem"),
    );
    let agent = Agent::start_with(
        "mtls",
        1,
        &[
            "--grpc-listen",
            "127.0.0.1:0",
            "--grpc-tls-cert",
            cert.to_str().unwrap(),
            "--grpc-tls-key",
            key.to_str().unwrap(),
            "--grpc-tls-client-ca",
            ca.to_str().unwrap(),
        ],
        |_| {},
    );
    let grpc = agent.grpc.expect("the agent reports its gRPC address");
    let mut options = ClientOptions::new(
        format!("https://127.0.0.1:{}", grpc.port()),
        hello("anonymous"),
    );
    options.tls_ca_pem = Some(std::fs::read(&ca).unwrap());
    options.reconnect_max = Duration::from_millis(200);
    let client = Client::start(options);
    one_step(&client);
    wait_until(
        "the anonymous client's retries",
        Duration::from_secs(20),
        || client.stats().reconnects >= 2,
    );
    assert_eq!(client.stats().sent, 0);
    let m = Metrics(agent.metrics());
    assert_eq!(
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "anonymous")]
        ),
        None
    );
    assert!(!client.connected());

    // A client with a certificate the CA signed gets in.
    let mut options = ClientOptions::new(
        format!("https://127.0.0.1:{}", grpc.port()),
        hello("signed"),
    );
    options.tls_ca_pem = Some(std::fs::read(&ca).unwrap());
    options.tls_identity_pem = Some((
        std::fs::read(certs.0.join("client.pem")).unwrap(),
        std::fs::read(certs.0.join("client.key")).unwrap(),
    ));
    let signed = Client::start(options);
    one_step(&signed);
    agent.wait_metrics("the signed client's step", Duration::from_secs(15), |m| {
        m.get(
            "stepwatch_rank_steps_completed_total",
            &[("training_job", "signed")],
        ) == Some(1.0)
    });
}

#[test]
fn a_tls_key_without_a_certificate_is_a_clear_error() {
    let out = Command::new(BIN)
        .args([
            "agent",
            "--grpc-tls-key",
            "/tmp/k.pem",
            "--socket",
            "/tmp/never.sock",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--grpc-tls-cert"), "{err}");
}
