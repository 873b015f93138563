"""Building servelab's kernels survives a builder killed mid-build: the baton file torch's builder leaves behind
(it waits while one exists) is gone before the next build starts, so the next worker start does not wait forever."""

from __future__ import annotations

import types

import torch.utils.cpp_extension

from servelab.engine.kernels import ISAS, _build


def test_a_build_baton_left_by_a_killed_builder_is_gone_before_the_next_build(tmp_path, monkeypatch) -> None:
    isa = ISAS[0]
    batons_seen = []

    def builder(*, name, sources, build_directory, extra_cflags, extra_ldflags, verbose):
        # NOTE: torch's builder would wait here while `lock` exists; this one only records it (no compiler needed)
        batons_seen.append(len(list((tmp_path / "kernels").glob("*/lock"))))
        return types.SimpleNamespace(isa=lambda: isa.name)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", builder)
    first = _build(tmp_path, isa)  # makes the build folder
    build_dir = next((tmp_path / "kernels").iterdir())
    (build_dir / "lock").touch()  # what a builder killed mid-build leaves
    second = _build(tmp_path, isa)
    assert first.module is not None and second.module is not None
    assert batons_seen == [0, 0]


def test_a_compiler_without_openmp_still_builds_the_kernels_for_one_thread(tmp_path, monkeypatch) -> None:
    isa = ISAS[0]
    calls = []

    def builder(*, name, sources, build_directory, extra_cflags, extra_ldflags, verbose):
        calls.append(extra_cflags)
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("error: unsupported option '-fopenmp'")
        return types.SimpleNamespace(isa=lambda: isa.name, parallel=lambda: False)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", builder)
    built = _build(tmp_path, isa)
    assert built.module is not None and built.label.endswith("(one thread: built without OpenMP)")
    assert ["-fopenmp" in flags for flags in calls] == [True, False]
    assert len(list((tmp_path / "kernels").iterdir())) == 2  # each attempt in a folder of its own
