"""`farm verify`: run a blob against its reference outputs on this device, and tell the farm.

Edge-safe: with FARM_API_URL set it needs only openvino, numpy and httpx (`farm[edge]`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from farm.cli import main
from farm.cli.common import (
    EXIT_COMPILER_UNAVAILABLE,
    EXIT_REJECTED,
    backend,
    emit,
    handle_errors,
    json_option,
    say,
    size_text,
    spec_options,
)
from farm.cli.edge import edge_agent, key_of
from farm.cli.submit import source_options
from farm.core.config import get_settings

_KEY = re.compile(r"^[0-9a-fA-F]{8,64}$")
"""A cache key, or a prefix of one (`farm.core.keyprefix`): then --device is where to run."""


def verify_ready_folder(ready: Path, as_json: bool) -> None:
    from farm.core.signing import TrustedKeys, public_key_path
    from farm.edge.bundle import verify_bundle  # GenAI: only when used

    settings = get_settings()
    own = public_key_path(settings.embedded_signing_key)
    keys = [*settings.trusted_key_paths, *([own] if own.exists() else [])]
    report = verify_bundle(ready, TrustedKeys.from_files(keys))

    def human() -> None:
        compiled = report["compiled_on_open"]
        say(
            f"bundle {report['bundle_key']}: same output as recorded at compile time; "
            + (f"compiled on open: {', '.join(compiled)}" if compiled else "nothing compiled")
        )

    emit(report, as_json, human)


@main.command()
@click.argument("key_or_model")
@spec_options(device_required=False)
@source_options
@click.option(
    "--runs",
    type=click.IntRange(1, 100_000),
    default=10,
    show_default=True,
    help="Timed inferences after one warm-up.",
)
@click.option(
    "--atol", type=click.FloatRange(min=0), help="Absolute error allowed (default: per target)."
)
@click.option(
    "--rtol", type=click.FloatRange(min=0), help="Error allowed relative to max|reference|."
)
@click.option(
    "--min-cosine", type=click.FloatRange(-1, 1), help="Lowest cosine similarity allowed."
)
@click.option(
    "--weights",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The model's .bin, for a weightless blob verified by cache key.",
)
@click.option("--allow-quarantined", is_flag=True, help="Verify a quarantined blob too.")
@click.option(
    "--wait",
    "wait_seconds",
    type=click.FloatRange(min=0),
    default=120,
    show_default=True,
    help="Seconds to wait for reference outputs still being computed (they follow the blob); "
    "past that, exit 4: not judged yet.",
)
@json_option
@handle_errors
def verify(
    key_or_model: str,
    runs: int,
    atol: float | None,
    rtol: float | None,
    min_cosine: float | None,
    weights: Path | None,
    allow_quarantined: bool,
    wait_seconds: float,
    as_json: bool,
    **options: Any,
) -> None:
    """Check that a blob computes its reference numbers on this machine's device, time it,
    and report it to the farm (a failure quarantines the blob fleet-wide).

    KEY_OR_MODEL is a cache key (then --device is the device to run on, default the blob's
    target's), or a model with its spec flags (the key this machine computes).
    Exit 0 within tolerance; 9 when outside it (the only outcome that counts against the
    blob); 4 when the verification could not judge it (OpenVINO would not import it here: out
    of memory, a missing device library; the reference inputs do not fit; reported, never
    counted against it), or this machine has no device of the blob's class, or its reference
    outputs are still being computed past --wait (nothing reported: not judged yet).
    KEY_OR_MODEL may be a ready pipeline folder (`farm pull FOLDER -o DIR`): its pipeline runs a
    fixed input with greedy decoding and must give the tokens recorded at compile time."""
    from farm.core.bundles import MANIFEST_NAME  # signing (cryptography): only for a bundle

    if (Path(key_or_model) / MANIFEST_NAME).is_file():
        verify_ready_folder(Path(key_or_model), as_json)
        return
    from farm.edge.verify import verify_blob  # OpenVINO: only when used

    run_on = None
    as_key = _KEY.match(key_or_model.strip()) and not Path(key_or_model).exists()
    if as_key and options["device"] is not None:
        run_on, options = options["device"], {**options, "device": None}
    farm = backend()
    key, model_bin = key_of(key_or_model, options, farm)
    agent = edge_agent(farm)
    agent.allow_quarantined = allow_quarantined
    record = agent.resolve(key)
    result = verify_blob(
        agent,
        key,
        _device(run_on),
        runs=runs,
        overrides={"atol": atol, "rtol": rtol, "min_cosine": min_cosine},
        weights=weights or model_bin,
        record=record,
        wait_seconds=wait_seconds,
    )
    tolerance = result.tolerance
    data = {
        "cache_key": key,
        "target": record["target"],
        "device": result.device,
        **result.report(),
        "outcome": result.outcome,
        "error_detail": result.error_detail,
        "farm": result.farm_answer,
    }

    def human() -> None:
        say(
            f"blob {key} ({record['target']}, {size_text(record['size_bytes'])}) on "
            f"{result.device_name}, OpenVINO {result.openvino_version}"
            + (f", driver {result.driver_version}" if result.driver_version else "")
        )
        if result.error:
            say(f"verification ERROR, nothing counted against the blob: {result.error}")
        for output in data["outputs"]:
            verdict = "ok" if output["passed"] else "OUTSIDE TOLERANCE"
            say(
                f"  {output['name']}: max abs error {_figure(output['max_abs_error'])}, "
                f"mean {_figure(output['mean_abs_error'])}, cosine "
                f"{_figure(output['cosine'], '.6f')}  {verdict}"
            )
        if data["runs"]:
            say(
                f"latency p50 {data['latency_p50_ms']:.3f} ms, p90 "
                f"{data['latency_p90_ms']:.3f} ms, min {data['latency_min_ms']:.3f} ms "
                f"({data['runs']} runs); import {1000 * (data['import_seconds'] or 0):.1f} ms; "
                f"peak RSS {size_text(data['peak_rss_bytes'] or 0)}"
            )
        if result.error is None:
            verdict = "passed" if data["passed"] else "FAILED"
            say(f"{verdict} ({tolerance.describe()})")
        if result.farm_answer and result.farm_answer.get("quarantined"):
            say(f"the farm quarantined blob {key}: edges refuse it until an admin releases it")

    emit(data, as_json, human)
    if result.outcome == "error":
        raise SystemExit(EXIT_COMPILER_UNAVAILABLE)
    if result.outcome == "failed":
        raise SystemExit(EXIT_REJECTED)


def _device(given: str | None) -> str | None:
    """`--device` for a cache key: the OpenVINO device to run on ("NPU", "NPU.0", "CPU"), also
    given as a target name ("4000" runs on the NPU)."""
    if given is None:
        return None
    if re.fullmatch(r"CPU|NPU(\.\d{1,2})?", given.upper()):  # OpenVINO's own names
        return given.upper()
    from farm.core.spec import Target

    return Target.parse(given).device


def _figure(value: float | None, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)
