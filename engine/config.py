"""Engine settings, from the environment with defaults that run locally."""

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.loader import default_cache_dir


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@dataclass(frozen=True)
class EngineConfig:
    """`ACS_ENGINE_MAX_ACTIVE` sequences decode together; up to `ACS_ENGINE_MAX_WAITING` more
    wait (beyond that: 503 engine_overloaded, except that a request larger than the whole queue
    is taken in when nothing else waits). `ACS_ENGINE_THREADS` torch threads."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    max_active: int = field(default_factory=lambda: _env_int("ACS_ENGINE_MAX_ACTIVE", 64))
    max_waiting: int = field(default_factory=lambda: _env_int("ACS_ENGINE_MAX_WAITING", 256))
    threads: int = field(
        default_factory=lambda: _env_int("ACS_ENGINE_THREADS", os.cpu_count() or 1)
    )
