"""What the benchmarks share: the device, random-weight models of a given shape without any file, the
machine's description and Linux's peak-RSS counters."""
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# GPT-2 124M, the original's policy and reward model.
GPT2_124M = dict(n_vocab=50257, n_ctx=1024, n_embd=768, n_head=12, n_layer=12)


def device():
    return torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def machine_info():
    model_name = platform.processor() or ''
    try:
        out = subprocess.run(['lscpu'], capture_output=True, text=True, check=True).stdout
        model_name = re.search(r'Model name:\s*(.+)', out).group(1).strip()
    except Exception:  # lscpu is optional: the platform string is a fine fallback
        pass
    try:
        transformers = __import__('transformers').__version__
    except ImportError:
        transformers = None
    return dict(cpu=model_name, cores=len(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(), transformers=transformers,
                cuda=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


class NoFilesEncoding:
    """Stands in for encodings.Main without its BPE files: the benchmarks feed random token ids, and
    the code under test only needs the padding token (and decode, for PPOTrainer.print_samples)."""
    name = 'main'

    def __init__(self, n_vocab):
        self.n_vocab = n_vocab

    def get_encoder(self):
        n_vocab = self.n_vocab

        class Encoder:
            padding_token = n_vocab + 2  # as encodings.Main: len(encoder) + 2

            @staticmethod
            def decode(tokens, pretty=False):
                return ' '.join(str(t) for t in tokens)
        return Encoder()


def random_trained_model(m):
    """A TrainedModel with the model hparams m and random initial weights (like the original's 'test'
    model, which keeps its random initialisation)."""
    from lm_human_preferences.language import model as lm_model, trained_models
    tm = trained_models.TrainedModel('test')
    tm.name = 'random-{n_layer}x{n_embd}'.format(**m)
    tm.encoding = NoFilesEncoding(m['n_vocab'])
    hparams = lm_model.HParams()
    hparams.override_from_dict(m)
    tm._hparams = hparams
    tm.checkpoint = lambda: None  # no weights to load: init_model keeps the random initialisation
    return tm


def proc_status_mb(field):
    """A field of /proc/self/status (VmRSS: resident now; VmHWM: the peak since the last reset), in MiB."""
    return int(re.search(rf'{field}:\s+(\d+)', Path('/proc/self/status').read_text()).group(1)) / 1024


def reset_peak_rss():
    """Linux: writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS."""
    Path('/proc/self/clear_refs').write_text('5')
