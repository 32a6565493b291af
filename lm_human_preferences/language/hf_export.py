"""Export one of our models as a Hugging Face transformers GPT-2 folder (no original).

    python sample.py export --save_dir DIR --out HF_DIR [--savescope policy|reward_model]

HF_DIR then loads with `transformers.GPT2LMHeadModel.from_pretrained(HF_DIR)` and computes the same
logits as our Model (to float rounding) on unpadded input; it holds
    config.json                  GPT2Config: n_positions = n_ctx, vocab_size = n_vocab, gelu_new (the
                                 tanh GELU), layer_norm_epsilon 1e-5, no dropout, tied embeddings
    model.safetensors            the transformer (lm_head is wte, tied, so not stored: as save_pretrained)
    <name>_head.safetensors      each scalar head, `w` [n_embd] and `b` []: `value` for a policy,
                                 `reward` for a reward model (with its normalization `gain` and `bias`:
                                 reward = gain * (h[-1] @ w + b) + bias, h after ln_f)
    lmhp_export.json             the source checkpoint, our encoding's name and the heads
No tokenizer is written: the `main` encoding is GPT-2's (transformers' GPT2Tokenizer with GPT-2's
encoder.json / vocab.bpe), the `test` encoding maps 'a'..'z', '.' to 0..26.

Writing needs no transformers: config.json is plain JSON and the weights are safetensors. Our weight
layouts are already GPT-2's: a Conv1x1 `w` is [nx, nf] like transformers' Conv1D `weight`. Two
numerical differences remain, both below 1e-5 on logits of a small model: our layer norm computes the
variance as E[x^2] - E[x]^2 (the original's formula; torch's LayerNorm subtracts the mean first), and
the attention kernels differ. Padding differs in kind: our Model takes a padding token (pads sit
mid-sequence, positions skip them), transformers takes an attention_mask.
"""

import json
import os
import re

from lm_human_preferences.language import checkpoints, trained_models
from lm_human_preferences.utils import files

# Our parameter names (without the `model.` prefix) -> GPT2LMHeadModel's.
_RENAMES = [
    (re.compile(r'(wte|wpe)'), r'transformer.\1.weight'),
    (re.compile(r'(h\.\d+\.ln_[12]|ln_f)\.g'), r'transformer.\1.weight'),
    (re.compile(r'(h\.\d+\.ln_[12]|ln_f)\.b'), r'transformer.\1.bias'),
    (re.compile(r'(h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj))\.w'), r'transformer.\1.weight'),
    (re.compile(r'(h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj))\.b'), r'transformer.\1.bias'),
]
_HEAD = re.compile(r'heads\.(\w+)\.([wb])')


def gpt2_config(hparams, encoding):
    """The config.json of a transformers GPT-2 equal to our Model with these HParams."""
    config = dict(
        architectures=['GPT2LMHeadModel'],
        model_type='gpt2',
        vocab_size=hparams.n_vocab,
        n_positions=hparams.n_ctx,
        n_embd=hparams.n_embd,
        n_layer=hparams.n_layer,
        n_head=hparams.n_head,
        n_inner=None,  # 4 * n_embd
        activation_function='gelu_new',
        layer_norm_epsilon=1e-5,
        # The original never applied dropout (see model.HParams), so the export has none either.
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        initializer_range=0.02,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=True,
        use_cache=True,
    )
    # GPT-2's <|endoftext|> for the main encoding, as GPT-2's own config; explicitly none otherwise
    # (GPT2Config would default to 50256). Our sampler never stops early, so neither must generate.
    eot = encoding.eot_token if encoding.name == 'main' else None
    config.update(bos_token_id=eot, eos_token_id=eot)
    return config


def convert_state(state):
    """Our checkpoint state -> (GPT2LMHeadModel tensors, {head name: {'w', 'b'[, 'gain', 'bias']}})."""
    transformer, heads = {}, {}
    for key, value in state.items():
        value = value.contiguous()
        if key.startswith('reward_norm.'):
            heads.setdefault('reward', {})[key[len('reward_norm.'):]] = value
            continue
        if not key.startswith('model.'):
            raise ValueError(f"cannot export variable '{key}': not a model parameter (model.*) or reward_norm.*")
        name = key[len('model.'):]
        head = _HEAD.fullmatch(name)
        if head:
            heads.setdefault(head.group(1), {})[head.group(2)] = value
            continue
        for pattern, replacement in _RENAMES:
            if pattern.fullmatch(name):
                transformer[pattern.sub(replacement, name)] = value
                break
        else:
            raise ValueError(f"cannot export variable '{key}': no GPT-2 counterpart")
    for name, tensors in heads.items():
        if set(tensors) & {'w', 'b'} != {'w', 'b'}:
            raise ValueError(f"scalar head '{name}' needs both w and b, got {sorted(tensors)}")
    return transformer, heads


def _check_shapes(transformer, hparams, source):
    e = hparams.n_embd
    expected = {'transformer.wte.weight': (hparams.n_vocab, e), 'transformer.wpe.weight': (hparams.n_ctx, e),
                'transformer.ln_f.weight': (e,), 'transformer.ln_f.bias': (e,)}
    for i in range(hparams.n_layer):
        p = f'transformer.h.{i}.'
        expected.update({
            p + 'ln_1.weight': (e,), p + 'ln_1.bias': (e,), p + 'ln_2.weight': (e,), p + 'ln_2.bias': (e,),
            p + 'attn.c_attn.weight': (e, 3 * e), p + 'attn.c_attn.bias': (3 * e,),
            p + 'attn.c_proj.weight': (e, e), p + 'attn.c_proj.bias': (e,),
            p + 'mlp.c_fc.weight': (e, 4 * e), p + 'mlp.c_fc.bias': (4 * e,),
            p + 'mlp.c_proj.weight': (4 * e, e), p + 'mlp.c_proj.bias': (e,),
        })
    for name, shape in expected.items():
        if name not in transformer:
            raise ValueError(f'{source} lacks {name} (its hparams.json says {hparams.n_layer} layers)')
        if tuple(transformer[name].shape) != shape:
            raise ValueError(f'{source}: {name} has shape {list(transformer[name].shape)}, hparams.json '
                             f'implies {list(shape)}')
    extra = sorted(set(transformer) - set(expected))
    if extra:
        raise ValueError(f'{source} has {extra[0]}, which its hparams.json ({hparams.n_layer} layers) does not')


def export(model_dir, out_dir, *, scope=None):
    """Export the latest checkpoint of model_dir (one of ours, or an original TF one, converted first)
    to out_dir. Returns the list of files written."""
    from safetensors.torch import save

    m = trained_models.TrainedModel(model_dir, savedir=model_dir, scope=scope)
    source = m.checkpoint()
    hparams = m.hparams()
    transformer, heads = convert_state(checkpoints.load_checkpoint(source))
    _check_shapes(transformer, hparams, source)

    os.makedirs(out_dir, exist_ok=True)
    # safetensors metadata format=pt: transformers refuses safetensors files without it.
    written = [os.path.join(out_dir, 'config.json'), os.path.join(out_dir, 'model.safetensors')]
    files.atomic_write(written[0], (json.dumps(gpt2_config(hparams, m.encoding), indent=2) + '\n').encode())
    files.atomic_write(written[1], save(transformer, metadata={'format': 'pt'}))
    for name, tensors in sorted(heads.items()):
        written.append(os.path.join(out_dir, f'{name}_head.safetensors'))
        files.atomic_write(written[-1], save(tensors, metadata={'format': 'pt'}))
    info = dict(source=os.path.abspath(source), encoding=m.encoding.name, heads=sorted(heads))
    written.append(os.path.join(out_dir, 'lmhp_export.json'))
    files.atomic_write(written[-1], (json.dumps(info, indent=2) + '\n').encode())
    return written
