"""Reading DeepSpeed's pickled checkpoint files without DeepSpeed, and without running code: `load_deepspeed_file`.

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
"""

from __future__ import annotations

import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

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
        raise CheckpointError(f"{path} holds an object zerodp does not unpickle (it never runs a checkpoint's code): "
                              f"{str(err).splitlines()[0]}. If it is your own client state's class, allowlist it "
                              f"with torch.serialization.add_safe_globals([YourClass]) before loading") from None


def record_value(record: Any) -> Any:
    """An enum record's value (`ZeroStageEnum.gradients` -> 2); anything else unchanged."""
    return record.args[0] if isinstance(record, DeepSpeedRecord) and len(record.args) == 1 else record
