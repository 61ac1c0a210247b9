"""`farm keys`: the key pair workers sign blobs with, the API's own certified key, and the keys
an edge trusts."""

from __future__ import annotations

import json
from pathlib import Path

import click

from farm.cli import main
from farm.cli.common import (
    EXIT_CODES,
    FarmCliError,
    direct,
    emit,
    err,
    handle_errors,
    json_option,
    out,
)
from farm.core.config import get_settings
from farm.core.errors import KeyFileError, Kind


@main.group()
def keys() -> None:
    """Blob signing keys: workers sign with FARM_SIGNING_KEY, edges trust FARM_TRUSTED_KEYS."""


@keys.command("create")
@click.option(
    "--path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Private key file to write (default: FARM_SIGNING_KEY, or the embedded farm's).",
)
@click.option("--if-missing", is_flag=True, help="Keep an existing key instead of failing.")
@json_option
@handle_errors
def keys_create(path: Path | None, if_missing: bool, as_json: bool) -> None:
    """Create a signing key pair: PATH (private, mode 0600) and PATH.pub (give it to edges)."""
    from farm.core.signing import Signer, create_key_pair, public_key_path  # cryptography

    settings = get_settings()
    path = path or settings.signing_key or settings.embedded_signing_key
    try:
        public, key_id = create_key_pair(path)
    except FileExistsError:
        if not if_missing:
            raise KeyFileError(f"{path} exists; keys are never overwritten") from None
        public, key_id = public_key_path(path), Signer.from_file(path).key_id
    data = {"private_key": str(path), "public_key": str(public), "key_id": key_id}
    emit(
        data,
        as_json,
        lambda: out.print(
            f"key {key_id}: private {path} (keep it on workers), public {public} "
            "(edges: FARM_TRUSTED_KEYS)"
        ),
    )


@keys.command("create-status")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--if-missing",
    is_flag=True,
    help="Keep an existing key and a certificate that names every purpose.",
)
@json_option
@handle_errors
def keys_create_status(path: Path, if_missing: bool, as_json: bool) -> None:
    """Create the API's own key PATH and its certificate PATH.cert, signed by this host's
    FARM_SIGNING_KEY: the API signs blob statuses and channel documents with it
    (FARM_STATUS_KEY=PATH) without holding the blob signing key, which alone signs blobs.
    Edges need nothing new: the certificate travels with each signature. Run it where the
    signing key is; copy PATH and PATH.cert to the API. With --if-missing, an existing
    certificate for fewer purposes (blob statuses only) is replaced by one for every purpose."""
    from farm.core.apikey import PURPOSES, certificate_path, certified_purposes, certify_api_key
    from farm.core.signing import Signer, create_key_pair  # cryptography

    settings = get_settings()
    signing = settings.resolved_signing_key
    if signing is None or not signing.exists():
        raise KeyFileError(
            "the certificate is signed with the blob signing key: set FARM_SIGNING_KEY"
        )
    certifier = Signer.from_file(signing)
    try:
        _, key_id = create_key_pair(path)
    except FileExistsError:
        if not if_missing:
            raise KeyFileError(f"{path} exists; keys are never overwritten") from None
        key_id = Signer.from_file(path).key_id
    certificate = _certificate(path) if if_missing else None
    if certificate is None or set(PURPOSES) - set(certified_purposes(certificate)):
        certificate = certify_api_key(certifier, Signer.from_file(path).public_key)
        certificate_path(path).write_text(json.dumps(certificate, indent=2))
    data = {
        "status_key": str(path),
        "certificate": str(certificate_path(path)),
        "key_id": key_id,
        "purposes": list(certified_purposes(certificate)),
        "certified_by": certificate["signer_id"],
    }
    emit(
        data,
        as_json,
        lambda: out.print(
            f"API key {key_id}: {path} and {certificate_path(path)}, certified by key "
            f"{data['certified_by']} for {', '.join(data['purposes'])}; on the API: "
            f"FARM_STATUS_KEY={path}"
        ),
    )


def _certificate(path: Path) -> dict | None:
    """The certificate beside the key `path`, if there is a readable one of that key."""
    from farm.core.apikey import ApiSigner

    try:
        return ApiSigner.from_file(path).certificate
    except KeyFileError:
        return None


@keys.command("show")
@json_option
@handle_errors
def keys_show(as_json: bool) -> None:
    """This host's signing key (if any) and the keys it trusts."""
    from farm.core.signing import Signer, TrustedKeys, public_key_path  # cryptography

    settings = get_settings()
    signing = settings.resolved_signing_key
    data: dict = {
        "signing_key": None,
        "trusted_keys": {},
        "allow_unsigned": settings.allow_unsigned,
    }
    if signing is not None and signing.exists():
        data["signing_key"] = {
            "key_id": Signer.from_file(signing).key_id,
            "private_key": str(signing),
            "public_key": str(public_key_path(signing)),
        }
    trusted = TrustedKeys.from_files(settings.trusted_key_paths)
    data["trusted_keys"] = dict(
        zip(trusted.keys, map(str, settings.trusted_key_paths), strict=True)
    )

    def human() -> None:
        key = data["signing_key"]
        out.print(
            f"signing key  {key['key_id']} ({key['private_key']})" if key else "signing key  none"
        )
        for key_id, path in data["trusted_keys"].items():
            out.print(f"trusts       {key_id} ({path})")
        if settings.allow_unsigned:
            out.print("FARM_ALLOW_UNSIGNED is set: this machine imports unsigned blobs")

    emit(data, as_json, human)


@keys.command("resign")
@click.option(
    "--accept-unverified",
    is_flag=True,
    help="Also sign blobs whose present signature no trusted key verifies (or that are "
    "unsigned): you vouch for the database and storage.",
)
@json_option
@handle_errors
def keys_resign(accept_unverified: bool, as_json: bool) -> None:
    """Sign every blob's manifest with FARM_SIGNING_KEY: after a key is retired, or for blobs
    recorded before manifests were signed. Old signatures must verify against FARM_TRUSTED_KEYS;
    each stored blob is hashed again first. Needs the database, storage and the private key."""
    report = direct("keys resign").resign_blobs(accept_unverified)
    data = report.as_dict()

    def human() -> None:
        out.print(
            f"re-signed {report.resigned} blob(s) with key {report.key_id}; skipped "
            f"{report.skipped} (already signed by it); failed {len(report.failures)}",
            soft_wrap=True,
        )
        for failure in report.failures:
            err.print(f"{failure.cache_key}  {failure.reason}", soft_wrap=True, markup=False)

    emit(data, as_json, human)
    if report.failures:
        kinds = [failure.kind for failure in report.failures]
        # Storage failures first: running again later may sign those.
        kind = Kind.INFRASTRUCTURE if Kind.INFRASTRUCTURE in kinds else kinds[0]
        raise FarmCliError(
            f"{len(report.failures)} blob(s) not re-signed (each named with its reason above)",
            EXIT_CODES[kind],
            "resign_failed",
        )
