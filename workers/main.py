"""`farm worker`: probe what this host compiles, consume only those queues, register, beat."""

from __future__ import annotations

import logging
import os
import socket
import threading

import openvino as ov
from celery import signals

from farm import toolchain
from farm.converters import probe as probe_converters
from farm.core import errors
from farm.core.config import Settings
from farm.core.errors import KeyFileError, ServiceUnavailable
from farm.core.logs import redact_logs
from farm.core.signing import TrustedKeys
from farm.core.spec import Target
from farm.core.vocabulary import CONTROL_QUEUE
from farm.server import routing
from farm.server.doctor import require_services, signing_check
from farm.server.jobs.compile_user import warn_if_compiles_as_worker
from farm.server.processes import die_with_parent, name_process

from . import tasks
from .app import make_app

log = logging.getLogger(__name__)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def genai_toolchains(
    compilable: list[str], converters: dict, can_sign: bool
) -> dict[str, dict[str, str]]:
    """Target -> the bundle key's toolchain part on this host, for the targets it compiles
    pipeline bundles for (§17): none without GenAI, with a GenAI of another release, or
    without a signing key (it could sign neither a part's listing nor a manifest)."""
    if routing.GENAI_CONVERTER not in converters:
        return {}
    if not can_sign:
        log.warning("no pipeline bundles on this worker: it has no signing key")
        return {}
    from farm import genai

    try:
        return {name: genai.toolchain(Target.parse(name)) for name in compilable}
    except errors.FarmError as error:
        log.warning("no pipeline bundles on this worker: %s", error)
        return {}


def check_trusted_keys(settings: Settings) -> None:
    """ServiceUnavailable unless FARM_TRUSTED_KEYS loads: read for bundle part listings, a key
    missing here would fail every part's task."""
    try:
        TrustedKeys.from_files(settings.trusted_key_paths)
    except KeyFileError as error:
        raise ServiceUnavailable(f"{error} (FARM_TRUSTED_KEYS)") from None


def run_worker(
    settings: Settings,
    *,
    concurrency: int = 1,
    name: str | None = None,
    beat: bool = False,
    loglevel: str = "INFO",
) -> None:
    """Start a Celery worker in this process; returns when it shuts down."""
    # Drivers' errors may quote their URLs: no log line of the worker shows a password.
    redact_logs(settings.secrets)
    require_services(settings)
    signing = signing_check(settings)
    if not signing.ok:
        if settings.signing_key is not None:
            raise ServiceUnavailable(f"{signing.detail} (FARM_SIGNING_KEY)")
        log.warning("%s", signing.detail)
    check_trusted_keys(settings)
    probe = toolchain.probe_targets()
    compilable = [target for target, reason in probe.items() if reason is None]
    if not compilable:
        raise errors.CompilerUnavailable(
            "this host compiles no target: " + "; ".join(filter(None, probe.values()))
        )
    memory = settings.worker_memory_bytes or host_memory_bytes()
    toolchains = {
        name: toolchain.host_toolchain(Target.parse(name)).key_part(Target.parse(name))
        for name in compilable
    }
    converters = probe_converters()  # stages it can run: torch, optimum (docs §15)
    bundles = genai_toolchains(compilable, converters, signing.ok)
    queues = [
        *routing.worker_queues(toolchains, memory, settings.large_worker_bytes, converters),
        *routing.worker_bundle_queues(bundles, memory, settings.large_worker_bytes),
        CONTROL_QUEUE,
    ]
    name = name or f"farm-{os.getpid()}@{socket.gethostname()}"
    tasks.serve_as(name)  # before the pool forks: every pool process inherits it
    app = make_app(settings)
    stop = threading.Event()

    def beat_loop() -> None:
        while not stop.wait(settings.worker_heartbeat_seconds):
            try:
                with tasks.context().sessions() as session:
                    routing.heartbeat(session, name)
            except Exception:
                log.warning("heartbeat failed", exc_info=True)

    @signals.worker_ready.connect(weak=False)
    def on_ready(**_: object) -> None:
        with tasks.context().sessions() as session:
            routing.register_worker(
                session,
                name=name,
                host=socket.gethostname(),
                pid=os.getpid(),
                targets=probe,
                toolchains=toolchains,
                converters=converters,
                queues=queues,
                openvino_version=ov.get_version(),
                memory_bytes=memory,
            )
        threading.Thread(target=beat_loop, name="farm-heartbeat", daemon=True).start()
        log.info("farm worker %s serves %s", name, ", ".join(queues))
        if warning := warn_if_compiles_as_worker(settings.compile_launcher):
            log.warning(warning)

    @signals.worker_shutdown.connect(weak=False)
    def on_shutdown(**_: object) -> None:
        stop.set()
        try:
            with tasks.context().sessions() as session:
                routing.mark_stopped(session, name)
        except Exception:
            log.warning("could not mark %s stopped", name, exc_info=True)

    argv = [
        "worker",
        "-Q",
        ",".join(queues),
        "-c",
        str(concurrency),
        "-n",
        name,
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
    ]
    if beat:
        settings.home.mkdir(parents=True, exist_ok=True)  # the beat's schedule file is there
        argv.append("--beat")
        _beat_dies_with(os.getpid())
    app.worker_main(argv)


def _beat_dies_with(worker_pid: int) -> None:
    """The embedded beat (`--beat`) is a child process of the worker: when the worker dies,
    even by SIGKILL, the beat dies too, instead of sending reconcile tasks beside the beat of
    the restarted worker. It shows as ``farm beat`` in ``ps``."""

    @signals.beat_embedded_init.connect(weak=False)
    def on_beat_start(**_: object) -> None:
        die_with_parent()
        name_process("farm beat")
        _keep_name_after_celery("farm beat")
        if os.getppid() != worker_pid:  # the worker died before the line above took hold
            os._exit(1)


def _keep_name_after_celery(name: str) -> None:
    """Celery titles the embedded beat right after `beat_embedded_init` ("[celery beat]", when
    setproctitle is installed, as it is with the dev tools), which renames the process: this
    beat process (a child of its own) names itself again after celery's title."""
    from celery import platforms

    celery_title = platforms.set_process_title

    def titled(progname: str, info: str | None = None) -> str:
        title = celery_title(progname, info=info)
        name_process(name)
        return title

    platforms.set_process_title = titled
