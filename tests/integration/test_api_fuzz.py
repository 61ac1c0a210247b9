"""schemathesis against the live API's own OpenAPI spec: whatever it sends, never a 500."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings


def test_no_input_makes_a_server_error(api):
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    headers = {"Authorization": f"Bearer {api.tokens['admin']}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def never_500(case) -> None:
            response = case.call(headers=headers, timeout=30)
            where = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, (where, response.text[:500])
            if response.status_code >= 400:
                body = response.json()
                assert body["code"] and body["message"], (where, body)

        never_500()
    assert api.process.poll() is None  # still serving
