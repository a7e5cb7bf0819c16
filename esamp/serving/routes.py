"""vLLM's POST routes, classified for ESamp: which generate text, and what the middleware does with
each (docs/serving.md, "Routes: which generate, and how each is served").

Whatever this table says, the API key guards every route but four (``middleware.OPEN``). Beyond
that, a route is one of:

- ``STEERED``: it generates, and its request's ``vllm_xargs`` reach vLLM's sampling parameters, so
  the middleware can give the request a group of the server's: it checks the body before vLLM
  answers (``check``), issues the group, returns its id in ``X-Esamp-Group`` and frees the group's
  Distiller slots when the request ends.
- ``PLAIN``: it generates, but no group of the server's can reach its sampling parameters (vLLM
  builds them itself, or takes them whole from another server). Its requests are sampled without
  ESamp and hold no Distiller slot: ``settings.prepare`` steers only a group the middleware issued.
- ``OTHER``: it samples nothing (tokenizer, adapters, caches, pooling, profiling, ...).

The routes a running server has are read from vLLM's own app (``posts``), not assumed: the
middleware classifies them when the first request comes, logs any POST route this table does not
name (sampled without ESamp, like a ``PLAIN`` one: the engine steers only issued groups), and
``GET /esamp/config`` lists the classification. tests/serving/test_serve_routes.py builds vLLM's
app with every optional router on and fails on a POST route this table does not name: the canary
for a vLLM that adds a generating route.
"""

from __future__ import annotations

from dataclasses import dataclass

STEERED, PLAIN, OTHER = "steered", "plain", "other"
UNKNOWN = "unknown"  # a POST route of the running server that this table does not name

# How the middleware reads a STEERED body before vLLM does (or /tokenize's text):
COMPLETION, CHAT, EITHER = "completion", "chat", "either"  # esamp.serving.admission.admit
XARGS = "xargs"  # middleware.other_admission: vLLM checks the body; the group rides in vllm_xargs
TEXT = "text"  # text a tokenizer reads: lone surrogates refused


@dataclass(frozen=True)
class Route:
    kind: str  # STEERED, PLAIN or OTHER
    why: str  # what it does, for the docs and the log
    check: str | None = None  # COMPLETION, CHAT, EITHER, XARGS or TEXT: the middleware reads the body
    prompts: str | None = None  # XARGS: the field whose items are separate prompts (one group each)


def _other(why: str, *paths: str) -> dict[str, Route]:
    return {path: Route(OTHER, why) for path in paths}


POST_ROUTES: dict[str, Route] = {
    "/v1/completions": Route(STEERED, "OpenAI completions", COMPLETION),
    "/v1/chat/completions": Route(STEERED, "OpenAI chat completions", CHAT),
    "/invocations": Route(STEERED, "SageMaker's entry point: a completion or chat body", EITHER),
    "/v1/responses": Route(STEERED, "OpenAI responses", XARGS),
    "/v1/messages": Route(STEERED, "Anthropic messages", XARGS),
    "/v1/chat/completions/batch": Route(STEERED, "several conversations, one group each", XARGS, "messages"),
    "/generative_scoring": Route(PLAIN, "one token per item, for its log-probabilities; takes no vllm_xargs"),
    "/cohere/v2/chat": Route(PLAIN, "Cohere chat (VLLM_ENABLE_COHERE_API); takes no vllm_xargs"),
    "/inference/v1/generate": Route(
        PLAIN,
        "token in, token out for disaggregated serving (--enable-scale-out, "
        "--tokens-only): sampling parameters come whole from another server",
    ),
    "/v1/audio/transcriptions": Route(PLAIN, "speech to text, for models ESamp does not run"),
    "/v1/audio/translations": Route(PLAIN, "speech to text, for models ESamp does not run"),
    "/tokenize": Route(OTHER, "the tokenizer", TEXT),
    **_other("the tokenizer", "/detokenize", "/v1/messages/count_tokens"),
    **_other("a health check (SageMaker)", "/ping"),
    **_other("cancels a background response", "/v1/responses/{response_id}/cancel"),
    **_other(
        "renders a request into tokens or back, without generating (--enable-scale-out)",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
        "/v1/completions/derender",
        "/v1/chat/completions/derender",
        "/cohere/v2/chat/render",
    ),
    **_other(
        "pooling models",
        "/pooling",
        "/classify",
        "/v1/embeddings",
        "/v2/embed",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    ),
    **_other(
        "LoRA adapters (VLLM_ALLOW_RUNTIME_LORA_UPDATING, SageMaker)",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/adapters",
    ),
    **_other("the profiler (--profiler-config)", "/start_profile", "/stop_profile"),
    **_other("elastic expert parallelism", "/scale_elastic_ep", "/is_scaling_elastic_ep"),
    **_other("fault tolerance (--enable-fault-tolerance)", "/fault_tolerance/apply"),
    **_other(
        "development routes (VLLM_SERVER_DEV_MODE; /abort_requests also with --tokens-only)",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/pause",
        "/resume",
        "/abort_requests",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/collective_rpc",
        "/sleep",
        "/wake_up",
    ),
}


def posts(app) -> list[str]:
    """Every POST path ``app`` (vLLM's FastAPI app, or any Starlette app) serves, from its routes."""
    return sorted(
        {
            route.path
            for route in getattr(app, "routes", ())
            if "POST" in (getattr(route, "methods", None) or ()) and getattr(route, "path", None)
        }
    )


def classify(paths) -> dict[str, list[str]]:
    """``paths`` (POST paths) by kind: ``STEERED``, ``PLAIN``, ``OTHER`` and ``UNKNOWN``."""
    out: dict[str, list[str]] = {STEERED: [], PLAIN: [], OTHER: [], UNKNOWN: []}
    for path in sorted(paths):
        route = POST_ROUTES.get(path)
        out[route.kind if route else UNKNOWN].append(path)
    return out
