"""Ours: our GPT-2 and transformers' GPT2LMHeadModel side by side, for hf_export.py and hf_import.py: one table of
parameter names both ways, the GPT2Config of our hparams, and the conversion of a transformers state dict to ours
(with its shape checks)."""

import re


# Our parameter names (without the `model.` prefix) and GPT2LMHeadModel's, one table both ways (hf_export.py,
# hf_import.py): (module path, our parameter, transformers' parameter); wte and wpe are
# parameters themselves in our Model, nn.Embedding modules there.
_LAYER_NORM = r'h\.\d+\.ln_[12]|ln_f'
_CONV = r'h\.\d+\.(?:attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)'
_PARAMETERS = [
    (r'wte|wpe', '', 'weight'),
    (_LAYER_NORM, 'g', 'weight'),
    (_LAYER_NORM, 'b', 'bias'),
    (_CONV, 'w', 'weight'),
    (_CONV, 'b', 'bias'),
]
_HEAD = re.compile(r'heads\.(\w+)\.([wb])')


def hf_name(ours):
    """GPT2LMHeadModel's name for our parameter (without `model.`), or None:
    'h.0.ln_1.g' -> 'transformer.h.0.ln_1.weight'."""
    for path, our_param, hf_param in _PARAMETERS:
        m = re.fullmatch(f'({path})' + (re.escape('.' + our_param) if our_param else ''), ours)
        if m:
            return f'transformer.{m.group(1)}.{hf_param}'
    return None


def our_name(theirs):
    """Our name (without `model.`) for a GPT2LMHeadModel parameter, or None; also takes GPT2Model's names
    (no `transformer.`), as the hub's own gpt2 files have them."""
    theirs = theirs[len('transformer.'):] if theirs.startswith('transformer.') else theirs
    for path, our_param, hf_param in _PARAMETERS:
        m = re.fullmatch(f'({path})' + re.escape('.' + hf_param), theirs)
        if m:
            return f'{m.group(1)}.{our_param}' if our_param else m.group(1)
    return None


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
    config.update(gpt2_config_special_tokens(encoding))
    return config


def gpt2_config_special_tokens(encoding):
    """The special token ids of config.json and generation_config.json: GPT-2's <|endoftext|> for the
    main encoding, as GPT-2's own config (and its tokenizer's pad token here); explicitly none otherwise
    (GPT2Config would default to 50256): a `test` model never stops early, as our sampler."""
    eot = encoding.eot_token if encoding.name == 'main' else None
    return dict(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)


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
        theirs = hf_name(name)
        if theirs is None:
            raise ValueError(f"cannot export variable '{key}': no GPT-2 counterpart")
        transformer[theirs] = value
    for name, tensors in heads.items():
        if set(tensors) & {'w', 'b'} != {'w', 'b'}:
            raise ValueError(f"scalar head '{name}' needs both w and b, got {sorted(tensors)}")
    return transformer, heads


def state_from_hf(transformer, heads):
    """The inverse of convert_state: (GPT2LMHeadModel tensors, heads) -> our checkpoint state."""
    state = {}
    for key, value in transformer.items():
        ours = our_name(key)
        if ours is None:
            raise ValueError(f"cannot convert variable '{key}': no counterpart in our GPT-2")
        state['model.' + ours] = value
    for name, tensors in heads.items():
        if not {'w', 'b'} <= set(tensors):
            raise ValueError(f"scalar head '{name}' needs both w and b, got {sorted(tensors)}")
        for param in ('w', 'b'):
            state[f'model.heads.{name}.{param}'] = tensors[param]
        for param in ('gain', 'bias'):  # a reward head's normalization
            if param in tensors:
                state[f'reward_norm.{param}'] = tensors[param]
    return state


def check_shapes(transformer, hparams, source, *, hparams_file='hparams.json'):
    """That the GPT2LMHeadModel tensors are those of a model with these hparams (read from hparams_file)."""
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
            raise ValueError(f'{source} lacks {name} (its {hparams_file} says {hparams.n_layer} layers)')
        if tuple(transformer[name].shape) != shape:
            raise ValueError(f'{source}: {name} has shape {list(transformer[name].shape)}, {hparams_file} '
                             f'implies {list(shape)}')
    extra = sorted(set(transformer) - set(expected))
    if extra:
        raise ValueError(f'{source} has {extra[0]}, which its {hparams_file} ({hparams.n_layer} layers) does not')
