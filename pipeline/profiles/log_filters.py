"""Silence the one warning Kimi's tokenizer code logs on every keyword-argument ``encode``.

Kimi's ``tokenization_kimi.py`` logs ``Calling super().encode with {...}`` each
time it is called with keyword arguments, which engines do for every request:
thousands of samples flood the logs. The filter sits on that module's own
logger (loaded as remote code, so its name carries the model folder) and drops
that message only; every other record, from that logger or any other, passes.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

KIMI_ENCODE_WARNING = "Calling super().encode with"
KIMI_TOKENIZER_MODULE = "tokenization_kimi"


class KimiEncodeWarningFilter(logging.Filter):
    """Drops the ``Calling super().encode with ...`` warning; passes everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        return not str(record.msg).startswith(KIMI_ENCODE_WARNING)


def _kimi_logger_names() -> set[str]:
    names = {n for n in sys.modules if n.split(".")[-1] == KIMI_TOKENIZER_MODULE}
    names |= {n for n in logging.Logger.manager.loggerDict if n.split(".")[-1] == KIMI_TOKENIZER_MODULE}
    return names


def silence_kimi_encode_warning(target: Any = None) -> list[logging.Logger]:
    """Attach the filter (once) to Kimi's tokenizer logger and return the loggers it sits on.

    ``target`` is a loaded Kimi tokenizer (its class's module names the logger),
    a logger name, or None (or any other object) for every ``*.tokenization_kimi``
    module loaded in this process so far. Filters are per process: call it where
    the tokenizer runs (an engine's worker or front-end process) after it loads.
    """
    if isinstance(target, str):
        names = {target}
    elif target is not None and type(target).__module__.split(".")[-1] == KIMI_TOKENIZER_MODULE:
        names = {type(target).__module__}
    else:  # None, or a wrapper (an engine's tokenizer pool): every Kimi tokenizer module loaded here
        names = _kimi_logger_names()
    loggers = []
    for name in sorted(names):
        logger = logging.getLogger(name)
        if not any(isinstance(f, KimiEncodeWarningFilter) for f in logger.filters):
            logger.addFilter(KimiEncodeWarningFilter())
        loggers.append(logger)
    return loggers
