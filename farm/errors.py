"""Errors shared by the CLI, the API and the edge; no dependencies, so the edge can use them."""


class NotFound(LookupError):
    """No job or blob by that id or cache key."""


class IntegrityMismatch(Exception):
    """Stored or downloaded bytes do not match their recorded sha256."""


class WorkDiskFull(Exception):
    """The worker's temporary directory has no room for a compile's files. An infrastructure
    error: the job is retried (perhaps by a worker with more room), then fails with this."""
