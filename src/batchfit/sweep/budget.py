"""Moved to ``batchfit.train.budget`` (the sweep and recommend engines share it, and an engine
never imports another): this name is the same module, so old imports and monkeypatches work."""

import sys

from batchfit.train import budget as _moved

sys.modules[__name__] = _moved
