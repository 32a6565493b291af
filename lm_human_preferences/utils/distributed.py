"""Ours: torch.distributed in place of MPI: the collectives over the processes of the group (utils/ranks.py: a
rank is not a process; its names are ranks.get_rank, get_world_size, is_root, local_ranks). core's
collectives (the original's mpi_bcast, sync_params, mpi_allreduce_sum / _mean, the gradient all-reduce of
minimize) are written with these.

Two kinds of collectives: the original's reductions over *ranks* (core.mpi_allreduce_sum / _mean) take the
list of this process's ranks' values; the rest (core.mpi_bcast, sync_params, all_gather_ranks) are over
*processes*, called once per process outside the rank sections (every rank of a process holds the same models,
so nothing per rank is lost); core.mpi_allreduce_mean_grads averages the processes' gradients. With no process
group a process is one MPI rank (world size 1), so the trainers and tests run unchanged in one process.
"""

import numpy as np
import torch
import torch.distributed as dist

from lm_human_preferences.utils import ranks


def comm_device():
    """Where a collective's buffers live."""
    # NCCL only moves CUDA tensors; gloo is used on CPU.
    if dist.get_backend() == 'nccl':
        return torch.device('cuda', torch.cuda.current_device())
    return torch.device('cpu')


def processes_on():
    return ranks.num_processes() > 1


def allreduce_tensor_sum(t):
    # Reduce floats in fp32 like the original (its MPI buffer was float32; fp64 stays fp64), ints in int64.
    if t.is_floating_point():
        work_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    else:
        work_dtype = torch.int64
    buf = t.detach().to(device=comm_device(), dtype=work_dtype).clone()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(device=t.device, dtype=t.dtype)


def sum_over_processes(value):
    """Sum over processes of a tensor, numpy array or python number; the same kind back."""
    if not processes_on():
        return value
    if isinstance(value, torch.Tensor):
        return allreduce_tensor_sum(value)
    if isinstance(value, np.ndarray) or isinstance(value, np.generic):
        arr = np.asarray(value)
        out = allreduce_tensor_sum(torch.from_numpy(np.ascontiguousarray(arr))).numpy()
        return out if isinstance(value, np.ndarray) else out[()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        out = allreduce_tensor_sum(torch.tensor(value, dtype=dtype))
        return type(value)(out.item())
    raise TypeError(f'mpi_allreduce_sum: unsupported value of type {type(value).__name__}')


def processes_sum(value):
    """Ours: the sum over processes of a value each process computed for all the ranks it carries (a tensor,
    numpy array or python number), e.g. totals over the rows of its ranks side by side. Collective over
    processes; returns the same kind as the value."""
    ranks.refuse_in_section('processes_sum')
    return sum_over_processes(value)


def processes_min(value: int):
    """Ours: the smallest of an integer each process computed, on every process. Collective over processes."""
    ranks.refuse_in_section('processes_min')
    if not processes_on():
        return value
    buf = torch.tensor(value, dtype=torch.int64, device=comm_device())
    dist.all_reduce(buf, op=dist.ReduceOp.MIN)
    return int(buf.item())


def all_gather_ranks(values):
    """Ours: [the value of rank 0, of rank 1, ...] on every process, from the list of this process's
    ranks' values (picklable objects). Collective over processes."""
    ranks.refuse_in_section('all_gather_ranks')
    values = list(values)
    if not processes_on():
        return values
    gathered = [None] * ranks.num_processes()
    dist.all_gather_object(gathered, values)
    return [v for process_values in gathered for v in process_values]


def gather_ranks_to_root(values):
    """Ours: as all_gather_ranks, but only process 0 gets the list (None elsewhere)."""
    ranks.refuse_in_section('gather_ranks_to_root')
    values = list(values)
    if not processes_on():
        return values
    gathered = [None] * ranks.num_processes() if ranks.process_index() == 0 else None
    dist.gather_object(values, gathered, dst=0)
    return None if gathered is None else [v for process_values in gathered for v in process_values]


def module_tensors(params):
    if isinstance(params, torch.nn.Module):
        # Parameters and buffers (e.g. a reward model's gain/bias), in state_dict order (same on every rank).
        return list(params.state_dict(keep_vars=True).values())
    return list(params)
