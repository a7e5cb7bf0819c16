"""Step records: what the processor reports per steered step, read back without waiting on the GPU.

A record says, for every steered row of one engine step, which (group, sample, generation index)
it was and its Distiller error (the novelty of the token that was the row's input) and candidate
count, plus each training group's loss. A step packs its device values into one row of a small
ring on the device (``stage``, or ``stage_parts`` in one launch on a GPU: a device counter names
the row, so a step captured as a CUDA graph stages its values itself, with no call of its own on
the host), and the host notes which row is
whose (``push_staged``, in the same order). Every ``MARK_EVERY`` steps the ring's new rows leave
for the host in one non-blocking copy marked by one CUDA event (a reader copies whatever is left
when it reads); a record is handed out only once its copy has finished, so reading never stalls
the GPU. Python tuples are built when records are read, not on the step path.

Records are kept until a reader takes them: the library engine drains every record; a server
keeps them only for groups that asked (``esamp_records``) and drops what nobody read some time
after its group ended (``RETAIN_SECONDS`` unless the server sets ``records_retain_s``), counting
what it dropped, whether or not anyone reads: the engine checks every second while it steps, and
every metrics scrape checks too. Readers may take the
records of some groups only: taking one group's leaves every other group's in place.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from esamp.core.backends import streams, triton_records

RETAIN_SECONDS = 300.0
LossOwner = str | tuple[str, ...] | None  # whose a packed loss is: a group, several, or nobody's
MAX_READY = 8192  # step records kept unread at most; beyond, the oldest go (counted as dropped)
COLLECT_AFTER = 64  # records waiting before a step turns the oldest into plain ones itself
MARK_EVERY = 8  # staged steps that one copy to the host takes, marked by one CUDA event (a reader copies the rest)
RING_ROWS = 4 * MARK_EVERY  # device rows staged values wait in for their copy (≥ MARK_EVERY: never overwritten first)
RING_WIDTH = 1024  # a ring row's values unless the engine sizes it (``EngineSteering``: its longest packed step)
WAIT_POLL_SECONDS = 5e-5  # how often a reader that waits for the copies in flight looks again (``settle``)


@dataclass(slots=True)
class _Step:
    step: int
    groups: list[str]  # per row
    samples: list[int]
    generated: list[int]  # tokens each row's request had generated before this step
    loss_groups: list[LossOwner]  # per packed loss, whose it is (``push``)
    keep: set[str] | None  # groups whose rows are kept (None: all)
    numel: int  # its packed values: errors [width] | candidates [width] | losses [len(loss_groups)]
    time: float
    width: int  # where the candidate counts start (≥ the rows: a padded step packs its whole bucket)
    event: object = None  # CUDA event after its copy, UNMARKED while staged only, or None (on the host)
    host: torch.Tensor | None = None  # its row of the host copy (at least ``numel`` values), once copied
    batch: list | None = None  # [host buffer, records of it not yet collected] (the buffer's reuse)


UNMARKED = object()  # a record still only in the device ring (``RecordStore._flush`` copies it)


class RecordStore:
    def __init__(self, device: torch.device, retain_seconds: float = RETAIN_SECONDS, width: int = RING_WIDTH) -> None:
        self.device = device
        self.retain_seconds = retain_seconds
        self.width = width  # a ring row's values: the longest packed step
        self._in_flight: collections.deque[_Step] = collections.deque()
        self._ready: collections.deque[dict] = collections.deque()  # step records, oldest first
        self._lock = threading.Lock()  # a server's side channel reads from another thread
        self.dropped = 0
        self.loss: float | None = None  # moving mean of the training groups' losses (for operators)
        self._owners_seen: tuple | None = None  # ``_loss_layout``'s last list of owners and its layout
        self._cuda = device.type == "cuda"  # host copies pinned and marked by events (else done at once)
        # The device ring (made once: captured steps write into it) and the row its next ``stage``
        # writes, a device counter. The host counts the rows copied so far; staged records not
        # yet copied wait in ``_staged`` (the rows after those copied, in order).
        with torch.inference_mode(False):
            self._ring = torch.zeros(RING_ROWS, width, dtype=torch.float32, device=device)
            self._ring_at = torch.zeros(1, dtype=torch.long, device=device)
        self._flushed = 0
        self._staged: list[_Step] = []
        self._buffers: list[torch.Tensor] = []  # host buffers of MARK_EVERY ring rows, free for a copy
        self._copies = None  # the stream the staged values were written on
        self._index: int | None = None  # the CUDA device's index (at the first push)

    @staticmethod
    def pack(errors: torch.Tensor, candidates: torch.Tensor, losses: torch.Tensor | None) -> torch.Tensor:
        """One device tensor: errors | candidate counts (exact in fp32: a vocabulary < 2²⁴) | losses."""
        parts = [errors.float(), candidates.float()]
        if losses is not None:
            parts.append(losses.float())
        return torch.cat(parts)

    def stage(self, packed: torch.Tensor) -> None:
        """Write one step's ``pack``ed values into the ring's next row, on the device alone (a step
        captured as a CUDA graph stages its values inside it); the step's ``push_staged`` must
        follow, once for each ``stage``, in the same order."""
        n = self._fits(packed.numel())
        self._ring[:, :n].index_copy_(0, self._ring_at, packed.view(1, n))
        self._ring_at.add_(1).remainder_(RING_ROWS)

    def stage_parts(self, errors: torch.Tensor, candidates: torch.Tensor, losses: torch.Tensor | None) -> int:
        """``stage`` the ``pack`` of these values, in one launch where Triton runs
        (``triton_records``); returns how many values were staged (``push_staged``'s ``numel``)."""
        n = errors.numel() + candidates.numel() + (0 if losses is None else losses.numel())
        if not triton_records.usable(self._ring, errors, candidates, losses):
            self.stage(self.pack(errors, candidates, losses))
            return n
        self._fits(n)
        triton_records.stage(self._ring, self._ring_at, errors, candidates, losses)
        return n

    def _fits(self, n: int) -> int:
        if n > self.width:
            raise ValueError(f"a step record of {n} values; the record ring holds {self.width} a step")
        return n

    def restart(self) -> None:
        """Forget rows staged without a record (an engine's captures before its first request run
        each step once, eagerly): the next ``stage`` writes the ring's first row again. Records
        staged before are copied first."""
        with self._lock:
            self._flush()
            self._ring_at.zero_()
            self._flushed = 0

    def push(
        self,
        step: int,
        groups: list[str],
        samples: list[int],
        generated: list[int],
        packed: torch.Tensor,
        loss_groups: list[LossOwner],
        keep: set[str] | None = None,
        width: int | None = None,
    ) -> None:
        """``stage`` one step's ``pack``ed values, then ``push_staged`` its record."""
        self.stage(packed)
        self.push_staged(step, groups, samples, generated, packed.numel(), loss_groups, keep, width)

    def push_staged(
        self,
        step: int,
        groups: list[str],
        samples: list[int],
        generated: list[int],
        numel: int,
        loss_groups: list[LossOwner],
        keep: set[str] | None = None,
        width: int | None = None,
    ) -> None:
        """Queue one step's record (of the ``keep`` groups' rows, or all) whose ``numel`` packed
        values the step ``stage``d; ``loss_groups``: per packed loss, the group whose loss it is,
        several groups (the shared Distiller's one loss is each training group's), or None (a unit
        that did not train); ``width``: how many errors and counts were packed, where that is more
        than the rows (the first of each are the rows'). Every ``MARK_EVERY`` records the staged
        values start their copy to the host (queued on the stream they were written on)."""
        record = _Step(
            step,
            groups,
            samples,
            generated,
            loss_groups,
            keep,
            numel,
            time.monotonic(),
            len(groups) if width is None else width,
            UNMARKED,
        )
        stream = None
        if self._cuda:
            if self._index is None:
                self._index = streams.index_of(self.device)
            stream = streams.current(self._index)
        with self._lock:
            if stream is not self._copies:
                self._flush()  # (the rows staged on the stream before: copied there, after their writes)
                self._copies = stream
            self._in_flight.append(record)
            self._staged.append(record)
            if len(self._staged) >= MARK_EVERY:
                self._flush()
            if len(self._in_flight) > COLLECT_AFTER:
                self._collect()  # nobody is reading (a server): keep what waits bounded

    def _flush(self) -> None:
        """Copy the staged records' ring rows to the host, one copy (two where the ring wraps) on
        the stream that wrote them, marked by one CUDA event (under the lock; from any thread)."""
        staged = self._staged
        if not staged:
            return
        k, start = len(staged), self._flushed % RING_ROWS
        ring = self._ring
        host = (
            self._buffers.pop()
            if self._buffers
            else torch.empty(MARK_EVERY, self.width, dtype=torch.float32, pin_memory=self._cuda)
        )
        here = streams.current(self._index) if self._cuda else None
        if here is not self._copies:
            streams.switch(self._copies)  # a reader's thread: its own current stream is another
        try:
            # A buffer made on the engine's thread (under vLLM's inference mode) is an inference
            # tensor, which a reader's thread may write into only under inference mode too.
            with torch.inference_mode():
                first = min(k, RING_ROWS - start)
                host[:first].copy_(ring[start : start + first], non_blocking=self._cuda)
                if first < k:
                    host[first:k].copy_(ring[: k - first], non_blocking=self._cuda)
            event = None  # (on the host: the copy is done when it returns)
            if self._cuda:
                event = torch.cuda.Event()
                streams.record(event, self._copies)
        finally:
            if here is not self._copies:
                streams.switch(here)
        batch = [host, k]
        for i, record in enumerate(staged):
            record.host, record.event, record.batch = host[i], event, batch
        self._flushed += k
        staged.clear()

    def _collect(self) -> None:
        """Turn records whose copies have finished into plain step records (under the lock).
        A ready record keeps its rows as columns (group, sample, generated, error, candidates),
        the two the device sent as one array: nothing here is done row by row, since this runs in
        the engine's process, on a step's path or in a reader's thread beside it (whose Python
        work the engine's steps wait for); readers get plain lists (``_public``)."""
        done = None  # the latest event seen finished (the records it marks come one after another)
        while self._in_flight:
            event = self._in_flight[0].event
            if event is UNMARKED or (event is not None and event is not done and not event.query()):
                break
            done = event
            s = self._in_flight.popleft()
            n, w = len(s.groups), s.width
            values = s.host[: s.numel].numpy().copy()  # its host buffer goes back to be copied into again
            s.batch[1] -= 1
            if s.batch[1] == 0:
                self._buffers.append(s.batch[0])
            names, at = self._loss_layout(s.loss_groups)
            losses = values[2 * w :]
            if at.size and at[-1] >= losses.size:  # fewer losses packed than owners: the rest have none
                k = int(np.searchsorted(at, losses.size))
                names, at = names[:k], at[:k]
            loss = dict(zip(names, losses[at].tolist()))
            if loss:
                mean = sum(loss.values()) / len(loss)
                self.loss = mean if self.loss is None else 0.9 * self.loss + 0.1 * mean
            if s.keep is not None and not s.keep:
                continue  # nobody asked for this step's rows
            cols = (s.groups, s.samples, s.generated, values[:n], values[w : w + n])
            if s.keep is not None:
                cols = _select(cols, s.keep.__contains__)
                loss = {g: v for g, v in loss.items() if g in s.keep}
            self._ready.append({"step": s.step, "time": s.time, "cols": cols, "loss": loss})
            if len(self._ready) > MAX_READY:  # a reader that asked for records and never reads
                self.dropped += len(self._ready.popleft()["cols"][0])

    def _loss_layout(self, owners: list[LossOwner]) -> tuple[list[str], np.ndarray]:
        """(each group a step's packed losses belong to, the loss it reads), once per list of
        owners: a plan hands the same list every step (a step that trained nothing, an empty one)."""
        if not owners:
            return [], _NO_LOSSES
        known = self._owners_seen
        if known is None or known[0] is not owners:
            pairs = [(g, i) for i, owner in enumerate(owners) for g in _owners(owner)]
            known = self._owners_seen = (owners, [g for g, _ in pairs], np.array([i for _, i in pairs], dtype=np.intp))
        return known[1], known[2]

    def collect(self) -> None:
        with self._lock:
            self._flush()
            self._collect()

    def settle(self, wait: float) -> bool:
        """Start the copy of every staged record and wait up to ``wait`` seconds for the last copy
        in flight, off the lock and the interpreter (the engine steps on meanwhile); True when every
        copy is done. For a reader with nothing else to do until the records come (the library
        engine once vLLM has no more outputs): one fetch then brings a run's last records, where
        a fetch that answered at once would find their copy only just started."""
        with self._lock:
            self._flush()
            last = self._in_flight[-1].event if self._in_flight else None
        if last is None:  # nothing in flight, or copied on the host (done when it returned)
            return True
        deadline = time.monotonic() + wait
        while not last.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_POLL_SECONDS)
        return True

    def take(
        self, groups: set[str] | None = None, columns: bool = False, plain: bool = True, wait: float = 0.0
    ) -> tuple[list[dict], int]:
        """(finished step records, how many are still copying). With ``groups``, only their rows
        and losses are taken; everything else stays for its own reader. A record's rows come as
        ``rows`` [(group, sample, generated, error, candidates), ...], or with ``columns`` as
        ``columns`` (the five lists; with ``plain`` False the numbers stay arrays, for a reader in
        another process, which turns them into lists there: ``plain_columns``). With ``wait``
        (seconds), the copies in flight get that long to finish first (``settle``)."""
        if wait > 0:
            self.settle(wait)
        with self._lock:
            self._flush()
            self._collect()
            pending = len(self._in_flight)
            if groups is None:
                out, self._ready = list(self._ready), collections.deque()
            else:
                out, keep = [], []
                for rec in self._ready:
                    mine = _select(rec["cols"], groups.__contains__)
                    loss = {g: v for g, v in rec["loss"].items() if g in groups}
                    if mine[0] or loss:
                        out.append({**rec, "cols": mine, "loss": loss})
                    rest = _select(rec["cols"], lambda g: g not in groups)
                    rest_loss = {g: v for g, v in rec["loss"].items() if g not in groups}
                    if rest[0] or rest_loss:
                        keep.append({**rec, "cols": rest, "loss": rest_loss})
                self._ready = collections.deque(keep)
        return [_public(rec, columns, plain) for rec in out], pending

    def expire(self, live: set[str], now: float | None = None) -> None:
        """Drop records of groups no longer ``live`` that nobody read for ``retain_seconds``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._ready or now - self._ready[0]["time"] < self.retain_seconds:
                return
            keep = []
            for rec in self._ready:
                old = now - rec["time"] >= self.retain_seconds
                cols = _select(rec["cols"], live.__contains__) if old else rec["cols"]
                self.dropped += len(rec["cols"][0]) - len(cols[0])
                loss = {g: v for g, v in rec["loss"].items() if not old or g in live}
                if cols[0] or loss:
                    keep.append({**rec, "cols": cols, "loss": loss})
            self._ready = collections.deque(keep)


_NO_LOSSES = np.zeros(0, dtype=np.intp)


def _owners(owner: LossOwner) -> tuple[str, ...]:
    """The groups a packed loss belongs to (``push``'s ``loss_groups`` entry)."""
    if owner is None:
        return ()
    return (owner,) if isinstance(owner, str) else tuple(owner)


def _select(cols: tuple, keep) -> tuple:
    """The columns' rows whose group ``keep(group)`` accepts."""
    picked = [i for i, g in enumerate(cols[0]) if keep(g)]
    if len(picked) == len(cols[0]):
        return cols
    return tuple(c[picked] if isinstance(c, np.ndarray) else [c[i] for i in picked] for c in cols)


COLUMNS = ("groups", "samples", "generated", "errors", "candidates")


def _arrays(cols: tuple) -> tuple:
    """A ready record's columns with its numbers as arrays (candidate counts as integers: exact in
    the float32 they came in, a vocabulary being under 2²⁴)."""
    groups, samples, generated, errors, candidates = cols
    if isinstance(candidates, np.ndarray):
        candidates = candidates.astype(np.int64)
    return groups, samples, generated, errors, candidates


def _plain(cols: tuple) -> tuple[list, ...]:
    """Columns as lists of plain Python values (floats, ints)."""
    return tuple(c.tolist() if isinstance(c, np.ndarray) else c for c in cols)


def plain_columns(columns: dict) -> dict:
    """A record's named columns as ``take(columns=True)`` gives them, from the arrays a reader in
    another process received (``take(..., plain=False)``)."""
    return dict(zip(COLUMNS, _plain(tuple(columns[name] for name in COLUMNS))))


def _public(rec: dict, columns: bool, plain: bool = True) -> dict:
    """A ready record as readers get it: rows, or named columns."""
    out = {"step": rec["step"], "time": rec["time"], "loss": rec["loss"]}
    cols = _arrays(rec["cols"])
    if plain or not columns:
        cols = _plain(cols)
    if columns:
        out["columns"] = dict(zip(COLUMNS, cols))
    else:
        out["rows"] = list(zip(*cols))
    return out
