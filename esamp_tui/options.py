"""The dashboard's launch settings: the typed ESamp settings plus what only the dashboard needs.

ESamp and sampling settings are ``esamp.core.config`` objects from start to worker: the command
line builds them with ``add_flags``/``from_flags`` (so every default, range and error message is
the core's), the screen changes them with validated copies, and the worker receives them as
they are. The dashboard adds its own limits, named here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from esamp.commands.cli import GROUP_ESAMP_FLAGS, SAMPLING_FLAGS
from esamp.core.config import EsampConfig, SamplingConfig, Steering, add_flags, bound, from_flags, update_config
from esamp.engines import DEFAULT_ENGINE
from esamp.engines.base import check_prompt_text
from esamp.errors import ConfigError, PromptError
from esamp_tui.worker import SessionSpec, default_log_file

MAX_PANES = 8  # samples shown side by side; more would leave each pane too narrow to read
BETA_STEP = 0.1  # what + and - change β by


BETA_RANGE = (bound(Steering, "beta", "ge"), bound(Steering, "beta", "le"))  # what + and - clamp to


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ESamp and sampling")
    add_flags(group, EsampConfig, GROUP_ESAMP_FLAGS)  # the settings esamp generate takes
    add_flags(group, SamplingConfig, SAMPLING_FLAGS)
    n = SamplingConfig.model_fields["n"]
    for action in group._group_actions:  # the dashboard shows fewer samples than a group may have
        if action.dest == "n":
            action.help = f"{n.description} (1 to {MAX_PANES} side by side, default {n.default})"


@dataclass
class Options:
    engine: str = DEFAULT_ENGINE
    engine_reason: str = ""  # why ``auto`` picked ``engine`` ("" when the user named it)
    model: str | None = None
    esamp: EsampConfig = field(default_factory=EsampConfig)  # engine-wide settings + the first runs' steering
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: str | None = None
    theme: str | None = None
    engine_factory: str | None = None  # "module:callable" instead of create_engine (tests, demos)
    engine_options: dict[str, Any] = field(default_factory=dict)
    log_file: str | None = None  # None: the default log; "": no log file (worker output is dropped)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **values) -> Options:
        """Options from parsed flags (``add_setting_flags``); a bad value names its flag."""
        return cls(
            esamp=from_flags(args, EsampConfig, GROUP_ESAMP_FLAGS),
            sampling=from_flags(args, SamplingConfig, SAMPLING_FLAGS),
            **values,
        ).validate()

    def validate(self) -> Options:
        """Raise ``ConfigError`` (or ``PromptError``) naming the bad setting; the CLI exits 2."""
        if self.sampling.n > MAX_PANES:
            raise ConfigError(
                f"-n {self.sampling.n}: the dashboard shows 1 to {MAX_PANES} samples side by side",
                hint=f"pass -n between 1 and {MAX_PANES} (esamp generate takes more)",
            )
        if self.prompt is not None:
            try:
                check_prompt_text(self.prompt)
            except PromptError as exc:
                raise PromptError(f"--prompt: {exc.message}", hint=exc.hint) from None
        return self

    def session_spec(self, steering: Steering, sampling: SamplingConfig) -> SessionSpec:
        """A worker spec with the dashboard's current settings (so a restart keeps them)."""
        return SessionSpec(
            engine=self.engine,
            model=self.model,
            esamp=update_config(self.esamp, **steering.model_dump()),
            sampling=sampling,
            engine_factory=self.engine_factory,
            engine_options=dict(self.engine_options),
            log_file=self.log_file if self.log_file is not None else str(default_log_file()),
        )
