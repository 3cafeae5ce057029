"""Adapter slot writes on a side CUDA stream, so loading an adapter never stalls the running batch.

The pool (`moelora.lora.pool`) decides which slot an adapter goes to; this decides where the
write runs. `SideStreamLoads.start(write)` runs `write` (the model's `set_lora_slot`: zero the
slot's A/B buffers, copy the adapter's page-locked, slot-dtype tensors in with non-blocking
copies, set the site ranks) on its own stream and returns an event recorded after it.

Contract 2, at the fork:
- side stream writes: the target slot's buffers (every site's lora_a / lora_b / ranks at that
  slot index) and nothing else; it reads only the staged host tensors.
- main stream: the step's kernels read slot buffers only at the slots of the step's rows. The pool
  only picks a slot whose adapter has no running request and no write in flight, and the
  scheduler admits no request of the loading adapter until the event has completed (`done`), so
  no step in flight or enqueued reads the slot being written.
- join: `wait` makes the main stream wait on the event before a step that uses the slot (the
  synchronous fallback path of `acquire`, and belt and braces after `done`).
The side stream first waits for the main stream, so a slot freed by earlier steps is written only
after those steps' kernels (enqueued before the fork) have finished reading it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelora.lora.pool import SlotLoads


class SideStreamLoads(SlotLoads):
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, write: Callable[[], None]) -> torch.cuda.Event:
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            write()
        return self.stream.record_event()

    def done(self, handle: torch.cuda.Event) -> bool:
        return handle.query()

    def wait(self, handle: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(handle)
