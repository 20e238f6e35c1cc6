"""The test-only fault hook: ``TPSERVE_TEST_FAULT=RANK:STEP:KIND`` makes one rank fail
(several comma-separated faults act each at its own step and site).

KIND is ``raise`` (a RuntimeError), ``exit`` (``os._exit(3)``) or ``oom`` (a
``torch.OutOfMemoryError``) in the forward of step STEP; ``oom-sample``, the same error when
rank 0 samples step STEP (after its samples were stored for the next step: the latest point
of a step that allocates device memory); ``leakN``: from step STEP on, keep N MiB more
host memory every step (a planted leak for the soak's memory check); or ``start`` (STEP 0):
a RuntimeError while the rank's runner is built; ``sleep`` or ``reload``: a RuntimeError in
the rank's STEP-th level-1 sleep (its host copy) or weight reload (its load), counted from
0 (the control queries a data-parallel replica can fail alone). The variable is read
and parsed once, when the runner is built; with it unset the runner holds None and each
site pays one attribute check per step.

With data parallelism RANK counts every replica's ranks (replica ``r``'s rank ``k`` is
``r x tp + k``, as ``/memory`` numbers them); each engine process rewrites the variable for
its own ranks (``replica_fault_spec``) before it starts them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

FAULT_ENV = "TPSERVE_TEST_FAULT"
KINDS = ("raise", "exit", "oom", "oom-sample", "leakN", "start", "sleep", "reload")
# the sites that call ``FaultHook.fire`` (sleep and reload: ``fire_event``)
FORWARD, SAMPLE, START, SLEEP, RELOAD = "forward", "sample", "start", "sleep", "reload"
EVENTS = (SLEEP, RELOAD)
MiB = 2**20


class _Events:
    """``fire_event`` of a hook or of several: the sleeps and reloads are counted per site
    in ``events`` (a field of each), once for all the hooks."""

    events: dict[str, int]

    def fire(self, step: int, site: str = FORWARD) -> None:
        raise NotImplementedError

    def fire_event(self, site: str) -> None:
        """Called at each sleep (``SLEEP``) or reload (``RELOAD``) of the rank: ``fire``
        with the number of earlier calls at ``site`` as the step."""
        count = self.events.get(site, 0)
        self.events[site] = count + 1
        self.fire(count, site)


@dataclass(frozen=True)
class FaultHook(_Events):
    """One rank's planted fault. ``kept`` holds what a leak keeps (it never shrinks)."""

    step: int
    kind: str
    leak_bytes: int = 0
    kept: list[bytearray] = field(default_factory=list, compare=False, repr=False)
    events: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def site(self) -> str:
        return {"oom-sample": SAMPLE, "start": START, "sleep": SLEEP,
                "reload": RELOAD}.get(self.kind, FORWARD)

    def fire(self, step: int, site: str = FORWARD) -> None:
        """Called at every step by the runner's forward (``FORWARD``) and by rank 0's
        sampling (``SAMPLE``), and once with step 0 when the runner is built (``START``);
        acts at ``self.step`` at its own site (a leak: from then on, in the forward)."""
        if site != self.site:
            return
        if self.leak_bytes:
            if step >= self.step:
                self.kept.append(bytearray(b"\xa5") * self.leak_bytes)  # touched: resident
            return
        if step != self.step:
            return
        if self.kind == "exit":
            os._exit(3)
        if self.kind in ("oom", "oom-sample"):
            raise torch.OutOfMemoryError(f"injected out-of-memory at {site} (test hook)")
        if site == START:
            raise RuntimeError("injected failure at start-up (test hook)")
        if site in EVENTS:
            raise RuntimeError(f"injected failure at {site} {step} (test hook)")
        raise RuntimeError(f"injected failure at step {step} (test hook)")


@dataclass(frozen=True)
class FaultHooks(_Events):
    """Several planted faults of one rank, each acting at its own step and site."""

    hooks: tuple[FaultHook, ...]
    events: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def fire(self, step: int, site: str = FORWARD) -> None:
        for hook in self.hooks:
            hook.fire(step, site)


def parse_fault(spec: str, rank: int) -> FaultHook | FaultHooks | None:
    """The hook(s) for ``rank`` described by ``spec``: None when empty or all for other
    ranks, one ``FaultHook``, or ``FaultHooks`` for several; ValueError naming the variable
    when any part is malformed."""
    if not spec:
        return None
    bad = ValueError(f"{FAULT_ENV}={spec!r}: expected RANK:STEP:KIND (comma-separated for "
                     f"several) with KIND one of {', '.join(KINDS)} (start: STEP 0)")
    hooks = []
    for part in spec.split(","):
        fields = part.split(":")
        if len(fields) != 3 or not fields[0].isdigit() or not fields[1].isdigit():
            raise bad
        kind = fields[2]
        leak_bytes = 0
        if kind.startswith("leak"):
            if not kind[4:].isdigit() or int(kind[4:]) < 1:
                raise bad
            leak_bytes = int(kind[4:]) * MiB
        elif kind not in KINDS or (kind == "start" and fields[1] != "0"):
            raise bad
        if int(fields[0]) == rank:
            hooks.append(FaultHook(int(fields[1]), kind, leak_bytes))
    if not hooks:
        return None
    return hooks[0] if len(hooks) == 1 else FaultHooks(tuple(hooks))


def fault_from_env(rank: int) -> FaultHook | FaultHooks | None:
    """Reads ``TPSERVE_TEST_FAULT`` once (start-up only)."""
    return parse_fault(os.environ.get(FAULT_ENV, ""), rank)


def replica_fault_spec(spec: str, replica: int, tp: int) -> str:
    """``spec`` (ranks counted over every replica) as data-parallel replica ``replica``'s
    ranks ``0..tp-1`` read it: its parts renumbered, the other replicas' dropped.
    ValueError, as ``parse_fault``'s, when any part is malformed (another replica's too)."""
    parse_fault(spec, 0)
    parts = []
    for part in filter(None, spec.split(",")):
        rank, _, rest = part.partition(":")
        if replica * tp <= int(rank) < (replica + 1) * tp:
            parts.append(f"{int(rank) - replica * tp}:{rest}")
    return ",".join(parts)
