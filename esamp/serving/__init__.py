"""ESamp behind vLLM's own OpenAI-compatible server (docs/serving.md).

There is no server of ours: ``esamp serve`` assembles ``vllm serve``'s options and hands the
process over to vLLM. What ESamp adds rides on vLLM's public seams:

- ``esamp.commands.serve`` (the command, in the commands' room): ``esamp serve MODEL [vLLM
  options]``: resolves the model as every esamp command does, writes the engine-wide settings into
  ``--additional-config``, chooses the model class (``--hf-overrides``), the logits processor, the
  worker extension and this package's middleware, caps ``--max-num-seqs`` to the Distiller bank,
  sets ``ESAMP_SERVE`` (every request is an ESamp group unless it says ``{"esamp": "off"}``) and the
  side channels' per-launch secret, listens on 127.0.0.1 unless told otherwise, tries the port
  before loading anything, and execs vLLM's server.
- ``middleware``: an ASGI middleware vLLM loads with ``--middleware``, the outermost layer. It
  checks ``--api-key`` on every route but the health checks and the counters, refuses a request
  ESamp cannot serve with an OpenAI-style 400 before a stream starts, names each request's group
  (the server's id, never a client's) and frees its slot when the request ends, keeps the n
  samples of a request on one data-parallel rank, ends every open response when the server stops,
  and serves ``GET /esamp/metrics``, ``GET /esamp/records?group=ID`` and ``GET /esamp/config``
  from every rank's side channel.
- ``channel``: a rank's side channel (its counters and records over HTTP, for the middleware).
- ``plugin``: what a served engine adds in vLLM's engine processes (the side channel, workers that
  put off a stop signal: ``shutdown``), through a vLLM plugin only ``esamp serve``'s processes load.
- ``admission``: the request check the middleware runs (the engine's own ``settings.prepare``).
- ``metrics``: every rank's counters as one Prometheus text.

The client side is ``esamp.engines.endpoint.EndpointEngine`` (``create_engine("server", url=...)``),
which ``esamp generate --server``, ``esamp eval --server`` and ``esamp-tui --server`` use.
"""

MIDDLEWARE = "esamp.serving.middleware.EsampMiddleware"
