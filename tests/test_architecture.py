"""The folder list is the architecture: who may import whom, checked on the source's import statements."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROCESS_PACKAGES = ("api", "worker", "dashboard")
# NOTE: policy modules take time as an argument and import no I/O or tensor library.
PURE_MODULES = ("servelab/config.py", "servelab/memory.py", "servelab/request.py",
                "servelab/outputs.py", "servelab/scheduler/policy.py", "servelab/scheduler/state.py",
                "servelab/scheduler/scheduler.py", "servelab/analysis/verdict.py", "servelab/analysis/factors.py",
                "servelab/analysis/metrics.py", "servelab/analysis/stats.py", "servelab/analysis/workload.py",
                "servelab/analysis/roofline.py", "servelab/idempotency.py", "servelab/jobs/share.py",
                "servelab/jobs/prefix_groups.py")
HEAVY = ("torch", "transformers", "redis", "sqlalchemy", "celery", "gptqmodel")


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def imported_modules(path: Path) -> set[str]:
    """Every dotted module a file imports (lazy imports too), relative ones made absolute; for
    `from package import name` both the package and package.name, since the name may be a module."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            anchor = package[:len(package) - node.level + 1] if node.level else ()
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            modules |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return modules


def python_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", python_files("servelab"), ids=lambda p: str(p.relative_to(REPO)))
def test_core_never_imports_process_packages(path: Path) -> None:
    assert not imported_roots(path) & set(PROCESS_PACKAGES), path


@pytest.mark.parametrize("package", PROCESS_PACKAGES)
def test_process_packages_never_import_each_other(package: str) -> None:
    others = set(PROCESS_PACKAGES) - {package}
    for path in python_files(package):
        assert not imported_roots(path) & others, path


@pytest.mark.parametrize("package", ["api", "dashboard"])
def test_api_and_dashboard_never_import_torch(package: str) -> None:
    for path in python_files(package):
        assert not imported_roots(path) & {"torch", "transformers", "gptqmodel"}, path


@pytest.mark.parametrize("module", PURE_MODULES)
def test_policy_modules_import_no_io_or_tensor_library(module: str) -> None:
    assert not imported_roots(REPO / module) & set(HEAVY), module


def test_no_grab_bag_modules() -> None:
    names = {p.stem for folder in ("servelab", *PROCESS_PACKAGES) for p in python_files(folder)}
    assert not names & {"utils", "helpers", "common", "manager", "misc"}


def test_awq_never_imports_the_loader_that_picks_it() -> None:
    # NOTE: loader.py is the one place the weights pick the loader, and it imports the AWQ loader; the
    # pieces both loaders share live below both (model_files.py, loaded_model.py), so there is no circle.
    paths = python_files("servelab/engine/awq")
    assert paths, "servelab/engine/awq/ holds the AWQ modules"
    for path in paths:
        assert "servelab.engine.loader" not in imported_modules(path), path


@pytest.mark.parametrize("module", ["servelab/engine/model_files.py", "servelab/engine/loaded_model.py"])
def test_shared_loading_pieces_import_neither_loader(module: str) -> None:
    imported = imported_modules(REPO / module)
    assert not {m for m in imported if m == "servelab.engine.loader" or m.startswith("servelab.engine.awq")}, module


# The floors, lowest first: a module imports only from its own floor or below (lazy imports included). Each
# entry is a room: a package or a module of its own. The map (docs, the table headed | room | what it holds |
# floor |) says the same thing, room by room.
FLOORS = (
    # 0, the contract: what is served, where things are, a request, what comes back, memory arithmetic, retries
    ("servelab.config", "servelab.settings", "servelab.request", "servelab.outputs", "servelab.memory",
     "servelab.idempotency"),
    # 1: rows; the configs a request may name; the lab's pure arithmetic; the model; the step's plan; the host;
    # how up splits the cores; embedded servers; Prometheus counts; this process's memory
    ("servelab.store", "servelab.catalog", "servelab.analysis", "servelab.engine", "servelab.scheduler",
     "servelab.hardware", "servelab.cores", "servelab.embedded", "servelab.telemetry", "servelab.resident"),
    ("servelab.queue", "servelab.runtime"),  # 2: Redis streams; connections
    ("servelab.jobs", "servelab.protocol", "servelab.serving", "servelab.stack"),  # 3: control plane, OpenAI, worker, stack
    ("servelab.lab",),  # 4: the runners: runs, comparisons, calibration, quality, sweeps, benches
    ("servelab.cli", "api", "dashboard", "worker", "bench"),  # 5: entry points
)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (each import resolved to the longest module it names) and the
    root names of the libraries it imports."""
    paths = {module_name(p): p for folder in ("servelab", *PROCESS_PACKAGES, "bench") for p in python_files(folder)}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for imported in imported_modules(path):
            parts = imported.split(".")
            found = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in paths), None)
            targets.add(found if found is not None else parts[0])
        graph[module] = targets - {module}
    return graph


def reachable(graph: dict[str, set[str]], module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def floor_of(module: str) -> int | None:
    return next((i for i, rooms in enumerate(FLOORS)
                 if any(module == room or module.startswith(room + ".") for room in rooms)), None)


def test_every_module_stands_on_a_floor_and_imports_none_above_it() -> None:
    graph = import_graph()
    assert [m for m in graph if m != "servelab" and floor_of(m) is None] == []
    upward = [(m, t) for m, targets in graph.items() for t in targets
              if t in graph and m != "servelab" and floor_of(t) > floor_of(m)]
    assert upward == []


def test_the_floors_name_every_room_of_the_folders_and_no_other() -> None:
    rooms = [room for floor in FLOORS for room in floor]
    folders = {f"servelab.{p.stem}" for p in (REPO / "servelab").iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert len(rooms) == len(set(rooms)), "a room stands on one floor"
    assert set(rooms) == folders | {*PROCESS_PACKAGES, "bench"}


def map_tables() -> dict[str, dict[str, int]]:
    """Each map in the README and docs/ (a table headed | room | what it holds | floor |, its rooms written as
    paths: `servelab/store/`, `servelab/config.py`, `api/`), as room -> floor, by file and line."""
    tables = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        lines = path.read_text().splitlines() if path.exists() else []
        for k, line in enumerate(lines):
            if [c.strip() for c in line.strip().strip("|").split("|")] != ["room", "what it holds", "floor"]:
                continue
            table = tables[f"{path.relative_to(REPO)}:{k + 1}"] = {}
            for row in itertools.takewhile(lambda r: r.startswith("|"), lines[k + 2:]):
                cells = [c.strip() for c in row.strip().strip("|").split("|")]
                room = cells[0].strip("`").removesuffix("/").removesuffix(".py").replace("/", ".")
                assert room not in table, f"{path.name}: {room} has two rows"
                table[room] = int(cells[-1])
    return tables


def test_every_map_in_the_docs_says_what_the_floors_say() -> None:
    tables = map_tables()
    assert tables, "the README or docs/ hold the map"
    floors = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}
    assert {where: table for where, table in tables.items() if table != floors} == {}


def test_the_import_graph_has_no_circles() -> None:
    graph = import_graph()
    circles = [m for m in graph if m in reachable(graph, m)]
    assert circles == []


def room_of(module: str) -> str | None:
    return next((room for rooms in FLOORS for room in rooms if module == room or module.startswith(room + ".")), None)


def room_graph() -> dict[str, set[str]]:
    """room -> the other rooms its modules import (rooms are the entries of FLOORS)."""
    graph = import_graph()
    rooms: dict[str, set[str]] = {room: set() for floor in FLOORS for room in floor}
    for module, targets in graph.items():
        if (room := room_of(module)) is not None:
            rooms[room] |= {r for t in targets if (r := room_of(t)) not in (None, room)}
    return rooms


def test_no_two_rooms_import_each_other_even_through_others() -> None:
    # NOTE: the module-level circle test misses a loop between packages (protocol.py importing jobs/catalog.py
    # while jobs/ingest.py imported protocol.py was no circle of modules); rooms must form a ladder too.
    rooms = room_graph()
    loops = sorted((room, sorted(r for r in rooms[room] if room in reachable(rooms, r)))
                   for room in rooms if room in reachable(rooms, room))
    assert loops == []


def test_the_contract_floor_reaches_no_torch_redis_or_sqlalchemy() -> None:
    # NOTE: every room imports the contract (a request, its outputs, the memory arithmetic); were it to reach a
    # heavy library, the API and the dashboard would load it too.
    graph = import_graph()
    contract = [m for m in graph if floor_of(m) == 0]
    assert contract, "the contract floor holds modules"
    for module in contract:
        assert not reachable(graph, module) & set(HEAVY), module


def test_the_analysis_room_reaches_no_io_tensor_process_or_clock() -> None:
    # NOTE: the lab's arithmetic, plans and workloads are checked on hand-made figures; what drives workers
    # (subprocesses, the queue, the store) and reads the clock is servelab/lab's.
    graph = import_graph()
    analysis = [m for m in graph if m == "servelab.analysis" or m.startswith("servelab.analysis.")]
    assert len(analysis) > 1, "servelab/analysis holds modules"
    for module in analysis:
        reached = reachable(graph, module)
        assert not reached & {*HEAVY, "subprocess", "multiprocessing", "time"}, module
        assert not {m for m in reached if floor_of(m) is not None and floor_of(m) > 0
                    and not m.startswith("servelab.analysis")}, module


def test_the_store_reaches_no_lab_queue_redis_or_torch() -> None:
    graph = import_graph()
    for module in (m for m in graph if m.startswith("servelab.store")):
        reached = reachable(graph, module)
        assert not {m for m in reached if m.startswith(("servelab.lab", "servelab.queue"))}, module
        assert not reached & {"redis", "torch", "transformers"}, module


@pytest.mark.parametrize("package", ["api", "dashboard"])
def test_api_and_dashboard_reach_no_torch_through_any_import(package: str) -> None:
    graph = import_graph()
    for module in (m for m in graph if m == package or m.startswith(package + ".")):
        assert not reachable(graph, module) & {"torch", "transformers", "gptqmodel"}, module


def test_a_module_past_400_lines_says_at_its_top_why_it_is_one_piece() -> None:
    long = [p for folder in ("servelab", *PROCESS_PACKAGES) for p in python_files(folder)
            if len(p.read_text().splitlines()) > 400]
    unexplained = [str(p.relative_to(REPO)) for p in long
                   if "past 400 lines" not in " ".join((ast.get_docstring(ast.parse(p.read_text())) or "").lower().split())]
    assert unexplained == []
