"""Ranks carried by processes (ours: the original ran one MPI rank per process).

The original's numerics depend on its rank count: with `mpiexec -n 8` every rank whitens rewards and
advantages over its own minibatch, seeds its random streams with seed + 100003 * rank, reads its own
shard of the queries, normalizes on its own samples and trains the reward model on `batch[rank::8]`.
Running it on fewer GPUs with fewer ranks changes all of that. Here a rank is not a process:

    --mpi N     N ranks, the original's meaning (its `mpi=8` for the paper's experiments)
    --procs P   P processes carry them, N / P each (a torch.distributed group of P, one GPU each)

A process carries its ranks side by side, as row blocks of one batch: rank local_ranks()[i] holds the i-th
block of every batch the trainers make (its queries, rollouts, minibatches, labels), so that one model pass
serves all of them (a GPU is dispatch-bound on one small rank at a time). Whatever the original computed per
rank the trainers compute per block: whitening, per-rank stats, losses (the gradient is that of the mean of
the ranks' losses). What a rank draws at random it draws inside `rank_section(rank)`: there
`get_rank()` is that rank and the global random streams (torch, CUDA, numpy, random) are that rank's
own, swapped in on entry and out on exit, so each rank's queries, sampling draws and shuffles come from its
own stream (for_each_rank). What every rank of the original held identically (the models, gradients
averaged over ranks, the optimizer, the KL controller) exists once per process and lives outside the
sections, as does everything that is collective over processes (core.mpi_bcast, sync_params,
core.mpi_allreduce_mean_grads): calling one inside a section is refused. Values reduced over ranks
(core.mpi_allreduce_sum / _mean) are passed as the list of this process's ranks' values.

Outside the sections a process acts as its first rank (so `is_root()` there means "carries rank 0")
and uses its own random streams, seeded the same in every process: model initialisation draws from them,
not from the ranks' streams, as TF's graph-level seeding kept initialisers and sampling apart.

Without a layout (code not started by utils/launch.py, e.g. a test calling a trainer) every process of
the group carries one rank, which is the original's arrangement.

The ranks have one spelling, this module's: get_rank(), get_world_size(), is_root(), local_ranks(),
for_each_rank(fn), concat_ranks(fn). The collectives over processes are utils/distributed.py's.
"""

import contextlib
import random
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    world_size: int  # N: the original's MPI ranks
    first: int  # the first rank this process carries
    count: int  # how many it carries: ranks first .. first + count - 1


_layout: Optional[RankLayout] = None
_current: Optional[int] = None  # the rank whose section is running
_rng: Dict[int, dict] = {}  # each local rank's random streams, while its section is not running


def num_processes():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def process_index():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def layout() -> RankLayout:
    if _layout is not None:
        return _layout
    return RankLayout(world_size=num_processes(), first=process_index(), count=1)


@contextlib.contextmanager
def carry(world_size):
    """Let this process group's processes carry `world_size` ranks, world_size / processes each, in
    order (process p carries ranks p * count .. (p + 1) * count - 1), until the block ends."""
    global _layout
    processes = num_processes()
    if world_size < 1 or world_size % processes:
        raise ValueError(f'{world_size} ranks cannot be shared evenly by {processes} processes')
    count = world_size // processes
    _layout = RankLayout(world_size=world_size, first=process_index() * count, count=count)
    _rng.clear()
    try:
        yield _layout
    finally:
        _layout = None
        _rng.clear()


def get_world_size():
    """The number of ranks (the original's MPI world size), whichever number of processes carries them."""
    return layout().world_size


def local_ranks():
    """The ranks this process carries, in order."""
    lay = layout()
    return range(lay.first, lay.first + lay.count)


def get_rank():
    """The rank whose section is running; outside the sections, this process's first rank."""
    return _current if _current is not None else layout().first


def is_root():
    """Whether the running rank is rank 0 (outside the sections: whether this process carries it)."""
    return get_rank() == 0


def in_section():
    return _current is not None


def refuse_in_section(what):
    """Collectives over processes run once per process, outside the ranks' sections."""
    if _current is not None:
        raise RuntimeError(f'{what} is collective over processes: call it outside the rank sections '
                           f'(it was called in rank {_current}\'s)')


# ---------------------------------------------------------------------------------------------------
# Random streams

def _uses_cuda():
    return torch.cuda.is_available()


def get_rng_state():
    """The global random streams: torch (CPU and this process's GPU), numpy and random."""
    return dict(
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state() if _uses_cuda() else None,
        numpy=np.random.get_state(),
        python=random.getstate(),
    )


def set_rng_state(state):
    torch.set_rng_state(state['torch'])
    if state['cuda'] is not None and _uses_cuda():
        torch.cuda.set_rng_state(state['cuda'])
    np.random.set_state(state['numpy'])
    random.setstate(state['python'])


def _seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    if seed is None:
        torch.seed()  # fresh entropy, as np.random.seed(None)
    else:
        torch.manual_seed(seed)


def seed(seed_value: Optional[int]):
    """Each local rank's streams from seed + rank * 100003, as the original's set_mpi_seed (None: fresh
    entropy per rank, as the original); then this process's own streams from seed, the same in every
    process. Refused inside a section."""
    refuse_in_section('set_mpi_seed')
    _rng.clear()
    for rank in local_ranks():
        # Prime (kept for backwards compatibility even though it does nothing)
        _seed_all(None if seed_value is None else seed_value + rank * 100003)
        _rng[rank] = get_rng_state()
    _seed_all(seed_value)


def rank_rng_states():
    """{rank: streams} of this process's ranks (train_state saves them); {} when unseeded."""
    refuse_in_section('rank_rng_states')
    return dict(_rng)


def set_rank_rng_states(states):
    refuse_in_section('set_rank_rng_states')
    _rng.clear()
    _rng.update(states)


@contextlib.contextmanager
def rank_section(rank):
    """Run the block as `rank`: get_rank() is rank and, once set_mpi_seed has seeded the ranks, the
    global random streams are rank's own (each section continues them where its last one stopped)."""
    global _current
    if _current is not None:
        raise RuntimeError(f'rank sections do not nest (rank {_current}\'s is running, {rank}\'s was entered)')
    if rank not in local_ranks():
        raise ValueError(f'rank {rank} is not carried by this process (it carries {list(local_ranks())})')
    seeded = rank in _rng
    if seeded:
        process_state = get_rng_state()
        set_rng_state(_rng[rank])
    _current = rank
    try:
        yield rank
    finally:
        _current = None
        if seeded:
            _rng[rank] = get_rng_state()
            set_rng_state(process_state)


def for_each_rank(fn):
    """[fn() in rank r's section, for each rank r this process carries, one after another]."""
    results = []
    for rank in local_ranks():
        with rank_section(rank):
            results.append(fn())
    return results


def concat_ranks(fn):
    """fn() in each rank's section (its get_rank(), its random streams), the tensors it returns concatenated
    rank after rank: a batch of the ranks this process carries side by side, each rank's rows drawn from its
    own streams. A tuple of tensors, as fn returns."""
    return tuple(torch.cat(pieces) for pieces in zip(*for_each_rank(fn)))
