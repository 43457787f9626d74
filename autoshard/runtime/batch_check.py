"""Every rank of a tensor-parallel and of a pipeline group must be given the same batch.

The tp ranks compute one model on one batch between them, and a pipeline's first stage reads the
inputs while its last reads the labels, so a batch that differs between them gives wrong losses and
gradients with no error: the classic cause is a ``DistributedSampler`` built over the whole world
(``num_replicas=world_size``) instead of over the data-parallel replicas. Megatron avoids it by
broadcasting the batch from tp rank 0; autoshard keeps the user's loop and checks instead: on the first
``CHECKED_CALLS`` calls of each program it all-gathers a fingerprint of the batch over tp and over pp
(sizes, sums and a position-weighted sum, in float64) and raises on every rank if they
differ, before any collective of the step can pair the ranks wrongly. Only dp ranks may differ: that is
how each replica gets its own rows (``autoshard.local_batch``, ``autoshard.data_parallel_rank``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.ir.errors import InputError
from autoshard.runtime.comm import collective_device

CHECKED_CALLS = 2            # the first calls of each program: a mistake in a data loader shows at once


SAMPLE = 1 << 20             # elements of each tensor in the position-weighted sum (a strided sample)


def fingerprint(leaves: list) -> torch.Tensor:
    """Six float64 numbers, whatever the batch (so every rank all-gathers the same size even when their
    batches have different structures): the count of tensors, their shapes (a checksum of the sizes), and
    over all elements their count, sum (NaNs as 0, so a NaN in a batch is compared, not an error) and NaN
    count, and a position-weighted sum over a strided sample of at most ``SAMPLE`` elements per tensor (an
    ``inputs_embeds`` batch is not copied whole into float64)."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    stats = torch.zeros(6, dtype=torch.float64, device=device)
    stats[0] = len(tensors)
    for i, x in enumerate(tensors):
        flat = x.detach().reshape(-1).to(device)
        stats[1] += _shape_code(i, x)
        stats[2] += flat.numel()
        if flat.is_floating_point() or flat.is_complex():
            stats[3] += torch.nansum(flat, dtype=torch.float64).real
            stats[5] += torch.isnan(flat).sum()
        elif flat.numel():
            stats[3] += flat.sum(dtype=torch.float64)
        sample = flat[::max(1, flat.numel() // SAMPLE)].to(torch.float64).nan_to_num(0.0)
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=device).remainder_(1009).add_(1)
        stats[4] += (sample * weights).sum() * (i + 1)
    return stats


def _shape_code(i: int, x: torch.Tensor) -> int:
    """A checksum of the ``i``-th tensor's shape (its place counts too)."""
    return sum((d + 1) * (j + 2) * (i + 3) for j, d in enumerate(x.shape))


def _rows(leaves: list) -> int:
    return next((int(x.shape[0]) for x in leaves if isinstance(x, torch.Tensor) and x.dim()), 0)


def check_same_shapes_over_dp(comms: dict, leaves: list, where: str, problem: Exception | None = None) -> None:
    """Raise (on every rank of the dp group) if the dp replicas were given batches of different shapes, or
    if one of them found its batch out of range (``problem``: its own ``check_inputs`` error, which that
    replica raises, the others naming it). Shapes only (no pass over the data): one all-gather of five
    numbers. Each replica computes the same program on its own rows, and a replica with other shapes would
    compile and run another program (its gradients weighted by its own row count, a last partial batch on
    some ranks only): a data-loader slip (a ``DistributedSampler`` without ``drop_last``), not a plan."""
    comm = comms.get("dp")
    group = getattr(comm, "group", None)
    if comm is None or comm.size == 1 or group is None:
        if problem is not None:
            raise problem
        return
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]    # shapes only (no pass over the data)
    mine = torch.tensor([len(tensors), sum(_shape_code(i, x) for i, x in enumerate(tensors)),
                         sum(x.numel() for x in tensors), _rows(leaves),
                         0 if problem is None else 1 if isinstance(problem, InputError) else 2],
                        dtype=torch.float64, device=collective_device())
    every = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(e[:3], every[0][:3]) for e in every):
        rows = [int(e[3]) for e in every]
        what = (f"rows per dp rank: {rows}" if len(set(rows)) > 1 else
                f"the same {rows[0]} rows each, but another dimension differs, such as the sequence length")
        raise InputError(f"{where}: the dp replicas were given batches of different shapes ({what}), "
                         "but every replica must pass the same shapes, its own rows of one global batch: use "
                         "autoshard.local_batch(batch, mesh), or a DistributedSampler with drop_last=True")
    if problem is not None:
        raise problem
    bad = [r for r, e in enumerate(every) if e[4]]
    if bad:
        what = ("a batch with a value out of range (a token id past the embedding, or a label past the classes)"
                if every[bad[0]][4] == 1 else "a batch its input checks failed on")
        raise InputError(f"{where}: dp replica {bad[0]} of {comm.size} was given {what}; that replica's error names "
                         "the value and its position, and every replica stops here, before the step's collectives")


def check_same_batch(comms: dict, leaves: list, where: str) -> None:
    """Raise (on every rank of the group) if the tp or pp ranks were given different batches."""
    mine = None
    for axis in ("tp", "pp"):
        comm = comms.get(axis)
        group = getattr(comm, "group", None)
        if comm is None or comm.size == 1 or group is None:
            continue                    # one rank, or the in-process simulator's threads
        if mine is None:
            mine = fingerprint(leaves).to(collective_device())   # a CPU batch under NCCL too
        every = [torch.empty_like(mine) for _ in range(comm.size)]
        dist.all_gather(every, mine, group=group)
        differ = [r for r in range(comm.size) if not torch.equal(every[r], every[0])]
        if differ:
            raise RuntimeError(
                f"{where}: the {axis} ranks were given different batches ({axis} rank {differ[0]} differs from "
                f"{axis} rank 0), but every rank of a {axis} group must pass the same batch (only dp replicas "
                "take different rows). A DistributedSampler over the whole world does this: build it with "
                "num_replicas and rank from autoshard.data_parallel_rank(mesh), or cut a global batch with "
                "autoshard.local_batch(batch, mesh)")
