"""`/dashboard` in headless Chromium: sign in through the form, read jobs, blobs and workers,
filter them, and check screenshots for the failed-state badge; plus the login rules over HTTP."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from farm.server import routing
from farm.server.api.dashboard import COOKIE
from farm.server.api.dashboard_html import FAILED_RGB
from farm.server.tokens import create_token, revoke_token
from tests import models
from tests.integration.admin_farm import admin_farm
from tests.integration.chromium import Chromium, chromium_path

ODD_WORKER = "<b>w2</b>@host"
"""A worker name with markup: the page must show it as text."""


@pytest.fixture
def empty_farm(sqlite_url, tmp_path):
    env = {"FARM_DATABASE_URL": sqlite_url, "FARM_STORAGE_URL": str(tmp_path / "store")}
    with admin_farm(env, tmp_path) as farm:
        yield farm


@pytest.fixture
def farm(empty_farm):
    """A succeeded job with its blob pulled once, a failed job, and a worker."""
    farm = empty_farm
    (ok,) = farm.submit(models.conv_net(), "conv", "-d", "CPU")
    # A compile OpenVINO refuses (an NPU target is no job on the embedded farm any more).
    bad = ("--config", "PERFORMANCE_HINT_NUM_REQUESTS=999999999999")
    (failed,) = farm.submit(models.conv_net(), "conv", "-d", "CPU", *bad, expect=1)
    assert farm.pull(ok["cache_key"], "edge-1")["ok"]
    with farm.sessions() as session:
        routing.register_worker(
            session,
            name=ODD_WORKER,
            host="host",
            pid=1,
            targets={"CPU": None},
            queues=["compile.cpu"],
            openvino_version="2026.0.0-1234",
            memory_bytes=2**34,
        )
    farm.facts = {"ok": ok, "failed": failed}
    return farm


@pytest.fixture
def browser(tmp_path):
    if chromium_path() is None:
        message = "chromium is not installed (apt-get install chromium; scripts/test does it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    chromium = Chromium(tmp_path / "chromium-profile")
    yield chromium
    chromium.close()


def job_ids(browser: Chromium) -> list[str]:
    """The job numbers in the page's jobs table, top to bottom."""
    return browser.evaluate(
        "Array.from(document.querySelectorAll('h2 + table')[0]?.rows ?? [])"
        ".slice(1).map(row => row.cells[0].innerText)"
    )


def test_the_dashboard_in_a_browser(browser, farm, tmp_path):
    base = f"{farm.api.url}/dashboard"
    browser.open(base)  # not signed in: the login form
    assert "API token" in browser.text()
    token = farm.tokens["submit"]
    browser.evaluate(
        f"document.querySelector('input[name=token]').value = '{token}';"
        "document.querySelector('form').submit()",
        wait_load=True,
    )
    page = browser.text()
    ok, failed = farm.facts["ok"], farm.facts["failed"]
    for expected in (
        "farm dashboard",
        "test-submit",
        "Wrong value",  # the failed job's error
        ok["cache_key"][:16],
        ODD_WORKER,  # shown as text, not markup
    ):
        assert expected in page, expected
    assert browser.evaluate("document.querySelectorAll('td b').length") == 0
    assert job_ids(browser) == sorted(
        [str(ok["job"]["id"]), str(failed["job"]["id"])], reverse=True
    )
    shot = browser.screenshot(tmp_path / "dashboard.png")
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    assert int.from_bytes(shot[16:20], "big") == browser.width
    assert browser.count_pixels(shot, FAILED_RGB) > 100  # the red 'failed' badge

    browser.open(f"{base}?state=succeeded&target=CPU")
    assert job_ids(browser) == [str(ok["job"]["id"])]
    assert "Wrong value" not in browser.text()
    succeeded_only = browser.screenshot(tmp_path / "succeeded.png")
    assert browser.count_pixels(succeeded_only, FAILED_RGB) == 0

    browser.open(f"{base}?state=failed")
    assert job_ids(browser) == [str(failed["job"]["id"])]
    browser.open(f"{base}?state=cancelled")
    assert "no jobs match" in browser.text()


def test_dashboard_login_rules(empty_farm):
    farm = empty_farm
    base = f"{farm.api.url}/dashboard"
    with httpx.Client(follow_redirects=False, timeout=30) as client:
        anonymous = client.get(base)
        assert anonymous.status_code == 303 and anonymous.headers["location"] == "/dashboard/login"
        for token in ("farm_forged", farm.tokens["pull"]):
            refused = client.post(f"{base}/login", data={"token": token})
            assert refused.status_code == 401 and "role" in refused.text

        login = client.post(f"{base}/login", data={"token": farm.tokens["submit"]})
        assert login.status_code == 303
        cookie = login.headers["set-cookie"].lower()
        for attribute in ("httponly", "samesite=lax", "path=/dashboard", "max-age=28800"):
            assert attribute in cookie, attribute
        assert "secure" not in cookie  # plain HTTP here; over HTTPS it is set
        session_id = client.cookies[COOKIE]
        assert farm.tokens["submit"] not in login.headers["set-cookie"]  # a session, not the token
        assert not session_id.startswith("farm_") and len(session_id) >= 43
        page = client.get(base)
        assert page.status_code == 200 and "test-submit" in page.text
        assert "script-src" not in page.headers["content-security-policy"]
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert client.get(f"{base}?state=bogus").status_code == 422

        # Logging out ends the session on the server: its cookie, replayed, opens nothing.
        assert client.post(f"{base}/logout").status_code == 303
        replayed = httpx.get(base, cookies={COOKIE: session_id}, timeout=30)
        assert replayed.status_code == 303 and replayed.headers["location"] == "/dashboard/login"
        assert client.post(f"{base}/login", data={"token": farm.tokens["submit"]}).is_redirect
        assert client.get(base).status_code == 200

        with farm.sessions() as session:
            revoke_token(session, "test-submit")
        assert client.get(base).status_code == 303  # the session's token is revoked: out

        with farm.sessions() as session:
            admin = create_token(session, "admin-1", "admin")
            soon = datetime.now(UTC) + timedelta(seconds=3)
            expired = create_token(session, "soon-expired", "admin", soon)
        bearer = httpx.get(base, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        assert bearer.status_code == 200 and "admin-1" in bearer.text
        # A valid token without the role: 403 saying so, not the login page again.
        edge = {"Authorization": f"Bearer {farm.tokens['pull']}"}
        pull = httpx.get(base, headers=edge, timeout=30, follow_redirects=False)
        assert pull.status_code == 403 and "has the &#x27;pull&#x27; role" in pull.text
        # A session never outlives its token: this one expires with it, within 3 s.
        with httpx.Client(follow_redirects=False, timeout=30) as brief:
            short = brief.post(f"{base}/login", data={"token": expired})
            assert short.status_code == 303
            max_age = int(short.headers["set-cookie"].lower().split("max-age=")[1].split(";")[0])
            assert 1 <= max_age <= 3
            time.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.1)
            assert brief.get(base).status_code == 303  # the token expired: so did its session
        assert client.post(f"{base}/login", data={"token": expired}).status_code == 401
