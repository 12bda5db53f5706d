//! Rust bindings for stepwatch's wire contract, `proto/stepwatch/v1`.
//!
//! The code under `src/generated/` (our contract) and `src/third_party/`
//! (the upstream APIs of `proto/third_party/`) is produced from the `.proto`
//! files and checked in, so a fresh machine builds without `protoc`. The test
//! `tests/bootstrap.rs` regenerates it and fails when the checked-in copy is
//! stale.

/// Version 1 of the contract: one bidirectional stream per training rank.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    include!("generated/stepwatch.v1.rs");
}

/// The kubelet's pod-resources API, v1 (`proto/third_party/kubelet/podresources/v1`,
/// vendored from Kubernetes): which pod and container hold which device.
/// The agent is a client of it, to tell whose GPUs a connecting process may
/// claim; the tests serve it from a fake kubelet.
pub mod podresources {
    /// Package `v1` of `k8s.io/kubelet/pkg/apis/podresources`.
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        include!("third_party/v1.rs");
    }
}

/// The Container Storage Interface, v1 (`proto/third_party/csi/v1/csi.proto`, vendored
/// from the CSI spec). With `--csi-socket` the agent serves its Identity and
/// Node services, so a pod that may not mount hostPath gets its own ingest
/// socket as an ephemeral inline volume; the tests play the kubelet.
pub mod csi {
    /// Package `csi.v1`.
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        include!("third_party/csi.v1.rs");
    }
}

// Feature `convert`: the client and the sampler do without the step model.
#[cfg(feature = "convert")]
pub mod convert;

/// Upper bound on markers in one `MarkerBatch`; larger batches are rejected.
pub const MAX_MARKERS_PER_BATCH: usize = 1024;

/// Upper bound on one encoded message, client or agent side.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Splits an allocator trace into `AllocatorTraceChunk`s whose encoded
/// `ClientMessage` stays within [`MAX_MESSAGE_BYTES`]: the settings (when
/// known) in the first, then segments, then events, in order, with `last`
/// set on the final chunk (there is always at least one). A single segment
/// too large for one message (over ~4000 blocks) still goes alone in its
/// chunk; the agent then rejects the trace. From a core trace, use
/// `convert::allocator_trace_to_wire` (feature `convert`). The forward
/// returns go in the first chunk, with the settings.
pub fn chunk_allocator_trace(
    step: u64,
    settings: Option<v1::AllocatorSettings>,
    segments: Vec<v1::AllocatorSegment>,
    events: Vec<v1::AllocatorEvent>,
    forward_returns: Vec<u64>,
) -> Vec<v1::AllocatorTraceChunk> {
    use prost::Message;
    // Room for the oneof tag, the chunk's length prefix, step and last.
    const BUDGET: usize = MAX_MESSAGE_BYTES - 64;
    /// The chunks so far and the open one, with its encoded size.
    struct Chunks {
        step: u64,
        closed: Vec<v1::AllocatorTraceChunk>,
        open: v1::AllocatorTraceChunk,
        size: usize,
    }
    impl Chunks {
        /// The open chunk with `n` more bytes counted, after closing it when
        /// they would not fit (a lone item too large still gets a chunk).
        fn with_room(&mut self, n: usize) -> &mut v1::AllocatorTraceChunk {
            if self.size + n > BUDGET && self.size > 0 {
                let next = v1::AllocatorTraceChunk {
                    step: self.step,
                    ..Default::default()
                };
                self.closed.push(std::mem::replace(&mut self.open, next));
                self.size = 0;
            }
            self.size += n;
            &mut self.open
        }
    }
    let framed = |len: usize| 1 + prost::length_delimiter_len(len) + len;
    let mut chunks = Chunks {
        step,
        closed: Vec::new(),
        open: v1::AllocatorTraceChunk {
            step,
            ..Default::default()
        },
        size: 0,
    };
    // The settings and the forward returns (packed) go in the first chunk.
    let packed: usize = forward_returns
        .iter()
        .map(|&r| prost::encoding::encoded_len_varint(r))
        .sum();
    let first = chunks.with_room(
        settings.as_ref().map_or(0, |s| framed(s.encoded_len()))
            + if forward_returns.is_empty() {
                0
            } else {
                framed(packed)
            },
    );
    first.settings = settings;
    first.forward_returns = forward_returns;
    for s in segments {
        chunks.with_room(framed(s.encoded_len())).segments.push(s);
    }
    for e in events {
        chunks.with_room(framed(e.encoded_len())).events.push(e);
    }
    chunks.open.last = true;
    chunks.closed.push(chunks.open);
    chunks.closed
}

/// The two clocks every marker carries (the `stepwatch-clock` crate).
pub use stepwatch_clock as clock;
