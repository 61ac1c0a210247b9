"""Channels: create, set a revision, promote, roll back (`release` or `admin` tokens; only an
admin forces a gate); show and status (submit
tokens); the signed document and the edges' reports (pull tokens); prebuild (submit tokens)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import Field, StringConstraints

from farm.core.channels import Entry
from farm.core.errors import ApiError
from farm.core.spec import CompileSpec, Toolchain
from farm.server.api.deps import (
    Dispatch,
    Farm,
    PullCaller,
    ReleaseCaller,
    SubmitCaller,
    known_query_only,
)
from farm.server.api.schemas import Name, Sha256, SpecIn, Strict, Text, ToolchainIn
from farm.server.channels import prebuild as prebuilds
from farm.server.channels import service, status

router = APIRouter(tags=["channels"], dependencies=[Depends(known_query_only)])

ChannelName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")]


class ChannelIn(Strict):
    name: ChannelName


class EntryIn(Strict):
    name: Name
    model: dict[Literal["xml", "bin", "onnx"], Sha256]
    spec: SpecIn


class RevisionIn(Strict):
    entries: list[EntryIn] = Field(min_length=1, max_length=256)


INT32 = 2**31 - 1
"""The database's integer columns: a larger number is a 422, not a driver error."""


class PromoteIn(Strict):
    revision: int = Field(ge=1, le=INT32)
    percent: int = Field(ge=1, le=100)
    force: bool = False


class EdgeReportIn(Strict):
    agent_id: Name
    revision: int | None = Field(None, ge=1, le=INT32)
    wanted_revision: int | None = Field(None, ge=1, le=INT32)
    sequence: int | None = Field(None, ge=0, le=INT32)
    openvino: Annotated[Text, StringConstraints(max_length=64)] | None = None
    runtime_requirements: Annotated[Text, StringConstraints(max_length=512)] | None = None
    targets: list[Annotated[Text, StringConstraints(max_length=16)]] = Field(
        default_factory=list, max_length=64
    )
    ok: bool
    error: Annotated[Text, StringConstraints(max_length=4000)] | None = None


class PrebuildIn(Strict):
    toolchain: ToolchainIn
    channel: ChannelName | None = None
    pulled_since_days: float | None = Field(None, gt=0, le=3650)


def entry_of(body: EntryIn) -> Entry:
    spec = body.spec.model_dump()
    model = {str(role): digest for role, digest in body.model.items()}
    return Entry(body.name, model, CompileSpec.from_canonical(spec.pop("target"), spec))


@router.post("/v1/channels", status_code=201)
def create(body: ChannelIn, farm: Farm, caller: ReleaseCaller) -> dict[str, Any]:
    with farm.session() as session:
        channel = service.create(session, farm.api_signer, body.name, caller.name)
        return status.channel_dict(channel)


@router.get("/v1/channels/{name}", responses={404: {}})
def show(
    name: ChannelName,
    farm: Farm,
    _: SubmitCaller,
    revision: int | None = Query(None, ge=1, le=INT32),
) -> dict[str, Any]:
    """The channel, its revisions (or one) and its last moves."""
    with farm.session() as session:
        return status.show(session, name, revision)


@router.post("/v1/channels/{name}/revisions", status_code=201, responses={404: {}})
def set_revision(
    name: ChannelName, body: RevisionIn, farm: Farm, caller: ReleaseCaller
) -> dict[str, Any]:
    entries = [entry_of(entry) for entry in body.entries]
    with farm.session() as session:
        service.set_revision(session, farm.api_signer, name, entries, caller.name)
        return status.show(session, name)


@router.post("/v1/channels/{name}/promote", responses={404: {}, 409: {}})
def promote(
    name: ChannelName, body: PromoteIn, farm: Farm, caller: ReleaseCaller
) -> dict[str, Any]:
    if body.force and not caller.may("admin"):
        raise ApiError(
            403,
            "forbidden",
            f"forcing a promotion past its gates needs the 'admin' role; token {caller.name!r} "
            f"has {caller.role!r}",
        )
    with farm.session() as session:
        channel = service.promote(
            session,
            farm.api_signer,
            name,
            body.revision,
            body.percent,
            caller.name,
            min_verifications=farm.settings.channel_min_verifications,
            force=body.force,
        )
        return status.channel_dict(channel)


@router.post("/v1/channels/{name}/rollback", responses={404: {}, 409: {}})
def rollback(name: ChannelName, farm: Farm, caller: ReleaseCaller) -> dict[str, Any]:
    with farm.session() as session:
        return status.channel_dict(service.rollback(session, farm.api_signer, name, caller.name))


@router.get("/v1/channels/{name}/document", responses={404: {}})
def document(name: ChannelName, farm: Farm, _: PullCaller) -> dict[str, Any]:
    """The signed document edges act on: `{document, signature, signing_key_id, certificate}`."""
    with farm.session() as session:
        return service.document_of(session, name, farm.api_signer)


@router.post("/v1/channels/{name}/edges", status_code=204, responses={404: {}})
def report_edge(name: ChannelName, body: EdgeReportIn, farm: Farm, _: PullCaller) -> None:
    """An edge's report of the revision it runs (or why its switch failed)."""
    report = body.model_dump()
    with farm.session() as session:
        service.record_edge(session, name, report.pop("agent_id"), report)


@router.get("/v1/channels/{name}/status", responses={404: {}})
def rollout_status(
    name: ChannelName,
    farm: Farm,
    _: SubmitCaller,
    openvino: str | None = Query(None, pattern=r"^\d{4}\.\d+\.\d+$"),
    runtime_requirements: Text | None = Query(None, max_length=512),
) -> dict[str, Any]:
    """Edges per revision, toolchain and targets; failures; the gates; with `openvino` (and
    `runtime_requirements`), what the farm lacks for that toolchain."""
    toolchain = Toolchain(openvino, runtime_requirements=runtime_requirements) if openvino else None
    with farm.session() as session:
        return status.status(session, name, farm.settings.channel_min_verifications, toolchain)


@router.post("/v1/prebuild")
def prebuild(
    body: PrebuildIn, farm: Farm, dispatcher: Dispatch, caller: SubmitCaller
) -> list[dict[str, Any]]:
    """Submit what a channel's fleet runs (or what edges pulled lately) for a toolchain."""
    toolchain = Toolchain(
        body.toolchain.openvino, runtime_requirements=body.toolchain.runtime_requirements
    )
    with farm.session() as session:
        if body.channel is not None:
            entries = prebuilds.channel_entries(session, body.channel)
        else:
            entries = prebuilds.pulled_entries(session, body.pulled_since_days or 30)
        return prebuilds.prebuild(
            session, farm.store, farm.settings, dispatcher, entries, toolchain, caller.name
        )
