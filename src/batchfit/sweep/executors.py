"""The executors moved down to ``batchfit.train.executors`` (``batchfit recommend``'s branches
run through them too): this name stays for code that imports it from here."""

from batchfit.train.executors import (  # noqa: F401
    EXECUTORS,
    DevicePool,
    WorkerContext,
    check_executor,
    execute,
    execute_remote,
    guarded_run,
    local_devices,
    run_in_process,
    run_local,
    run_pool,
    run_ray,
)
