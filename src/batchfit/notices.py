"""Import-time notices of other libraries that concern no batchfit user, kept off the terminal.

transformers imports torchao whenever it is installed (``transformers/quantizers/quantizer_torchao.py``),
so every command that builds an ``hf:`` model, PEFT's LoRA or a user's transformers model did,
and torchao's import logs two kinds of lines that say nothing about the user's run:

- ``torchao``: "Failed to load .../torchao/_C_mxfp8...so: Could not load this library" for each
  CUDA extension a CPU (or other CUDA) build cannot load (``torchao/__init__.py``);
- ``torch.utils._pytree``: "<enum 'KernelPreference'> is an Enum subclass and is now natively
  supported by torch.compile ..." for each torchao enum torchao registers as a pytree constant.

Each is dropped by a filter on its own logger that matches that message only (torchao's own
enums, its own extension libraries); every other record of those loggers, and every warning,
passes as before. Installed when batchfit is imported (``batchfit/__init__.py``): no torch here.
"""

from __future__ import annotations

import logging


class _TorchaoImportNotes(logging.Filter):
    """Drops torchao's extension-loading failures and torch's pytree note on torchao's enums."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            message = record.getMessage()
            return not (message.startswith("Failed to load ") and ".so" in message)
        if record.name == "torch.utils._pytree" and "is an Enum subclass" in str(record.msg):
            enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not getattr(enum, "__module__", "").startswith("torchao")
        return True


_FILTER = _TorchaoImportNotes()


def quiet_torchao_import_notes() -> None:
    """Add the filter to the two loggers (once: ``addFilter`` keeps one copy of a filter)."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(_FILTER)
