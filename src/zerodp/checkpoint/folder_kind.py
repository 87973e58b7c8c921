"""What a folder handed to a load holds, in words, with the way forward: `describe_folder`.

A load that finds no checkpoint it can read says what it found instead (issue 40): another tool's format, a save
that never finished, a weights-only folder, or nothing known, never a bare "tag not found". The kinds, by the files
that mark them:
    zerodp          <tag>/meta.json (and `latest`); .tmp-<tag>/ alone is a save that died before its commit
    DeepSpeed ZeRO  <tag>/*mp_rank_*_model_states.pt and *zero_pp_rank_*_optim_states.pt, `latest`
    DeepSpeed universal  <tag>/zero/<param>/fp32.pt, `latest_universal`
    torch DCP       .metadata (torch.distributed.checkpoint)
    Hugging Face    config.json with model*.safetensors or pytorch_model*.bin
    weights         *.safetensors, *.pt, *.pth, *.bin alone
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

_MODEL = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_WEIGHTS = (".safetensors", ".pt", ".pth", ".bin")


def _names(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir())
    except OSError:
        return []


def _deepspeed(folder: Path, names: list[str]) -> Optional[str]:
    models = [n for n in names if _MODEL.match(n)]
    optims = [n for n in names if _OPTIM.match(n)]
    if (folder / "zero").is_dir():
        if not models:
            return (f"a DeepSpeed universal checkpoint folder without its mp_rank_00_model_states.pt: "
                    f"ds_to_universal did not finish; convert it again")
        return None
    if not models and not optims:
        return None
    if not models:
        return (f"a DeepSpeed ZeRO checkpoint folder with optimizer files but no model states file "
                f"(mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt): it is incomplete (a save "
                f"that died, or a partial copy); copy the whole tag folder")
    if not optims:
        return (f"a DeepSpeed checkpoint folder with a model states file but no ZeRO optimizer files "
                f"(zero_pp_rank_<r>_mp_rank_00_optim_states.pt): either a save that died, or a checkpoint without ZeRO "
                f"(stage 0), which zerodp does not resume; load its weights with torch.load(...)['module'] and "
                f"model.load_state_dict, then train on")
    return None


def describe_folder(folder) -> str:
    """One sentence: what `folder` holds and what to do with it (for a load that cannot read it)."""
    folder = Path(folder)
    if not folder.exists():
        return f"{folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is a file, not a checkpoint folder; pass the folder the checkpoint was saved into"
    names = _names(folder)
    if not names:
        return f"{folder} is empty"
    if ".metadata" in names:
        return (f"{folder} is a torch.distributed.checkpoint (DCP) folder (it has a .metadata file); import it with "
                f"zerodp's DCP reader (docs/checkpoints.md, 'torch distributed checkpoint (DCP)')")
    if "latest_universal" in names or (folder / "zero").is_dir():
        problem = _deepspeed(folder, names)
        return (f"{folder} is {problem}" if problem else
                f"{folder} is a DeepSpeed universal checkpoint; pass the folder holding latest_universal, or its tag "
                f"folder")
    problem = _deepspeed(folder, names)
    if problem:
        return f"{folder} is {problem}"
    if any(_MODEL.match(n) for n in names):
        return f"{folder} is a DeepSpeed ZeRO checkpoint's tag folder"
    if "meta.json" in names:
        return f"{folder} is a zerodp checkpoint's tag folder"
    tmp = [n for n in names if n.startswith(".tmp-")]
    if tmp and not any((folder / n / "meta.json").is_file() for n in names if not n.startswith(".")):
        return (f"{folder} holds only a zerodp save that never completed ({tmp[0]}/: the run stopped before its "
                f"commit), so there is no checkpoint to resume; start from an earlier checkpoint, or from scratch")
    if "config.json" in names and any(n.startswith(("model", "pytorch_model")) and n.endswith((".safetensors", ".bin"))
                                      for n in names):
        return (f"{folder} is a Hugging Face model folder (config.json and weights): weights only, no optimizer "
                f"state; load it with from_pretrained and start a new run from it")
    weights = [n for n in names if n.endswith(_WEIGHTS)]
    if weights:
        return (f"{folder} holds weight files ({', '.join(weights[:3])}) but no training checkpoint: load them with "
                f"model.load_state_dict and start a new run from them")
    subfolders = [n for n in names if (folder / n).is_dir() and not n.startswith(".")]
    for sub in subfolders:  # a tag folder of a known kind, without the `latest` file that names it
        inner = describe_folder(folder / sub)
        if "checkpoint's tag folder" in inner or "DeepSpeed" in inner:
            return f"{folder} has no 'latest' file; {inner}: name it with tag={sub!r} (--tag {sub})"
    shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
    return (f"{folder} is in none of the formats zerodp reads (zerodp, DeepSpeed ZeRO or universal, torch DCP); it "
            f"holds: {shown}")
