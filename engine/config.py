"""Engine settings, from the environment with defaults that run locally."""

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.loader import default_cache_dir


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_hosts() -> frozenset[str]:
    value = os.environ.get("ACS_ENGINE_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]")
    return frozenset(host.strip().lower() for host in value.split(",") if host.strip())


@dataclass(frozen=True)
class EngineConfig:
    """`ACS_ENGINE_MAX_ACTIVE` sequences decode together; each tenant (X-Acs-Tenant: the
    gateway's account) may have up to `ACS_ENGINE_MAX_WAITING` more waiting (beyond that: 503
    engine_overloaded for that tenant only, except that a tenant with nothing waiting may queue
    a request of any size). `ACS_ENGINE_THREADS` torch threads.

    The engine has no user accounts, so it only answers requests whose Host is one of
    `ACS_ENGINE_ALLOWED_HOSTS` (host names, any port; a web page's DNS-rebound name is not),
    and, when `ACS_ENGINE_TOKEN` is set, that carry `Authorization: Bearer <token>`."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    max_active: int = field(default_factory=lambda: _env_int("ACS_ENGINE_MAX_ACTIVE", 64))
    max_waiting: int = field(default_factory=lambda: _env_int("ACS_ENGINE_MAX_WAITING", 256))
    threads: int = field(
        default_factory=lambda: _env_int("ACS_ENGINE_THREADS", os.cpu_count() or 1)
    )
    allowed_hosts: frozenset[str] = field(default_factory=_env_hosts)
    token: str = field(default_factory=lambda: os.environ.get("ACS_ENGINE_TOKEN", ""))


def is_loopback(host: str) -> bool:
    """Whether binding `host` (an address or `localhost`) serves only this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def bind_refusal(host: str, config: EngineConfig) -> str | None:
    """Why the engine must not listen on `host` with `config`, or None. The engine has no
    accounts: anyone who reaches it gets unmetered completions, so listening beyond loopback
    needs ACS_ENGINE_TOKEN (which the gateway sends with every request)."""
    if config.token or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host!r} without ACS_ENGINE_TOKEN: anyone who can reach this "
        "address would get unmetered completions. Set ACS_ENGINE_TOKEN to a long random "
        "secret on the engine and on every gateway process (python -c 'import secrets; "
        "print(secrets.token_urlsafe(32))'), or listen on 127.0.0.1."
    )
