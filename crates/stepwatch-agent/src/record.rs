//! `--record`: every tracker input as JSON lines, for `stepwatch replay-record`
//! and for the predictor's fixtures (see `stepwatch_core::record`).
//!
//! Entries are written under the tracker lock by whoever applies them, so
//! the file holds them in the order the tracker saw them. Writing stops
//! (logged once, counted) at the size bound or on the first I/O error; the
//! agent goes on either way.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Mutex;

use prometheus::IntCounterVec;
use stepwatch_core::RecordEntry;

/// The open record file.
pub struct Recorder {
    inner: Mutex<Inner>,
    max_bytes: u64,
    entries: IntCounterVec,
}

struct Inner {
    file: Option<BufWriter<File>>,
    written: u64,
}

impl Recorder {
    /// Creates (truncates) `path`; `entries` counts written and dropped entries.
    pub fn create(path: &Path, max_bytes: u64, entries: IntCounterVec) -> std::io::Result<Self> {
        let file = File::create(path)?;
        Ok(Self {
            inner: Mutex::new(Inner {
                file: Some(BufWriter::new(file)),
                written: 0,
            }),
            max_bytes,
            entries,
        })
    }

    /// Appends one entry; `flush` pushes it to the file now (rank events),
    /// else it waits in the buffer (samples).
    pub fn write(&self, entry: &RecordEntry, flush: bool) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let written = inner.written;
        let Some(file) = inner.file.as_mut() else {
            self.entries.with_label_values(&["dropped"]).inc();
            return;
        };
        let result = serde_json::to_vec(entry)
            .map_err(std::io::Error::from)
            .and_then(|mut line| {
                line.push(b'\n');
                if written + line.len() as u64 > self.max_bytes {
                    let _ = file.flush();
                    return Err(std::io::Error::other(format!(
                        "the record reached --record-max-bytes ({})",
                        self.max_bytes
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
                inner.written += n;
                self.entries.with_label_values(&["written"]).inc();
            }
            Err(e) => {
                tracing::warn!(error = %e, "recording stops (the agent goes on)");
                inner.file = None;
                self.entries.with_label_values(&["dropped"]).inc();
            }
        }
    }

    /// Pushes buffered entries to the file (periodically and at shutdown).
    pub fn flush(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(file) = inner.file.as_mut() {
            if let Err(e) = file.flush() {
                tracing::warn!(error = %e, "cannot write the record; recording stops (the agent goes on)");
                inner.file = None;
            }
        }
    }
}
