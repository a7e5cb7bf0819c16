"""The reference engine: transformers + PyTorch, eager, forward hooks on the two tapped norms.

It runs the embedded default on a CPU and is the oracle the vLLM engine is tested against.
A prompt group is one batch: the prompt is prefilled once, its KV cache repeated for the n
samples, and every step feeds each running sample's last token.  When a sample finishes its row
is dropped from the batch and the cache; rows are renumbered from ``alive`` every step, so no
row index outlives the step that made it. Each step runs ``esamp.core.steerer.Steerer`` with the
reference backends: the core's candidate filter, and d computed only at the candidates.

A step runs every group's forward first. With a bank each group then takes its own Distiller
step; with the shared Distiller (``distiller="shared"``) one Distiller step covers every steered
row of every group, in group order, as the vLLM engine's step covers its whole batch. A group's
first step feeds the shared Distiller its prompt's last position once per sample: vLLM sees n
requests there, n rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from esamp.core import intervention as iv
from esamp.core.config import EsampConfig
from esamp.core.distiller import DistillerBank, bank_for
from esamp.core.steerer import SteeredRow, Steerer, StepPlan
from esamp.engines.base import EngineBase, Group, StepStats, resolve_layer, stop_token_ids
from esamp.engines.models import resolve
from esamp.errors import EngineError
from esamp.events import Event
from esamp.platform.threads import apply_threads


@dataclass
class _RefGroup(Group):
    generator: torch.Generator = field(default_factory=torch.Generator)
    alive: list[int] = field(default_factory=list)  # sample index of each batch row, in row order
    last: torch.Tensor | None = None  # [rows] last sampled token per row
    cache: object | None = None
    slot: int | None = None
    steps: int = 0
    plan: StepPlan | None = None  # for the current row count


class _Taps:
    """Forward hooks that keep the last position of two modules' outputs."""

    def __init__(self, source: torch.nn.Module, target: torch.nn.Module) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        self._handles = [
            source.register_forward_hook(self._hook("source")),
            target.register_forward_hook(self._hook("target")),
        ]

    def _hook(self, name: str):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.rows[name] = out[:, -1, :].detach()

        return hook

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.rows.pop("source"), self.rows.pop("target")
        except KeyError:
            raise EngineError(
                "a tapped module did not run in the forward pass", hint="check the source and target layers"
            ) from None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class ReferenceEngine(EngineBase):
    name = "reference"

    def __init__(
        self,
        model: str | None = None,
        esamp: EsampConfig | None = None,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        threads: int | None = None,
        progress=None,
    ) -> None:
        super().__init__(esamp)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if device == "cpu":
            apply_threads(threads)
        self.resolved = resolve(model, progress)
        if self.resolved.kind == "dummy":
            raise EngineError(
                f"{self.resolved.name} has random weights and only runs on the vLLM engine",
                hint="use --engine vllm, or pass a real model to the reference engine",
            )
        path = self.resolved.hf_dir(progress)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        layers = self.model.model.layers
        self.num_layers = len(layers)
        src = resolve_layer(self.esamp.source_layer, self.num_layers, "source")
        dst = resolve_layer(self.esamp.target_layer, self.num_layers, "target")
        self.taps = _Taps(layers[src].input_layernorm, layers[dst].input_layernorm)
        self.lm_head = self.model.get_output_embeddings().weight.detach()
        cfg = self.model.config
        self.hidden = cfg.hidden_size
        self.context = int(getattr(cfg, "max_position_embeddings", 2048))
        # The plain PyTorch step on every device: this engine is the oracle the fused kernels are held to.
        self.steerer = Steerer(bank_for(self.esamp, self.hidden, self.device, backend="torch"))
        self._joint: tuple[tuple, StepPlan] | None = None  # the shared Distiller's plan, by its groups' rows
        self.stop_ids = stop_token_ids(path, self.tokenizer)
        self.model_name, self.device_name = self.resolved.name, str(self.device)
        self._loaded()

    @property
    def bank(self) -> DistillerBank:
        return self.steerer.bank

    def _admit(self, group: Group) -> _RefGroup:
        slot = self.bank.allocate(group.key) if group.steered else None  # BankFullError when full
        # The draws' generator lives where the logits do (a CPU generator cannot draw on a GPU).
        g = _RefGroup(**vars(group), slot=slot, generator=torch.Generator(device=self.device))
        s = g.sampling
        g.generator.manual_seed(s.seed if s.seed is not None else torch.seed())
        return g

    def _release(self, g: _RefGroup) -> None:
        if g.slot is not None:
            self.bank.free(g.key)
            g.slot = None

    def _shutdown(self) -> None:
        self.taps.remove()

    # -- decoding ----------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, g: _RefGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        if g.cache is None:  # prefill once, then one row per sample
            g.cache = DynamicCache()
            ids = torch.tensor([g.prompt_ids], device=self.device)
            g.alive = list(range(g.sampling.n))
        else:
            ids = g.last.reshape(-1, 1)
        out = self.model(input_ids=ids, past_key_values=g.cache, use_cache=True)
        x, y = self.taps.take()
        return out.logits[:, -1, :], x, y

    def _plan(self, g: _RefGroup, rows: int) -> StepPlan:
        if g.plan is None or g.plan.rows != rows:
            g.plan = StepPlan.build([SteeredRow(g.slot, g.steering, g.sampling)] * rows, self.device)
        return g.plan

    def _joint_plan(self, groups: list[_RefGroup]) -> StepPlan:
        """The shared Distiller's plan: a row per running sample of every group, group by group."""
        # Everything the plan is made of (a key may name a new group once its holder has ended).
        key = tuple((g.key, g.slot, g.steering, g.sampling, len(g.alive)) for g in groups)
        if self._joint is None or self._joint[0] != key:
            rows = [SteeredRow(g.slot, g.steering, g.sampling, group=g.key) for g in groups for _ in g.alive]
            self._joint = (key, StepPlan.build(rows, self.device))
        return self._joint[1]

    def _distill_shared(self, fed: dict, out: dict, stats: StepStats) -> list[Event]:
        """One step of the shared Distiller on every steered row of the step (``fed``: each group's
        forward); each group's (ŷ, e) goes into ``out``. If it fails, every steered group does."""
        groups = [self.groups[k] for k in fed if self.groups[k].steered]
        if not groups:
            return []
        try:
            x = torch.cat([fed[g.key][1].expand(len(g.alive), -1) for g in groups])
            y = torch.cat([fed[g.key][2].expand(len(g.alive), -1) for g in groups])
            plan = self._joint_plan(groups)
            prediction, errors, loss = self.steerer.distill(plan, x, y)
        except Exception as exc:  # the one Distiller every group uses: none of them can be steered
            return [e for g in groups for e in self._failed(g, exc)]
        stats.port_hits += x.shape[0]
        offset = 0
        for g in groups:
            rows = len(g.alive)
            out[g.key] = (prediction[offset : offset + rows], errors[offset : offset + rows])
            if loss is not None and any(plan.trains[offset : offset + rows]):
                stats.add_loss(g.key, float(loss.mean()))  # the one step's loss, for each group it learned from
            offset += rows
        return []

    def _step_group(self, g: _RefGroup, fed: tuple, shared: tuple | None, stats: StepStats) -> list[Event]:
        """The rest of ``g``'s step after its forward (``fed``): its Distiller step (with a bank;
        ``shared``: its rows' (ŷ, e) from the shared Distiller's), the filter, the mix, the draw."""
        events: list[Event] = []
        first = g.steps == 0
        logits, x, y = fed  # rows: 1 on the prefill step, else len(g.alive)
        rows = len(g.alive)
        s = g.sampling
        if g.steered:
            # The prediction that steers is the Distiller's before this step's update.
            if self.bank.shared:
                prediction, errors = shared
            else:
                prediction, errors, loss = self.steerer.distill(self._plan(g, x.shape[0]), x, y)
                if loss is not None:
                    stats.add_loss(g.key, float(loss.mean()))
                stats.port_hits += x.shape[0]
            if not first:  # this step's inputs were the tokens sampled last step
                events += g.stream.novelties(g.alive, errors.tolist())
            plan = self._plan(g, rows)
            # the prompt's last position serves every sample's first token
            scaled = self.steerer.filter(plan, logits.float().expand(rows, -1).clone())
            final, counts = self.steerer.mix_at_candidates(plan, scaled, prediction.expand(rows, -1), self.lm_head)
            stats.candidates.append(float(counts.float().mean()))
        else:
            if not first:
                events += g.stream.novelties(g.alive, None)

            def per_row(value):
                return torch.full((rows,), value, device=logits.device)

            scaled = iv.scale_logits(logits, per_row(s.temperature)).expand(rows, -1)
            mask = iv.candidate_mask(scaled, per_row(s.top_k), per_row(s.top_p), per_row(s.min_p))
            final = iv.filtered_logits(scaled, mask)
        tokens = iv.sample(final, torch.full((rows,), s.temperature == 0), g.generator)

        if first:
            g.cache.batch_repeat_interleave(rows)
        g.steps += 1
        keep: list[int] = []
        for row, (sample, token) in enumerate(zip(g.alive, tokens.tolist())):
            stats.tokens += 1
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
        stats.rows += rows
        return events

    def step(self) -> list[Event]:
        """Advance every running group by one token."""
        stats = StepStats()
        fed: dict[str, tuple] = {}  # group → its forward's (logits, x, y)

        def forward(g: _RefGroup) -> list[Event]:
            fed[g.key] = self._forward(g)
            return []

        events = self._each_group(forward)
        shared: dict[str, tuple] = {}
        if self.bank.shared:
            events += self._distill_shared(fed, shared, stats)
        return events + self._advance_groups(lambda g: self._step_group(g, fed[g.key], shared.get(g.key), stats), stats)
