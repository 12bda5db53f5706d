//! The allocator model's rule for equal free blocks follows the traced
//! PyTorch version, checked on recorded allocator histories.

use stepwatch_core::allocator::{
    AllocatorSettings, BlockLayout, FreeBlockOrder, History, Pool, RecordedAction, RecordedEvent,
    SegmentLayout,
};

const MIB: u64 = 1 << 20;

fn settings(order: FreeBlockOrder) -> AllocatorSettings {
    AllocatorSettings {
        free_block_order: order,
        ..AllocatorSettings::default()
    }
}

fn event(action: RecordedAction, address: u64, size: u64) -> RecordedEvent {
    RecordedEvent {
        action,
        address,
        size,
        stream: 0,
    }
}

#[test]
fn torch_2_15_on_fake_cuda_takes_the_oldest_segments_block() {
    // Real PyTorch 2.15 on fake CUDA (history.py in the fixtures folder).
    let text = include_str!("../fixtures/torch-fake-cuda/history-adamw-2.15.json");
    let history: History = serde_json::from_str(text).unwrap();
    let order = FreeBlockOrder::of_torch_version("2.15.0+cu132").unwrap();
    assert_eq!(order, FreeBlockOrder::SegmentAge);
    let c = history.check(settings(order)).unwrap();
    assert_eq!(c.allocations, 483);
    assert_eq!(
        c.placed_right, c.allocations,
        "every block where 2.15 put it"
    );
    assert!(c.reserved_exact(), "{c:?}");
    // The history tells the rules apart: by address, blocks land elsewhere
    // and the reserved peak is off.
    let by_address = history.check(settings(FreeBlockOrder::Address)).unwrap();
    assert!(by_address.placed_right < c.allocations, "{by_address:?}");
    assert!(!by_address.reserved_exact(), "{by_address:?}");
}

/// Two equal free blocks: the older segment's at the higher address, as
/// CUDA hands out segments downwards. PyTorch up to 2.12 takes the lower
/// (checked on real-GPU snapshots of 2.1 to 2.11: `bench/alloc-snapshots.sh`),
/// 2.13 on the older.
fn tie_history(takes: u64) -> History {
    let old = 1u64 << 36;
    let new = old - 40 * MIB;
    History {
        start: vec![SegmentLayout::new(
            old,
            Pool::Large,
            vec![BlockLayout {
                size: 40 * MIB,
                allocated: true,
                gradient: false,
            }],
        )],
        events: vec![
            event(RecordedAction::SegmentAlloc, new, 40 * MIB),
            event(RecordedAction::Alloc, new, 40 * MIB),
            event(RecordedAction::Free, old, 40 * MIB),
            event(RecordedAction::Free, new, 40 * MIB),
            event(RecordedAction::Alloc, takes, 24 * MIB),
        ],
    }
}

/// Each of `versions` follows `order`, which places both allocations of
/// the tie history where the real allocator did (the second at `takes`);
/// the other rule misses the second.
fn versions_follow(versions: &[&str], order: FreeBlockOrder, takes: u64) {
    let history = tie_history(takes);
    for version in versions {
        assert_eq!(
            FreeBlockOrder::of_torch_version(version),
            Some(order),
            "{version}"
        );
        let c = history.check(settings(order)).unwrap();
        assert_eq!((c.allocations, c.placed_right), (2, 2), "{version}");
    }
    let other = match order {
        FreeBlockOrder::Address => FreeBlockOrder::SegmentAge,
        FreeBlockOrder::SegmentAge => FreeBlockOrder::Address,
    };
    assert_eq!(history.check(settings(other)).unwrap().placed_right, 1);
}

#[test]
fn up_to_2_12_the_lowest_address_serves_first() {
    let versions = ["2.1.2+cu121", "2.6.0", "2.11.0+cu128", "2.12.1"];
    versions_follow(&versions, FreeBlockOrder::Address, (1u64 << 36) - 40 * MIB);
}

#[test]
fn from_2_13_the_oldest_segment_serves_first() {
    let versions = ["2.13.0", "2.13.0a0+git5f2b1c4", "2.15.0+cu132", "3.0.0"];
    versions_follow(&versions, FreeBlockOrder::SegmentAge, 1u64 << 36);
}

#[test]
fn a_version_that_is_not_one_names_no_rule() {
    for version in ["", "nightly", "2", "x.13", "2.x"] {
        assert_eq!(
            FreeBlockOrder::of_torch_version(version),
            None,
            "{version:?}"
        );
    }
    assert_eq!(
        FreeBlockOrder::of_torch_version("1.13.1"),
        Some(FreeBlockOrder::Address)
    );
}

#[test]
fn a_history_that_does_not_lead_to_its_events_is_refused() {
    // An allocation where the state has no free block (events lost).
    let mut history = tie_history(1u64 << 36);
    history.events.remove(2);
    history.events.remove(2);
    let err = history
        .check(settings(FreeBlockOrder::SegmentAge))
        .unwrap_err();
    assert!(err.to_string().contains("no free block"), "{err}");
}
