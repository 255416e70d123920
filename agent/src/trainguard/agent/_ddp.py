"""Gradient averaging whose result does not depend on how DDP buckets the gradients.

**Why.** ``DistributedDataParallel`` averages gradients bucket by bucket with an all-reduce,
whose sum order for an element depends on where the element sits in its bucket: gloo's ring
all-reduce (and NCCL's) splits a bucket into one chunk per rank and starts each chunk's sum at
a different rank. DDP lays the buckets out in reverse parameter order at construction, and
after the first iteration rebuilds them in the order the gradients became ready
(``Reducer::rebuild_buckets``). A process restarted from a checkpoint therefore runs its first
step with the construction layout where the uninterrupted run used the rebuilt one: each
element is summed in another order. With two ranks that changes nothing (``a + b == b + a``
exactly); with three or more, floating-point addition is not associative and the parameters
differ in their last bits from the first step after the restore on (measured on
``examples/charlm`` with 3 and 4 ranks: the first checkpoint after a restart differs).

**What.** :func:`ordered_allreduce_hook` is a DDP communication hook that gathers every rank's
bucket (``all_gather_into_tensor``, ``all_gather_single`` since torch 2.13) and adds them up element-wise in rank order,
``((g_0 + g_1) + g_2) + ...``, then divides by the world size. Each element's sum is then the
same whatever the bucket layout, the collective's algorithm or the number of buckets, so a
restored run reproduces the uninterrupted one bit for bit at any world size. It moves
``world_size`` times the bucket instead of the ring's ``2 (w - 1) / w``; the cost on
``examples/charlm`` is in ``bench/RESULTS.md``. :func:`ordered_allreduce` registers it on a
DDP model and records that it did, which :meth:`trainguard.agent.Agent.watch` checks.

Alternatives, and why not: ``find_unused_parameters=True`` happens to keep the construction
layout (torch skips the rebuild then) at the price of a graph traversal per step, and relies
on that implementation detail; ``static_graph=True`` still rebuilds after the first iteration;
a bigger ``bucket_cap_mb`` does not fix the order within a bucket.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook checks the hook's
# annotations at runtime (``bucket`` must be annotated with the GradBucket class itself, the
# return with ``torch.futures.Future[torch.Tensor]``), which postponed annotations turn into
# strings.

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, as the type stubs know it
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "average_in_rank_order",
    "averages_in_fixed_order",
    "ordered_allreduce",
    "ordered_allreduce_hook",
]

_ALL_GATHER: Any = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
"""``all_gather_into_tensor`` under its torch 2.13 name (the old one is deprecated there; this
package supports torch >= 2.4)."""

_ORDERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Modules (the DDP wrapper and the module it wraps) whose gradients are averaged by
:func:`ordered_allreduce_hook`, as registered by :func:`ordered_allreduce`."""


def ordered_allreduce_hook(
    state: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the ranks of ``state`` (a process group;
    ``None``: the default group), adding the ranks' gradients element-wise in rank order.

    Register it with :func:`ordered_allreduce` (or ``ddp.register_comm_hook(group, hook)``,
    which :meth:`Agent.watch` cannot see). Works on any backend with
    ``all_gather_into_tensor`` (gloo, NCCL); the result has the bucket's dtype and device.

    Returns:
        A future of the averaged bucket (the same shape as ``bucket.buffer()``).
    """
    return average_in_rank_order(bucket.buffer(), state)


def average_in_rank_order(
    buffer: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.futures.Future[torch.Tensor]:
    """The average of ``buffer`` over the ranks of ``group`` (``None``: the default group),
    its elements summed in rank order: what :func:`ordered_allreduce_hook` does to a bucket.
    ``buffer`` is not changed.

    Returns:
        A future of a new tensor of ``buffer``'s shape, dtype and device; it completes with
        the all-gather's error when the collective fails (a peer died), which DDP raises in
        ``backward``, as it does for its own all-reduce.
    """
    world = dist.get_world_size(group)
    gathered = torch.empty(world * buffer.numel(), dtype=buffer.dtype, device=buffer.device)
    work = _ALL_GATHER(gathered, buffer.reshape(-1), group=group, async_op=True)

    def average(gather: torch.futures.Future[Any]) -> torch.Tensor:
        # value() raises the collective's error: a failed all-gather leaves ``gathered``
        # uninitialised, and averaging it would train on garbage without a word.
        gather.value()
        rows = gathered.view(world, -1)
        total = rows[0].clone()
        for rank in range(1, world):
            total.add_(rows[rank])  # element-wise: the same sum for any bucket layout
        return total.div_(world).view_as(buffer)

    averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(average)
    return averaged


def ordered_allreduce(
    model: DistributedDataParallel, group: dist.ProcessGroup | None = None
) -> DistributedDataParallel:
    """Make ``model`` average its gradients with :func:`ordered_allreduce_hook` over ``group``
    (``None``: the default process group), so that a restored run stays bitwise equal to the
    uninterrupted one with any number of ranks; return ``model``.

    Call it once, right after wrapping the module, before the first forward::

        model = ordered_allreduce(DistributedDataParallel(module))

    Raises:
        RuntimeError: ``model`` already has a communication hook (DDP allows one).
    """
    model.register_comm_hook(group, ordered_allreduce_hook)
    _ORDERED.add(model)
    _ORDERED.add(model.module)
    return model


def averages_in_fixed_order(model: nn.Module) -> bool:
    """Whether ``model`` (a DDP wrapper or the module it wraps) averages its gradients with
    :func:`ordered_allreduce_hook`: registered by :func:`ordered_allreduce`, or found among a
    DDP wrapper's registered hooks."""
    if model in _ORDERED:
        return True
    hooks = getattr(model, "_comm_hooks", ())  # DDP's record of register_comm_hook calls
    return any(hook is ordered_allreduce_hook for hook, _ in hooks)
