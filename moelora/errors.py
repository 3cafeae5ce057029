"""Typed errors for every condition a user can trigger (contract 7).

`assert` is reserved for internal invariants; anything a config, checkpoint, adapter or request
can cause raises one of these, with a message that names the offending key, field or value.
"""


class MoeLoRAError(Exception):
    """Base class of every moelora error."""


class ConfigError(MoeLoRAError):
    """A model or engine config is unsupported or inconsistent (names the field and value)."""


class CheckpointError(MoeLoRAError):
    """A base-model checkpoint is missing, has unexpected, or mis-shaped tensors."""


class AdapterError(MoeLoRAError):
    """A LoRA adapter cannot be used with this model (names the reason and the key)."""


class CapacityError(MoeLoRAError):
    """A fixed capacity (adapter slots, KV blocks, rank, sequence length) would be exceeded."""


class RequestError(MoeLoRAError):
    """A request carries an invalid parameter (names it)."""


class WorkerError(MoeLoRAError):
    """A tensor-parallel worker died, hung past the step timeout or failed a step: the engine stops."""
