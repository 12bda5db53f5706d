from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OptimizerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_KIND_UNSPECIFIED: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_ADAM: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_SGD_MOMENTUM: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_SGD: _ClassVar[OptimizerKind]
    OPTIMIZER_KIND_OTHER: _ClassVar[OptimizerKind]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    PRECISION_FP32: _ClassVar[Precision]
    PRECISION_MIXED_BF16: _ClassVar[Precision]
    PRECISION_MIXED_FP16: _ClassVar[Precision]
    PRECISION_BF16: _ClassVar[Precision]

class OptimizerImplementation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPTIMIZER_IMPLEMENTATION_UNSPECIFIED: _ClassVar[OptimizerImplementation]
    OPTIMIZER_IMPLEMENTATION_FOREACH: _ClassVar[OptimizerImplementation]
    OPTIMIZER_IMPLEMENTATION_FUSED: _ClassVar[OptimizerImplementation]
    OPTIMIZER_IMPLEMENTATION_FOR_LOOP: _ClassVar[OptimizerImplementation]

class MarkerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MARKER_KIND_UNSPECIFIED: _ClassVar[MarkerKind]
    STEP_BEGIN: _ClassVar[MarkerKind]
    FORWARD_BEGIN: _ClassVar[MarkerKind]
    BACKWARD_BEGIN: _ClassVar[MarkerKind]
    OPTIMIZER_BEGIN: _ClassVar[MarkerKind]
    OPTIMIZER_END: _ClassVar[MarkerKind]
    STEP_END: _ClassVar[MarkerKind]
    OOM: _ClassVar[MarkerKind]
    EVAL_BEGIN: _ClassVar[MarkerKind]
    EVAL_END: _ClassVar[MarkerKind]
    CHECKPOINT_BEGIN: _ClassVar[MarkerKind]
    CHECKPOINT_END: _ClassVar[MarkerKind]

class AllocatorAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATOR_ACTION_UNSPECIFIED: _ClassVar[AllocatorAction]
    ALLOCATOR_ACTION_ALLOC: _ClassVar[AllocatorAction]
    ALLOCATOR_ACTION_FREE: _ClassVar[AllocatorAction]
    ALLOCATOR_ACTION_SEGMENT_ALLOC: _ClassVar[AllocatorAction]
    ALLOCATOR_ACTION_SEGMENT_FREE: _ClassVar[AllocatorAction]
    ALLOCATOR_ACTION_SEGMENT_MAP: _ClassVar[AllocatorAction]
    ALLOCATOR_ACTION_SEGMENT_UNMAP: _ClassVar[AllocatorAction]

class AdvisoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADVISORY_KIND_UNSPECIFIED: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_STEP2_OOM_PREDICTED: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_LOW_HEADROOM: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_RANK_DIVERGENCE: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_ALLOCATOR_RETRIES: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_LOW_OBSERVED_HEADROOM: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_MEMORY_GROWTH: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_CLIENT_CLOCK: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_PREDICTION_FINAL: _ClassVar[AdvisoryKind]

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    SEVERITY_INFO: _ClassVar[Severity]
    SEVERITY_WARNING: _ClassVar[Severity]
    SEVERITY_CRITICAL: _ClassVar[Severity]
OPTIMIZER_KIND_UNSPECIFIED: OptimizerKind
OPTIMIZER_KIND_ADAM: OptimizerKind
OPTIMIZER_KIND_SGD_MOMENTUM: OptimizerKind
OPTIMIZER_KIND_SGD: OptimizerKind
OPTIMIZER_KIND_OTHER: OptimizerKind
PRECISION_UNSPECIFIED: Precision
PRECISION_FP32: Precision
PRECISION_MIXED_BF16: Precision
PRECISION_MIXED_FP16: Precision
PRECISION_BF16: Precision
OPTIMIZER_IMPLEMENTATION_UNSPECIFIED: OptimizerImplementation
OPTIMIZER_IMPLEMENTATION_FOREACH: OptimizerImplementation
OPTIMIZER_IMPLEMENTATION_FUSED: OptimizerImplementation
OPTIMIZER_IMPLEMENTATION_FOR_LOOP: OptimizerImplementation
MARKER_KIND_UNSPECIFIED: MarkerKind
STEP_BEGIN: MarkerKind
FORWARD_BEGIN: MarkerKind
BACKWARD_BEGIN: MarkerKind
OPTIMIZER_BEGIN: MarkerKind
OPTIMIZER_END: MarkerKind
STEP_END: MarkerKind
OOM: MarkerKind
EVAL_BEGIN: MarkerKind
EVAL_END: MarkerKind
CHECKPOINT_BEGIN: MarkerKind
CHECKPOINT_END: MarkerKind
ALLOCATOR_ACTION_UNSPECIFIED: AllocatorAction
ALLOCATOR_ACTION_ALLOC: AllocatorAction
ALLOCATOR_ACTION_FREE: AllocatorAction
ALLOCATOR_ACTION_SEGMENT_ALLOC: AllocatorAction
ALLOCATOR_ACTION_SEGMENT_FREE: AllocatorAction
ALLOCATOR_ACTION_SEGMENT_MAP: AllocatorAction
ALLOCATOR_ACTION_SEGMENT_UNMAP: AllocatorAction
ADVISORY_KIND_UNSPECIFIED: AdvisoryKind
ADVISORY_KIND_STEP2_OOM_PREDICTED: AdvisoryKind
ADVISORY_KIND_LOW_HEADROOM: AdvisoryKind
ADVISORY_KIND_RANK_DIVERGENCE: AdvisoryKind
ADVISORY_KIND_ALLOCATOR_RETRIES: AdvisoryKind
ADVISORY_KIND_LOW_OBSERVED_HEADROOM: AdvisoryKind
ADVISORY_KIND_MEMORY_GROWTH: AdvisoryKind
ADVISORY_KIND_CLIENT_CLOCK: AdvisoryKind
ADVISORY_KIND_PREDICTION_FINAL: AdvisoryKind
SEVERITY_UNSPECIFIED: Severity
SEVERITY_INFO: Severity
SEVERITY_WARNING: Severity
SEVERITY_CRITICAL: Severity

class ClientMessage(_message.Message):
    __slots__ = ("hello", "markers", "allocator_trace", "model_update", "oom_report")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    MARKERS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_TRACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_UPDATE_FIELD_NUMBER: _ClassVar[int]
    OOM_REPORT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    markers: MarkerBatch
    allocator_trace: AllocatorTraceChunk
    model_update: ModelFacts
    oom_report: OomReport
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., markers: _Optional[_Union[MarkerBatch, _Mapping]] = ..., allocator_trace: _Optional[_Union[AllocatorTraceChunk, _Mapping]] = ..., model_update: _Optional[_Union[ModelFacts, _Mapping]] = ..., oom_report: _Optional[_Union[OomReport, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("identity", "gpu_uuid", "pid", "framework", "framework_version", "model", "client_version", "run_id", "torch_version")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    identity: Identity
    gpu_uuid: str
    pid: int
    framework: str
    framework_version: str
    model: ModelFacts
    client_version: str
    run_id: str
    torch_version: str
    def __init__(self, identity: _Optional[_Union[Identity, _Mapping]] = ..., gpu_uuid: _Optional[str] = ..., pid: _Optional[int] = ..., framework: _Optional[str] = ..., framework_version: _Optional[str] = ..., model: _Optional[_Union[ModelFacts, _Mapping]] = ..., client_version: _Optional[str] = ..., run_id: _Optional[str] = ..., torch_version: _Optional[str] = ...) -> None: ...

class Identity(_message.Message):
    __slots__ = ("job_id", "rank", "local_rank", "world_size", "node_name", "pod", "namespace")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    local_rank: int
    world_size: int
    node_name: str
    pod: str
    namespace: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., node_name: _Optional[str] = ..., pod: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class ModelFacts(_message.Message):
    __slots__ = ("parameter_count", "parameter_bytes", "optimizer", "state_bytes_per_parameter", "precision", "sharding_factor", "grad_accumulation_steps", "state_precreated", "grads_set_to_none", "micro_batch_size", "optimizer_implementation", "ddp_bucket_rebuild", "largest_batch")
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_PER_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    GRAD_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    STATE_PRECREATED_FIELD_NUMBER: _ClassVar[int]
    GRADS_SET_TO_NONE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    DDP_BUCKET_REBUILD_FIELD_NUMBER: _ClassVar[int]
    LARGEST_BATCH_FIELD_NUMBER: _ClassVar[int]
    parameter_count: int
    parameter_bytes: int
    optimizer: OptimizerKind
    state_bytes_per_parameter: int
    precision: Precision
    sharding_factor: int
    grad_accumulation_steps: int
    state_precreated: bool
    grads_set_to_none: bool
    micro_batch_size: int
    optimizer_implementation: OptimizerImplementation
    ddp_bucket_rebuild: DdpBucketRebuild
    largest_batch: BatchFacts
    def __init__(self, parameter_count: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerKind, str]] = ..., state_bytes_per_parameter: _Optional[int] = ..., precision: _Optional[_Union[Precision, str]] = ..., sharding_factor: _Optional[int] = ..., grad_accumulation_steps: _Optional[int] = ..., state_precreated: bool = ..., grads_set_to_none: bool = ..., micro_batch_size: _Optional[int] = ..., optimizer_implementation: _Optional[_Union[OptimizerImplementation, str]] = ..., ddp_bucket_rebuild: _Optional[_Union[DdpBucketRebuild, _Mapping]] = ..., largest_batch: _Optional[_Union[BatchFacts, _Mapping]] = ...) -> None: ...

class DdpBucketRebuild(_message.Message):
    __slots__ = ("old_bucket_bytes", "new_bucket_bytes")
    OLD_BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEW_BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    old_bucket_bytes: _containers.RepeatedScalarFieldContainer[int]
    new_bucket_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, old_bucket_bytes: _Optional[_Iterable[int]] = ..., new_bucket_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocatorTraceChunk(_message.Message):
    __slots__ = ("step", "segments", "events", "last", "settings", "forward_returns")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_RETURNS_FIELD_NUMBER: _ClassVar[int]
    step: int
    segments: _containers.RepeatedCompositeFieldContainer[AllocatorSegment]
    events: _containers.RepeatedCompositeFieldContainer[AllocatorEvent]
    last: bool
    settings: AllocatorSettings
    forward_returns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[AllocatorSegment, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[AllocatorEvent, _Mapping]]] = ..., last: bool = ..., settings: _Optional[_Union[AllocatorSettings, _Mapping]] = ..., forward_returns: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocatorSettings(_message.Message):
    __slots__ = ("max_split_size_bytes", "roundup_power2_divisions", "garbage_collection_threshold", "expandable_segments", "alloc_conf")
    MAX_SPLIT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUNDUP_POWER2_DIVISIONS_FIELD_NUMBER: _ClassVar[int]
    GARBAGE_COLLECTION_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EXPANDABLE_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_CONF_FIELD_NUMBER: _ClassVar[int]
    max_split_size_bytes: int
    roundup_power2_divisions: _containers.RepeatedScalarFieldContainer[int]
    garbage_collection_threshold: float
    expandable_segments: bool
    alloc_conf: str
    def __init__(self, max_split_size_bytes: _Optional[int] = ..., roundup_power2_divisions: _Optional[_Iterable[int]] = ..., garbage_collection_threshold: _Optional[float] = ..., expandable_segments: bool = ..., alloc_conf: _Optional[str] = ...) -> None: ...

class AllocatorSegment(_message.Message):
    __slots__ = ("address", "small_pool", "blocks", "stream", "pool_id", "expandable")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SMALL_POOL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EXPANDABLE_FIELD_NUMBER: _ClassVar[int]
    address: int
    small_pool: bool
    blocks: _containers.RepeatedCompositeFieldContainer[AllocatorBlock]
    stream: int
    pool_id: int
    expandable: bool
    def __init__(self, address: _Optional[int] = ..., small_pool: bool = ..., blocks: _Optional[_Iterable[_Union[AllocatorBlock, _Mapping]]] = ..., stream: _Optional[int] = ..., pool_id: _Optional[int] = ..., expandable: bool = ...) -> None: ...

class AllocatorBlock(_message.Message):
    __slots__ = ("size", "allocated", "gradient")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    size: int
    allocated: bool
    gradient: bool
    def __init__(self, size: _Optional[int] = ..., allocated: bool = ..., gradient: bool = ...) -> None: ...

class AllocatorEvent(_message.Message):
    __slots__ = ("action", "address", "size", "phase", "stream")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    action: AllocatorAction
    address: int
    size: int
    phase: MarkerKind
    stream: int
    def __init__(self, action: _Optional[_Union[AllocatorAction, str]] = ..., address: _Optional[int] = ..., size: _Optional[int] = ..., phase: _Optional[_Union[MarkerKind, str]] = ..., stream: _Optional[int] = ...) -> None: ...

class MarkerBatch(_message.Message):
    __slots__ = ("markers",)
    MARKERS_FIELD_NUMBER: _ClassVar[int]
    markers: _containers.RepeatedCompositeFieldContainer[Marker]
    def __init__(self, markers: _Optional[_Iterable[_Union[Marker, _Mapping]]] = ...) -> None: ...

class Marker(_message.Message):
    __slots__ = ("kind", "step", "monotonic_ns", "wall_ns", "allocator", "micro_batch", "layout_segments", "device_memory", "batch")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MONOTONIC_NS_FIELD_NUMBER: _ClassVar[int]
    WALL_NS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    kind: MarkerKind
    step: int
    monotonic_ns: int
    wall_ns: int
    allocator: AllocatorStats
    micro_batch: int
    layout_segments: _containers.RepeatedCompositeFieldContainer[AllocatorSegment]
    device_memory: DeviceMemory
    batch: BatchFacts
    def __init__(self, kind: _Optional[_Union[MarkerKind, str]] = ..., step: _Optional[int] = ..., monotonic_ns: _Optional[int] = ..., wall_ns: _Optional[int] = ..., allocator: _Optional[_Union[AllocatorStats, _Mapping]] = ..., micro_batch: _Optional[int] = ..., layout_segments: _Optional[_Iterable[_Union[AllocatorSegment, _Mapping]]] = ..., device_memory: _Optional[_Union[DeviceMemory, _Mapping]] = ..., batch: _Optional[_Union[BatchFacts, _Mapping]] = ...) -> None: ...

class BatchFacts(_message.Message):
    __slots__ = ("samples", "tokens", "shape")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    samples: int
    tokens: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, samples: _Optional[int] = ..., tokens: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("free_bytes", "total_bytes")
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    free_bytes: int
    total_bytes: int
    def __init__(self, free_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class AllocatorStats(_message.Message):
    __slots__ = ("allocated_bytes", "allocated_peak_bytes", "reserved_bytes", "reserved_peak_bytes", "active_bytes", "active_peak_bytes", "num_alloc_retries")
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOC_RETRIES_FIELD_NUMBER: _ClassVar[int]
    allocated_bytes: int
    allocated_peak_bytes: int
    reserved_bytes: int
    reserved_peak_bytes: int
    active_bytes: int
    active_peak_bytes: int
    num_alloc_retries: int
    def __init__(self, allocated_bytes: _Optional[int] = ..., allocated_peak_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., reserved_peak_bytes: _Optional[int] = ..., active_bytes: _Optional[int] = ..., active_peak_bytes: _Optional[int] = ..., num_alloc_retries: _Optional[int] = ...) -> None: ...

class OomReport(_message.Message):
    __slots__ = ("step", "requested_bytes", "allocator", "inactive_split_bytes", "segment_count", "largest_free_block_bytes", "largest_segments", "device_memory", "message")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_SPLIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    requested_bytes: int
    allocator: AllocatorStats
    inactive_split_bytes: int
    segment_count: int
    largest_free_block_bytes: int
    largest_segments: _containers.RepeatedCompositeFieldContainer[OomSegment]
    device_memory: DeviceMemory
    message: str
    def __init__(self, step: _Optional[int] = ..., requested_bytes: _Optional[int] = ..., allocator: _Optional[_Union[AllocatorStats, _Mapping]] = ..., inactive_split_bytes: _Optional[int] = ..., segment_count: _Optional[int] = ..., largest_free_block_bytes: _Optional[int] = ..., largest_segments: _Optional[_Iterable[_Union[OomSegment, _Mapping]]] = ..., device_memory: _Optional[_Union[DeviceMemory, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class OomSegment(_message.Message):
    __slots__ = ("size_bytes", "allocated_bytes", "largest_free_block_bytes", "small_pool")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SMALL_POOL_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    allocated_bytes: int
    largest_free_block_bytes: int
    small_pool: bool
    def __init__(self, size_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., largest_free_block_bytes: _Optional[int] = ..., small_pool: bool = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("advisory",)
    ADVISORY_FIELD_NUMBER: _ClassVar[int]
    advisory: Advisory
    def __init__(self, advisory: _Optional[_Union[Advisory, _Mapping]] = ...) -> None: ...

class Advisory(_message.Message):
    __slots__ = ("kind", "severity", "message", "step", "predicted_peak_bytes", "capacity_bytes", "predicted_headroom_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HEADROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: AdvisoryKind
    severity: Severity
    message: str
    step: int
    predicted_peak_bytes: int
    capacity_bytes: int
    predicted_headroom_bytes: int
    def __init__(self, kind: _Optional[_Union[AdvisoryKind, str]] = ..., severity: _Optional[_Union[Severity, str]] = ..., message: _Optional[str] = ..., step: _Optional[int] = ..., predicted_peak_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., predicted_headroom_bytes: _Optional[int] = ...) -> None: ...
