"""Which adapters are resident in the model's ``--max-loras`` slots: a pool like the KV blocks.

Pure bookkeeping, owned by the scheduler. A running (or swapped) request holds a reference on its
adapter's slot. An adapter not yet resident takes a free slot, or the least recently used slot that
no request holds; when every slot is held the request waits. A held slot is never evicted.
"""
from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # adapter id -> slot, least recently used first
        self._refs: dict[int, int] = {}                        # adapter id -> requests holding it
        self._free = list(range(num_slots - 1, -1, -1))

    def slot_of(self, adapter_id: int) -> int | None:
        return self._slot_of.get(adapter_id)

    def can_acquire(self, adapter_id: int) -> bool:
        return adapter_id in self._slot_of or bool(self._free) or self._idle() is not None

    def acquire(self, adapter_id: int) -> tuple[int, bool] | None:
        """Holds the adapter's slot for one request: (slot, whether its weights must be loaded now), or
        None when every slot is held by other adapters."""
        slot = self._slot_of.get(adapter_id)
        needs_load = slot is None
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim = self._idle()
                if victim is None:
                    return None
                slot = self._slot_of.pop(victim)
            self._slot_of[adapter_id] = slot
        self._slot_of.move_to_end(adapter_id)
        self._refs[adapter_id] = self._refs.get(adapter_id, 0) + 1
        return slot, needs_load

    def release(self, adapter_id: int) -> None:
        refs = self._refs.get(adapter_id, 0)
        if refs <= 0:
            raise AssertionError(f"adapter {adapter_id} released more often than acquired")
        if refs == 1:
            del self._refs[adapter_id]     # stays resident (LRU) until its slot is wanted
        else:
            self._refs[adapter_id] = refs - 1

    def held(self) -> dict[int, int]:
        return dict(self._refs)

    def resident(self) -> list[int]:
        return list(self._slot_of)

    def _idle(self) -> int | None:
        return next((a for a in self._slot_of if a not in self._refs), None)
