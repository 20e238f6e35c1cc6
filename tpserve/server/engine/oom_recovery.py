"""What the engine does after a step ran out of device memory at tp 1 (``EngineCore``'s
``_launch`` returned None): preempt, release the allocator's cache, hold the budget.

The failed step was launched as one unit (forward, logits, grammar bitmask, sampling, the
copy of the samples to the host) and is dropped whole: ``scheduler.update`` never ran for
it, so no sequence advanced, got a placeholder or cached a block from it; the blocks it
allocated stay with their sequences and are written again by the step that computes those
tokens. Before ``recover_from_oom`` runs, the engine reads back the previous step (launched
before, complete on the stream), so no placeholder is left and no later step reads the
runner's sampled buffer, which the failed step may have overwritten: the next
``store_sampled`` refills it before any step names it again.

At tp > 1 there is no recovery: ``_launch`` re-raises and the engine fails. Rank 0 may have
run out of memory partway through the forward, after its workers entered collectives it
will never issue, so the ranks are no longer in step and cannot be recovered in place. (A
failure in sampling, after every collective, would be; it is not distinguished yet.)
"""

from __future__ import annotations

import logging

import torch

from tpserve.server.engine.scheduler import Scheduler
from tpserve.server.engine.token_budget import TokenBudget

logger = logging.getLogger(__name__)


def recover_from_oom(scheduler: Scheduler, budget: TokenBudget, device: torch.device,
                     counters: dict, failed_tokens: int) -> None:
    """After a dropped step of ``failed_tokens`` tokens (the previous step already read
    back): the newest half of the running sequences is preempted (their blocks return to
    the pool), the allocator's cache is released, and the budget is held (``OomHold``)
    until free-memory readings show room. Counts the preemptions and the recovery."""
    victims = scheduler.preempt_newest(0.5)
    counters["num_preemptions_total"] += len(victims)
    counters["oom_recoveries_total"] += 1
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget.after_oom(failed_tokens)
    logger.warning("a step of %d tokens ran out of device memory: preempted %d "
                   "sequences; token budget %d until free memory reaches %d bytes "
                   "(now %d)", failed_tokens, len(victims), budget.budget, budget.hold.room,
                   budget.free)
