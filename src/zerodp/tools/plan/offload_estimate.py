"""`zerodp estimate --offload`'s table: where the model states of an offloaded run would live, per rank and
stage (device memory, host memory, disk), from the tier arithmetic of offload/footprint.py."""

from __future__ import annotations

from ...offload.footprint import OffloadBytes, predict_offload_bytes, predict_param_offload_bytes  # noqa: F401


def render_offload_estimate(numel: float, world_size: int, precision_bytes: tuple[int, int, int], n_states: int,
                            device: str, stages: tuple[int, ...], sub_group_size: float, buffer_count: int,
                            param_device: str = "none", max_in_cpu: float = 1e9) -> str:
    """The per-stage table of device / host / disk bytes per rank for `zerodp estimate --offload` and
    `--offload-param` (`device` or `param_device` may be 'none')."""
    p, g, k = precision_bytes
    state = 4 * n_states
    master = k - state
    lines = []
    if device != "none":
        lines.append(f"with offload_optimizer.device={device}: the optimizer's elementwise state ({state} bytes per "
                     f"element) leaves the device; the fp32 master ({master} bytes) stays with the parameters "
                     f"(nvme: sub_group_size={sub_group_size:.3g}, buffer_count={buffer_count})")
    if param_device != "none":
        lines.append(f"with offload_param.device={param_device} (stage 3 only): the parameter shard ({p} bytes per "
                     f"element{', also the fp32 master' if master == 0 else ''}) leaves the device (nvme: at most "
                     f"max_in_cpu={max_in_cpu:.3g} elements cached in host memory)")
        if param_device == "nvme" and master == 0:
            lines.append("  and, in fp32, so does the gradient shard (as many bytes, cached the same way)")
    lines += ["(without a GPU, device and host are the same memory)",
              "| stage | device (GB) | host (GB) | disk (GB) |", "|---|---|---|---|"]
    for stage in stages:
        if stage == 0 and device != "none":
            lines.append("| 0 | offload_optimizer needs stage 1-3 | | |")
            continue
        if stage != 3 and param_device != "none":
            lines.append(f"| {stage} | offload_param needs stage 3 | | |")
            continue
        shard = numel / world_size
        params = numel * p / (world_size if stage >= 3 else 1)
        grads = numel * g / (world_size if stage >= 2 else 1)
        host = disk = 0.0
        device_bytes = grads + shard * master
        if device != "none":
            tiers = predict_offload_bytes(shard, state, device, 1.0, sub_group_size, buffer_count)
            host, disk = tiers.host, tiers.disk
        else:
            device_bytes += shard * state
        if param_device != "none":
            tiers = predict_param_offload_bytes(shard, p, param_device, max_in_cpu)
            host, disk = host + tiers.host, disk + tiers.disk
            if param_device == "nvme" and master == 0:  # fp32: the gradient shard goes to nvme too
                device_bytes -= grads
                host, disk = host + tiers.host, disk + tiers.disk
        else:
            device_bytes += params
        lines.append(f"| {stage} | {device_bytes / 1e9:.3g} | {host / 1e9:.3g} | {disk / 1e9:.3g} |")
    return "\n".join(lines)
