"""Pretrained / trained models (port of the original language/trained_models.py).

A model is named as in the original: 'test' (tiny, randomly initialised), a GPT-2 release ('124M'), or a
directory holding one of our checkpoints (language/checkpoints.py) or an original TF checkpoint. Ours: the
other names a model may have, and the downloads and conversions they need, are language/model_sources.py's.
"""

import copy
import os

from lm_human_preferences.language import checkpoints, encodings, hf_import, model, model_sources
from lm_human_preferences.utils import gcs, ranks

GPT2_MODELS_URL = 'https://openaipublic.blob.core.windows.net/gpt-2/models'
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
            self.savedir = model_sources.local_dir(name, savedir)  # ours: downloaded or converted once
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
        if self.savedir is None:  # ours: a GPT-2 release, converted once
            return model_sources.converted_release(self.name, self.download_release, scope=self.scope)
        ours = checkpoints.latest_checkpoint(self.savedir)
        if ours is not None:
            return ours
        return model_sources.converted_tf_checkpoint(self.savedir, scope=self.scope)  # ours: converted once

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
        if parts and ranks.is_root() and (type(module).__name__, path) not in _reported_fresh:
            _reported_fresh.add((type(module).__name__, path))  # once per kind of model and checkpoint
            print(f'{type(module).__name__} from {path}: {" and ".join(parts)} '
                  f'{"starts" if len(parts) == 1 else "start"} fresh (not in the checkpoint), as the original intended')
        return fresh


def known_n_ctx(name):
    """Ours, for the launch-time checks: the context length of the model named `name` without downloading
    anything ('test', a GPT-2 release, a model dir with hparams.json, a Hugging Face folder's config.json);
    None when it is not known yet. A bad name or a missing dir: one line (model_sources.model_source)."""
    source = model_sources.model_source(name)
    if source == 'test':
        return test_hparams().n_ctx
    if source == 'release':
        return model_sources.GPT2_N_CTX
    if source == 'offline':
        return model_sources.OFFLINE_MODELS[name]
    if source == 'dir':
        model_sources.check_dir(name)
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
