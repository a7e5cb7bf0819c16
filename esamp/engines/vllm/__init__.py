"""ESamp on vLLM through public seams only.

- ``model``: out-of-tree model classes (Llama, Qwen2) whose ``forward`` returns the final hidden
  state with vLLM's own auxiliary (EAGLE-3) taps appended, and whose eager ``compute_logits``
  normalises and stashes the tapped rows.
- ``processor``: a V1 logits processor that runs the Distiller bank on the stashed rows and
  applies ``esamp.intervention`` per row, with per-request settings from
  ``SamplingParams.extra_args``.
- ``extension``: a worker extension whose ``esamp_drain`` brings novelty records, losses and
  counters back from the engine-core process through ``collective_rpc``.
- ``engine``: ``VllmEngine``, the streaming loop (``add_request`` + ``step`` with delta outputs).
- ``plugin``: the ``vllm.general_plugins`` entry point that registers the model classes.

Importing this package does not import vLLM; the submodules above do.
"""
