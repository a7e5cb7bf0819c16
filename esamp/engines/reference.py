"""The reference engine: transformers + PyTorch, eager, forward hooks on the two tapped norms.

It runs the embedded default on a CPU and is the oracle the vLLM engine is tested against.
A prompt group is one batch: the prompt is prefilled once, its KV cache repeated for the n
samples, and every step feeds each running sample's last token.  When a sample finishes its row
is dropped from the batch and the cache; rows are renumbered from ``alive`` every step, so no
row index outlives the step that made it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from esamp.core import intervention as iv
from esamp.core.config import EsampConfig, SamplingConfig
from esamp.core.distiller import DistillerBank, RowLayout
from esamp.engines.base import GroupStream, RateMeter, encode_prompt, new_group_key
from esamp.errors import EngineError
from esamp.events import ErrorEvent, Event, ReadyEvent, StepEvent
from esamp.models import resolve
from esamp.threads import apply_threads
from esamp.core.novelty import NoveltyNormalizer


@dataclass
class _Group:
    key: str
    sampling: SamplingConfig
    esamp: EsampConfig
    stream: GroupStream
    prompt_ids: list[int]
    max_new: int
    generator: torch.Generator
    alive: list[int] = field(default_factory=list)  # sample index of each batch row, in row order
    last: torch.Tensor | None = None  # [rows] last sampled token per row
    cache: object | None = None
    slot: int | None = None
    steps: int = 0


class _Taps:
    """Forward hooks that keep the last position of two modules' outputs."""

    def __init__(self, source: torch.nn.Module, target: torch.nn.Module) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        self.calls = 0
        self._handles = [
            source.register_forward_hook(self._hook("source")),
            target.register_forward_hook(self._hook("target")),
        ]

    def _hook(self, name: str):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.rows[name] = out[:, -1, :].detach()
            self.calls += 1

        return hook

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.rows.pop("source"), self.rows.pop("target")
        except KeyError:
            raise EngineError("a tapped module did not run in the forward pass",
                              hint="check --source-layer/--target-layer") from None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class ReferenceEngine:
    name = "reference"

    def __init__(self, model: str | None = None, esamp: EsampConfig | None = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32,
                 threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        t0 = time.perf_counter()
        self.esamp = esamp or EsampConfig()
        if device == "cpu":
            apply_threads(threads)
        self.resolved = resolve(model)
        if self.resolved.kind == "dummy":
            raise EngineError(
                f"{self.resolved.name} has random weights and only runs on the vLLM engine",
                hint="use --engine vllm, or pass a real model to the reference engine",
            )
        path = self.resolved.hf_dir()
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        cfg = self.model.config
        layers = self.model.model.layers
        self.num_layers = len(layers)
        src, dst = self._layer_index(self.esamp.source_layer), self._layer_index(self.esamp.target_layer)
        self.taps = _Taps(layers[src].input_layernorm, layers[dst].input_layernorm)
        self.lm_head = self.model.get_output_embeddings().weight.detach()
        self.hidden = cfg.hidden_size
        self.context = int(getattr(cfg, "max_position_embeddings", 2048))
        self.bank = DistillerBank(
            self.hidden, rank=self.esamp.rank, slots=self.esamp.slots, lr=self.esamp.lr,
            optimizer=self.esamp.optimizer, device=self.device, seed=self.esamp.seed,
        )
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) or self.tokenizer.eos_token_id
        self.stop_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.normalizer = NoveltyNormalizer()
        self.groups: dict[str, _Group] = {}
        self.rate = RateMeter()
        self.step_count = 0
        self._ready = ReadyEvent(
            engine=self.name, model=self.resolved.name, device=str(self.device),
            hidden_size=self.hidden, num_layers=self.num_layers, context=self.context,
            load_seconds=round(time.perf_counter() - t0, 3),
        )

    def _layer_index(self, index: int) -> int:
        L = self.num_layers
        if not -L <= index < L:
            raise EngineError(f"layer {index} is out of range for a {L}-layer model",
                              hint=f"choose a layer between {-L} and {L - 1}")
        return index % L

    @property
    def ready(self) -> ReadyEvent:
        return self._ready

    # -- admission ---------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, self.context)

    def start(self, prompt: str | Sequence[int], sampling: SamplingConfig,
              esamp: EsampConfig | None = None, group: str | None = None, chat: bool = True) -> str:
        esamp = esamp or self.esamp
        ids = self.encode(prompt, chat)
        key = group or new_group_key()
        if key in self.groups:
            raise EngineError(f"group {key!r} is already running", hint="use a new group key")
        slot = self.bank.allocate(key) if esamp.enabled else None
        gen = torch.Generator(device="cpu")
        gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        self.groups[key] = _Group(
            key=key, sampling=sampling, esamp=esamp,
            stream=GroupStream(key, sampling.n, self.tokenizer, self.normalizer,
                               () if sampling.ignore_eos else self.stop_ids, ids),
            prompt_ids=ids, max_new=min(sampling.max_tokens, self.context - len(ids)),
            generator=gen, slot=slot,
        )
        return key

    def abort(self, group: str) -> list[Event]:
        g = self.groups.pop(group, None)
        if g is None:
            return []
        self._release(g)
        return g.stream.finish_all("abort")

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def close(self) -> None:
        for key in list(self.groups):
            self.abort(key)
        self.taps.remove()

    def _release(self, g: _Group) -> None:
        if g.slot is not None:
            self.bank.free(g.key)
            g.slot = None

    # -- decoding ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, g: _Group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        if g.cache is None:  # prefill once, then one row per sample
            g.cache = DynamicCache()
            ids = torch.tensor([g.prompt_ids], device=self.device)
            out = self.model(input_ids=ids, past_key_values=g.cache, use_cache=True)
            g.alive = list(range(g.sampling.n))
            logits = out.logits[:, -1, :]
            x, y = self.taps.take()
            return logits, x, y
        ids = g.last.reshape(-1, 1)
        out = self.model(input_ids=ids, past_key_values=g.cache, use_cache=True)
        x, y = self.taps.take()
        return out.logits[:, -1, :], x, y

    def _step_group(self, g: _Group, stats: dict) -> list[Event]:
        events: list[Event] = []
        first = g.steps == 0
        logits, x, y = self._forward(g)  # rows: 1 on the prefill step, else len(g.alive)
        s = g.sampling
        steered = g.esamp.enabled

        prediction = errors = None
        if steered:
            # The prediction that steers is the Distiller's before this step's update; with
            # training on, one pass gives both it and the update.
            layout = RowLayout.from_slots([g.slot] * x.shape[0], self.device)
            if g.esamp.train:
                prediction, errors, loss = self.bank.predict_and_train(x, y, layout)
                stats["losses"].append(float(loss.mean()))
            else:
                prediction = self.bank.predict(x, layout)
                errors = DistillerBank.row_error(prediction, y)
            stats["port_hits"] += x.shape[0]
        if not first:  # this step's inputs were the tokens sampled last step
            events += g.stream.novelties(g.alive, errors.tolist() if errors is not None else None)

        rows = len(g.alive)
        if first:  # the prompt's last position serves every sample's first token
            logits = logits.expand(rows, -1)
            if prediction is not None:
                prediction = prediction.expand(rows, -1)
        temperature = torch.full((rows,), s.temperature)
        scaled = iv.scale_logits(logits, temperature)
        mask = iv.candidate_mask(scaled, torch.full((rows,), s.top_k), torch.full((rows,), s.top_p),
                                 torch.full((rows,), s.min_p))
        if steered:
            final = iv.steer(scaled, mask, prediction, self.lm_head, torch.full((rows,), g.esamp.beta),
                             g.esamp.mix)
            stats["candidates"].append(float(mask.sum(dim=-1).float().mean()))
            stats["steered"] = True
        else:
            final = iv.filtered_logits(scaled, mask)
        tokens = iv.sample(final, torch.full((rows,), s.temperature == 0), g.generator)

        if first:
            g.cache.batch_repeat_interleave(rows)
        g.steps += 1
        keep: list[int] = []
        for row, (sample, token) in enumerate(zip(g.alive, tokens.tolist())):
            stats["tokens"] += 1
            if g.stream.sampled(sample, token):
                events += g.stream.finish(sample, "stop")
            elif g.stream.count[sample] >= g.max_new:
                events += g.stream.finish(sample, "length")
            else:
                keep.append(row)
        if len(keep) < rows and keep:
            g.cache.batch_select_indices(torch.tensor(keep, device=self.device))
        g.alive = [g.alive[r] for r in keep]
        g.last = tokens[keep]
        stats["rows"] += rows
        return events

    def step(self) -> list[Event]:
        """Advance every running group by one token."""
        events: list[Event] = []
        stats = dict(tokens=0, rows=0, port_hits=0, candidates=[], losses=[], steered=False)
        for key in list(self.groups):
            g = self.groups[key]
            try:
                events += self._step_group(g, stats)
            except Exception as exc:  # one failing group must not take the others down
                self.groups.pop(key, None)
                self._release(g)
                events.append(ErrorEvent(message=f"generation failed: {exc}", group=key,
                                         hint="the other groups keep running; try again"))
                events += g.stream.finish_all("error")
                continue
            if g.stream.done:
                self.groups.pop(key, None)
                self._release(g)
                self.normalizer.forget(key)
        if stats["rows"]:
            events.append(StepEvent(
                step=self.step_count, rows=stats["rows"],
                tokens_per_s=round(self.rate.add(stats["tokens"]), 3),
                loss=sum(stats["losses"]) / len(stats["losses"]) if stats["losses"] else None,
                port_hits=stats["port_hits"],
                candidates=sum(stats["candidates"]) / len(stats["candidates"]) if stats["candidates"] else 0.0,
                esamp=stats["steered"],
            ))
            self.step_count += 1
        return events
