"""A cache key, or a unique prefix of one, as people type it (git's rule for commit hashes).

A 64-hex key is taken as it is; a shorter run of at least `MIN_PREFIX` hex characters names the
one key of a blob or job that starts with it. Too short, not hex, unknown or ambiguous (the
candidates are listed) is an error that says which. The CLI asks either backend for the keys
that start with a prefix (`GET /v1/cache-keys` over the API) and decides here.

Standard library and farm.core only: the edge computes and types keys too.
"""

from __future__ import annotations

from collections.abc import Callable

from farm.core.errors import CacheError, NotFound

KEY_LENGTH = 64
MIN_PREFIX = 8
"""Shortest prefix accepted: 32 bits, unique among tens of thousands of keys."""
CANDIDATES_SHOWN = 5
"""Keys an ambiguous prefix lists (the backends look up one more, to know there are more)."""
HEX = frozenset("0123456789abcdef")


def normalize(text: str) -> str:
    """`text` as a key or prefix (lower case, stripped); CacheError unless it can be one."""
    key = text.strip().lower()
    if not key or not set(key) <= HEX or len(key) > KEY_LENGTH:
        raise CacheError(
            f"{text!r} is neither a job number nor a cache key (64 hex characters, or a "
            f"unique prefix of at least {MIN_PREFIX})"
        )
    if len(key) < MIN_PREFIX:
        raise CacheError(
            f"cache key prefix {key!r} is too short: give at least {MIN_PREFIX} hex characters"
        )
    return key


def resolve(text: str, starting_with: Callable[[str], list[str]]) -> str:
    """The full key `text` names; `starting_with(prefix)` lists keys with that prefix (at
    least `CANDIDATES_SHOWN + 1` of them when there are that many)."""
    key = normalize(text)
    if len(key) == KEY_LENGTH:
        return key
    found = sorted(set(starting_with(key)))
    if not found:
        raise NotFound(f"no blob and no job has a cache key starting with {key}")
    if len(found) > 1:
        shown = ", ".join(found[:CANDIDATES_SHOWN])
        more = " and more" if len(found) > CANDIDATES_SHOWN else ""
        raise CacheError(
            f"cache key prefix {key} is ambiguous: it matches {shown}{more}; give more characters"
        )
    return found[0]


def upper_bound(prefix: str) -> str:
    """The smallest string above every key that starts with `prefix` (hex): a database finds
    keys in [prefix, upper_bound) with its index on the key, where LIKE might not."""
    return prefix + "g"
