"""The docs' structure (issue 43): README.md is a front page, and what README.md and docs/*.md point at exists.

- README.md has at most 200 lines; the long sections live in docs/, and its Docs index links every docs/ page.
- Every relative link `[text](path#anchor)` in README.md and docs/*.md names an existing file, and an anchor
  into a markdown file names one of its headings (GitHub's slugs).
- Every row of docs/guarantees.md names at least one test, and every test path it names exists (a glob such as
  `tests/dist/test_stage3_*.py` must match a file).
- Every source path the docs name exists: `src/zerodp/...` and `zerodp/...` exactly; a shorter `pkg/module.py`
  under src/zerodp, or the repository root.
- docs/layout.md's tree names every entry at the top of src/zerodp and every package of shard/, adapters/, tools/.
- Every dotted name `zerodp.x.y` the docs name exists: a module file, then a name its source defines or imports
  (`zerodp.optim.LARC`), read without importing.

No process group, no import of zerodp: milliseconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
GUARANTEES = ROOT / "docs" / "guarantees.md"
MAX_README_LINES = 200

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def _text(path: Path) -> str:
    return path.read_text()


def _headings(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lowercased, punctuation dropped, spaces to hyphens."""
    out, seen = set(), {}
    for line in CODE_FENCE.sub("", _text(path)).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _relative_links(path: Path) -> list[str]:
    text = CODE_FENCE.sub("", _text(path))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:


def test_readme_is_a_front_page():
    lines = _text(README).count("\n")
    assert lines <= MAX_README_LINES, (f"README.md has {lines} lines; the front page keeps to {MAX_README_LINES}: "
                                       "move the long sections to docs/ and link them from README's Docs index")


def test_the_docs_index_links_every_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _relative_links(README)}
    unlinked = [p.name for p in DOCS[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs/ pages that README.md's Docs index does not link: {unlinked}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in _relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _headings(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist:\n  " + "\n  ".join(broken)


TEST_PATH = re.compile(r"(?<![\w/.-])tests/[\w/*.\-]*[\w/*]")


def test_every_guarantee_names_existing_tests():
    rows = [line for line in _text(GUARANTEES).splitlines()
            if line.startswith("|") and not re.match(r"^\|\s*(claim|-+)\s*\|", line)]
    assert len(rows) >= 40, f"docs/guarantees.md has {len(rows)} rows; the table was moved whole from the README"
    untested, missing = [], []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        paths = TEST_PATH.findall(cells[-1])
        if not paths:
            untested.append(cells[0][:80])
        for p in paths:
            if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()):
                missing.append(p)
    assert not untested, f"guarantees with no test named in their last cell: {untested}"
    assert not missing, f"docs/guarantees.md names tests that do not exist: {sorted(set(missing))}"


SRC = ROOT / "src"
PKG = SRC / "zerodp"
# `src/zerodp/a/b.py`, `zerodp/a/b.py`, `a/b.py` (a module named from its package's folder)
FULL_PATH = re.compile(r"(?<![\w/.-])(?:src/)?zerodp/[a-z_][\w/.\-]*\w/?")  # lowercase: not "zerodp/DeepSpeed"
SHORT_PATH = re.compile(r"(?<![\w/.<>-])(?:[A-Za-z_]\w*/)+[A-Za-z_]\w*\.py\b")
SHORT_PATH_BASES = [ROOT, PKG]  # `optim/step_plan.py`, `bench/generation.py`; `flat/x.py` is `shard/flat/x.py`
# paths in other projects' repositories, named where the docs say which scripts the tests copied from them
EXTERNAL = {"tests/torch_compile/test_compile.py": "DeepSpeed's repository",
            "training/offload_states/offload_states.py": "DeepSpeedExamples"}


def _source_paths(doc: Path) -> tuple[list[str], list[str]]:
    text = _text(doc)
    full = FULL_PATH.findall(text)
    short = [p for p in SHORT_PATH.findall(text) if not p.startswith(("zerodp/", "src/")) and p not in EXTERNAL]
    return full, short


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_source_paths_exist(doc: Path):
    full, short = _source_paths(doc)
    missing = [p for p in full if not (SRC / p.removeprefix("src/")).exists()]
    missing += [p for p in short if not any((base / p).exists() for base in SHORT_PATH_BASES)]
    assert not missing, (f"{doc.relative_to(ROOT)} names source paths that do not exist (moved? write the "
                         f"path of the new tree):\n  " + "\n  ".join(sorted(set(missing))))


DOTTED = re.compile(r"(?<![\w/.-])zerodp(?:\.[A-Za-z_]\w*)+")
# public names that are other modules' objects (sys.modules entries made at import), not files of their own
MODULE_ALIASES = {"zerodp.deepspeed": "zerodp.adapters.deepspeed",  # zerodp/adapters/__init__.py
                  "zerodp.config_vissl": "zerodp.config.vissl"}  # the former path, zerodp/config/vissl/__init__.py


def _module_file(module: str) -> Path | None:
    rel = Path(*module.split("."))
    for candidate in ((SRC / rel).with_suffix(".py"), SRC / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _resolves(name: str) -> bool:
    """Read, not imported (importing zerodp.adapters.hf alone costs transformers' import): the longest prefix
    of `name` that is a module must be a file, and each name after it must be a word of that module's source
    (defined or imported there)."""
    for public, real in MODULE_ALIASES.items():
        if name == public or name.startswith(public + "."):
            name = real + name[len(public):]
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is not None:
            source = path.read_text()
            return all(re.search(rf"\b{re.escape(attr)}\b", source) for attr in parts[cut:])
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_dotted_names_import(doc: Path):
    names = sorted(set(DOTTED.findall(_text(doc))))
    missing = [n for n in names if not _resolves(n)]
    assert not missing, f"{doc.relative_to(ROOT)} names zerodp objects that do not import: {missing}"


def test_the_checks_see_what_is_missing(tmp_path: Path):
    """The checkers fail on a broken link, a missing anchor, a missing path and a missing name."""
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## Some section, here\n\n[x](nowhere.md) [y](page.md#some-section-here) "
                    "[z](#no-such) `src/zerodp/no_such.py` `zerodp.no_such_thing`\n")
    assert _relative_links(page) == ["nowhere.md", "page.md#some-section-here", "#no-such"]
    assert _headings(page) == {"a-title", "some-section-here"}
    assert _source_paths(page)[0] == ["src/zerodp/no_such.py"]
    assert not _resolves("zerodp.no_such_thing") and not _resolves("zerodp.optim.NoSuchOptimizer")
    assert _resolves("zerodp.optim.LARC") and _resolves("zerodp.deepspeed.zero.Init")


def test_the_layout_maps_the_top_level():
    """docs/layout.md's tree names every entry at the top of src/zerodp, and every package in the folders that only
    group packages (shard/, adapters/, tools/); the packages' own docstrings map the rest (test_layering)."""
    text = _text(ROOT / "docs" / "layout.md")
    tree = text[text.index("```\nsrc/zerodp/"):]
    tree = tree[:tree.index("\n```", 4)]
    named = set(re.findall(r"^[ \t]*((?:[A-Za-z_]\w*(?:\.py|/)[ \t]*)+)", tree, flags=re.M))
    named = {n for group in named for n in group.split()}
    entries = {p.name + ("/" if p.is_dir() else "") for p in PKG.iterdir() if p.name != "__pycache__"}
    for folder in ("shard", "adapters", "tools"):
        entries |= {p.name + ("/" if p.is_dir() else "") for p in (PKG / folder).iterdir()
                    if p.name not in ("__pycache__", "__init__.py")}
    lacking = sorted(entries - named)
    assert not lacking, f"docs/layout.md's tree does not name {lacking}: add them where they belong in the tiers"
