"""Revision 0013 gives blobs retired while quarantined their quarantine reason back from the
reason those paths wrote ("<why> after quarantine: <reason>"), on SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import text

from farm.server.db.session import make_engine, upgrade_database


def test_0013_backfills_the_quarantine_reason_of_retired_blobs(database_url):
    upgrade_database(database_url, "0012")
    engine = make_engine(database_url)
    columns = (
        "cache_key, storage_key, target, size_bytes, sha256, blob_created_at, pulls, "
        "failed_pulls, reason, deleted_at, state"
    )
    with engine.begin() as connection:
        for index, reason in enumerate(
            (
                "rebuilt after quarantine: verification 3 on NPU (e): outside tolerance",
                "deleted by root@host after quarantine: bad numbers",
                "unpulled for 30 days",
            )
        ):
            connection.execute(
                text(
                    f"INSERT INTO blob_deletions ({columns}) VALUES (:key, 'k', 'CPU', 1, :sha, "
                    "CURRENT_TIMESTAMP, 0, 0, :reason, CURRENT_TIMESTAMP, 'deleted')"
                ),
                {"key": str(index) * 64, "sha": "f" * 64, "reason": reason},
            )
    upgrade_database(database_url, "0013")
    with engine.begin() as connection:
        rows = connection.execute(
            text("SELECT quarantine_reason FROM blob_deletions ORDER BY cache_key")
        ).all()
    engine.dispose()
    assert [row[0] for row in rows] == [
        "verification 3 on NPU (e): outside tolerance",
        "bad numbers",
        None,
    ]
