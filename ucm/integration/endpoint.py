"""UCM's own Prometheus endpoint in an engine's process (``ucm.metrics``), one per rank.

Every engine takes a port in its config (vLLM's ``ucm_metrics_port``, SGLang's
``ucm_metrics_port``, LMCache's ``storage_plugin.<name>.metrics_port``); each rank serves on that
port plus its offset on the node, on 127.0.0.1 only, and ``0`` picks a free port (logged). The
endpoint shows what ``ucm stats`` cannot: this process's Store counters, its tiers' counters and
breakers, and the integration's own counters (:class:`~ucm.metrics.CountersCollector`).
"""

from __future__ import annotations

import logging

from .. import Store, metrics
from ..errors import ConfigError, UcmError

logger = logging.getLogger(__name__)


def check_metrics_port(value: object, key: str) -> int | None:
    """The port an engine's config gives (``key`` names where), or None when not given."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(
            f"{key}: {value!r} is not valid: expected an integer port in [0, 65535] "
            "(0: a free port)"
        )
    return value


def serve_rank_metrics(
    store: Store,
    port: int,
    offset: int,
    key: str,
    what: str,
    *extra: metrics.CountersCollector,
) -> metrics.MetricsServer:
    """Serves ``store``'s metrics (and ``extra``) on ``port + offset``, or a free port when
    ``port`` is 0. ``what`` names the rank in the log line. A port that cannot be bound is a
    :class:`~ucm.errors.ConfigError` naming ``key``."""
    try:
        server = metrics.serve(store, port + offset if port else 0, "127.0.0.1", *extra)
    except UcmError as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    logger.info("UCM %s: Prometheus metrics on %s", what, server.url)
    return server
