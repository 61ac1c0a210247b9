"""schemathesis against the live API's own OpenAPI spec: whatever it sends, never a 500; and
cursors tampered with (the one parameter whose meaning the spec cannot describe) answer 422.

Deterministic: hypothesis is derandomized (one fixed seed per test), so a CI run finds what the
run before it found, and a failure reproduces. Cost: about 20 s for the spec's operations at
50 examples each, plus about 2 s for the cursor properties (one API process, PostgreSQL).
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from farm.server.pagination import encode

FUZZ = settings(
    max_examples=50,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
LISTS = ("/v1/jobs", "/v1/blobs", "/v1/workers")
TAMPERED = [
    encode("job", "²"),  # str.isdigit() says yes, int() says no
    encode("job", "9223372036854775808"),  # past a BIGINT
    encode("job", "1" * 60),
    encode("job", "12\x00"),
    encode("blob", "0001-01-01T00:00:00+14:00", "1"),  # no UTC equivalent
    encode("blob", "9999-12-31T23:59:59-14:00", "1"),
    encode("blob", "2026-01-01T00:00:00", "1"),  # no zone: not one the server hands out
    encode("blob", "2026-01-01T00:00:00+00:00", "1" * 60),
    encode("worker", "w\x00"),
    encode("worker", "w") + "\x00",
    "am9ifDE\x00",
    "=" * 8,
]


def _call(api, path: str, cursor: str):
    import httpx

    headers = {"Authorization": f"Bearer {api.tokens['admin']}"}
    return httpx.get(f"{api.url}{path}", params={"cursor": cursor}, headers=headers, timeout=30)


def test_no_input_makes_a_server_error(api):
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    headers = {"Authorization": f"Bearer {api.tokens['admin']}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14

    for operation in operations:

        @given(case=operation.as_strategy())
        @FUZZ
        def never_500(case) -> None:
            response = case.call(headers=headers, timeout=30)
            where = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, (where, response.text[:500])
            if response.status_code >= 400:
                body = response.json()
                assert body["code"] and body["message"], (where, body)

        never_500()
    assert api.process.poll() is None  # still serving


def test_tampered_cursors_answer_422_never_a_500(api):
    for path in LISTS:
        for cursor in TAMPERED:
            response = _call(api, path, cursor)
            assert response.status_code == 422, (path, cursor, response.text[:300])
            assert response.json()["code"] in {"invalid_cursor", "invalid_request"}

    kinds = st.sampled_from(["job", "blob", "worker", "", "job|1"])
    parts = st.lists(st.text(max_size=40), min_size=1, max_size=3)

    @given(kind=kinds, rest=parts, path=st.sampled_from(LISTS))
    @settings(FUZZ, max_examples=100)
    def forged_cursor_is_never_a_500(kind: str, rest: list[str], path: str) -> None:
        response = _call(api, path, encode(kind, *rest))
        assert response.status_code in (200, 422), (path, kind, rest, response.text[:300])

    forged_cursor_is_never_a_500()
    assert api.process.poll() is None
