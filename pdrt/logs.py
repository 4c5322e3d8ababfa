"""Structured logs for every pdrt process: to stderr, readable on a terminal, JSON lines otherwise."""

import logging
import sys

import structlog


def configure_logging(process: str | None = None, level: int = logging.INFO) -> None:
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer = structlog.dev.ConsoleRenderer() if sys.stderr.isatty() else structlog.processors.JSONRenderer()
    # WriteLogger writes a line and its newline in one write(): the processes of a node share one stderr, and
    # print()'s two writes (the line, then the newline) let another process's line land between them.
    structlog.configure(processors=processors + [renderer],
                        wrapper_class=structlog.make_filtering_bound_logger(level),
                        logger_factory=structlog.WriteLoggerFactory(sys.stderr), cache_logger_on_first_use=True)
    if process is not None:
        structlog.contextvars.bind_contextvars(process=process)


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers in a server's log (imports transformers)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
