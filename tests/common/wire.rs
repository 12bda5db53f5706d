//! Raw wire messages for tests that speak the protocol directly (no client).

use stepwatch_proto::v1::{
    client_message::Kind, ingest_client::IngestClient, ClientMessage, Hello, Identity, Marker,
    MarkerBatch, MarkerKind,
};

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

/// Sends `messages` on one stream, then half-closes; returns how it ended.
pub async fn exchange(endpoint: &str, messages: Vec<ClientMessage>) -> Result<(), tonic::Status> {
    let mut client = IngestClient::new(connect(endpoint).await);
    let mut inbound = client
        .stream(tokio_stream::iter(messages))
        .await?
        .into_inner();
    while inbound.message().await?.is_some() {}
    Ok(())
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
