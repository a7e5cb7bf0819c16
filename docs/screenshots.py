"""Make the dashboard pictures in this folder, on the embedded model on the CPU.

    python docs/screenshots.py [--threads 1]          # dashboard-200x50.png, dashboard-80x24.png
    python docs/screenshots.py --walk [--threads 1]   # the newcomer's walk: walk-*.png (needs tmux)

The first form runs the app headless: at 200×50 one prompt with ESamp off, the same prompt and
seed with ESamp on, then both at once (compare mode), so the history line compares them; at
80×24 one prompt. The second runs the real ``esamp-tui`` command in tmux at 80×24 and at 140×42,
as a user would: a first start on an empty model cache, a prompt, compare mode, help and ``q``;
each step is captured with ``tmux capture-pane -e`` and drawn to PNG the way the dashboard's own
export draws its screenshots. Every picture is rendered with the monospace font of this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PROMPT = "Name three colours and say what each makes you think of."


async def shoot(size: tuple[int, int], name: str, threads: int, compare: bool) -> None:
    from esamp.core.config import EsampConfig, SamplingConfig
    from esamp.platform.gpu import MemorySampler
    from esamp_tui.app import EsampApp
    from esamp_tui.options import Options
    from esamp_tui.screenshot import svg_to_png

    options = Options(
        engine="reference",
        esamp=EsampConfig(enabled=not compare),
        sampling=SamplingConfig(n=4, max_tokens=48),
        prompt=PROMPT,
        log_file="",
        engine_options=dict(threads=threads),
    )
    sampler = MemorySampler()
    app = EsampApp(options, memory_sampler=sampler)
    async with app.run_test(size=size) as pilot:
        screen = app.main_screen

        async def run_ends(deadline: float = 600) -> None:
            end = time.monotonic() + deadline
            while (screen.record.running() or not screen.record.groups) and time.monotonic() < end:
                await pilot.pause(0.2)

        await run_ends()
        if compare:
            await pilot.press("e", "r")  # ESamp on, same prompt and seed
            await run_ends()
            await pilot.press("c")  # both at once, two rows
            await run_ends()
        await pilot.pause(2.5)  # the charts' next draw, a memory reading or two
        app.clear_notifications()
        screen.charts.redraw()
        await pilot.pause(0.3)
        svg = app.export_screenshot(title="esamp")
    sampler.close()
    (HERE / f"{name}.png").write_bytes(svg_to_png(svg))
    print(f"wrote {name}.png")


# -- the newcomer's walk, in tmux ----------------------------------------------------------------


class Tmux:
    """One detached tmux window of a given size on a socket of its own."""

    def __init__(self, width: int, height: int, command: str, env: dict[str, str]) -> None:
        self.size = (width, height)
        self.socket = f"esamp-walk-{os.getpid()}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        self.tmux(
            "new-session",
            "-d",
            "-s",
            "walk",
            "-x",
            str(width),
            "-y",
            str(height),
            f"env {exports} {command}; echo '[esamp-tui exited with status '$?']'; sleep 600",
        )

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def screen(self, colours: bool = False) -> str:
        return self.tmux("capture-pane", "-p", "-t", "walk", *(["-e"] if colours else []))

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "walk", *keys)

    def wait(self, check, what: str, timeout: float = 600.0) -> None:
        end = time.monotonic() + timeout
        while not check(self.screen()):
            if time.monotonic() > end:
                raise TimeoutError(f"{what}: not on screen after {timeout:.0f} s\n{self.screen()}")
            time.sleep(0.25)

    def png(self, name: str) -> None:
        """The window as the user sees it, drawn as the dashboard's export draws a screenshot."""
        from rich.console import Console
        from rich.text import Text

        from esamp_tui.screenshot import svg_to_png

        width, height = self.size
        console = Console(
            record=True, width=width, height=height, force_terminal=True, color_system="truecolor", file=io.StringIO()
        )
        lines = self.screen(colours=True).split("\n")[:height]
        for k, line in enumerate(lines):
            console.print(Text.from_ansi(line, no_wrap=True), soft_wrap=True, end="\n" if k < len(lines) - 1 else "")
        svg = console.export_svg(title=f"esamp-tui at {width}×{height}")
        (HERE / f"{name}.png").write_bytes(svg_to_png(svg))
        print(f"wrote {name}.png")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def ready(screen: str) -> bool:
    return "│ ready │" in screen


def walk(size: tuple[int, int], threads: int) -> str:
    """One walk at ``size``; returns what the terminal shows after ``q``."""
    width, height = size
    name = f"walk-{width}x{height}"
    command = f"{shlex.quote(str(Path(sys.executable).with_name('esamp-tui')))} --threads {threads}"
    cache = tempfile.mkdtemp(prefix="esamp-walk-")  # an empty model cache: a real first start
    term = Tmux(width, height, command, dict(ESAMP_CACHE_DIR=cache, COLORTERM="truecolor", TERM="xterm-256color"))
    try:
        term.wait(lambda s: "starting engine" in s, "the first screen")
        if width == 80:
            term.png(f"{name}-1-starting")
        term.wait(ready, "the engine ready")
        term.keys(PROMPT, "Enter")
        term.wait(lambda s: "generating" in s and " tok" in s, "the first tokens")
        time.sleep(3.0)
        if width == 80:
            term.png(f"{name}-2-streaming")
        term.wait(lambda s: ready(s) and "distinct-2" in s and "Vendi …" not in s, "the run's end and its Vendi score")
        time.sleep(2.5)  # a chart redraw, a memory reading
        if width == 80:
            term.png(f"{name}-3-done")
        else:
            term.keys("c")  # compare: ESamp off and on at once
            term.wait(lambda s: "generating" in s, "the compare run")
            term.wait(lambda s: ready(s) and s.count("distinct-2") >= 3 and "Vendi …" not in s, "the compare run's end")
            time.sleep(2.5)
            term.png(f"{name}-4-compare")
            term.keys("?")
            term.wait(lambda s: "keymap.toml" in s, "the help screen")
            time.sleep(0.5)
            term.png(f"{name}-5-help")
            term.keys("Escape")
            time.sleep(0.5)
        term.keys("q")
        term.wait(lambda s: "[esamp-tui exited" in s, "the shell after q", timeout=30)
        time.sleep(2.0)  # anything printed after the dashboard (a resource tracker's warning) lands
        return term.screen().rstrip()
    finally:
        term.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--walk", action="store_true", help="the newcomer's walk in tmux at 80×24 and 140×42")
    args = parser.parse_args()
    if args.walk:
        for size in ((80, 24), (140, 42)):
            after = walk(size, args.threads)
            print(f"after q at {size[0]}×{size[1]}:\n{after}\n")
        return 0
    asyncio.run(shoot((200, 50), "dashboard-200x50", args.threads, compare=True))
    asyncio.run(shoot((80, 24), "dashboard-80x24", args.threads, compare=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
