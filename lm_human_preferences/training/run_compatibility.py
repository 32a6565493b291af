"""Whether a rerun is the same run as the one in its save dir (ours: the original could not resume): its
hparams must match those the save dir recorded, but for the save dir itself and what a rerun may change."""

import json
import os

from lm_human_preferences.utils import core


class IncompatibleRunError(ValueError):
    """The save dir holds a run with other hyperparameters."""


def _comparable(hparams_dict, save_dir):
    """Flat hparams with the save dir factored out: fields named save_dir are dropped and paths inside
    the run's save dir (e.g. train_policy's rewards.trained_model = <save_dir>/reward_model) are made
    relative, so that a moved or differently spelled save dir still resumes."""
    flat = core.flatten_dict(json.loads(json.dumps(hparams_dict)), sep='.')
    root = flat.get('run.save_dir') if save_dir is None else save_dir
    out = {}
    for k, v in flat.items():
        if k.split('.')[-1] == 'save_dir':
            continue
        if root and isinstance(v, str) and (v == root or v.startswith(root.rstrip('/') + '/')):
            v = '<save_dir>' + v[len(root.rstrip('/')):]
        out[k] = v
    return out


def check_resume_compatible(save_dir, hparams_dict, filename, *, ignore=()):
    """Whether save_dir/filename (a trainer's saved hparams) exists; raises IncompatibleRunError if it
    holds other hparams than hparams_dict (ours, to_nested_dict()).

    Every field must match except `run.save_dir` (and paths inside it, compared relative to it) and the
    fields named in `ignore` (dotted keys, matched as the key or its last parts, e.g. `run.wandb` matches
    `rewards.train_new_model.run.wandb`): a resumed run must be the same run, or its results would mix
    two configurations. Not collective: training/run.py calls it on one process.
    """
    path = os.path.join(save_dir, filename)
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IncompatibleRunError(f'{path} is not valid JSON ({e}); choose another --save_dir or remove it') from None
    theirs = _comparable(saved, None)
    ours = _comparable(hparams_dict, save_dir)
    diffs = sorted(k for k in set(theirs) | set(ours)
                   if not any(k == i or k.endswith('.' + i) for i in ignore)
                   and theirs.get(k, '<unset>') != ours.get(k, '<unset>'))
    if diffs:
        k = diffs[0]
        more = f' (and {len(diffs) - 1} more differences)' if len(diffs) > 1 else ''
        raise IncompatibleRunError(
            f'{save_dir} holds another run: its {filename} has {k}={theirs.get(k, "<unset>")!r}, this run has '
            f'{k}={ours.get(k, "<unset>")!r}{more}. To resume that run, rerun its command with the same '
            f'hyperparameters; to start a new run, give it another NAME (or --save_dir)')
    return True
