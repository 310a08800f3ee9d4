"""The store moved down to ``batchfit.train.store`` (``batchfit recommend``'s branches share it):
this name stays for code that imports it from here."""

from batchfit.train.store import (  # noqa: F401
    CLAIMABLE,
    RUN_FIELDS,
    STATUSES,
    Store,
    check_store,
    config_hash,
    owner_id,
)
