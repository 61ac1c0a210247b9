"""Who the compile child runs as (the compile user), and what the worker does as that user.

A worker running as root starts the child as root and the child switches itself
(`farm.server.jobs.sandbox`). A worker that is not root (the Docker image's ``farm``) cannot:
it starts the child through a launcher (``FARM_COMPILE_LAUNCHER``: a copy of util-linux
``setpriv`` with the file capabilities ``cap_setuid,cap_setgid``, executable only by the
worker's group, made by docker/compile-sandbox.sh), which switches before the child's first
instruction. Such a worker may not signal its child or remove what the child made (another
uid), so it does that through the launcher too: ``python -m farm.server.jobs.compile_user
--kill PGID`` or ``--empty BOX``, run as the compile user (`as_compile_user`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from farm.core import errors

log = logging.getLogger(__name__)
DEFAULT_COMPILE_USER = "nobody"
"""Who compiles when the worker runs as root and FARM_COMPILE_USER is unset."""


@dataclass(frozen=True)
class ChildUser:
    """Who the compile child runs as, and how it becomes that user: through `launcher` (a
    worker that is not root), or by switching itself (None: a worker running as root)."""

    uid: int
    gid: int
    launcher: Path | None = None


LAUNCHER_OPTIONS = ("--clear-groups", "--inh-caps=-all", "--no-new-privs")
"""What the launcher (``setpriv``) does besides setting the uid and gid: no supplementary
groups (not the worker's), no capabilities to pass on, none to gain from any later exec."""


def compile_identity(
    compile_user: str | None = None, launcher: Path | None = None
) -> ChildUser | None:
    """Who the compile child runs as, or None: it stays who the worker is.

    A worker running as root switches to `compile_user` (a name or a uid; default nobody);
    ``root`` or uid 0 keeps root. A worker that is not root switches only through `launcher`
    (FARM_COMPILE_LAUNCHER), to `compile_user`; without one its child is the worker's user,
    which can read what the worker can (its signing key): `warn_if_compiles_as_worker`."""
    if os.geteuid() != 0 and launcher is None:
        return None
    name = compile_user or DEFAULT_COMPILE_USER
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        if not name.isdigit():
            raise errors.SandboxUnavailable(
                f"no user {name!r} on this host to run compiles as (FARM_COMPILE_USER): create "
                "it, or name an existing unprivileged user or a numeric uid"
            ) from None
        uid = gid = int(name)  # a uid of its own, with no entry in /etc/passwd
    if os.geteuid() == 0:
        return None if uid == 0 else ChildUser(uid, gid)
    if uid in (0, os.getuid()):
        raise errors.SandboxUnavailable(
            f"FARM_COMPILE_USER {name!r} is {'root' if uid == 0 else 'the worker itself'}: "
            "with FARM_COMPILE_LAUNCHER it must name a user of its own (farm-compile in the "
            "Docker image)"
        )
    if launcher is None or not os.access(launcher, os.X_OK):
        raise errors.SandboxUnavailable(
            f"FARM_COMPILE_LAUNCHER {launcher} is not an executable this user ({os.getuid()}) "
            "may run: install it as docker/Dockerfile does (a copy of setpriv, group of the "
            "worker, mode 0750, cap_setuid,cap_setgid+ep), or unset it"
        )
    return ChildUser(uid, gid, launcher)


def warn_if_compiles_as_worker(compile_launcher: Path | None) -> str | None:
    """The warning a worker logs at start when its compile child would run as the worker's
    own user (not root, no launcher), or None."""
    if os.geteuid() == 0 or compile_launcher is not None:
        return None
    return (
        "this worker is not root and FARM_COMPILE_LAUNCHER is unset: compiles run as the "
        "worker's own user, so a model that took over the compiler could read what the worker "
        "can (its signing key, its environment); set FARM_COMPILE_LAUNCHER and "
        "FARM_COMPILE_USER as the Docker image does (SECURITY.md)"
    )


_SECURE_EXEC_DROPS = ("LD_LIBRARY_PATH", "GLIBC_TUNABLES", "TMPDIR")
"""Variables of the child's environment that the C library removes when it starts a program
with file capabilities (the launcher): `launched` sets them again after it, through env."""


def launched(
    identity: ChildUser | None, command: list[str], env: Mapping[str, str] | None = None
) -> list[str]:
    """`command` as started with the environment `env`: through the launcher when there is
    one, then ``env`` to restore what the launcher's start removed from `env`."""
    if identity is None or identity.launcher is None:
        return command
    ids = [f"--reuid={identity.uid}", f"--regid={identity.gid}"]
    env = env or {}
    kept = [f"{name}={env[name]}" for name in _SECURE_EXEC_DROPS if name in env]
    restore = [shutil.which("env") or "/usr/bin/env", *kept] if kept else []
    return [str(identity.launcher), *ids, *LAUNCHER_OPTIONS, "--", *restore, *command]


def as_compile_user(identity: ChildUser, env: Mapping[str, str], *arguments: str) -> None:
    """Run this module's `_service` as the compile user, with the environment `env` (the
    child's): what the worker may not do to the child's processes and files itself (another
    uid). A failure is logged, not raised: the job's outcome is decided already."""
    command = [sys.executable, "-P", "-m", "farm.server.jobs.compile_user", *arguments]
    try:
        done = subprocess.run(
            launched(identity, command, env),
            cwd="/",
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("could not run %s as the compile user: %s", " ".join(arguments), error)
        return
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        log.warning("%s as the compile user failed (%d): %s", arguments[0], done.returncode, last)


def _group_members(pgid: int) -> set[int]:
    """The processes of process group `pgid` (``/proc/<pid>/stat``, readable for any process)."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # ended meanwhile
            if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp
                members.add(int(entry))
    return members


def kill_group(
    pgid: int, identity: ChildUser | None, leader_exited: bool, env: Mapping[str, str]
) -> None:
    """SIGKILL process group `pgid` (the child, its leader, and whatever it started), as the
    child's user when this process may not signal it (only when something is left to kill),
    with the child's environment `env` (never the worker's: other processes of that user
    could read it)."""
    if identity and identity.launcher:
        if not leader_exited or _group_members(pgid) - {pgid}:
            as_compile_user(identity, env, "--kill", str(pgid))
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _service(action: str, argument: str) -> int:
    """What the worker asks of the compile user through the launcher: kill the child's process
    group (``--kill PGID``), or empty its box (``--empty BOX``), whatever the child made of
    it (folders it closed, files it made read-only)."""
    if action == "--kill":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(argument), signal.SIGKILL)
        return 0
    box = Path(argument)
    for folder, names, _ in os.walk(box):  # top down: each folder opened before it is listed
        for name in names:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
    for entry in box.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(_service(sys.argv[1], sys.argv[2]))
