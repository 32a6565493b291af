"""Ours: an offline experiment's published initial model and labels (<its package>/published/), the files every
CPU starts from, as every run of the original starts from the GPT-2 checkpoint and the human labels OpenAI
published. A CPU's kernels round the pretraining and the label sampling their own way (bf16 products where native,
fp32's sums in another order elsewhere), so without them each kind of CPU would run another experiment; and making
them is two thirds of a first run on a CPU without native bf16 (a 2-core AMD Zen 3: 554 s pretraining and 538 s of
labels of 1,671).

published/published.json indexes them: the initial model's dir and its pretraining key (pretrain.py), each labels
file and its key (labels.labels_key), and for each where and how it was made. A run uses them when what it would
make is what they are (MADE_WITH: how a file was made is recorded, not matched); a run of other pretraining hparams,
another seed or another task makes its own as before. Published from finished runs:

    python launch.py publish sentiment_mini SAVE_DIR[,SAVE_DIR ...]

(each SAVE_DIR a finished run of the experiment: its initial model and its <experiment>_labels.json.)
"""

import gzip
import json
import os
import shutil
from dataclasses import dataclass

INDEX = 'published.json'
# What in a key says how a file was made, not what it is: another CPU (the products' dtype, the sampler's
# precision), the sampling's batches and ranks make other bits of the same experiment.
MADE_WITH = dict(initial_model=('products_dtype',), labels=('rollout_batch_size', 'bf16', 'sampler', 'ranks'))


@dataclass(frozen=True)
class Published:
    """A published file (the initial model's dir, or a labels file) and a few words on where it was made; for labels
    of which only the first records are asked for, how many (None: the whole file)."""
    path: str
    made: str
    num_labels: int | None = None


def _what(key, kind):
    return {k: v for k, v in key.items() if k not in MADE_WITH[kind]}


def _index(exp):
    path = os.path.join(exp.published, INDEX) if exp.published else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _made(entry):
    made = entry['made']
    how = ', '.join(f"{k} {entry['key'][k]}" for k in MADE_WITH[entry['kind']] if k in entry['key'])
    return f"made on {made['chip'] or 'a CPU'}: {how}, torch {made['torch']}"


def initial_model(exp, key):
    """The published initial model of pretraining key `key` (pretrain._pretrain_key), or None."""
    entry = _index(exp).get('initial_model')
    if entry is None or _what(entry['key'], 'initial_model') != _what(key, 'initial_model'):
        return None
    return Published(os.path.join(exp.published, entry['dir']), _made(entry))


def labels(exp, key):
    """The published labels of labels key `key` (labels.labels_key), or None: a file of that key, or the first
    key['num_labels'] records of a file of more that is otherwise the same and was made on one rank. One rank draws
    its labels in batches of rollout_batch_size from one stream of each kind and keeps the first num_labels
    (labels.make_labels), so a file's first n records are what making n would write, for n at least its batch."""
    num_labels, entries = key['num_labels'], _index(exp).get('labels', [])
    for entry in entries:
        if _what(entry['key'], 'labels') == _what(key, 'labels'):
            return Published(os.path.join(exp.published, entry['file']), _made(entry))
    for entry in entries:
        made = entry['key']
        if (_what(dict(made, num_labels=num_labels), 'labels') == _what(key, 'labels') and made['ranks'] == 1
                and made['rollout_batch_size'] <= num_labels < made['num_labels']):
            return Published(os.path.join(exp.published, entry['file']),
                             f"{_made(entry)}; its first {num_labels} of {made['num_labels']}", num_labels)
    return None


def read_labels(found: Published):
    """A published labels file's records that `found` asks for, as the bytes make_labels would write for them (the
    original's best_of_N JSON; the file is gzipped: ~5x smaller)."""
    with gzip.open(found.path, 'rb') as f:
        data = f.read()
    if found.num_labels is None:
        return data
    return json.dumps(json.loads(data)[:found.num_labels]).encode()


def publish(exp, save_dirs):
    """Copies the initial model and the labels of finished runs of `exp` (save dirs) into exp.published and indexes
    them: the model of the first run (every run's must be the same), each run's labels under its key."""
    import torch

    from lm_human_preferences import train_reward
    from lm_human_preferences.offline import labels as labels_module
    from lm_human_preferences.utils import cpu

    made = dict(chip=cpu.chip(), torch=torch.__version__)  # the runs' CPU: publish where they ran
    os.makedirs(exp.published, exist_ok=True)
    index = _index(exp)
    entries = {json.dumps(e['key'], sort_keys=True): e for e in index.get('labels', [])}
    for save_dir in save_dirs:
        hparams = train_reward.HParams()
        hparams.override_from_json_file(os.path.join(save_dir, 'train_reward_hparams.json'))
        model_dir = hparams.task.policy.initial_model
        with open(os.path.join(model_dir, 'pretrain.json')) as f:
            model_key = json.load(f)
        target = os.path.join(exp.published, 'initial_model')
        if 'initial_model' not in index:
            shutil.copytree(model_dir, target)
            index['initial_model'] = dict(kind='initial_model', dir='initial_model', key=model_key, made=made)
        elif index['initial_model']['key'] != model_key or weights_sha256(model_dir) != weights_sha256(target):
            raise ValueError(f'{save_dir}: its initial model ({model_dir}) is not the published one ({target}): '
                             f'publish runs of one initial model')
        seed = hparams.run.seed or 0
        num_labels = hparams.labels.num_train + exp.held_out_labels
        hparams.labels.source = exp.name
        key = labels_module.labels_key(exp, hparams, num_labels=num_labels, seed=seed)
        name = f'labels-seed{seed}-{num_labels}.json.gz'
        with open(os.path.join(save_dir, f'{exp.name}_labels.json'), 'rb') as f, \
                gzip.GzipFile(os.path.join(exp.published, name), 'wb', mtime=0) as out:
            out.write(f.read())
        entries[json.dumps(key, sort_keys=True)] = dict(kind='labels', file=name, key=key, made=made)
        print(f'{exp.name}: published {name} (seed {seed}, {num_labels} labels) from {save_dir}')
    index['labels'] = sorted(entries.values(), key=lambda e: e['file'])
    with open(os.path.join(exp.published, INDEX), 'w') as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.write('\n')


def weights_sha256(model_dir):
    """The sha256 of a model dir's checkpoint, as labels.labels_key names an initial model."""
    from lm_human_preferences.language import checkpoints
    from lm_human_preferences.utils import files
    return files.sha256_file(checkpoints.latest_checkpoint(model_dir))

