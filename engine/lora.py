"""Which LoRA adapter runs in which slot (the leader's side of multi-LoRA
serving; model_zoo/lora.py holds the slots on every rank).

A step may run up to max_loras adapters at once, one per slot. A waiting
request is admitted when its adapter is in a slot already, or a slot no
running request uses can take it (an empty one first, else the least
recently used). Otherwise it waits at the front of the queue, the
requests behind it are admitted (vLLM's rule), and the least recently
admitted slot drains: no new request joins its adapter while one waits, so
the slot frees once its running requests end, and a steady stream for the
adapters in the slots cannot starve another adapter. The slot's weights
are loaded on every rank at the start of the step that first runs it
(StepPlan.lora_loads carries the leader's copy: no other rank reads the
adapter's files, which may have changed or gone since). An adapter the
leader must read again (its host copy aged out) and cannot, because its
files changed or went, fails the request that asked (AdapterUnreadable:
finish_reason "error"), not the engine.
"""
import itertools
from dataclasses import dataclass


class AdapterUnreadable(Exception):
    """A request's adapter could not be read again; the message says why."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter's name, an id unique to what is at its path (the
    prefix cache and the slots key on it), and its PEFT directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str


class LoRAManager:
    def __init__(self, model_lora):
        """model_lora: the leader's model_zoo/lora.ModelLoRA."""
        self.model = model_lora
        self.held: list[int | None] = [None] * len(model_lora.slots)    # what each slot holds after pending loads
        self.used_at = [0] * len(self.held)
        self._clock = itertools.count(1)
        self.pending: list[tuple[int, int, str]] = []       # (slot, lora_int_id, path) for the next step
        self.draining: int | None = None    # the slot a waiting adapter gets next (this admission pass)
        self.adapters: dict[int, LoRARequest] = {}          # read and checked (add)

    def add(self, lora: LoRARequest) -> None:
        """Read and check the adapter (ValueError if it does not fit the model)."""
        self.model.read(lora.lora_int_id, lora.lora_path)
        self.adapters[lora.lora_int_id] = lora

    def remove(self, lora_int_id: int) -> None:
        """Forget it (its id is never used again by new requests). Its slot
        and host copy go the least-recently-used way, so the requests that
        already have it, running or waiting, run with it to their end."""
        self.adapters.pop(lora_int_id, None)

    def begin_admission(self) -> None:
        """A new pass over the waiting queue (Scheduler.schedule): what drains
        is decided again by the first request that finds no slot."""
        self.draining = None

    def acquire(self, lora: LoRARequest, running) -> int | None:
        """The slot the request runs its adapter in, or None while every slot
        is in use by running requests of other adapters (or drains for one)."""
        used = {r.lora_slot for r in running if r.lora is not None}
        if lora.lora_int_id in self.held:
            slot = self.held.index(lora.lora_int_id)
            if slot == self.draining:
                return None
        else:
            free = [s for s in range(len(self.held)) if s not in used]
            if not free:
                if self.draining is None:
                    self.draining = min(used, key=lambda s: self.used_at[s])
                return None
            slot = min(free, key=lambda s: (s != self.draining, self.held[s] is not None, self.used_at[s]))
            try:        # (rank 0, cached) before the step loads it
                self.model.read(lora.lora_int_id, lora.lora_path)
            except Exception as e:      # (ValueError, OSError, safetensors' errors: files that changed)
                raise AdapterUnreadable(f"LoRA adapter {lora.lora_name!r} could not be read again: {e}") from e
            self.held[slot] = lora.lora_int_id
            self.model.keep = set(self.held)        # kept on the host until the step's plan takes it
            self.pending = [p for p in self.pending if p[0] != slot] + [(slot, lora.lora_int_id, lora.lora_path)]
        self.used_at[slot] = next(self._clock)
        return slot

    def forget_slots(self) -> None:
        """The slots were emptied (sleep level 2): adapters load again when used."""
        self.held = [None] * len(self.held)
        self.pending = []
        self.model.keep = set()

    def take_pending(self) -> list[tuple[int, int, object]]:
        """The next step's loads: (slot, adapter id, the adapter as read here,
        from the host cache that `keep` holds it in)."""
        loads, self.pending = self.pending, []
        return [(slot, lora_int_id, self.model.read(lora_int_id, path)) for slot, lora_int_id, path in loads]
