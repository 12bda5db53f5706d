//! `chunk_allocator_trace` keeps every message under the size limit and the
//! trace in order, with `last` on the final chunk only.

use prost::Message;
use stepwatch_proto::v1::{
    client_message::Kind, AllocatorBlock, AllocatorEvent, AllocatorSegment, ClientMessage,
};
use stepwatch_proto::{chunk_allocator_trace, MAX_MESSAGE_BYTES};

#[test]
fn chunks_fit_the_message_limit_and_keep_the_order() {
    let segments: Vec<AllocatorSegment> = (0..3000u64)
        .map(|i| AllocatorSegment {
            address: (1 << 40) + i * (1 << 26),
            small_pool: i % 2 == 0,
            blocks: (0..3)
                .map(|j| AllocatorBlock {
                    size: (i + 1) * 512 * (j + 1),
                    allocated: j == 1,
                    gradient: false,
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    let events: Vec<AllocatorEvent> = (0..50_000u64)
        .map(|i| AllocatorEvent {
            action: 1 + (i % 2) as i32,
            address: u64::MAX - i,
            size: i * 4096 + 1,
            phase: 2 + (i % 4) as i32,
            ..Default::default()
        })
        .collect();
    let chunks = chunk_allocator_trace(1, None, segments.clone(), events.clone(), Vec::new());
    assert!(chunks.len() > 10, "{} chunks", chunks.len());
    for (i, c) in chunks.iter().enumerate() {
        let message = ClientMessage {
            kind: Some(Kind::AllocatorTrace(c.clone())),
        };
        assert!(message.encoded_len() <= MAX_MESSAGE_BYTES, "chunk {i}");
        assert_eq!(c.step, 1);
        assert_eq!(c.last, i + 1 == chunks.len());
    }
    let all_segments: Vec<_> = chunks.iter().flat_map(|c| c.segments.clone()).collect();
    let all_events: Vec<_> = chunks.iter().flat_map(|c| c.events.clone()).collect();
    assert_eq!(all_segments, segments);
    assert_eq!(all_events, events);

    // An empty trace is one final chunk.
    let empty = chunk_allocator_trace(1, None, Vec::new(), Vec::new(), Vec::new());
    assert_eq!(empty.len(), 1);
    assert!(empty[0].last);
}
