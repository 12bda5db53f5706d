//! How ingest says no: the gRPC status, the `stepwatch_markers_rejected_total`
//! reason it is counted under, and whether a retry can help.

use super::*;

/// The `stepwatch_markers_rejected_total` reason of a status tonic raised
/// while reading a message; None for the client going away.
pub(super) fn wire_refusal(status: &Status) -> Option<&'static str> {
    match status.code() {
        tonic::Code::OutOfRange if status.message().contains("message length too large") => {
            Some("message_too_large")
        }
        tonic::Code::Internal
            if status
                .message()
                .starts_with("failed to decode Protobuf message") =>
        {
            Some("decode_error")
        }
        _ => None,
    }
}

/// Counts and logs `n` markers (or a facts update or trace) refused on a
/// stream of a run its process has left for a newer one
/// ([`MarkerError::RunEnded`]), and the status that ends the stream: logged
/// once per stream, since the stream ends. FAILED_PRECONDITION, not
/// INVALID_ARGUMENT: nothing in the message is wrong, its run is over.
pub(super) fn run_ended(state: &AgentState, key: &RankKey, e: &MarkerError, n: u64) -> Status {
    state.ingest.reject(e.reason(), n);
    if let MarkerError::RunEnded {
        stream_run,
        rank_run,
    } = e
    {
        tracing::warn!(namespace = %key.namespace, job = %key.job, rank = key.rank, stream_run = %stream_run, rank_run = %rank_run, refused = n, "refused a stream's input for a run the process has left for a newer one; the stream is ended");
    }
    let status = Status::failed_precondition(format!(
        "refused for job {} rank {}: {e}",
        key.job, key.rank
    ));
    let retry = if e.refuses_the_run() {
        Retry::Never
    } else {
        Retry::Later
    };
    named(status, e.reason(), retry)
}

/// Trailing metadata of a stream the agent ended with a refusal: its
/// `stepwatch_markers_rejected_total` reason, so that a client can act on
/// the refusal without parsing the message (see ingest.proto).
pub const REFUSAL_METADATA: &str = "stepwatch-refusal";

/// Trailing metadata set to `never` on a refusal no reconnect of the same
/// process can pass ([`Retry::Never`]), so that its client stops instead of
/// being refused at every try for the rest of training.
pub const RETRY_METADATA: &str = "stepwatch-retry";

/// Whether a reconnect of the same process could pass where a refusal did
/// not (the classification ingest.proto documents).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// It may: the refusal is of one message after the hello (a new stream
    /// does not resend it), or of something that changes without the
    /// process: a limit (streams, ranks, rate), a rank another process
    /// holds, the kubelet's answer, a slow hello, the agent's own failure.
    Later,
    /// It cannot: the stream's opening breaks the contract (an invalid,
    /// oversized or undecodable hello, or none), which the process sends
    /// the same way on every stream, or the hello's run is over on the rank.
    Never,
}

/// Counts a refusal of `n` markers (at least one input) under `reason` and
/// names it in the status that ends the stream; a later try may pass.
pub(super) fn refuse(state: &AgentState, reason: &'static str, n: u64, status: Status) -> Status {
    refuse_as(state, reason, n, Retry::Later, status)
}

/// [`refuse`], saying whether a reconnect of the process may pass.
pub(super) fn refuse_as(
    state: &AgentState,
    reason: &'static str,
    n: u64,
    retry: Retry,
    status: Status,
) -> Status {
    state.ingest.reject(reason, n);
    named(status, reason, retry)
}

/// `status` with the refusal's reason in its trailing metadata, and
/// `stepwatch-retry: never` for a refusal no reconnect can pass.
pub(super) fn named(mut status: Status, reason: &'static str, retry: Retry) -> Status {
    let metadata = status.metadata_mut();
    metadata.insert(REFUSAL_METADATA, MetadataValue::from_static(reason));
    if retry == Retry::Never {
        metadata.insert(RETRY_METADATA, MetadataValue::from_static("never"));
    }
    status
}
