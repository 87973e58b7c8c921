"""Several optimizers from the config: a list of `optimizer` sections over disjoint parameter sets.

    "optimizer": [
        {"type": "Muon",  "select": "matrices", "params": {"lr": 0.02, "momentum": 0.95}},
        {"type": "AdamW", "select": "rest",     "params": {"lr": 3e-4, "weight_decay": 0.1}}
    ]

This is how Muon is used (torch's Muon refuses parameters that are not 2-D). `select` picks each
section's trainable parameters:

    "matrices"   parameters of 2 or more dimensions except embedding tables (the weight of an
                 nn.Embedding, and any parameter tied to one, such as a tied output head)
    "rest"       every trainable parameter that no other section selects (one section at most)
    [globs]      parameters with a name matching one of the fnmatch patterns, e.g. ["blocks.*.weight"]
                 (a tied weight matches through any of its names)

Every trainable parameter must land in exactly one section: a parameter selected twice, a parameter
no section selects, or a section that selects nothing is one `OptimizerError` naming the parameters
and the sections. The sections become an `OptimizerList`, in config order, each built over its
parameters in model order; everything after that (whole-tensor groups, checkpoints) is the same as
for `zerodp.initialize(model, [Muon(...), AdamW(...)])`.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from ..errors import OptimizerError

MATRICES, REST = "matrices", "rest"


def _describe(k: int, section) -> str:
    return f"optimizer section {k} ({section.type}, select={section.select!r})"


def _names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _selects(section, p: nn.Parameter, names: list[str], embeddings: set[int]) -> bool:
    if section.select == MATRICES:
        return p.dim() >= 2 and id(p) not in embeddings
    return any(fnmatchcase(n, pattern) for n in names for pattern in section.select)


def select_parameters(sections: list, model: nn.Module) -> list[list[nn.Parameter]]:
    """The trainable parameters of each section, in model order (see the module docstring)."""
    rest = [k for k, s in enumerate(sections) if s.select == REST]
    if len(rest) > 1:
        raise OptimizerError(f"optimizer sections {rest} both select 'rest'; one section at most takes the rest")
    unselected = [k for k, s in enumerate(sections) if s.select is None]
    if unselected:
        raise OptimizerError(f"optimizer sections {unselected} have no 'select'; in a list of optimizer sections each "
                             f"says which parameters it takes: 'matrices', 'rest' or a list of name patterns")
    names = _names(model)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    chosen: list[list[nn.Parameter]] = [[] for _ in sections]
    overlaps, uncovered = [], []
    for p in trainable:
        takers = [k for k, s in enumerate(sections) if s.select != REST and _selects(s, p, names[id(p)], embeddings)]
        if not takers and rest:
            takers = rest
        if len(takers) > 1:
            overlaps.append(f"{names[id(p)][0]} (sections {takers})")
        elif not takers:
            uncovered.append(names[id(p)][0])
        else:
            chosen[takers[0]].append(p)
    problems = []
    if overlaps:
        problems.append(f"parameters selected by several sections: {', '.join(overlaps)}")
    if uncovered:
        problems.append(f"parameters no section selects: {', '.join(uncovered)} (add a section with "
                        f"select='rest')")
    empty = [_describe(k, s) for k, s in enumerate(sections) if not chosen[k] and not problems]
    if empty:
        problems.append(f"{', '.join(empty)} select no trainable parameter")
    if problems:
        raise OptimizerError("the config's optimizer sections must split the trainable parameters into disjoint "
                             "sets: " + "; ".join(problems))
    return chosen
