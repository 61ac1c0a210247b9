"""Log records without secrets: the API and the workers log what drivers raise (botocore, kombu,
redis, psycopg), and a driver's message may quote the URL it was given, credentials and all.

`redact_logs` installs a log record factory, so every record of the process is cleaned when it
is made, whichever logger and handler it goes to (uvicorn's, Celery's, ours): its message and
its traceback have URL passwords and the given secrets replaced by ``***``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from farm.core.text import redact

_secrets: set[str] = set()
_lock = threading.Lock()
_installed = False
_formatter = logging.Formatter()


def redact_logs(secrets: Iterable[str | None] = ()) -> None:
    """From now on, redact URL passwords and `secrets` from every log record of this process
    (and of processes it forks). Calling it again adds secrets; the factory is installed once."""
    global _installed
    with _lock:
        _secrets.update(secret for secret in secrets if secret)
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            _clean(record)
            return record

        logging.setLogRecordFactory(factory)
        _installed = True


def _clean(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: logging reports it when the record is emitted
        return
    secrets = tuple(_secrets)
    clean = redact(message, secrets)
    if clean != message:
        # The arguments one by one first: a formatter may read them (uvicorn's access log
        # unpacks them), and a hostile request path must not break its log line.
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact(arg, secrets) if isinstance(arg, str) else arg for arg in record.args
            )
        if isinstance(record.msg, str):
            record.msg = redact(record.msg, secrets)
        try:
            redacted = record.getMessage() == clean
        except Exception:  # a format string the redaction changed
            redacted = False
        if not redacted:
            record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None:
        # Formatted now, as a formatter would, so every handler prints the redacted text.
        record.exc_text = redact(_formatter.formatException(record.exc_info), secrets)
    if record.stack_info:
        record.stack_info = redact(record.stack_info, secrets)
