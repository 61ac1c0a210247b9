"""How close a blob's outputs must be to its reference outputs, by the precision it computes in.

One table (`TOLERANCES`), documented once: the table in docs/architecture.md §14, which a test
reads and compares with this one. Apart from `farm.core.reference` (numpy) so that the farm's
server, which only judges reports, and the CLI's listings load no numpy. No OpenVINO either:
the edge names the precision (`precision_name` in farm/edge/verify.py turns OpenVINO's
`Type` into one of the names below).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """How close a blob's outputs must be to the reference: every output's largest absolute
    error at most `atol + rtol * max|reference|`, and its cosine similarity at least
    `min_cosine`."""

    atol: float
    rtol: float
    min_cosine: float

    def describe(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g} cosine>={self.min_cosine:g}"


TOLERANCES: dict[str, Tolerance] = {
    # The CPU plugin in f32 reproduces the f32 reference up to summation order.
    "f32": Tolerance(atol=1e-4, rtol=1e-4, min_cosine=0.99999),
    # fp16 (10-bit mantissa, NPUs; CPUs told INFERENCE_PRECISION_HINT=f16): about 1e-3
    # relative per operation, compounding.
    "f16": Tolerance(atol=1e-2, rtol=2e-2, min_cosine=0.999),
    # bf16 (8-bit mantissa, CPUs with AMX or AVX512-BF16 by default): 4x f16's rounding.
    "bf16": Tolerance(atol=4e-2, rtol=8e-2, min_cosine=0.996),
}
"""The tolerance of each precision a blob computes in (docs/architecture.md §14, one table)."""

DEVICE_PRECISION = {"CPU": "f32", "NPU": "f16"}
"""What a device class computes in when its compiled model does not say (NPUs: fp16)."""


def tolerance_class(device: str, precision: str | None = None) -> str:
    """The row of `TOLERANCES` for a blob on `device` ("CPU", "NPU", "NPU.0") whose compiled
    model reports `precision` (its INFERENCE_PRECISION_HINT as a `TOLERANCES` name; None when
    it reports none). An NPU is held to f16 whatever it reports; a precision not in the table
    (f8, i8) gets the loosest row that is still a float one, bf16."""
    if not device.upper().startswith("CPU"):
        return DEVICE_PRECISION["NPU"]
    if precision is None:
        return DEVICE_PRECISION["CPU"]
    return precision if precision in TOLERANCES else "bf16"


def default_tolerance(device: str, precision: str | None = None) -> Tolerance:
    """The tolerance for a target's device ("CPU", "NPU") computing in `precision`; each
    figure overridable per run (`farm verify --atol ...`)."""
    return TOLERANCES[tolerance_class(device, precision)]
