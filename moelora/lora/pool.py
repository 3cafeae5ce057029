"""Adapter slot pool: `max_loras` device slots of fixed address, a CPU LRU of loaded adapters.

The pool owns names -> (path, pinned), a CPU cache of validated `LoRAAdapter`s (at most
`max_cpu_loras`, least recently used dropped first, pinned ones never), and which adapter sits
in which device slot. Writing a slot is delegated to `write_slot(slot, adapter | None)` (the
model's `set_lora_slot`), so this module knows nothing of layers. An evicted slot is zeroed. The
base model is "no slot": it never occupies one and costs no LoRA compute. `slot_ranks` is each
slot's adapter-level rank (host ints, for the step's `LoRABatch`); every site keeps its own rank per
slot on the device, written by `write_slot`.

Loading without stalling the batch: `ensure(name, busy)` (the scheduler's admission check) puts
an adapter in a slot that no running request uses and starts the write through `SlotLoads`; it
answers True only once the write has completed, so requests of a loading adapter wait while the
others run. The default `SlotLoads` writes synchronously (CPU, or the engine's off switch); the
engine's CUDA one (`moelora.engine.adapter_loads`) writes on a side stream. `acquire` (the step)
then orders the step after any write it still has in flight. A slot with a write in flight is
never chosen as a victim until that write is waited for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

from moelora.errors import AdapterError, CapacityError
from moelora.lora.adapter import LoRAAdapter


class SlotLoads:
    """How slot writes run: here, synchronously (`start` writes and returns no handle)."""

    def start(self, write: Callable[[], None]) -> object | None:
        write()
        return None

    def done(self, handle: object) -> bool:
        return True

    def wait(self, handle: object) -> None:
        """Order everything the caller issues next after the write (no host block needed)."""


class AdapterPool:
    def __init__(self, max_loras: int, max_cpu_loras: int, load: Callable[[str, Path], LoRAAdapter],
                 write_slot: Callable[[int, LoRAAdapter | None], None], *, loads: SlotLoads | None = None,
                 stage: Callable[[LoRAAdapter], LoRAAdapter] | None = None):
        """`loads`: where slot writes run (default synchronous). `stage`: applied once to every
        adapter entering the CPU cache (the engine pins and casts it there for async copies)."""
        if max_cpu_loras < max_loras:
            raise CapacityError(f"max_cpu_loras={max_cpu_loras} must be >= max_loras={max_loras}")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._load, self._write_slot = load, write_slot
        self._paths: dict[str, tuple[Path, bool]] = {}
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self.slot_ranks = [0] * max_loras
        self.loads = 0
        self.evictions = 0
        self._added = 0
        self._cache_keys: dict[str, str] = {}
        self._loads = loads or SlotLoads()
        self._stage = stage
        self._pending: dict[str, object] = {}  # adapter -> handle of its slot write still in flight

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    def slots_in_use(self) -> int:
        return len(self._slot_of)

    def path_of(self, name: str) -> Path | None:
        """The directory adapter `name` was registered from (None: not registered)."""
        entry = self._paths.get(name)
        return None if entry is None else entry[0]

    def add(self, name: str, path: str | Path, *, pinned: bool = False) -> LoRAAdapter:
        """Register and validate (load) an adapter; errors leave the pool untouched."""
        if name in self._paths:
            raise AdapterError(f"an adapter named {name!r} is already registered")
        adapter = self._load(name, Path(path))
        self._paths[name] = (Path(path), pinned)
        self._added += 1
        self._cache_keys[name] = f"{name}#{self._added}"
        self._cache(name, adapter)
        return adapter

    def cache_key(self, name: str | None) -> str | None:
        """Prefix-cache identity of an adapter: a new one each time a name is (re)registered, so KV
        computed with a removed adapter is never reused for another adapter of the same name."""
        return None if name is None else self._cache_keys[name]

    def remove(self, name: str) -> None:
        if name not in self._paths:
            raise AdapterError(f"no adapter named {name!r}; registered: {self.names}")
        del self._paths[name]
        del self._cache_keys[name]
        self._cpu.pop(name, None)
        self._settle(name)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._write_slot(slot, None)
            self.slot_ranks[slot] = 0

    def _cache(self, name: str, adapter: LoRAAdapter) -> None:
        if name not in self._cpu and self._stage is not None:
            adapter = self._stage(adapter)
        self._cpu[name] = adapter
        self._cpu.move_to_end(name)
        while len(self._cpu) > self.max_cpu_loras:
            victim = next((n for n in self._cpu if not self._paths[n][1] and n != name), None)
            if victim is None:
                break
            del self._cpu[victim]

    def _adapter(self, name: str) -> LoRAAdapter:
        if name not in self._paths:
            raise AdapterError(f"no adapter named {name!r}; registered: {self.names}")
        adapter = self._cpu.get(name)
        if adapter is None:
            adapter = self._load(name, self._paths[name][0])
            self.loads += 1
        self._cache(name, adapter)
        return adapter

    def _settle(self, name: str | None) -> None:
        """Order what follows after `name`'s in-flight slot write, if any."""
        handle = self._pending.pop(name, None) if name is not None else None
        if handle is not None:
            self._loads.wait(handle)

    def _loading(self, name: str) -> bool:
        """Whether `name`'s slot write is still in flight (a finished one is forgotten here)."""
        handle = self._pending.get(name)
        if handle is not None and self._loads.done(handle):
            self._settle(name)  # done, but order the stream after it too (the stream sanitizer sees no query)
            handle = None
        return handle is not None

    def _place(self, name: str, slot: int) -> object | None:
        """Write `name` into `slot` (evicting its owner) through `SlotLoads`; the write's handle."""
        adapter = self._adapter(name)
        old = self._owner(slot)
        self._settle(old)  # never overwrite a slot while an earlier write into it is in flight
        if old is not None:
            del self._slot_of[old]
            self.evictions += 1
        self._slot_of[name] = slot
        self.slot_ranks[slot] = adapter.max_rank
        self._slot_lru.move_to_end(slot)
        return self._loads.start(lambda: self._write_slot(slot, adapter))

    def ensure(self, name: str, busy: set[str]) -> bool:
        """Admission check: True when `name` sits in a slot whose write has completed. Otherwise
        starts that write (in a free slot, or the least recently used one whose adapter is neither
        in `busy` nor still loading) and returns False; also False when no slot can be taken now."""
        if name in self._slot_of:
            if self._loading(name):
                return False
            self._slot_lru.move_to_end(self._slot_of[name])
            return True
        slot = next((s for s in self._slot_lru
                     if (o := self._owner(s)) is None or (o not in busy and not self._loading(o))), None)
        if slot is None:
            return False
        handle = self._place(name, slot)
        if handle is None:
            return True
        self._pending[name] = handle
        return not self._loading(name)

    def acquire(self, names: Iterable[str | None]) -> dict[str, int]:
        """Put every named adapter in a device slot (evicting slots not named); name -> slot. Writes
        still in flight for these adapters are ordered before the step; missing ones are written now."""
        wanted = {n for n in names if n is not None}
        if len(wanted) > self.max_loras:
            raise CapacityError(f"{len(wanted)} adapters in one step but only {self.max_loras} slots")
        for name in wanted:
            if name in self._slot_of:
                self._settle(name)
                self._slot_lru.move_to_end(self._slot_of[name])
                continue
            slot = next(s for s in self._slot_lru if self._owner(s) not in wanted)
            handle = self._place(name, slot)
            if handle is not None:
                self._loads.wait(handle)
        return {n: self._slot_of[n] for n in wanted}

    def _owner(self, slot: int) -> str | None:
        return next((n for n, s in self._slot_of.items() if s == slot), None)
