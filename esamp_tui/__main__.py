"""``esamp-tui``: the dashboard's command line. Bad flags: a clear message and exit status 2."""

from __future__ import annotations

import argparse
import sys

from esamp.errors import EsampError

EPILOG = """keys (also in the command palette, ctrl+p): e ESamp on/off · r re-run · c compare off/on ·
+/- beta · n/N samples · a abort · x export · t theme · ? help · q quit.
Themes: built-in dark, light, high-contrast; add your own as TOML in ~/.config/esamp/themes."""


def build_parser() -> argparse.ArgumentParser:
    from esamp.engines import ENGINE_NAMES

    p = argparse.ArgumentParser(
        prog="esamp-tui", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Watch n samples side by side with novelty heat; toggle ESamp and compare.",
    )
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file or a name in the local HF cache (default: embedded SmolLM2-135M)")
    p.add_argument("--engine", default="reference", choices=ENGINE_NAMES,
                   help="reference (CPU, default), vllm, or auto (vLLM when CUDA and vLLM are present)")
    p.add_argument("-n", type=int, default=4, help="samples per prompt, 1-8 (default 4)")
    p.add_argument("--beta", type=float, default=0.8, help="ESamp strength beta, 0-10 (default 0.8)")
    p.add_argument("--no-esamp", action="store_true", help="start with ESamp off")
    p.add_argument("--prompt", default=None, help="run this prompt at start")
    p.add_argument("--theme", default=None, help="theme name (dark, light, high-contrast or your own)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; re-runs reuse it (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the reference engine (default: all cores; 1 on a busy machine)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # argparse itself exits 2 on unknown flags
    try:
        from esamp_tui.options import Options
        from esamp_tui.theming import load_themes

        options = Options(engine=args.engine, model=args.model, n=args.n, beta=args.beta,
                          esamp_on=not args.no_esamp, max_tokens=args.max_tokens, prompt=args.prompt,
                          theme=args.theme, seed=args.seed,
                          engine_options={} if args.threads is None else {"threads": args.threads}
                          ).validate()
        if args.theme is not None:
            themes, _ = load_themes()
            names = [t.name for t in themes]
            if args.theme not in names:
                from textual.theme import BUILTIN_THEMES

                if args.theme not in BUILTIN_THEMES:
                    raise EsampError(f"unknown theme {args.theme!r}",
                                     hint="choose one of: " + ", ".join(names + sorted(BUILTIN_THEMES)))
    except EsampError as exc:
        print(f"esamp-tui: error: {exc.user_text()}", file=sys.stderr)
        return 2

    return run_app(options)


def run_app(options, memory_sampler=None) -> int:
    """Run the dashboard; whatever ends it (q, ctrl+c, an exception), the worker is stopped."""
    from esamp.gpu import MemorySampler
    from esamp_tui.app import EsampApp

    sampler = memory_sampler or MemorySampler()
    app = EsampApp(options, memory_sampler=sampler)
    try:
        app.run()
    except KeyboardInterrupt:
        pass
    finally:
        screen = app.main_screen
        if screen is not None and screen.session is not None:
            screen.session.close(timeout=0.5)
        sampler.close()
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
