"""Pieces of the vLLM engine that need no engine: settings, the candidate filter, the bank."""

from __future__ import annotations

import pytest
import torch

from esamp.core import intervention as iv
from esamp.core.config import EsampConfig, SamplingConfig
from esamp.core.distiller import DistillerBank, RowLayout
from esamp.engines.vllm import settings as es
from esamp.errors import ConfigError


def test_settings_round_trip_and_neutral_filters():
    s = SamplingConfig(temperature=0.7, top_p=0.9, min_p=0.05, top_k=20)
    extra = {es.KEY: es.request_settings("g", 2, EsampConfig(beta=0.5, mix="unsharpened"), s)}
    parsed = es.parse_request_settings(extra)
    assert parsed["group"] == "g" and parsed["sample"] == 2 and parsed["beta"] == 0.5
    assert parsed["temperature"] == 0.7 and parsed["top_k"] == 20 and parsed["mix"] == "unsharpened"
    assert es.vllm_filters(True, s) == dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    assert es.vllm_filters(True, SamplingConfig(temperature=0.0))["temperature"] == 0.0
    assert es.vllm_filters(False, s)["top_p"] == 0.9
    assert es.parse_request_settings({}) is None
    with pytest.raises(ValueError):
        es.parse_request_settings({es.KEY: {"group": "g", "sample": 0, "mix": "bogus"}})


def test_layers_and_architectures_give_clear_errors():
    assert es.resolve_layer(-1, 30, "target") == 29
    with pytest.raises(ConfigError) as err:
        es.resolve_layer(30, 30, "target")
    assert err.value.hint
    with pytest.raises(ConfigError):
        es.esamp_architecture("GPT2LMHeadModel")


@pytest.mark.vllm
def test_core_candidate_mask_equals_vllms_own_filters():
    """Drift canary: the core candidate set is what vLLM's own min-p + top-k/top-p ops keep."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    for trial in range(40):
        R, V = 6, 800
        z = torch.randn(R, V) * (1 + 5 * torch.rand(1))
        k = torch.randint(0, 40, (R,)) if trial % 2 else torch.zeros(R, dtype=torch.long)
        p = 0.5 + 0.5 * torch.rand(R)
        m = 0.2 * torch.rand(R) if trial % 3 else torch.zeros(R)
        probs = z.softmax(-1)
        filtered = z.masked_fill(probs < probs.amax(-1, keepdim=True) * m[:, None], float("-inf"))
        kk = torch.where(k > 0, k, torch.full_like(k, V))
        want = torch.isfinite(apply_top_k_top_p_pytorch(filtered.clone(), kk, p))
        assert torch.equal(iv.candidate_mask(z, k, p, m), want), trial
        assert torch.equal(iv.candidate_mask(z, k, p, m, width=V), want), trial


@pytest.mark.vllm
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_processor_filter_equals_core_candidate_mask(device):
    """The processor's filter is the function vLLM's sampler calls on that device. On a CPU (the
    sort) it keeps exactly the core's candidate set. On a GPU vLLM uses a Triton kernel from 8
    rows up, which finds the top-p cut without sorting: it must keep a prefix of each row's
    sorted order, like the sort, and may move that cut only by tokens at the boundary."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from esamp.engines.vllm.processor import filter_candidates

    gen = torch.Generator().manual_seed(3)
    moved = []
    for trial in range(24):
        R, V = (4, 900) if trial % 4 == 0 else (16, 5000)
        z = torch.randn(R, V, generator=gen) * (1 + 6 * torch.rand(1, generator=gen))
        k = torch.randint(0, 60, (R,), generator=gen) if trial % 2 else torch.zeros(R, dtype=torch.long)
        p = 0.5 + 0.5 * torch.rand(R, generator=gen)
        m = 0.2 * torch.rand(R, generator=gen) if trial % 3 else torch.zeros(R)
        want = iv.candidate_mask(z, k, p, m)
        kk = torch.where(k > 0, k, torch.full_like(k, V)) if trial % 2 else None
        got = filter_candidates(z.clone().to(device), None if kk is None else kk.to(device), p.to(device),
                                m.reshape(-1, 1).to(device) if trial % 3 else None).cpu()
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], z[kept]), trial  # kept tokens keep their z̃
        if device == "cpu" or R < 8:
            assert torch.equal(kept, want), trial
            continue
        order = z.argsort(dim=-1, descending=True)
        in_order = kept.gather(1, order)
        count = in_order.sum(-1)
        # a prefix of the sorted order, never empty, at most the top-k
        assert torch.equal(in_order, torch.arange(V).expand(R, V) < count[:, None]), trial
        assert (count >= 1).all() and (kk is None or (count <= kk).all()), trial
        moved.append((count - want.sum(-1)).abs())
    if moved:
        moved = torch.cat(moved)
        print(f"Triton top-p cut vs the sort: {int((moved > 0).sum())}/{moved.numel()} rows moved, "
              f"at most {int(moved.max())} tokens")
        assert (moved > 0).float().mean() <= 0.1 and int(moved.max()) <= 3


def test_predict_and_train_equals_predict_then_train():
    """The processor's one-pass step gives what separate predict / row_error / train_step give."""
    for optimizer in ("adam", "sgd"):
        a = DistillerBank(16, rank=4, slots=3, optimizer=optimizer, seed=5)
        b = DistillerBank(16, rank=4, slots=3, optimizer=optimizer, seed=5)
        for g in ("p", "q"):
            a.allocate(g), b.allocate(g)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            layout = RowLayout.from_slots([1, 0, 1])
            x, y = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
            want_pred = a.predict(x, layout)
            want_loss = a.train_step(x, y, layout)
            with torch.inference_mode():  # as inside vLLM's sampler
                layout_inf = RowLayout.from_slots([1, 0, 1])
                pred, err, loss = b.predict_and_train(x, y, layout_inf)
            torch.testing.assert_close(pred, want_pred)
            assert torch.equal(loss, want_loss)
            torch.testing.assert_close(err, DistillerBank.row_error(want_pred, y))
        a.free("q"), b.free("q")
        for k in a.PARAMS:
            assert torch.equal(a.params[k], b.params[k])


def test_bench_workload_parsing():
    from esamp.bench import parse_workload

    assert parse_workload("16x64") == (16, 1, 64)
    assert parse_workload("32xn8x256") == (32, 8, 256)
    with pytest.raises(ConfigError):
        parse_workload("16by64")


@pytest.mark.parametrize("args", [["--trials", "0"], ["--seed", "-1"], ["--gpu-memory-utilization", "1.5"],
                                  ["--workloads", "16by64"]])
def test_bench_refuses_bad_options_before_loading_anything(args, capsys):
    from esamp.cli import main

    assert main(["bench", "--model", "no-such-model", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model" not in err  # refused before the model is looked up


@pytest.mark.cuda
def test_cuda_check_leaves_the_process_able_to_fork_cuda_users():
    """vLLM forks its engine core: our CUDA check must not initialise CUDA in the parent."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = (
        "import multiprocessing as mp, torch\n"
        "from esamp.engines import cuda_available\n"
        "assert cuda_available()\n"
        "def child():\n"
        "    torch.zeros(1, device='cuda')\n"
        "p = mp.get_context('fork').Process(target=child); p.start(); p.join()\n"
        "raise SystemExit(p.exitcode)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@pytest.mark.cuda
def test_graphed_distiller_step_equals_eager_steps():
    """The CUDA-graph replay of a Distiller step does what the eager step does, step after step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from esamp.engines.vllm.processor import _GraphedStep

    dev = torch.device("cuda")
    banks = [DistillerBank(64, rank=8, slots=4, device=dev, seed=2) for _ in range(2)]
    for bank in banks:
        for g in ("a", "b", "c"):
            bank.allocate(g)
    slots = [0, 0, 2, 1, 2]  # scattered slots: the gathered path
    layouts = [RowLayout.from_slots(slots, dev) for _ in banks]
    gen = torch.Generator(device=dev).manual_seed(0)
    step = _GraphedStep(None, lambda x, y: banks[1].predict_and_train(x, y, layouts[1]),
                        torch.zeros(5, 64, device=dev), torch.zeros(5, 64, device=dev))
    for _ in range(5):
        x = torch.randn(5, 64, device=dev, generator=gen)
        y = torch.randn(5, 64, device=dev, generator=gen)
        want = banks[0].predict_and_train(x, y, layouts[0])
        got = step.run(x, y)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w)
    torch.testing.assert_close(banks[1].flat, banks[0].flat)
    assert torch.equal(banks[1].steps, banks[0].steps)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fused_mix_and_count_equals_the_torch_ops(device):
    """The fused mix (Triton on a GPU) equals a·z̃ + c·d with −∞ kept, counts |C|, and β = 0
    returns z̃ bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from esamp.core.backends.triton_mix import mix_and_count, mix_and_count_torch

    gen = torch.Generator().manual_seed(5)
    R, V = 6, 10_000
    z = torch.randn(R, V, generator=gen)
    z[torch.rand(R, V, generator=gen) < 0.7] = float("-inf")
    d = torch.randn(R, V, generator=gen).to(torch.bfloat16)
    beta = torch.tensor([0.0, 0.8, 0.8, 2.0, 0.0, 0.3]).reshape(-1, 1)
    a = torch.where(torch.arange(R).reshape(-1, 1) % 2 == 0, 1 + beta, torch.ones_like(beta))
    want, want_count = mix_and_count_torch(z.clone(), d, a, -beta)
    got, count = mix_and_count(z.clone().to(device), d.to(device), a.to(device), -beta.to(device))
    got = got.cpu()
    assert torch.equal(count.cpu().long(), want_count) and torch.equal(torch.isfinite(got), torch.isfinite(z))
    fin = torch.isfinite(z)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-5)
    for r in (0, 4):  # β = 0
        assert torch.equal(got[r], z[r])
