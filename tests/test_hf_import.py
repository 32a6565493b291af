"""A Hugging Face GPT-2 as the starting model (language/hf_import.py): a folder written by transformers, our
own export, a hub name; converted once and cached; each unusable folder or name is one line."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lm_human_preferences.language import checkpoints, encodings, hf_export, hf_import, model, model_sources, trained_models
from lm_human_preferences.utils import gcs

transformers = pytest.importorskip('transformers')  # the `test-full` extra
REPO_ROOT = Path(__file__).resolve().parents[1]


def _randomize(hf):
    """Every parameter random, layer norms and biases included (a wrong mapping of any tensor shows)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith('ln_1.weight') or name.endswith('ln_2.weight') or name.endswith('ln_f.weight'):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith('wte.weight'):
                p.copy_(0.5 * torch.randn_like(p))  # logits of size ~10: differences would show
            else:
                p.copy_(0.3 * torch.randn_like(p) if name.endswith('bias') else 0.05 * torch.randn_like(p))
    return hf.eval()


def _hf_folder(path, *, n_vocab, tokenizer=None, **config):
    config = transformers.GPT2Config(vocab_size=n_vocab, n_positions=32, n_embd=48, n_layer=3, n_head=4, **config)
    hf = _randomize(transformers.GPT2LMHeadModel(config))
    hf.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return hf


@pytest.fixture
def gpt2_folder(tmp_path):
    """A GPT2LMHeadModel folder written by transformers (random weights) with GPT-2's own tokenizer."""
    files = tmp_path / 'tokenizer-files'  # GPT-2's tokenizer files under the hub's names
    files.mkdir()
    encoder_json, vocab_bpe = encodings.Main.bpe_files()  # the shipped copies
    (files / 'vocab.json').write_bytes(Path(encoder_json).read_bytes())
    (files / 'merges.txt').write_bytes(Path(vocab_bpe).read_bytes())
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(files))
    hf = _hf_folder(tmp_path / 'gpt2-random', n_vocab=50257, tokenizer=tokenizer)
    return hf, tmp_path / 'gpt2-random'


def _ours(name_or_dir):
    m = trained_models.TrainedModel(str(name_or_dir))
    lm = model.Model(m.hparams())
    m.init_model(lm)
    return m, lm.eval()


def _block_outputs(lm):
    """Capture each transformer block's output h, rows of tokens [b*s, e] (transformers' hidden_states[1:-1])."""
    outputs = []
    for block in lm.h:
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    return outputs


@pytest.fixture
def test_encoding_folder(tmp_path):
    """A GPT2LMHeadModel folder written by transformers (random weights) with our `test` characters' tokenizer."""
    hf = _hf_folder(tmp_path / 'test-random', n_vocab=27)
    (tmp_path / 'test-random' / 'tokenizer.json').write_text(_test_tokenizer())
    return hf, tmp_path / 'test-random'


@pytest.mark.parametrize('folder, encoding', [('gpt2_folder', encodings.Main), ('test_encoding_folder', encodings.Test)])
def test_forward_equals_transformers_to_1e_5(folder, encoding, request):
    hf, folder = request.getfixturevalue(folder)
    m, lm = _ours(folder)
    assert m.encoding is encoding  # decided by the folder's tokenizer
    hp = m.hparams()
    assert (hp.n_vocab, hp.n_ctx, hp.n_embd, hp.n_layer, hp.n_head) == (encoding.n_vocab, 32, 48, 3, 4)
    tokens = torch.randint(0, encoding.n_vocab, (3, 32), generator=torch.Generator().manual_seed(1))  # no padding
    blocks = _block_outputs(lm)
    with torch.no_grad():
        ours = lm(tokens)
        theirs = hf(tokens, output_hidden_states=True)
    assert theirs.logits.abs().max() > 5  # large logits: a difference would show
    assert (ours['lm_logits'] - theirs.logits).abs().max().item() <= 1e-5
    for i, h in enumerate(blocks[:-1]):  # hidden_states[i + 1] is block i's output; the last one is after ln_f
        assert (h.view_as(theirs.hidden_states[i + 1]) - theirs.hidden_states[i + 1]).abs().max().item() <= 1e-5, i
    assert (ours['h'] - theirs.hidden_states[-1]).abs().max().item() <= 1e-5


def test_converted_once_and_again_when_the_folder_changes(gpt2_folder, capsys):
    _, folder = gpt2_folder
    first = trained_models.TrainedModel(str(folder))
    assert 'converting' in capsys.readouterr().out
    path = first.checkpoint()
    assert path.startswith(os.path.join(gcs.saved_models_dir(), 'converted', 'hf-gpt2-random-'))
    again = trained_models.TrainedModel(str(folder))
    assert again.checkpoint() == path and 'converting' not in capsys.readouterr().out
    config = json.loads((folder / 'config.json').read_text())
    config['n_positions'] = 32  # the same value, a new file: converted again
    (folder / 'config.json').write_text(json.dumps(config))
    assert trained_models.TrainedModel(str(folder)).checkpoint() != path


def test_our_export_comes_back_as_it_went(tmp_path):
    """A policy of ours (test encoding, value head) exported, then used as a starting model: the same state."""
    hparams = model.HParams(n_vocab=27, n_ctx=16, n_embd=8, n_head=2, n_layer=2)
    torch.manual_seed(3)
    lm = model.Model(hparams, scalar_heads=['value'])
    with torch.no_grad():
        for p in lm.parameters():
            p.copy_(torch.randn_like(p))
    checkpoints.save_checkpoint(str(tmp_path / 'policy'), 5, lm, hparams=hparams, encoding=encodings.Test)
    hf_export.export(str(tmp_path / 'policy'), str(tmp_path / 'hf'))
    m = trained_models.TrainedModel(str(tmp_path / 'hf'))
    assert m.encoding is encodings.Test and m.hparams().to_nested_dict() == {
        **hparams.to_nested_dict(), **{k: v for k, v in model.HParams().to_nested_dict().items() if k.endswith('pdrop')}}
    back = checkpoints.load_checkpoint(m.checkpoint())
    assert sorted(back) == sorted('model.' + k for k in lm.state_dict())
    for k, v in lm.state_dict().items():
        assert torch.equal(back['model.' + k], v), k


def test_a_reward_models_export_keeps_its_head_and_normalization(tmp_path):
    hparams = model.HParams(n_vocab=27, n_ctx=8, n_embd=8, n_head=2, n_layer=1)
    state = {'model.' + k: v for k, v in model.Model(hparams, scalar_heads=['reward']).state_dict().items()}
    state.update({'reward_norm.gain': torch.tensor(2.5), 'reward_norm.bias': torch.tensor(-0.5)})
    checkpoints.write_checkpoint(str(tmp_path / 'rm'), 3, state, hparams=hparams, encoding='test')
    hf_export.export(str(tmp_path / 'rm'), str(tmp_path / 'hf'))
    back = checkpoints.load_checkpoint(trained_models.TrainedModel(str(tmp_path / 'hf')).checkpoint())
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], v) for k, v in state.items())


def _edit_config(folder, **changes):
    config = json.loads((folder / 'config.json').read_text())
    config.update(changes)
    (folder / 'config.json').write_text(json.dumps(config))


@pytest.mark.parametrize('change, message', [
    (dict(model_type='llama'), "config.json: model_type 'llama' is not GPT-2 ('gpt2')"),
    (dict(activation_function='relu'),
     "config.json: activation_function 'relu' is not supported (our GPT-2 computes 'gelu_new' or 'gelu_pytorch_tanh')"),
    (dict(layer_norm_epsilon=1e-6), 'config.json: layer_norm_epsilon 1e-06 is not supported'),
    (dict(n_inner=100), "config.json: n_inner 100 is not supported (our GPT-2's MLP is 4 * n_embd = 32 wide)"),
    (dict(tie_word_embeddings=False), 'config.json: tie_word_embeddings False is not supported'),
    (dict(vocab_size=28), 'config.json: vocab_size 28 is not the 27 tokens of its tokenizer'),
])
def test_a_config_our_model_cannot_compute_is_one_line(change, message, tmp_path):
    hparams = model.HParams(n_vocab=27, n_ctx=8, n_embd=8, n_head=2, n_layer=1)
    checkpoints.save_checkpoint(str(tmp_path / 'p'), 1, model.Model(hparams), hparams=hparams, encoding=encodings.Test)
    hf_export.export(str(tmp_path / 'p'), str(tmp_path / 'hf'))
    _edit_config(tmp_path / 'hf', **change)
    with pytest.raises(ValueError) as e:
        trained_models.TrainedModel(str(tmp_path / 'hf'))
    assert message in str(e.value) and '\n' not in str(e.value)


def test_other_tokenizers_pickles_and_untied_heads_are_one_line(tmp_path):
    from tokenizers import Tokenizer, models
    _hf_folder(tmp_path / 'hf', n_vocab=27)
    with pytest.raises(ValueError, match=r'has no tokenizer \(tokenizer.json, or vocab.json and merges.txt\)'):
        trained_models.TrainedModel(str(tmp_path / 'hf'))
    bpe = Tokenizer(models.BPE({chr(97 + i): i for i in range(27)}, []))
    (tmp_path / 'hf' / 'tokenizer.json').write_text(bpe.to_str())
    with pytest.raises(ValueError, match=r"tokenizer \(BPE, 27 tokens\) is not supported: only GPT-2's BPE"):
        trained_models.TrainedModel(str(tmp_path / 'hf'))
    (tmp_path / 'hf' / 'tokenizer.json').write_text(_test_tokenizer())  # our test tokenizer: usable
    trained_models.TrainedModel(str(tmp_path / 'hf'))
    (tmp_path / 'hf' / 'model.safetensors').rename(tmp_path / 'hf' / 'pytorch_model.bin')
    with pytest.raises(FileNotFoundError, match=r'has no model.safetensors \(only pytorch_model.bin, which we do not '
                                                r'load: a pickle can run code'):
        trained_models.TrainedModel(str(tmp_path / 'hf'))


def test_a_folder_without_its_config_a_config_list_and_a_nan_weight_are_one_line(tmp_path):
    """Each names its cause: the folder's missing config.json (not our hparams.json), the file that holds no
    JSON object, the tensor and file of a NaN weight (not a failure to sample, later, naming neither); at
    launch (known_n_ctx) where the config says it."""
    hparams = model.HParams(n_vocab=27, n_ctx=8, n_embd=8, n_head=2, n_layer=1)
    checkpoints.save_checkpoint(str(tmp_path / 'p'), 1, model.Model(hparams), hparams=hparams, encoding=encodings.Test)
    hf = tmp_path / 'hf'
    hf_export.export(str(tmp_path / 'p'), str(hf))
    config = (hf / 'config.json').read_text()
    (hf / 'config.json').unlink()
    for load in (trained_models.known_n_ctx, trained_models.TrainedModel):
        with pytest.raises(FileNotFoundError, match=rf'^{hf} holds a Hugging Face model without its config.json '
                                                    r'\(the GPT2Config, which save_pretrained writes beside the '
                                                    r'weights\): copy it there$'):
            load(str(hf))
    (hf / 'config.json').write_text(json.dumps([json.loads(config)]))
    for load in (trained_models.known_n_ctx, trained_models.TrainedModel):
        with pytest.raises(ValueError, match=rf'^{hf}/config.json holds a JSON list: it must hold an object'):
            load(str(hf))
    (hf / 'config.json').write_text(config)
    from safetensors.torch import load_file, save_file
    weights = load_file(str(hf / 'model.safetensors'))
    weights['transformer.h.0.mlp.c_fc.weight'][1, 2] = float('nan')
    save_file(weights, str(hf / 'model.safetensors'), metadata={'format': 'pt'})
    with pytest.raises(ValueError, match=rf"^variable 'transformer.h.0.mlp.c_fc.weight' in {hf}/model.safetensors "
                                         r'holds non-finite values \(NaN or inf\): the model is broken$'):
        trained_models.TrainedModel(str(hf))
    # One of our checkpoints (written by hand: our trainers never save a non-finite weight): at load, named.
    state = checkpoints.load_checkpoint(str(tmp_path / 'p'))
    state['model.wpe'][0, 0] = float('inf')
    path = checkpoints.write_checkpoint(str(tmp_path / 'p'), 2, state, hparams=hparams, encoding=encodings.Test)
    with pytest.raises(ValueError, match=rf"^variable 'model.wpe' in {path} holds non-finite values"):
        _ours(tmp_path / 'p')


def _test_tokenizer():
    return hf_export.tokenizer_files(encodings.Test, model.HParams(n_ctx=8))['tokenizer.json']


def test_a_bad_name_is_one_line_before_any_download(tmp_path):
    with pytest.raises(ValueError, match=r"^model 'gpt 2' is none of: 124M, 355M, 774M, 1558M \(OpenAI's GPT-2, "
                                         r"downloaded\), test, a model dir .*, a Hugging Face GPT-2 folder or hub name"):
        trained_models.TrainedModel('gpt 2')
    with pytest.raises(FileNotFoundError, match='^model directory /no/such/model does not exist$'):
        trained_models.known_n_ctx('/no/such/model')
    assert model_sources.model_source('gpt2') == model_sources.model_source('openai-community/gpt2') == 'hub'
    for typo in ('125M', 'Gpt2', 'bogus'):  # no owner and no GPT-2 of the hub's: not a download that fails later
        with pytest.raises(ValueError, match=rf"^model '{typo}' is none of: "):
            model_sources.model_source(typo)
    (tmp_path / 'gpt2').mkdir()
    assert model_sources.model_source(str(tmp_path / 'gpt2')) == 'dir'  # a local folder wins


def _hub_cache(tmp_path, repo_id, folder):
    """huggingface_hub's cache layout under saved_models_dir()/huggingface, holding folder's files as the
    snapshot of commit 'c0ffee' of repo_id: what a download leaves there."""
    repo = Path(gcs.saved_models_dir()) / 'huggingface' / ('models--' + repo_id.replace('/', '--'))
    snapshot = repo / 'snapshots' / ('c0ffee' * 6 + 'c0ff')
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / 'refs').mkdir()
    (repo / 'refs' / 'main').write_text(snapshot.name)


def _offline_env():
    return dict(os.environ, HF_HUB_OFFLINE='1', PYTHONPATH=str(REPO_ROOT))


@pytest.mark.slow
def test_a_hub_name_offline_is_one_line_quickly_and_a_cached_one_runs(tmp_path):
    env = _offline_env()
    started = time.time()
    proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', 'x', '--task.policy.initial_model',
                           'openai-community/gpt2', '--save_dir', str(tmp_path / 'save')], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count('\n') == 1, proc.stderr
    assert proc.stderr.startswith("error: could not download the Hugging Face model 'openai-community/gpt2' (no local "
                                  "directory openai-community/gpt2 either): the hub cannot be reached (no internet?)")
    assert time.time() - started < 60

    # Once downloaded (here: the cache as a download leaves it), the name runs offline.
    hparams = trained_models.test_hparams()
    checkpoints.save_checkpoint(str(tmp_path / 'm'), 0, model.Model(hparams), hparams=hparams, encoding=encodings.Test)
    hf_export.export(str(tmp_path / 'm'), str(tmp_path / 'hf'))
    _hub_cache(tmp_path, 'someone/tiny-test', tmp_path / 'hf')
    proc = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', 'y', '--task.policy.initial_model',
                           'someone/tiny-test', '--save_dir', str(tmp_path / 'save')], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    converted = [d for d in (Path(gcs.saved_models_dir()) / 'converted').glob('hf-someone--tiny-test-*') if d.is_dir()]
    assert len(converted) == 1 and checkpoints.latest_checkpoint(str(converted[0]))


def test_hub_download_goes_through_huggingface_hub_into_our_cache(tmp_path, monkeypatch):
    """In process: the snapshot huggingface_hub finds in saved_models_dir()/huggingface is converted."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    hparams = trained_models.test_hparams()
    checkpoints.save_checkpoint(str(tmp_path / 'm'), 0, model.Model(hparams), hparams=hparams, encoding=encodings.Test)
    hf_export.export(str(tmp_path / 'm'), str(tmp_path / 'hf'))
    _hub_cache(tmp_path, 'someone/tiny', tmp_path / 'hf')
    m = trained_models.TrainedModel('someone/tiny')
    assert m.encoding is encodings.Test and m.hparams().n_ctx == hparams.n_ctx
    assert hf_import.is_hf_folder(str(tmp_path / 'hf'))
