"""Import-time notices of other libraries that concern no batchfit user, kept off the terminal.

transformers imports torchao whenever it is installed (``transformers/quantizers/quantizer_torchao.py``),
and PEFT imports bitsandbytes (``peft/helpers.py``), so every command that builds an ``hf:`` model,
PEFT's LoRA, a user's transformers model or reads ``--trainer`` args did, and their imports log
lines that say nothing about the user's run:

- ``torchao``: "Failed to load .../torchao/_C_mxfp8...so: Could not load this library" for each
  CUDA extension a CPU (or other CUDA) build cannot load (``torchao/__init__.py``);
- ``torch.utils._pytree``: "<enum 'KernelPreference'> is an Enum subclass and is now natively
  supported by torch.compile ..." for each torchao enum torchao registers as a pytree constant;
- ``bitsandbytes.backends.cpu.ops``: "Failed to load CPU gemm_4bit_forward from kernels-community:
  No module named 'kernels'" on a CPU with AVX-512 bf16, where an optional kernel package is absent
  (bitsandbytes then runs its own CPU kernel);
- ``torchao.kernel.intmm``: "Warning: Detected no triton, on systems without Triton certain kernels
  will not work" (a CPU install has no Triton; batchfit runs none of those kernels).

Each is dropped by a filter on its own logger that matches that message only (torchao's own
enums, its own extension libraries); every other record of those loggers, and every warning,
passes as before. With ``BATCHFIT_DEBUG`` set (the variable that also shows tracebacks) nothing is
dropped: the records go to the log as the libraries wrote them. Installed when batchfit is
imported (``batchfit/__init__.py``): no torch here.
"""

from __future__ import annotations

import logging
import os

NOTES: dict[str, str] = {
    "torchao": "Failed to load ",  # ... .so: its CUDA extensions (and only those: the ".so" is checked)
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    "torchao.kernel.intmm": "Warning: Detected no triton",
}
"""Logger -> the start of the one message dropped from it."""


class _ImportNotes(logging.Filter):
    """Drops NOTES' messages and torch's pytree note on torchao's enums, unless BATCHFIT_DEBUG is set."""

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get("BATCHFIT_DEBUG"):
            return True
        if record.name in NOTES:
            message = record.getMessage()
            return not (message.startswith(NOTES[record.name]) and (record.name != "torchao" or ".so" in message))
        if record.name == "torch.utils._pytree" and "is an Enum subclass" in str(record.msg):
            enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not getattr(enum, "__module__", "").startswith("torchao")
        return True


_FILTER = _ImportNotes()


def quiet_import_notes() -> None:
    """Add the filter to the loggers (once: ``addFilter`` keeps one copy of a filter)."""
    for name in (*NOTES, "torch.utils._pytree"):
        logging.getLogger(name).addFilter(_FILTER)
