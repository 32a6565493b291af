"""Hugging Face export (language/hf_export.py): the exported folder loads with transformers and computes
our model's logits and values, and greedy decoding picks the same tokens."""
import json

import pytest
import torch

from lm_human_preferences.language import checkpoints, encodings, hf_export, hf_gpt2, model, trained_models
from lm_human_preferences.policy import Policy

transformers = pytest.importorskip('transformers')  # a test-only dependency (the `test-full` extra)


def _random_policy_dir(tmp_path):
    """A saved policy of ours (transformer + value head) with every parameter random, biases and layer
    norms included, so that a wrong mapping of any tensor changes the outputs."""
    hparams = model.HParams(n_vocab=encodings.Test.n_vocab, n_ctx=32, n_embd=48, n_head=4, n_layer=2)
    torch.manual_seed(0)
    lm = model.Model(hparams, scalar_heads=['value'])
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name in ('wte', 'wpe'):  # logits of size ~10, not ~0.1: differences would show
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith('.g'):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith('.b') or name.startswith('heads.'):
                p.copy_(0.3 * torch.randn_like(p))
    policy_dir = tmp_path / 'policy'
    checkpoints.save_checkpoint(str(policy_dir), 7, lm, hparams=hparams, encoding=encodings.Test)
    return lm, policy_dir


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp('export')
    lm, policy_dir = _random_policy_dir(tmp_path)
    out = tmp_path / 'hf'
    written = hf_export.export(str(policy_dir), str(out))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    return lm.eval(), policy_dir, out, written, hf


def test_files_and_config(exported):
    lm, _, out, written, hf = exported
    assert sorted(p.rsplit('/', 1)[-1] for p in written) == [
        'config.json', 'generation_config.json', 'lmhp_export.json', 'model.safetensors', 'tokenizer.json',
        'tokenizer_config.json', 'value_head.safetensors']
    config = json.loads((out / 'config.json').read_text())
    assert (config['vocab_size'], config['n_positions'], config['n_embd'], config['n_layer'], config['n_head']) == \
        (27, 32, 48, 2, 4)
    assert config['activation_function'] == 'gelu_new' and config['tie_word_embeddings'] is True
    # Tied: the loaded lm_head is wte itself, which holds our wte.
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(hf.transformer.wte.weight, lm.wte, rtol=0, atol=0)


def test_logits_and_values_match(exported):
    lm, _, out, _, hf = exported
    from safetensors.torch import load_file
    tokens = torch.randint(0, 27, (3, 32), generator=torch.Generator().manual_seed(1))  # unpadded, full n_ctx
    with torch.no_grad():
        ours = lm(tokens)
        theirs = hf(tokens, output_hidden_states=True)
    assert (ours['lm_logits'] - theirs.logits).abs().max().item() <= 1e-4
    # The value head applies to the final hidden state (after ln_f), as in our Model.
    head = load_file(str(out / 'value_head.safetensors'))
    values = theirs.hidden_states[-1] @ head['w'] + head['b']
    assert (ours['value'] - values).abs().max().item() <= 1e-4


def test_greedy_generation_matches(exported):
    _, policy_dir, _, _, hf = exported
    # Our sampler at temperature 0 (logits * 1e10) is greedy.
    policy = Policy(trained_models.TrainedModel(str(policy_dir)), temperature=0.0).eval()
    queries = torch.randint(0, 27, (4, 8), generator=torch.Generator().manual_seed(2))
    ours = policy.respond(queries, length=16)['responses']
    with torch.no_grad():
        theirs = hf.generate(queries, attention_mask=torch.ones_like(queries), max_new_tokens=16,
                             min_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs[:, 8:], ours)


def test_reward_model_head_and_norm(tmp_path):
    hparams = model.HParams(n_vocab=27, n_ctx=8, n_embd=8, n_head=2, n_layer=1)
    lm = model.Model(hparams, scalar_heads=['reward'])
    state = {'model.' + k: v for k, v in lm.state_dict().items()}
    state.update({'reward_norm.gain': torch.tensor(2.5), 'reward_norm.bias': torch.tensor(-0.5)})
    checkpoints.write_checkpoint(str(tmp_path / 'rm'), 3, state, hparams=hparams, encoding='test')
    hf_export.export(str(tmp_path / 'rm'), str(tmp_path / 'hf'))
    from safetensors.torch import load_file
    head = load_file(str(tmp_path / 'hf' / 'reward_head.safetensors'))
    assert sorted(head) == ['b', 'bias', 'gain', 'w']
    assert head['gain'].item() == 2.5 and head['bias'].item() == -0.5
    torch.testing.assert_close(head['w'], lm.heads['reward'].w, rtol=0, atol=0)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match='missing_dir'):
        hf_export.export(str(tmp_path / 'missing_dir'), str(tmp_path / 'hf'))
    with pytest.raises(ValueError, match="'model.h.0.attn.bogus'"):
        hf_gpt2.convert_state({'model.h.0.attn.bogus': torch.zeros(1)})
    hparams = model.HParams(n_vocab=27, n_ctx=8, n_embd=8, n_head=2, n_layer=1)
    state = {'model.' + k: v for k, v in model.Model(hparams).state_dict().items()}
    hparams.n_layer = 2  # hparams.json no longer matches the weights
    checkpoints.write_checkpoint(str(tmp_path / 'bad'), 1, state, hparams=hparams, encoding='test')
    with pytest.raises(ValueError, match=r'lacks transformer\.h\.1\.ln_1\.weight'):
        hf_export.export(str(tmp_path / 'bad'), str(tmp_path / 'hf2'))


def test_sample_py_export_command(tmp_path, capsys):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location('sample_cli', Path(__file__).resolve().parents[1] / 'sample.py')
    sample_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample_cli)

    lm, _ = _random_policy_dir(tmp_path)  # tmp_path is a save dir holding policy/
    sample_cli.launch.main(sample_cli.COMMANDS, argv=['export', '--save_dir', str(tmp_path), '--out', str(tmp_path / 'hf')])
    assert str(tmp_path / 'hf' / 'model.safetensors') in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / 'hf')).eval()
    tokens = torch.arange(10)[None] % 27
    with torch.no_grad():
        assert (lm.eval()(tokens)['lm_logits'] - hf(tokens).logits).abs().max().item() <= 1e-4

    for argv, message in [(['--save_dir', str(tmp_path)], 'export needs --save_dir DIR'),
                          (['--save_dir', str(tmp_path), '--out', 'x', '--savescope', 'reward_model'],
                           f'{tmp_path / "reward_model"} does not exist'),
                          (['--save_dir', str(tmp_path), '--out', 'x', '--savescope', 'ref'], "export takes 'policy' or 'reward_model'")]:
        with pytest.raises(SystemExit) as e:
            sample_cli.launch.main(sample_cli.COMMANDS, argv=['export', *argv])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_export_takes_an_empty_folder_outside_every_save_dir(tmp_path, capsys):
    """A folder holding files is refused in one line (old files beside the new ones would mix into the model
    transformers loads) unless --force, which replaces an earlier export there and leaves the rest; a run's
    save dir or a folder in it never, --force neither. Nothing is written when refused."""
    import importlib.util
    from pathlib import Path
    from lm_human_preferences import train_policy
    spec = importlib.util.spec_from_file_location('sample_cli', Path(__file__).resolve().parents[1] / 'sample.py')
    sample_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample_cli)
    save_dir = tmp_path / 'run'
    hparams = train_policy.HParams()
    hparams.override_from_dict({
        'task.policy.initial_model': 'test', 'task.query_dataset': 'test', 'task.query_length': 2,
        'task.response_length': 3, 'rewards.trained_model': 'test', 'ppo.batch_size': 8, 'ppo.total_episodes': 8,
        'ppo.noptepochs': 1, 'run.seed': 1, 'run.save_dir': str(save_dir)})
    hparams.validate()
    train_policy.train(hparams)

    def export(out, *force):
        sample_cli.launch.main(sample_cli.COMMANDS, argv=['export', '--save_dir', str(save_dir), '--out', str(out),
                                                           *force])

    def refused(out, *force):
        before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob('*') if p.name != '.lock')
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            export(out, *force)
        assert e.value.code == 1
        assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob('*') if p.name != '.lock') == before
        return capsys.readouterr().err

    hf = tmp_path / 'hf'
    export(hf)
    assert refused(hf) == (f'error: {hf} is not empty (it holds config.json and 6 more): export into a new or empty '
                           f'folder, or add --force to replace the files an export writes there (the rest stay)\n')
    (hf / 'reward_head.safetensors').write_bytes(b'an earlier export of a reward model')
    (hf / 'README.md').write_text('notes')
    export(hf, '--force')
    assert sorted(p.name for p in hf.iterdir()) == [
        'README.md', 'config.json', 'generation_config.json', 'lmhp_export.json', 'model.safetensors',
        'tokenizer.json', 'tokenizer_config.json', 'value_head.safetensors']
    for out, where, mark in [(save_dir, 'is', 'train_policy_hparams.json'),
                             (save_dir / 'hf', 'is inside', 'train_policy_hparams.json'),
                             (save_dir / 'policy', 'is', 'train_state')]:
        run_folder = save_dir / 'policy' if mark == 'train_state' else save_dir
        assert refused(out, '--force') == (f'error: {out} {where} the run folder {run_folder} (it holds {mark}): '
                                           f'export into a folder of its own, outside the save dir\n')
    (tmp_path / 'file').write_text('')
    assert refused(tmp_path / 'file') == f'error: {tmp_path / "file"} is a file: an export writes a folder\n'


# ---- the tokenizer (once not written: AutoTokenizer silently gave an empty one, vocab_size 0) ----

def _random_model_dir(path, encoding, n_ctx=40):
    """A saved policy of ours with large random weights (greedy choices far from ties)."""
    hparams = model.HParams(n_vocab=encoding.n_vocab, n_ctx=n_ctx, n_embd=32, n_head=4, n_layer=2)
    torch.manual_seed(0)
    lm = model.Model(hparams, scalar_heads=['value'])
    with torch.no_grad():
        for name, p in lm.named_parameters():
            p.copy_((0.5 if name == 'wte' else 0.3) * torch.randn_like(p) + (1 if name.endswith('.g') else 0))
    checkpoints.save_checkpoint(str(path), 1, lm, hparams=hparams, encoding=encoding)
    return path


QUERIES = {'test': ['the.river.is.a.', 'by.the.bridge.', 'every.eve.'],
           'main': ['The river is a', 'By the bridge, he said:\n\n', 'Every eve']}


@pytest.mark.parametrize('encoding_name', ['test', pytest.param('main', marks=pytest.mark.slow)])
def test_auto_tokenizer_and_generate_reproduce_our_samples(encoding_name, tmp_path):
    """AutoTokenizer + GPT2LMHeadModel.generate on the export give our policy's sample texts (greedy: our
    sampler at temperature 0), prompts of different lengths padded in one batch as the printed usage does."""
    encoding = encodings.get(encoding_name)
    policy_dir = _random_model_dir(tmp_path / 'policy', encoding)
    hf_export.export(str(policy_dir), str(tmp_path / 'hf'))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / 'hf')).eval()
    encoder = encoding.get_encoder()
    assert tokenizer.vocab_size == encoding.n_vocab
    for text in QUERIES[encoding_name] + ['Any TEXT, 123 \u00e9!']:
        assert tokenizer(text)['input_ids'] == encoder.encode(text)
        assert tokenizer.decode(encoder.encode(text)) == encoder.decode(encoder.encode(text))

    policy = Policy(trained_models.TrainedModel(str(policy_dir)), temperature=0.0).eval()
    ours = [encoder.decode(policy.respond(torch.tensor([encoder.encode(q)]), length=12)['responses'][0].tolist())
            for q in QUERIES[encoding_name]]
    batch = tokenizer(QUERIES[encoding_name], return_tensors='pt', padding=True)
    assert len(set(map(len, batch['input_ids'].tolist()))) == 1 and (batch['attention_mask'] == 0).any()
    with torch.no_grad():  # as the printed usage: generate(**batch), the pads in the model's vocabulary
        out = hf.generate(**batch, max_new_tokens=12, min_new_tokens=12, do_sample=False, top_k=None, top_p=None)
    assert tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:]) == ours


@pytest.mark.parametrize('encoding_name', ['test', 'main'])
def test_padding_never_masks_a_character_of_the_prompt(encoding_name, tmp_path):
    """generate never takes a character of a prompt for padding (`.` as the test model's pad once made it mask
    every `.`: the configs now name no pad token for it), and the pad token is one the model embeds (a TRL
    user's generate(**tokenizer(texts, padding=True)) once hit an IndexError on the <pad> = 27 outside it)."""
    encoding = encodings.get(encoding_name)
    hf_export.export(str(_random_model_dir(tmp_path / 'policy', encoding)), str(tmp_path / 'hf'))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / 'hf')).eval()
    assert tokenizer.padding_side == 'left'
    text = 'the.river.is.a.'
    assert tokenizer.pad_token_id < hf.config.vocab_size  # embedded by the model
    if encoding_name == 'test':
        assert tokenizer.pad_token == '.' and hf.generation_config.pad_token_id is None
    else:  # GPT-2's convention: pad = eos, which generate never takes for padding
        assert tokenizer.pad_token_id == tokenizer.eos_token_id == hf.generation_config.pad_token_id == 50256
    ids = tokenizer(text, return_tensors='pt').input_ids
    with torch.no_grad():  # no attention_mask: generate infers one from the pad token, if it may
        inferred = hf.generate(ids, max_new_tokens=5, do_sample=False, top_k=None, top_p=None)
        explicit = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, top_k=None,
                               top_p=None)
    assert torch.equal(inferred, explicit)


@pytest.mark.parametrize('n_ctx, response_length', [(40, 9), (8, 3)])  # (8, 3): the `test` experiment's model
def test_generation_config_samples_as_our_policy(n_ctx, response_length, tmp_path, capsys):
    """The whole distribution (top_k 0, not transformers' 50) at the run's temperature and response length; and
    sample.py export prints how to use it: the printed code runs (its prompts once overflowed the `test`
    model's 8-token context: IndexError)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location('sample_cli', Path(__file__).resolve().parents[1] / 'sample.py')
    sample_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample_cli)
    from lm_human_preferences import train_policy
    from lm_human_preferences.utils import hyperparams
    _random_model_dir(tmp_path / 'run' / 'policy', encodings.Test, n_ctx=n_ctx)
    run_hparams = train_policy.HParams()
    run_hparams.override_from_dict({'task.policy.temperature': 0.7, 'task.response_length': response_length})
    hyperparams.save_json(run_hparams, str(tmp_path / 'run' / 'train_policy_hparams.json'))
    sample_cli.launch.main(sample_cli.COMMANDS, argv=['export', '--save_dir', str(tmp_path / 'run'),
                                                      '--out', str(tmp_path / 'hf')])
    out = capsys.readouterr().out
    config = json.loads((tmp_path / 'hf' / 'generation_config.json').read_text())
    assert (config['do_sample'], config['top_k'], config['temperature'], config['max_new_tokens']) == (True, 0, 0.7,
                                                                                                       response_length)
    usage = out[out.index('use it with transformers'):].splitlines()[1:]
    namespace = {}
    torch.manual_seed(0)
    exec('\n'.join(line[2:] for line in usage), namespace)  # prints the samples
    samples = capsys.readouterr().out
    assert samples.startswith("['") and len(eval(samples)) == 2 and all(len(s) == response_length for s in eval(samples))


def test_hf_tokenizer_made_offline_is_the_exports():
    """hf_export.hf_tokenizer(): GPT-2's tokenizer from the BPE files the package ships, no download (what the
    README shows a TRL user): our encoder's ids, <|endoftext|> as eos and pad, left padding with a mask."""
    tokenizer = hf_export.hf_tokenizer()
    encoder = encodings.Main.get_encoder()
    for text in QUERIES['main'] + ['Any TEXT, 123 \u00e9!']:
        assert tokenizer(text)['input_ids'] == encoder.encode(text)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 50256 and tokenizer.padding_side == 'left'
    batch = tokenizer(['a b', 'hello there friend'], padding=True)
    assert batch['input_ids'][0][0] == 50256 and batch['attention_mask'][0] == [0, 1, 1]
