"""The dashboard's launch settings, validated once, shared by the CLI, the app and the tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from esamp.core.config import EsampConfig, SamplingConfig, make_config
from esamp.errors import ConfigError
from esamp.session import SessionSpec, default_log_file

MAX_PANES = 8
BETA_STEP = 0.1


@dataclass
class Options:
    engine: str = "reference"
    model: str | None = None
    n: int = 4
    beta: float = 0.8
    esamp_on: bool = True
    max_tokens: int = 128
    prompt: str | None = None
    theme: str | None = None
    seed: int = 0
    engine_factory: str | None = None  # "module:callable" instead of create_engine (tests, demos)
    engine_options: dict[str, Any] = field(default_factory=dict)
    log_file: str | None = None  # None: the default log; "": no log file (worker output is dropped)

    def validate(self) -> "Options":
        """Raise ``ConfigError`` naming the bad setting; the CLI turns it into exit status 2."""
        if not 1 <= self.n <= MAX_PANES:
            raise ConfigError(f"n={self.n}: the dashboard shows 1 to {MAX_PANES} samples side by side",
                              hint=f"pass -n between 1 and {MAX_PANES} (esamp generate takes more)")
        make_config(EsampConfig, beta=self.beta, enabled=self.esamp_on)
        make_config(SamplingConfig, n=self.n, max_tokens=self.max_tokens, seed=self.seed)
        threads = self.engine_options.get("threads")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"--threads {threads}: needs at least 1", hint="e.g. --threads 1")
        if self.prompt is not None and not self.prompt.strip():
            raise ConfigError("--prompt is empty", hint="give a prompt, or leave --prompt out and type one")
        return self

    def session_spec(self, esamp_on: bool, beta: float, n: int) -> SessionSpec:
        """A worker spec carrying the dashboard's current settings (so a restart keeps them)."""
        return SessionSpec(
            engine=self.engine, model=self.model,
            esamp=dict(enabled=esamp_on, beta=beta),
            sampling=dict(n=n, max_tokens=self.max_tokens, seed=self.seed),
            engine_factory=self.engine_factory, engine_options=dict(self.engine_options),
            log_file=self.log_file if self.log_file is not None else str(default_log_file()),
        )
