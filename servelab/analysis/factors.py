"""The factors a comparison varies, and which of them two stored configs differ in.

A factor is a named group of config fields, each a dotted path into the config as stored with a run
(`ServingConfig.model_dump`). A section named whole (`batching`, `kv_cache`) stands for its fields that no
other factor names, so a field added to a section later is counted under it without a change here. A field a
stored config lacks (a run stored before the field existed) counts as the field's current default: the run
was served that way. Pure: reads dicts, imports no I/O library.
"""

from __future__ import annotations

from typing import Any

from servelab.config import ServingConfig

# NOTE: a candidate should change exactly one of these; the verdict warns when it changes more.
FACTORS: dict[str, tuple[str, ...]] = {
    "model": ("model",),
    "weight precision": ("weights", "awq", "lm_head_weights"),
    "cache precision": ("kv_cache_dtype",),
    # NOTE: the paged pool holds max_batch_tokens' blocks unless max_kv_cache_mib gives fewer: both size it
    "cache capacity": ("batching.max_kv_cache_mib", "batching.max_batch_tokens"),
    "cache eviction": ("kv_cache.eviction", "kv_cache.sink_tokens", "kv_cache.window_tokens"),
    "prefix caching": ("kv_cache.prefix_caching",),
    "cache block size": ("kv_cache.block_size",),
    "KV cache (other settings)": ("kv_cache",),
    "batching": ("batching",),
    "decoding limits": ("decoding",),
    "decoder and kernels": ("decoder", "linear_kernel"),
    "device": ("device",),
    "threads": ("num_threads",),
}
_PATHS = tuple(p for paths in FACTORS.values() for p in paths)
_DEFAULTS = ServingConfig(name="defaults").model_dump(mode="json", exclude={"name"})


def changed_factors(baseline_config: dict[str, Any], candidate_config: dict[str, Any]) -> list[str]:
    """The factors whose fields differ between two stored configs, in FACTORS' order."""
    a, b = with_defaults(baseline_config), with_defaults(candidate_config)
    return [factor for factor, paths in FACTORS.items() if any(field_value(a, p) != field_value(b, p) for p in paths)]


def with_defaults(config: dict[str, Any], defaults: dict[str, Any] = _DEFAULTS) -> dict[str, Any]:
    """The stored config with every field it lacks set to today's default (nested sections too)."""
    merged = dict(config)
    for key, default in defaults.items():
        if key not in merged:
            merged[key] = default
        elif isinstance(default, dict) and isinstance(merged[key], dict):
            merged[key] = with_defaults(merged[key], default)
    return merged


def field_value(config: dict[str, Any], path: str) -> Any:
    """The value at a dotted path; a section without the fields other factors name (theirs, not its)."""
    value: Any = config
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    claimed = {p[len(path) + 1:] for p in _PATHS if p.startswith(path + ".")}
    if claimed and isinstance(value, dict):
        value = {k: v for k, v in value.items() if k not in claimed}
    return value
