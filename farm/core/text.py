"""Text for people: sizes in binary units, URLs with their credentials masked."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def size_text(count: float) -> str:
    """``1536`` → ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``: safe to print, log or return."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
