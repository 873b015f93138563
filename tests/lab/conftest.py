"""Fixtures shared with the engine tests: the tiny random model and the bundled model."""

from tests.engine.conftest import bundled_engine, bundled_folder, settings, tiny_engine, tiny_folder  # noqa: F401
