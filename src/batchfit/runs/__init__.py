"""Many-step runs: what the sweep's runs and recommend's branches share, one floor above the
training step (``train/``) and below the engines that run it many times.

    store.py      the SQLite store every worker writes to (a run or a branch per row)
    executors.py  this process, local worker processes, or Ray; the device pool
    data.py       text -> token ids (tokenizers, the cache), batches in a seeded order
    budget.py     token/sample budgets, the schedule, learning rate per batch size
"""
