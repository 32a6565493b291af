"""Pretrained / trained models (port of the original language/trained_models.py).

A model is named as in the original: 'test' (tiny, randomly initialised), a GPT-2 release ('124M',
downloaded from OpenAI's public bucket and converted once into saved_models_dir()/<name>), or a
directory holding either one of our checkpoints (language/checkpoints.py) or an original TF
checkpoint (converted on first use into a cache dir under saved_models_dir()/converted). Ours: also a
Hugging Face GPT-2, a local folder or a hub name (language/hf_import.py), converted once likewise.
"""

import contextlib
import copy
import fcntl
import hashlib
import os
import re


from lm_human_preferences.language import checkpoints, convert_tf, encodings, hf_import, model
from lm_human_preferences.utils import core, gcs

GPT2_MODELS_URL = 'https://openaipublic.blob.core.windows.net/gpt-2/models'
GPT2_RELEASES = ('124M', '355M', '774M', '1558M')  # the names OpenAI published them under
GPT2_N_CTX = 1024  # every GPT-2 release's context length
GPT2_RELEASE_FILES = ('checkpoint', 'hparams.json', 'model.ckpt.data-00000-of-00001', 'model.ckpt.index',
                      'model.ckpt.meta')


_reported_fresh = set()  # (module type, checkpoint) whose fresh heads init_model has reported


class TrainedModel():
    def __init__(self, name, *, savedir=None, scope=None):
        self.name = name
        self.scope = scope  # for an original TF checkpoint: which model in it (see convert_tf.infer_scope)
        if name == 'test':
            self.savedir = None
            self.encoding = encodings.Test
        else:
            # The original's default savedir was gs://gpt-2/models/<name>; a name that is a path is a
            # local model dir, and an https URL is an original TF run dir (e.g. OpenAI's released
            # runs/descriptiveness/reward_model), downloaded once; ours, a hub name is a Hugging Face model.
            if savedir:
                source = 'url' if gcs.is_url(savedir) else 'dir'
            else:
                source = model_source(name)
            self.savedir = savedir or (None if source == 'release' else name)
            if source == 'url':
                self.savedir = download_tf_model_dir(self.savedir)
            elif source == 'hub':
                self.savedir = hf_import.download(name)
            elif source == 'offline':
                self.savedir = offline_model_dir(name)
                if not os.path.isdir(self.savedir):
                    raise FileNotFoundError(f"model {name!r} is the {name} experiment's initial model, which is "
                                            f"not made yet: python launch.py train_policy {name} NAME makes it in "
                                            f"{self.savedir}")
            if self.savedir is not None:
                _check_dir(self.savedir)
            if self.savedir is not None and hf_import.is_hf_folder(self.savedir):
                self.savedir = convert_hf_folder(self.savedir, label=name if source == 'hub' else None)
            # The original always used Main for non-test models; we honour the dir's `encoding` file.
            self.encoding = checkpoints.read_encoding(self.savedir) if self.savedir else encodings.Main
        self._hparams = None

    def _release_url(self, filename):
        return f'{GPT2_MODELS_URL}/{self.name}/{filename}'

    def download_release(self):
        """Download the GPT-2 release files (collective, as gcs.download_file_cached); returns their dir."""
        cache_dir = os.path.join(gcs.saved_models_dir(), 'downloads')
        paths = [gcs.download_file_cached(self._release_url(f), cache_dir=cache_dir) for f in GPT2_RELEASE_FILES]
        return os.path.dirname(paths[0])

    def checkpoint(self):
        """Path of our checkpoint file for this model (converting an original one first); None for 'test'."""
        if self.name == 'test':
            return None
        if self.savedir is None:
            dst = os.path.join(gcs.saved_models_dir(), self.name)
            if checkpoints.latest_checkpoint(dst) is None:
                src = self.download_release()
                with _file_lock(dst + '.lock'):
                    if checkpoints.latest_checkpoint(dst) is None:
                        print(f'converting {src} -> {dst}')
                        convert_tf.convert_tf_checkpoint(src, dst, scope=self.scope)
            return checkpoints.latest_checkpoint(dst)
        ours = checkpoints.latest_checkpoint(self.savedir)
        if ours is not None:
            return ours
        prefix = convert_tf.find_tf_checkpoint(self.savedir)
        if prefix is None:
            raise FileNotFoundError(
                f'no checkpoint in {self.savedir}: expected {self.savedir}/checkpoints/model-<step>.safetensors '
                f'or a TensorFlow checkpoint state file {self.savedir}/checkpoint or '
                f'{self.savedir}/checkpoints/checkpoint')
        # Converted once per checkpoint: the cache key is the checkpoint's path, its mtime and the scope.
        index = prefix + '.index'
        key = f'{os.path.realpath(prefix)}|{os.stat(index).st_mtime_ns}|{self.scope}'
        dst = _convert_once(prefix, os.path.basename(os.path.normpath(self.savedir)), key,
                            lambda dst: convert_tf.convert_tf_checkpoint(prefix, dst, scope=self.scope))
        return checkpoints.latest_checkpoint(dst)

    def hparams(self):
        if self._hparams is None:
            if self.name == 'test':
                hparams = test_hparams()
            elif self.savedir is None:
                hparams = checkpoints.load_hparams(gcs.download_file_cached(
                    self._release_url('hparams.json'), cache_dir=os.path.join(gcs.saved_models_dir(), 'downloads')))
            else:
                hparams = checkpoints.load_hparams(os.path.join(self.savedir, 'hparams.json'))
            self._hparams = hparams
        return copy.deepcopy(self._hparams)

    def init_model(self, module):
        """Load this model's weights into module: a model.Model, or a module holding one as `.model`
        (Policy, a reward model). 'test' keeps the random initialisation, as the original.

        Heads and reward_norm absent from the checkpoint keep their initial values (the original
        printed a note for them), e.g. the value head when a policy starts from GPT-2; heads of the
        checkpoint that the module lacks are ignored. Anything else missing, unknown or mis-shaped is
        an error naming it. Returns the keys that start fresh (ours).
        """
        path = self.checkpoint()
        if path is None:
            return []
        # The newest checkpoint that verifies (a corrupt newest one is skipped with a warning).
        path, state = checkpoints.load_latest_checkpoint(os.path.dirname(os.path.dirname(path)))
        fresh = checkpoints.load_state(module, state, source=path)
        parts = sorted({f'{k.split(".")[2]} head' if k.startswith('model.heads.') else k.split('.')[0] for k in fresh})
        if parts and core.is_root() and (type(module).__name__, path) not in _reported_fresh:
            _reported_fresh.add((type(module).__name__, path))  # once per kind of model and checkpoint
            print(f'{type(module).__name__} from {path}: {" and ".join(parts)} '
                  f'{"starts" if len(parts) == 1 else "start"} fresh (not in the checkpoint), as the original intended')
        return fresh


def _check_dir(path):
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

# Ours: the initial models an offline experiment makes for itself (offline/experiment.py registers them): name ->
# the context length of the model it makes.
OFFLINE_MODELS = {}

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


def known_n_ctx(name):
    """Ours, for the launch-time checks: the context length of the model named `name` without downloading
    anything ('test', a GPT-2 release, a model dir with hparams.json, a Hugging Face folder's config.json);
    None when it is not known yet. A bad name or a missing dir: one line (model_source)."""
    source = model_source(name)
    if source == 'test':
        return test_hparams().n_ctx
    if source == 'release':
        return GPT2_N_CTX
    if source == 'offline':
        return OFFLINE_MODELS[name]
    if source == 'dir':
        _check_dir(name)
        if hf_import.is_hf_folder(name):
            return hf_import.read_hparams(name).n_ctx
        return checkpoints.load_hparams(os.path.join(name, 'hparams.json')).n_ctx
    return None  # a URL or a hub name: known once downloaded


def test_hparams():
    hparams = model.HParams()
    hparams.override_from_dict(dict(
        n_vocab=27,  # Corresponds to random encoding length
        n_ctx=8,
        n_layer=2,
        n_embd=7,
        n_head=1,
    ))
    return hparams


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
