"""Utilities (port of the original utils/core.py from TF1 + mpi4py to torch + torch.distributed).

What replaced the original's TF1 graph machinery (details in PORTING.md):
- `graph_function` / placeholders / `tf.Session`: gone; functions are called eagerly with tensors.
- `mpi_session` / `variables_on_gpu` / `gpu_devices`: `get_device()` (one GPU per process, by LOCAL_RANK).
- MPI (`MPI.COMM_WORLD`, horovod): the default torch.distributed process group, whose processes carry
  the MPI ranks, one or several each (utils/ranks.py). Every function works without an initialised
  group too (a single process), like the original with one MPI rank.
- `variable_synchronizer`: `sync_params`; the gradient all-reduce inside `minimize`: `mpi_allreduce_mean_grads`;
  `tf.train.AdamOptimizer(epsilon=1e-5)`: `AdamTF`.
- `where` (scalar broadcasting), `shape_list`, `map_flat_bits`, `add_batch_dim`, `mpi_read_file`,
  `SampleBuffer.write/write_add` are not ported: torch does these natively or nothing uses them.
The original's functions come first, in its order; ours follow them.
"""

import collections.abc
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from lm_human_preferences.utils import categorical, distributed, ranks, stats_table


def get_device():
    """One GPU per process, like the original's _our_gpu() (one per rank there); CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device('cuda', get_local_rank() % torch.cuda.device_count())
    return torch.device('cpu')


def set_mpi_seed(seed: Optional[int]):
    """Seed each rank's torch, numpy and random streams with seed + rank * 100003, as the original (None:
    fresh entropy); ours: the process's own streams, used outside the rank sections, with seed."""
    ranks.seed(seed)


def exact_div(a, b):
    q = a // b
    if a != q * b:
        raise ValueError('Inexact division: %s / %s = %s' % (a, b, a / b))
    return q


def ceil_div(a, b):
    return (a - 1) // b + 1


def expand_tile(value, size, *, axis):
    """Add a new axis of given size."""
    value = torch.as_tensor(value)
    ndims = value.dim()
    if axis < 0:
        axis += ndims + 1
    return value.unsqueeze(axis).repeat([1] * axis + [size] + [1] * (ndims - axis))


def index_each(a, ix):
    """Do a batched indexing operation: index row i of a by ix[i]

    In the simple case (a is >=2D and ix is 1D), returns [row[i] for row, i in zip(a, ix)].

    If ix has more dimensions, multiple lookups will be done at each batch index.
    For instance, if ix is 2D, returns [[row[i] for i in ix_row] for row, ix_row in zip(a, ix)].

    Always indexes into dimension 1 of a.
    """
    a = torch.as_tensor(a)
    ix = torch.as_tensor(ix, dtype=torch.long, device=a.device)
    if a.shape[0] != ix.shape[0]:
        raise ValueError(f'index_each: batch sizes differ: a {tuple(a.shape)}, ix {tuple(ix.shape)}')
    i0 = torch.arange(a.shape[0], device=a.device).view((-1,) + (1,) * (ix.dim() - 1)).expand_as(ix)
    return a[i0, ix]


def cumulative_max(x):
    """Takes the (inclusive) cumulative maximum along the last axis of x."""
    return torch.cummax(torch.as_tensor(x), dim=-1).values


def flatten_dict(nested, sep='.'):
    def rec(nest, prefix, into):
        for k, v in nest.items():
            if sep in k:
                raise ValueError(f"separator '{sep}' not allowed to be in key '{k}'")
            # collections.abc.Mapping: the original's collections.Mapping was removed in Python 3.10.
            if isinstance(v, collections.abc.Mapping):
                rec(v, prefix + k + sep, into)
            else:
                into[prefix + k] = v
    flat = {}
    rec(nested, '', flat)
    return flat


@dataclass
class Schema:
    dtype: Any  # a torch dtype (the original: a tf dtype)
    shape: Tuple[Optional[int], ...]


class SampleBuffer:
    """A circular buffer for storing and sampling data (CPU tensors).

    Data can be added to the buffer with `add`, and old data will be dropped.
    """

    def __init__(self, *, capacity: int, schemas: Dict[str, Schema]) -> None:
        self._capacity = capacity
        self._total = 0
        self._schemas = dict(schemas)
        self._vars = {n: torch.zeros((capacity,) + tuple(s.shape), dtype=s.dtype) for n, s in schemas.items()}
        self._generators = {}

    def add(self, **data):
        """Add new data to the end of the buffer, dropping old data if we exceed capacity."""
        if data.keys() != self._vars.keys():
            raise ValueError('data.keys() = %s != %s' % (sorted(data.keys()), sorted(self._vars.keys())))
        data = {k: torch.as_tensor(d) for k, d in data.items()}
        n = next(iter(data.values())).shape[0]
        for k, d in data.items():
            want = (n,) + tuple(self._schemas[k].shape)
            if tuple(d.shape) != want:
                raise ValueError(f'SampleBuffer.add: key {k} has shape {tuple(d.shape)}, expected {want}')
            if not torch.can_cast(d.dtype, self._schemas[k].dtype):
                raise ValueError(f'SampleBuffer.add: key {k} has dtype {d.dtype}, expected {self._schemas[k].dtype}')
        if n > self._capacity:
            raise ValueError(f'SampleBuffer.add: {n} entries do not fit in capacity {self._capacity}')
        # Enqueue: the same two slices as the original, [i0, i1) at the end and [i2, i3) wrapped around.
        capacity = self._capacity
        i0 = self._total % capacity
        i0n = i0 + n
        i1 = min(i0n, capacity)
        i2 = i1 % capacity
        i3 = i0n % capacity
        self._total += n
        for k, d in data.items():
            d = d.to(device='cpu', dtype=self._schemas[k].dtype)
            self._vars[k][i0:i1] = d[:i1 - i0]
            self._vars[k][i2:i3] = d[i1 - i0:]

    def total(self):
        """Total number of entries ever added, including those already discarded."""
        return self._total

    def size(self):
        """Current number of entries."""
        return min(self._total, self._capacity)

    def read(self, indices):
        """indices: A 1-D tensor of indices to read from. Each index must be less than capacity."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[indices] for k, v in self._vars.items()}

    def data(self):
        return {k: v[:self.size()] for k, v in self._vars.items()}

    def sample(self, n, seed=None):
        """Sample n entries with replacement.

        Like the original's seeded op, a given seed fixes the sequence of samples over calls (each call
        continues it) rather than returning the same sample every time.
        """
        generator = None
        if seed is not None:
            if seed not in self._generators:
                self._generators[seed] = torch.Generator().manual_seed(seed)
            generator = self._generators[seed]
        indices = torch.randint(0, self.size(), (n,), generator=generator)
        return self.read(indices)


def entropy_from_logits(logits):
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def logprobs_from_logits(*, logits, labels):
    # = -sparse_softmax_cross_entropy_with_logits(labels, logits)
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def sample_from_logits(logits, generator=None):
    """One categorical sample per row of logits (any leading shape); returns int64 token ids: the original's
    tf.random.categorical, by TF's own algorithm (a running sum of exp(logit - max), searched for uniform *
    total), with torch's random stream and the exp in float32 (PORTING.md says why, and what it costs)."""
    samples, has_finite = categorical.sample_from_logits_unchecked(logits, generator)
    categorical.check_rows_have_finite_logits(has_finite)
    return samples


def take_top_k_logits(logits, k):
    values, _ = torch.topk(logits, k=k, dim=-1)
    min_values = values[..., -1:]
    return torch.where(logits < min_values, torch.full_like(logits, -1e10), logits)


def take_top_p_logits(logits, p):
    """Nucleus sampling"""
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
    cumulative_probs = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    # number of indices to include
    n_keep = torch.clamp((cumulative_probs <= p).sum(dim=-1) - 1, min=0)
    min_values = sorted_logits.gather(-1, n_keep.unsqueeze(-1))
    return torch.where(logits < min_values, torch.full_like(logits, -1e10), logits)


def whiten(values, shift_mean=True, groups=1):
    """groups (ours): the rows of values are that many equal blocks, each whitened over its own elements:
    the ranks a process carries side by side, each of which the original whitened over its own minibatch."""
    blocks = values.reshape(groups, -1)  # [groups, elements of a block]
    mean, var = moments(blocks, dim=1)
    whitened = (blocks - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.view_as(values)


def map_flat(f, values):
    """Apply the function f to flattened, concatenated values, then split and reshape back to original shapes."""
    values = list(values)
    flat = torch.cat([v.reshape(-1) for v in values])
    flat = f(flat)
    parts = torch.split(flat, [v.numel() for v in values])
    return [p.reshape(v.shape) for p, v in zip(parts, values)]


def mpi_bcast(value, root=0):
    """Broadcast value from process `root` (process 0 carries rank 0) to the other processes.

    A tensor is broadcast in place of an equally shaped tensor on every process (as the original, whose
    tensors had static shapes); anything else (numpy arrays, python objects) is pickled.
    """
    ranks.refuse_in_section('mpi_bcast')
    if not distributed.processes_on():
        return value
    if isinstance(value, torch.Tensor):
        buf = value.detach().to(distributed.comm_device()).clone()
        dist.broadcast(buf, src=root)
        return buf.to(value.device)
    obj = [value if ranks.process_index() == root else None]
    dist.broadcast_object_list(obj, src=root, device=distributed.comm_device())
    return obj[0]


def chunk_tensors(tensors, *, limit=1 << 28):
    """Chunk the list of tensors into groups of size at most `limit` bytes (and a single dtype each, since
    the groups are concatenated for one collective call)."""
    batches = []
    total = 0
    for v in tensors:
        size = v.element_size() * v.numel()
        if not batches or total + size > limit or batches[-1][0].dtype != v.dtype:
            total = 0
            batches.append([])
        total += size
        batches[-1].append(v)
    return batches


@torch.no_grad()
def sync_params(params, root=0):
    """Copy params (an nn.Module or a list of tensors) from process `root` to the other processes.

    Replaces the original's variable_synchronizer; chunked, one broadcast per chunk.
    """
    ranks.refuse_in_section('sync_params')
    if not distributed.processes_on():
        return
    tensors = distributed.module_tensors(params)
    for batch in chunk_tensors(tensors):
        values = map_flat(lambda flat: mpi_bcast(flat, root=root), batch)
        for t, v in zip(batch, values):
            t.copy_(v)


def mpi_allreduce_sum(values):
    """The sum over all ranks of a value each rank computed (a tensor, numpy array or python number).

    values: the list of the values of this process's ranks, in ranks.local_ranks() order (one value where a
    process is a rank). Collective over processes; returns the same kind as the values.
    """
    ranks.refuse_in_section('mpi_allreduce_sum')
    if not isinstance(values, (list, tuple)) or len(values) != len(ranks.local_ranks()):
        raise TypeError(f'mpi_allreduce_sum takes the list of the values of this process\'s '
                        f'{len(ranks.local_ranks())} ranks, got {type(values).__name__}'
                        + (f' of {len(values)}' if isinstance(values, (list, tuple)) else ''))
    # Ours: every rank's value, added in rank order on every process, whatever the layout.
    if distributed.processes_on():
        device = values[0].device if isinstance(values[0], torch.Tensor) else None
        values = [v if device is None else v.to(device) for v in distributed.all_gather_ranks(
            [v.cpu() if device is not None else v for v in values])]
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def mpi_allreduce_mean(values):
    """The mean over all ranks; values as in mpi_allreduce_sum."""
    total = mpi_allreduce_sum(values)
    scale = 1 / ranks.get_world_size()
    return total if scale == 1 else total * scale


class FlatStats:
    """A bunch of statistics stored as a single flat tensor."""

    def __init__(self, keys, flat):
        keys = tuple(keys)
        flat = torch.as_tensor(flat, dtype=torch.float32)
        assert flat.shape == (len(keys),), f'FlatStats: {len(keys)} keys but flat has shape {tuple(flat.shape)}'
        self.keys = keys
        self.flat = flat

    @staticmethod
    def from_dict(stats):
        for k, v in stats.items():
            if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
                dtype = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError('Statistic %s has dtype %r, expected %r' % (k, dtype, torch.float32))
        keys = tuple(sorted(stats.keys()))
        flat = torch.stack([stats[k].reshape(()) for k in keys])
        return FlatStats(keys, flat)

    def concat(self, more):
        dups = set(self.keys) & set(more.keys)
        if dups:
            raise ValueError('Duplicate statistics: %s' % ', '.join(sorted(dups)))
        return FlatStats(self.keys + more.keys, torch.cat([self.flat, more.flat.to(self.flat.device)]))

    def as_dict(self):
        return dict(safe_zip(self.keys, self.flat.unbind(0)))

    def with_values(self, flat):
        return FlatStats(self.keys, flat)

    def map_flat(self, f):
        return FlatStats(self.keys, f(self.flat))


def pearson_r(x, y):
    assert x.dim() == 1, f'pearson_r: x must be 1-D, got shape {tuple(x.shape)}'
    assert y.dim() == 1, f'pearson_r: y must be 1-D, got shape {tuple(y.shape)}'
    x_mean, x_var = moments(x)
    y_mean, y_var = moments(y)
    cov = torch.mean((x - x_mean) * (y - y_mean), dim=0)
    return cov / torch.sqrt(x_var * y_var)


def safe_zip(*args):
    """Zip, but require all sequences to be the same length."""
    args = tuple(map(tuple, args))
    for a in args[1:]:
        if len(args[0]) != len(a):
            raise ValueError(f'Lengths do not match: {[len(a) for a in args]}')
    return zip(*args)


def get_summary_writer(save_dir, subdir='', purge_step=None):
    """A TensorBoard writer under <save_dir>/tb/<subdir> on rank 0; None elsewhere or without a save_dir.
    purge_step (ours, for a resumed run): TensorBoard hides the events this dir holds from that step on."""
    if not ranks.is_root() or save_dir is None:
        return None
    # tensorboard uses TensorFlow's file I/O when TensorFlow is importable (here: tensorflow-cpu, for the
    # converter), which costs seconds per process; its own stub writes the same event files.
    if 'tensorflow' not in sys.modules:
        sys.modules.setdefault('tensorboard.compat.notf', types.ModuleType('tensorboard.compat.notf'))
    from torch.utils.tensorboard import SummaryWriter  # imported lazily: it pulls in tensorboard
    return SummaryWriter(os.path.join(save_dir, 'tb', subdir), purge_step=purge_step)


def record_stats(*, stats, summary_writer, step, log_interval):
    """Log stats (dict of name -> scalar, already averaged over ranks) on the process that carries rank 0:
    print a table every log_interval steps and write every step to TensorBoard. Returns the dict of floats
    (on every process). training/stats_log.py's StatsLog adds the JSONL file and wandb."""
    means = {k: stats_table.to_float(v) for k, v in stats.items()}
    step = int(step)
    if not ranks.is_root():
        return means
    if log_interval and step % log_interval == 0:
        print(stats_table.format_table(means, step))
    if summary_writer is not None:
        for k, v in means.items():
            summary_writer.add_scalar(k, v, global_step=step)
        summary_writer.flush()
    return means


@torch.no_grad()
def mpi_allreduce_mean_grads(params):
    """The gradient all-reduce of the original's `minimize` (map_flat_chunked(mpi_allreduce_mean, grads)).

    A process computes the gradient of the mean of its ranks' losses in one backward pass (its ranks are
    side by side in one batch), so its .grad is the mean over the ranks it carries; this sets .grad to the
    mean over all ranks: the mean over processes (each carries as many ranks), summed in float64 so that
    the result does not depend on the order of the sums. Params without .grad keep None, as the original
    dropped None gradients. Collective over processes; nothing to do with one process.
    """
    ranks.refuse_in_section('mpi_allreduce_mean_grads')
    if not distributed.processes_on():
        return
    grads = [p.grad for p in params if p.grad is not None]
    scale = 1 / ranks.num_processes()
    for chunk in chunk_tensors(grads, limit=1 << 28):
        values = map_flat(lambda flat: distributed.sum_over_processes(flat.double()) * scale, chunk)
        for g, v in zip(chunk, values):
            g.copy_(v)


# ---------------------------------------------------------------------------------------------------
# Ours, after the original's functions: tf.nn.moments, which the original's whiten uses, this process's index on
# its machine, which get_device uses, and what every rank learns of rank 0's try (root_tries).


def moments(values, dim=None):
    """Mean and population variance over all elements (or along dim, kept), as tf.nn.moments (no gradient
    through the mean in var)."""
    if dim is None:
        mean = values.mean()
        return mean, torch.mean((values - mean.detach()) ** 2)
    mean = values.mean(dim, keepdim=True)
    return mean, torch.mean((values - mean.detach()) ** 2, dim, keepdim=True)


def get_local_rank():
    """This process's index on its machine (set by launch.py / torchrun); the original derived it from
    MPI host names."""
    return int(os.environ.get('LOCAL_RANK', '0'))


def root_tries(attempt, *, fails=(OSError, ValueError)):
    """Ours, the one way of "rank 0 tries, every rank learns the error": attempt() runs in the process that carries
    rank 0 alone (a save dir's files, a download); what it raises of `fails` reaches every process in one
    broadcast, which is also the barrier (the others wait for rank 0, rather than go on into the next collective
    alone or wait for a file that never comes), and every process raises it: rank 0 its own exception, the others
    one of its class with its message (and errno; a RuntimeError where the class takes more than a message).
    Returns attempt()'s value in the process that carries rank 0, None in the others."""
    value = error = None
    if ranks.is_root():
        try:
            value = attempt()
        except fails as e:
            error = e
    learned = mpi_bcast(None if error is None else (type(error), str(error), getattr(error, 'errno', None)))
    if error is not None:
        raise error
    if learned is not None:
        cls, message, errno = learned
        try:
            error = cls(message)
        except TypeError:
            error = RuntimeError(message)
        if errno is not None:
            error.errno = errno
        raise error
    return value
