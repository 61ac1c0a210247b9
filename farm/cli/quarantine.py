"""`farm blobs quarantine|release|delete KEY`: an admin stops a blob spreading, lets it go
again, or deletes it.

A failed `farm verify` quarantines a blob by itself; these are for what a person found (and for
releasing a blob whose failure was the device's, not the blob's). Through the API they need an
admin token.
"""

from __future__ import annotations

import functools

import click

from farm.cli.common import (
    backend,
    emit,
    handle_errors,
    json_option,
    print_blob,
    resolve_key,
    say,
)
from farm.cli.jobs import blobs


@blobs.command("quarantine")
@click.argument("cache_key")
@click.option("--reason", required=True, help="Why, for the record and for the edges' message.")
@json_option
@handle_errors
def quarantine(cache_key: str, reason: str, as_json: bool) -> None:
    """Quarantine a blob: edges refuse it until it is released (or rebuilt)."""
    farm = backend()
    blob = farm.quarantine(resolve_key(farm, cache_key), reason)
    emit(blob, as_json, functools.partial(print_blob, blob))


@blobs.command("release")
@click.argument("cache_key")
@json_option
@handle_errors
def release(cache_key: str, as_json: bool) -> None:
    """Lift a blob's quarantine; its verifications stay on record."""
    farm = backend()
    blob = farm.release(resolve_key(farm, cache_key))
    emit(blob, as_json, functools.partial(print_blob, blob))


@blobs.command("delete")
@click.argument("cache_key")
@json_option
@handle_errors
def delete(cache_key: str, as_json: bool) -> None:
    """Delete a quarantined blob (its verifications stay on record); a blob in use is left to
    `farm gc`."""
    farm = backend()
    key = resolve_key(farm, cache_key)
    farm.delete_blob(key)
    emit({"cache_key": key, "deleted": True}, as_json, lambda: say(f"deleted blob {key}"))
