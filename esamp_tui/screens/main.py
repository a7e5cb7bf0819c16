"""The main screen: prompt, rows of sample panes, charts, status, error panel, keys.

Data flow: a thread worker owns the ``Session`` (the engine's process). It reads events, batches
them for ``BATCH_SECONDS`` and posts one ``EventBatch`` message; the handler applies the whole
batch inside ``batch_update()``, so n panes repaint together at ~10 Hz however fast tokens come.
Every event also goes into a ``SessionRecord``, which is what export writes.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Static
from textual.worker import Worker, WorkerState, get_current_worker

from esamp.events import DoneEvent, ErrorEvent, Event, ReadyEvent, StepEvent, TokenEvent
from esamp.gpu import MemorySampler
from esamp.session import (Abort, RunPrompt, Session, SessionSpec, SetBeta, SetEsamp, SetSamples,
                           group_key)
from esamp_tui import diversity
from esamp_tui.options import BETA_STEP, MAX_PANES, Options
from esamp_tui.record import GroupRecord, SessionRecord
from esamp_tui.widgets.charts import ChartStrip
from esamp_tui.widgets.error_panel import ErrorPanel
from esamp_tui.widgets.run_row import RunRow
from esamp_tui.widgets.status import StatusBar

BATCH_SECONDS = 0.1  # events reach the UI at most 10 times a second: each frame with 8 scrolling panes costs ~30 ms here
HISTORY_LINES = 4


class MainScreen(Screen):
    BINDING_GROUP_TITLE = "esamp"
    BINDINGS = [
        Binding("e", "toggle_esamp", "ESamp on/off", id="esamp.toggle",
                tooltip="Turn ESamp steering on or off for the next run"),
        Binding("r", "rerun", "Re-run", id="esamp.rerun",
                tooltip="Run the last prompt again with the same seed"),
        Binding("c", "compare", "Compare", id="esamp.compare",
                tooltip="Run the last prompt with ESamp off and on at once, in two rows"),
        Binding("plus", "beta(1)", "β+", key_display="+", id="esamp.beta_up",
                tooltip=f"Raise β by {BETA_STEP:g} for the next run"),
        Binding("minus", "beta(-1)", "β-", key_display="-", id="esamp.beta_down",
                tooltip=f"Lower β by {BETA_STEP:g} for the next run"),
        Binding("n", "samples(1)", "n+", id="esamp.more_samples",
                tooltip=f"One more sample per run (up to {MAX_PANES})"),
        Binding("N", "samples(-1)", "n-", key_display="N", id="esamp.fewer_samples",
                tooltip="One sample fewer per run"),
        Binding("a", "abort", "Abort", id="esamp.abort", tooltip="Stop the running samples"),
        Binding("x", "export", "Export", id="esamp.export",
                tooltip="Write transcript (Markdown, JSONL), metrics (JSONL, CSV) and an SVG screenshot"),
        Binding("t", "next_theme", "Theme", id="esamp.theme", tooltip="Switch to the next theme"),
        Binding("p", "focus_prompt", "Prompt", id="esamp.prompt", tooltip="Type a new prompt"),
        Binding("question_mark,f1", "help", "Help", key_display="?", id="esamp.help",
                tooltip="Keys and what the colours mean"),
        Binding("q", "app.quit", "Quit", id="esamp.quit", tooltip="Stop the engine and quit"),
        Binding("ctrl+r", "restart", "Restart engine", id="esamp.restart",
                tooltip="Start a fresh engine process (after an error)"),
        Binding("escape", "escape", "Hide error / leave prompt", show=False, id="esamp.escape"),
    ]

    @dataclass
    class EventBatch(Message):
        """Events from the worker, in arrival order."""

        bubble = False  # posted to this screen by its own reader thread; nobody above needs it
        session_id: int
        events: list[Event]

    @dataclass
    class VendiScored(Message):
        """A group's Vendi score (or why there is none), from the scoring thread."""

        bubble = False
        key: str
        score: float | None
        error: str

    @dataclass
    class SessionExited(Message):
        """The worker process has ended (``expected`` when we asked it to)."""

        bubble = False
        session_id: int
        exitcode: int | None
        expected: bool

    def __init__(self, options: Options, session_factory: Callable[[SessionSpec], Session] = Session,
                 memory_sampler: MemorySampler | None = None) -> None:
        super().__init__(id="main")
        self.options = options
        self.session_factory = session_factory
        self.memory_sampler = memory_sampler
        self.esamp_on = options.esamp_on
        self.beta = options.beta
        self.n = options.n
        self.last_prompt: str | None = options.prompt
        self.run_id = 0
        self.record = SessionRecord()
        self.rows: dict[str, RunRow] = {}
        self.session: Session | None = None
        self.session_id = 0
        self.closing: set[int] = set()  # ids of sessions we asked to stop
        self.engine_ready = False
        self.fatal_error: ErrorEvent | None = None
        self.history: dict[str, str] = {}  # group key → summary line
        self.exports: list[Path] = []
        self.log_file: str | None = None

    # -- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Input(self.options.prompt or "", placeholder="Type a prompt and press Enter "
                    "(p: back to this box · Esc: leave it so single-letter keys work)", id="prompt")
        yield ErrorPanel(id="error")
        with VerticalScroll(id="results"):
            yield Static("Type a prompt above and press Enter. Each pane is one sample; tokens are "
                         "coloured by novelty (how much the Distiller did not see them coming).",
                         id="placeholder")
        yield Static("", id="history")
        yield ChartStrip(id="charts")
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.status.set(esamp_on=self.esamp_on, beta=self.beta, n=self.n,
                        engine=self.options.engine, model=self.options.model or "embedded default")
        self.query_one("#history", Static).display = False
        self.start_session()
        if self.memory_sampler is not None:
            self.sample_memory()
        if self.options.prompt:
            self.run_prompt(self.options.prompt)
            self.query_one("#results").focus()
        else:
            self.query_one("#prompt", Input).focus()

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def charts(self) -> ChartStrip:
        return self.query_one(ChartStrip)

    @property
    def error_panel(self) -> ErrorPanel:
        return self.query_one(ErrorPanel)

    # -- the engine session -------------------------------------------------------------------

    def start_session(self) -> None:
        self.session_id += 1
        self.engine_ready = False
        self.fatal_error = None
        spec = self.options.session_spec(self.esamp_on, self.beta, self.n)
        self.log_file = spec.log_file
        self.session = self.session_factory(spec)
        self.status.set(state="starting engine")
        self.refresh_bindings()
        self.pump_events(self.session, self.session_id)

    @work(thread=True, group="session", exit_on_error=False, description="engine session reader")
    def pump_events(self, session: Session, session_id: int) -> None:
        """Start the worker process, then batch its events into messages until it ends."""
        worker = get_current_worker()
        session.start()
        batch: list[Event] = []
        first = 0.0
        while not worker.is_cancelled:
            wait = BATCH_SECONDS - (time.monotonic() - first) if batch else BATCH_SECONDS
            got = session.read(timeout=max(wait, 0.005))
            if got:
                if not batch:
                    first = time.monotonic()
                batch.extend(got)
            if batch and (got is None or time.monotonic() - first >= BATCH_SECONDS):
                self.post_message(self.EventBatch(session_id, batch))
                batch = []
            if got is None:
                self.post_message(self.SessionExited(session_id, session.exitcode,
                                                     session_id in self.closing))
                return

    def stop_session(self) -> None:
        """Ask the current worker to stop; the close (which may wait) runs in a thread."""
        if self.session is None:
            return
        self.closing.add(self.session_id)
        session, self.session = self.session, None
        self.close_session(session)

    @work(thread=True, group="session-close", exit_on_error=False, description="stop engine")
    def close_session(self, session: Session) -> None:
        session.close()

    def engine_usable(self) -> bool:
        return self.session is not None and self.fatal_error is None

    def send(self, command) -> bool:
        """Send a command the engine must act on now (run, abort); say so when it cannot."""
        if not self.engine_usable():
            self.notify("The engine is not running. Press ctrl+r to restart it.", severity="warning")
            return False
        self.session.send(command)
        return True

    def tell(self, command) -> None:
        """Pass a setting on; with no engine it waits for the next one (its spec carries it)."""
        if self.engine_usable():
            self.session.send(command)

    @on(EventBatch)
    def apply_batch(self, message: EventBatch) -> None:
        if message.session_id != self.session_id:
            return  # a stale batch from a session we already replaced
        tokens: dict[str, dict[int, list[TokenEvent]]] = defaultdict(lambda: defaultdict(list))
        with self.app.batch_update():
            for event in message.events:
                if isinstance(event, TokenEvent):
                    tokens[event.group][event.sample].append(event)
                    group = self.record.groups.get(event.group)
                    if group is not None:
                        group.add_token(event)
                    continue
                self._flush_tokens(tokens)  # keep order: a sample's tokens land before its done
                tokens.clear()
                if isinstance(event, StepEvent):
                    self.record.add_step(event)
                    self.charts.add_step(event.tokens_per_s, event.loss, event.port_hits, event.esamp)
                elif isinstance(event, DoneEvent):
                    self._on_done(event)
                elif isinstance(event, ReadyEvent):
                    self._on_ready(event)
                elif isinstance(event, ErrorEvent):
                    self._on_error(event)
            self._flush_tokens(tokens)

    def _flush_tokens(self, tokens: dict[str, dict[int, list[TokenEvent]]]) -> None:
        for key, by_sample in tokens.items():
            row = self.rows.get(key)
            if row is None:
                continue
            for sample, events in by_sample.items():
                row.add_tokens(sample, events)

    def _on_ready(self, event: ReadyEvent) -> None:
        self.engine_ready = True
        self.record.engine = event.model_dump()
        self.status.set(engine=event.engine, model=event.model, device=event.device,
                        state="generating" if self.run_in_progress() else "ready")
        self.error_panel.hide()

    def _on_done(self, event: DoneEvent) -> None:
        row = self.rows.get(event.group)
        if row is not None:
            row.finish_sample(event)
        group = self.record.groups.get(event.group)
        if group is not None and group.finish(event):
            self._group_finished(group)
        if not self.run_in_progress():
            self.status.set(state="ready")
            self.refresh_bindings()

    def _group_finished(self, group: GroupRecord) -> None:
        row = self.rows.get(group.key)
        pending = diversity.vendi_available() and group.samples and all(s.tokens for s in group.samples)
        if row is not None:
            row.set_diversity(distinct_2=group.distinct_2, vendi_pending=bool(pending))
        self._show_history(group)
        if pending:
            self.score_vendi(group.key, [s.text for s in group.samples])

    def _show_history(self, group: GroupRecord) -> None:
        """One line per finished group (newest last), so runs can be compared by number."""
        d2 = "n/a" if group.distinct_2 is None else f"{group.distinct_2:.3f}"
        vendi = f" · Vendi {group.vendi:.2f}" if group.vendi is not None else ""
        self.history[group.key] = f"run {group.run_id} · {group.label()} · n={group.n} · distinct-2 {d2}{vendi}"
        for key in list(self.history)[:-HISTORY_LINES]:
            del self.history[key]
        history = self.query_one("#history", Static)
        history.update("\n".join(self.history.values()))
        history.display = True

    def _on_error(self, event: ErrorEvent) -> None:
        if event.fatal:
            self.fatal_error = event
            self.error_panel.show(event.message, event.hint, event.detail)
            self.status.set(state="error")
            self.refresh_bindings()
            for row in self.rows.values():
                if any(p.finish_reason is None for p in row.panes):
                    row.mark_stopped()
        else:
            where = f" ({event.group})" if event.group else ""
            text = event.message + where + (f"\nhint: {event.hint}" if event.hint else "")
            self.notify(text, severity="error", timeout=8)

    @on(SessionExited)
    def session_exited(self, message: SessionExited) -> None:
        self.closing.discard(message.session_id)
        if message.session_id != self.session_id or message.expected:
            return
        self.session = None
        if self.fatal_error is None:  # died without a word: killed, segfault, out of memory
            code = message.exitcode
            reason = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            self._on_error(ErrorEvent(
                message=f"the engine process stopped unexpectedly ({reason})",
                hint="press ctrl+r to start a fresh engine"
                     + (f"; the worker's output is in {self.log_file}" if self.log_file else ""),
                fatal=True,
            ))
        for key, group in self.record.groups.items():
            if not group.finished:
                group.mark_unfinished("error")
        self.status.set(state="error")
        self.refresh_bindings()

    def run_in_progress(self) -> bool:
        return any(not g.finished for g in self.record.groups.values())

    # -- runs ---------------------------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def prompt_submitted(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            self.notify("The prompt is empty: type a question or an instruction.", severity="warning")
            return
        self.run_prompt(prompt)
        self.query_one("#results").focus()

    def run_prompt(self, prompt: str, compare: bool = False) -> None:
        if not self.send(RunPrompt(self.run_id + 1, prompt, compare=compare)):
            return
        self.run_id += 1
        self.last_prompt = prompt
        for key, group in self.record.groups.items():  # the worker aborts what was running
            if not group.finished:
                group.mark_unfinished("abort")
        modes = (False, True) if compare else (self.esamp_on,)
        results = self.query_one("#results", VerticalScroll)
        with self.app.batch_update():
            results.remove_children()
            self.rows = {}
            for on_ in modes:
                key = group_key(self.run_id, on_)
                self.record.add_group(GroupRecord(key, self.run_id, on_, self.beta, self.n, prompt))
                row = RunRow(key, self.run_id, on_, self.beta, self.n)
                self.rows[key] = row
                results.mount(row)
        self.status.set(state="generating" if self.engine_ready else "starting engine")
        self.refresh_bindings()

    def _need_prompt(self) -> str | None:
        if not self.last_prompt:
            self.notify("No prompt yet: type one and press Enter.", severity="warning")
            self.query_one("#prompt", Input).focus()
        return self.last_prompt

    # -- actions (each is a binding and a command-palette entry) ------------------------------

    def action_toggle_esamp(self) -> None:
        self.esamp_on = not self.esamp_on
        self.tell(SetEsamp(self.esamp_on))
        self.status.set(esamp_on=self.esamp_on)
        self.notify(f"ESamp {'ON' if self.esamp_on else 'OFF'} for the next run (r re-runs the same "
                    "prompt and seed)", timeout=3)

    def action_rerun(self) -> None:
        if prompt := self._need_prompt():
            self.run_prompt(prompt)

    def action_compare(self) -> None:
        if prompt := self._need_prompt():
            self.run_prompt(prompt, compare=True)

    def action_beta(self, direction: int) -> None:
        beta = round(min(max(self.beta + direction * BETA_STEP, 0.0), 10.0), 3)
        if beta != self.beta:
            self.beta = beta
            self.tell(SetBeta(beta))
            self.status.set(beta=beta)

    def action_samples(self, delta: int) -> None:
        n = min(max(self.n + delta, 1), MAX_PANES)
        if n != self.n:
            self.n = n
            self.tell(SetSamples(n))
            self.status.set(n=n)
            self.notify(f"n={n} from the next run", timeout=2)

    def action_abort(self) -> None:
        if self.run_in_progress():
            self.send(Abort())

    def action_restart(self) -> None:
        self.stop_session()
        self.error_panel.hide()
        for group in self.record.groups.values():  # what the old engine was running ends here
            if not group.finished:
                group.mark_unfinished("abort")
        for row in self.rows.values():
            for pane in row.panes:
                if pane.finish_reason is None:
                    pane.finish("abort")
            row.refresh_header()
        self.start_session()
        self.notify("Starting a fresh engine…", timeout=3)

    def action_escape(self) -> None:
        if self.error_panel.visible_now:
            self.error_panel.hide()
        elif self.focused is self.query_one("#prompt"):
            self.query_one("#results").focus()

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt", Input).focus()

    def action_next_theme(self) -> None:
        names = self.app.esamp_theme_names if hasattr(self.app, "esamp_theme_names") else []
        if not names:
            self.app.action_change_theme()
            return
        current = self.app.theme
        self.app.theme = names[(names.index(current) + 1) % len(names)] if current in names else names[0]
        self.notify(f"theme: {self.app.theme}", timeout=2)

    def action_help(self) -> None:
        from esamp_tui.screens.help import HelpScreen

        self.app.push_screen(HelpScreen(self.BINDINGS))

    def action_export(self) -> None:
        from esamp_tui.screens.export import ExportScreen

        def chosen(directory: Path | None) -> None:
            if directory is not None:
                svg = self.app.export_screenshot(title="esamp")
                self.export_files(directory, svg)

        self.app.push_screen(ExportScreen(), chosen)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Hidden (False) rather than greyed out: the footer stays short and only says what works.
        if action == "restart":
            return self.fatal_error is not None or self.session is None
        if action == "abort":
            return self.run_in_progress()
        return True

    # -- thread workers -----------------------------------------------------------------------

    @work(thread=True, group="export", exit_on_error=False, description="export")
    def export_files(self, directory: Path, svg: str) -> list[Path]:
        return self.record.export(directory, svg)

    @work(thread=True, group="memory", exclusive=True, exit_on_error=False, description="memory sampler")
    def sample_memory(self):
        return self.memory_sampler.sample()

    def score_vendi(self, key: str, texts: list[str]) -> None:
        """Vendi in a daemon thread, not a Textual thread worker: the first call loads a sentence
        embedder (seconds of CPU), and thread workers run in asyncio's default executor, which
        the app waits for on exit — quitting then hung until the embedder had loaded."""

        def score() -> None:
            try:
                self.post_message(self.VendiScored(key, diversity.vendi(texts), ""))
            except Exception as exc:  # no embedder, broken install: say so, keep distinct-2
                self.post_message(self.VendiScored(key, None, f"{type(exc).__name__}: {exc}"))

        threading.Thread(target=score, name="esamp-vendi", daemon=True).start()

    @on(VendiScored)
    def vendi_scored(self, message: VendiScored) -> None:
        if message.error:
            self.notify(f"Vendi score unavailable: {message.error}", severity="warning")
            if message.key in self.rows:
                self.rows[message.key].set_diversity()
            return
        group = self.record.groups.get(message.key)
        if group is not None:
            group.vendi = message.score
            if message.key in self.history:
                self._show_history(group)
        if message.key in self.rows:
            self.rows[message.key].set_diversity(vendi=message.score)

    @on(Worker.StateChanged)
    def worker_changed(self, event: Worker.StateChanged) -> None:
        """Results and failures of every thread worker, handled in one place."""
        worker, state = event.worker, event.state
        if state == WorkerState.SUCCESS:
            if worker.group == "memory":
                self.record.memory = worker.result
                self.charts.set_memory(worker.result)
                self.set_timer(1.0, self.sample_memory)
            elif worker.group == "export":
                paths = worker.result
                self.exports = paths
                folder = paths[0].parent if paths else "?"
                self.notify(f"Exported {len(paths)} files to {folder}", timeout=6)
        elif state == WorkerState.ERROR:
            error = worker.error
            if worker.group == "session":
                self._on_error(ErrorEvent(message=f"could not run the engine process: {error}",
                                          hint="press ctrl+r to try again", fatal=True))
            elif worker.group == "export":
                self.notify(f"Export failed: {error}\nChoose a folder you can write to and press x again.",
                            severity="error", timeout=10)
            elif worker.group == "memory":
                self.set_timer(5.0, self.sample_memory)
            else:
                self.notify(f"{worker.description} failed: {error}", severity="error")

    def on_unmount(self) -> None:
        if self.session is not None:
            self.closing.add(self.session_id)
            self.session.close(timeout=0.5)  # quitting: a step in flight is not worth waiting for
            self.session = None
