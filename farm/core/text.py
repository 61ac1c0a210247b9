"""Text for people: sizes in binary units, URLs with their credentials masked, secrets
redacted, and text from models or other hosts made safe for a terminal."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"


def size_text(count: float) -> str:
    """``1536`` → ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:\"'<>]*:)[^\s/?#\"'<>]*@")
"""``scheme://user:PASSWORD@`` anywhere in a text. The password runs to the last ``@`` before
the path, so a password holding ``@`` or ``:`` is masked whole."""


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``: safe to print, log or return. The user
    name and the rest stay, so the operator still sees which service and account it is. Never
    raises: a URL the standard library cannot parse (a port that is no number) is masked all
    the same."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return mask_urls(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))


def mask_urls(text: str) -> str:
    """Every ``scheme://user:password@`` in a free text (a driver's error message that quotes
    its URL) with the password masked."""
    return _URL_PASSWORD.sub(lambda match: f"{match['head']}{MASK}@", text)


def strip_userinfo(url: str) -> str:
    """The URL without ``user:password@``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _URL_USERINFO.sub(r"\g<head>", url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


_URL_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#]*@")


def url_password(url: str | None) -> str | None:
    """The password in a URL (``redis://:PASSWORD@host``), or None."""
    if not url:
        return None
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        match = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#]*)@", url)
        netloc = f"{match[1]}@" if match else ""
    userinfo, at, _ = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return None
    return userinfo.partition(":")[2] or None


MIN_SECRET_CHARS = 4
"""Shorter secrets are not searched for in texts: replacing every "ab" in a message would make
it unreadable, and a secret that short is no secret anyway."""


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with every URL password masked and each of `secrets` (as given, and
    percent-decoded, as a driver may print it) replaced by ``***``."""
    text = mask_urls(text)
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, unquote(secret)}:
            if len(form) >= MIN_SECRET_CHARS:
                text = text.replace(form, MASK)
    return text


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_UNPRINTABLE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str, *, multiline: bool = True) -> str:
    """`text` safe for a terminal: each control character (C0, DEL, C1; so every escape
    sequence, which starts with ESC or CSI) is shown as its Python escape (``\\x1b``) instead
    of acting on the terminal (setting its title, writing the clipboard with OSC 52, clearing
    the screen, faking output). Lone surrogates (file names that are not UTF-8) are shown
    the same way, rather than failing to print. Newline and tab are kept when `multiline`
    (logs, messages), escaped in a one-line field (a table cell).

    For what people read only: the database, the API's JSON and ``--json`` keep the raw text.
    """
    pattern = _UNPRINTABLE if multiline else _UNPRINTABLE_LINE
    return pattern.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def toolchains_text(toolchains: Mapping[str, Mapping[str, str]] | None) -> str:
    """``CPU: meta=1.0;ov=2026.4.1;isa=Intel AVX2; NPU.4000: 2026.4.1``: what each target of a
    worker compiles with (its runtime requirements for CPU, else its OpenVINO release)."""
    if not toolchains:
        return "unknown"
    return "; ".join(
        f"{target}: {part.get('runtime_requirements') or part.get('openvino')}"
        for target, part in sorted(toolchains.items())
    )


def converters_text(converters: Mapping[str, Mapping[str, str]] | None) -> str:
    """``torch (torch 2.13.0), optimum (...)`` or ``none (pip install 'farm[convert]')``."""
    if not converters:
        return "none (pip install 'farm[convert]')"
    return ", ".join(
        f"{name} ({', '.join(f'{d} {v}' for d, v in sorted(versions.items()))})"
        for name, versions in sorted(converters.items())
    )
