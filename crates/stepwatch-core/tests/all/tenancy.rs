//! Shared nodes: a rank belongs to one process of one tenant. Another
//! process can neither take over nor reset a live rank, two namespaces
//! never share one, and a job resubmitted under the same id is a new run.

use proptest::prelude::*;
use stepwatch_core::*;
use stepwatch_testkit as kit;

fn info(namespace: &str, job: &str, rank: u32, pid: u32) -> RankInfo {
    RankInfo {
        namespace: namespace.into(),
        job: job.into(),
        rank,
        world_size: 4,
        local_rank: rank,
        gpu_uuid: format!("GPU-{rank}"),
        pid,
        ..Default::default()
    }
}

/// Two complete steps, 10 ms apart per marker, from `t0`.
fn two_steps(t0: u64) -> Vec<Marker> {
    let mut out = Vec::new();
    let mut t = t0;
    for step in 1..=2 {
        for kind in MarkerKind::STEP_ORDER {
            t += 10_000_000;
            out.push(kit::marker(kind, step, t));
        }
    }
    out
}

#[test]
fn two_namespaces_with_the_same_job_id_have_separate_ranks() {
    let mut t = Tracker::new(TrackerConfig::default());
    let a = t.open(info("team-a", "train", 0, 10), 0).unwrap();
    let b = t.open(info("team-b", "train", 0, 20), 0).unwrap();
    assert_ne!(a, b);
    assert_eq!(t.rank_count(), 2);
    t.markers(&a, &two_steps(0), 1).unwrap();
    assert_eq!(t.rank(&a).unwrap().timeline.steps_completed(), 2);
    assert_eq!(t.rank(&b).unwrap().timeline.steps_completed(), 0);
    assert_eq!(t.job_ranks("team-a", "train").count(), 1);
    assert_eq!(t.job_ranks("team-b", "train").count(), 1);
    assert_eq!(t.job_ranks("", "train").count(), 0);
}

#[test]
fn another_process_cannot_take_or_reset_a_live_rank() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(info("ns", "j", 0, 10), 0).unwrap();
    t.markers(&key, &two_steps(0), 1).unwrap();
    let refused = t.open(info("ns", "j", 0, 11), 2);
    assert!(
        matches!(refused, Err(OpenError::RankHeld { ref job, rank: 0, .. }) if job == "j"),
        "{refused:?}"
    );
    let refused = refused.unwrap_err();
    assert_eq!(refused.reason(), "rank_held");
    // The holder may go away (a restart while the old stream closes): the
    // client is told to retry.
    assert!(!refused.refuses_the_run(), "{refused:?}");
    let r = t.rank(&key).unwrap();
    assert_eq!((r.info.pid, r.connected_streams), (10, 1));
    assert_eq!(r.timeline.steps_completed(), 2);
    // Another pod with the same PID number (another PID namespace) neither.
    let mut other_pod = info("ns", "j", 0, 10);
    other_pod.pod = "intruder".into();
    let mut own = info("ns", "j", 0, 10);
    own.pod = "trainer-0".into();
    let mut t = Tracker::new(TrackerConfig::default());
    t.open(own.clone(), 0).unwrap();
    assert!(matches!(
        t.open(other_pod, 1),
        Err(OpenError::RankHeld { .. })
    ));
    // The same process may open a second stream (a reconnect racing the close).
    assert!(t.open(own, 2).is_ok());
    assert_eq!(t.rank(&key).unwrap().connected_streams, 2);
}

#[test]
fn a_restart_after_the_old_stream_closed_starts_afresh_and_a_reconnect_resumes() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(info("ns", "j", 0, 10), 0).unwrap();
    t.markers(&key, &two_steps(0), 1).unwrap();
    t.close(&key, 2);
    // The same process again: resumes.
    t.open(info("ns", "j", 0, 10), 3).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
    t.close(&key, 4);
    // A new process: a fresh timeline.
    t.open(info("ns", "j", 0, 12), 5).unwrap();
    let r = t.rank(&key).unwrap();
    assert_eq!((r.info.pid, r.timeline.steps_completed()), (12, 0));
}

/// Process 10's rank 0 of job `j` in `ns`, in the run `id`.
fn run(id: &str) -> RankInfo {
    RankInfo {
        run_id: id.into(),
        ..info("ns", "j", 0, 10)
    }
}

#[test]
fn a_new_run_id_from_the_same_process_starts_the_rank_afresh() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(run("fit-1"), 0).unwrap();
    t.markers(&key, &two_steps(0), 1).unwrap();
    // A reconnect within the run, and a hello without a run id (an older
    // client), resume it, also while the first stream is still open.
    t.open(run("fit-1"), 2).unwrap();
    t.open(run(""), 2).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
    // A second fit while the first stream is still open: a new run.
    t.open(run("fit-2"), 3).unwrap();
    let r = t.rank(&key).unwrap();
    assert_eq!(r.timeline.steps_completed(), 0);
    assert_eq!((r.info.run_id.as_str(), r.connected_streams), ("fit-2", 4));
    // Its step 1 is step 1, not step 3 (which a resumed run would refuse).
    t.markers(&key, &two_steps(100_000_000), 4).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
    assert_eq!(
        t.rank(&key).unwrap().timeline.steps().next().unwrap().step,
        1
    );
}

#[test]
fn a_stream_of_a_run_the_process_left_cannot_reopen_or_reset_the_rank() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(run("fit-1"), 0).unwrap();
    t.close(&key, 1);
    t.open(run("fit-2"), 2).unwrap();
    t.markers(&key, &two_steps(0), 3).unwrap();
    // A client that kept fit-1's stream reconnects with it: refused, and
    // fit-2's steps stand (before, it started the rank afresh again).
    let refused = t.open(run("fit-1"), 4);
    let Err(OpenError::RankHeld { ref why, .. }) = refused else {
        panic!("{refused:?}");
    };
    assert!(
        why.contains("\"fit-2\"") && why.contains("\"fit-1\""),
        "{why}"
    );
    // No later try of fit-1 can pass: its client is told to stop.
    assert!(refused.as_ref().unwrap_err().refuses_the_run());
    let r = t.rank(&key).unwrap();
    assert_eq!((r.info.run_id.as_str(), r.connected_streams), ("fit-2", 1));
    assert_eq!(r.timeline.steps_completed(), 2);
    // fit-2 itself reconnects as before, and a third run starts afresh.
    t.open(run("fit-2"), 5).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
    t.open(run("fit-3"), 6).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 0);
    assert!(t.open(run("fit-2"), 7).is_err());
    // Another process after this one left: its run ids are its own.
    for _ in 0..3 {
        t.close(&key, 8);
    }
    let other = RankInfo {
        run_id: "fit-1".into(),
        ..info("ns", "j", 0, 11)
    };
    t.open(other, 9).unwrap();
    assert!(t.rank(&key).unwrap().ended_runs.is_empty());
}

#[test]
fn batches_of_a_still_open_stream_of_a_run_the_process_left_are_refused() {
    let mut t = Tracker::new(TrackerConfig::default());
    let steps = two_steps(0);
    // fit-1's stream is open and half way through its step 1 when fit-2's
    // opens (connected_streams 2), and fit-2 begins its own step 1.
    let key = t.open(run("fit-1"), 0).unwrap();
    t.run_markers(&key, "fit-1", &steps[..2], 1).unwrap();
    t.open(run("fit-2"), 2).unwrap();
    // The two runs' clocks interleave (two clients), so fit-1's late
    // markers would pass every check of fit-2's timeline.
    let fit2 = two_steps(0);
    t.run_markers(&key, "fit-2", &fit2[..2], 3).unwrap();
    let before = serde_json::to_string(&t.rank(&key).unwrap().timeline).unwrap();
    // fit-1's last batches, still in flight: the rest of its step 1 and
    // its step 2's begin (which would freeze fit-2's prediction).
    let late = &steps[2..MarkerKind::STEP_ORDER.len() + 1];
    let refused = t.run_markers(&key, "fit-1", late, 4);
    let Err(e @ MarkerError::RunEnded { .. }) = refused else {
        panic!("{refused:?}");
    };
    assert_eq!(e.reason(), "run_ended");
    assert!(e.refuses_the_run(), "fit-1's client is told to stop");
    assert!(
        e.to_string().contains("\"fit-1\"") && e.to_string().contains("\"fit-2\""),
        "{e}"
    );
    let r = t.rank(&key).unwrap();
    assert_eq!(serde_json::to_string(&r.timeline).unwrap(), before);
    assert!(
        r.prediction_before_step2.is_none(),
        "fit-2 is in its step 1"
    );
    assert_eq!(r.last_activity_ns, 3, "a refused batch is no activity");
    // fit-2 goes on with its step 1 as if fit-1 had not spoken.
    t.run_markers(&key, "fit-2", &fit2[2..], 5).unwrap();
    let r = t.rank(&key).unwrap();
    assert_eq!(r.timeline.steps_completed(), 2);
    assert_eq!(r.timeline.steps().next().unwrap().step, 1);
    // A stream without a run id (an older client) is applied as before.
    t.open(run("fit-3"), 6).unwrap();
    t.run_markers(&key, "", &steps[..2], 7).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps().count(), 1);
}

#[test]
fn a_new_run_forgets_the_last_runs_step_1_segment_layout() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(run("fit-1"), 0).unwrap();
    // Step 1 up to its optimizer begin, which carries a layout; the run
    // ends there (say, an exception) and the process starts another.
    let mut ms: Vec<Marker> = two_steps(0).into_iter().take(4).collect();
    ms[3].layout_segments = vec![allocator::SegmentLayout::new(
        0,
        allocator::Pool::Large,
        vec![allocator::BlockLayout {
            size: 20 << 20,
            allocated: false,
            gradient: false,
        }],
    )];
    t.markers(&key, &ms, 1).unwrap();
    assert_eq!(t.rank(&key).unwrap().optimizer_begin_layout.len(), 1);
    t.close(&key, 2);
    t.open(run("fit-2"), 3).unwrap();
    let r = t.rank(&key).unwrap();
    assert!(r.optimizer_begin_layout.is_empty() && r.layout_estimate.is_none());
}

#[test]
fn a_process_remembers_at_most_max_ended_runs_of_its_own() {
    let mut t = Tracker::new(TrackerConfig::default());
    let key = t.open(run("fit-0"), 0).unwrap();
    for i in 1..=MAX_ENDED_RUNS + 2 {
        t.close(&key, i as u64);
        t.open(run(&format!("fit-{i}")), i as u64).unwrap();
    }
    let ended = &t.rank(&key).unwrap().ended_runs;
    assert_eq!(ended.len(), MAX_ENDED_RUNS);
    assert_eq!(
        ended.last().unwrap(),
        &format!("fit-{}", MAX_ENDED_RUNS + 1)
    );
    assert_eq!(ended.first().unwrap(), "fit-2");
}

#[test]
fn a_run_id_outside_the_identifier_charset_is_refused() {
    let mut t = Tracker::new(TrackerConfig::default());
    let bad = RankInfo {
        run_id: "fit 1".into(),
        ..info("ns", "j", 0, 10)
    };
    let refused = t.open(bad, 0);
    assert!(matches!(refused, Err(OpenError::Invalid(_))), "{refused:?}");
}

#[test]
fn an_attested_rank_is_not_taken_by_an_unattested_hello() {
    let mut t = Tracker::new(TrackerConfig::default());
    let mut attested = info("ns", "j", 0, 10);
    attested.attested = true;
    let key = t.open(attested, 0).unwrap();
    t.close(&key, 1);
    let claim = info("ns", "j", 0, 10);
    assert!(matches!(t.open(claim, 2), Err(OpenError::RankHeld { .. })));
    assert!(t.rank(&key).unwrap().info.attested);
}

#[test]
fn a_resubmitted_job_replaces_the_old_runs_ranks_instead_of_adding_to_them() {
    let mut t = Tracker::new(TrackerConfig::default());
    // Run 1: four ranks, all finished.
    for rank in 0..4 {
        let key = t.open(info("ns", "j", rank, 100 + rank), 0).unwrap();
        t.markers(&key, &two_steps(0), 1).unwrap();
        t.close(&key, 2);
    }
    // Another tenant's job of the same id is not touched.
    t.open(info("other", "j", 0, 7), 0).unwrap();
    // Run 2 of the same id, two ranks: rank 0 comes back as a new process.
    let opened = t.open_evicting(info("ns", "j", 0, 200), 3).unwrap();
    assert_eq!(
        opened.superseded,
        (1..4)
            .map(|r| RankKey::new("ns", "j", r))
            .collect::<Vec<_>>()
    );
    t.open(info("ns", "j", 1, 201), 3).unwrap();
    let ranks: Vec<_> = t
        .job_ranks("ns", "j")
        .map(|(k, r)| (k.rank, r.info.pid))
        .collect();
    assert_eq!(ranks, vec![(0, 200), (1, 201)]);
    assert_eq!(t.job_ranks("other", "j").count(), 1);
    assert_eq!(t.rank_count(), 3);
}

#[test]
fn ranks_of_one_run_that_start_late_do_not_drop_their_finished_peers() {
    let mut t = Tracker::new(TrackerConfig::default());
    let r0 = t.open(info("ns", "j", 0, 100), 0).unwrap();
    t.close(&r0, 1);
    // Rank 1 was never seen: no sign of a new run.
    let opened = t.open_evicting(info("ns", "j", 1, 101), 2).unwrap();
    assert!(opened.superseded.is_empty());
    assert_eq!(t.job_ranks("ns", "j").count(), 2);
    // A live peer also means the same run.
    let r1 = opened.key;
    assert!(t.rank(&r1).is_some());
}

#[test]
fn journals_and_records_without_a_namespace_still_read() {
    let key: RankKey = serde_json::from_str(r#"{"job":"j","rank":3}"#).unwrap();
    assert_eq!(key, RankKey::new("", "j", 3));
    // And the key of a rank outside Kubernetes is written as before.
    assert_eq!(
        serde_json::to_string(&key).unwrap(),
        r#"{"job":"j","rank":3}"#
    );
}

proptest! {
    /// Whatever the order of hellos and closes from a few processes, a rank
    /// with an open stream keeps the process that opened it, and a refused
    /// hello changes nothing.
    #[test]
    fn a_connected_rank_keeps_its_process(ops in proptest::collection::vec((0u32..3, any::<bool>()), 1..40)) {
        let mut t = Tracker::new(TrackerConfig::default());
        let key = RankKey::new("ns", "j", 0);
        // Streams each pid holds open.
        let mut open = [0u32; 3];
        for (i, (p, close)) in ops.into_iter().enumerate() {
            let pid = 10 + p;
            if close {
                if open[p as usize] > 0 {
                    open[p as usize] -= 1;
                    t.close(&key, i as u64);
                }
                continue;
            }
            let before = t.rank(&key).map(|r| (r.info.pid, r.connected_streams));
            match t.open(info("ns", "j", 0, pid), i as u64) {
                Ok(_) => {
                    prop_assert!(before.is_none_or(|(holder, streams)| streams == 0 || holder == pid));
                    open[p as usize] += 1;
                }
                Err(e) => {
                    let held = matches!(e, OpenError::RankHeld { .. });
                    prop_assert!(held);
                    let (holder, streams) = before.unwrap();
                    prop_assert!(streams > 0 && holder != pid);
                    prop_assert_eq!(t.rank(&key).map(|r| (r.info.pid, r.connected_streams)), before);
                }
            }
        }
    }
}

#[test]
fn a_rank_whose_stream_broke_stays_its_process_s_through_the_reconnect_window() {
    let mut t = Tracker::new(TrackerConfig {
        reconnect_window_ns: 100,
        ..TrackerConfig::default()
    });
    let key = t.open(info("ns", "j", 0, 10), 0).unwrap();
    t.markers(&key, &two_steps(0), 1).unwrap();
    t.disconnect(&key, 1_000);
    // Another process, within the window: refused, and the history kept.
    assert!(matches!(
        t.open(info("ns", "j", 0, 66), 1_050),
        Err(OpenError::RankHeld {
            run_left: false,
            ..
        })
    ));
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
    // Its own process resumes within it.
    t.open(info("ns", "j", 0, 10), 1_099).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
    // A clean close holds nothing: a restarted job takes the rank at once.
    t.close(&key, 2_000);
    t.open(info("ns", "j", 0, 12), 2_001).unwrap();
    t.disconnect(&key, 3_000);
    // Past the window, another process may take it (a new run).
    t.open(info("ns", "j", 0, 13), 3_100).unwrap();
    assert_eq!(t.rank(&key).unwrap().info.pid, 13);
}

#[test]
fn over_tcp_only_the_client_certificate_identifies_a_process() {
    let over_tcp = |pid: u32, identity: &str| RankInfo {
        tcp_identity: Some(identity.into()),
        ..info("ns", "j", 0, pid)
    };
    let mut t = Tracker::new(TrackerConfig {
        reconnect_window_ns: 100,
        ..TrackerConfig::default()
    });
    // Without a certificate, a hello claiming the holder's PID is nobody:
    // it can neither join the live rank nor resume it.
    let key = t.open(over_tcp(10, ""), 0).unwrap();
    t.markers(&key, &two_steps(0), 1).unwrap();
    assert!(matches!(
        t.open(over_tcp(10, ""), 2),
        Err(OpenError::RankHeld { .. })
    ));
    // Nothing identifies the holder, so nothing holds the rank for it once
    // it is gone: the next claimant starts afresh.
    t.disconnect(&key, 3);
    t.open(over_tcp(10, ""), 4).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 0);
    t.close(&key, 5);

    // With one, the certificate's holder resumes and no one else can.
    let key = t.open(over_tcp(20, "tls:aa"), 6).unwrap();
    t.markers(&key, &two_steps(10), 7).unwrap();
    assert!(matches!(
        t.open(over_tcp(20, "tls:bb"), 8),
        Err(OpenError::RankHeld { .. })
    ));
    // Nor a Unix socket peer claiming the same PID.
    assert!(matches!(
        t.open(info("ns", "j", 0, 20), 8),
        Err(OpenError::RankHeld { .. })
    ));
    t.disconnect(&key, 9);
    assert!(t.open(over_tcp(20, "tls:bb"), 10).is_err());
    t.open(over_tcp(20, "tls:aa"), 11).unwrap();
    assert_eq!(t.rank(&key).unwrap().timeline.steps_completed(), 2);
}

#[test]
fn a_dead_ranks_other_processes_do_not_absorb_its_restarted_run() {
    const GB: u64 = 1_000_000_000;
    let mut t = Tracker::new(TrackerConfig::default());
    // The demo's doomed job: its rank 0 on GPU-0 beside a 1 GB process.
    let dead = t.open(info("", "doomed-llm-1", 0, 10), 0).unwrap();
    t.markers(&dead, &two_steps(0), 1).unwrap();
    t.set_gpu_processes("GPU-0", &[(10, 30 * GB), (99, GB)]);
    assert_eq!(t.other_process_bytes(&dead), GB);
    t.close(&dead, 2);
    // It died; its restarted run (another job id, another process) takes
    // the GPU.
    let next = t.open(info("", "doomed-llm-2", 0, 11), 3).unwrap();
    t.set_gpu_processes("GPU-0", &[(11, 42_700_000_000), (99, GB)]);
    assert_eq!(t.other_process_bytes(&next), GB);
    assert_eq!(
        t.other_process_bytes(&dead),
        GB,
        "not the successor's 42.7 GB"
    );
    assert_eq!(t.rank_analysis(&dead).unwrap().other_process_bytes, GB);
    // Kept in the journal, as a restarted agent reads it back.
    let journal = t.journal(8);
    let mut restored = Tracker::new(TrackerConfig::default());
    restored.restore(journal, 4);
    restored.set_gpu_processes("GPU-0", &[(11, 42_700_000_000), (99, GB)]);
    assert_eq!(restored.other_process_bytes(&dead), GB);
    // A rank whose process comes back reads the live list again.
    t.open(info("", "doomed-llm-1", 0, 10), 5).unwrap();
    assert_eq!(t.other_process_bytes(&dead), 42_700_000_000 + GB);
}
