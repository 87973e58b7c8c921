"""The fixture scripts' runs: one case = a script, its arguments and a world size of 2.

Shared by the test (`tests/e2e/test_deepspeed_scripts.py`, zerodp through `python -m zerodp.deepspeed.run`)
and the recorder (`record_deepspeed.py`, real DeepSpeed 0.19.8 in the bench venv), so both run the same
command. Sizes are tiny so that a case takes seconds on 2 CPU cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
EXPECTED = HERE / "expected_deepspeed.json"
SEED = 0  # SEED_AT_START for the shim (the CIFAR script never seeds torch)

_SDMA_SIZES = ["--vocab_size", "64", "--hidden_size", "32", "--num_layers", "2", "--num_heads", "2",
               "--max_seq_len", "16", "--num_samples", "16", "--train_steps", "4"]


class Case(NamedTuple):
    name: str
    script: str           # file in this folder, byte-identical to its source (SOURCES.md)
    args: tuple           # "{config:NAME}" is replaced by the path of configs()[NAME] written to a temp dir
    bf16: bool = False    # compare with bf16's tolerance
    default: bool = True  # in the default suite (False: only with ZERODP_ALL_SCRIPT_STAGES=1)
    reference: str = "deepspeed"  # or "plain": plain PyTorch (test_deepspeed_scripts.plain_sdma_losses)


CASES = [
    *[Case(f"cifar10-fp32-stage{s}", "cifar10_deepspeed.py", ("--epochs", "2", "--dtype", "fp32", "--stage", str(s)),
           default=s == 3) for s in range(4)],
    Case("cifar10-bf16-stage2", "cifar10_deepspeed.py", ("--epochs", "2", "--dtype", "bf16", "--stage", "2"),
         bf16=True, default=False),
    Case("sdma-zero3-bf16", "sdma_train_zero3.py", (*_SDMA_SIZES, "--deepspeed_config", "{config:bf16}"), bf16=True),
    Case("sdma-zero3-fp32", "sdma_train_zero3.py", (*_SDMA_SIZES, "--deepspeed_config", "{config:fp32}"),
         default=False),
    # lr 0: the bf16 weights never change, so every loss is plain PyTorch's bf16 forward of the initial
    # weights, bitwise (DeepSpeed 0.19.8 on CPU is 1-2 bf16 ulps off it from the second step on)
    Case("sdma-zero3-bf16-lr0", "sdma_train_zero3.py", (*_SDMA_SIZES, "--deepspeed_config", "{config:bf16_lr0}"),
         bf16=True, reference="plain"),
]


def configs() -> dict:
    """The sdma script's configs: its repository's ds_config_zero3.json as published (bf16), and the same
    with bf16 off and a larger lr (1e-3, warmup 2 steps) so that fp32 steps move the weights visibly."""
    bf16 = json.loads((HERE / "sdma_ds_config_zero3.json").read_text())
    fp32 = json.loads(json.dumps(bf16))
    fp32["bf16"]["enabled"] = False
    fp32["optimizer"]["params"]["lr"] = 1e-3
    fp32["scheduler"]["params"].update(warmup_max_lr=1e-3, warmup_num_steps=2)
    bf16_lr0 = json.loads(json.dumps(bf16))
    bf16_lr0["optimizer"]["params"]["lr"] = 0.0
    bf16_lr0["scheduler"]["params"]["warmup_max_lr"] = 0.0
    return {"bf16": bf16, "fp32": fp32, "bf16_lr0": bf16_lr0}


def command_args(case: Case, tmp: Path) -> list:
    """The script path and its arguments, configs written under `tmp`."""
    out = [str(HERE / case.script)]
    for arg in case.args:
        if arg.startswith("{config:"):
            name = arg[len("{config:"):-1]
            path = tmp / f"ds_config_{name}.json"
            path.write_text(json.dumps(configs()[name]))
            arg = str(path)
        out.append(arg)
    return out
