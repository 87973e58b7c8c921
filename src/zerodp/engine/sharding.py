"""How an engine's model is sharded: `build_sharding`, from the user's model and optimizer to the strategy
the engine drives (`seams.ShardingStrategy`) for the configured stage.

The stage is a policy, chosen here once; the engine (engine.py) drives whichever strategy this returns:

    stages 0-2   parameters replicated, whole on every rank, in gradient buckets (`stage12/`):
                 `stage12.buckets.ReducePolicy` says what the stage does with a bucket (stage 1 steps only
                 this rank's shard of the optimizer state, stage 2 also keeps only its shard of the gradients)
    stage 3      parameters sharded too, in units gathered around each module's forward and backward
                 (`stage3/`)

In order, as every rank does it: the optimizer is resolved (the user's, or the config's `optimizer` section)
and checked; its param groups are read (trainable parameters only, in the model's order, so every rank
agrees); rank 0's weights and buffers are broadcast (DDP's rule); under bf16/fp16 the model is cast to
its compute dtype; then the gradient arithmetic every stage shares (grads/grad_arithmetic.py) and the
stage's strategy are built.

Per param group the optimizer decides the layout, with no configuration: one that reads whole tensors
(Muon, Adafactor) has each rank own whole tensors of it (flat/whole_tensor_layout.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from torch import nn

from .. import comm
from ..precision.autocast import AutocastPolicy
from ..config import ZeroConfig
from ..shard.grads.grad_arithmetic import GradArithmetic
from .nonfinite import check_hyperparameters
from ..offload.placement import Placement
from ..optim.inner import OptimizerLike, check_supported, members, needs_whole_tensors, resolve_optimizer
from ..precision.policy import PrecisionPolicy
from .preflight import broadcast_module_state, optimizer_groups, trainable_parameters
from ..shard.seams import ShardingStrategy
from ..shard.stage3 import build_stage3_sharding
from ..shard.stage12.buckets import ReducePolicy, build_buckets
from ..shard.stage12.strategy import GradReducer
from ..moe.expert_groups import ExpertPlan
from ..moe.sharding import ExpertNorm, ExpertParallelSharding


class Sharding(NamedTuple):
    """What `build_sharding` gives the engine."""

    user_optimizer: OptimizerLike  # the user's (or the config's) optimizer: read for its classes, never stepped
    autocast: Optional[AutocastPolicy]  # torch_autocast (autocast.py), or None
    strategy: ShardingStrategy  # the configured stage's; its units are what the optimizer steps
    norm_rule: Optional[ExpertNorm] = None  # expert parallelism: the gradient norm over both groups (moe/)


def build_sharding(model: nn.Module, optimizer: Any, config: ZeroConfig, process_group: comm.ProcessGroup,
                   precision: PrecisionPolicy, world_size: int, placement: Placement) -> Sharding:
    """Resolve and check `optimizer` (None: the config's section), make `model` the same on every rank and
    cast it to the compute dtype, then lay its trainable parameters out for the configured stage (its
    gradient buffers as `placement` says: `round_grad_views`)."""
    trainable = trainable_parameters(model)
    user_opt = resolve_optimizer(optimizer, config.optimizer, trainable, model=model)
    check_supported(user_opt, config.zero_allow_untested_optimizer)
    check_hyperparameters(user_opt.param_groups)
    groups = optimizer_groups(model, user_opt)
    # per param group: does its optimizer read whole tensors (Muon, Adafactor)? Then each rank owns
    # whole tensors of it (flat/whole_tensor_layout.py); no configuration, the optimizer decides.
    whole = [needs_whole_tensors(m) for m in members(user_opt)]
    # MoE layers (moe/): their expert-parallel groups made and bound; experts start from their own group's first rank
    experts = ExpertPlan.of(model, process_group, config.expert_parallel.autoep_size if config.expert_parallel.enabled
                            else None)
    broadcast_module_state(model, process_group, skip=set() if experts is None else set(experts.ep_size_of()))
    if experts is not None:
        experts.broadcast_experts()
    if precision.mixed:
        model.to(precision.param_dtype)  # parameters and floating buffers compute in low precision
    # communication/accumulation dtypes, pre/post divisors: one arithmetic for all stages (grads/grad_arithmetic.py)
    autocast = AutocastPolicy.from_config(config, model)
    arithmetic = GradArithmetic(world_size, precision.grad_accum_dtype, precision.reduce_dtype,
                                config.gradient_predivide_factor, config.prescale_gradients,
                                *(() if autocast is None else (autocast.low_precision_ids, autocast.dtype)))
    if experts is not None:
        return Sharding(user_opt, autocast, *_expert_strategy(model, experts, groups, whole, config, process_group,
                                                               arithmetic, placement.round_grad_views))
    return Sharding(user_opt, autocast, _strategy(model, groups, whole, config, process_group, arithmetic,
                                                  placement.round_grad_views))


def _expert_strategy(model: nn.Module, experts: ExpertPlan, groups: list[list[nn.Parameter]], whole: list[bool], config: ZeroConfig,
                     process_group: comm.ProcessGroup, arithmetic: GradArithmetic,
                     round_views: bool) -> tuple[ShardingStrategy, ExpertNorm]:
    """Expert parallelism (moe/sharding.py): the dense parameters over every rank at the configured stage, each
    ep_size's experts over its expert-data-parallel group (stage 3: at stage 2); every part averages over all
    ranks (`arithmetic`)."""
    experts.check_supported(config)
    zero = config.zero_optimization
    # stage 3: the dense parameters partitioned (stage3/), the experts at stage 2 over their expert-data-parallel
    # group (whole on their ranks, gradients and optimizer state sharded): moe/sharding.py's module docstring
    policy = ReducePolicy.for_stage(min(config.stage, 2), zero.reduce_scatter)
    dense, by_size = experts.split(groups)
    parts, expert_units = [], {}
    if config.stage == 3:
        parts.append(build_stage3_sharding(model, dense, config, process_group, whole, arithmetic,
                                           round_views=round_views, exclude=frozenset(experts.ep_size_of())))
    for group, part_groups, size in [(process_group, dense, None)] * (config.stage < 3) + \
            [(experts.groups[s].expert_data_parallel, by_size[s], s) for s in sorted(by_size)]:
        buckets = build_buckets(part_groups, policy, group, zero.reduce_bucket_size, whole, arithmetic,
                                round_views=round_views)
        # the expert part reduces after backward: [Note: expert reductions wait for backward] in moe/sharding.py
        parts.append(GradReducer(buckets, group, zero.overlap_comm, policy, zero.allgather_bucket_size,
                                 launch_in_backward=size is None))
        if size is not None:
            expert_units.update({id(b): size for b in buckets})
    return ExpertParallelSharding(parts, process_group, experts), ExpertNorm(expert_units, experts)


def _strategy(model: nn.Module, groups: list[list[nn.Parameter]], whole: list[bool], config: ZeroConfig,
              process_group: comm.ProcessGroup, arithmetic: GradArithmetic, round_views: bool) -> ShardingStrategy:
    """The strategy for the configured stage (seams.ShardingStrategy); `whole[g]`: group g's units
    are laid out in whole tensors per rank; `arithmetic`: how gradients are accumulated and reduced;
    `round_views`: stages 2-3 hand autograd views of each round's gradient buffer (placement.py)."""
    zero = config.zero_optimization
    if config.stage == 3:
        return build_stage3_sharding(model, groups, config, process_group, whole, arithmetic, round_views=round_views)
    policy = ReducePolicy.for_stage(config.stage, zero.reduce_scatter)
    buckets = build_buckets(groups, policy, process_group, zero.reduce_bucket_size, whole, arithmetic,
                            round_views=round_views)
    return GradReducer(buckets, process_group, zero.overlap_comm, policy, zero.allgather_bucket_size)
