"""Resumable training state (ours: the original could not resume).

The original saved only model weights (tf.train.Saver) and always started from scratch. A long RLHF run
dies to preemption, a full disk or a crashed worker, so both trainers also save their full *training
state* here (through training/run.py), and pick it up again when the same command is rerun. Their files and
format: training/state_files.py.

Resuming restores the exact RNG streams: the trainers rebuild everything as a fresh run would, then
`load_latest_train_state` replays the query samplers to their saved positions and only after that
restores every rank's RNG states (so the replay's own random draws do not matter). Frozen models (the
reference policy, the reward model a policy trains against) are not saved: they are rebuilt from their
checkpoints, or for random `test` models from run.seed, exactly as before the crash.
"""

import base64
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from lm_human_preferences.language import checkpoints
from lm_human_preferences.training.state_files import (FORMAT, TRAIN_STATE_SUBDIR, CheckpointError, choose_train_state,
                                                       save_model_checkpoint, state_paths, write_state_files)
from lm_human_preferences.utils import core, distributed, ranks


# ---------------------------------------------------------------------------------------------------
# RNG states (JSON-able)

def _b64(t: torch.Tensor):
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _from_b64(s):
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _rng_to_json(state):
    """utils/ranks.py's random streams as JSON."""
    name, keys, pos, has_gauss, cached_gaussian = state['numpy']
    version, internal, gauss_next = state['python']
    return dict(
        torch=_b64(state['torch']),
        cuda=_b64(state['cuda']) if state['cuda'] is not None else None,
        numpy=[name, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)],
        python=[version, list(internal), gauss_next],
    )


def _rng_from_json(state):
    name, keys, pos, has_gauss, cached_gaussian = state['numpy']
    version, internal, gauss_next = state['python']
    return dict(
        torch=_from_b64(state['torch']),
        cuda=_from_b64(state['cuda']) if state['cuda'] is not None else None,
        numpy=(name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian),
        python=(version, tuple(internal), gauss_next),
    )


def _local_rng_states():
    """JSON of this process's own random streams and of each of its ranks' (None where set_mpi_seed has not
    seeded them: they share the process's)."""
    rank_states = ranks.rank_rng_states()
    return _rng_to_json(ranks.get_rng_state()), [
        _rng_to_json(rank_states[r]) if r in rank_states else None for r in ranks.local_ranks()]


def _set_rng_states(process_state, all_rank_states):
    ranks.set_rng_state(_rng_from_json(process_state))
    ranks.set_rank_rng_states({r: _rng_from_json(all_rank_states[r]) for r in ranks.local_ranks()
                               if all_rank_states[r] is not None})


# ---------------------------------------------------------------------------------------------------
# Data position

class CountingSampler:
    """Wraps a query sampler (a function returning the next batch of the calling rank's queries) and counts
    the batches each rank has drawn, so that a resumed run can skip to the same place in every rank's query
    stream (a stream is deterministic given its seed, but its sampler has no way to seek: we draw and drop
    the batches already used). Every rank draws as many batches as every other."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.drawn = {}  # rank -> batches drawn

    def __call__(self):
        batch = self.sampler()
        rank = ranks.get_rank()
        self.drawn[rank] = self.drawn.get(rank, 0) + 1
        return batch

    @property
    def batches_drawn(self):
        """Batches drawn by each of this process's ranks (the same number for all)."""
        counts = {self.drawn.get(r, 0) for r in ranks.local_ranks()}
        if len(counts) != 1:
            raise CheckpointError(f'the ranks of this process drew different numbers of query batches: {self.drawn}')
        return counts.pop()

    def skip_to(self, batches_drawn):
        """Draw (in each rank's section) until every rank of this process has drawn batches_drawn batches."""
        def skip():
            rank = ranks.get_rank()
            if batches_drawn < self.drawn.get(rank, 0):
                raise CheckpointError(f'cannot rewind a query sampler from batch {self.drawn[rank]} to {batches_drawn}')
            while self.drawn.get(rank, 0) < batches_drawn:
                self()
        ranks.for_each_rank(skip)


# ---------------------------------------------------------------------------------------------------
# Save

def _tensor_state(modules, optimizer, extra):
    """(tensors for safetensors, JSON-able rest) of modules, optimizer and extra."""
    tensors, json_state = {}, {}
    for name, module in modules.items():
        for k, v in module.state_dict().items():
            tensors[f'modules.{name}.{k}'] = v
    opt = optimizer.state_dict()
    opt_scalars = {}
    for idx, param_state in opt['state'].items():
        for k, v in param_state.items():
            if isinstance(v, torch.Tensor):
                tensors[f'optimizer.{idx}.{k}'] = v
            else:
                opt_scalars.setdefault(str(idx), {})[k] = v
    json_state['optimizer'] = dict(param_groups=opt['param_groups'], state_scalars=opt_scalars)
    json_extra, extra_tensors = {}, {}
    for k, v in extra.items():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            extra_tensors[k] = 'numpy' if isinstance(v, np.ndarray) else 'torch'
            tensors[f'extra.{k}'] = torch.as_tensor(v)
        else:
            json_extra[k] = v
    json_state['extra'] = json_extra
    json_state['extra_tensors'] = extra_tensors
    # Copies on the CPU: safetensors refuses tensors that share memory (tied weights) and needs contiguity.
    tensors = {k: v.detach().to('cpu', copy=True).contiguous() for k, v in tensors.items()}
    return tensors, json_state


def save_train_state(save_dir, step, *, modules: Dict[str, torch.nn.Module], optimizer, extra: Optional[dict] = None,
                     samplers: Optional[Dict[str, CountingSampler]] = None, keep=3,
                     save_model: Optional[Callable[[], Any]] = None):
    """Save the full training state after `step` steps into <save_dir>/train_state (see the module doc).

    Collective over processes, outside the rank sections: every rank's random streams are gathered to
    process 0, which alone writes. extra: the trainer's own state, JSON-able values plus torch / numpy
    arrays. Modules and the optimizer are the same for every rank (gradients are averaged). save_model:
    called on process 0 before the state is written, it writes the model checkpoint of this step and
    returns {module name: its checkpoint file} for the modules it holds, whose weights the state then
    refers to (language/checkpoints.py verifies them on load). On a failed write (e.g. a full disk)
    every process raises CheckpointWriteError naming the file and errno; earlier states and checkpoints
    stay intact. Returns the path of the .json on process 0, None elsewhere.
    """
    extra = dict(extra or {})
    samplers = dict(samplers or {})
    process_rng, local_rank_rngs = _local_rng_states()
    rank_rngs = distributed.gather_ranks_to_root(local_rank_rngs)

    def write():
        # The weights of a module that save_model wrote as a model checkpoint are read back from it
        # on resume instead of being stored a second time.
        model_files = save_model_checkpoint(save_model, save_dir) if save_model is not None else {}
        tensors, json_state = _tensor_state({k: m for k, m in modules.items() if k not in model_files},
                                            optimizer, extra)
        json_state['module_checkpoints'] = {k: os.path.relpath(p, save_dir) for k, p in model_files.items()}
        return write_state_files(save_dir, step, tensors, dict(
            json_state,
            format=FORMAT,
            step=int(step),
            world_size=ranks.get_world_size(),
            modules=sorted(modules),
            samplers={k: s.batches_drawn for k, s in samplers.items()},
            # The ranks' streams, and the process's own (the same in every process).
            rng=dict(ranks=rank_rngs, process=process_rng),
        ), keep=keep)
    # Every rank learns whether rank 0 succeeded, so that none goes on into the next collective alone.
    return core.root_tries(write, fails=(Exception,))


# ---------------------------------------------------------------------------------------------------
# Load

@dataclass
class TrainState:
    step: int
    extra: Dict[str, Any]
    path: str  # the .json


def _check_keys(source, what, loaded: dict, expected: dict):
    """One-line errors for missing, unknown or mis-shaped tensors (state_dict loading prints many lines)."""
    missing = sorted(set(expected) - set(loaded))
    unknown = sorted(set(loaded) - set(expected))
    if missing:
        raise CheckpointError(f'{source}: {what} {missing[0]!r} is missing ({len(missing)} missing in all)')
    if unknown:
        raise CheckpointError(f'{source}: unknown {what} {unknown[0]!r} ({len(unknown)} unknown in all)')
    for k, v in expected.items():
        if tuple(loaded[k].shape) != tuple(v.shape):
            raise CheckpointError(f'{source}: {what} {k!r} has shape {list(loaded[k].shape)}, '
                                  f'this run expects {list(v.shape)}')


def load_latest_train_state(save_dir, *, modules: Dict[str, torch.nn.Module], optimizer,
                            samplers: Optional[Dict[str, CountingSampler]] = None,
                            at_most: Optional[int] = None) -> Optional[TrainState]:
    """Restore the newest valid training state of save_dir into modules, optimizer, samplers (replayed to
    their saved positions) and random streams (each rank its own, last); None when save_dir has none.
    at_most (read on process 0): the newest valid one at or before that step, where there is one.

    Collective over processes, outside the rank sections: process 0 picks the state (verifying
    checksums, warning about skipped ones) and tells the others, which then read the same files (the
    save dir must be visible to every process, as it already is for the reward model that train_policy
    loads). The state holds every rank's streams, so it resumes under any number of processes.
    """
    samplers = dict(samplers or {})
    chosen = None
    if ranks.is_root() and save_dir:
        try:
            chosen = choose_train_state(save_dir, at_most)
        except CheckpointError as e:
            chosen = e  # raised on every rank below, so that none waits for the others
    chosen = core.mpi_bcast(chosen)
    if isinstance(chosen, CheckpointError):
        raise chosen
    if chosen is None:
        return None
    step, sidecar = chosen
    tensors_path, source = state_paths(os.path.join(save_dir, TRAIN_STATE_SUBDIR), step)
    tensors = _read_state(sidecar, tensors_path, source, modules)

    for name, module in modules.items():
        if name in sidecar['module_checkpoints']:  # its weights are in the model checkpoint of this step
            state = checkpoints.load_checkpoint(os.path.join(save_dir, sidecar['module_checkpoints'][name]))
        else:
            prefix = f'modules.{name}.'
            state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        _check_keys(source, f'{name} tensor', state, module.state_dict())
        module.load_state_dict(state)

    _load_optimizer(optimizer, tensors, sidecar['optimizer'], source)

    extra = dict(sidecar['extra'])
    for k, kind in sidecar['extra_tensors'].items():
        t = tensors[f'extra.{k}']
        extra[k] = t.numpy() if kind == 'numpy' else t

    # Replay the query streams first: the replay draws random numbers, which the RNG restore then undoes.
    if set(sidecar['samplers']) != set(samplers):
        raise CheckpointError(f'{source} has positions of samplers {sorted(sidecar["samplers"])}, '
                              f'this run uses {sorted(samplers)}')
    for k, sampler in samplers.items():
        sampler.skip_to(sidecar['samplers'][k])
    _set_rng_states(sidecar['rng']['process'], sidecar['rng']['ranks'])
    return TrainState(step=step, extra=extra, path=source)


def _read_state(sidecar, tensors_path, source, modules):
    """The tensors of a training state that fits this run (its ranks and modules)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if sidecar['world_size'] != ranks.get_world_size():
        raise CheckpointError(f'{source} was written by {sidecar["world_size"]} ranks, this run has '
                              f'{ranks.get_world_size()}: resume with --mpi {sidecar["world_size"]}')
    if sorted(modules) != sidecar['modules']:
        raise CheckpointError(f'{source} holds modules {sidecar["modules"]}, this run saves {sorted(modules)}')
    try:
        return load_file(tensors_path)
    except SafetensorError as e:
        raise CheckpointError(f'{tensors_path} is not a valid safetensors file: {e}') from None


def _load_optimizer(optimizer, tensors, saved, source):
    """The optimizer's state from a training state's tensors (optimizer.<param index>.<name>) and its sidecar's
    scalars and param_groups."""
    opt = optimizer.state_dict()
    opt_state = {}
    for key, v in tensors.items():
        if key.startswith('optimizer.'):
            _, idx, k = key.split('.', 2)
            opt_state.setdefault(int(idx), {})[k] = v
    for idx, scalars in saved['state_scalars'].items():
        opt_state.setdefault(int(idx), {}).update(scalars)
    param_groups = saved['param_groups']
    if [g['params'] for g in param_groups] != [g['params'] for g in opt['param_groups']]:
        raise CheckpointError(f'{source}: the optimizer state is for other parameters than this run\'s')
    # JSON has no tuples: give back the types the optimizer uses (e.g. betas).
    param_groups = [{k: tuple(v) if isinstance(ours.get(k), tuple) else v for k, v in g.items()}
                    for g, ours in zip(param_groups, opt['param_groups'])]
    # load_state_dict moves the state tensors to each parameter's device and dtype.
    optimizer.load_state_dict(dict(state=opt_state, param_groups=param_groups))
