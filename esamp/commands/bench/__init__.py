"""``esamp bench``: ESamp's throughput against plain vLLM, in one invocation.

Two engines stay loaded side by side: the baseline is plain vLLM (the model's own class, no ESamp
settings, CUDA graphs as configured), the other is the ESamp engine. Trials interleave the sides
pass by pass on identical token-id prompts and sampling settings, every sample runs to exactly
its token budget, and a short workload repeats within each trial (``--min-trial-seconds``), the
same number of passes on every side (``trials``). Workloads are ``PxL`` (P prompts × L tokens,
n=1), ``PxnNxL`` (P prompts × n=N samples × L tokens), or a preset's name (``fair``: the
published runtime's workload and settings, 8 prompts × n=16 × 256 tokens, top-p 1.0, min-p 0.05,
β 0.1). Without a GPU it runs the embedded model on vLLM for the CPU, on workloads that finish in
a few minutes.

``--floor`` adds a third side: the ESamp engine (tap model class and logits processor installed)
running every request with ESamp off. Its ratio to the baseline is what the seams cost by
themselves, before any Distiller or steering work.

``--distiller shared`` runs the ESamp side with one Distiller for every group (the published
runtime's mode: one Distiller block as wide as the batch, trained on every steered row) instead of
a Distiller per group; the JSON's ``esamp`` settings say which.

``--logits`` chooses what a dummy model's next-token distributions look like: ``flat`` (the dummy
weights as they are: near-uniform logits keep almost the whole vocabulary under the default
filters, ESamp's worst case) or ``realistic`` (``calibrate``: the head rescaled to a real model's
candidate count and entropy).

Output: a table on stdout and a JSON file with per-trial tok/s, the ESamp/baseline ratio (median
of the per-trial ratios, with min and max), time to first token per side, the Distiller's loss
count and first/last loss, port hits, mean candidate count, the processor's host time per steady
step and its start-up and plan costs, peak GPU memory of each engine, the calibration, device,
versions and the exact command. Ctrl-C or SIGTERM stops the bench and still writes what was
measured, every workload with the rounds and trials it finished (``stop``, ``run.WorkloadRun``).
vLLM's own output, from this process and its engine processes, goes to a log beside the JSON
(``vllm_log``), so the terminal shows the bench's lines only.

Sampling draws without per-request seeds unless ``--seed`` is given: with a seed, vLLM's sampler
draws each row with its own generator (one kernel launch per row and step), which slows both
sides alike and makes the engine bound by its host.
"""

from esamp.commands.bench.run import HELP, configure, run

__all__ = ["HELP", "configure", "run"]
