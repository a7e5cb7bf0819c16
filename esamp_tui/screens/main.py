"""The main screen: prompt, rows of sample panes, run history, charts, status, error panel, keys.

The engine belongs to the controller (``esamp_tui.controller``). This screen holds the settings
of the next run as reactives (ESamp on/off, β, mix, n): the status bar is bound to them, and a
change reaches the worker as one typed ``Configure``. It turns the controller's messages into
what the panes, charts and history show; every event goes into a ``SessionRecord``, which is
what export writes.
"""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widgets import Input

from esamp.core.config import SamplingConfig, Steering, update_config
from esamp.core.mixes import MIXES
from esamp.engines.base import check_prompt_text
from esamp.errors import PromptError
from esamp.eval.standing import standing
from esamp.events import ErrorEvent, LoadingEvent, StepEvent
from esamp_tui.controller import SessionController
from esamp_tui.keymap import MAIN_BINDINGS, KeysScreen, footer_drop_actions
from esamp_tui.messages import VendiScored
from esamp_tui.options import BETA_RANGE, BETA_STEP, MAX_PANES, Options
from esamp_tui.screens.export import ExportScreen
from esamp_tui.screens.help import HelpScreen
from esamp_tui.session_log import SessionRecord
from esamp_tui.speed import SpeedRecord, SpeedWatch
from esamp_tui.widgets.charts import MODES, ChartStrip
from esamp_tui.widgets.error_panel import ErrorPanel
from esamp_tui.widgets.footer import KeysFooter
from esamp_tui.widgets.history import RunHistory
from esamp_tui.widgets.results import Results
from esamp_tui.widgets.status import StatusBar

SHORT = 36  # terminal rows below which the charts shrink to one line and the prompt box to one row
TINY = 18  # rows below which the charts are hidden (the panes need them more)
NARROW = 100  # columns below which the footer leaves out ctrl+p (help and ? still name it)


class MainScreen(KeysScreen):
    BINDING_GROUP_TITLE = "esamp"
    BINDINGS = MAIN_BINDINGS

    esamp_on = reactive(Steering.model_fields["enabled"].default, init=False)
    beta = reactive(Steering.model_fields["beta"].default, init=False)
    mix = reactive(Steering.model_fields["mix"].default, init=False)
    n = reactive(SamplingConfig.model_fields["n"].default, init=False)

    def __init__(self, options: Options, backend_factory, memory_sampler=None, speed_file: Path | None = None) -> None:
        super().__init__(id="main")
        self.options, self.memory_sampler, self.speed_file = options, memory_sampler, speed_file
        default = options.esamp.steering
        for name, value in (
            ("esamp_on", default.enabled),
            ("beta", default.beta),
            ("mix", default.mix),
            ("n", options.sampling.n),
        ):
            self.set_reactive(getattr(MainScreen, name), value)
        self.controller = SessionController(
            self, lambda: options.session_spec(self.steering, self.sampling), backend_factory
        )
        self.record, self.run_id = SessionRecord(), 0
        self.last_prompt: str | None = options.prompt
        self.charts_chosen = False  # once the user picks a chart mode, the terminal's size no longer does
        self.speed: SpeedWatch | None = None
        self.start_progress: LoadingEvent | None = (
            None  # the engine's start, as far as it has come (not Widget.loading)
        )

    @property
    def steering(self) -> Steering:
        """How the next run steers, exactly as the worker receives it."""
        return update_config(self.options.esamp.steering, enabled=self.esamp_on, beta=self.beta, mix=self.mix)

    @property
    def sampling(self) -> SamplingConfig:
        return update_config(self.options.sampling, n=self.n)

    def validate_beta(self, beta: float) -> float:
        return round(min(max(beta, BETA_RANGE[0]), BETA_RANGE[1]), 3)

    def validate_n(self, n: int) -> int:
        return min(max(n, 1), MAX_PANES)

    def compose(self) -> ComposeResult:
        yield Input(
            self.options.prompt or "",
            id="prompt",
            placeholder="Type a prompt and press Enter "
            "(p: back to this box · Esc: leave it so single-letter keys work)",
        )
        yield ErrorPanel(id="error")
        yield Results(self.record, self.options.esamp, id="results")
        yield RunHistory(id="history")
        yield ChartStrip(self.memory_sampler, id="charts")
        yield StatusBar(id="status").data_bind(MainScreen.esamp_on, MainScreen.beta, MainScreen.mix, MainScreen.n)
        yield KeysFooter(footer_drop_actions(), compact=True)

    def on_mount(self) -> None:
        self.prompt, self.results, self.history = (
            self.query_one(Input),
            self.query_one(Results),
            self.query_one(RunHistory),
        )
        self.charts, self.status, self.error_panel = (
            self.query_one(ChartStrip),
            self.query_one(StatusBar),
            self.query_one(ErrorPanel),
        )
        self.status.model = self.options.model or "embedded default"
        self.status.engine, self.status.engine_reason = self.options.engine, self.options.engine_reason
        for name in ("esamp_on", "beta", "mix", "n"):
            self.watch(self, name, lambda _: self.controller.configure(self.steering, self.sampling), init=False)
        self.controller.start()
        if not (self.options.prompt and self.run_prompt(self.options.prompt)):
            self.prompt.focus()

    def on_resize(self, event) -> None:
        height = event.size.height
        self.set_class(height < SHORT, "-short")
        self.query_one(KeysFooter).show_command_palette = event.size.width >= NARROW
        if not self.charts_chosen:
            self.query_one(ChartStrip).mode = "full" if height >= SHORT else "compact" if height >= TINY else "hidden"

    # -- the engine's messages ----------------------------------------------------------------

    @on(SessionController.EngineReady)
    def engine_ready(self, message: SessionController.EngineReady) -> None:
        if self.controller.current(message):
            info = message.info
            self.record.engine = info.model_dump()
            self.record.engine_ready()
            self.speed = SpeedWatch(SpeedRecord.load(info, self.speed_file))
            self.status.engine, self.status.model, self.status.device = info.engine, info.model, info.device
            self.refresh_state()

    @on(SessionController.EngineLoading)
    def engine_loading(self, message: SessionController.EngineLoading) -> None:
        if self.controller.current(message):
            self.start_progress = message.progress
            self.refresh_state()

    @on(SessionController.EventBatch)
    def events_arrived(self, message: SessionController.EventBatch) -> None:
        if not self.controller.current(message):
            return
        with self.app.batch_update():
            ended, others = self.results.apply(message.events)
            self.charts.run_rates = self.record.run_rates()
            for event in others:
                self.step_arrived(event) if isinstance(event, StepEvent) else self.error_panel.report(event)
            if ended:
                self.history.show(self.record)
                if not self.record.running() and self.speed is not None:
                    self.speed.end_run()
                    self.run_worker(self.speed.record.save, thread=True, group="speed", exit_on_error=False)
                self.refresh_state()

    def step_arrived(self, event: StepEvent) -> None:
        self.record.add_step(event, self.charts.memory_sample)
        self.charts.add_step(event.time, event.tokens_per_s, event.loss, event.port_hits, event.esamp)
        slow = self.speed.add(event) if self.speed else None
        if slow and not self.status.notice:
            self.notify(slow.explain(self.status.engine), severity="warning", timeout=8)
        self.status.notice = slow.text() if slow else ""

    @on(SessionController.EngineFailed)
    def engine_failed(self, message: SessionController.EngineFailed) -> None:
        if self.controller.current(message):
            self.error_panel.report(message.error)
            self.stop_runs("error")
            self.refresh_state()

    def refresh_state(self) -> None:
        """What the engine is doing, in the status bar, and the keys that work now, in the footer."""
        c, status = self.controller, self.status
        starting = f"starting engine: {self.start_progress.describe()}" if self.start_progress else "starting engine"
        status.state = (
            "error" if c.failed else starting if not c.ready else "generating" if self.record.running() else "ready"
        )
        status.notice = status.notice if status.state == "generating" else ""
        self.refresh_bindings()

    @on(VendiScored)
    def vendi_scored(self) -> None:
        self.history.show(self.record)

    def stop_runs(self, why: str) -> None:
        """End what is still running (``why``: see ``session_log.INTERRUPTIONS``); panes and history say so."""
        self.results.stopped(self.record.stop_running(why))
        self.history.show(self.record)

    # -- runs ---------------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def prompt_submitted(self, event: Input.Submitted) -> None:
        self.run_prompt(event.value.strip())

    def run_prompt(self, prompt: str, compare: bool = False) -> bool:
        try:
            check_prompt_text(prompt)  # the engine checks too; here the engine is not even bothered
        except PromptError as exc:
            self.error_panel.report(ErrorEvent(message=exc.message, hint=exc.hint, group="prompt"))
            return False
        if not self.controller.run(self.run_id + 1, prompt, compare):
            self.notify("The engine is not running. Press ctrl+r to restart it.", severity="warning")
            return False
        self.run_id, self.last_prompt = self.run_id + 1, prompt
        with self.app.batch_update():
            self.stop_runs("cut")  # the worker aborts what was running
            self.results.show_run(self.record.new_run(self.run_id, prompt, self.steering, self.sampling, compare))
        if not self.error_panel.fatal:
            self.error_panel.hide()
        self.results.focus()
        self.refresh_state()
        return True

    # -- actions (each is a binding and a command-palette entry) ------------------------------

    def action_toggle_esamp(self) -> None:
        self.esamp_on = not self.esamp_on
        self.notify(
            f"ESamp {'ON' if self.esamp_on else 'OFF'} for the next run (r re-runs the same prompt and seed)", timeout=3
        )

    def action_rerun(self, compare: bool = False) -> None:
        if self.last_prompt:
            self.run_prompt(self.last_prompt, compare)
        else:
            self.notify("No prompt yet: type one and press Enter.", severity="warning")
            self.prompt.focus()

    def action_beta(self, direction: int) -> None:
        self.beta += direction * BETA_STEP

    def action_samples(self, delta: int) -> None:
        self.n += delta
        self.notify(f"n={self.n} from the next run", timeout=2)

    def action_mix(self, name: str = "") -> None:
        """Switch to mix ``name``, or to the next one."""
        names = list(MIXES)
        self.mix = name or names[(names.index(self.mix) + 1) % len(names)]
        self.notify(f"mix {self.mix}: {MIXES[self.mix].formula}, from the next run", timeout=3)

    def action_abort(self) -> None:
        self.controller.abort()

    def action_restart(self) -> None:
        self.stop_runs("cut")  # what the old engine was running ends here
        self.error_panel.hide()
        self.start_progress = None
        self.controller.restart()
        self.refresh_state()
        self.notify("Starting a fresh engine…", timeout=3)

    def action_charts(self) -> None:
        self.charts_chosen = True
        self.charts.mode = MODES[(MODES.index(self.charts.mode) + 1) % len(MODES)]

    def action_hide_error(self) -> None:
        self.error_panel.hide()

    def action_focus(self, area: str) -> None:
        self.query_one(f"#{area}").focus()

    def action_help(self) -> None:
        steering = self.steering.model_copy(update={"enabled": True})
        found = standing(self.record.engine.get("model"), steering, config=self.options.esamp)
        self.app.push_screen(HelpScreen(self.BINDINGS, self.app.user_keymap, found.text() if found else None))

    def action_export(self) -> None:
        self.app.push_screen(ExportScreen(self.record, self.app.export_screenshot(title="esamp")))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        when = {
            "restart": lambda: not self.controller.usable,
            "abort": lambda: bool(self.record.running()),
            "focus": lambda: parameters != ("results",) or self.typing,
            "hide_error": lambda: self.query_one(ErrorPanel).visible_now and not self.typing,
        }
        return when[action]() if action in when else super().check_action(action, parameters)

    def on_unmount(self) -> None:
        self.controller.close_now()
