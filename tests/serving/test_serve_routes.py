"""The canary for vLLM's routes: vLLM's own app, built as its server builds it (no engine, no model)
with every optional router on, serves no POST route that ``esamp.serving.routes`` does not classify.
A vLLM that adds a route fails here until the route is classified: generating (steered, or sampled
plainly) or not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from esamp.serving import routes as rt

pytestmark = [pytest.mark.vllm]

# Every switch vLLM 0.30 puts a router behind, on (vllm/entrypoints/launchers/api_server/routers.py)
SWITCHES = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_ENABLE_COHERE_API": "1"}
ARGS = [
    "--enable-scale-out",
    "--tokens-only",
    "--enable-fault-tolerance",
    "--profiler-config",
    '{"profiler": "torch", "torch_profiler_dir": "/tmp/esamp-unused"}',
]
# Routes behind an SDK that is not installed here, which no app built here can show
NEEDS_SDK = {"/cohere/v2/chat", "/cohere/v2/chat/render"}


def vllm_app(monkeypatch):
    """vLLM's FastAPI app with every router it can register: every task, every switch, and a
    pooling model's configuration (a stand-in: the pooling routers read only the task)."""
    pytest.importorskip("vllm")
    for name, value in SWITCHES.items():
        monkeypatch.setenv(name, value)
    import vllm.envs

    # An engine built earlier in this process may have made vLLM cache its environment
    # (EngineCore enables the cache); the switches above must be read now.
    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.tasks import GENERATION_TASKS, POOLING_TASKS
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "unused", *ARGS])
    pooling = SimpleNamespace(get_pooling_task=lambda tasks: "embed", hf_config=SimpleNamespace(num_labels=1))
    return build_app(args, GENERATION_TASKS + POOLING_TASKS, pooling)


def test_every_post_route_vllm_registers_is_classified(monkeypatch):
    served = rt.posts(vllm_app(monkeypatch))
    kinds = rt.classify(served)
    assert kinds[rt.UNKNOWN] == [], (
        f"vLLM serves POST {kinds[rt.UNKNOWN]}, which esamp.serving.routes does not classify: say whether each "
        "generates (STEERED if its vllm_xargs reach the sampling parameters, else PLAIN) or not (OTHER)"
    )
    # what esamp steers is there, under these names, and /generative_scoring (the issue-29 leak) is known
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/invocations",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
    } == set(kinds[rt.STEERED])
    assert "/generative_scoring" in kinds[rt.PLAIN]
    # the table names nothing vLLM no longer has (a stale name would hide a renamed route)
    assert set(rt.POST_ROUTES) - set(served) == NEEDS_SDK
