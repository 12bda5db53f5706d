//! Raw wire messages for tests that speak the protocol directly (no client).

use std::time::Duration;

use stepwatch_proto::v1::{
    client_message::Kind, ingest_client::IngestClient, AgentMessage, ClientMessage, Hello,
    Identity, Marker, MarkerBatch, MarkerKind,
};
use tokio::sync::mpsc::Sender;
use tonic::{Code, Status, Streaming};

use super::Agent;

fn identity(job: &str, rank: u32, world: u32) -> Option<Identity> {
    Some(Identity {
        job_id: job.into(),
        rank,
        world_size: world,
        ..Default::default()
    })
}

pub fn hello(job: &str, rank: u32, world: u32) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::Hello(Hello {
            identity: identity(job, rank, world),
            gpu_uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            pid: 1,
            ..Default::default()
        })),
    }
}

/// [`hello`] for rank 0 of a one-rank `job`, naming the process's run (a
/// new `fit()` in the same process is a new run).
pub fn hello_of_run(job: &str, run_id: &str) -> ClientMessage {
    let mut message = hello(job, 0, 1);
    if let Some(Kind::Hello(h)) = message.kind.as_mut() {
        h.run_id = run_id.into();
    }
    message
}

/// A client's hello for the one rank of `job`, from this process.
pub fn solo_hello(job: &str) -> Hello {
    Hello {
        identity: identity(job, 0, 1),
        pid: std::process::id(),
        ..Default::default()
    }
}

pub fn marker(kind: MarkerKind, step: u64, t: u64) -> Marker {
    Marker {
        kind: kind as i32,
        step,
        monotonic_ns: t,
        wall_ns: t,
        ..Default::default()
    }
}

pub fn batch(markers: Vec<Marker>) -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::Markers(MarkerBatch { markers })),
    }
}

pub fn step(n: u64, t0: u64) -> Vec<Marker> {
    stepwatch_core::MarkerKind::STEP_ORDER
        .map(stepwatch_proto::convert::marker_kind_to_wire)
        .iter()
        .enumerate()
        .map(|(i, k)| marker(*k, n, t0 + i as u64 * 1000))
        .collect()
}

/// A connection to the agent's ingest endpoint, for one or more streams.
pub async fn connect(endpoint: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .unwrap()
        .connect()
        .await
        .expect("connect to the agent")
}

/// A stream held open: what is sent on the sender goes out as it is sent,
/// and the agent's answers come in on the receiver.
pub async fn open_stream(endpoint: &str) -> (Sender<ClientMessage>, Streaming<AgentMessage>) {
    let (sender, rx) = tokio::sync::mpsc::channel::<ClientMessage>(4);
    let inbound = IngestClient::new(connect(endpoint).await)
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the stream opens")
        .into_inner();
    (sender, inbound)
}

/// The status that ends `inbound`, past the messages before it; fails the
/// test if the stream ends cleanly or nothing ends it within 30 s.
pub async fn refusal(inbound: &mut Streaming<AgentMessage>, what: &str) -> tonic::Status {
    let ended = async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("{what}: the stream ended without a refusal"),
                Err(status) => break status,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), ended)
        .await
        .unwrap_or_else(|_| panic!("{what}: no refusal within 30 s"))
}

/// The value of `key` in a status's metadata (the agent's
/// `stepwatch-refusal` and `stepwatch-retry`), when it is there.
pub fn metadata(status: &tonic::Status, key: &str) -> Option<String> {
    status
        .metadata()
        .get(key)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Asserts what a refusal tells the client in its metadata: the reason
/// (`stepwatch-refusal`) and whether to retry (`stepwatch-retry`: None
/// when the client may, `never` when no retry can pass); `what` names the
/// case.
#[track_caller]
pub fn assert_refusal(status: &tonic::Status, reason: &str, retry: Option<&str>, what: &str) {
    let told = (
        metadata(status, "stepwatch-refusal"),
        metadata(status, "stepwatch-retry"),
    );
    let expected = (Some(reason.to_owned()), retry.map(str::to_owned));
    assert_eq!(told, expected, "{what}: (refusal, retry) of {status:?}");
}

/// Sends `messages` on one stream, then half-closes; returns how it ended.
pub async fn exchange(endpoint: &str, messages: Vec<ClientMessage>) -> Result<(), tonic::Status> {
    exchange_collect(endpoint, messages).await.map(drop)
}

/// [`exchange`], returning what the agent sent back on the stream.
pub async fn exchange_collect(
    endpoint: &str,
    messages: Vec<ClientMessage>,
) -> Result<Vec<stepwatch_proto::v1::AgentMessage>, tonic::Status> {
    let mut client = IngestClient::new(connect(endpoint).await);
    let mut inbound = client
        .stream(tokio_stream::iter(messages))
        .await?
        .into_inner();
    let mut received = Vec::new();
    while let Some(m) = inbound.message().await? {
        received.push(m);
    }
    Ok(received)
}

/// The advisories about memory among what the agent sent on a stream, in
/// order. Streams whose markers carry made-up times (long before the agent
/// started, so that no GPU sample falls in them) are also told their clock
/// is far from the agent's; those advisories are left out here.
pub fn advisories(
    got: Vec<stepwatch_proto::v1::AgentMessage>,
) -> Vec<stepwatch_proto::v1::Advisory> {
    all_advisories(got)
        .filter(|a| a.kind != stepwatch_proto::v1::AdvisoryKind::ClientClock as i32)
        .collect()
}

/// The client-clock advisories among what the agent sent on a stream.
pub fn clock_advisories(
    got: Vec<stepwatch_proto::v1::AgentMessage>,
) -> Vec<stepwatch_proto::v1::Advisory> {
    all_advisories(got)
        .filter(|a| a.kind == stepwatch_proto::v1::AdvisoryKind::ClientClock as i32)
        .collect()
}

fn all_advisories(
    got: Vec<stepwatch_proto::v1::AgentMessage>,
) -> impl Iterator<Item = stepwatch_proto::v1::Advisory> {
    got.into_iter().filter_map(|m| match m.kind {
        Some(stepwatch_proto::v1::agent_message::Kind::Advisory(a)) => Some(a),
        _ => None,
    })
}
/// The advisories that warn or tell something about the rank, in order:
/// all but PREDICTION_FINAL, which every rank whose step 1 ends gets.
pub fn warnings(got: Vec<stepwatch_proto::v1::AgentMessage>) -> Vec<stepwatch_proto::v1::Advisory> {
    advisories(got)
        .into_iter()
        .filter(|a| a.kind != stepwatch_proto::v1::AdvisoryKind::PredictionFinal as i32)
        .collect()
}

/// The runtime the blocking calls below run their streams on, one per test
/// binary.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| tokio::runtime::Runtime::new().expect("a tokio runtime"))
}

/// Whole streams to the agent's ingest endpoint, for a test that is not
/// async itself.
impl Agent {
    /// Sends `messages` on one stream, then half-closes, and returns what
    /// the agent sent back; fails the test, naming `what`, if the agent
    /// ended the stream with a status.
    pub fn accepts(&self, what: &str, messages: Vec<ClientMessage>) -> Vec<AgentMessage> {
        runtime()
            .block_on(exchange_collect(&self.endpoint(), messages))
            .unwrap_or_else(|status| panic!("{what}: the agent refused it: {status:?}"))
    }

    /// Sends `messages` on one stream and checks that the agent refused it
    /// with `code` and a message that says `says`; returns the status.
    pub fn refuses(&self, messages: Vec<ClientMessage>, code: Code, says: &str) -> Status {
        let status = runtime()
            .block_on(exchange(&self.endpoint(), messages))
            .expect_err("the agent should refuse this");
        assert_eq!(status.code(), code, "{status:?}");
        assert!(
            status.message().contains(says),
            "status {:?} should mention {says:?}",
            status.message()
        );
        status
    }
}
