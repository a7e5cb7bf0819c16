"""``esamp eval``: Pass@k and semantic diversity, ESamp against the baseline, fully offline.

Modules, bottom up:

- ``passk``: the unbiased Pass@k estimator (pure functions).
- ``diversity``: distinct-n, Vendi score, mean pairwise cosine distance, and a lazy MiniLM
  embedder; importable on its own (the TUI reuses it).
- ``stats``: paired bootstrap confidence intervals.
- ``tasks``: problems that load offline (HumanEval, AIME, MATH-500 subset, built-in sets, JSONL).
- ``grading``: answer extraction and the symbolic math check (in a subprocess); ``sandbox``: code
  tests under bubblewrap.
- ``runner``: every arm on the same problems and seeds, resumable; ``report``: JSON + Markdown;
  ``frontier``: every cell against the temperature curve of the plain arms.
- ``cli``: the ``esamp eval`` subcommand.
"""
