"""DeepSpeed's hostfile and what `--include`, `--exclude`, `--num_nodes` and `--num_gpus` leave of it.

A hostfile is MPI-style, one host a line, `NAME slots=N` (`#` comments and blank lines skipped). It gives the
*pool*: host -> slot count. The launch uses the *active resources*: host -> the slot ids (device indices) to run
ranks on, hosts in the hostfile's order (which is the order of the node ranks). The filters mean what they mean
in DeepSpeed's launcher (deepspeed/launcher/runner.py, 0.19):

- `--include` / `--exclude` (mutually exclusive) take `NODE_SPEC[@NODE_SPEC ...]`, `NODE_SPEC = NAME[:SLOT[,SLOT
  ...]]`: include keeps the named hosts (all their slots, or the listed ones); exclude removes the named slots (or
  whole hosts). A host left without slots is dropped. Naming a host or slot the pool lacks is an error.
- `--num_nodes N` keeps the first N hosts; `--num_gpus G` runs G ranks on every host, slots 0..G-1. Neither goes
  with --include/--exclude.
"""

from __future__ import annotations

import re
from collections import OrderedDict

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


class LauncherError(ValueError):
    """A launcher input that cannot work (a bad hostfile, a filter naming what is not there); says the fix."""


def parse_hostfile(text: str, path: str = "hostfile") -> "OrderedDict[str, int]":
    """The pool of a hostfile's text: host -> slot count, in the file's order."""
    pool: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise LauncherError(f"{path}:{number}: {line!r} is not a hostfile line; write one host a line as "
                                f"`NAME slots=N` (e.g. `worker-0 slots=8`)")
        host, slots = match.group(1), int(match.group(2))
        if host in pool:
            raise LauncherError(f"{path}:{number}: host {host!r} is listed twice; list each host once")
        pool[host] = slots
    if not pool:
        raise LauncherError(f"{path} lists no host; write one host a line as `NAME slots=N`")
    return pool


def _parse_spec(spec: str, flag: str) -> "OrderedDict[str, list[int]]":
    """`NAME[:SLOT,...]@...` -> host -> slot ids (empty: the whole host)."""
    named: OrderedDict[str, list[int]] = OrderedDict()
    for node in spec.split("@"):
        host, _, slots = node.partition(":")
        if not host:
            raise LauncherError(f"{flag} {spec!r}: an empty host name; write NAME[:SLOT[,SLOT...]][@NAME...]")
        try:
            ids = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise LauncherError(f"{flag} {spec!r}: slots of {host!r} must be integers, as in {host}:0,2") from None
        named.setdefault(host, [])
        named[host] = sorted(set(named[host] + ids))
    return named


def active_resources(pool: "OrderedDict[str, int]", include: str = "", exclude: str = "", num_nodes: int = -1,
                     num_gpus: int = -1) -> "OrderedDict[str, list[int]]":
    """The hosts and slot ids a launch uses, in the pool's order (see the module docstring)."""
    if include and exclude:
        raise LauncherError("--include and --exclude cannot be combined; name what to use, or what to leave out")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise LauncherError("--num_nodes/--num_gpus cannot be combined with --include/--exclude; use one or the other")
    active = OrderedDict((host, list(range(n))) for host, n in pool.items())
    if include or exclude:
        flag = "--include" if include else "--exclude"
        named = _parse_spec(include or exclude, flag)
        for host, ids in named.items():
            if host not in active:
                raise LauncherError(f"{flag}: host {host!r} is not in the hostfile (it lists {', '.join(active)})")
            missing = [i for i in ids if i not in active[host]]
            if missing:
                raise LauncherError(f"{flag}: host {host!r} has no slot {missing[0]} (the hostfile gives it "
                                    f"slots 0..{len(active[host]) - 1})")
        if include:
            active = OrderedDict((h, named[h] or active[h]) for h in active if h in named)
        else:
            kept: OrderedDict[str, list[int]] = OrderedDict()
            for host, ids in active.items():
                if not (host in named and not named[host]):  # a host named without slots goes whole
                    kept[host] = [i for i in ids if i not in named.get(host, [])]
            active = kept
        active = OrderedDict((h, ids) for h, ids in active.items() if ids)
    if num_nodes > 0:
        if num_nodes > len(active):
            raise LauncherError(f"--num_nodes {num_nodes}: the hostfile has only {len(active)} host(s)")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        active = OrderedDict((h, list(range(num_gpus))) for h in active)
    if not active:
        raise LauncherError(f"{'--include' if include else '--exclude'} leaves no slot to run on")
    return active
