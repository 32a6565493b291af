"""The on-disk format of a training state (ours: the original could not resume; training/train_state.py
says what a state holds and how a run resumes from one):

    <dir>/train_state/state-<step>.safetensors   tensors: `modules.<name>.<state_dict key>` for each
                                                 module not in a model checkpoint of the same step,
                                                 `optimizer.<param index>.<key>` (Adam m, v), `extra.<key>`
                                                 for tensors among the trainer's extras
    <dir>/train_state/state-<step>.json          everything else (step, the trainer's scalar extras such
                                                 as the KL coefficient, optimizer param groups, how many
                                                 batches each query sampler has drawn, the random
                                                 streams of every rank and of the processes, the model
                                                 checkpoints holding module weights), the sha256 of the
                                                 .safetensors file and a sha256 of the JSON itself

The .json is written last and is the commit marker: a step whose .json is absent does not exist. Both
files are written atomically (utils/files.py); the last `keep` states are kept. On load, the newest
state whose checksums verify (those of the model checkpoints it refers to too) is used; every newer one
that does not is skipped with a warning, never loaded. Nothing is unpickled: tensors come from
safetensors, the rest from JSON, and a pickle / torch.save file is refused by its first bytes.
"""

import hashlib
import json
import os
import re
import warnings

from lm_human_preferences.language import checkpoints
from lm_human_preferences.utils import files

TRAIN_STATE_SUBDIR = 'train_state'
FORMAT = 'lm_human_preferences train state v2'
_STATE_RE = re.compile(r'state-(\d+)\.json')


class CheckpointError(ValueError):
    """A training state that cannot be saved or loaded; the message is one line naming the file. (A
    ValueError, as other bad inputs: launch.py reports it in one line.)"""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed (e.g. ENOSPC); the temporary file is removed and earlier states are kept."""


class TrainStateWarning(UserWarning):
    """A corrupt or truncated training state was skipped."""


# ---------------------------------------------------------------------------------------------------
# Paths

def _canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(',', ':')).encode()


def state_paths(state_dir, step):
    base = os.path.join(state_dir, f'state-{int(step)}')
    return base + '.safetensors', base + '.json'


def train_state_steps(save_dir):
    """Steps of the committed (.json present) training states in save_dir, newest first."""
    state_dir = os.path.join(save_dir, TRAIN_STATE_SUBDIR)
    if not os.path.isdir(state_dir):
        return []
    return sorted((int(m.group(1)) for m in map(_STATE_RE.fullmatch, os.listdir(state_dir)) if m), reverse=True)


# ---------------------------------------------------------------------------------------------------
# Write

def _one_line(e: OSError):
    return f'[Errno {e.errno}] {e.strerror}' if e.errno is not None else str(e)


def save_model_checkpoint(save_model, save_dir):
    try:
        return save_model()
    except OSError as e:
        err = CheckpointWriteError(f'could not save the model checkpoint in {save_dir}: {_one_line(e)} '
                                   f'(earlier checkpoints are kept)')
        err.errno = e.errno
        raise err from e


def write_state_files(save_dir, step, tensors, sidecar, *, keep):
    from safetensors.torch import save
    state_dir = os.path.join(save_dir, TRAIN_STATE_SUBDIR)
    tensors_path, sidecar_path = state_paths(state_dir, step)
    path = tensors_path
    try:
        os.makedirs(state_dir, exist_ok=True)
        files.remove_stale_temporaries(state_dir)
        data = save(tensors)
        sidecar = dict(sidecar, tensors=os.path.basename(tensors_path),
                       tensors_sha256=hashlib.sha256(data).hexdigest(), tensors_bytes=len(data))
        sidecar['sha256'] = hashlib.sha256(_canonical(sidecar)).hexdigest()
        sidecar_bytes = json.dumps(sidecar, indent=1, sort_keys=True).encode()
        if os.path.exists(sidecar_path):
            # Re-saving a committed step (a rerun saves its state again): the new files are written beside it
            # and renamed over it, the .json last, so that a write that fails (a full disk) leaves the committed
            # state as it was; tensors of the same bytes are kept as they are.
            staged = f'.tmp-{os.getpid()}'  # files.remove_stale_temporaries' pattern: a kill leaves no state
            same = os.path.isfile(tensors_path) and files.sha256_file(tensors_path) == sidecar['tensors_sha256']
            if not same:
                files.atomic_write(tensors_path + staged, data)
            del data
            path = sidecar_path
            files.atomic_write(sidecar_path + staged, sidecar_bytes)
            if not same:
                os.replace(tensors_path + staged, tensors_path)
            os.replace(sidecar_path + staged, sidecar_path)
            files.fsync_dir(state_dir)
        else:
            files.atomic_write(tensors_path, data)
            del data
            path = sidecar_path
            files.atomic_write(sidecar_path, sidecar_bytes)
    except OSError as e:
        for staged_path in (tensors_path + f'.tmp-{os.getpid()}', sidecar_path + f'.tmp-{os.getpid()}'):
            if os.path.exists(staged_path):
                os.remove(staged_path)
        if path == sidecar_path and os.path.exists(tensors_path) and not os.path.exists(sidecar_path):
            os.remove(tensors_path)  # its .json never arrived: the tensors alone are no state
        err = CheckpointWriteError(f'could not save the training state to {path}: {_one_line(e)} '
                                   f'(earlier states in {state_dir} are kept)')
        err.errno = e.errno
        raise err from e
    _prune(state_dir, keep=keep)
    return sidecar_path


def _prune(state_dir, *, keep):
    steps = train_state_steps(os.path.dirname(state_dir))
    for step in steps[keep:]:
        for path in reversed(state_paths(state_dir, step)):  # the .json (commit marker) first
            if os.path.exists(path):
                os.remove(path)
    # Tensors whose .json never arrived (a crash between the two renames).
    committed = set(steps)
    for name in os.listdir(state_dir):
        m = re.fullmatch(r'state-(\d+)\.safetensors', name)
        if m and int(m.group(1)) not in committed:
            os.remove(os.path.join(state_dir, name))


# ---------------------------------------------------------------------------------------------------
# Read

def _verified_sidecar(state_dir, step):
    """The sidecar dict of step if both files verify; raises CheckpointError naming the problem otherwise."""
    tensors_path, sidecar_path = state_paths(state_dir, step)
    try:
        files.refuse_pickle(sidecar_path)
        with open(sidecar_path, 'rb') as f:
            sidecar = json.loads(f.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f'{sidecar_path} is not valid JSON ({e})') from None
    if not isinstance(sidecar, dict) or sidecar.get('format') != FORMAT:
        raise CheckpointError(f'{sidecar_path} is not a training state of ours (format {FORMAT!r})')
    claimed = sidecar.pop('sha256', None)
    if claimed != hashlib.sha256(_canonical(sidecar)).hexdigest():
        raise CheckpointError(f'{sidecar_path}: checksum mismatch (the file is corrupt)')
    if sidecar['step'] != step:
        raise CheckpointError(f'{sidecar_path} holds step {sidecar["step"]}, not {step}')
    if not os.path.isfile(tensors_path):
        raise CheckpointError(f'{tensors_path} is missing')
    files.refuse_pickle(tensors_path)
    size = os.path.getsize(tensors_path)
    if size != sidecar['tensors_bytes']:
        raise CheckpointError(f'{tensors_path} has {size} bytes, expected {sidecar["tensors_bytes"]} (truncated?)')
    if files.sha256_file(tensors_path) != sidecar['tensors_sha256']:
        raise CheckpointError(f'{tensors_path}: checksum mismatch (the file is corrupt)')
    for path in sidecar['module_checkpoints'].values():  # the weights the state refers to
        try:
            checkpoints.load_checkpoint(os.path.join(os.path.dirname(state_dir), path))
        except (OSError, ValueError) as e:
            raise CheckpointError(f'{sidecar_path} refers to a model checkpoint that fails: {e}') from None
    return sidecar


def referenced_checkpoint_steps(save_dir):
    """The steps of the model checkpoints that save_dir's training states refer to (not to be pruned)."""
    steps = set()
    for step in train_state_steps(save_dir):
        try:
            with open(state_paths(os.path.join(save_dir, TRAIN_STATE_SUBDIR), step)[1]) as f:
                refs = json.load(f).get('module_checkpoints', {}).values()
        except (OSError, ValueError):
            continue
        steps.update(int(m.group(1)) for m in (re.search(r'model-(\d+)\.safetensors$', p) for p in refs) if m)
    return steps


def choose_train_state(save_dir, at_most=None):
    """(step, sidecar) of the newest verified state, warning about each newer one skipped; None if none.
    at_most: the newest verified state at or before it, if one is (else the newest verified)."""
    state_dir = os.path.join(save_dir, TRAIN_STATE_SUBDIR)
    skipped, passed_over = [], None
    for step in train_state_steps(save_dir):
        try:
            sidecar = _verified_sidecar(state_dir, step)
        except (ValueError, OSError) as e:  # CheckpointError, or refuse_pickle's ValueError
            warnings.warn(f'skipping training state {step} in {state_dir}: {e}', TrainStateWarning, stacklevel=3)
            skipped.append(step)
            continue
        if at_most is None or step <= at_most:
            return step, sidecar
        passed_over = passed_over or (step, sidecar)
    if passed_over:
        return passed_over
    if skipped:
        raise CheckpointError(f'no valid training state in {state_dir}: every one (steps {skipped}) is corrupt; '
                              f'move the directory away to start afresh')
    return None
