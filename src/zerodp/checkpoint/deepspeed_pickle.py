"""DeepSpeed's pickled checkpoint files without DeepSpeed: `load_deepspeed_file` (reading, never running code) and
`save_deepspeed_file` (writing DeepSpeed's class names).

DeepSpeed `torch.save`s plain containers and tensors, plus a few of its own objects: the loss scaler
(`deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`), the ZeRO stage (`ZeroStageEnum`), the
fragment addresses of `param_slice_mappings` (`deepspeed.utils.tensor_fragment.fragment_address`). Two ways to read
them, both refused here:
  - `torch.load(weights_only=False)` imports those classes (DeepSpeed is not installed where zerodp resumes, so it
    fails) and, worse, runs whatever callable a pickle names: a downloaded checkpoint could run code.
  - `torch.load(weights_only=True)` rejects the DeepSpeed classes.
So the file is read with torch's weights-only unpickler, and every `deepspeed.*` class the pickle names (found by
scanning its opcodes first) is allowlisted under its name as an inert `DeepSpeedRecord`, which keeps the
constructor arguments (`args`: an enum's value, a named tuple's fields) and the attributes (`__dict__`: the loss
scaler's `cur_scale`, ...) and runs nothing. A user's own object in the client state (DeepSpeed merges the client
state into `mp_rank_00_model_states.pt`) stays refused, with torch's message naming its class: allowlist it with
`torch.serialization.add_safe_globals([TheClass])`, as for any weights-only load.

Writing: DeepSpeed's loader assigns the pickled loss scaler to its optimizer and calls its methods, so a checkpoint
for DeepSpeed must name DeepSpeed's classes. `LossScaler`, `DynamicLossScaler` and `fragment_address` below hold
DeepSpeed's attributes (runtime/fp16/loss_scaler.py, utils/tensor_fragment.py of 0.19.8) and are pickled under
DeepSpeed's module names (`save_deepspeed_file`): DeepSpeed unpickles its own classes, zerodp's `deepspeed` alias
these (zerodp.deepspeed.runtime.fp16.loss_scaler re-exports them), and `load_deepspeed_file` records.
"""

from __future__ import annotations

import dataclasses
import pickle
import pickletools
import re
import types
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..errors import CheckpointError


class DeepSpeedRecord:
    """An inert stand-in for one of DeepSpeed's pickled objects: `args` (constructor arguments) and attributes."""

    ds_class = "deepspeed.?"

    def __new__(cls, *args):
        record = object.__new__(cls)
        record.args = args
        return record

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "args"}
        return f"<{self.ds_class} args={self.args} {fields}>"


_RECORDS: dict[str, type] = {}


def _record_class(qualified: str) -> type:
    if qualified not in _RECORDS:
        _RECORDS[qualified] = type(qualified.rsplit(".", 1)[-1], (DeepSpeedRecord,), {"ds_class": qualified})
    return _RECORDS[qualified]


def _deepspeed_globals(path: Path) -> set[str]:
    """The `deepspeed.*` globals a torch.save file's pickle names (torch.save writes protocol 2: GLOBAL opcodes)."""
    with zipfile.ZipFile(path) as archive:
        name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
        if name is None:
            raise CheckpointError(f"{path} is not a torch.save file (no data.pkl inside)")
        data = archive.read(name)
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            qualified = arg.replace(" ", ".")
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:  # protocol 4+: module and name pushed before
            qualified = f"{strings[-2]}.{strings[-1]}"
        else:
            if isinstance(arg, str):
                strings.append(arg)
            continue
        if qualified.startswith("deepspeed."):
            found.add(qualified)
    return found


def load_deepspeed_file(path) -> Any:
    """The object DeepSpeed saved in `path`, read weights-only with DeepSpeed's classes as `DeepSpeedRecord`s."""
    path = Path(path)
    try:
        names = _deepspeed_globals(path)
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable torch.save file ({err}); the checkpoint is damaged or "
                              f"still being written") from None
    stand_ins = [(_record_class(n), n) for n in sorted(names)]
    try:
        with torch.serialization.safe_globals(stand_ins):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL (\S+)", str(err))  # torch names the refused class: "Unsupported global: GLOBAL x.Y"
        what = named.group(1) if named else str(err).splitlines()[0]
        raise CheckpointError(f"{path} holds an object zerodp does not unpickle (it never runs a checkpoint's code): "
                              f"{what}. If it is your own client state's class, allowlist it with "
                              f"torch.serialization.add_safe_globals([YourClass]) before loading") from None


def record_value(record: Any) -> Any:
    """An enum record's value (`ZeroStageEnum.gradients` -> 2); anything else unchanged."""
    return record.args[0] if isinstance(record, DeepSpeedRecord) and len(record.args) == 1 else record


# -- writing DeepSpeed's names ----------------------------------------------------------------------


class LossScaler:
    """DeepSpeed's static loss scaler, as its checkpoints pickle it (`cur_scale`, `dynamic`)."""

    DEEPSPEED_NAME = "deepspeed.runtime.fp16.loss_scaler.LossScaler"

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)
        self.dynamic = False

    @property
    def loss_scale(self) -> float:
        return self.cur_scale


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler's state (`cur_iter`, `last_overflow_iter`, `cur_hysteresis`, ...)."""

    DEEPSPEED_NAME = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


@dataclasses.dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's name, a dataclass there too)
    """A parameter's piece of a rank's flat partition (DeepSpeed's param_slice_mappings entries)."""

    numel: int
    start: int
    DEEPSPEED_NAME: ClassVar[str] = "deepspeed.utils.tensor_fragment.fragment_address"


class _DeepSpeedNamesPickler(pickle._Pickler):
    """A pickler (the pure-Python one: its save_global can be overridden) writing DeepSpeed's names for the classes
    above; torch.save's protocol 2 names a class with one GLOBAL opcode."""

    def save_global(self, obj, name=None):
        deepspeed_name = getattr(obj, "DEEPSPEED_NAME", None) if isinstance(obj, type) else None
        if deepspeed_name is None:
            return super().save_global(obj, name)
        module, qualname = deepspeed_name.rsplit(".", 1)
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("zerodp_deepspeed_pickle")
_PICKLE_MODULE.Pickler = _DeepSpeedNamesPickler
_PICKLE_MODULE.Unpickler = pickle.Unpickler


def save_deepspeed_file(obj: Any, path) -> None:
    """torch.save `obj` to `path` (protocol 2, as DeepSpeed's files are), naming the classes above as DeepSpeed's."""
    torch.save(obj, path, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
