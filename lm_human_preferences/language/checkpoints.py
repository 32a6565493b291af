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
"""

import json
import os
import re

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from lm_human_preferences.language import encodings, model
from lm_human_preferences.utils import files, hyperparams

_CHECKPOINT_RE = re.compile(r'model-(\d+)\.safetensors')


def load_hparams(file):
    if not os.path.isfile(file):
        raise FileNotFoundError(f'{file} does not exist')
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


def write_checkpoint(dir, step, state, *, hparams, encoding):
    """Write a state dict (our keys) as `dir`'s checkpoint for `step`, with hparams.json and encoding."""
    ckpt_dir = os.path.join(dir, 'checkpoints')
    os.makedirs(ckpt_dir, exist_ok=True)
    hyperparams.save_json(hparams, os.path.join(dir, 'hparams.json'))
    name = encoding if isinstance(encoding, str) else encoding.name
    files.atomic_write(os.path.join(dir, 'encoding'), json.dumps(name).encode())
    path = os.path.join(ckpt_dir, f'model-{int(step)}.safetensors')
    files.atomic_write(path, save({k: v.detach().to('cpu', copy=True).contiguous() for k, v in state.items()}))
    return path


def save_checkpoint(dir, step, module, *, hparams, encoding):
    """Save module (a Model, Policy or reward model: one scope) to dir; call on one rank only."""
    return write_checkpoint(dir, step, _state_of(module), hparams=hparams, encoding=encoding)


def latest_checkpoint(dir):
    """Path of the highest-step checkpoint in <dir>/checkpoints, or None."""
    ckpt_dir = os.path.join(dir, 'checkpoints')
    if not os.path.isdir(ckpt_dir):
        return None
    steps = [int(m.group(1)) for m in map(_CHECKPOINT_RE.fullmatch, os.listdir(ckpt_dir)) if m]
    return os.path.join(ckpt_dir, f'model-{max(steps)}.safetensors') if steps else None


def load_checkpoint(dir_or_file):
    """The state dict (our keys -> CPU tensors) of a checkpoint file, or of a dir's latest one."""
    path = dir_or_file
    if os.path.isdir(dir_or_file):
        path = latest_checkpoint(dir_or_file)
        if path is None:
            raise FileNotFoundError(f'no checkpoint in {dir_or_file}/checkpoints (expected model-<step>.safetensors)')
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint {path} does not exist')
    files.refuse_pickle(path)
    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(f'{path} is not a valid safetensors checkpoint: {e}') from None


def _is_optional(key):
    return key.startswith('model.heads.') or key.startswith('reward_norm.')


@torch.no_grad()
def load_state(module, state, *, source):
    """Copy state (our keys) into module; see TrainedModel.init_model for the rules."""
    targets = _state_of(module)
    unknown = sorted(k for k in state if k not in targets and not _is_optional(k))
    if unknown:
        raise ValueError(f'unknown variable {unknown[0]!r} in {source} (the model has no such parameter'
                         f'{f"; {len(unknown)} unknown in all" if len(unknown) > 1 else ""})')
    for key, target in targets.items():
        if key not in state:
            if not _is_optional(key):
                raise ValueError(f'variable {key!r} is missing from {source}')
            print(f'Param {key} is missing from checkpoint {source}; keeping its initial value')
            continue
        value = state[key]
        if value.shape != target.shape:
            raise ValueError(f'variable {key!r} has shape {list(value.shape)} in {source}, but the model '
                             f'(built from its hparams.json) expects {list(target.shape)}')
        target.copy_(value)
