//! The optional TCP ingest with TLS: a client that trusts the agent's CA
//! streams markers; a plaintext client is refused; with --grpc-tls-client-ca
//! a client without a certificate is refused too.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use stepwatch_client::{Client, ClientOptions};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made by
/// tests/make-test-certs.sh (shared with the Python TLS tests).
fn make_certs(dir: &Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/make-test-certs.sh");
    stdout_of(
        Command::new("bash").arg(script).arg(dir),
        "make-test-certs.sh (needs the openssl CLI)",
    );
}

fn one_step(client: &Client) {
    for kind in
        stepwatch_core::MarkerKind::STEP_ORDER.map(stepwatch_proto::convert::marker_kind_to_wire)
    {
        client.mark_now(kind, 1, 0);
    }
}

/// An agent with TCP ingest over TLS, and the certificates it was given.
struct TlsAgent {
    agent: Agent,
    certs: TempDir,
    port: u16,
}

impl TlsAgent {
    /// With `--grpc-tls-client-ca` when `mutual`.
    fn start(tag: &str, mutual: bool) -> Self {
        let certs = TempDir::new(tag);
        make_certs(&certs.0);
        let path = |name: &str| certs.0.join(name).to_str().unwrap().to_owned();
        let mut args = vec![
            "--grpc-listen".to_owned(),
            "127.0.0.1:0".to_owned(),
            "--grpc-tls-cert".to_owned(),
            path("server.pem"),
            "--grpc-tls-key".to_owned(),
            path("server.key"),
        ];
        if mutual {
            args.extend(["--grpc-tls-client-ca".to_owned(), path("ca.pem")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let agent = Agent::start_args(tag, &args);
        let grpc = agent.grpc.expect("the agent reports its gRPC address");
        TlsAgent {
            agent,
            certs,
            port: grpc.port(),
        }
    }

    fn cert(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.certs.0.join(name)).unwrap()
    }

    /// Client options for `job` at `scheme://` the agent's port, trusting its
    /// CA over https; reconnecting every 200 ms at most, so that refusals show soon.
    fn options(&self, scheme: &str, job: &str) -> ClientOptions {
        let mut options = ClientOptions::new(
            format!("{scheme}://127.0.0.1:{}", self.port),
            wire::solo_hello(job),
        );
        if scheme == "https" {
            options.tls_ca_pem = Some(self.cert("ca.pem"));
        }
        options.reconnect_max = Duration::from_millis(200);
        options
    }

    /// A client with `options` sends one step, and the agent counts it.
    fn admits(&self, options: ClientOptions, job: &str) {
        let client = Client::start(options);
        one_step(&client);
        self.agent
            .wait_metrics(&format!("{job}'s step"), Duration::from_secs(15), |m| {
                m.steps_completed(job) == Some(1.0)
            });
        client.close(Duration::from_secs(2));
    }

    /// A client with `options` tries, and tries again, and nothing of its
    /// step gets in: a refusal, not a client that never called.
    fn refuses(&self, options: ClientOptions, job: &str) {
        let client = Client::start(options);
        one_step(&client);
        wait_until(&format!("{job}'s retries"), Duration::from_secs(20), || {
            client.stats().reconnects >= 2
        });
        assert!(!client.connected());
        assert_eq!(client.stats().sent, 0);
        assert_eq!(Metrics(self.agent.metrics()).steps_completed(job), None);
    }
}

#[test]
fn tcp_ingest_with_tls_accepts_trusting_clients_only() {
    let tls = TlsAgent::start("tls", false);
    let log = tls.agent.log();
    assert!(log.contains("TCP ingest enabled with TLS"), "{log}");
    // Trusting the CA: markers arrive.
    tls.admits(tls.options("https", "tls-ok"), "tls-ok");
    // Plaintext to the TLS port: nothing gets in.
    tls.refuses(tls.options("http", "plain"), "plain");
}

#[test]
fn mutual_tls_admits_only_clients_with_a_signed_certificate() {
    let tls = TlsAgent::start("mtls", true);
    // Trusting the CA is not enough: the agent asks for a certificate.
    tls.refuses(tls.options("https", "anonymous"), "anonymous");
    // A client with a certificate the CA signed gets in.
    let mut options = tls.options("https", "signed");
    options.tls_identity_pem = Some((tls.cert("client.pem"), tls.cert("client.key")));
    tls.admits(options, "signed");
}

#[test]
fn a_tls_key_without_a_certificate_is_a_clear_error() {
    let err = stderr_of_failure(Command::new(BIN).args([
        "agent",
        "--grpc-tls-key",
        "/tmp/k.pem",
        "--socket",
        "/tmp/never.sock",
    ]));
    assert!(err.contains("--grpc-tls-cert"), "{err}");
}
