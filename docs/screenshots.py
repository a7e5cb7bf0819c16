"""Make the dashboard screenshots in this folder: the embedded model on the CPU, headless.

    python docs/screenshots.py [--threads 1]

At 200×50 it runs one prompt with ESamp off, the same prompt and seed with ESamp on, then both at
once (compare mode), so the history line compares them; at 80×24 it runs one prompt. Each picture
is rendered as the dashboard's own export renders its PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PROMPT = "Name three colours and say what each makes you think of."


async def shoot(size: tuple[int, int], name: str, threads: int, compare: bool) -> None:
    from esamp.core.config import EsampConfig, SamplingConfig
    from esamp.gpu import MemorySampler
    from esamp_tui.app import EsampApp
    from esamp_tui.options import Options
    from esamp_tui.screenshot import svg_to_png

    options = Options(engine="reference", esamp=EsampConfig(enabled=not compare),
                      sampling=SamplingConfig(n=4, max_tokens=48), prompt=PROMPT, log_file="",
                      engine_options=dict(threads=threads))
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(shoot((200, 50), "dashboard-200x50", args.threads, compare=True))
    asyncio.run(shoot((80, 24), "dashboard-80x24", args.threads, compare=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
