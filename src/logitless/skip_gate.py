"""Whether the default skipping pays for a head: decided from the skip plans of its earlier calls, never by a host sync.

The skipping backward (skip_threshold="auto", the default) pays where a trained model's softmax leaves whole tiles
cold, and costs where nothing is cold (a head at initialisation, a flat softmax): there it gives up the dense
plans' stash, row chunks and cuBLAS products for Triton products over a plan that skips nothing
(docs/design/skipping.md). Which one a call faces is a property of the data, known only on the device after the
forward. So each head keeps a small record here, known by its weight's shape, dtype and device (not its storage:
under autocast the head gets a fresh cast of its weight at every call, wherever the allocator puts it; two heads of
one shape that both train share a record, which only merges their measurements):

- a call asks ``decide(weight)`` on the host, before its forward (under torch.compile, in the backward op, where
  the host code runs at every call and a decision never reaches the compiled graph);
- a call that skips hands its plan's pair map to ``observe``, which starts an asynchronous copy of its hot pair
  count into pinned host memory (one tensor per head) and records an event; a later ``decide`` reads the skipped
  share from it once that event has completed (``Event.query``, which never waits) and keeps skipping while the
  share is at least the break-even share of the dense plan the call would run instead (``Tuning.skip_min_share``,
  ``skip_min_share_row_chunks``);
- a head found dense runs the dense plans and probes again (one skipping call) after ``skip_probe_every`` calls,
  the interval doubling after each dense finding up to ``skip_probe_max``: a softmax that sharpens as training goes
  on is found within that many calls, and a flat one pays one skipping call in every ``skip_probe_max`` at most.

The first call of a head runs the dense plans and the second probes: a head called once (a test, an evaluation
with gradients) is not worth a plan. Nothing here synchronises with the device; while a CUDA graph is being captured
the record is only read (a captured graph replays the plan it captured). Records are per process and per head, the
most recent ``_MAX_HEADS`` kept.
"""

from __future__ import annotations

import collections
import threading

import torch

from .kernels import current_tuning

_MAX_HEADS = 64


class _Record:
    __slots__ = ("skip", "calls", "interval", "findings", "pending", "event", "share", "min_share", "pairs", "host",
                 "done")

    def __init__(self):
        self.skip = False  # the first call runs dense (one call alone is not worth a plan), the second probes
        self.calls = 0  # calls since the last probe, while dense
        self.interval = 2  # calls between probes while dense
        self.findings = 0  # dense findings in a row
        self.pending = None  # a 0-d int32 host tensor being filled with a plan's hot pair count, or None
        self.event = None  # the event after that copy (None on the CPU: the value is there already)
        self.pairs = 0  # the pairs of that plan
        self.host = None  # the pinned tensor the copies land in and their event, made once per record (an
        self.done = None  # allocation and an event per call cost the host more than the copy)
        self.share = None  # the last skipped share read
        self.min_share = 0.0  # the share from which skipping pays, from the last decide()

    def poll(self) -> None:
        if self.pending is None or (self.event is not None and not self.event.query()):
            return
        share = self.share = 1.0 - int(self.pending) / self.pairs  # a host tensor whose copy has completed: no wait
        self.pending = self.event = None
        tune = current_tuning()
        if share >= self.min_share:
            self.skip, self.findings = True, 0
        else:
            self.skip, self.calls = False, 0
            self.interval = min(tune.skip_probe_every << min(self.findings, 30), tune.skip_probe_max)
            self.findings += 1


_records: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def _key(weight: torch.Tensor, dtype: torch.dtype | None = None):
    return (weight.device, tuple(weight.shape), dtype or weight.dtype)


def _capturing(weight: torch.Tensor) -> bool:
    return weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def decide(weight: torch.Tensor, min_share: float) -> bool:
    """Whether this call of the head whose weight is `weight` runs the skipping plan (one call, one decision);
    min_share: the skipped share from which skipping pays against the dense plan this call would run instead."""
    with _lock:
        rec = _records.get(_key(weight))
        if rec is None:
            rec = _records[_key(weight)] = _Record()
            while len(_records) > _MAX_HEADS:
                _records.popitem(last=False)
        else:
            _records.move_to_end(_key(weight))
        if min_share <= 0.0:
            return True  # skipping wherever a plan is possible, from the first call (tests, A/B runs)
        if _capturing(weight):
            return rec.skip
        rec.min_share = min_share
        rec.poll()
        if rec.skip:
            return True
        rec.calls += 1
        if rec.calls >= rec.interval:
            rec.calls = 0
            return True  # a probe
        return False


def observe(weight: torch.Tensor, plan) -> None:
    """Record the skipped share of a skip plan (kernels/linear_head/skip_plans.SkipPlan: its hot pair count, of its
    pair map's pairs) for the head, without waiting for it: an asynchronous copy to the host, read by a later
    decide()."""
    if plan.hot.numel() == 0 or _capturing(weight):
        return
    count = plan.pairs[-1]
    with _lock:
        rec = _records.get(_key(weight))
        if rec is None:
            return
        rec.pairs = plan.hot.numel()
        if count.device.type == "cpu":
            rec.pending, rec.event = count, None
            return
        if rec.host is None:
            rec.host = torch.empty((), dtype=count.dtype, pin_memory=True)
            rec.done = torch.cuda.Event()
        # A copy still in flight may be overtaken: poll() reads the latest one, after its event.
        rec.host.copy_(count, non_blocking=True)
        rec.done.record()
        rec.pending, rec.event = rec.host, rec.done


def state(weight: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """"skip", "dense" or None (never seen) for the head of `weight` (run in `dtype`, e.g. autocast's; None: the
    weight's own), after reading any finished measurement: for tests and tools (on the GPU, a measurement still in
    flight is not waited for)."""
    with _lock:
        rec = _records.get(_key(weight, dtype))
        if rec is None:
            return None
        rec.poll()
        return "skip" if rec.skip else "dense"


def last_share(weight: torch.Tensor, dtype: torch.dtype | None = None) -> float | None:
    """The skipped share of the head's last plan that has been read (after state()'s poll), or None: for the
    benchmarks' tables."""
    with _lock:
        rec = _records.get(_key(weight, dtype))
        if rec is None:
            return None
        rec.poll()
        return rec.share


def forget() -> None:
    """Drop every record (tests; a new process starts empty)."""
    with _lock:
        _records.clear()
