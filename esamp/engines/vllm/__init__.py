"""ESamp on vLLM through public seams only.

- ``model``: out-of-tree model classes (Llama, Qwen2) whose ``forward`` appends vLLM's own
  auxiliary (EAGLE-3) taps to the final hidden state, and whose eager ``compute_logits`` hands the
  tapped rows to the engine's step exchange and hands back d = W·ŷ as ŷ and the head's weight.
- ``exchange``: the per-step meeting point of the model and the live logits-processor adapter.
- ``steering``: ESamp in one engine (the Distiller bank, plans, the step, records, counters), built
  by ``make_steering``.
- ``hooks``: steps other packages register to run once an engine's steering is built (none for a
  library engine; ``esamp serve`` adds its side channel and its workers' stop handling this way).
- ``v1`` (``V1Adapter``, vLLM's V1 interface) and ``mrv2`` (``Mrv2Adapter``, Model Runner V2's):
  the adapters; ``entry`` is the class vLLM's loaders build, which picks the adapter of the runner
  that loads it.
- ``rows``: requests as ESamp rows, prompt groups and their Distiller slots.
- ``step_records``: per-step novelty records, read back without waiting on the GPU.
- ``tp``: a worker's place in the tensor-parallel group (TP rank 0 owns the bank, shares ŷ).
- ``extension``: worker methods called through ``collective_rpc`` (``esamp bench`` adds its own:
  ``esamp.commands.bench.worker_extension``).
- ``engine``: ``VllmEngine``, the streaming loop (``add_request`` + ``step`` with delta outputs).
- ``launch``: vLLM's engine arguments from a resolved model and the ESamp settings (the library
  engine's and ``esamp serve``'s).
- ``plugin``: registration with vLLM (the model classes; the processor's scoped entry point).
- ``settings``: how ESamp settings travel through vLLM (engine-wide and per request).
- ``versions``: the vLLM versions esamp supports.

Importing this package does not import vLLM; the submodules above do.
"""
