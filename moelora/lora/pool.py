"""Adapter slot pool: `max_loras` device slots of fixed address, a CPU LRU of loaded adapters.

The pool owns names -> (path, pinned), a CPU cache of validated `LoRAAdapter`s (at most
`max_cpu_loras`, least recently used dropped first, pinned ones never), and which adapter sits
in which device slot. Writing a slot is delegated to `write_slot(slot, adapter | None)` (the
model's `set_lora_slot`), so this module knows nothing of layers. An evicted slot is zeroed. The
base model is "no slot": it never occupies one and costs no LoRA compute. `slot_ranks` is each
slot's adapter-level rank (host ints, for the step's `LoRABatch`); every site keeps its own rank per
slot on the device, written by `write_slot`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

from moelora.errors import AdapterError, CapacityError
from moelora.lora.adapter import LoRAAdapter


class AdapterPool:
    def __init__(self, max_loras: int, max_cpu_loras: int, load: Callable[[str, Path], LoRAAdapter],
                 write_slot: Callable[[int, LoRAAdapter | None], None]):
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

    @property
    def names(self) -> list[str]:
        return sorted(self._paths)

    def slots_in_use(self) -> int:
        return len(self._slot_of)

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
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._write_slot(slot, None)
            self.slot_ranks[slot] = 0

    def _cache(self, name: str, adapter: LoRAAdapter) -> None:
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

    def acquire(self, names: Iterable[str | None]) -> dict[str, int]:
        """Put every named adapter in a device slot (evicting slots not named); name -> slot."""
        wanted = {n for n in names if n is not None}
        if len(wanted) > self.max_loras:
            raise CapacityError(f"{len(wanted)} adapters in one step but only {self.max_loras} slots")
        for name in wanted:
            if name in self._slot_of:
                self._slot_lru.move_to_end(self._slot_of[name])
                continue
            adapter = self._adapter(name)
            slot = next(s for s in self._slot_lru if self._owner(s) not in wanted)
            old = self._owner(slot)
            if old is not None:
                del self._slot_of[old]
                self.evictions += 1
            self._write_slot(slot, adapter)
            self._slot_of[name] = slot
            self.slot_ranks[slot] = adapter.max_rank
            self._slot_lru.move_to_end(slot)
        return {n: self._slot_of[n] for n in wanted}

    def _owner(self, slot: int) -> str | None:
        return next((n for n, s in self._slot_of.items() if s == slot), None)
