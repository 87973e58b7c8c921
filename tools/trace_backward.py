"""Which zerodp modules and packages one `engine.backward` crosses: the call trace behind issue 43's
"a stage-2 backward crosses N modules in M packages with K package switches".

    .venv/bin/python tools/trace_backward.py                 # stages 1, 2 and 3, world 1, fp32
    .venv/bin/python tools/trace_backward.py --stage 2 --host-staging --bf16 --list

One process (world 1, zerodp's own group), the tests' ParityNet with small buckets (several of them), two
warm-up steps (stages 0-1 learn their bucket triggers), then the boundary micro-step's backward is traced
with `sys.setprofile`: every Python call and return whose frame belongs to a `zerodp` module.

  modules    distinct zerodp modules with a Python frame during the backward
  packages   distinct packages of those modules (the module name without its last part)
  switches   how often control passed between packages: each call into, and each return back to, a
             frame of another package than the one running (calls into torch or other libraries are not
             counted; a zerodp frame called from torch's autograd engine counts from the last zerodp package)

`--host-staging` forces ZeRO-Offload's GPU placement on the CPU (masters apart, gradients staged on the host:
tests/unit/test_placement.py does the same) with offload_optimizer cpu, so the host copy's path is traced too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests.dist.common: the parity model and data

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _package(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else module


def trace(stage: int, bf16: bool = False, host_staging: bool = False) -> dict:
    """Train two steps, then trace the third step's backward; the counts (module docstring)."""
    import zerodp
    import zerodp.engine.zero_engine as engine_module
    from zerodp.offload.placement import HOST, Home
    from tests.dist.common import global_batch, make_model, make_optimizer

    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": bf16}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
    original = engine_module.placement_of
    if host_staging:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        dtype = torch.bfloat16 if bf16 else torch.float32
        engine_module.placement_of = lambda config, device: dataclasses.replace(
            original(config, device), masters_are_shards=False, grad_staging=Home(HOST, dtype),
            param_staging=Home(HOST, dtype))
    calls: Counter = Counter()
    functions: Counter = Counter()  # (module, function) -> calls
    sequence: list[str] = []  # the package running after each zerodp call or return
    try:
        model = make_model()
        with zerodp.initialize(model, make_optimizer("adamw", model), cfg) as engine:
            for step in range(3):
                x, y = global_batch(step, 4)
                loss = F.mse_loss(engine(x).float(), y)
                if step == 2:
                    def profile(frame, event, arg):
                        if event not in ("call", "return"):
                            return
                        module = frame.f_globals.get("__name__", "")
                        if not module.startswith("zerodp"):
                            return
                        if event == "call":
                            calls[module] += 1
                            functions[module, frame.f_code.co_name] += 1
                            sequence.append(_package(module))
                        else:  # back to the caller, if it is zerodp's
                            back = frame.f_back
                            caller = back.f_globals.get("__name__", "") if back is not None else ""
                            if caller.startswith("zerodp"):
                                sequence.append(_package(caller))
                    sys.setprofile(profile)
                    try:
                        engine.backward(loss)
                    finally:
                        sys.setprofile(None)
                else:
                    engine.backward(loss)
                engine.step()
    finally:
        engine_module.placement_of = original
    switches = sum(1 for a, b in zip(sequence, sequence[1:]) if a != b)
    packages = Counter()
    for module, n in calls.items():
        packages[_package(module)] += n
    return {"modules": calls, "packages": packages, "switches": switches, "functions": functions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, action="append", help="stage(s) to trace (default: 1, 2, 3)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--host-staging", action="store_true", help="ZeRO-Offload's host step, forced on the CPU")
    parser.add_argument("--list", action="store_true", help="list the modules with their call counts")
    parser.add_argument("--functions", action="store_true", help="with --list: each module's functions too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for stage in args.stage or [1, 2, 3]:
        counts = trace(stage, args.bf16, args.host_staging)
        tag = f"stage {stage}" + (" bf16" if args.bf16 else "") + (" host-staging" if args.host_staging else "")
        print(f"{tag}: {len(counts['modules'])} modules in {len(counts['packages'])} packages, "
              f"{counts['switches']} package switches, {sum(counts['modules'].values())} calls")
        if args.list:
            for module, n in sorted(counts["modules"].items()):
                print(f"    {n:6d}  {module}")
                for (m, function), k in sorted(counts["functions"].items()):
                    if m == module and args.functions:
                        print(f"              {k:6d}  {function}")


if __name__ == "__main__":
    main()
