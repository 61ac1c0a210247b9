"""How close a blob's outputs must be to its reference outputs, per device class.

Apart from `farm.core.reference` (numpy) so that the farm's server, which only judges reports,
and the CLI's listings load no numpy.
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


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    # The CPU plugin in f32 reproduces the f32 reference up to summation order.
    "CPU": Tolerance(atol=1e-4, rtol=1e-4, min_cosine=0.99999),
    # NPUs compute in fp16 (10-bit mantissa): about 1e-3 relative per operation, compounding.
    "NPU": Tolerance(atol=1e-2, rtol=2e-2, min_cosine=0.999),
}


def default_tolerance(device: str) -> Tolerance:
    """The tolerance for a target's device ("CPU", "NPU"); overridable per run."""
    return DEFAULT_TOLERANCES["CPU" if device.upper() == "CPU" else "NPU"]
