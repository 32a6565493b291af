"""Convert the original's TensorFlow checkpoints into our format (see trained_models.py).

Reads any checkpoint the original wrote or loaded:
  - a GPT-2 release directory: `checkpoint`, `model.ckpt.*`, `hparams.json`; variables `model/...`;
  - a train_reward save dir (`<save_dir>/reward_model`): `hparams.json`, `encoding`, `checkpoints/`;
    variables `reward_model/model/...` (head `heads/reward`) and `reward_model/reward_norm/{gain,bias}`;
  - a train_policy save dir (`<save_dir>/policy`): the same files; variables `policy/model/...` with
    `heads/value`; the checkpoint named by the `checkpoints/checkpoint` state file (e.g. model.ckpt-7).
The trainers' checkpoints also hold other models (`ref_policy/...`, the score model's `reward_model/...`
in a policy save), optimizer slots (`.../adam`, `.../adam_1`, `beta1_power`, ...) and step counters:
only the chosen scope is converted, and its optimizer slots are skipped.

TensorFlow is imported only inside the functions that read a checkpoint: nothing else needs it.
"""

import contextlib
import os
import re

import numpy as np
import torch

from lm_human_preferences.language import checkpoints, model
from lm_human_preferences.utils import optional_deps

# Optimizer slots (the original's AdamOptimizer named 'adam'; TF's default name is 'Adam') and counters.
_SKIPPED = re.compile(r'(.*/)?(Adam|Adam_1|adam|adam_1|beta1_power(_\d+)?|beta2_power(_\d+)?|global_step|train_step)$')


def find_tf_checkpoint(src):
    """The checkpoint prefix (e.g. .../checkpoints/model.ckpt-7) for src: a checkpoint prefix, or a
    directory whose `checkpoint` or `checkpoints/checkpoint` state file names one (the original's
    TrainedModel.checkpoint() order). Returns None when there is none. Needs no TensorFlow."""
    if os.path.exists(src + '.index'):
        return src
    for ckpt_dir in (src, os.path.join(src, 'checkpoints')):
        state_file = os.path.join(ckpt_dir, 'checkpoint')
        if not os.path.isfile(state_file):
            continue
        with open(state_file) as f:
            m = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', f.read(), re.MULTILINE)
        if m is None:
            raise ValueError(f'{state_file} has no model_checkpoint_path line')
        path = m.group(1)
        if not os.path.isabs(path):
            path = os.path.join(ckpt_dir, path)
        elif not os.path.exists(path + '.index'):
            # Saved with absolute paths on another machine: look beside the state file.
            path = os.path.join(ckpt_dir, os.path.basename(path))
        if not os.path.exists(path + '.index'):
            raise FileNotFoundError(f'{state_file} names checkpoint {m.group(1)!r}, but {path}.index does not exist')
        return path
    return None


def model_dir_of(prefix):
    """The directory holding hparams.json (and encoding) for a checkpoint prefix."""
    d = os.path.dirname(os.path.abspath(prefix))
    return os.path.dirname(d) if os.path.basename(d) == 'checkpoints' else d


def expected_model_variables(hparams: model.HParams):
    """TF name (under the model scope) -> TF shape of every transformer variable for these hparams."""
    e, v = hparams.n_embd, hparams.n_vocab
    shapes = {'wte': [v, e], 'wpe': [hparams.n_ctx, e], 'ln_f/g': [e], 'ln_f/b': [e]}
    for i in range(hparams.n_layer):
        shapes.update({
            f'h{i}/ln_1/g': [e], f'h{i}/ln_1/b': [e],
            f'h{i}/attn/c_attn/w': [1, e, 3 * e], f'h{i}/attn/c_attn/b': [3 * e],
            f'h{i}/attn/c_proj/w': [1, e, e], f'h{i}/attn/c_proj/b': [e],
            f'h{i}/ln_2/g': [e], f'h{i}/ln_2/b': [e],
            f'h{i}/mlp/c_fc/w': [1, e, 4 * e], f'h{i}/mlp/c_fc/b': [4 * e],
            f'h{i}/mlp/c_proj/w': [1, 4 * e, e], f'h{i}/mlp/c_proj/b': [e],
        })
    return shapes


def torch_name(name):
    """Our state-dict key for a TF name relative to the scope: 'model/h3/attn/c_attn/w' -> 'model.h.3.attn.c_attn.w'."""
    return re.sub(r'(^|/)h(\d+)/', r'\1h.\2/', name).replace('/', '.')


def name_map(variables, hparams: model.HParams, *, scope, source):
    """Map a checkpoint's (name, shape) list to {tf_name: our key} for one scope ('' = the GPT-2
    release layout), checking that every variable of the model is there with the shape hparams.json
    implies. Raises naming the first unknown, missing or mis-shaped variable."""
    prefix = f'{scope}/' if scope else ''
    expected = {f'model/{k}': s for k, s in expected_model_variables(hparams).items()}
    head_names = set()
    mapping = {}
    for name, shape in variables:
        if not name.startswith(prefix) or _SKIPPED.match(name):
            continue  # another model in the same checkpoint, an optimizer slot or a step counter
        rel = name[len(prefix):]
        shape = list(shape)
        m = re.fullmatch(r'model/heads/([^/]+)/(w|b)', rel)
        if rel in expected:
            want = expected[rel]
        elif m:
            head_names.add(m.group(1))
            want = [hparams.n_embd] if m.group(2) == 'w' else []
        elif rel in ('reward_norm/gain', 'reward_norm/bias'):
            want = []
        else:
            raise ValueError(f'unknown variable {name!r} {shape} in {source} (converting scope {scope!r})')
        if shape != want:
            raise ValueError(f'variable {name!r} has shape {shape} in {source}, but hparams.json '
                             f'({_describe(hparams)}) implies {want}')
        mapping[name] = torch_name(rel)
    required = list(expected) + [f'model/heads/{h}/{p}' for h in sorted(head_names) for p in ('w', 'b')]
    if any(k.startswith('reward_norm/') for k in (n[len(prefix):] for n in mapping)):
        required += ['reward_norm/gain', 'reward_norm/bias']
    present = {n[len(prefix):] for n in mapping}
    for rel in required:
        if rel not in present:
            raise ValueError(f'variable {prefix + rel!r} is missing from {source} '
                             f'(hparams.json: {_describe(hparams)}; converting scope {scope!r})')
    return mapping


def _describe(hparams):
    return ', '.join(f'{k}={getattr(hparams, k)}' for k in ('n_vocab', 'n_ctx', 'n_embd', 'n_head', 'n_layer'))


def infer_scope(variables, model_dir, *, source):
    """'' for the GPT-2 release layout (model/...); else the model dir's name (policy, reward_model)
    when the checkpoint has that scope, as the original's save dirs are laid out."""
    scopes = sorted({name.split('/')[0] for name, _ in variables if not _SKIPPED.match(name)})
    if 'model' in scopes:
        return ''
    if os.path.basename(model_dir) in scopes:
        return os.path.basename(model_dir)
    raise ValueError(f'cannot tell which model to convert from {source}: it holds scopes {scopes}; pass scope=')


@contextlib.contextmanager
def _unreadable_checkpoint_errors(tf, prefix):
    """TensorFlow's errors reading the checkpoint at prefix as one line naming it (TF's messages span
    lines). Its reader raises OpError for a garbage index or a checksum mismatch, and, from its C++
    bindings, IndexError for a truncated data file ("Read less bytes than requested") or ValueError."""
    try:
        yield
    except (tf.errors.OpError, IndexError, ValueError) as e:
        message = str(e).strip()
        reason = message.splitlines()[0] if message else type(e).__name__
        raise ValueError(f'{prefix} is not a readable TensorFlow checkpoint (truncated or corrupt: {reason})') from None


def convert_tf_checkpoint(src, dst, *, scope=None):
    """Convert the TF checkpoint in src (a model dir or a checkpoint prefix) into our format in dst.

    scope: which model of the checkpoint ('' for the GPT-2 release layout, 'policy', 'reward_model');
    by default inferred (see infer_scope). Returns the path of the written checkpoint.
    """
    prefix = find_tf_checkpoint(src)
    if prefix is None:
        raise FileNotFoundError(f'no TensorFlow checkpoint in {src} (looked for {src}.index, {src}/checkpoint '
                                f'and {src}/checkpoints/checkpoint)')
    model_dir = model_dir_of(prefix)
    hparams_file = os.path.join(model_dir, 'hparams.json')
    if not os.path.isfile(hparams_file):
        raise FileNotFoundError(f'{hparams_file} does not exist (needed to convert {prefix})')
    hparams = checkpoints.load_hparams(hparams_file)
    encoding = checkpoints.read_encoding(model_dir)

    # TF's C++ log lines (its oneDNN and CPU-feature notices at import) would bury our one-line errors. The oneDNN
    # notice ignores the log level: only turning oneDNN off stops it, which changes no value (conversion runs no op).
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
    # Only here: nothing but conversion needs TensorFlow (the `tf` extra).
    tf = optional_deps.require('tensorflow', extra='tf', needed_for=f'converting the TensorFlow checkpoint {prefix}')
    with _unreadable_checkpoint_errors(tf, prefix):
        variables = tf.train.list_variables(prefix)
    if scope is None:
        scope = infer_scope(variables, model_dir, source=prefix)
    mapping = name_map(variables, hparams, scope=scope, source=prefix)
    with _unreadable_checkpoint_errors(tf, prefix):
        reader = tf.train.load_checkpoint(prefix)
        state = {}
        for name, key in mapping.items():
            value = np.asarray(reader.get_tensor(name), dtype=np.float32)
            if value.ndim == 3:
                value = value[0]  # conv1x1 weights: [1, nx, nf] -> [nx, nf]
            state[key] = torch.tensor(value)  # a copy; scalars stay 0-d
    m = re.search(r'-(\d+)$', prefix)
    step = int(m.group(1)) if m else 0
    return checkpoints.write_checkpoint(dst, step, state, hparams=hparams, encoding=encoding)
