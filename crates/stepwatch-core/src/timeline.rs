//! One rank's steps and phases, built from its validated marker stream.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::error::{kind_name, MarkerError};
use crate::marker::{
    AllocatorStats, BatchFacts, DeviceMemory, Marker, MarkerKind, PassKind, PhaseKind,
    MAX_PLAUSIBLE_BYTES, MAX_PLAUSIBLE_MONOTONIC_NS, MAX_PLAUSIBLE_STEP,
};

/// A step holds at most this many phases: a forward and a backward for each
/// of 510 micro-batches, plus the prologue, optimizer and epilogue phases.
/// Real steps have far fewer; more is refused rather than grown without
/// bound (4096 let one client grow the agent by a megabyte a step).
pub const MAX_PHASES_PER_STEP: usize = 1024;

/// Memory seen by NVML during one phase, from the GPU samples whose
/// timestamps fall inside it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleStats {
    /// Number of samples; 0 means the phase was too short to be seen.
    pub samples: u64,
    /// Highest device-used bytes seen.
    pub peak_bytes: u64,
    /// Sum of device-used bytes, for the mean; u128 so it cannot overflow.
    pub sum_bytes: u128,
}

impl SampleStats {
    /// Adds one sample's device-used bytes.
    pub fn add(&mut self, used_bytes: u64) {
        self.samples += 1;
        self.peak_bytes = self.peak_bytes.max(used_bytes);
        self.sum_bytes += u128::from(used_bytes);
    }

    /// Mean bytes, or None without samples.
    pub fn mean_bytes(&self) -> Option<u64> {
        (self.samples > 0).then(|| (self.sum_bytes / u128::from(self.samples)) as u64)
    }
}

/// The earliest and latest NVML samples of a phase (by timestamp, ties broken
/// by bytes so the result never depends on arrival order). They give the
/// memory level at the phase's boundaries, which the per-phase peak and mean
/// cannot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleEdges {
    /// `(monotonic_ns, used_bytes)` of the earliest sample.
    pub first: Option<(u64, u64)>,
    /// `(monotonic_ns, used_bytes)` of the latest sample.
    pub last: Option<(u64, u64)>,
}

impl SampleEdges {
    /// Takes one sample into account.
    pub fn add(&mut self, monotonic_ns: u64, used_bytes: u64) {
        let s = (monotonic_ns, used_bytes);
        if self.first.is_none_or(|f| s < f) {
            self.first = Some(s);
        }
        if self.last.is_none_or(|l| s > l) {
            self.last = Some(s);
        }
    }

    /// Bytes of the earliest sample.
    pub fn first_bytes(&self) -> Option<u64> {
        self.first.map(|(_, b)| b)
    }

    /// Bytes of the latest sample.
    pub fn last_bytes(&self) -> Option<u64> {
        self.last.map(|(_, b)| b)
    }
}

/// One phase of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseRecord {
    /// Which phase this is.
    pub phase: PhaseKind,
    /// Micro-batch index from the opening marker (gradient accumulation).
    pub micro_batch: u32,
    /// CLOCK_MONOTONIC ns of the opening marker; samples are attributed by it.
    pub start_monotonic_ns: u64,
    /// None while the phase is open.
    pub end_monotonic_ns: Option<u64>,
    /// Allocator figures of the opening marker; the phase's allocator peak is
    /// reconstructed from these and the closing ones.
    pub allocator_at_start: Option<AllocatorStats>,
    /// Allocator figures of the closing marker; None while open.
    pub allocator_at_end: Option<AllocatorStats>,
    /// The device's memory at the opening marker, when the client sent it
    /// (step 1's markers); with `allocator_at_start` it measures the memory
    /// outside the allocator. The closing marker's is the next phase's
    /// start, or the step's [`StepRecord::device_at_end`].
    #[serde(default)]
    pub device_at_start: Option<DeviceMemory>,
    /// NVML samples attributed to this phase.
    pub nvml: SampleStats,
    /// Earliest and latest of those samples.
    pub nvml_edges: SampleEdges,
    /// Set once the phase has closed and the sample window has been scanned
    /// for it; later samples are credited on arrival. Keeps attribution
    /// exactly-once whatever the arrival order.
    #[serde(skip)]
    pub(crate) credited: bool,
}

impl PhaseRecord {
    /// Duration in ns once the phase has closed.
    pub fn duration_ns(&self) -> Option<u64> {
        self.end_monotonic_ns
            .map(|end| end.saturating_sub(self.start_monotonic_ns))
    }

    /// Credits one NVML sample to this phase (stats and edges).
    pub(crate) fn add_sample(&mut self, monotonic_ns: u64, used_bytes: u64) {
        self.nvml.add(used_bytes);
        self.nvml_edges.add(monotonic_ns, used_bytes);
    }

    /// Whether a sample at `t` belongs to this phase: phases are half-open
    /// intervals [start, end), so a sample on a boundary belongs to exactly one.
    pub fn contains(&self, t: u64) -> bool {
        t >= self.start_monotonic_ns && self.end_monotonic_ns.is_none_or(|end| t < end)
    }
}

/// How a step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepOutcome {
    /// The step has begun and not ended yet.
    Running,
    /// The step-end marker arrived; only such steps feed the steady profile.
    Completed,
    /// The OOM marker ended it.
    Oom,
    /// A later step began before this one ended (markers were lost).
    Abandoned,
}

/// One optimizer step of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Optimizer step number, from 1.
    pub step: u64,
    /// CLOCK_MONOTONIC ns of the first marker of the step.
    pub begin_monotonic_ns: u64,
    /// Wall-clock ns of that marker, for display.
    pub begin_wall_ns: u64,
    /// CLOCK_MONOTONIC ns of the step end or OOM; None while running.
    pub end_monotonic_ns: Option<u64>,
    /// Wall-clock ns of that marker.
    pub end_wall_ns: Option<u64>,
    /// How the step ended, or that it is still running.
    pub outcome: StepOutcome,
    /// Phases in marker order; bounded by [`MAX_PHASES_PER_STEP`].
    pub phases: Vec<PhaseRecord>,
    /// The GPU's last NVML sample before the step began, at most
    /// [`BEFORE_BEGIN_WINDOW_NS`] before, as (monotonic ns, used bytes); kept
    /// for a rank's first step, whose prediction uses it. Against the reserved
    /// bytes at the step's first marker it bounds what NVML shows beyond the
    /// allocator (see `predict`).
    #[serde(default)]
    pub nvml_before_begin: Option<(u64, u64)>,
    /// The device's memory at the step-end or OOM marker, when the client
    /// sent it; the allocator figures of that marker are the last phase's
    /// `allocator_at_end`.
    #[serde(default)]
    pub device_at_end: Option<DeviceMemory>,
    /// The largest batch the step's markers carried (its micro-batches'),
    /// when the client saw them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<BatchFacts>,
}

/// Evaluation passes and checkpoint saves a rank keeps (the latest).
pub const MAX_RETAINED_PASSES: usize = 64;

/// How a pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PassOutcome {
    /// Still running.
    Running,
    /// Its end marker came, or the next step began.
    Completed,
    /// An OOM marker ended it.
    Oom,
}

/// One evaluation pass or checkpoint save, between two training steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PassRecord {
    /// What it is.
    pub kind: PassKind,
    /// The last training step begun before it (0: before the first).
    pub after_step: u64,
    /// CLOCK_MONOTONIC ns of its begin marker.
    pub begin_monotonic_ns: u64,
    /// Wall-clock ns of that marker.
    pub begin_wall_ns: u64,
    /// CLOCK_MONOTONIC ns of its end (its end marker, or the next step's
    /// first marker); None while running.
    pub end_monotonic_ns: Option<u64>,
    /// How it ended.
    pub outcome: PassOutcome,
    /// Allocator figures at its begin.
    pub allocator_at_start: Option<AllocatorStats>,
    /// Allocator figures at its end (None when the next step's marker
    /// ended it: that marker's figures are the step's).
    pub allocator_at_end: Option<AllocatorStats>,
    /// NVML samples within it.
    pub nvml: SampleStats,
    /// Set once it has closed and the sample window was scanned for it.
    #[serde(skip)]
    pub(crate) credited: bool,
}

impl PassRecord {
    /// Whether a sample at `t` falls in it (half-open, as phases).
    pub fn contains(&self, t: u64) -> bool {
        t >= self.begin_monotonic_ns && self.end_monotonic_ns.is_none_or(|end| t < end)
    }

    /// Duration in ns once it has ended.
    pub fn duration_ns(&self) -> Option<u64> {
        self.end_monotonic_ns
            .map(|end| end.saturating_sub(self.begin_monotonic_ns))
    }
}

/// How far before a step's begin a sample may be to count as its
/// [`StepRecord::nvml_before_begin`].
pub const BEFORE_BEGIN_WINDOW_NS: u64 = 100_000_000;

/// What `steps` retained steps with `phases` phases in all hold in memory,
/// approximately (see [`RankTimeline::approx_bytes`]).
fn approx_bytes(steps: usize, phases: usize) -> u64 {
    (steps * std::mem::size_of::<StepRecord>() + phases * std::mem::size_of::<PhaseRecord>()) as u64
}

impl StepRecord {
    /// What this step holds in memory, approximately: its share of
    /// [`RankTimeline::approx_bytes`].
    pub fn approx_bytes(&self) -> u64 {
        approx_bytes(1, self.phases.len())
    }

    /// Takes a sample as [`StepRecord::nvml_before_begin`] if it is the
    /// latest so far in the window before the begin, the larger on a tie
    /// (any arrival order gives the same result).
    pub fn offer_before_begin(&mut self, monotonic_ns: u64, used_bytes: u64) {
        if self.takes_before_begin(monotonic_ns, used_bytes) {
            self.nvml_before_begin = Some((monotonic_ns, used_bytes));
        }
    }

    /// Whether [`StepRecord::offer_before_begin`] would keep the sample.
    pub fn takes_before_begin(&self, monotonic_ns: u64, used_bytes: u64) -> bool {
        let in_window = monotonic_ns < self.begin_monotonic_ns
            && self.begin_monotonic_ns - monotonic_ns <= BEFORE_BEGIN_WINDOW_NS;
        in_window
            && self
                .nvml_before_begin
                .is_none_or(|kept| (monotonic_ns, used_bytes) > kept)
    }

    /// Duration in ns once the step has ended.
    pub fn duration_ns(&self) -> Option<u64> {
        self.end_monotonic_ns
            .map(|end| end.saturating_sub(self.begin_monotonic_ns))
    }

    /// Sum of the durations of this step's closed phases of one kind.
    pub fn phase_duration_ns(&self, kind: PhaseKind) -> Option<u64> {
        let mut found = false;
        let total = self
            .phases
            .iter()
            .filter(|p| p.phase == kind)
            .filter_map(|p| p.duration_ns())
            .inspect(|_| found = true)
            .sum();
        found.then_some(total)
    }

    /// Highest NVML sample over the whole step.
    pub fn nvml_peak_bytes(&self) -> Option<u64> {
        self.phases
            .iter()
            .filter(|p| p.nvml.samples > 0)
            .map(|p| p.nvml.peak_bytes)
            .max()
    }

    fn last_kind(&self) -> Option<MarkerKind> {
        self.phases.last().map(|p| p.phase.opened_by())
    }
}

/// Whether `next` may follow `prev` within one step.
fn may_follow(prev: MarkerKind, next: MarkerKind) -> bool {
    use MarkerKind::*;
    match next {
        StepBegin => false,
        // An OOM can happen anywhere.
        Oom => true,
        ForwardBegin => matches!(prev, StepBegin | ForwardBegin | BackwardBegin),
        BackwardBegin => matches!(prev, ForwardBegin),
        // Several optimizers (GANs) may run back to back.
        OptimizerBegin => matches!(
            prev,
            StepBegin | ForwardBegin | BackwardBegin | OptimizerEnd
        ),
        OptimizerEnd => matches!(prev, OptimizerBegin),
        StepEnd => !matches!(prev, OptimizerBegin),
        // Checked apart (`check_pass`): never within a step.
        EvalBegin | EvalEnd | CheckpointBegin | CheckpointEnd => false,
    }
}

/// A rank's bounded step history. Step 1 (the first step seen) is always
/// kept, because the first-step analysis compares everything against it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankTimeline {
    steps: VecDeque<StepRecord>,
    #[serde(skip)]
    max_retained_steps: usize,
    /// Phases in the retained steps, for [`RankTimeline::approx_bytes`];
    /// recomputed after a restore.
    #[serde(skip)]
    phases_retained: usize,
    last_monotonic_ns: u64,
    steps_completed: u64,
    ooms: u64,
    /// The latest evaluation passes and checkpoint saves, oldest first.
    #[serde(default)]
    passes: VecDeque<PassRecord>,
    /// Passes begun, per [`PassKind::ALL`] kind.
    #[serde(default)]
    passes_begun: [u64; 2],
    /// Moves on every change to the retained steps ([`RankTimeline::revision`]).
    #[serde(skip)]
    revision: u64,
}

impl RankTimeline {
    /// A copy holding step 1 and the latest `keep_last` steps (what the
    /// journal stores, to bound its size), with counters unchanged.
    pub fn trimmed(&self, keep_last: usize) -> Self {
        let later = self.steps.len().saturating_sub(1);
        let mut trimmed = Self {
            steps: self
                .steps
                .iter()
                .take(1)
                .chain(self.steps.iter().skip(1 + later.saturating_sub(keep_last)))
                .cloned()
                .collect(),
            max_retained_steps: self.max_retained_steps,
            phases_retained: 0,
            last_monotonic_ns: self.last_monotonic_ns,
            steps_completed: self.steps_completed,
            ooms: self.ooms,
            passes: self.passes.clone(),
            passes_begun: self.passes_begun,
            revision: 0,
        };
        trimmed.count_phases();
        trimmed
    }

    /// Re-applies the retention bound after a restore (it is not journaled).
    pub(crate) fn set_max_retained_steps(&mut self, max_retained_steps: usize) {
        self.max_retained_steps = max_retained_steps.max(2);
        self.revision += 1;
        while self.steps.len() > self.max_retained_steps {
            self.steps.remove(1);
        }
        self.count_phases();
    }

    fn count_phases(&mut self) {
        self.phases_retained = self.steps.iter().map(|s| s.phases.len()).sum();
    }

    /// An empty timeline that keeps at most `max_retained_steps` steps.
    pub fn new(max_retained_steps: usize) -> Self {
        Self {
            steps: VecDeque::new(),
            max_retained_steps: max_retained_steps.max(2),
            phases_retained: 0,
            last_monotonic_ns: 0,
            steps_completed: 0,
            ooms: 0,
            passes: VecDeque::new(),
            passes_begun: [0; 2],
            revision: 0,
        }
    }

    /// A number that changes whenever the retained steps may have changed
    /// (markers, credited samples, trimming): what a cache of figures
    /// derived from the steps is keyed on.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// What the retained steps hold in memory, approximately: their records
    /// and phase records (closed steps' phase lists are shrunk to fit). The
    /// figure the tracker's memory budget is enforced on.
    pub fn approx_bytes(&self) -> u64 {
        approx_bytes(self.steps.len(), self.phases_retained)
            + (self.passes.len() * std::mem::size_of::<PassRecord>()) as u64
    }

    /// Drops the oldest step after step 1, unless only step 1 and the
    /// latest step are left (what the analysis cannot do without). Returns
    /// whether a step was dropped.
    pub fn trim_oldest(&mut self) -> bool {
        if self.steps.len() <= 2 {
            return false;
        }
        self.remove_step(1);
        self.revision += 1;
        true
    }

    fn remove_step(&mut self, index: usize) {
        if let Some(step) = self.steps.remove(index) {
            self.phases_retained -= step.phases.len();
        }
    }

    /// Applies a batch of markers, all or nothing: the first invalid marker
    /// rejects the batch and leaves the timeline unchanged.
    pub fn apply_batch(&mut self, markers: &[Marker]) -> Result<(), MarkerError> {
        self.check_batch(markers)?;
        self.revision += 1;
        for m in markers {
            self.apply_unchecked(m);
        }
        Ok(())
    }

    /// Checks a batch without applying it: Ok means `apply_batch` would
    /// accept it, in whole or split in order.
    pub fn check_batch(&self, markers: &[Marker]) -> Result<(), MarkerError> {
        let mut cursor = self.cursor();
        for m in markers {
            cursor.check_and_advance(m)?;
        }
        Ok(())
    }

    /// Steps retained, oldest first.
    pub fn steps(
        &self,
    ) -> impl DoubleEndedIterator<Item = &StepRecord> + ExactSizeIterator + Clone {
        self.steps.iter()
    }

    /// Mutable access for sample attribution.
    pub(crate) fn steps_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut StepRecord> {
        self.revision += 1;
        self.steps.iter_mut()
    }

    /// Number of steps that reached their step end.
    pub fn steps_completed(&self) -> u64 {
        self.steps_completed
    }

    /// Number of OOM markers seen.
    pub fn ooms(&self) -> u64 {
        self.ooms
    }

    /// The latest evaluation passes and checkpoint saves (at most
    /// [`MAX_RETAINED_PASSES`]), oldest first.
    pub fn passes(
        &self,
    ) -> impl DoubleEndedIterator<Item = &PassRecord> + ExactSizeIterator + Clone {
        self.passes.iter()
    }

    /// Mutable access for sample attribution.
    pub(crate) fn passes_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut PassRecord> {
        self.revision += 1;
        self.passes.iter_mut()
    }

    /// Passes of `kind` begun so far (retained or not).
    pub fn passes_begun(&self, kind: PassKind) -> u64 {
        self.passes_begun[kind as usize]
    }

    /// The latest step, open or not.
    pub fn current(&self) -> Option<&StepRecord> {
        self.steps.back()
    }

    /// The latest step that completed.
    pub fn last_completed(&self) -> Option<&StepRecord> {
        self.steps
            .iter()
            .rev()
            .find(|s| s.outcome == StepOutcome::Completed)
    }

    /// Device memory outside the allocator at step 1's first marker with
    /// the driver's figures (device used − reserved): the CUDA context and
    /// other libraries' memory, as the client saw it.
    pub fn outside_allocator_at_step1(&self) -> Option<u64> {
        let first = self.steps.front().filter(|s| s.step == 1)?;
        first.phases.iter().find_map(|p| {
            let d = p.device_at_start?;
            let a = p.allocator_at_start?;
            Some(d.used_bytes().saturating_sub(a.reserved_bytes))
        })
    }

    /// Timestamp of the latest marker.
    pub fn last_monotonic_ns(&self) -> u64 {
        self.last_monotonic_ns
    }

    fn cursor(&self) -> Cursor {
        let current = self.steps.back();
        Cursor {
            last_step: current.map_or(0, |s| s.step),
            open_kind: current
                .filter(|s| s.outcome == StepOutcome::Running)
                .and_then(|s| s.last_kind().or(Some(MarkerKind::StepBegin))),
            phases: current.map_or(0, |s| s.phases.len()),
            last_ns: self.last_monotonic_ns,
            open_pass: self
                .passes
                .back()
                .filter(|p| p.outcome == PassOutcome::Running)
                .map(|p| p.kind),
        }
    }

    /// Ends the open pass, if any, at marker `m`.
    fn close_open_pass(&mut self, m: &Marker, outcome: PassOutcome, figures: bool) {
        if let Some(open) = self
            .passes
            .back_mut()
            .filter(|p| p.outcome == PassOutcome::Running)
        {
            open.end_monotonic_ns = Some(m.monotonic_ns);
            open.outcome = outcome;
            open.allocator_at_end = m.allocator.filter(|_| figures);
        }
    }

    fn apply_pass_marker(&mut self, m: &Marker, kind: PassKind, begins: bool) {
        self.close_open_pass(m, PassOutcome::Completed, true);
        if !begins {
            return;
        }
        self.passes_begun[kind as usize] += 1;
        self.passes.push_back(PassRecord {
            kind,
            after_step: m.step,
            begin_monotonic_ns: m.monotonic_ns,
            begin_wall_ns: m.wall_ns,
            end_monotonic_ns: None,
            outcome: PassOutcome::Running,
            allocator_at_start: m.allocator,
            allocator_at_end: None,
            nvml: SampleStats::default(),
            credited: false,
        });
        if self.passes.len() > MAX_RETAINED_PASSES {
            self.passes.pop_front();
        }
    }

    fn apply_unchecked(&mut self, m: &Marker) {
        self.last_monotonic_ns = m.monotonic_ns;
        if let Some((kind, begins)) = m.kind.pass() {
            self.apply_pass_marker(m, kind, begins);
            return;
        }
        let pass_open = self
            .passes
            .back()
            .is_some_and(|p| p.outcome == PassOutcome::Running);
        let step_open = self
            .steps
            .back()
            .is_some_and(|s| s.outcome == StepOutcome::Running);
        let last_step = self.steps.back().map_or(0, |s| s.step);
        if m.kind == MarkerKind::Oom && pass_open && !step_open && m.step == last_step {
            // The pass died: it is what ran out of memory.
            self.close_open_pass(m, PassOutcome::Oom, true);
            self.ooms += 1;
            return;
        }
        // The next step ends a pass its client did not end.
        self.close_open_pass(m, PassOutcome::Completed, false);
        let opens_new_step = self.steps.back().is_none_or(|s| m.step > s.step);
        if opens_new_step {
            if let Some(prev) = self.steps.back_mut() {
                if prev.outcome == StepOutcome::Running {
                    close_open_phase(prev, m);
                    prev.outcome = StepOutcome::Abandoned;
                    prev.phases.shrink_to_fit();
                }
            }
            self.steps.push_back(StepRecord {
                step: m.step,
                begin_monotonic_ns: m.monotonic_ns,
                begin_wall_ns: m.wall_ns,
                end_monotonic_ns: None,
                end_wall_ns: None,
                outcome: StepOutcome::Running,
                phases: Vec::new(),
                nvml_before_begin: None,
                device_at_end: None,
                batch: None,
            });
            // Keep the first step; drop the oldest after it.
            if self.steps.len() > self.max_retained_steps {
                self.remove_step(1);
            }
        }
        let step = self.steps.back_mut().expect("a step is open");
        close_open_phase(step, m);
        if let Some(batch) = m.batch.as_ref().filter(|b| !b.is_empty()) {
            let larger = step
                .batch
                .as_ref()
                .is_none_or(|kept| batch.size().larger_than(&kept.size()));
            if larger {
                step.batch = Some(batch.clone());
            }
        }
        match m.kind {
            MarkerKind::StepEnd | MarkerKind::Oom => {
                step.end_monotonic_ns = Some(m.monotonic_ns);
                step.end_wall_ns = Some(m.wall_ns);
                step.device_at_end = m.device_memory;
                step.phases.shrink_to_fit();
                if m.kind == MarkerKind::Oom {
                    step.outcome = StepOutcome::Oom;
                    self.ooms += 1;
                } else {
                    step.outcome = StepOutcome::Completed;
                    self.steps_completed += 1;
                }
            }
            kind => {
                let phase = kind.opens().expect("non-terminal markers open a phase");
                self.phases_retained += 1;
                step.phases.push(PhaseRecord {
                    phase,
                    micro_batch: m.micro_batch,
                    start_monotonic_ns: m.monotonic_ns,
                    end_monotonic_ns: None,
                    allocator_at_start: m.allocator,
                    allocator_at_end: None,
                    device_at_start: m.device_memory,
                    nvml: SampleStats::default(),
                    nvml_edges: SampleEdges::default(),
                    credited: false,
                });
            }
        }
    }
}

fn close_open_phase(step: &mut StepRecord, m: &Marker) {
    if let Some(open) = step
        .phases
        .last_mut()
        .filter(|p| p.end_monotonic_ns.is_none())
    {
        open.end_monotonic_ns = Some(m.monotonic_ns);
        open.allocator_at_end = m.allocator;
    }
}

/// The few facts needed to validate the next marker, so a batch can be
/// checked completely before anything changes.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    last_step: u64,
    /// Kind of the marker that opened the current phase; None when no step is open.
    open_kind: Option<MarkerKind>,
    phases: usize,
    last_ns: u64,
    /// The pass that is running, if any.
    open_pass: Option<PassKind>,
}

impl Cursor {
    fn check_and_advance(&mut self, m: &Marker) -> Result<(), MarkerError> {
        let implausible = |field, value, limit| MarkerError::Implausible {
            field,
            value,
            limit,
        };
        if m.step > MAX_PLAUSIBLE_STEP {
            return Err(implausible("step", m.step, MAX_PLAUSIBLE_STEP));
        }
        if m.monotonic_ns > MAX_PLAUSIBLE_MONOTONIC_NS {
            return Err(implausible(
                "monotonic_ns",
                m.monotonic_ns,
                MAX_PLAUSIBLE_MONOTONIC_NS,
            ));
        }
        if let Some((field, value)) = m.allocator.and_then(|a| a.implausible()) {
            return Err(implausible(field, value, MAX_PLAUSIBLE_BYTES));
        }
        if let Some((field, value, limit)) = m.device_memory.and_then(|d| d.implausible()) {
            return Err(implausible(field, value, limit));
        }
        if let Some((field, value, limit)) = m.batch.as_ref().and_then(|b| b.implausible()) {
            return Err(implausible(field, value, limit));
        }
        let clock = MarkerError::ClockRegressed {
            last: self.last_ns,
            got: m.monotonic_ns,
        };
        if let Some((kind, begins)) = m.kind.pass() {
            if m.monotonic_ns < self.last_ns {
                return Err(clock);
            }
            return self.check_pass(m, kind, begins);
        }
        if m.kind == MarkerKind::Oom
            && self.open_pass.is_some()
            && self.open_kind.is_none()
            && m.step == self.last_step
            && m.monotonic_ns >= self.last_ns
        {
            // An OOM in the running pass ends it.
            self.open_pass = None;
            self.last_ns = m.monotonic_ns;
            return Ok(());
        }
        if m.step == 0 {
            return Err(MarkerError::StepZero);
        }
        // A step that has ended cannot be reopened.
        if m.step < self.last_step || (m.step == self.last_step && self.open_kind.is_none()) {
            return Err(MarkerError::StepRegressed {
                last: self.last_step,
                got: m.step,
            });
        }
        if m.monotonic_ns < self.last_ns {
            return Err(clock);
        }
        if m.step > self.last_step {
            // A new step. StepBegin is expected; any other kind opens the step
            // implicitly, because a client that dropped markers under load
            // must not be locked out until the next step.
            if m.kind == MarkerKind::StepEnd && self.last_step == 0 {
                return Err(MarkerError::NoOpenStep {
                    kind: kind_name(m.kind),
                    step: m.step,
                });
            }
            self.last_step = m.step;
            self.phases = 0;
        } else {
            let prev = self.open_kind.expect("checked above: the step is open");
            if !may_follow(prev, m.kind) {
                return Err(MarkerError::OutOfOrder {
                    kind: kind_name(m.kind),
                    after: kind_name(prev),
                });
            }
        }
        if m.kind.opens().is_some() {
            if self.phases >= MAX_PHASES_PER_STEP {
                return Err(MarkerError::TooManyPhases {
                    step: m.step,
                    limit: MAX_PHASES_PER_STEP,
                });
            }
            self.phases += 1;
            self.open_kind = Some(m.kind);
        } else {
            self.open_kind = None;
        }
        self.open_pass = None;
        self.last_ns = m.monotonic_ns;
        Ok(())
    }

    /// An evaluation or checkpoint marker: between steps, naming the last
    /// step begun; an end only for the pass of its kind that runs.
    fn check_pass(&mut self, m: &Marker, kind: PassKind, begins: bool) -> Result<(), MarkerError> {
        let misplaced = |why| MarkerError::PassMisplaced {
            kind: kind_name(m.kind),
            step: m.step,
            why,
        };
        if self.open_kind.is_some() {
            return Err(misplaced(
                "a training step is open; a pass runs between steps",
            ));
        }
        if m.step != self.last_step {
            return Err(misplaced(
                "a pass names the last training step begun (0 before the first)",
            ));
        }
        if begins {
            self.open_pass = Some(kind);
        } else if self.open_pass == Some(kind) {
            self.open_pass = None;
        } else {
            return Err(misplaced("no pass of this kind is running"));
        }
        self.last_ns = m.monotonic_ns;
        Ok(())
    }
}
