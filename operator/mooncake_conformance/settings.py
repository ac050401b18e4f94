"""One typed settings object for the engine environments (env prefix ``MOONCAKE_ENGINES_``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/mooncake-operator/engines`` (or ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mooncake-operator" / "engines"


class EngineEnvSettings(BaseSettings):
    """Where the engines' virtual environments live and how they are made."""

    model_config = SettingsConfigDict(env_prefix="MOONCAKE_ENGINES_", frozen=True)

    cache_root: Path = Field(default_factory=default_cache_root, description=(
        "one virtual environment per engine version under this folder, and uv's wheel "
        "cache beside them (same file system: the environments hard-link its files)"))
    uv: str = Field("uv", description="the uv executable (PyPI's `uv`, a dev dependency)")
    python: str = Field(default_factory=lambda: sys.executable, description=(
        "interpreter the environments are made from (default: this one; the engines' "
        "wheels need CPython 3.10-3.12)"))
    install_timeout_s: float = Field(3600.0, gt=0, description="give up an install after")
    probe_timeout_s: float = Field(600.0, gt=0, description=(
        "give up one probe run after (an engine's first import compiles its bytecode)"))

    @property
    def uv_cache(self) -> Path:
        return self.cache_root / "uv-cache"
