"""Measuring the model-state bytes a rank holds, next to the ZeRO paper's prediction for them.

Measured: the storage actually allocated for parameters (flat buffers or shards), gradients
(persistent buffers or shards) and optimizer state (separate fp32 masters plus moment tensors).
Predicted: `memory.predict_model_state_bytes` with Ψ = trainable elements, the precision's byte
sizes, and K = master bytes (4 with mixed precision, 0 when the master aliases fp32 parameters) plus
4 bytes per optimizer state element. Padding to a multiple of the world size is the only expected
difference. Frozen parameters are reported apart: they are not in the paper's Ψ.

Whole-tensor units (Muon, Adafactor: flat/whole_tensor_layout.py) break the even split: a rank
owns whole tensors, so its optimizer bytes follow what it owns, not Ψ/N. Their optimizer prediction
is per owned tensor (master bytes plus `whole_tensor_state_numel`), and `owned_numel` /
`fair_numel` report this rank's elements against the even share, the imbalance of ownership. At
stage 3 the parameter and gradient shards of whole-tensor units are the owned tensors themselves
(unequal, unpadded shards balanced across units), and their prediction follows them too.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from ..optim.inner import members, state_numel_per_param, streamed_state_names, whole_tensor_state_numel
from .model_states import ModelStateBytes, predict_model_state_bytes


@dataclass(frozen=True)
class MemoryReport:
    """One rank's model-state memory."""

    rank: int
    world_size: int
    stage: int
    numel: int                  # Ψ: trainable parameter elements (tied parameters once)
    padding_numel: int          # elements added to make shards even
    measured: ModelStateBytes
    predicted: ModelStateBytes
    frozen_param_bytes: int
    rss_bytes: int
    disk_bytes: int = 0            # offloaded optimizer state and parameter shards in files (nvme)
    disk_bytes_predicted: int = 0
    owned_numel: int = 0           # parameter elements whose optimizer state this rank holds
    fair_numel: int = 0            # the even share: Ψ/N (Ψ at stage 0)

    def as_dict(self) -> dict:
        out = {"rank": self.rank, "world_size": self.world_size, "stage": self.stage, "numel": self.numel,
               "padding_numel": self.padding_numel, "frozen_param_bytes": self.frozen_param_bytes,
               "rss_bytes": self.rss_bytes, "disk_bytes": self.disk_bytes,
               "disk_bytes_predicted": self.disk_bytes_predicted, "owned_numel": self.owned_numel,
               "fair_numel": self.fair_numel}
        for kind in ("params", "grads", "optimizer"):
            out[f"{kind}_bytes"] = getattr(self.measured, kind)
            out[f"{kind}_bytes_predicted"] = getattr(self.predicted, kind)
        return out


def measure_memory(engine) -> MemoryReport:
    """Build the `MemoryReport` of `engine` on this rank."""
    units = engine.units
    numel = sum(u.layout.numel for u in units)
    padding = sum(u.layout.padded_numel - u.layout.numel for u in units)
    params = sum(u.param_bytes() for u in units)  # held now: offloaded shards (offload_param) do not count
    grads = sum(u.grad_bytes() for u in units)
    optimizer = engine.optimizer.state_bytes()
    # Frozen parameters: stage 3 shards them into frozen units; other stages keep them whole.
    frozen_units = engine.sharding.frozen_units
    in_units = {id(p) for u in list(units) + list(frozen_units) for p in u.params}
    frozen = sum(u.param_bytes() for u in frozen_units) + sum(
        p.numel() * p.element_size() for p in engine.module.parameters() if id(p) not in in_units)
    precision = engine.precision
    elem = precision.param_dtype.itemsize
    grad_elem = (precision.grad_accum_dtype or precision.param_dtype).itemsize  # data_types.grad_accum_dtype
    master = 0 if engine.placement.masters_are_shards else precision.master_dtype.itemsize  # a separate copy
    user_members = members(engine.user_optimizer)
    whole = [u for u in units if u.layout.whole_tensors]
    flat_members = {id(user_members[u.group_index]): user_members[u.group_index] for u in units if u not in whole}
    k_values = {master + 4 * state_numel_per_param(m) for m in flat_members.values()}
    k = max(k_values) if k_values else master
    predicted = predict_model_state_bytes(numel, engine.world_size, engine.stage, param_bytes=elem,
                                          grad_bytes=grad_elem, optimizer_bytes=k)
    owned = sum(seg.numel for u in units for seg in u.layout.segments(u.shard_index))
    if whole or len(k_values) > 1:  # per unit: the flat units' share, and the whole tensors this rank owns
        optimizer_predicted = 0
        for u in units:
            member = user_members[u.group_index]
            if u not in whole:  # elementwise: the whole shard, padding included, as the paper's Ψ/N
                optimizer_predicted += (master + 4 * state_numel_per_param(member)) * u.layout.shard_numel
                continue
            # a separate master copies the whole shard (stage 3: exactly the owned tensors, see below)
            optimizer_predicted += master * u.layout.shard_size(u.shard_index)
            for seg in u.layout.segments(u.shard_index):  # state: per tensor this rank owns, no padding
                optimizer_predicted += 4 * whole_tensor_state_numel(member, u.layout.shapes[seg.param_index])
        predicted = ModelStateBytes(predicted.params, predicted.grads, optimizer_predicted)
    if whole and engine.stage == 3:
        # stage 3's whole-tensor shards hold exactly the tensors this rank owns (unequal shards, balanced
        # across units), so parameter and gradient shards follow ownership too, not Psi/N
        shard_numel = sum(u.layout.shard_size(u.shard_index) for u in units)
        predicted = ModelStateBytes(elem * shard_numel, grad_elem * shard_numel, predicted.optimizer)
    disk = disk_predicted = 0
    if engine.optimizer.offload is not None:  # offload: the elementwise state's host part, and disk bytes
        from ..offload.footprint import offload_report_bytes

        if whole or len(k_values) > 1:
            optimizer_predicted, disk_predicted = _offload_by_member(engine, units, user_members, master)
        else:
            optimizer_predicted, disk_predicted = offload_report_bytes(engine, numel, master, k - master)
        predicted = ModelStateBytes(predicted.params, predicted.grads, optimizer_predicted)
        disk = engine.optimizer.offload.disk_bytes()
    shards = engine.sharding.param_offload()
    if shards is not None:  # offload_param: at most max_in_cpu elements of this rank's shard stay in memory
        from ..offload.footprint import param_offload_report_bytes

        params_predicted, param_disk_predicted = param_offload_report_bytes(engine, numel, elem, shards.limit_numel)
        predicted = ModelStateBytes(params_predicted, predicted.grads, predicted.optimizer)
        disk += shards.disk_bytes
        disk_predicted += param_disk_predicted
        if shards.grad_disk_bytes is not None:  # fp32 nvme: the gradient shards too, bounded the same way
            disk += shards.grad_disk_bytes
            disk_predicted += param_disk_predicted
            predicted = ModelStateBytes(predicted.params, params_predicted, predicted.optimizer)
    return MemoryReport(engine.rank, engine.world_size, engine.stage, numel, padding,
                        ModelStateBytes(params, grads, optimizer), predicted, frozen,
                        psutil.Process().memory_info().rss, disk, int(disk_predicted), owned,
                        -(-numel // engine.world_size) if engine.stage >= 1 else numel)


def _offload_by_member(engine, units, user_members, master: int) -> tuple[float, float]:
    """(host, disk) bytes predicted for offload_optimizer with whole-tensor units or several optimizers.

    The offloaded stream is this rank's chunks: elementwise shards whole, whole-tensor units' owned
    tensors; the store keeps one region per streamed state name over the whole stream (with Muon +
    AdamW: momentum_buffer, exp_avg, exp_avg_sq). Resident: separate masters, and whole-tensor state
    of another shape (Adafactor's row and column moments)."""
    from ..offload.footprint import offload_report_bytes

    stream, names, resident, largest = 0, set(), 0, 0
    for u in units:
        member = user_members[u.group_index]
        resident += master * u.layout.shard_size(u.shard_index)
        if not u.layout.whole_tensors:
            stream += u.layout.shard_numel
            names.update(streamed_state_names(member, (u.layout.shard_numel,)))
            continue
        for seg in u.layout.segments(u.shard_index):
            shape = u.layout.shapes[seg.param_index]
            stream += seg.numel
            largest = max(largest, seg.numel)
            streamed = streamed_state_names(member, shape)
            names.update(streamed)
            resident += 4 * (whole_tensor_state_numel(member, shape) - seg.numel * len(streamed))
    host, disk = offload_report_bytes(engine, stream, 0, 4 * len(names), shard_numel=stream, largest_chunk=largest)
    return host + resident, disk
