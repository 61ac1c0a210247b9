"""Text for people: URL passwords masked everywhere, secrets redacted from messages and log
lines, control characters shown instead of obeyed."""

from __future__ import annotations

import io
import logging

import pytest

from farm.core.config import Settings
from farm.core.logs import redact_logs
from farm.core.text import mask_url, mask_urls, printable, redact, strip_userinfo, url_password


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@127.0.0.1:6390/1", "redis://:***@127.0.0.1:6390/1"),
        ("postgresql+psycopg://farm:s3cret@db/farm", "postgresql+psycopg://farm:***@db/farm"),
        ("redis://:p@ss:w0rd@host/0", "redis://:***@host/0"),  # '@' and ':' in the password
        ("postgresql://farm:s3cret@db:port/farm", "postgresql://farm:***@db:port/farm"),
        ("redis://:s3cret@[::1/0", "redis://:***@[::1/0"),  # unparsable: masked all the same
        ("redis://127.0.0.1:6390/1", "redis://127.0.0.1:6390/1"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("/a/folder", "/a/folder"),
    ],
)
def test_mask_url_masks_the_password_of_any_url_and_never_raises(url, shown):
    assert mask_url(url) == shown


def test_urls_quoted_in_a_driver_message_are_masked():
    message = (
        'Could not connect to the endpoint URL: "http://key:s3cret@127.0.0.1:8399/farm"; '
        "redis://:other@host:1/0 and redis://host:6379/0 stay as they are"
    )
    assert mask_urls(message) == (
        'Could not connect to the endpoint URL: "http://key:***@127.0.0.1:8399/farm"; '
        "redis://:***@host:1/0 and redis://host:6379/0 stay as they are"
    )


def test_redact_replaces_secrets_as_given_and_percent_decoded():
    assert redact("auth se@cret failed; url had se%40cret", ["se%40cret"]) == (
        "auth *** failed; url had ***"
    )
    assert redact("ab is too short to hide", ["ab"]) == "ab is too short to hide"


def test_settings_know_their_secrets_and_drop_credentials_from_the_s3_endpoint():
    settings = Settings(
        database_url="postgresql+psycopg://farm:db-secret@db/farm",
        broker_url="redis://:broker-secret@redis:6379/0",
        s3_endpoint_url="http://key:endpoint-secret@s3:8333",
        s3_secret_access_key="s3-secret",
        token="token-secret",
    )
    assert settings.s3_endpoint_url == "http://s3:8333"
    assert settings.secrets == ["db-secret", "broker-secret", "s3-secret", "token-secret"]
    assert strip_userinfo("http://key:pw@h:port/x") == "http://h:port/x"
    assert url_password("redis://h/0") is None


def test_presigned_urls_carry_no_endpoint_credentials():
    from farm.server.storage import open_store

    settings = Settings(
        storage_url="s3://farm/p",
        s3_endpoint_url="http://key:endpoint-secret@127.0.0.1:8333",
        s3_access_key_id="farm",
        s3_secret_access_key="farm-secret",
    )
    store = open_store(settings.resolved_storage_url, settings)
    url = store.presigned_url("blobs/x.blob", 60)
    assert url.startswith("http://127.0.0.1:8333/farm/p/blobs/x.blob?")
    assert "endpoint-secret" not in url


def test_log_records_are_redacted_with_their_tracebacks():
    redact_logs(["token-secret-1234"])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("tests.unit.redaction")
    logger.addHandler(handler)
    try:
        logger.warning("storage failed: %s", "http://key:url-secret@s3:8333/farm")
        try:
            raise RuntimeError("AUTH token-secret-1234 refused by redis://:url-secret@r:1/0")
        except RuntimeError:
            logger.exception("broker failed")
    finally:
        logger.removeHandler(handler)
    logged = stream.getvalue()
    assert "url-secret" not in logged and "token-secret-1234" not in logged
    assert "storage failed: http://key:***@s3:8333/farm" in logged
    assert "RuntimeError: AUTH *** refused by redis://:***@r:1/0" in logged


def test_an_access_log_line_with_a_hostile_path_is_redacted_and_still_formatted():
    from uvicorn.logging import AccessFormatter

    redact_logs()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s'))
    logger = logging.getLogger("tests.unit.redaction.access")
    logger.addHandler(handler)
    try:
        path = "/v1/jobs?next=redis://:in-a-path@host/0"
        logger.warning('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1", 404)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == (
        '127.0.0.1:5 - "GET /v1/jobs?next=redis://:***@host/0 HTTP/1.1" 404 Not Found\n'
    )


def test_printable_shows_control_characters_instead_of_obeying_them():
    hostile = "Relu\x1b]0;title\x07\x1b]52;c;aGk=\x07\x1b[2J\x9b2J\x7f\r\x00"
    assert printable(hostile) == (
        "Relu\\x1b]0;title\\x07\\x1b]52;c;aGk=\\x07\\x1b[2J\\x9b2J\\x7f\\x0d\\x00"
    )
    assert printable("line one\n\tline two") == "line one\n\tline two"
    assert printable("cell\nwith\ttabs", multiline=False) == "cell\\x0awith\\x09tabs"
    assert printable("name-\udcff.xml") == "name-\\udcff.xml"  # not UTF-8: shown, not a crash
    assert printable("ünïcödé → ok") == "ünïcödé → ok"
