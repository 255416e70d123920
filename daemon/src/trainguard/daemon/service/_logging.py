"""Log set-up for trainguard's processes: structlog, one JSON object per line on stderr.

The library modules only call ``structlog.get_logger(...)`` and bind context (``job_id``,
``generation``, ...); the process entry point chooses the output here. Standard-library logging
(aiokafka's) is routed through the same renderer at WARNING and above, aiokafka's throttled
(:mod:`trainguard.agent.bus._kafka_logs`: the first line of each template, then one per 30 s).
"""

from __future__ import annotations

import logging
import sys

import structlog

from trainguard.agent.bus import quiet_kafka_logs

__all__ = ["configure_logging"]


def configure_logging(*, json: bool = True, level: int = logging.INFO) -> None:
    """Configure structlog and stdlib logging for a command-line process.

    Args:
        json: one JSON object per line (for log shippers); ``False`` for a human console.
        level: lowest level emitted (``logging.INFO`` ...).
    """
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    quiet_kafka_logs()
