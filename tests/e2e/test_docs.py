"""docs/config.md is generated from the pydantic models; this test fails when it is stale.

Regenerate with:  .venv/bin/python -m tests.e2e.test_docs
"""

from __future__ import annotations

from pathlib import Path

from zerodp.config.schema import _NOT_SUPPORTED, ZeroConfig, reference_markdown
from zerodp.config.compat import compat_markdown

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
HEADER = """# Configuration reference

Generated from the pydantic models in `src/zerodp/config/` by `zerodp.config.reference_markdown()`;
do not edit by hand. Regenerate with `.venv/bin/python -m tests.e2e.test_docs` (a test fails when
this file is stale).

A config is a dict, or a `.json` / `.yaml` file; DeepSpeed's key names are accepted where they mean
the same thing, and an unknown key is an error that names the closest valid one.

"""


def _honoured_keys(model=ZeroConfig, prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields") and name not in ("optimizer", "scheduler"):
            keys += _honoured_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def render_config_doc() -> str:
    refused = {f"zero_optimization.{k}": v for k, v in _NOT_SUPPORTED.items()}
    return HEADER + reference_markdown() + "\n\n" + compat_markdown(_honoured_keys(), refused) + "\n"


def test_config_doc_is_current():
    assert CONFIG_DOC.exists(), "docs/config.md is missing; run .venv/bin/python -m tests.e2e.test_docs"
    assert CONFIG_DOC.read_text() == render_config_doc(), \
        "docs/config.md is stale; run .venv/bin/python -m tests.e2e.test_docs"


if __name__ == "__main__":
    CONFIG_DOC.write_text(render_config_doc())
    print(f"wrote {CONFIG_DOC}")
