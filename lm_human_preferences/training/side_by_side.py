"""Ours: the ranks a process carries side by side (utils/ranks.py), as the trainers see them. Rank
ranks.local_ranks()[i] holds the i-th block of rows of every batch a trainer makes; what the original computed per
rank, a trainer computes per block, and the ranks meet where the original's MPI calls were: a mean of per-rank
stats, a gradient averaged over ranks, each rank's share of a global index list, each rank's shuffle."""

import numpy as np
import torch

from lm_human_preferences.utils import core, distributed, passes, ranks


class RankBlocks:
    """This process's ranks, side by side: `count` of the `world` ranks."""

    def __init__(self):
        self.count = len(ranks.local_ranks())
        self.world = ranks.get_world_size()

    def view(self, x):
        """[ranks * n, ...] -> [ranks, n, ...]: each rank's rows."""
        return x.view(self.count, -1, *x.shape[1:])

    def permutations(self, n, device=None):
        """Each rank's np.random.permutation(n), drawn from its own stream as each of the original's ranks drew
        its own, as rows of the side-by-side batch: [ranks, n], rank i's offset by i * n."""
        orders = ranks.for_each_rank(lambda: np.random.permutation(n))
        return torch.from_numpy(np.stack(orders) + n * np.arange(self.count)[:, None]).to(device)

    def passes(self, fn, size, *tensors):
        """fn(*tensors) (rows first, a tensor back) over each rank's rows in passes of their own, of at most `size`
        rows each (passes.microbatches; None: a rank's rows in one pass), concatenated rank after rank. CPU kernels
        round a row differently in a batch of another number of rows (a GEMM's blocking, a vector loop's tail: the
        reward normalization's mean moved by 3e-8 between --procs 1 and 4), so a pass over several ranks' rows
        would make each rank's result depend on how many ranks its process carries. With one rank: fn's pieces
        as passes.microbatched makes them."""
        n = len(tensors[0]) // self.count
        return passes.cat_pieces([fn(*(t[rank * n + piece.start:rank * n + piece.stop] for t in tensors))
                                for rank in range(self.count) for piece in passes.microbatches(n, size)])

    def shares(self, indices):
        """Each of this process's ranks' share of a global index list, indices[rank::world], as the original's
        ranks took theirs: one per rank, in rank order."""
        return [indices[rank::self.world] for rank in ranks.local_ranks()]

    def mean(self, stats):
        """{name: [ranks] tensor of each rank's value} -> {name: float}: the mean over all ranks, in float64 (the
        original: float32), so that it does not depend on how the ranks are spread over processes (the order of
        the sums). Collective over processes."""
        keys = list(stats)
        per_rank = torch.stack([stats[k].double() for k in keys], dim=1)  # [ranks, keys]
        return dict(zip(keys, core.mpi_allreduce_mean(list(per_rank.unbind(0))).tolist()))


class RankGradients:
    """The gradient averaged over all ranks, from each rank's own backward pass, as each of the original's
    ranks computed its own. A process adds its ranks' gradients in float64 in rank order (add_rank, after each
    rank's backward), then the processes' sums are added in float64 (mean_into_grads), so that the mean does not
    depend on how the ranks are spread over processes. One backward over several ranks' rows sums them in another
    order, and where a loss is flat (the `test` labels: every sample alike) Adam's 1 / epsilon turns that rounding
    into steps. The reward model's trainer uses it; PPO keeps one pass over its ranks' rows, for speed."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self.sums = None  # float64, one per param

    def add_rank(self):
        """Move .grad (one rank's gradient) into the sums."""
        ranks.refuse_in_section('RankGradients.add_rank')
        if ranks.get_world_size() == 1:
            return  # the one rank's gradient is the mean: .grad stays (through float64 it would keep its bits)
        if self.sums is None:
            self.sums = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]
        for total, p in zip(self.sums, self.params):
            if p.grad is not None:
                total.add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def mean_into_grads(self):
        """Set .grad to the mean over all ranks of the gradients added so far (collective over processes), and
        start new sums."""
        ranks.refuse_in_section('RankGradients.mean_into_grads')
        if ranks.get_world_size() == 1:
            return  # .grad holds the one rank's gradient (add_rank left it there)
        if ranks.num_processes() > 1:
            for chunk in core.chunk_tensors(self.sums, limit=1 << 28):
                for total, v in zip(chunk, core.map_flat(distributed.processes_sum, chunk)):
                    total.copy_(v)
        scale = 1 / ranks.get_world_size()
        for total, p in zip(self.sums, self.params):
            p.grad = total.mul_(scale).to(p.dtype)
        self.sums = None
