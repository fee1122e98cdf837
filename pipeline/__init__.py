"""The data pipeline: prompts -> sources -> exact token ids -> checks -> samples -> hidden states."""

import sys as _sys


def _in_ray_worker() -> bool:
    worker = _sys.modules.get("ray._private.worker")
    return worker is not None and getattr(worker.global_worker, "mode", None) == worker.WORKER_MODE


if _in_ray_worker():
    # A Ray worker imports this package before running any task or actor of ours (it unpickles our code first):
    # pandas is imported whole here, before any thread can. Ray Data's batch check reads ``pd.core.frame``, and
    # two threads importing pandas at once can leave one of them a half-initialised module (seen once in CI, a
    # read task failing with "module 'pandas' has no attribute 'core'"). A runtime_env setup hook did this
    # before; any runtime_env costs ~2 s of start-up on 2 cores (no prestarted worker fits it), and a cluster's
    # `ray job submit` never applied it.
    import pandas.core.frame  # noqa: F401
