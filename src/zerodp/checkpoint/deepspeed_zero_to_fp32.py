#!/usr/bin/env python
"""zero_to_fp32.py: the whole fp32 model from a DeepSpeed-layout ZeRO checkpoint, offline, with torch alone.

zerodp (https://github.com/zerodp) copies this file beside `latest` when it saves a checkpoint in DeepSpeed's layout,
where DeepSpeed puts its own script of that name; it is zerodp's code and needs neither DeepSpeed nor zerodp:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_FILE [-t TAG] [--exclude_frozen_parameters]

CHECKPOINT_DIR holds `latest` and the tag folders; OUTPUT_FILE gets the state dict (torch.save, or safetensors for a
`.safetensors` name). It reads DeepSpeed 0.19.8's layout, whoever wrote it: stages 1-2 concatenate the ranks'
`single_partition_of_fp32_groups` and walk `param_shapes` through it; stage 3 joins each parameter's
ceil(numel / world) pieces of `fp32_flat_groups`; buffers come from the module state, frozen parameters from
`frozen_param_fragments` (or the module at stage 1), tied names from `shared_params`. Files are read with torch's
weights-only unpickler; DeepSpeed's own classes (the loss scaler) are read as inert records, so no code in a
checkpoint runs.
"""

import argparse
import math
import pickletools
import re
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class _Record:
    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)


def _load(path):
    """torch.load, weights only, with every `deepspeed.*` class of the pickle read as a record."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    names = {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data)
             if op.name == "GLOBAL" and arg.startswith("deepspeed")}
    stand_ins = [(type(n.rsplit(".", 1)[1], (_Record,), {}), n) for n in sorted(names)]
    with torch.serialization.safe_globals(stand_ins):
        return torch.load(path, map_location="cpu", weights_only=True)


def _stage(value):
    return int(value.args[0]) if isinstance(value, _Record) else int(value)


def get_fp32_state_dict(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The fp32 state dict of checkpoint `tag` (default: the one `latest` names) in `checkpoint_dir`."""
    checkpoint_dir = Path(checkpoint_dir)
    if tag is None:
        tag = (checkpoint_dir / "latest").read_text().strip()
    folder = checkpoint_dir / tag
    optim_paths = sorted((p for p in folder.iterdir() if _OPTIM.match(p.name)),
                         key=lambda p: int(_OPTIM.match(p.name).group(2)))
    if not optim_paths:
        raise SystemExit(f"{folder} has no zero_pp_rank_*_optim_states.pt files: not a DeepSpeed ZeRO checkpoint")
    optims = [_load(p)["optimizer_state_dict"] for p in optim_paths]
    stage, world = _stage(optims[0]["zero_stage"]), len(optims)
    model_paths = ([folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage >= 3
                   else [folder / "mp_rank_00_model_states.pt"])
    models = [_load(p) for p in model_paths]
    first = models[0]
    out = OrderedDict((k, v.float() if v.is_floating_point() else v) for k, v in first["module"].items()
                      if k in set(first.get("buffer_names") or []))
    if not exclude_frozen_parameters:
        frozen = first.get("frozen_param_shapes")
        if frozen:
            for name, shape in frozen.items():
                pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
                out[name] = torch.cat(pieces)[:math.prod(shape)].view(shape).float()
        elif stage < 3:  # stage 1 records no frozen shapes: the module's other entries are the frozen parameters
            trainable = {n for group in first["param_shapes"] for n in group} | set(first.get("shared_params") or {})
            for k, v in first["module"].items():
                if k not in trainable and k not in out:
                    out[k] = v.float()
    for g, shapes in enumerate(first["param_shapes"]):
        offset = 0
        if stage >= 3:
            parts = [o["fp32_flat_groups"][g] for o in optims]
            for name, shape in shapes.items():
                numel = math.prod(shape)
                piece = math.ceil(numel / world)
                out[name] = torch.cat([p[offset:offset + piece] for p in parts])[:numel].view(shape).clone()
                offset += piece
        else:
            flat = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optims])
            paddings = optims[0].get("param_alignment_paddings")
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                out[name] = flat[offset:offset + numel].view(shape).clone()
                offset += numel + (paddings[g][i] if paddings else 0)
    for alias, name in (first.get("shared_params") or {}).items():
        if name in out:
            out[alias] = out[name]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the fp32 weights of a DeepSpeed-layout ZeRO checkpoint.")
    parser.add_argument("checkpoint_dir", help="the folder holding `latest` and the tag folders")
    parser.add_argument("output_file", help="where the state dict goes (.safetensors: safetensors; else torch.save)")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint's tag (default: the one `latest` names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    args = parser.parse_args(argv)
    state = get_fp32_state_dict(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
    if args.output_file.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in state.items()}, args.output_file)
    else:
        torch.save(state, args.output_file)
    print(f"wrote {len(state)} tensors to {args.output_file}")


if __name__ == "__main__":
    main()
