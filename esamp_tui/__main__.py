"""``esamp-tui``: the dashboard's command line. Bad flags: a clear message and exit status 2.

The ESamp and sampling flags (``--beta``, ``--mix``, ``--distiller``, ``-n``, ``--max-tokens``,
``--seed``, ``--no-esamp``, the filters) are built from ``esamp.core.config``, the same as
``esamp generate``'s: their defaults, ranges and error messages are the core's. ``-n`` is
further limited to the panes the dashboard can show.
"""

from __future__ import annotations

import argparse
import sys

from esamp.errors import EsampError

EPILOG = """keys (also in the command palette, ctrl+p): e ESamp on/off · r re-run · c compare off/on ·
+/- beta · n/N samples · m mix · a abort · x export · g charts · t theme · ? help · q quit.
Themes: dark, light, high-contrast, and your own TOML files in ~/.config/esamp/themes."""


def build_parser() -> argparse.ArgumentParser:
    from esamp.commands.cli import Parser, add_engine_flags
    from esamp.platform.threads import add_threads_flag
    from esamp_tui.options import MAX_PANES, add_setting_flags

    p = Parser(
        prog="esamp-tui",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Watch n samples (up to {MAX_PANES}) side by side with novelty heat; toggle ESamp and compare.",
    )
    add_engine_flags(
        p,
        server_help="attach to a running esamp serve endpoint (http://HOST:PORT) instead of "
        "starting an engine; --model then names a served model",
    )
    p.add_argument("--prompt", default=None, help="run this prompt at start")
    p.add_argument("--theme", default=None, help="theme name (dark, light, high-contrast or your own)")
    add_threads_flag(p)
    add_setting_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from esamp.platform.threads import prefer_passive_wait, threads_option

    prefer_passive_wait()  # before torch loads (here, and in the engine's worker process)
    args = build_parser().parse_args(argv)  # argparse itself exits 2 on unknown flags
    try:
        from esamp.commands.cli import refuse_server_distiller
        from esamp.engines import EngineChoice, choose_engine
        from esamp_tui.options import Options
        from esamp_tui.theming import check_theme, load_themes

        refuse_server_distiller(args)

        # --server: the session's worker runs the client of the served endpoint (esamp.engines.endpoint);
        # otherwise "auto" is decided here, so the status bar can say what was picked and why
        choice = EngineChoice("server", "") if args.server else choose_engine(args.engine)
        engine_options = {"url": args.server} if args.server else threads_option(choice.name, args.threads)
        options = Options.from_args(
            args,
            engine=choice.name,
            engine_reason=choice.reason,
            model=args.model,
            prompt=args.prompt,
            theme=args.theme,
            engine_options=engine_options,
        )
        if args.theme is not None:
            check_theme(args.theme, *load_themes())
    except EsampError as exc:
        print(f"esamp-tui: error: {exc.user_text()}", file=sys.stderr)
        return 2
    return run_app(options)


def run_app(options, memory_sampler=None) -> int:
    """Run the dashboard; whatever ends it (q, ctrl+c, a signal, an exception), the worker is
    stopped and the terminal restored. Exit status 0, or 128 + the signal that ended it."""
    from esamp.platform.gpu import MemorySampler
    from esamp_tui.app import EsampApp

    sampler = memory_sampler or MemorySampler()
    app = EsampApp(options, memory_sampler=sampler)
    try:
        app.run()
    except KeyboardInterrupt:
        pass
    finally:
        if app.main_screen is not None:
            app.main_screen.controller.close_now()  # already done on unmount; this covers a crash
        sampler.close()
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
