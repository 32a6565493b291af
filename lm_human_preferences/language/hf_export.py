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
    tokenizer.json,              our encoding as a `tokenizers` tokenizer, for AutoTokenizer: `main` is
    tokenizer_config.json        GPT-2's BPE (its vocabulary and merges) with <|endoftext|> as bos, eos,
                                 unk and pad (GPT-2 has no pad token; as eos, transformers' generate
                                 never takes it for padding inside a prompt); `test` is one token per
                                 character 'a'..'z', '.' (0..26; any other character is '.', as ours),
                                 padded with '.' (26), a token the model embeds, as GPT-2 users pad with
                                 eos: the tokenizer's attention_mask marks the pads, and the model's
                                 configs name no pad token, so that generate never takes a prompt's '.'
                                 (every word break) for padding. Padding side: left, for generate.
    generation_config.json       sampling as our policy samples: from the whole distribution (top_k 0,
                                 not transformers' 50), and with the run's task: its temperature and
                                 response length (max_new_tokens)
    lmhp_export.json             the source checkpoint, our encoding's name and the heads

Writing needs no transformers: the configs are plain JSON, the weights safetensors, the tokenizer
`tokenizers`'. Our generate-free sampler never stops early; transformers' generate stops a `main`
model's sample at <|endoftext|>. Our weight
layouts are already GPT-2's: a Conv1x1 `w` is [nx, nf] like transformers' Conv1D `weight`. The
numbers differ only where the kernels do (attention, matmul blocking): below 1e-5 on logits of a small
model (tests/test_hf_import.py). Padding differs in kind: our Model takes a padding token (pads sit
mid-sequence, positions skip them), transformers takes an attention_mask.
"""

import json
import os

from lm_human_preferences.language import checkpoints, encodings, hf_gpt2, model, trained_models
from lm_human_preferences.utils import files

TEST_PAD_TOKEN = '.'  # a token of the model's (see the module's docstring)


def tokenizer_files(encoding, hparams):
    """{file name: content} of the tokenizer of our encoding, for AutoTokenizer (see the module's docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    if encoding.name == 'main':
        encoder_json, vocab_bpe = encoding.bpe_files()
        tokenizer = Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
        # GPT-2's byte-level pre-tokenizer: its regex is the original's (encodings._PAT_STR).
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
        eot = '<|endoftext|>'
        tokenizer.add_special_tokens([eot])  # already in the vocabulary (50256): marked special
        special = dict(bos_token=eot, eos_token=eot, unk_token=eot, pad_token=eot)
    elif encoding.name == 'test':
        tokenizer = Tokenizer(models.WordLevel(encoding.get_encoder().encoder, unk_token='.'))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), behavior='isolated')  # each character
        tokenizer.decoder = decoders.Fuse()  # joined without spaces
        special = dict(pad_token=TEST_PAD_TOKEN)
    else:
        raise ValueError(f'no tokenizer for the encoding {encoding.name!r}')
    config = dict(tokenizer_class='PreTrainedTokenizerFast', model_max_length=hparams.n_ctx, padding_side='left',
                  clean_up_tokenization_spaces=False, **special)
    return {'tokenizer.json': tokenizer.to_str(pretty=True), 'tokenizer_config.json': json.dumps(config, indent=2)}


def hf_tokenizer(encoding=encodings.Main, n_ctx=1024):
    """Our encoding as a transformers tokenizer, made offline from the files the package ships: the tokenizer
    an export holds (for `main`, GPT-2's, with <|endoftext|> as eos and pad), e.g. for a TRL script."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    made = tokenizer_files(encoding, model.HParams(n_ctx=n_ctx))
    config = {k: v for k, v in json.loads(made['tokenizer_config.json']).items() if k != 'tokenizer_class'}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(made['tokenizer.json']), **config)


def generation_config(encoding, task=None):
    """generation_config.json: generate samples as our policy does (see the module's docstring)."""
    config = hf_gpt2.gpt2_config_special_tokens(encoding)
    config.update(do_sample=True, top_k=0, top_p=1.0)
    if task is not None:
        config.update(temperature=task.policy.temperature, max_new_tokens=task.response_length)
    return config


# The files an export writes, but its heads' (<name>_head.safetensors).
EXPORT_FILES = ('config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json',
                'generation_config.json', 'lmhp_export.json')
HEAD_SUFFIX = '_head.safetensors'


def check_out_dir(out_dir, *, force=False):
    """Ours: one-line errors, before any work, for a folder an export must not write: a file, or a folder
    holding anything (old files beside the new ones would mix into the model transformers loads); sample.py
    refuses a run's folders too. With force, an earlier export there is replaced: returns its files, to remove
    those the new export does not write."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f'{out_dir} is a file: an export writes a folder')
    present = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if present and not force:
        more = f' and {len(present) - 1} more' if len(present) > 1 else ''
        raise ValueError(f'{out_dir} is not empty (it holds {present[0]}{more}): export into a new or empty folder, '
                         f'or add --force to replace the files an export writes there (the rest stay)')
    return [os.path.join(out_dir, n) for n in present if n in EXPORT_FILES or n.endswith(HEAD_SUFFIX)]


def export(model_dir, out_dir, *, scope=None, task=None, force=False):
    """Export the latest checkpoint of model_dir (one of ours, or an original TF one, converted first)
    to out_dir, with its tokenizer; task: the run's TaskHParams, for the sampling defaults; force: replace
    an earlier export in out_dir (check_out_dir). Returns the list of files written."""
    from safetensors.torch import save

    earlier = check_out_dir(out_dir, force=force)
    m = trained_models.TrainedModel(model_dir, savedir=model_dir, scope=scope)
    source = m.checkpoint()
    hparams = m.hparams()
    transformer, heads = hf_gpt2.convert_state(checkpoints.load_checkpoint(source))
    hf_gpt2.check_shapes(transformer, hparams, source)

    os.makedirs(out_dir, exist_ok=True)
    # safetensors metadata format=pt: transformers refuses safetensors files without it.
    written = [os.path.join(out_dir, 'config.json'), os.path.join(out_dir, 'model.safetensors')]
    files.atomic_write(written[0], (json.dumps(hf_gpt2.gpt2_config(hparams, m.encoding), indent=2) + '\n').encode())
    files.atomic_write(written[1], save(transformer, metadata={'format': 'pt'}))
    for name, tensors in sorted(heads.items()):
        written.append(os.path.join(out_dir, name + HEAD_SUFFIX))
        files.atomic_write(written[-1], save(tensors, metadata={'format': 'pt'}))
    tokenizer = tokenizer_files(m.encoding, hparams)
    tokenizer['generation_config.json'] = json.dumps(generation_config(m.encoding, task), indent=2)
    for name, text in tokenizer.items():
        written.append(os.path.join(out_dir, name))
        files.atomic_write(written[-1], (text + '\n').encode())
    info = dict(source=os.path.abspath(source), encoding=m.encoding.name, heads=sorted(heads))
    written.append(os.path.join(out_dir, 'lmhp_export.json'))
    files.atomic_write(written[-1], (json.dumps(info, indent=2) + '\n').encode())
    for path in set(earlier) - set(written):  # an earlier export's heads that this model lacks
        os.remove(path)
    return written


def usage(out_dir):
    """How to load and sample the export in out_dir with transformers (sample.py export prints it)."""
    with open(os.path.join(out_dir, 'lmhp_export.json')) as f:
        encoding = encodings.get(json.load(f)['encoding'])
    with open(os.path.join(out_dir, 'config.json')) as f:
        n_ctx = json.load(f)['n_positions']
    with open(os.path.join(out_dir, 'generation_config.json')) as f:
        new_tokens = json.load(f).get('max_new_tokens', 0)
    # The example prompts leave room for the new tokens in the context (the `test` model's is 8 tokens, one
    # a character): a prompt too long for it makes generate fail with an IndexError.
    room = max(1, n_ctx - new_tokens - 1)
    prompts = ['a query', 'another query'] if encoding.name != 'test' else ['a query'[:room], 'another query'[:room]]
    if encoding.name == 'test':
        note = "'.' pads, marked by the attention mask"
    else:
        note = '<|endoftext|> is eos and pad, as for GPT-2'
    return [f'use it with transformers (generate samples as the policy does: generation_config.json; {note}):',
            '  from transformers import AutoTokenizer, GPT2LMHeadModel',
            f'  tokenizer = AutoTokenizer.from_pretrained({out_dir!r})',
            f'  model = GPT2LMHeadModel.from_pretrained({out_dir!r})',
            f"  batch = tokenizer({prompts!r}, return_tensors='pt', padding=True)",
            "  print(tokenizer.batch_decode(model.generate(**batch)[:, batch.input_ids.shape[1]:]))"]

