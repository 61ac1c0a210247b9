"""One line of `farm doctor` and `/readyz`: what was checked, whether it is fine, and why not."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
