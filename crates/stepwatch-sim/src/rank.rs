//! The step-by-step memory model of one rank.

use std::collections::{BTreeMap, VecDeque};

use stepwatch_core::{
    AllocatorAction, AllocatorEvent, AllocatorStats, AllocatorTrace, BatchFacts, Marker,
    MarkerKind, ModelFacts, OptimizerImplementation, OptimizerKind, PhaseKind, Precision, RankInfo,
};

use crate::allocator::{AllocId, CachingAllocator, OutOfMemory, Usage};
use crate::scenario::{Scenario, ScenarioError, SimOptimizer, SimPrecision};

/// One thing a simulated rank does, at a simulated time.
#[derive(Debug, Clone, PartialEq)]
pub enum SimEvent {
    /// A phase marker, as the client would send it, with allocator figures.
    Marker(Marker),
    /// The rank's memory after one modelled event (a layer's forward, …).
    Memory {
        /// Simulated CLOCK_MONOTONIC ns of the event.
        at_ns: u64,
        /// What NVML shows for this process: reserved + CUDA context + workspaces.
        nvml_used_bytes: u64,
        /// Allocator allocated bytes after the event.
        allocated: u64,
        /// Allocator reserved bytes after the event.
        reserved: u64,
    },
    /// Step 1's allocator history, right after step 1's optimizer-end
    /// marker, as the Python client records and sends it (see
    /// `stepwatch_core::replay`). Only when [`RankSim::set_allocator_trace`]
    /// left it on.
    AllocatorTrace {
        /// Simulated CLOCK_MONOTONIC ns (that of the marker).
        at_ns: u64,
        /// The trace.
        trace: Box<AllocatorTrace>,
    },
}

impl SimEvent {
    /// Simulated monotonic time of the event.
    pub fn at_ns(&self) -> u64 {
        match self {
            SimEvent::Marker(m) => m.monotonic_ns,
            SimEvent::Memory { at_ns, .. } | SimEvent::AllocatorTrace { at_ns, .. } => *at_ns,
        }
    }

    /// The marker, if this event is one; what a client would send.
    pub fn as_marker(&self) -> Option<&Marker> {
        match self {
            SimEvent::Marker(m) => Some(m),
            SimEvent::Memory { .. } | SimEvent::AllocatorTrace { .. } => None,
        }
    }
}

/// How the allocator peaks carried by markers are measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PeakMode {
    /// Peaks are reset after every marker (`torch.cuda.reset_peak_memory_stats`),
    /// so a marker's peaks are those of the phase it closes. No shipped
    /// client sends these: kept to check that the step model reads both.
    PerPhase,
    /// Peaks since the process started, as `memory_stats()` reports by
    /// default and the Python client sends them (it never resets them).
    #[default]
    SinceStart,
}

/// How a rank's run ended, or that it has not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimOutcome {
    /// Still has steps to run.
    Running,
    /// Ran every step of the scenario.
    Completed {
        /// Steps completed.
        steps: u64,
    },
    /// Died like a CUDA OOM. `phase` is None during initialisation.
    Oom {
        /// The step that ran out; 1 when it died during initialisation.
        step: u64,
        /// The phase it ran out in; None during initialisation.
        phase: Option<PhaseKind>,
        /// Size of the request that failed, bytes.
        requested_bytes: u64,
    },
}

/// Peaks of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStats {
    /// Step number, from 1.
    pub step: u64,
    /// Highest allocated bytes during the step.
    pub allocated_peak: u64,
    /// Highest reserved bytes during the step.
    pub reserved_peak: u64,
    /// Highest NVML-visible use of this process during the step.
    pub nvml_peak: u64,
    /// False when the step died of OOM; its peaks are then partial.
    pub completed: bool,
}

/// What a rank did, for tests and the accuracy benchmark.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    /// Rank within the scenario.
    pub rank: u32,
    /// How the run ended; compared with the scenario's expectation.
    pub outcome: SimOutcome,
    /// Peaks of every step run, in order.
    pub steps: Vec<StepStats>,
    /// Allocator usage when step 1 began (weights, master weights, and
    /// pre-created state).
    pub at_step1_begin: Usage,
    /// Highest NVML-visible use of this process.
    pub peak_nvml_bytes: u64,
    /// Highest use of the whole GPU: this process plus other processes.
    pub peak_gpu_used_bytes: u64,
    /// GPU capacity from the scenario, bytes.
    pub capacity_bytes: u64,
    /// Times the allocator released its cache to retry a failed `cudaMalloc`.
    pub num_alloc_retries: u64,
}

impl RankReport {
    /// `1 − peak_gpu_used/capacity`.
    pub fn headroom_fraction(&self) -> f64 {
        1.0 - self.peak_gpu_used_bytes as f64 / self.capacity_bytes as f64
    }

    /// The stats of step `step`, if it ran.
    pub fn step(&self, step: u64) -> Option<&StepStats> {
        self.steps.iter().find(|s| s.step == step)
    }
}

/// Names of the tensors the model tracks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Weight(u32),
    Master(u32),
    Grad(u32),
    State(u32, u8),
    GradF32(u32),
    OptTemp(u32),
    Input(u32),
    Act(u32, u32, u8),
    Logits(u32),
    Temp,
}

#[derive(Debug, Clone, Copy)]
enum Action {
    Alloc(Key, u64),
    Free(Key),
}

#[derive(Debug, Clone)]
enum Op {
    Marker(MarkerKind, u32),
    Work { dur_ns: u64, actions: Vec<Action> },
}

/// Static sizes derived from the scenario.
#[derive(Debug, Clone)]
struct Layout {
    /// Elements of each parameter tensor.
    tensors: Vec<u64>,
    /// Group 0 is the embedding (possibly empty), groups 1..=L the layers.
    groups: Vec<Vec<u32>>,
    weight_bytes: u64,
    master_bytes: u64,
    state_elem_bytes: u64,
    n_states: u8,
    shard: u64,
    /// Activation bytes of one layer for one micro-batch, per tensor.
    layer_acts: Vec<u64>,
    fwd_temp: u64,
    bwd_temp: u64,
    input_bytes: u64,
    logits_bytes: u64,
}

impl Layout {
    fn new(s: &Scenario, rank: u32) -> Layout {
        let m = &s.model;
        let (l, h) = (u64::from(m.layers), m.hidden);
        let fixed = l * 2 * h + m.vocab * h;
        let matrices = s.parameter_count() - fixed;
        let mut tensors = Vec::new();
        let mut groups = vec![Vec::new()];
        if m.vocab > 0 {
            groups[0].push(0);
            tensors.push(m.vocab * h);
        }
        let per_layer = matrices / l;
        for layer in 0..l {
            let mut this = per_layer;
            if layer == l - 1 {
                this += matrices % l;
            }
            // qkv, attention out, mlp in, mlp out: 3:1:4:4, plus two norms.
            let parts = [3 * this / 12, this / 12, 4 * this / 12];
            let last = this - parts.iter().sum::<u64>();
            let mut group = Vec::new();
            for e in [h, parts[0], parts[1], h, parts[2], last] {
                group.push(tensors.len() as u32);
                tensors.push(e);
            }
            groups.push(group);
        }
        let t = &s.training;
        let (weight_bytes, master_bytes, act_factor) = match t.precision {
            SimPrecision::Fp32 => (4, 0, 2.0),
            SimPrecision::MixedBf16 => (2, 4, 1.0),
            SimPrecision::Bf16 => (2, 0, 1.0),
        };
        let state_elem_bytes = if master_bytes > 0 {
            master_bytes
        } else {
            weight_bytes
        };
        let n_states = match t.optimizer {
            SimOptimizer::Adam => 2,
            SimOptimizer::SgdMomentum => 1,
            SimOptimizer::Sgd => 0,
        };
        // Korthikanti et al.: per layer s·b·h·(34 + 5·a·s/h) bytes with 16-bit
        // activations, split into plausible tensors.
        let skew = s.memory_skew(rank);
        let sbh = (m.seq_len * m.micro_batch * h) as f64;
        let scale = |x: f64| (x * act_factor * skew).round() as u64;
        let mut layer_acts: Vec<u64> = [2.0, 2.0, 6.0, 8.0, 8.0, 8.0]
            .iter()
            .map(|k| scale(k * sbh))
            .collect();
        if !m.flash_attention {
            let ass_b = (m.heads * m.seq_len * m.seq_len * m.micro_batch) as f64;
            layer_acts.push(scale(4.0 * ass_b));
            layer_acts.push(scale(ass_b));
        }
        let sb = m.seq_len * m.micro_batch;
        Layout {
            tensors,
            groups,
            weight_bytes,
            master_bytes,
            state_elem_bytes,
            n_states,
            shard: u64::from(t.sharding_factor),
            layer_acts,
            fwd_temp: scale(8.0 * sbh),
            bwd_temp: scale(12.0 * sbh),
            input_bytes: 16 * sb,
            logits_bytes: ((m.vocab * sb * 4) as f64 * skew).round() as u64,
        }
    }

    fn sharded(&self, elems: u64) -> u64 {
        elems.div_ceil(self.shard)
    }
}

/// Splits `total_ns` over `ops`' work items in order.
fn spread(total_ns: u64, works: Vec<Vec<Action>>) -> Vec<Op> {
    let n = works.len() as u64;
    works
        .into_iter()
        .enumerate()
        .map(|(i, actions)| {
            let i = i as u64;
            Op::Work {
                dur_ns: total_ns * (i + 1) / n - total_ns * i / n,
                actions,
            }
        })
        .collect()
}

fn ms_to_ns(ms: f64, skew: f64) -> u64 {
    (ms * skew * 1e6).round() as u64
}

/// One rank of a simulated job: a pure, deterministic event source.
///
/// Iterate it (or call [`RankSim::next_event`]) to get its [`SimEvent`]s in
/// time order. It starts with the CUDA context alone, loads the model,
/// then runs the scenario's steps until they are done or memory runs out.
#[derive(Debug, Clone)]
pub struct RankSim {
    scenario: Scenario,
    rank: u32,
    layout: Layout,
    alloc: CachingAllocator,
    live: BTreeMap<Key, AllocId>,
    ops: VecDeque<Op>,
    out: VecDeque<SimEvent>,
    peak_mode: PeakMode,
    start_ns: u64,
    start_wall_ns: u64,
    now_ns: u64,
    started: bool,
    finished: bool,
    /// Step whose ops are queued (0 before step 1).
    step: u64,
    phase: Option<PhaseKind>,
    grads_exist: bool,
    state_exists: bool,
    other_bytes: u64,
    last_nvml: u64,
    report: RankReport,
    step_nvml_peak: u64,
    /// Whether to record and emit step 1's allocator trace.
    trace_enabled: bool,
    /// Step 1's allocator events so far.
    trace_events: Vec<AllocatorEvent>,
}

impl RankSim {
    /// A rank of `scenario` whose simulated clock starts at 0 (plus the
    /// scenario's start offset).
    pub fn new(scenario: &Scenario, rank: u32) -> Result<Self, ScenarioError> {
        scenario.validate()?;
        if rank >= scenario.ranks.count {
            return Err(ScenarioError::NoSuchRank {
                name: scenario.name.clone(),
                rank,
                count: scenario.ranks.count,
            });
        }
        let layout = Layout::new(scenario, rank);
        let mut sim = RankSim {
            scenario: scenario.clone(),
            rank,
            layout,
            alloc: CachingAllocator::new(),
            live: BTreeMap::new(),
            ops: VecDeque::new(),
            out: VecDeque::new(),
            peak_mode: PeakMode::default(),
            start_ns: 0,
            start_wall_ns: 0,
            now_ns: 0,
            started: false,
            finished: false,
            step: 0,
            phase: None,
            grads_exist: false,
            state_exists: false,
            other_bytes: scenario.gpu.other_process_bytes,
            last_nvml: 0,
            report: RankReport {
                rank,
                outcome: SimOutcome::Running,
                steps: Vec::new(),
                at_step1_begin: Usage::default(),
                peak_nvml_bytes: 0,
                peak_gpu_used_bytes: 0,
                capacity_bytes: scenario.gpu.capacity_bytes,
                num_alloc_retries: 0,
            },
            step_nvml_peak: 0,
            trace_enabled: true,
            trace_events: Vec::new(),
        };
        sim.set_start(0, 0);
        sim.queue_init();
        Ok(sim)
    }

    /// Sets the simulated clocks: the run begins at `monotonic_ns` (plus the
    /// scenario's `start_offset_ms`), and marker wall times are derived from
    /// `wall_ns` at the same instant. Only effective before the first event.
    pub fn set_start(&mut self, monotonic_ns: u64, wall_ns: u64) {
        if self.started {
            return;
        }
        let offset = ms_to_ns(self.scenario.start_offset_ms, 1.0);
        self.start_ns = monotonic_ns + offset;
        self.start_wall_ns = wall_ns + offset;
        self.now_ns = self.start_ns;
    }

    /// Builder form of [`RankSim::set_start`].
    pub fn with_start(mut self, monotonic_ns: u64, wall_ns: u64) -> Self {
        self.set_start(monotonic_ns, wall_ns);
        self
    }

    /// Chooses how marker peaks are measured (default
    /// [`PeakMode::SinceStart`], as the Python client sends them).
    pub fn set_peak_mode(&mut self, mode: PeakMode) {
        self.peak_mode = mode;
    }

    /// Memory other processes hold on this GPU from now on (replaces the
    /// scenario's `other_process_bytes`).
    pub fn set_other_process_bytes(&mut self, bytes: u64) {
        self.other_bytes = bytes;
    }

    /// The scenario this rank belongs to.
    pub fn scenario(&self) -> &Scenario {
        &self.scenario
    }

    /// The rank this simulator plays.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Simulated time of the latest event (the start before any).
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// True once the last event has been returned.
    pub fn is_finished(&self) -> bool {
        self.finished && self.out.is_empty()
    }

    /// NVML-visible use of this process as of the latest event; 0 before
    /// it starts and after it has exited.
    pub fn nvml_used_bytes(&self) -> u64 {
        if self.is_finished() {
            0
        } else {
            self.last_nvml
        }
    }

    /// What the rank did so far.
    pub fn report(&self) -> &RankReport {
        &self.report
    }

    /// The hello this rank sends as job `job` from process `pid` on GPU
    /// `gpu_uuid`: `stepwatch sim` puts it on the wire, and the accuracy
    /// harness hands it to the tracker as the agent reads it from there.
    pub fn rank_info(&self, job: &str, gpu_uuid: &str, pid: u32) -> RankInfo {
        RankInfo {
            job: job.to_owned(),
            rank: self.rank,
            local_rank: self.rank,
            world_size: self.scenario.ranks.count,
            node_name: "sim".into(),
            gpu_uuid: gpu_uuid.to_owned(),
            pid,
            framework: "stepwatch-sim".into(),
            framework_version: env!("CARGO_PKG_VERSION").into(),
            model: self.model_facts(),
            ..RankInfo::default()
        }
    }

    /// The model facts a client would send in its hello.
    pub fn model_facts(&self) -> ModelFacts {
        let t = &self.scenario.training;
        let l = &self.layout;
        ModelFacts {
            parameter_count: Some(self.scenario.parameter_count()),
            parameter_bytes: Some(self.scenario.parameter_count() * l.weight_bytes),
            optimizer: match t.optimizer {
                SimOptimizer::Adam => OptimizerKind::Adam,
                SimOptimizer::SgdMomentum => OptimizerKind::SgdMomentum,
                SimOptimizer::Sgd => OptimizerKind::Sgd,
            },
            state_bytes_per_parameter: Some(u32::from(l.n_states) * l.state_elem_bytes as u32),
            precision: match t.precision {
                SimPrecision::Fp32 => Precision::Fp32,
                SimPrecision::MixedBf16 => Precision::MixedBf16,
                SimPrecision::Bf16 => Precision::Bf16,
            },
            sharding_factor: Some(t.sharding_factor),
            grad_accumulation_steps: Some(t.grad_accumulation_steps),
            state_precreated: Some(t.state_precreated),
            grads_set_to_none: Some(t.grads_set_to_none),
            micro_batch_size: u32::try_from(self.scenario.model.micro_batch).ok(),
            optimizer_implementation: if t.foreach {
                OptimizerImplementation::Foreach
            } else {
                OptimizerImplementation::ForLoop
            },
            // The simulated jobs have no DDP buckets.
            ddp_bucket_rebuild: None,
            largest_batch: None,
        }
    }

    /// Whether the rank records step 1's allocator history and emits it as a
    /// [`SimEvent::AllocatorTrace`] (on by default, as in the Python client);
    /// off, it is a client without tracing. Set before the first event.
    pub fn set_allocator_trace(&mut self, enabled: bool) {
        self.trace_enabled = enabled;
    }

    /// The rank's caching allocator, as of the last event returned.
    pub fn allocator(&self) -> &CachingAllocator {
        &self.alloc
    }

    /// Bytes NVML shows for this process beyond the allocator's reserved memory.
    pub fn overhead_bytes(&self) -> u64 {
        self.scenario.gpu.cuda_context_bytes + self.scenario.gpu.workspace_bytes
    }

    /// The next event, or None when the rank has finished.
    pub fn next_event(&mut self) -> Option<SimEvent> {
        loop {
            if let Some(e) = self.out.pop_front() {
                return Some(e);
            }
            if self.finished {
                return None;
            }
            if !self.started {
                self.started = true;
                self.emit_memory();
                continue;
            }
            match self.ops.pop_front() {
                Some(op) => self.execute(op),
                None if self.step < self.scenario.training.steps => self.queue_step(),
                None => {
                    self.finished = true;
                    self.report.outcome = SimOutcome::Completed { steps: self.step };
                }
            }
        }
    }

    /// Runs to the end and returns every remaining event.
    pub fn run_to_end(&mut self) -> Vec<SimEvent> {
        self.by_ref().collect()
    }

    fn limit(&self) -> u64 {
        self.scenario
            .gpu
            .capacity_bytes
            .saturating_sub(self.overhead_bytes())
            .saturating_sub(self.other_bytes)
    }

    fn execute(&mut self, op: Op) {
        match op {
            Op::Marker(kind, micro_batch) => {
                if kind == MarkerKind::StepBegin {
                    self.alloc.reset_step_peak();
                    self.step_nvml_peak = self.last_nvml;
                    if self.step == 1 {
                        self.report.at_step1_begin = self.alloc.usage();
                    }
                }
                self.phase = kind.opens();
                self.emit_marker(kind, micro_batch);
                if kind == MarkerKind::OptimizerEnd && self.step == 1 && self.trace_enabled {
                    let trace = AllocatorTrace {
                        step: 1,
                        segments: self.alloc.layout(),
                        events: std::mem::take(&mut self.trace_events),
                        settings: None,
                        forward_returns: Vec::new(),
                        // The simulator's allocator follows the default rules.
                        torch_version: String::new(),
                    };
                    self.out.push_back(SimEvent::AllocatorTrace {
                        at_ns: self.now_ns,
                        trace: Box::new(trace),
                    });
                }
                if kind == MarkerKind::StepEnd {
                    self.close_step(true);
                }
            }
            Op::Work { dur_ns, actions } => {
                self.now_ns += dur_ns;
                for a in actions {
                    match a {
                        Action::Alloc(key, bytes) => {
                            if bytes == 0 {
                                continue;
                            }
                            if let Some(old) = self.live.remove(&key) {
                                self.trace(AllocatorAction::Free, old, 0);
                                self.alloc.free(old);
                            }
                            match self.alloc.malloc(bytes, self.limit()) {
                                Ok(id) => {
                                    self.trace(AllocatorAction::Alloc, id, bytes);
                                    self.live.insert(key, id);
                                }
                                Err(oom) => return self.die(oom),
                            }
                        }
                        Action::Free(key) => {
                            if let Some(id) = self.live.remove(&key) {
                                self.trace(AllocatorAction::Free, id, 0);
                                self.alloc.free(id);
                            }
                        }
                    }
                }
                self.emit_memory();
            }
        }
    }

    /// Records an allocator event of step 1 (`requested` 0: the block's size).
    fn trace(&mut self, action: AllocatorAction, id: AllocId, requested: u64) {
        if !self.trace_enabled || self.step != 1 {
            return;
        }
        let (Some(phase), Some(address)) = (self.phase, self.alloc.address_of(id)) else {
            return;
        };
        let size = if requested > 0 {
            requested
        } else {
            self.alloc.block_size(id).unwrap_or(0)
        };
        self.trace_events.push(AllocatorEvent {
            action,
            address,
            size,
            phase,
            stream: 0,
        });
    }

    fn die(&mut self, oom: OutOfMemory) {
        self.emit_memory();
        let step = self.step.max(1);
        self.report.outcome = SimOutcome::Oom {
            step,
            phase: if self.step == 0 { None } else { self.phase },
            requested_bytes: oom.requested,
        };
        if self.step == 0 {
            self.step = 1;
        }
        self.emit_marker(MarkerKind::Oom, 0);
        self.close_step(false);
        self.ops.clear();
        self.finished = true;
    }

    fn close_step(&mut self, completed: bool) {
        let p = self.alloc.peaks().step;
        self.report.steps.push(StepStats {
            step: self.step,
            allocated_peak: p.allocated,
            reserved_peak: p.reserved,
            nvml_peak: self.step_nvml_peak,
            completed,
        });
    }

    fn stats(&self) -> AllocatorStats {
        let u = self.alloc.usage();
        let p = match self.peak_mode {
            PeakMode::PerPhase => self.alloc.peaks().phase,
            PeakMode::SinceStart => self.alloc.peaks().total,
        };
        AllocatorStats {
            allocated_bytes: u.allocated,
            allocated_peak_bytes: p.allocated,
            reserved_bytes: u.reserved,
            reserved_peak_bytes: p.reserved,
            active_bytes: u.allocated,
            active_peak_bytes: p.allocated,
            num_alloc_retries: self.alloc.num_alloc_retries(),
        }
    }

    fn emit_marker(&mut self, kind: MarkerKind, micro_batch: u32) {
        let wall_ns = self.start_wall_ns + (self.now_ns - self.start_ns);
        // No device memory: the simulator leaves the overhead to NVML's samples.
        // A forward says its batch, as the Python client's forward hooks do.
        let batch = (kind == MarkerKind::ForwardBegin).then(|| BatchFacts {
            samples: Some(self.scenario.model.micro_batch),
            ..BatchFacts::default()
        });
        let marker = Marker {
            micro_batch,
            allocator: Some(self.stats()),
            batch,
            ..Marker::at(kind, self.step, self.now_ns, wall_ns)
        };
        self.alloc.reset_phase_peak();
        self.out.push_back(SimEvent::Marker(marker));
    }

    fn emit_memory(&mut self) {
        let u = self.alloc.usage();
        let nvml = u.reserved + self.overhead_bytes();
        self.last_nvml = nvml;
        self.report.num_alloc_retries = self.alloc.num_alloc_retries();
        self.step_nvml_peak = self.step_nvml_peak.max(nvml);
        self.report.peak_nvml_bytes = self.report.peak_nvml_bytes.max(nvml);
        self.report.peak_gpu_used_bytes =
            self.report.peak_gpu_used_bytes.max(nvml + self.other_bytes);
        self.out.push_back(SimEvent::Memory {
            at_ns: self.now_ns,
            nvml_used_bytes: nvml,
            allocated: u.allocated,
            reserved: u.reserved,
        });
    }

    fn queue_init(&mut self) {
        let l = &self.layout;
        let t = &self.scenario.training;
        let mut works = Vec::new();
        for g in &l.groups {
            if g.is_empty() {
                continue;
            }
            works.push(
                g.iter()
                    .map(|&i| Action::Alloc(Key::Weight(i), l.tensors[i as usize] * l.weight_bytes))
                    .collect(),
            );
        }
        if l.master_bytes > 0 {
            for g in l.groups.iter().filter(|g| !g.is_empty()) {
                works.push(
                    g.iter()
                        .map(|&i| {
                            Action::Alloc(
                                Key::Master(i),
                                l.sharded(l.tensors[i as usize]) * l.master_bytes,
                            )
                        })
                        .collect(),
                );
            }
        }
        if t.state_precreated && l.n_states > 0 {
            for g in l.groups.iter().filter(|g| !g.is_empty()) {
                works.push(self.state_actions(g));
            }
            self.state_exists = true;
        }
        let total = ms_to_ns(
            self.scenario.timing.init_ms,
            self.scenario.time_skew(self.rank),
        );
        self.ops.extend(spread(total, works));
    }

    fn state_actions(&self, group: &[u32]) -> Vec<Action> {
        let l = &self.layout;
        group
            .iter()
            .flat_map(|&i| {
                (0..l.n_states).map(move |j| {
                    Action::Alloc(
                        Key::State(i, j),
                        l.sharded(l.tensors[i as usize]) * l.state_elem_bytes,
                    )
                })
            })
            .collect()
    }

    fn queue_step(&mut self) {
        self.step += 1;
        let sc = self.scenario.clone();
        let t = &sc.training;
        let tm = &sc.timing;
        let skew = sc.time_skew(self.rank);
        let l = self.layout.clone();
        let layers = sc.model.layers;
        let all_tensors = 0..l.tensors.len() as u32;

        self.ops.push_back(Op::Marker(MarkerKind::StepBegin, 0));
        // Prologue: zero_grad.
        let mut prologue = Vec::new();
        if t.grads_set_to_none && self.grads_exist {
            prologue.extend(all_tensors.clone().map(|i| Action::Free(Key::Grad(i))));
            self.grads_exist = false;
        }
        self.ops
            .extend(spread(ms_to_ns(tm.prologue_ms, skew), vec![prologue]));

        for mb in 0..t.grad_accumulation_steps {
            // Forward: activations rise layer by layer.
            self.ops.push_back(Op::Marker(MarkerKind::ForwardBegin, mb));
            let mut works = Vec::new();
            for layer in 0..layers {
                let mut w = Vec::new();
                if layer == 0 {
                    w.push(Action::Alloc(Key::Input(mb), l.input_bytes));
                }
                for (k, &bytes) in l.layer_acts.iter().enumerate() {
                    w.push(Action::Alloc(Key::Act(mb, layer, k as u8), bytes));
                }
                w.push(Action::Alloc(Key::Temp, l.fwd_temp));
                w.push(Action::Free(Key::Temp));
                works.push(w);
            }
            if l.logits_bytes > 0 {
                works.push(vec![Action::Alloc(Key::Logits(mb), l.logits_bytes)]);
            }
            self.ops
                .extend(spread(ms_to_ns(tm.forward_ms, skew), works));

            // Backward: activations freed in reverse while grads appear.
            self.ops
                .push_back(Op::Marker(MarkerKind::BackwardBegin, mb));
            let mut works = Vec::new();
            if l.logits_bytes > 0 {
                works.push(vec![
                    Action::Alloc(Key::Temp, l.logits_bytes),
                    Action::Free(Key::Logits(mb)),
                    Action::Free(Key::Temp),
                ]);
            }
            let grads = |group: &[u32], w: &mut Vec<Action>, exist: bool| {
                for &i in group {
                    let bytes = l.tensors[i as usize] * l.weight_bytes;
                    if exist {
                        // AccumulateGrad: the new grad, added in place.
                        w.push(Action::Alloc(Key::Temp, bytes));
                        w.push(Action::Free(Key::Temp));
                    } else {
                        w.push(Action::Alloc(Key::Grad(i), bytes));
                    }
                }
            };
            for layer in (0..layers).rev() {
                let mut w = Vec::new();
                grads(&l.groups[layer as usize + 1], &mut w, self.grads_exist);
                w.push(Action::Alloc(Key::Temp, l.bwd_temp));
                for k in 0..l.layer_acts.len() {
                    w.push(Action::Free(Key::Act(mb, layer, k as u8)));
                }
                w.push(Action::Free(Key::Temp));
                works.push(w);
            }
            let mut w = Vec::new();
            grads(&l.groups[0], &mut w, self.grads_exist);
            w.push(Action::Free(Key::Input(mb)));
            works.push(w);
            self.grads_exist = true;
            self.ops
                .extend(spread(ms_to_ns(tm.backward_ms, skew), works));
        }

        // Optimizer.
        self.ops
            .push_back(Op::Marker(MarkerKind::OptimizerBegin, 0));
        let mut works = Vec::new();
        if l.n_states > 0 && !self.state_exists {
            for g in l.groups.iter().filter(|g| !g.is_empty()) {
                works.push(self.state_actions(g));
            }
            self.state_exists = true;
        }
        if l.master_bytes > 0 {
            works.push(
                all_tensors
                    .clone()
                    .map(|i| Action::Alloc(Key::GradF32(i), l.sharded(l.tensors[i as usize]) * 4))
                    .collect(),
            );
        }
        match t.optimizer {
            SimOptimizer::Adam => {
                let temp = |i: u32| l.sharded(l.tensors[i as usize]) * l.state_elem_bytes;
                if t.foreach {
                    // _foreach_sqrt(exp_avg_sq) materialises one state-sized list.
                    works.push(
                        all_tensors
                            .clone()
                            .map(|i| Action::Alloc(Key::OptTemp(i), temp(i)))
                            .collect(),
                    );
                    works.push(
                        all_tensors
                            .clone()
                            .map(|i| Action::Free(Key::OptTemp(i)))
                            .collect(),
                    );
                } else {
                    works.push(
                        all_tensors
                            .clone()
                            .flat_map(|i| {
                                [
                                    Action::Alloc(Key::OptTemp(i), temp(i)),
                                    Action::Free(Key::OptTemp(i)),
                                ]
                            })
                            .collect(),
                    );
                }
            }
            // In place: buf.mul_(m).add_(g); p.add_(buf, alpha=-lr).
            SimOptimizer::SgdMomentum | SimOptimizer::Sgd => works.push(Vec::new()),
        }
        if l.master_bytes > 0 {
            works.push(
                all_tensors
                    .clone()
                    .map(|i| Action::Free(Key::GradF32(i)))
                    .collect(),
            );
        }
        self.ops
            .extend(spread(ms_to_ns(tm.optimizer_ms, skew), works));
        self.ops.push_back(Op::Marker(MarkerKind::OptimizerEnd, 0));
        self.ops
            .extend(spread(ms_to_ns(tm.epilogue_ms, skew), vec![Vec::new()]));
        self.ops.push_back(Op::Marker(MarkerKind::StepEnd, 0));
    }
}

impl Iterator for RankSim {
    type Item = SimEvent;

    fn next(&mut self) -> Option<SimEvent> {
        self.next_event()
    }
}
