"""Ours: what a model name names and where its files come from, for language/trained_models.py: a GPT-2 release,
an original TF model dir or its https URL, our model dir, a Hugging Face GPT-2 (a local folder or a hub name), an
offline experiment's initial model (OFFLINE_MODELS: each experiment declares its own); downloaded once, and
converted once into a cache dir under saved_models_dir()."""

import contextlib
import fcntl
import hashlib
import os
import re

from lm_human_preferences.language import checkpoints, convert_tf, hf_import
from lm_human_preferences.utils import gcs

GPT2_RELEASES = ('124M', '355M', '774M', '1558M')  # the names OpenAI published them under
GPT2_N_CTX = 1024  # every GPT-2 release's context length
# The initial models the offline experiments make, by name: their context length. Each experiment declares its own
# (offline/experiment.OfflineExperiment.declare), as a dataset registers its name: this layer asks no registry of
# experiments.
OFFLINE_MODELS = {}


def local_dir(name, savedir=None):
    """The local model dir of TrainedModel(name, savedir=...): savedir, or what the name names (model_source),
    downloaded or converted once as needed; None for a GPT-2 release (TrainedModel downloads it)."""
    # The original's default savedir was gs://gpt-2/models/<name>; a name that is a path is a
    # local model dir, and an https URL is an original TF run dir (e.g. OpenAI's released
    # runs/descriptiveness/reward_model), downloaded once; ours, a hub name is a Hugging Face model.
    if savedir:
        source = 'url' if gcs.is_url(savedir) else 'dir'
    else:
        source = model_source(name)
    local = savedir or (None if source == 'release' else name)
    if source == 'url':
        local = download_tf_model_dir(local)
    elif source == 'hub':
        local = hf_import.download(name)
    elif source == 'offline':
        local = offline_model_dir(name)
        if not os.path.isdir(local):
            raise FileNotFoundError(f"model {name!r} is the {name} experiment's initial model, which is "
                                    f"not made yet: python launch.py train_policy {name} NAME makes it in "
                                    f"{local}")
    if local is not None:
        check_dir(local)
    if local is not None and hf_import.is_hf_folder(local):
        local = convert_hf_folder(local, label=name if source == 'hub' else None)
    return local


def converted_release(name, download, *, scope=None):
    """Our checkpoint of the GPT-2 release `name`, converted once into saved_models_dir()/<name> from the files
    download() fetches (the ranks' processes wait for the one converting)."""
    dst = os.path.join(gcs.saved_models_dir(), name)
    if checkpoints.latest_checkpoint(dst) is None:
        src = download()
        with _file_lock(dst + '.lock'):
            if checkpoints.latest_checkpoint(dst) is None:
                print(f'converting {src} -> {dst}')
                convert_tf.convert_tf_checkpoint(src, dst, scope=scope)
    return checkpoints.latest_checkpoint(dst)


def converted_tf_checkpoint(savedir, *, scope=None):
    """Our checkpoint converted once from the original TF checkpoint in savedir (one line when there is none)."""
    prefix = convert_tf.find_tf_checkpoint(savedir)
    if prefix is None:
        raise FileNotFoundError(
            f'no checkpoint in {savedir}: expected {savedir}/checkpoints/model-<step>.safetensors '
            f'or a TensorFlow checkpoint state file {savedir}/checkpoint or '
            f'{savedir}/checkpoints/checkpoint')
    # Converted once per checkpoint: the cache key is the checkpoint's path, its mtime and the scope.
    index = prefix + '.index'
    key = f'{os.path.realpath(prefix)}|{os.stat(index).st_mtime_ns}|{scope}'
    dst = _convert_once(prefix, os.path.basename(os.path.normpath(savedir)), key,
                        lambda dst: convert_tf.convert_tf_checkpoint(prefix, dst, scope=scope))
    return checkpoints.latest_checkpoint(dst)


def check_dir(path):
    if not os.path.isdir(path):
        raise FileNotFoundError(f'model directory {path} ' + (
            'is a file, not a directory' if os.path.exists(path) else 'does not exist'))


def _convert_once(source, label, key, convert):
    """Our model dir converted from source by convert(dst), once: saved_models_dir()/converted/<label>-<hash
    of key> (another key, another dir); the ranks' processes wait for the one converting."""
    dst = os.path.join(gcs.saved_models_dir(), 'converted', f'{label}-{hashlib.sha1(key.encode()).hexdigest()[:16]}')
    with _file_lock(dst + '.lock'):
        if checkpoints.latest_checkpoint(dst) is None:
            print(f'converting {source} -> {dst}')
            convert(dst)
    return dst


def convert_hf_folder(folder, *, label=None):
    """Ours: our model dir converted from a Hugging Face GPT-2 folder (hf_import), cached and keyed by the
    paths, sizes and mtimes of the files it reads, so a changed folder is converted again. label: the
    name in the cache dir's (a hub name's snapshot folder is named by its commit)."""
    label = 'hf-' + (label or os.path.basename(os.path.normpath(folder))).replace('/', '--')
    key = '|'.join(f'{os.path.realpath(p)}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}'
                   for p in hf_import.source_files(folder))
    return _convert_once(folder, label, key, lambda dst: hf_import.convert(folder, dst))


# Ours: the hub's GPT-2 names without an owner (its legacy canonical models). Any other name without a '/'
# is a typo of ours ('125M', 'Gpt2'), not a hub model: one line at launch, not a failed download later.
HUB_GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', 'distilgpt2')


def offline_model_dir(name):
    """Ours: where the offline experiment `name` keeps the initial model it makes."""
    return os.path.join(gcs.saved_models_dir(), name)


# What task.policy.initial_model (and rewards.trained_model) accept, for the one-line errors.
ACCEPTED = (f"{', '.join(GPT2_RELEASES)} (OpenAI's GPT-2, downloaded), test, a model dir (ours, or an original "
            f"TF one, or its https URL), a Hugging Face GPT-2 folder or hub name ({', '.join(HUB_GPT2_NAMES)} "
            f"or owner/name, e.g. openai-community/gpt2)")


def model_source(name):
    """What a model name names, without downloading anything: 'test', 'release' (GPT-2 from OpenAI),
    'url' (an original TF model dir), 'dir' (a local path: ours, an original TF or a Hugging Face model dir),
    or ours, 'hub' (a Hugging Face hub name; a local path of that name wins, as in transformers) and
    'offline' (an offline experiment's model, which its command makes). A ValueError in one line, listing
    what is accepted, for none of them."""
    if name == 'test':
        return 'test'
    if name in GPT2_RELEASES:
        return 'release'
    if gcs.is_url(name):
        return 'url'
    if os.path.exists(name):
        return 'dir'
    if name in OFFLINE_MODELS:
        return 'offline'
    if hf_import.is_hub_name(name) and ('/' in name or name in HUB_GPT2_NAMES):
        return 'hub'
    if os.sep in name or name.startswith(('.', '~')):
        return 'dir'  # TrainedModel says it does not exist
    raise ValueError(f'model {name!r} is none of: {ACCEPTED}')


def download_tf_model_dir(url):
    """Download an original TF model dir (`hparams.json`, `encoding`, `checkpoints/checkpoint` and the
    checkpoint it names) from an https URL, e.g. a scope dir of OpenAI's released runs; return the local
    dir. The original read these with gs:// paths; TF checkpoints written by one process are one shard.
    Collective, as gcs.download_file_cached."""
    url = url.rstrip('/')
    cache_dir = os.path.join(gcs.saved_models_dir(), 'downloads')
    local = os.path.dirname(gcs.download_file_cached(f'{url}/hparams.json', cache_dir=cache_dir))
    for optional in ('encoding',):
        try:
            gcs.download_file_cached(f'{url}/{optional}', cache_dir=cache_dir)
        except gcs.DownloadError as e:
            if '404' not in str(e):
                raise
    state = gcs.download_file_cached(f'{url}/checkpoints/checkpoint', cache_dir=cache_dir)
    with open(state) as f:
        m = re.search(r'^model_checkpoint_path:\s*"(.*)"\s*$', f.read(), re.MULTILINE)
    if m is None:
        raise ValueError(f'{url}/checkpoints/checkpoint has no model_checkpoint_path line')
    prefix = os.path.basename(m.group(1))
    for suffix in ('.index', '.data-00000-of-00001'):
        gcs.download_file_cached(f'{url}/checkpoints/{prefix}{suffix}', cache_dir=cache_dir)
    return local


@contextlib.contextmanager
def _file_lock(path):
    """An exclusive lock across processes (ranks converting the same checkpoint wait for the first)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
