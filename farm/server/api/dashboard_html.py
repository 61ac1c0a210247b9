"""The dashboard's HTML: plain server-rendered tables, every value escaped, no scripts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from html import escape
from typing import Any

from farm.core import compression
from farm.core.text import converters_text, size_text, toolchains_text
from farm.core.vocabulary import JOB_STATES

SECURITY_HEADERS = {
    # No scripts at all; styles and forms only from here; never framed (clickjacking).
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.4em; margin: 0 0 .5em; } h2 { font-size: 1.1em; margin: 1.5em 0 .4em; }
header { display: flex; justify-content: space-between; align-items: baseline; }
.cards { display: flex; gap: 1em; flex-wrap: wrap; }
.card { border: 1px solid #ccc; border-radius: 4px; padding: .4em .8em; }
form.filters { margin: 1em 0; display: flex; gap: .6em; align-items: end; flex-wrap: wrap; }
form.filters label { display: flex; flex-direction: column; font-size: .85em; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .25em .6em; border-bottom: 1px solid #e4e4e4; }
th { background: #f4f4f4; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: .9em; }
.state { display: inline-block; padding: 0 .5em; border-radius: 3px; color: #fff; }
.state-queued { background: #757575; } .state-running { background: #1565c0; }
.state-succeeded { background: #2e7d32; } .state-failed { background: #c62828; }
.state-cancelled { background: #ef6c00; }
.error { color: #c62828; } .muted { color: #777; }
"""
FAILED_RGB = (0xC6, 0x28, 0x28)
"""The failed-state badge colour (the browser test looks for these pixels)."""


def _layout(title: str, body: str) -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{escape(title)}</title>"
        '<link rel=stylesheet href="/dashboard/style.css"></head>'
        f"<body>{body}</body></html>"
    )


def login(error: str | None = None) -> str:
    note = f'<p class="error">{escape(error)}</p>' if error else ""
    return _layout(
        "farm: sign in",
        "<h1>farm dashboard</h1>"
        f"{note}"
        '<form method="post" action="/dashboard/login">'
        "<label>API token (role submit or admin) "
        '<input type="password" name="token" autocomplete="off" required></label> '
        '<button type="submit">Sign in</button></form>',
    )


def message(text: str) -> str:
    return _layout("farm", f'<p class="error">{escape(text)}</p>')


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]], empty: str) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(f"<tr>{''.join(cells)}</tr>" for cells in rows)
    return f"<table><tr>{head}</tr>{body}</table>" if body else f'<p class="muted">{empty}</p>'


def _td(value: Any, num: bool = False) -> str:
    text = "" if value is None else str(value)
    return f'<td class="num">{escape(text)}</td>' if num else f"<td>{escape(text)}</td>"


def _when(value: Any) -> str:
    return "" if value is None else str(value)[:19]


def _size(count: int | None) -> str:
    return size_text(count or 0)


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def jobs_table(
    jobs: Iterable, model_names: Mapping[int, str], phases: Mapping[int, str] | None = None
) -> str:
    rows = (
        [
            _td(job.id, num=True),
            _td(model_names.get(job.model_id)),
            _td(job.target),
            f'<td><span class="state state-{escape(job.state)}">{escape(job.state)}</span></td>',
            _td(job.queue),
            _td(job.submitter),
            _td(_when(job.created_at)),
            _td(_seconds(job.compile_seconds), num=True),
            _td((phases or {}).get(job.id, "")),
            _td((job.error or "")[:120]),
        ]
        for job in jobs
    )
    headers = [
        *("job", "model", "target", "state", "queue", "submitter", "created", "compile s"),
        *("phases (s)", "error"),
    ]
    return _table(headers, rows, "no jobs match")


def blobs_table(
    blobs: Iterable,
    pulls: Mapping[int, tuple[int, Any]],
    compressions: Mapping[int, Mapping[str, Any]] | None = None,
) -> str:
    compressions = compressions or {}
    rows = (
        [
            f"<td><code>{escape(blob.cache_key[:16])}</code></td>",
            _td(blob.model.name),
            _td(blob.target),
            _td(blob.openvino_version),
            _td(_size(blob.size_bytes), num=True),
            _td(_seconds(blob.compile_seconds), num=True),
            _td(pulls.get(blob.id, (0, None))[0], num=True),
            _td(_when(pulls.get(blob.id, (0, None))[1]) or "never"),
            _td(_when(blob.created_at)),
            _td(_verification_state(blob)),
            _td(_compression(compressions.get(blob.id))),
        ]
        for blob in blobs
    )
    headers = [
        *("cache key", "model", "target", "OpenVINO", "size", "compile s", "pulls"),
        "last pull",
    ]
    return _table((*headers, "created", "verification", "compression"), rows, "no blobs match")


def _compression(compressed: Mapping[str, Any] | None) -> str:
    """`int4_sym 0.144x, drift max-abs 0.0123 cosine 0.9998` (docs §15); empty: none."""
    if not compressed:
        return ""
    metrics = compressed.get("metrics") or {}
    what = compressed["args"].get("mode") or compressed["args"].get("precision")
    ratio = metrics.get("ratio")
    drift = compression.drift_summary(metrics)
    return f"{what} {ratio:.3g}x, drift {drift}" if ratio else f"{what}, drift {drift}"


def _verification_state(blob: Any) -> str:
    """What the fleet knows of the blob's numbers: quarantined, or whether it can be verified."""
    if blob.quarantined_at is not None:
        return f"QUARANTINED: {blob.quarantine_reason}"
    if blob.reference_state == "pending":  # computed after the blob (docs §14)
        return "reference pending"
    return "reference outputs" if blob.reference_sha256 else "no reference"


def workers_table(workers: Iterable, live: set[str]) -> str:
    rows = (
        [
            _td(w.name),
            _td("live" if w.name in live else ("stopped" if w.stopped_at else "silent")),
            _td(toolchains_text(w.toolchains)),
            _td(converters_text(w.converters)),
            _td(", ".join(w.queues)),
            _td(_size(w.memory_bytes), num=True),
            _td(w.openvino_version.split("-")[0]),
            _td(_when(w.heartbeat_at)),
        ]
        for w in workers
    )
    headers = (
        "worker",
        "status",
        "toolchains",
        "converters",
        "queues",
        "memory",
        "OpenVINO",
        "last heartbeat",
    )
    return _table(headers, rows, "no live workers")


def channels_table(channels: Iterable[Mapping[str, Any]]) -> str:
    """Per channel: its rollout, its edges, and per OpenVINO release the farm's workers
    compile with, its entries built for it (prebuilt before the fleet upgrades)."""
    rows = (
        [
            _td(c["channel"]),
            _td(c["stable_revision"]),
            _td(
                ""
                if c["candidate_revision"] is None
                else f"{c['candidate_revision']} on {c['percent']} %"
            ),
            _td(c["edges"], num=True),
            _td(c["failing"], num=True),
            _td(", ".join(f"{r}: {n}/{of}" for r, (n, of) in sorted(c["built"].items()))),
        ]
        for c in channels
    )
    headers = ("channel", "stable", "rolling out", "edges", "failing", "built per OpenVINO")
    return _table(headers, rows, "no channels")


def _filters(filters: Mapping[str, str], limit: int, all_workers: bool) -> str:
    options = "".join(
        f'<option value="{s}"{" selected" if filters["state"] == s else ""}>{s or "any"}</option>'
        for s in ("", *JOB_STATES)
    )
    checked = " checked" if all_workers else ""
    return (
        '<form class="filters" method="get" action="/dashboard">'
        f'<label>state <select name="state">{options}</select></label>'
        f'<label>target <input name="target" value="{escape(filters["target"])}" size=10></label>'
        '<label>submitter <input name="submitter" '
        f'value="{escape(filters["submitter"])}" size=12></label>'
        f'<label>rows <input name="limit" type="number" min=1 max=500 value="{limit}"></label>'
        f'<label><span><input type="checkbox" name="workers" value="all"{checked}> '
        "stopped workers too</span></label>"
        '<button type="submit">Filter</button></form>'
    )


def dashboard(
    user: str,
    filters: Mapping[str, str],
    limit: int,
    all_workers: bool,
    summary: Mapping[str, Any],
    jobs: str,
    blobs: str,
    workers: str,
    channels: str = "",
) -> str:
    states = summary["states"]
    blob_count, blob_bytes = summary["blobs"]
    cards = "".join(
        f'<div class="card">{escape(label)} <b>{escape(str(value))}</b></div>'
        for label, value in (
            *((state, states.get(state, 0)) for state in JOB_STATES),
            ("blobs", blob_count),
            ("stored", _size(blob_bytes)),
            ("live workers", summary["live_workers"]),
        )
    )
    return _layout(
        "farm dashboard",
        "<header><h1>farm dashboard</h1>"
        f'<form method="post" action="/dashboard/logout">{escape(user)} '
        '<button type="submit">Sign out</button></form></header>'
        f'<div class="cards">{cards}</div>'
        f"{_filters(filters, limit, all_workers)}"
        f"<h2>Jobs</h2>{jobs}<h2>Blobs</h2>{blobs}<h2>Workers</h2>{workers}"
        + (f"<h2>Channels</h2>{channels}" if channels else ""),
    )
