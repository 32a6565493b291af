"""A Hugging Face transformers GPT-2 as a model of ours (no original; the reverse of hf_gpt2.py).

    --task.policy.initial_model DIR     a local GPT2LMHeadModel folder (save_pretrained's, or our export)
    --task.policy.initial_model gpt2    a name on the Hugging Face hub (downloaded once, huggingface_hub)

A folder holds config.json (GPT2Config), model.safetensors (or model.safetensors.index.json and its
shards) and a tokenizer (tokenizer.json, or vocab.json + merges.txt); our export adds
<name>_head.safetensors. trained_models.TrainedModel converts it once into our checkpoint layout
(language/checkpoints.py), cached under saved_models_dir()/converted and keyed by the folder's files, so
a changed folder is converted again. The hparams come from config.json; the encoding from the tokenizer:
GPT-2's BPE, the same vocabulary and merges as our `main` encoding (compared), is `main`; the character
tokenizer of our export of a `test`-encoded model is `test`; any other tokenizer is refused in one line.
Our Model is GPT-2 exactly, so config.json must describe GPT-2 (tanh GELU, layer norm epsilon 1e-5, tied
embeddings, ...): anything else is one line naming the field. Pickled weights (pytorch_model.bin) are not
loaded: loading a pickle can run code.
"""

import json
import os

from lm_human_preferences.language import checkpoints, encodings, hf_gpt2, model
from lm_human_preferences.utils import gcs

# The files a conversion reads: what is downloaded of a hub model.
WEIGHTS, WEIGHTS_INDEX = 'model.safetensors', 'model.safetensors.index.json'
TOKENIZER_FILES = ('tokenizer.json', 'vocab.json', 'merges.txt')
HUB_FILES = ['config.json', WEIGHTS, WEIGHTS_INDEX, 'model-*-of-*.safetensors', *TOKENIZER_FILES,
             '*_head.safetensors']
_HEAD_SUFFIX = '_head.safetensors'
_PICKLED = ('pytorch_model.bin', 'tf_model.h5')  # transformers' weights that we do not load
# transformers' attention buffers (the causal mask), saved by older versions: nothing to convert.
_BUFFERS = ('.attn.bias', '.attn.masked_bias')


def is_hf_folder(path):
    """A Hugging Face model folder: config.json or transformers' weights, and no hparams.json (ours and the
    original's model dirs)."""
    return (any(os.path.isfile(os.path.join(path, f)) for f in ('config.json', WEIGHTS, WEIGHTS_INDEX, *_PICKLED))
            and not os.path.isfile(os.path.join(path, 'hparams.json')))


def _config_path(folder):
    path = os.path.join(folder, 'config.json')
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{folder} holds a Hugging Face model without its config.json (the GPT2Config, which '
                                f'save_pretrained writes beside the weights): copy it there')
    return path


def is_hub_name(name):
    """Whether name can be a model on the hub ('gpt2', 'openai-community/gpt2'); nothing is looked up."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(name)
        return True
    except HFValidationError:
        return False


def download(repo_id):
    """The local folder of the hub model repo_id (its files that a conversion reads), downloaded once."""
    # A name with a '/' may be a mistyped local path: the error says there is none.
    return gcs.download_hub_snapshot(repo_id, allow_patterns=HUB_FILES,
                                     cache_dir=os.path.join(gcs.saved_models_dir(), 'huggingface'),
                                     note=f' (no local directory {repo_id} either)' if os.sep in repo_id else '')


def _read_json(path):
    """The JSON object (every file read here holds one) in path."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f'{path} is not valid JSON: {e}') from None
    if not isinstance(value, dict):
        raise ValueError(f'{path} holds a JSON {type(value).__name__}: it must hold an object ({{"name": value, ...}})')
    return value


# GPT2Config's fields that our Model fixes: (field, GPT2Config's default, the values our Model computes).
_FIXED = [
    ('activation_function', 'gelu_new', ('gelu_new', 'gelu_pytorch_tanh')),  # both the tanh GELU, as ours
    ('layer_norm_epsilon', 1e-5, (1e-5,)),
    ('scale_attn_weights', True, (True,)),
    ('scale_attn_by_inverse_layer_idx', False, (False,)),
    ('add_cross_attention', False, (False,)),
    ('tie_word_embeddings', True, (True,)),  # the output projection is wte
]


def read_hparams(folder):
    """Our model HParams from a folder's config.json (GPT2Config's defaults where a field is absent);
    a ValueError naming the field where it describes a model ours is not."""
    path = _config_path(folder)
    config = _read_json(path)
    if config.get('model_type') != 'gpt2':
        raise ValueError(f"{path}: model_type {config.get('model_type')!r} is not GPT-2 ('gpt2'): only a GPT-2 can be "
                         f"loaded (our Model is the original's GPT-2)")
    for name, default, allowed in _FIXED:
        if config.get(name, default) not in allowed:
            raise ValueError(f'{path}: {name} {config[name]!r} is not supported (our GPT-2 computes '
                             f'{" or ".join(map(repr, allowed))})')
    hparams = model.HParams(n_vocab=config.get('vocab_size', 50257),
                            n_ctx=config.get('n_positions', config.get('n_ctx', 1024)),
                            n_embd=config.get('n_embd', 768), n_head=config.get('n_head', 12),
                            n_layer=config.get('n_layer', 12))
    if config.get('n_inner') not in (None, 4 * hparams.n_embd):
        raise ValueError(f"{path}: n_inner {config['n_inner']} is not supported (our GPT-2's MLP is 4 * n_embd = "
                         f'{4 * hparams.n_embd} wide)')
    return hparams


def _read_merges(path):
    """BPE merges as (a, b) pairs, from a merges.txt / vocab.bpe file (a '#version' line first)."""
    with open(path, encoding='utf-8') as f:
        lines = f.read().split('\n')
    return [tuple(line.split(' ')) for line in lines if line and not line.startswith('#version')]


def _tokenizer(folder):
    """(model type, vocab {token: id}, merges [(a, b)]) of the folder's tokenizer, or None if it has none."""
    path = os.path.join(folder, 'tokenizer.json')
    if os.path.isfile(path):
        tok = _read_json(path).get('model') or {}
        merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m) for m in tok.get('merges') or []]
        return tok.get('type'), tok.get('vocab') or {}, merges
    vocab, merges = os.path.join(folder, 'vocab.json'), os.path.join(folder, 'merges.txt')
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return 'BPE', _read_json(vocab), _read_merges(merges)
    return None


def read_encoding(folder, hparams):
    """Our encoding for the folder's tokenizer (see the module's docstring), checked against config.json's
    vocab_size; a ValueError in one line otherwise."""
    tokenizer = _tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f'{folder} has no tokenizer (tokenizer.json, or vocab.json and merges.txt): the tokenizer '
                         f"decides the encoding (GPT-2's BPE: 'main')")
    kind, vocab, merges = tokenizer
    if kind == 'WordLevel' and vocab == encodings.Test.get_encoder().encoder:
        encoding = encodings.Test
    else:
        encoding = None
        if kind == 'BPE' and len(vocab) == encodings.Main.n_vocab:
            encoder_json, vocab_bpe = encodings.Main.bpe_files()
            if vocab == _read_json(encoder_json) and merges == _read_merges(vocab_bpe):
                encoding = encodings.Main
        if encoding is None:
            raise ValueError(f"{folder}'s tokenizer ({kind}, {len(vocab)} tokens) is not supported: only GPT-2's BPE "
                             f"(the vocabulary and merges of our 'main' encoding) and our export's 'test' characters "
                             f'are')
    if hparams.n_vocab != encoding.n_vocab:
        raise ValueError(f"{os.path.join(folder, 'config.json')}: vocab_size {hparams.n_vocab} is not the "
                         f"{encoding.n_vocab} tokens of its tokenizer's encoding ({encoding.name}); a resized "
                         f'embedding (say, for an added pad token) is not supported')
    return encoding


def _weight_files(folder):
    """The safetensors files holding the folder's transformer weights."""
    index = os.path.join(folder, WEIGHTS_INDEX)
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [os.path.join(folder, WEIGHTS)]
    if os.path.isfile(index):
        return [os.path.join(folder, f) for f in sorted(set(_read_json(index).get('weight_map', {}).values()))]
    pickled = [f for f in _PICKLED if os.path.isfile(os.path.join(folder, f))]
    raise FileNotFoundError(
        f'{folder} has no {WEIGHTS}' + (f' (only {pickled[0]}, which we do not load: a pickle can run code; save the '
                                        f'model with save_pretrained, which writes safetensors)' if pickled else ''))


def source_files(folder):
    """Every file a conversion of folder reads (the converted cache is keyed by them)."""
    _config_path(folder)  # a folder without it: one line, not a file missing from the cache key
    names = ['config.json', *(f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, f)))]
    heads = sorted(f for f in os.listdir(folder) if f.endswith(_HEAD_SUFFIX))
    return [os.path.join(folder, n) for n in names + heads] + _weight_files(folder)


def _load(path):
    """The tensors of a safetensors file, each finite (checkpoints.check_finite)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f'{path} is not a valid safetensors file: {e}') from None
    for name, value in tensors.items():
        checkpoints.check_finite(name, value, path)
    return tensors


def read_state(folder, hparams):
    """Our checkpoint state (fp32) of the folder's weights and heads."""
    transformer, lm_head = {}, None
    for path in _weight_files(folder):
        for name, value in _load(path).items():
            if name == 'lm_head.weight':
                lm_head = value
            elif not name.endswith(_BUFFERS):
                # GPT2LMHeadModel's names start with 'transformer.'; GPT2Model's (the hub's gpt2 files) do not.
                transformer[name if name.startswith('transformer.') else 'transformer.' + name] = value.float()
    hf_gpt2.check_shapes(transformer, hparams, folder, hparams_file='config.json')
    wte = transformer['transformer.wte.weight']
    if lm_head is not None and not (lm_head.shape == wte.shape and bool((lm_head.float() == wte).all())):
        raise ValueError(f'{folder}: lm_head.weight is not wte (untied output embeddings): our GPT-2 ties them')
    heads = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(_HEAD_SUFFIX):  # our export's scalar heads
            heads[f[:-len(_HEAD_SUFFIX)]] = {k: v.float() for k, v in _load(os.path.join(folder, f)).items()}
    return hf_gpt2.state_from_hf(transformer, heads)


def convert(folder, dst):
    """Write the folder's model into dst in our checkpoint layout; returns the checkpoint's path."""
    hparams = read_hparams(folder)
    encoding = read_encoding(folder, hparams)
    return checkpoints.write_checkpoint(dst, 0, read_state(folder, hparams), hparams=hparams, encoding=encoding)
