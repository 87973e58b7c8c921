"""zerodp's configuration: pydantic models that accept DeepSpeed's JSON keys.

An existing DeepSpeed config works unchanged where its keys mean the same thing here. Every model
forbids unknown keys, and the error names the key and the closest valid one; every accepted key is
honoured by the engine (a key zerodp cannot honour yet is refused with a message saying so, never
silently dropped). VISSL's YAML dialect is not read here: its adapter translates it before a config is
loaded (`zerodp.adapters.vissl.vissl_engine`, `zerodp.config.vissl.translate_vissl`), and a VISSL file given here is refused
with that fix.

Each field's description doubles as the reference documentation (`zerodp.config.reference_markdown`).
"""

from __future__ import annotations

import json
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator

from .activation_checkpointing import ActivationCheckpointingConfig
from .compat import normalize
from .expert_parallel import ExpertParallelConfig
from .precision import DTYPE_NAMES, BF16Config, DataTypesConfig, FP16Config, GradDtype, TorchAutocastConfig, dtype_name  # noqa: F401
from .strict import _NOT_SUPPORTED, StrictModel, refuse_vissl  # noqa: F401 (_NOT_SUPPORTED: the docs render it)

from .offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig, check_stage  # offload tier
from ..errors import ConfigError
from .monitor import (CommsLoggerConfig, CSVMonitorConfig, FlopsProfilerConfig, TensorBoardConfig,
                              WandbConfig)  # DeepSpeed's monitoring sections


class NonFinitePolicy(str, Enum):
    """What a NaN or Inf gradient does in bf16/fp32 training (see zerodp.engine.nonfinite)."""

    STOP = "stop"
    SKIP = "skip"


class OptimizerSection(StrictModel):
    """DeepSpeed's `optimizer` section: lets `zerodp.initialize(model, config=...)` build the optimizer."""

    type: str = Field(description="Optimizer name: SGD, Adam, AdamW, Adagrad, RMSprop, LAMB, LARC (SGD inside).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the optimizer.")
    select: Optional[Union[Literal["matrices", "rest"], list[str]]] = Field(None, description="In a list of "
        "optimizer sections (e.g. Muon beside AdamW): the parameters this one steps. 'matrices': 2-D and larger, "
        "embedding tables excluded; 'rest': every parameter no other section takes; or a list of name patterns "
        "(fnmatch). Each trainable parameter must be selected by exactly one section (optim/selection.py).")


class SchedulerSection(StrictModel):
    """DeepSpeed's `scheduler` section: the engine steps it after every optimizer step (`zerodp.lr_schedules`)."""

    type: str = Field(description="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest.")
    params: dict[str, Any] = Field(default_factory=dict, description="The schedule's parameters, as in DeepSpeed.")


class ZeroOptimizationConfig(StrictModel):
    """DeepSpeed's `zero_optimization` section."""

    stage: int = Field(0, ge=0, le=3, description="0: plain data parallel; 1: shard optimizer state; "
                       "2: also shard gradients; 3: also shard parameters.")
    reduce_bucket_size: int = Field(5_000_000, ge=0, description="Elements per gradient bucket; a bucket is "
                                    "reduced as soon as all its gradients are ready (stages 0-2; at least 1). zerodp's "
                                    "default (5e6) is smaller than DeepSpeed's (5e8) so that stage 2 frees each full "
                                    "gradient bucket early: on the 33.7M-parameter benchmark GPT its peak is 97 MiB "
                                    "lower per rank.")
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="Most elements one all-gather of updated "
                                       "parameters moves (stages 1-2), and one gather of engine.full_state_dict() (every stage); larger "
                                       "buffers are gathered in chunks.")
    overlap_comm: bool = Field(True, description="Launch each bucket's (stage 3: each unit's) reduction "
                               "asynchronously during backward; false waits for each reduction before backward "
                               "continues.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into contiguous buckets as they are "
                                       "produced. zerodp always does; false (DeepSpeed: keep each gradient in "
                                       "its own tensor, a memory-fragmentation trade-off with the same numbers) "
                                       "is accepted with a warning that it changes nothing.")
    reduce_scatter: bool = Field(True, description="Reduce gradients with reduce-scatter (stages 1-3); false "
                                 "uses all-reduce and keeps this rank's shard.")
    stage3_prefetch_bucket_size: Optional[int] = Field(None, ge=0, description="Stage 3: elements gathered "
                                                       "ahead of the unit about to run. Unset: one unit ahead (the "
                                                       "largest unit below the root), as FSDP does; DeepSpeed's "
                                                       "default is 5e7 elements. 0 disables prefetch.")
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0, description="Stage 3: most gathered (full) "
                                            "parameter elements alive at once, prefetch included.")
    stage3_inference_memory_fraction: float = Field(0.5, ge=0, le=1, description="Stage 3, evaluation and "
                                                     "generation (module in eval mode, grad disabled): units "
                                                     "gathered for a forward stay gathered for the next ones while "
                                                     "their elements fit this fraction of the free device (host on "
                                                     "CPU) memory measured when evaluation starts, and at most "
                                                     "stage3_max_live_parameters; beyond it the least recently used "
                                                     "are released. All are released when training resumes or the "
                                                     "parameters change. 0: re-gather every forward, as in training.")
    stage3_param_persistence_threshold: int = Field(100_000, ge=0, description="Stage 3: parameters with fewer "
                                                    "elements stay whole on every rank.")
    stage3_unit_modules: list[str] = Field(default_factory=list, description="Stage 3: module class names that "
                                           "each become one gathering unit (e.g. a transformer block).")
    debug_sync: bool = Field(False, description="Before every collective, check that all ranks are about to issue "
                             "the same one (a small hash exchange); on a mismatch every rank stops naming what each "
                             "was doing. A debugging aid: one extra collective per collective. Also "
                             "ZERODP_DEBUG_SYNC=1.")
    stage3_unit_min_params: int = Field(100_000, ge=0, description="Stage 3 auto-wrap: a module with at least "
                                        "this many parameters (not counting its sub-units) becomes a unit. Left "
                                        "unset, the model's repeated blocks (HF's _no_split_modules, else the class "
                                        "in its largest ModuleList) are never split, so a module called only for "
                                        "some inputs (an MoE expert) is never a unit of its own (docs/moe.md); set, "
                                        "the size alone decides.")
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig, description="ZeRO-"
                                                      "Offload / ZeRO-Infinity: optimizer state in host memory or files.")
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig, description="Stage 3: "
                                              "parameter shards in host memory or files.")
    sub_group_size: Optional[int] = Field(None, ge=0, description="Elements per chunk that an offloaded "
                                          "optimizer step streams (read, step, write); bounds the optimizer's working "
                                          "set in RAM. 0: the smallest chunks (DeepSpeed: one tensor per sub-group). "
                                          "Unset: 4e6 (16 MiB per fp32 state tensor, logged at start-up); DeepSpeed's "
                                          "default, 1e9, reads a rank's whole optimizer state at once.")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ (stage 3): every parameter gather sends "
                                         "the shards in int8 with one fp32 scale per 256 elements (about a quarter "
                                         "of fp32's bytes, half of bf16's); every rank computes with the same "
                                         "dequantized weights, within 1/254 of each block's largest magnitude. An "
                                         "approximation: see docs/quantized.md.")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ (stage 3): gradients are reduced through "
                                           "an all-to-all of int4 slices with one fp32 scale per 256 elements (about "
                                           "an eighth of fp32's bytes), dequantized and summed in fp32 in rank "
                                           "order. An approximation: see docs/quantized.md.")
    zero_hpz_partition_size: int = Field(1, ge=0, description="ZeRO++ hpZ (stage 3): besides its primary shard "
                                         "(1/N of each unit), a rank keeps a secondary shard (1/k of the unit, taken "
                                         "from the forward's gather) shared by the k consecutive ranks of its block, "
                                         "normally one node (k = ranks per node), so that the backward's gathers stay "
                                         "inside the block. Exact (placement only); costs 1/k of the parameters per "
                                         "rank from the forward until the optimizer step. 0 or 1: off.")
    mics_shard_size: int = Field(-1, description="MiCS / FSDP2's HSDP (stage 3): shard the model states inside "
                                 "blocks of this many consecutive ranks and replicate them across blocks; gathers stay "
                                 "in the block, gradients are reduce-scattered in it and all-reduced across the "
                                 "replicas. The ranks per node (LOCAL_WORLD_SIZE) is HSDP. Exact (placement only); "
                                 "each rank holds 1/size of the states instead of 1/N. -1 (or the world size): off.")
    mics_hierarchical_params_gather: bool = Field(False, description="MiCS: gather a block that spans nodes in two "
                                                  "hops, across nodes one shard per node and then inside each node, "
                                                  "so that 1/(ranks per node) of the bytes cross nodes. Needs blocks "
                                                  "of whole nodes; a block of every rank is allowed.")
    stage3_gather_16bit_weights_on_model_save: bool = Field(False, description="Make save_16bit_model (and every "
                                                            "save_checkpoint, as DeepSpeed does) also write the "
                                                            "consolidated weights in the compute dtype as safetensors.")

    @model_validator(mode="after")
    def _check_honourable(self) -> "ZeroOptimizationConfig":
        if not self.contiguous_gradients:
            # DeepSpeed's false only changes where gradients wait before their reduction, never their values;
            # published configs set it (DeepSpeed's tests/torch_compile), so it is accepted, not honoured
            warnings.warn("zero_optimization.contiguous_gradients=false has no effect: zerodp always copies "
                          "gradients into contiguous buckets (same values, no extra memory)", UserWarning,
                          stacklevel=2)
        check_stage(self.stage, self.offload_optimizer, self.offload_param)
        for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size", "mics_shard_size"):
            if self.stage < 3 and getattr(self, key) not in (False, 0, 1, -1):  # DeepSpeed applies ZeRO++ to stage 3 only, and ignores it below
                warnings.warn(f"zero_optimization.{key} has no effect at stage {self.stage}: ZeRO++ (quantized "
                              f"collectives, secondary shards) and MiCS are stage 3's", UserWarning, stacklevel=2)
        if self.stage < 3 and self.reduce_bucket_size == 0:
            raise ValueError("reduce_bucket_size=0 is only meaningful at stage 3 (where buckets are not used); "
                             "write a number of elements, e.g. 500000000")
        if self.stage == 3 and "reduce_bucket_size" in self.model_fields_set:
            # DeepSpeed configs often carry it; at stage 3 zerodp reduces per module unit instead.
            # (allgather_bucket_size still bounds full_state_dict's gathers, so it is not reported.)
            warnings.warn("zero_optimization.reduce_bucket_size has no effect at stage 3: parameters are "
                          "gathered and gradients reduced per module unit (see stage3_unit_modules, "
                          "stage3_unit_min_params, stage3_prefetch_bucket_size)", UserWarning, stacklevel=2)
        return self


class ZeroConfig(StrictModel):
    """The whole configuration. Field names are DeepSpeed's where they mean the same thing."""

    train_batch_size: Optional[int] = Field(None, ge=1, description="Global batch size = micro batch x "
                                            "accumulation steps x world size (any two determine the third).")
    train_micro_batch_size_per_gpu: Optional[int] = Field(None, ge=1, description="Samples per rank per "
                                                          "forward/backward.")
    gradient_accumulation_steps: Optional[int] = Field(None, ge=1, description="Micro-steps per optimizer "
                                                       "step; the loss is divided by it in backward.")
    gradient_clipping: float = Field(0.0, ge=0, description="Clip the global gradient norm (over all shards) "
                                     "to this value; 0 disables clipping.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision.")
    communication_data_type: Optional[GradDtype] = Field(None, description="The dtype gradients are summed over "
        "ranks in: 'fp32' in a bf16 run casts each bucket (stage 3: unit) to fp32 before the reduction and the "
        "rank average back to the accumulation dtype after it. Unset: the compute dtype (DeepSpeed's default). "
        "Every stage. Not with zero_quantized_gradients (its payload is int4).")
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig, description="torch.autocast "
                                                "mixed precision with fp32 parameters (zerodp.precision.autocast).")
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig, description="Gradient accumulation dtype.")
    prescale_gradients: bool = Field(False, description="Divide each rank's gradients by the world size before "
                                     "the reduction instead of the sum after it (DeepSpeed's meaning; "
                                     "gradient_predivide_factor is then ignored). Changes rounding and range only.")
    gradient_predivide_factor: float = Field(1.0, gt=0, description="With prescale_gradients false: divide each "
                                             "rank's gradients by this factor before the reduction and the sum by "
                                             "world size / factor after it (keeps fp16 sums over many ranks in "
                                             "range). 1: divide the sum by the world size. Every stage.")
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig,
                                                      description="ZeRO stage and communication settings.")
    optimizer: Optional[Union[OptimizerSection, list[OptimizerSection]]] = Field(
        None, description="Build the optimizer from the config; a list of sections builds several optimizers over "
        "disjoint parameter sets, each choosing its parameters with 'select'.")
    aio: AioConfig = Field(default_factory=AioConfig, description="How offload files are read and written.")
    scheduler: Optional[SchedulerSection] = Field(None, description="Learning-rate schedule stepped by the engine.")
    dataloader_drop_last: bool = Field(False, description="zerodp.deepspeed.initialize(training_data=...): drop the "
                                       "last incomplete batch of the data loader it builds.")
    zero_allow_untested_optimizer: bool = Field(False, description="Allow an optimizer class zerodp does not "
                                                "know to be elementwise (you assert its update is per element).")
    steps_per_print: Optional[int] = Field(None, ge=1, description="Log loss scale, grad norm and step time "
                                           "every this many optimizer steps (rank 0).")
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward and optimizer step separately "
                                       "(engine.timings) and log them with steps_per_print (every 10 if unset).")
    comm_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one collective, in seconds. A rank "
                                  "that waits longer prints its step, phase, stage-3 unit and last collectives, then "
                                  "exits with code 3 (instead of hanging). The environment's ZERODP_COMM_TIMEOUT_S "
                                  "overrides it.")
    nonfinite: NonFinitePolicy = Field(NonFinitePolicy.STOP, description="bf16/fp32: what a NaN or Inf gradient "
                                       "does. stop: raise on every rank, naming the step, rank and first "
                                       "parameter; skip: skip the step on every rank with a warning. (fp16 always "
                                       "skips and lowers the loss scale.)")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig, description="DeepSpeed's CSV monitor: "
                                          "loss, lr, loss scale and grad norm per step (see zerodp.monitor).")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="The same events as "
                                           "TensorBoard scalars.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="The same events logged to Weights & Biases.")
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="Count, bytes and latency "
                                            "of every collective (engine.comms_summary()).")
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig, description="FLOPs and achieved "
                                                "FLOP/s of one optimizer step (torch.utils.flop_counter).")
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig,
        description="ZeRO-R: how checkpointed regions keep their inputs (docs/activations.md).")
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig, description="DeepSpeed's "
                                                  "AutoEP section: transformers' packed experts split over ranks "
                                                  "(docs/moe_ep.md).")

    # Set by load_config: no-effect keys to log once at start-up, and "auto" keys config/auto.py resolves.
    _notes: list[str] = PrivateAttr(default_factory=list)
    _warnings: list[str] = PrivateAttr(default_factory=list)
    _autos: set[str] = PrivateAttr(default_factory=set)

    @model_validator(mode="before")
    @classmethod
    def _canonical_comm_dtype(cls, data: Any) -> Any:
        if isinstance(data, dict) and "communication_data_type" in data:  # DeepSpeed reads it case-insensitively
            names = {k: v for k, v in DTYPE_NAMES.items() if k == v}  # DeepSpeed: only fp32, fp16, bf16 here
            data = {**data, "communication_data_type": dtype_name(data["communication_data_type"],
                                                                   "communication_data_type", names)}
        return data

    @model_validator(mode="after")
    def _check_precision(self) -> "ZeroConfig":
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        compute = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        accum = self.data_types.grad_accum_dtype
        if self.stage == 0 and accum not in (None, compute):
            raise ValueError(f"data_types.grad_accum_dtype={accum!r} in a {compute} run needs ZeRO stage 1-3 "
                             f"(DeepSpeed without ZeRO refuses it too: 'unsupported mix'); set zero_optimization."
                             f"stage to 1, 2 or 3, or remove grad_accum_dtype")
        if (self.communication_data_type not in (None, compute) and self.stage == 3
                and self.zero_optimization.zero_quantized_gradients):
            raise ValueError(f"communication_data_type={self.communication_data_type!r} with "
                             f"zero_quantized_gradients: the quantized reduction sends int4, so no reduction dtype "
                             f"applies; remove one of them")
        self.torch_autocast.check_compatible(compute, self.zero_optimization)
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            warnings.warn(f"gradient_predivide_factor={self.gradient_predivide_factor} has no effect with "
                          f"prescale_gradients=true: gradients are divided by the world size before the reduction "
                          f"(DeepSpeed ignores it too)", UserWarning, stacklevel=2)
        return self

    @property
    def stage(self) -> int:
        """The ZeRO stage (shorthand for zero_optimization.stage)."""
        return self.zero_optimization.stage

    def resolve_batch(self, world_size: int) -> tuple[int, int, int]:
        """Return (train_batch_size, micro_batch, accumulation_steps), completing DeepSpeed's rule.

        Raises ConfigError when the three given values disagree or do not divide.
        """
        tb, mb, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if tb is not None and mb is not None and gas is None:
            if tb % (mb * world_size):
                raise ConfigError(f"train_batch_size={tb} is not divisible by train_micro_batch_size_per_gpu={mb}"
                                  f" x world size {world_size}; change one of them")
            gas = tb // (mb * world_size)
        elif tb is not None and mb is None:
            gas = gas or 1
            if tb % (gas * world_size):
                raise ConfigError(f"train_batch_size={tb} is not divisible by gradient_accumulation_steps={gas}"
                                  f" x world size {world_size}; change one of them")
            mb = tb // (gas * world_size)
        gas = gas or 1
        mb = mb or 1
        if tb is None:
            tb = mb * gas * world_size
        if tb != mb * gas * world_size:
            raise ConfigError(f"train_batch_size={tb} != train_micro_batch_size_per_gpu={mb} x "
                              f"gradient_accumulation_steps={gas} x world size {world_size}; fix one of them")
        return tb, mb, gas


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return "invalid zerodp config:\n  " + "\n  ".join(lines)


def _read_file(path: Path) -> dict:
    """The mapping in a .json/.yaml file; any problem is a one-line ConfigError naming file:line:column."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; pass a path to a .json or .yaml file, or a dict")
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path} has suffix '{path.suffix}'; use .json, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    if not text.strip():
        raise ConfigError(f"config file {path} is empty; write the settings into it (an empty config is "
                          f"{{}} in JSON)")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}; fix the file at that "
                              f"place (JSON has no trailing commas or comments, and quotes keys)") from None
    else:
        data = _parse_yaml(path, text)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping (key: value) at the top level, not "
                          f"{type(data).__name__}")
    return data


def _parse_yaml(path: Path, text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        hint = "YAML indents with spaces, never tabs" if "\\t" in problem or "\t" in problem else \
            "fix the file at that place"
        raise ConfigError(f"{where}: invalid YAML: {problem}; {hint}") from None


def load_config(source: Union["ZeroConfig", dict, str, Path, None], auto_values: Optional[dict] = None) -> ZeroConfig:
    """Build a validated ZeroConfig from a ZeroConfig, a dict, or a path to a .json/.yaml file.

    DeepSpeed's aliases, no-effect keys and "auto" values are handled by `config_compat.normalize`;
    `auto_values` ({dotted key: value}) fills "auto" keys first, as an integration (HF's Trainer) would.
    """
    if isinstance(source, ZeroConfig):
        return source
    if source is None:
        data: dict = {}
    elif isinstance(source, (str, Path)):
        data = _read_file(Path(source))
    elif isinstance(source, dict):
        data = dict(source)
    else:
        raise ConfigError(f"config must be a dict, a path or a ZeroConfig, not {type(source).__name__}")
    refuse_vissl(data)  # VISSL's dialect is its adapter's to translate
    data = normalize(_fill_auto(data, auto_values or {}), ConfigError)
    try:
        config = ZeroConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None
    config._notes, config._warnings, config._autos = list(data.notes), list(data.warnings), set(data.autos)
    return config


def _fill_auto(data: dict, values: dict) -> dict:
    """Replace "auto" at each dotted key of `values` with its value (other keys are left alone)."""
    data = json.loads(json.dumps(data)) if values else data
    for path, value in values.items():
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) == "auto":
            node[last] = value
    return data


def reference_markdown(model: type[BaseModel] = ZeroConfig, prefix: str = "") -> str:
    """Render the config reference (keys, defaults, descriptions) as Markdown, from the models."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is not None:
            rows.append(f"| `{prefix}{name}` | section | {field.description} |")
            rows.append(reference_markdown(sub, prefix=f"{prefix}{name}.").split("\n", 2)[2])
            continue
        default = field.get_default(call_default_factory=True)
        rows.append(f"| `{prefix}{name}` | `{default!r}` | {field.description} |")
    return "| key | default | meaning |\n|---|---|---|\n" + "\n".join(r for r in rows if r)
