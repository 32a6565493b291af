"""Our model checkpoint format (ours; the original used TF Saver checkpoints). Everything saves and loads
models through the functions below; language/convert_tf.py writes the original's checkpoints into it.

    <dir>/hparams.json                            model HParams
    <dir>/encoding                                the encoding name, JSON-quoted as the original wrote it
    <dir>/checkpoints/model-<step>.safetensors    the state of one model scope: `model.<param>` for the
                                                  transformer and its heads (`model.h.0.attn.c_attn.w`,
                                                  `model.heads.value.w`, ...), `reward_norm.gain/bias`
                                                  for reward models
The keys are the original's TF variable names under the scope with '/' -> '.' and 'h<i>' -> 'h.<i>'
(see model.py). Safetensors only: loading never unpickles anything.

Every checkpoint carries the sha256 of its tensor data in its safetensors header (metadata `sha256`),
verified on every load: a flipped bit is an error naming the file, never a silently wrong weight. A
directory's newest checkpoint that fails is skipped with a warning for the one before it
(load_latest_checkpoint). Checkpoints written before we added the checksum load with a warning.
"""

import hashlib
import json
import os
import re
import warnings

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from lm_human_preferences.language import encodings, model
from lm_human_preferences.utils import files, hyperparams

_CHECKPOINT_RE = re.compile(r'model-(\d+)\.safetensors')
_NO_DIGEST = '0' * 64  # the checksum's place in the header, filled in once the data is hashed


class CheckpointWarning(UserWarning):
    """A checkpoint that is corrupt (skipped for an older one) or has no checksum."""


def load_hparams(file):
    if not os.path.isfile(file):
        # Ours: a model dir holds hparams.json beside its checkpoints/ (a run's save dir holds its models
        # in policy/ and reward_model/)
        raise FileNotFoundError(f'{file} does not exist: {os.path.dirname(file)} is not a model directory '
                                f'(one holds hparams.json and checkpoints/; a save dir holds them in policy/ '
                                f'and reward_model/)')
    hparams = model.HParams()
    hparams.override_from_json_file(file)
    return hparams


def read_encoding(model_dir):
    """The encoding named by <model_dir>/encoding (JSON-quoted as the original wrote it, or bare);
    Main when the file is absent (the original always used Main for non-test models)."""
    path = os.path.join(model_dir, 'encoding')
    if not os.path.isfile(path):
        return encodings.Main
    with open(path) as f:
        text = f.read().strip()
    try:
        name = json.loads(text)
    except json.JSONDecodeError:
        name = text
    return encodings.get(name)


def _state_of(module):
    """A module's state under our keys: a bare Model's parameters get the `model.` prefix."""
    prefix = 'model.' if isinstance(module, model.Model) else ''
    return {prefix + k: v for k, v in module.state_dict().items()}


def _checksummed(tensors):
    """The safetensors file of tensors, as chunks to write, with the sha256 of its data section in its
    header. Serialized once: the header is written with a placeholder of the digest's length, which is
    then replaced (the data section does not depend on the header's content)."""
    raw = save(tensors, metadata={'format': 'pt', 'sha256': _NO_DIGEST})
    n = int.from_bytes(raw[:8], 'little')
    data = memoryview(raw)[8 + n:]
    header = raw[8:8 + n].replace(_NO_DIGEST.encode(), hashlib.sha256(data).hexdigest().encode(), 1)
    return [raw[:8], header, data]


def write_checkpoint(dir, step, state, *, hparams, encoding):
    """Write a state dict (our keys) as `dir`'s checkpoint for `step`, with hparams.json and encoding."""
    ckpt_dir = os.path.join(dir, 'checkpoints')
    os.makedirs(ckpt_dir, exist_ok=True)
    hyperparams.save_json(hparams, os.path.join(dir, 'hparams.json'))
    name = encoding if isinstance(encoding, str) else encoding.name
    files.atomic_write(os.path.join(dir, 'encoding'), json.dumps(name).encode())
    path = checkpoint_path(dir, step)
    files.atomic_write(path, _checksummed({k: v.detach().to('cpu', copy=True).contiguous() for k, v in state.items()}))
    return path


def save_checkpoint(dir, step, module, *, hparams, encoding):
    """Save module (a Model, Policy or reward model: one scope) to dir; call on one rank only."""
    return write_checkpoint(dir, step, _state_of(module), hparams=hparams, encoding=encoding)


def checkpoint_path(dir, step):
    return os.path.join(dir, 'checkpoints', f'model-{int(step)}.safetensors')


def checkpoint_steps(dir):
    """Steps of the checkpoints in <dir>/checkpoints, newest first."""
    ckpt_dir = os.path.join(dir, 'checkpoints')
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted((int(m.group(1)) for m in map(_CHECKPOINT_RE.fullmatch, os.listdir(ckpt_dir)) if m), reverse=True)


def latest_checkpoint(dir):
    """Path of the highest-step checkpoint in <dir>/checkpoints, or None."""
    steps = checkpoint_steps(dir)
    return checkpoint_path(dir, steps[0]) if steps else None


def prune_checkpoints(dir, *, keep, protect=()):
    """Remove all but the `keep` newest checkpoints of dir (the original's Saver max_to_keep), never the
    steps in protect (those a training state refers to). Returns the removed steps."""
    removed = [step for step in checkpoint_steps(dir)[keep:] if step not in protect]
    for step in removed:
        os.remove(checkpoint_path(dir, step))
    return removed


def load_checkpoint(dir_or_file):
    """The state dict (our keys -> CPU tensors) of a checkpoint file, or of a dir's newest valid one;
    its checksum verified (a ValueError naming the file on a mismatch)."""
    if os.path.isdir(dir_or_file):
        return load_latest_checkpoint(dir_or_file)[1]
    path = dir_or_file
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint {path} does not exist')
    files.refuse_pickle(path)
    with open(path, 'rb') as f:
        data = f.read()
    try:
        n = int.from_bytes(data[:8], 'little')
        metadata = json.loads(data[8:8 + n]).get('__metadata__') or {}
        tensors = load(data)
    except (SafetensorError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f'{path} is not a valid safetensors checkpoint: {e}') from None
    if 'sha256' not in metadata:
        warnings.warn(f'{path} has no checksum (written before checkpoints carried one): loaded unverified',
                      CheckpointWarning, stacklevel=2)
    elif hashlib.sha256(memoryview(data)[8 + n:]).hexdigest() != metadata['sha256']:
        raise ValueError(f'{path} is corrupt: its data does not match the checksum in its header')
    return tensors


def load_latest_checkpoint(dir):
    """(path, state dict) of the newest checkpoint of dir that verifies, warning about each newer one
    skipped; FileNotFoundError when dir has none, ValueError when every one is corrupt."""
    errors = []
    for step in checkpoint_steps(dir):
        path = checkpoint_path(dir, step)
        try:
            return path, load_checkpoint(path)
        except ValueError as e:
            warnings.warn(f'skipping checkpoint {path}: {e}', CheckpointWarning, stacklevel=2)
            errors.append(str(e))
    if errors:
        older = f' (and the {len(errors) - 1} older ones fail too)' if len(errors) > 1 else ''
        raise ValueError(f'no valid checkpoint in {dir}/checkpoints: {errors[0]}{older}')
    raise FileNotFoundError(f'no checkpoint in {dir}/checkpoints (expected model-<step>.safetensors)')


def check_finite(name, value, source):
    """Ours: a weight holding NaN or inf is one line naming it and its file as it is loaded (the run would
    fail later, sampling, without saying which model)."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError(f'variable {name!r} in {source} holds non-finite values (NaN or inf): the model is broken')


def _is_optional(key):
    return key.startswith('model.heads.') or key.startswith('reward_norm.')


@torch.no_grad()
def load_state(module, state, *, source):
    """Copy state (our keys) into module; see TrainedModel.init_model for the rules. Returns the keys that
    kept their initial values (heads and reward_norm absent from state)."""
    targets = _state_of(module)
    unknown = sorted(k for k in state if k not in targets and not _is_optional(k))
    if unknown:
        raise ValueError(f'unknown variable {unknown[0]!r} in {source} (the model has no such parameter'
                         f'{f"; {len(unknown)} unknown in all" if len(unknown) > 1 else ""})')
    fresh = []
    for key, target in targets.items():
        if key not in state:
            if not _is_optional(key):
                raise ValueError(f'variable {key!r} is missing from {source}')
            fresh.append(key)
            continue
        value = state[key]
        if value.shape != target.shape:
            raise ValueError(f'variable {key!r} has shape {list(value.shape)} in {source}, but the model '
                             f'(built from its hparams.json) expects {list(target.shape)}')
        check_finite(key, value, source)
        target.copy_(value)
    return fresh
