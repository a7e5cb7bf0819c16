"""``VllmEngine``: the engine protocol on vLLM, streaming through ``add_request`` + ``step()``.

A group of n samples is n requests (n=1 each) that carry one group key and their sample index
in ``extra_args`` (the flat payload of ``esamp.core.payload``), so the engine knows which sample
each record belongs to; a served request with n > 1 is grouped by the processor instead (see
``settings.prepare``). Each ``step()`` advances vLLM by one engine step (delta outputs: the new
token of every running request), then drains the ESamp processor's step records through
``collective_rpc``.

Events follow the reference engine exactly (``GroupStream``): a token is released one engine
step after it was sampled, with the Distiller error of the step where it was the input; the
bookkeeping that pairs tokens with step records is ``esamp.engines.record_streams``'s.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time

from esamp.core.config import EsampConfig
from esamp.core.distiller import bank_full
from esamp.engines.base import Group, StepStats, stop_token_ids
from esamp.engines.models import resolve, stand_in_tokenizer
from esamp.engines.record_streams import RecordedEngine, RecordedGroup, finish_reason
from esamp.engines.vllm import launch, records_channel, settings as es, versions
from esamp.errors import ConfigError, EngineError
from esamp.events import Event, LoadingEvent
from esamp.platform.devices import cuda_available
from esamp.platform.spawn import check_main_guard

log = logging.getLogger(__name__)

GPU_SHARE = 0.85  # of the GPU's memory an engine takes unless told (vLLM's own default is 0.9)
GPU_SHARE_ENV = "ESAMP_GPU_MEMORY_UTILIZATION"  # the operator's say, for every command at once


# While an engine is open, the heap it started with (vLLM's client, the tokenizer, the modules of
# torch and transformers: some 660,000 objects in a process holding two engines) is frozen out of
# Python's garbage collector, as vLLM freezes its engine core's and its server's after start-up.
# A full collection over it took about 0.27 s on the CPU: a pause of this process's reading of
# outputs and step records and of its starting of requests (the bench saw one ESamp pass in 30
# lose a third of its speed so). The last engine to close thaws it, so that what the engines held
# in reference cycles can be collected.
_open_engines = 0


def _freeze_heap() -> None:
    """An engine started: what lives now is frozen (after the collections that leave only that)."""
    global _open_engines
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
    _open_engines += 1


def _thaw_heap() -> None:
    """An engine closed: collect what it left (the heap thawed for that), and freeze the rest
    again while other engines are open."""
    global _open_engines
    _open_engines = max(0, _open_engines - 1)
    gc.unfreeze()
    gc.collect()
    if _open_engines:
        gc.freeze()


def gpu_share(given: float | None) -> float:
    """The share of GPU memory an engine takes: as given, else ``ESAMP_GPU_MEMORY_UTILIZATION``,
    else ``GPU_SHARE`` (a clear error for a value outside (0, 1))."""
    if given is not None:
        return given
    raw = os.environ.get(GPU_SHARE_ENV)
    if raw is None:
        return GPU_SHARE
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0 < share < 1:
        raise ConfigError(
            f"{GPU_SHARE_ENV}={raw!r}: a share of the GPU's memory is between 0 and 1",
            hint=f"e.g. {GPU_SHARE_ENV}=0.5 to leave half the GPU to other programs",
        )
    return share


def _release_cached_gpu_memory() -> None:
    """Hand what PyTorch's allocator cached in this process back to the device (an in-process
    engine's memory), where CUDA is already in use here; never starts CUDA."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass


# How often the library engine fetches the processor's step records while vLLM is busy. A fetch is
# one ``collective_rpc`` round trip, answered only between two engine steps, so this process waits
# about a step for it. Every DRAIN_STEPS output batches (engine steps), never sooner than
# DRAIN_MIN_SECONDS nor later than DRAIN_MAX_SECONDS after the last: a token waits for its novelty
# about as long as the dashboard gathers its events when busy, and on a GPU (7B steps of ~12 ms)
# this process waits on one fetch in 16 steps instead of one in two (a fixed 25 ms did that).
DRAIN_STEPS = 16
DRAIN_MIN_SECONDS = 0.025
DRAIN_MAX_SECONDS = 0.25
# A fetch made when vLLM brought no outputs (the run's last records, or a step not back yet) lets the
# worker wait this long for the records' copies in flight: the copy of a run's last steps starts at
# the fetch itself, so a fetch that answered at once would come back without them, and this process
# would ask again after a pause (a round trip more at the end of every run).
DRAIN_WAIT_SECONDS = 0.02


class VllmEngine(RecordedEngine):
    name = "vllm"

    def __init__(
        self,
        model: str | None = None,
        esamp: EsampConfig | None = None,
        *,
        plain: bool = False,
        dtype: str | None = None,
        tokenizer: str | None = None,
        enforce_eager: bool | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int = 256,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        gguf: str = "convert",
        llm_kwargs: dict | None = None,
        progress=None,
    ) -> None:
        """``max_model_len``: the context, by default ``launch.MAX_MODEL_LEN`` or the model's own
        if that is shorter. ``plain``: vLLM without ESamp (its own model class, no additional config), the
        baseline of ``esamp bench``. ``gguf``: "convert" loads the cached bf16 HF directory of a
        GGUF model, "native" lets vLLM read the GGUF itself. ``tensor_parallel_size``: vLLM's
        workers per engine (TP rank 0 owns the Distiller and shares ŷ: ``esamp.engines.vllm.tp``).
        ``progress``: hears how the start goes (a hub model's download, a first conversion, the
        load), as ``LoadingEvent``s. A random-weight preset reads and writes text through the
        embedded model's tokenizer (``models.StandInTokenizer``)."""
        super().__init__(esamp)
        cuda = cuda_available()
        tensor_parallel_size = int((llm_kwargs or {}).get("tensor_parallel_size", tensor_parallel_size))
        if tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size={tensor_parallel_size}: at least 1 worker",
                hint="e.g. tensor_parallel_size=2 for a model split over two GPUs",
            )
        workers_env = launch.parallel_env(tensor_parallel_size, cuda=cuda)  # before cpu_env fills in
        if cuda:
            workers_env.update(launch.cuda_env())
        if launch.spawns(tensor_parallel_size, workers_env):
            check_main_guard(f"a vLLM engine (vLLM starts its processes with {launch.start_method(workers_env)})")
        if not cuda:
            for key, value in launch.cpu_env().items():
                os.environ.setdefault(key, value)
        versions.check()  # an unsupported vLLM is refused here, with the supported range
        try:
            from vllm import LLM
        except ImportError as exc:
            raise EngineError(f"vLLM could not be imported: {exc}", hint=versions.INSTALL_HINT) from None
        from esamp.engines.vllm import plugin

        plugin.register()  # in-process; the entry point does the same in spawned processes
        self.plain = plain
        self._last_drain = 0.0
        self._batches_since_drain = 0
        self._records_owed = False  # outputs came whose steps' records no fetch has brought back yet
        self._channel = None  # the records channel (``_records_channel``)
        self._channel_asked = False
        self.drains = 0  # record fetches, and the wall time this process spent in them
        self.drain_seconds = 0.0
        self.last_output_at: float | None = None  # when a step last brought vLLM outputs (perf_counter)
        self.resolved = resolve(model, progress)
        facts = launch.model_facts(
            self.resolved, gguf=gguf, dtype=dtype, tokenizer=tokenizer, progress=progress, cuda=cuda
        )
        stand_in = stand_in_tokenizer(progress) if facts.dummy else None
        config_dir = facts.config_dir
        self.num_layers, self.hidden = facts.num_layers, facts.hidden_size
        max_model_len = launch.context(facts, max_model_len)
        self.context = max_model_len
        kwargs: dict = dict(
            launch.engine_args(facts, None if plain else self.esamp, cuda=cuda),
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
        )
        if cuda:
            kwargs["gpu_memory_utilization"] = gpu_share(gpu_memory_utilization)
        if enforce_eager is not None:
            kwargs["enforce_eager"] = enforce_eager
        kwargs.update(llm_kwargs or {})
        if not launch.SCHEDULING.intersection(llm_kwargs or {}):  # the caller's scheduling stands
            kwargs.update(launch.scheduling(kwargs["max_model_len"], cuda=cuda))
        # ESamp's logits processor reaches this engine, and no other, through an entry point
        # only the processes of this engine see (plugin.processor_scope).
        scope = contextlib.nullcontext() if plain else plugin.processor_scope()
        if progress is not None:
            progress(
                LoadingEvent(
                    stage="load",
                    text=f"vLLM is loading {self.resolved.name}"
                    + (" and capturing CUDA graphs" if cuda and not kwargs.get("enforce_eager") else ""),
                )
            )
        try:
            with scope, launch.environment(workers_env):
                self.llm = LLM(**kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise EngineError(
                f"vLLM could not load {self.resolved.name}: {exc}",
                hint="check the model path, --dtype and free GPU memory",
            ) from exc
        self.engine = self.llm.llm_engine
        self.tokenizer = stand_in if facts.dummy else self.llm.get_tokenizer()
        self.stop_ids = set() if facts.dummy else stop_token_ids(config_dir, self.tokenizer)
        self.by_request: dict[str, tuple[str, int]] = {}
        self.release: list[str] = []
        # Time to first token: seconds from a group's start to the first token vLLM sampled for it.
        self._admitted: dict[str, float] = {}
        self.first_token_seconds: list[float] = []
        self.counters: dict = {}
        self.free_slots = self.esamp.slots
        self.model_name, self.device_name = self.resolved.name, "cuda" if cuda else "cpu"
        self._loaded()
        _freeze_heap()
        self._frozen = True

    # -- admission ---------------------------------------------------------------------------

    def _admit(self, group: Group) -> RecordedGroup:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        steered = group.steered and not self.plain
        if steered and sum(1 for g in self.groups.values() if g.steered) >= self.esamp.slots:
            raise bank_full(self.esamp.slots, self.esamp.shared_distiller)
        g = RecordedGroup(**{**vars(group), "steering": group.steering.model_copy(update={"enabled": steered})})
        s = g.sampling
        g.arrived = [[] for _ in range(s.n)]
        g.fed = [0] * s.n
        self._admitted[g.key] = time.perf_counter()
        # vLLM's renderer turns token ids into engine inputs (raw prompts are deprecated there).
        prompts = self.engine.renderer.render_cmpl([{"prompt_token_ids": g.prompt_ids} for _ in range(s.n)])
        for sample in range(s.n):
            params = SamplingParams(
                n=1,
                max_tokens=g.max_new,
                seed=None if s.seed is None else s.seed + sample,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                min_p=s.min_p,
                # The group's ignore_eos, as its stream (``GroupStream``) reads it; vLLM stops on a
                # listed stop token whatever ignore_eos says, so a group that ignores EOS lists none.
                stop_token_ids=[] if s.ignore_eos else sorted(self.stop_ids),
                ignore_eos=s.ignore_eos,
                # vLLM matches stop strings in its own text, so it decodes only for them; the
                # events' text is this process's (``GroupStream`` cuts it at the same place).
                stop=list(s.stop),
                output_kind=RequestOutputKind.DELTA,
                detokenize=bool(s.stop),
            )
            if steered:
                # The group's settings go to prepare typed (nothing is encoded to be decoded again);
                # it writes the flat payload and hands the request's filters to ESamp, as for a
                # served request. vLLM's frontend, which runs the processor's validate_params too
                # where the entry point was visible when it first loaded the processors, then finds
                # the params prepared.
                es.prepare(params, settings=es.request_settings(g.key, sample, g.steering))
            rid = f"{g.key}/{sample}"
            internal = self.engine.add_request(rid, prompts[sample], params)
            for name in {rid, internal if isinstance(internal, str) else rid}:
                self.by_request[name] = (g.key, sample)
            g.request_ids.append(internal if isinstance(internal, str) else rid)
        return g

    def _forget_requests(self, g: RecordedGroup) -> None:
        self._admitted.pop(g.key, None)
        for sample, internal in enumerate(g.request_ids):
            self.by_request.pop(internal, None)
            self.by_request.pop(f"{g.key}/{sample}", None)

    def _cancel(self, g: RecordedGroup) -> None:
        self._forget_requests(g)
        unfinished = [rid for s, rid in enumerate(g.request_ids) if s not in g.final]
        if unfinished:
            self.engine.abort_request(unfinished)

    def _release(self, g: RecordedGroup) -> None:
        self._forget_requests(g)
        if g.steered:
            self.release.append(g.key)

    def _shutdown(self) -> None:
        if getattr(self, "llm", None) is not None:
            try:
                self.drain()
            except Exception:
                pass
            if self._channel is not None:
                self._channel.close()  # the worker's reader thread ends with it
                self._channel = None
            # The engine core's own shutdown: it stops its processes, and an in-process core
            # (VLLM_ENABLE_V1_MULTIPROCESSING=0) undoes the gc.freeze() of its start, without
            # which its weights and KV cache would never be collected.
            core = getattr(self.engine, "engine_core", None)
            try:
                if core is not None:
                    core.shutdown()
            except Exception:
                pass
            del self.engine
            self.llm = None
            if getattr(self, "_frozen", False):
                self._frozen = False
                _thaw_heap()
            else:
                gc.collect()
            _release_cached_gpu_memory()

    # -- the loop ----------------------------------------------------------------------------

    def drain(self, wait: float = 0.0) -> dict:
        """Step records and counters from the engine process (and release finished groups);
        ``wait``: seconds the records channel's worker may wait for the copies in flight first
        (the RPC path, answered between engine steps, does not wait)."""
        if self.plain:
            return {"steps": [], "counters": {}}
        release, self.release = self.release, []
        t0 = time.perf_counter()
        channel = self._records_channel()
        if channel is None:
            out = self.engine.collective_rpc("esamp_drain", args=(release, None, True))[0]  # rows as columns
        else:
            if release:  # every worker's ledger frees the groups (the channel is rank 0's)
                self.engine.collective_rpc("esamp_release", args=(release,))
            out = records_channel.receive(channel, wait)
        self.drains += 1
        self.drain_seconds += time.perf_counter() - t0
        self.counters = out.get("counters", {})
        self.free_slots = out.get("free_slots", self.free_slots)
        return out

    def _records_channel(self):
        """The records channel of the worker that keeps them (asked for once), or None: records
        then come through ``collective_rpc`` (``records_channel`` says why a channel)."""
        if self._channel_asked:
            return self._channel
        self._channel_asked = True
        try:
            answer = self.engine.collective_rpc("esamp_records_channel")[0]
        except Exception as exc:  # an extension without the method: the RPC path serves
            log.warning("ESamp: no records channel (%s); fetching records through vLLM's RPC", exc)
            answer = None
        self._channel = records_channel.connect(answer)
        return self._channel

    def drain_due(self, since: float) -> bool:
        """Whether to fetch records now, ``since`` seconds after the last fetch, vLLM busy."""
        if since < DRAIN_MIN_SECONDS:
            return False
        return self._batches_since_drain >= DRAIN_STEPS or since >= DRAIN_MAX_SECONDS

    def info(self) -> dict:
        return self.engine.collective_rpc("esamp_info")[0]

    def workers(self, method: str = "esamp_info", *args) -> list:
        """A worker extension method's answer from every tensor-parallel worker, in rank order
        (``drain`` and ``info`` read rank 0, which owns the Distiller and its records)."""
        return self.engine.collective_rpc(method, args=args)

    def step(self) -> list[Event]:
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        tokens = 0
        where_is, group_of, admitted = self.by_request.get, self.groups.get, self._admitted
        for out in outputs:  # every running request's, every step: the lookups are hoisted
            where = where_is(out.request_id)
            g = None if where is None else group_of(where[0])
            if g is None:
                continue
            sample = where[1]
            for c in out.outputs:
                ids = c.token_ids
                g.arrived[sample].extend(ids)
                tokens += len(ids)
                if admitted and ids and g.key in admitted:
                    self.first_token_seconds.append(time.perf_counter() - admitted.pop(g.key))
                if c.finish_reason is not None or out.finished:
                    g.final[sample] = finish_reason(c.finish_reason)
            if out.finished and sample not in g.final:
                g.final[sample] = "stop"
        stats = StepStats(tokens=tokens, rows=tokens)
        steering = any(g.steered for g in self.groups.values())
        now = time.perf_counter()
        # One round trip to the engine process per drain: batch engine steps per drain while vLLM
        # is busy (``drain_due``); at once when it produced nothing (the run's last records). Only
        # while records are owed: before the first output (prompts still prefilling) and after a
        # fetch found every record back with no output since, a fetch brings nothing, and its
        # answer takes the engine process's interpreter from the steps (a thread there serves it).
        if outputs:
            self.last_output_at = now
            self._batches_since_drain += 1
            self._records_owed = True
        all_back = not self._records_owed  # every step that produced the outputs seen so far reported back
        due = self._records_owed and (not outputs or self.drain_due(now - self._last_drain))
        if self.release or (steering and due):
            self._last_drain = now
            self._batches_since_drain = 0
            drained = self.drain(0.0 if outputs else DRAIN_WAIT_SECONDS)
            for rec in drained["steps"]:
                self._file(rec, stats)
            all_back = drained.get("pending", 0) == 0
            self._records_owed = not all_back
            if steering and not drained["steps"] and not outputs:
                time.sleep(0.0005)  # records still on their way back from the device
        elif not outputs:
            time.sleep(0.001)
        return self._advance_groups(lambda g: self._advance(g, all_back), stats)
