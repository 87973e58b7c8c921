"""Stage-3 shards that live off the compute memory: `ShardStore`.

One store holds the parameter shards (`offload_param`); with nvme offload of fp32 parameters a second
one holds the gradient shards too ([Note: gradient shards offloaded] below).

Each sharded (non-persistent) stage-3 flat unit's `param_shard` keeps its shape and every view of it
forever (the optimizer's chunks of the fp32 master are views of it: optimizer.py), but its *storage*
is attached only while the shard is resident (see [Note: freeing storage] in flat/buffer.py). At
rest the values live in a backing store: one file per shard under nvme_path (`nvme`), or pinned host
memory when the shard itself lives on a GPU (`cpu`). At most `max_in_cpu` elements are resident at once
(unset: `buffer_count` largest shards, the gathers' working set); a shard that must be (a gather or the
optimizer reads it) always is, past the bound too.

Shard states (asserted):

    OFFLOADED --read--> READING --wait--> RESIDENT --evict, dirty: write--> WRITING --done--> OFFLOADED
                                          RESIDENT --evict, clean--> OFFLOADED

Only the stage-3 flat unit and its strategy call a store (stage3/flat_unit.py, stage3/strategy.py);
everyone else asks the unit (`seams.ShardedUnit.resident`) or the strategy (`all_resident`, `end_step`):
    FlatUnit.unshard / wait_for_unshard   acquire / release around the all-gather that reads the shard
    FlatUnit.write_back                   acquire / release(dirty=True)
    FlatUnit.resident(dirty)              resident([its shard], dirty): the optimizer around each part
                                          of the step, checkpoints (one unit at a time), the getters
    Stage3Sharding.all_resident           all_resident(): engine.full_state_dict reads every shard
    Stage3Sharding.end_step               end_step(): after every optimizer step (read-ahead below)

[Note: parameter read-ahead] The order in which shards are acquired is the stage-3 schedule's order
of gathers, prefetches included (stage3/schedule.py, stage3/prefetch.py), followed by the optimizer
step's unit order; it repeats every optimizer step. The store records it (`trace`) and, when a shard
is acquired, starts reading the shards that followed it last step, at most `buffer_count` reads in
flight and within `max_in_cpu`; so a gather finds its shard already read. A different order later
only wastes a read. Reads are local (no collective), so ranks need not agree on any of this.

[Note: gradient shards offloaded] In fp32 training with offload_param nvme, a stage-3 unit's reduced
gradient shard is as large as its parameter shard (4 bytes x Ψ/N: 6.1 GB per rank for 3e9 parameters
on 2 ranks), and would be the largest thing left in memory. A second store (`kind="grad"`) holds them:
    GradShard._deliver        acquire / add the reduced slice / release(dirty=True)
    GradShard.resident        resident([its shard]) (FlatUnit.grad_resident: the optimizer beside the
                              parameter shards per part of the step, nonfinite's diagnosis, the getters)
    GradShard.zero_grad       `zero(shard)`: the values become zeros without any I/O
A zero shard (`Entry.zero`) is never read or read ahead: acquiring it allocates zeros, which are
dirty (written before dropped). The step learns norms from GradShard.square_norm() (kept from the
last delivery), not by reading shards. A zero gradient shard's file holds no disk either: its blocks are
punched out when it is zeroed and all are taken again at the start of the next backward (`reserve`,
Stage3Sharding.start_micro_step; a full disk fails there, never inside a reduction). So the gradient
files take nothing while checkpoints are written (the 3e9 run's: bench/results/big_checkpoint.md).
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Iterable, Optional

import torch

from ..host_memory import alloc_storage, free_storage
from .file_io import DONE, FileIO, IOHandle
from .run_dir import RankDir
from .shard_entry import ShardEntry as _Entry, ShardHome
from .store import FileStore, HostStore, reserve_files


class ShardStore:
    """Where this rank's stage-3 parameter (or gradient) shards live; see the module docstring."""

    offloads = True  # offload/null_store.py's NullShardStore: False (shards that stay in memory)

    def __init__(self, rank_dir: Optional[RankDir], io: Optional[FileIO], max_in_cpu: Optional[int], buffer_count: int,
                 pin_memory: bool = False, kind: str = "param", owns_files: bool = True,
                 read_ahead: bool = True) -> None:
        self.rank_dir = rank_dir       # None: backed by host memory (device cpu with a GPU)
        self.io = io
        self.kind = kind               # "param" or "grad": names the files
        self.owns_files = owns_files   # close() also closes `io` and `rank_dir` (a grad store shares them)
        self.max_in_cpu = max_in_cpu   # None: the working set, see `limit_numel`
        self.buffer_count = buffer_count
        self._largest_numel = 0        # of the shards adopted so far
        self.pin_memory = pin_memory
        self.entries: dict[int, _Entry] = {}                            # id(shard) -> entry
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # resident, oldest first
        self.resident_numel = 0        # elements with storage attached (READING, RESIDENT, WRITING)
        self.peak_resident_numel = 0
        # read_ahead=False: no order is recorded (and nothing is read ahead); a store whose end_step()
        # nobody calls must not record one, or `trace` grows by every acquire for the whole run
        self.read_ahead = read_ahead
        self.trace: list[int] = []     # acquisition order of this step ([Note: parameter read-ahead])
        self._last: list[int] = []
        self._cursor = 0
        self.read_wait_s = 0.0         # time spent blocked on reads / writes (the bench's NVMe split)
        self.write_wait_s = 0.0
        self.closed = False
        self._adopted = 0              # shards ever adopted (names their files)

    # -- adoption ------------------------------------------------------------------------------

    def holds(self, shard: torch.Tensor) -> bool:
        return id(shard) in self.entries

    def adopt(self, shard: torch.Tensor, zeros: bool = False) -> None:
        """Take over `shard` (resident now, its values final): write it to its backing store, then
        keep it cached only while there is room. `zeros`: its values are zeros; nothing is written."""
        assert id(shard) not in self.entries
        index = self._adopted
        self._adopted += 1
        self._largest_numel = max(self._largest_numel, shard.numel())
        if self.rank_dir is not None:
            backing = FileStore(self.rank_dir, shard.numel(), self.io, prefix=f"{self.kind}{index}.")
            backing.ensure("values", shard.dtype, reserve=not (zeros and self.kind == "grad"))
        else:
            backing = HostStore(shard.numel(), self.pin_memory)
            backing.ensure("values", shard.dtype)
        entry = _Entry(index, shard, backing)
        self.entries[id(shard)] = entry
        self._count(entry.numel)
        if zeros:
            self.zero(shard)
            return
        self.lru[id(shard)] = None
        entry.dirty = True
        if not self._make_room(0, protect=(id(shard),)):  # older shards go first
            self._make_room(0, protect=())

    def zero(self, shard: torch.Tensor) -> None:
        """`shard`'s values are now zeros: its memory goes without a write ([Note: gradient shards offloaded])."""
        entry = self.entries[id(shard)]
        assert entry.users == 0, f"zeroing {self.kind} shard {entry.index} while it is held"
        if entry.state in (ShardHome.READING, ShardHome.WRITING):
            entry.handle.wait()
            entry.handle = DONE
            entry.state = ShardHome.RESIDENT  # its I/O is over; the values no longer matter
        if entry.state is ShardHome.RESIDENT:
            self.lru.pop(id(shard), None)
            self._drop(entry)
        entry.dirty, entry.zero = False, True
        if self.kind == "grad" and not entry.backing.is_host:
            entry.backing.release()  # see [Note: gradient shards offloaded]

    def reserve(self) -> None:
        """Take back the disk blocks zero shards gave up; a full disk raises here, naming the space needed."""
        reserve_files([e.backing for e in self.entries.values() if not e.backing.is_host], f"{self.kind} shards")

    def discard(self, shard: torch.Tensor) -> None:
        """Forget `shard`, whose values are no longer needed: its file and its memory go."""
        entry = self.entries.pop(id(shard), None)
        if entry is None:
            return
        assert entry.users == 0, f"discarding {self.kind} shard {entry.index} while it is held"
        if entry.state in (ShardHome.READING, ShardHome.WRITING):
            entry.handle.wait()
        if entry.state is not ShardHome.OFFLOADED:
            self.resident_numel -= entry.numel
            if entry.shard.untyped_storage().resizable():
                free_storage(entry.shard)
        self.lru.pop(id(shard), None)
        entry.backing.close()
        if self.rank_dir is not None:
            self.rank_dir.path_of(f"{self.kind}{entry.index}.values.bin").unlink(missing_ok=True)

    # -- the three calls ------------------------------------------------------------------------

    def acquire(self, shard: torch.Tensor) -> None:
        """Make `shard` resident (reading it if needed) and keep it so until `release`; reads ahead."""
        entry = self.entries.get(id(shard))
        if entry is None:
            return  # a shard this store does not hold (a persistent unit's view)
        if self.read_ahead:
            self.trace.append(id(shard))
        upcoming = self._predict(id(shard))
        self._reap()
        if entry.state is ShardHome.OFFLOADED:
            self._make_room(entry.numel, protect=(id(shard),))
            self._start_read(entry)
        entry.users += 1
        self._settle(entry)
        self.lru.move_to_end(id(shard))
        self._read_ahead(upcoming)

    def release(self, shard: torch.Tensor, dirty: bool = False) -> None:
        """Drop one hold; `dirty`: the caller wrote new values (written back when evicted)."""
        entry = self.entries.get(id(shard))
        if entry is None:
            return
        assert entry.users > 0 and entry.state is ShardHome.RESIDENT, f"release of shard {entry.index} not held"
        entry.users -= 1
        entry.dirty |= dirty
        if entry.users == 0:
            self._make_room(0, protect=())

    @contextlib.contextmanager
    def resident(self, shards: Iterable[torch.Tensor], dirty: bool = False):
        """Hold `shards` resident for the block (unknown ones are ignored)."""
        held = [s for s in shards if id(s) in self.entries]
        for s in held:
            self.acquire(s)
        try:
            yield
        finally:
            for s in held:
                self.release(s, dirty=dirty)

    @contextlib.contextmanager
    def all_resident(self, dirty: bool = False):
        """Hold every shard resident for the block (full_state_dict reads every shard at once)."""
        with self.resident([e.shard for e in self.entries.values()], dirty=dirty):
            yield

    def end_step(self) -> None:
        """An optimizer step ended: this step's order predicts the next one's."""
        if self.trace:
            self._last, self.trace, self._cursor = self.trace, [], 0

    def flush(self) -> None:
        """Write every dirty resident shard back and wait (the backing store is then up to date)."""
        for entry in self.entries.values():
            if entry.state is ShardHome.RESIDENT and entry.dirty:
                self._write(entry).wait()
                entry.dirty = False

    # -- mechanics -------------------------------------------------------------------------------

    def _count(self, numel: int) -> None:
        self.resident_numel += numel
        self.peak_resident_numel = max(self.peak_resident_numel, self.resident_numel)

    def _start_read(self, entry: _Entry) -> None:
        entry.to(ShardHome.READING)
        alloc_storage(entry.shard, entry.numel)
        self._count(entry.numel)
        if entry.zero:  # nothing to read; the zeros are newer than the file ([Note: gradient shards offloaded])
            entry.shard.zero_()
            entry.zero, entry.dirty, entry.handle = False, True, DONE
            return
        target = entry.shard if entry.shard.device.type == "cpu" else self._staging(entry)
        entry.handle = entry.backing.read("values", 0, target)

    def _staging(self, entry: _Entry) -> torch.Tensor:
        entry.staging = torch.empty(entry.numel, dtype=entry.shard.dtype, pin_memory=self.pin_memory)
        return entry.staging

    def _settle(self, entry: _Entry) -> None:
        """Wait for the entry's I/O; a READING or WRITING entry becomes RESIDENT."""
        if entry.state in (ShardHome.READING, ShardHome.WRITING):
            start = time.perf_counter()
            entry.handle.wait()
            waited = time.perf_counter() - start
            if entry.state is ShardHome.READING:
                self.read_wait_s += waited
                if entry.staging is not None:
                    entry.shard.copy_(entry.staging)
            else:
                self.write_wait_s += waited
            entry.handle, entry.staging = DONE, None
            entry.to(ShardHome.RESIDENT)
            self.lru[id(entry.shard)] = None

    def _write(self, entry: _Entry) -> IOHandle:
        src = entry.shard if entry.shard.device.type == "cpu" else entry.shard.to("cpu")
        return entry.backing.write("values", 0, src)

    def _evict(self, entry: _Entry) -> None:
        """Start freeing a resident, unheld shard: write it first when dirty."""
        del self.lru[id(entry.shard)]
        if entry.dirty:
            entry.handle = self._write(entry)
            entry.dirty = False
            entry.to(ShardHome.WRITING)
            return
        self._drop(entry)

    def _drop(self, entry: _Entry) -> None:
        entry.handle = DONE
        entry.to(ShardHome.OFFLOADED)
        if not entry.shard.untyped_storage().resizable():
            raise RuntimeError(f"zerodp offload_param: {self.kind} shard {entry.index}'s memory was exported (e.g. by "
                               f".numpy() on a shard or a view of it) and can no longer be freed; read shards "
                               f"through torch only (clone them before converting)")
        free_storage(entry.shard)
        self.resident_numel -= entry.numel

    def _reap(self, wait: bool = False) -> bool:
        """Free the storage of finished writes (`wait`: at least the oldest one); True if any was freed."""
        writing = [e for e in self.entries.values() if e.state is ShardHome.WRITING]
        freed = False
        for e in writing:
            if e.handle.done() or (wait and not freed):
                start = time.perf_counter()
                e.handle.wait()
                self.write_wait_s += time.perf_counter() - start
                self._drop(e)
                freed = True
        return freed

    @property
    def limit_numel(self) -> int:
        """Elements that may be resident at once: max_in_cpu, or when it is unset the working set of the gathers,
        `buffer_count` shards of the largest size adopted (the ones in flight: gathered, read ahead, written)."""
        return self.max_in_cpu if self.max_in_cpu is not None else self.buffer_count * self._largest_numel

    def _make_room(self, numel: int, protect: Iterable[int]) -> bool:
        """Evict least recently used unheld shards until `numel` more elements fit in `limit_numel`.
        Returns False when they do not fit even so (held shards, or writes that cannot finish yet)."""
        protect = set(protect)
        while self.resident_numel + numel > self.limit_numel:
            victim = next((self.entries[k] for k in self.lru
                           if k not in protect and self.entries[k].users == 0
                           and self.entries[k].state is ShardHome.RESIDENT), None)
            if victim is not None:
                self._evict(victim)
                continue
            unused = next((e for e in self.entries.values() if e.state is ShardHome.READING and e.users == 0
                           and id(e.shard) not in protect), None)
            if unused is not None:  # a read-ahead nobody used (yet): finish it, then it can be evicted
                self._settle(unused)
                continue
            if not self._reap(wait=True):
                return False
        return True

    # -- read-ahead ([Note: parameter read-ahead]) ---------------------------------------------------

    def _predict(self, key: int) -> list[int]:
        last = self._last
        if not last:
            return []
        n = len(last)
        for offset in range(n):
            j = (self._cursor + offset) % n
            if last[j] == key:
                self._cursor = j + 1
                return [last[(j + 1 + k) % n] for k in range(min(n - 1, 4 * self.buffer_count))]
        return []

    def _read_ahead(self, upcoming: list[int]) -> None:
        in_flight = sum(1 for e in self.entries.values() if e.state in (ShardHome.READING, ShardHome.WRITING))
        seen = set()
        for key in upcoming:
            if in_flight >= self.buffer_count:
                return
            entry = self.entries[key]
            if key in seen or entry.state is not ShardHome.OFFLOADED or entry.zero:
                seen.add(key)
                continue
            seen.add(key)
            # room may come from shards needed later than this one, never from nearer ones
            if not self._make_room(entry.numel, protect=seen):
                return
            self._start_read(entry)
            self.lru[key] = None
            in_flight += 1

    # -- accounting ------------------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Bytes of resident shards (and of the backing store when it is host memory)."""
        resident = sum(e.numel * e.shard.element_size() for e in self.entries.values()
                       if e.state is not ShardHome.OFFLOADED)
        return resident + sum(e.backing.host_bytes() for e in self.entries.values())

    def disk_bytes(self) -> int:
        return sum(e.backing.disk_bytes() for e in self.entries.values())

    def offloaded_bytes(self, shard: torch.Tensor) -> int:
        """Bytes of `shard` that are not in memory now (0 for a resident or unknown shard)."""
        entry = self.entries.get(id(shard))
        if entry is None or entry.state is not ShardHome.OFFLOADED:
            return 0
        return entry.numel * entry.shard.element_size()

    @property
    def read_bytes(self) -> int:
        return self.io.read_bytes if self.io is not None else 0

    @property
    def written_bytes(self) -> int:
        return self.io.written_bytes if self.io is not None else 0

    def close(self) -> None:
        """Delete the files now. Shards not resident are gone with them: the engine cannot train after
        its close() (reading everything back first would put the whole shard in memory)."""
        if self.closed:
            return
        for entry in self.entries.values():
            if entry.state in (ShardHome.READING, ShardHome.WRITING):
                entry.handle.wait()  # never close a file a worker thread still reads or writes
            entry.backing.close()
        self.lru.clear()
        if self.owns_files:
            if self.io is not None:
                self.io.close()
            if self.rank_dir is not None:
                self.rank_dir.close()
        self.closed = True
