"""The serving configs a request may name: the YAML files of the configs folder and those workers registered.

Knows names, each config's decoding limits, which configs have a live worker (a recent heartbeat), and the sampling
defaults a config's model declares in its generation_config.json. Does not know HTTP: an unknown name is an
UnknownModel error that lists the names that exist.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from servelab.config import BUNDLED_PREFIX, ConfigError, ServingConfig
from servelab.store.models import ServingConfigRow, WorkerRow

log = logging.getLogger(__name__)
# NOTE: the sampling fields a model's generation_config.json may set for it, as vLLM reads them (its
# --generation-config auto): a request that leaves one out gets the model's value, not the API's default
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class UnknownModel(LookupError):
    """A request named a serving config that does not exist; the message lists those that do."""


@dataclass(frozen=True)
class Catalog:
    configs: dict[str, ServingConfig]
    live_names: frozenset[str]

    def get(self, name: str) -> ServingConfig:
        config = self.configs.get(name)
        if config is None:
            known = ", ".join(sorted(self.configs)) or "(none)"
            raise UnknownModel(f"the model {name!r} does not exist; known models (serving configs): {known}")
        return config


def load_catalog(session: Session, *, configs_dir: Path, live_since: datetime) -> Catalog:
    """YAML configs, overridden by the config a registered worker actually serves under the same name."""
    configs: dict[str, ServingConfig] = {}
    for path in sorted(configs_dir.glob("*.yaml")) if configs_dir.is_dir() else []:
        try:
            config = ServingConfig.from_yaml(path)
        except ConfigError as exc:
            log.warning("skipping a bad serving config: %s", exc)
            continue
        configs[config.name] = config
    workers = session.execute(
        select(WorkerRow.serving_config_name, WorkerRow.heartbeat_at, ServingConfigRow.config)
        .join(ServingConfigRow, (ServingConfigRow.name == WorkerRow.serving_config_name)
              & (ServingConfigRow.config_hash == WorkerRow.config_hash))
        .order_by(WorkerRow.heartbeat_at)
    ).all()
    live = set()
    for name, heartbeat_at, data in workers:  # the newest heartbeat comes last and wins
        configs[name] = ServingConfig.model_validate(data)
        if heartbeat_at >= live_since:
            live.add(name)
    return Catalog(configs, frozenset(live))


def sampling_defaults(config: ServingConfig) -> dict[str, float | int]:
    """The sampling values the config's model declares in its generation_config.json (a local folder's; the bundled
    models declare none), for the fields a request leaves out; {} where there is none or it cannot be read."""
    if config.model.startswith(BUNDLED_PREFIX):
        return {}
    path = Path(config.model).expanduser() / "generation_config.json"
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {}
    cached = _DEFAULTS.get(str(path))
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        declared = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("%s: cannot read it (%s); the API's sampling defaults apply", path, exc)
        declared = {}
    defaults = {name: declared[name] for name in SAMPLING_DEFAULT_FIELDS
                if isinstance(declared, dict) and isinstance(declared.get(name), (int, float))
                and not isinstance(declared.get(name), bool)}
    _DEFAULTS[str(path)] = (stamp, defaults)
    return defaults


_DEFAULTS: dict[str, tuple[int, dict[str, float | int]]] = {}
