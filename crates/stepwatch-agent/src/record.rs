//! `--record`: every tracker input as JSON lines, for `stepwatch replay-record`
//! and for the predictor's fixtures (see `stepwatch_core::record`).
//!
//! Entries are queued under the tracker lock by whoever applies them, so the
//! file holds them in the order the tracker saw them; a writer thread
//! serialises and writes them after the lock is released (an allocator trace
//! is megabytes of JSON, and a slow disk must not stall ingest or scrapes).
//! The queue is bounded: when it is full (the disk fell behind), recording
//! stops rather than skipping an entry, so the file stays a replayable
//! prefix. Writing also stops (logged once, counted) at the size bound or on
//! the first I/O error; the agent goes on either way.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use prometheus::IntCounterVec;
use stepwatch_core::RecordEntry;

/// Entries the writer may fall behind by before recording stops: about
/// 400 s of samples of 8 GPUs at 10 Hz, or a few seconds of heavy ingest.
pub const RECORD_QUEUE_ENTRIES: usize = 4096;

/// How long the final flush at shutdown waits for the writer.
const FINAL_FLUSH_WAIT: Duration = Duration::from_secs(5);

enum Message {
    Entry(Box<RecordEntry<'static>>, bool),
    /// Push buffered entries to the file; answer on the sender when done.
    Flush(Option<mpsc::Sender<()>>),
}

/// The open record file, written by its own thread.
pub struct Recorder {
    queue: SyncSender<Message>,
    /// Set once an entry could not be queued; later entries are dropped too.
    stopped: AtomicBool,
    entries: IntCounterVec,
}

impl Recorder {
    /// Creates (truncates) `path` and starts its writer; `entries` counts
    /// written and dropped entries.
    pub fn create(path: &Path, max_bytes: u64, entries: IntCounterVec) -> std::io::Result<Self> {
        Self::with_queue(path, max_bytes, entries, RECORD_QUEUE_ENTRIES)
    }

    fn with_queue(
        path: &Path,
        max_bytes: u64,
        entries: IntCounterVec,
        queue_entries: usize,
    ) -> std::io::Result<Self> {
        let file = File::create(path)?;
        let (queue, rx) = mpsc::sync_channel(queue_entries);
        let writer = Writer {
            file: Some(BufWriter::new(file)),
            written: 0,
            max_bytes,
            entries: entries.clone(),
        };
        std::thread::Builder::new()
            .name("stepwatch-record".into())
            .spawn(move || writer.run(rx))?;
        Ok(Self {
            queue,
            stopped: AtomicBool::new(false),
            entries,
        })
    }

    /// Queues one entry; `flush` pushes it to the file as soon as it is
    /// written (rank events), else it waits in the buffer (samples). Never
    /// blocks and does no I/O: callers hold the tracker lock.
    pub fn write(&self, entry: RecordEntry<'static>, flush: bool) {
        if self.stopped.load(Ordering::Relaxed) {
            self.entries.with_label_values(&["dropped"]).inc();
            return;
        }
        match self.queue.try_send(Message::Entry(Box::new(entry), flush)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                if !self.stopped.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        queued = RECORD_QUEUE_ENTRIES,
                        "the record writer fell behind (slow disk); recording stops so the record stays a replayable prefix (the agent goes on)"
                    );
                }
                self.entries.with_label_values(&["dropped"]).inc();
            }
            Err(TrySendError::Disconnected(_)) => {
                self.stopped.store(true, Ordering::Relaxed);
                self.entries.with_label_values(&["dropped"]).inc();
            }
        }
    }

    /// Asks the writer to push buffered entries to the file (periodically);
    /// skipped when the queue is full, as the writer is busy anyway.
    pub fn flush(&self) {
        let _ = self.queue.try_send(Message::Flush(None));
    }

    /// Waits (a bounded time) until everything queued so far is in the file
    /// (at shutdown, and for tests).
    pub fn flush_and_wait(&self) -> bool {
        let (done_tx, done_rx) = mpsc::channel();
        let deadline = Instant::now() + FINAL_FLUSH_WAIT;
        let mut message = Message::Flush(Some(done_tx));
        loop {
            match self.queue.try_send(message) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                    message = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return false,
            }
        }
        done_rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }
}

struct Writer {
    file: Option<BufWriter<File>>,
    written: u64,
    max_bytes: u64,
    entries: IntCounterVec,
}

impl Writer {
    fn run(mut self, rx: Receiver<Message>) {
        for message in rx {
            match message {
                Message::Entry(entry, flush) => self.write(&entry, flush),
                Message::Flush(done) => {
                    self.flush();
                    if let Some(done) = done {
                        let _ = done.send(());
                    }
                }
            }
        }
        self.flush();
    }

    fn write(&mut self, entry: &RecordEntry<'_>, flush: bool) {
        let written = self.written;
        let max_bytes = self.max_bytes;
        let Some(file) = self.file.as_mut() else {
            self.entries.with_label_values(&["dropped"]).inc();
            return;
        };
        let result = serde_json::to_vec(entry)
            .map_err(std::io::Error::from)
            .and_then(|mut line| {
                line.push(b'\n');
                if written + line.len() as u64 > max_bytes {
                    let _ = file.flush();
                    return Err(std::io::Error::other(format!(
                        "the record reached --record-max-bytes ({max_bytes})"
                    )));
                }
                file.write_all(&line)?;
                if flush {
                    file.flush()?;
                }
                Ok(line.len() as u64)
            });
        match result {
            Ok(n) => {
                self.written += n;
                self.entries.with_label_values(&["written"]).inc();
            }
            Err(e) => {
                tracing::warn!(error = %e, "recording stops (the agent goes on)");
                self.file = None;
                self.entries.with_label_values(&["dropped"]).inc();
            }
        }
    }

    fn flush(&mut self) {
        if let Some(file) = self.file.as_mut() {
            if let Err(e) = file.flush() {
                tracing::warn!(error = %e, "cannot write the record; recording stops (the agent goes on)");
                self.file = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Opts;

    fn counter() -> IntCounterVec {
        IntCounterVec::new(Opts::new("t", "t"), &["result"]).unwrap()
    }

    fn evict(at_ns: u64) -> RecordEntry<'static> {
        RecordEntry::Evict {
            at_ns,
            retention_ns: 1,
        }
    }

    /// The entries the record file at `path` holds.
    fn read_back(path: &std::path::Path) -> Vec<RecordEntry<'static>> {
        let text = std::fs::read_to_string(path).unwrap();
        text.lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    #[test]
    fn entries_reach_the_file_in_order_after_a_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("order.jsonl");
        let entries = counter();
        let r = Recorder::create(&path, 1 << 20, entries.clone()).unwrap();
        for i in 0..100 {
            r.write(evict(i), false);
        }
        assert!(r.flush_and_wait());
        assert_eq!(read_back(&path), (0..100).map(evict).collect::<Vec<_>>());
        assert_eq!(entries.with_label_values(&["written"]).get(), 100);
        assert_eq!(entries.with_label_values(&["dropped"]).get(), 0);
    }

    #[test]
    fn a_full_queue_stops_recording_and_counts_every_drop() {
        // A queue of one with the writer held up: the record must stay a
        // prefix of what the tracker saw, so after the first refused entry
        // every later one is dropped (and counted) too.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("full.jsonl");
        let entries = counter();
        let r = Recorder::with_queue(&path, 1 << 20, entries.clone(), 1).unwrap();
        // Fill the queue faster than the writer can drain it; writes never block.
        let mut sent = 0;
        while entries.with_label_values(&["dropped"]).get() == 0 {
            r.write(evict(sent), false);
            sent += 1;
        }
        for i in 0..10 {
            r.write(evict(sent + i), false);
        }
        assert!(r.flush_and_wait());
        let written = entries.with_label_values(&["written"]).get();
        let dropped = entries.with_label_values(&["dropped"]).get();
        assert_eq!(written + dropped, sent + 10);
        assert!(dropped >= 11, "{dropped}");
        assert_eq!(
            read_back(&path),
            (0..written).map(evict).collect::<Vec<_>>()
        );
    }
}
