"""Checkpoints: converting the original's TF checkpoints (written here with TensorFlow, named exactly as
the original named its variables), our safetensors format, and running without TensorFlow.

TensorFlow is imported once per session (module-scoped fixture); tests/test_parity.py reuses the
checkpoint writers below.
"""

import functools
import http.server
import json
import os
import pickle
import re
import runpy
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from lm_human_preferences.language import checkpoints, convert_tf, encodings, model, model_sources, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.rewards import RewardModelTrainer, TrainedRewardModel

from conftest import (TINY, expected_state, tf_model_variables, tiny_hparams, write_model_dir_files,
                      write_original_save_dirs, write_release, write_tf_checkpoint)

REPO_ROOT = Path(__file__).resolve().parents[1]


def import_tf():
    return pytest.importorskip('tensorflow', reason='needs tensorflow, the [tf] extra (pip install -e ".[tf]")')


@pytest.fixture(scope='module')
def tf():
    return import_tf()


def assert_state_equal(state, expected):
    assert sorted(state) == sorted(expected)
    for k, v in expected.items():
        assert tuple(state[k].shape) == v.shape, k
        np.testing.assert_array_equal(state[k].numpy(), v, err_msg=k)


def assert_no_pickle(directory):
    """Every file is JSON text or a valid safetensors file; nothing starts like a pickle or a zip."""
    for path in Path(directory).rglob('*'):
        if path.is_dir() or path.suffix == '.lock':
            continue
        head = path.read_bytes()[:4]
        assert not head.startswith(b'PK') and head[:1] != b'\x80', path
        if path.suffix == '.safetensors':
            checkpoints.load_checkpoint(str(path))
        else:
            json.loads(path.read_text())


# --- the GPT-2 124M release ----------------------------------------------------------------------------

@pytest.mark.slow
def test_gpt2_124m_name_map(gpt2_124m_dir):
    """The converter's map covers all 148 variables of OpenAI's 124M checkpoint (its index is enough to
    list them; the weights are not needed), 124,439,808 parameters, onto our Model's parameters."""
    d = gpt2_124m_dir
    tf = import_tf()  # after the files' check: without them, the skip names the files whatever is installed
    variables = tf.train.list_variables(str(d / 'model.ckpt'))
    hp = checkpoints.load_hparams(str(d / 'hparams.json'))
    assert convert_tf.infer_scope(variables, str(d), source='124M') == ''
    mapping = convert_tf.name_map(variables, hp, scope='', source='124M')
    assert len(variables) == 148 and len(mapping) == 148
    assert sum(int(np.prod(shape)) for _, shape in variables) == 124_439_808
    with torch.device('meta'):
        m = model.Model(hp)
    ours = {'model.' + k: list(v.shape) for k, v in m.state_dict().items()}
    shapes = dict(variables)
    assert sorted(mapping.values()) == sorted(ours)
    for name, key in mapping.items():
        tf_shape = shapes[name][1:] if len(shapes[name]) == 3 else shapes[name]
        assert tf_shape == ours[key], name
    assert sum(int(np.prod(s)) for s in ours.values()) == 124_439_808


def test_release_download_and_convert(tf, tmp_path, monkeypatch):
    """TrainedModel(<release>) downloads the five release files (here from a local server laid out like
    OpenAI's bucket), converts them once into saved_models_dir()/<name>, and loads them."""
    rng = np.random.RandomState(0)
    www = tmp_path / 'www'
    variables = write_release(tf, str(www / 'gpt-2' / 'models' / 'tiny'), rng)
    assert sorted(os.listdir(www / 'gpt-2' / 'models' / 'tiny')) == sorted(trained_models.GPT2_RELEASE_FILES)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(trained_models, 'GPT2_MODELS_URL', f'http://127.0.0.1:{server.server_port}/gpt-2/models')
        monkeypatch.setattr(model_sources, 'GPT2_RELEASES', model_sources.GPT2_RELEASES + ('tiny',))
        tm = trained_models.TrainedModel('tiny')
        assert tm.encoding is encodings.Main
        hp = tm.hparams()
        assert (hp.n_embd, hp.n_layer, hp.n_ctx) == (16, 2, 32)
        path = tm.checkpoint()
        assert path == os.path.join(os.environ['LMHP_SAVED_MODELS_DIR'], 'tiny', 'checkpoints', 'model-0.safetensors')
        mtime = os.stat(path).st_mtime_ns
        m = model.Model(hp)
        tm.init_model(m)
        assert_state_equal({'model.' + k: v for k, v in m.state_dict().items()}, expected_state(variables, ''))
        assert trained_models.TrainedModel('tiny').checkpoint() == path and os.stat(path).st_mtime_ns == mtime
        assert_no_pickle(os.path.dirname(os.path.dirname(path)))
    finally:
        server.shutdown()
        server.server_close()


# --- the original's trainer save dirs ------------------------------------------------------------------

@pytest.fixture(scope='module')
def save_dirs(tf, tmp_path_factory):
    return write_original_save_dirs(tf, str(tmp_path_factory.mktemp('original') / 'save'), np.random.RandomState(1))


def test_convert_trainer_save_dirs_and_cli(save_dirs, tmp_path):
    """Only the chosen scope is converted (ref_policy, the other models, optimizer slots and counters are
    skipped), weights squeezed, heads and reward_norm kept; the step comes from the checkpoint name."""
    dirs = save_dirs

    out = tmp_path / 'reward_out'
    runpy.run_path(str(REPO_ROOT / 'saved_models' / 'prepare_pytorch_checkpoint.py'), run_name='not_main')['main'](
        [dirs['reward_dir'], str(out)])
    assert checkpoints.latest_checkpoint(str(out)) == str(out / 'checkpoints' / 'model-0.safetensors')
    state = checkpoints.load_checkpoint(str(out))
    assert_state_equal(state, expected_state(dirs['reward'], 'reward_model'))
    assert state['reward_norm.gain'].item() == pytest.approx(1.7)
    assert (out / 'encoding').read_text() == '"test"'
    assert checkpoints.load_hparams(str(out / 'hparams.json')) == tiny_hparams()
    assert_no_pickle(out)

    out = tmp_path / 'policy_out'
    path = convert_tf.convert_tf_checkpoint(dirs['policy_dir'], str(out))
    assert path.endswith('model-7.safetensors')
    assert_state_equal(checkpoints.load_checkpoint(path), expected_state(dirs['policy'], 'policy'))

    # the score model inside a policy save, chosen explicitly
    out = tmp_path / 'score_out'
    convert_tf.convert_tf_checkpoint(dirs['policy_dir'], str(out), scope='reward_model')
    assert_state_equal(checkpoints.load_checkpoint(str(out)), expected_state(dirs['score'], 'reward_model'))


def test_trained_model_converts_local_tf_dir_once(save_dirs):
    dirs = save_dirs
    tm = trained_models.TrainedModel(dirs['policy_dir'])
    assert tm.encoding is encodings.Test
    path = tm.checkpoint()
    assert path.startswith(os.path.join(os.environ['LMHP_SAVED_MODELS_DIR'], 'converted', 'policy-'))
    mtime = os.stat(path).st_mtime_ns
    policy = Policy(tm)
    assert_state_equal({k: v for k, v in policy.state_dict().items()}, expected_state(dirs['policy'], 'policy'))
    assert trained_models.TrainedModel(dirs['policy_dir']).checkpoint() == path
    assert os.stat(path).st_mtime_ns == mtime
    # a newer checkpoint file (mtime) is converted again, into another cache dir
    index = os.path.join(dirs['policy_dir'], 'checkpoints', 'model.ckpt-7.index')
    os.utime(index, ns=(mtime + 10**9, mtime + 10**9))
    assert trained_models.TrainedModel(dirs['policy_dir']).checkpoint() != path


def _variant(name):
    """A release-layout checkpoint with one defect, and the error it must produce."""
    base = tf_model_variables(np.random.RandomState(3), 'model')
    hp = dict(TINY)
    if name == 'unknown':
        base['model/h0/attn/extra'] = np.zeros(3, np.float32)
        error = (ValueError, "unknown variable 'model/h0/attn/extra'")
    elif name == 'extra_layer':
        base['model/h2/ln_1/g'] = np.ones(16, np.float32)
        error = (ValueError, "unknown variable 'model/h2/ln_1/g'")
    elif name == 'missing':
        del base['model/h1/mlp/c_fc/w']
        error = (ValueError, "variable 'model/h1/mlp/c_fc/w' is missing")
    elif name == 'head_without_bias':
        base['model/heads/value/w'] = np.zeros(16, np.float32)
        error = (ValueError, "variable 'model/heads/value/b' is missing")
    elif name == 'misshaped':
        base['model/wpe'] = np.zeros((16, 16), np.float32)
        error = (ValueError, r"variable 'model/wpe' has shape \[16, 16\] .*implies \[32, 16\]")
    elif name == 'hparams_disagree':
        hp['n_embd'] = 8
        error = (ValueError, r"has shape .*hparams.json \(n_vocab=27, n_ctx=32, n_embd=8")
    else:
        raise AssertionError(name)
    return base, hp, error


@pytest.mark.parametrize('name', ['unknown', 'extra_layer', 'missing', 'head_without_bias', 'misshaped',
                                  'hparams_disagree'])
def test_conversion_errors(tf, tmp_path, name):
    variables, hp, (exc, match) = _variant(name)
    src = tmp_path / 'src'
    write_model_dir_files(str(src), hp, full_hparams=False)
    write_tf_checkpoint(tf, str(src / 'model.ckpt'), variables)
    with pytest.raises(exc, match=match):
        convert_tf.convert_tf_checkpoint(str(src), str(tmp_path / 'dst'))
    assert not (tmp_path / 'dst').exists()
    with pytest.raises(exc, match=match):  # the same error through TrainedModel
        trained_models.TrainedModel(str(src)).checkpoint()


def test_conversion_errors_files(tf, tmp_path):
    with pytest.raises(FileNotFoundError, match='no TensorFlow checkpoint in'):
        convert_tf.convert_tf_checkpoint(str(tmp_path), str(tmp_path / 'dst'))
    src = tmp_path / 'src'
    write_tf_checkpoint(tf, str(src / 'model.ckpt'), tf_model_variables(np.random.RandomState(4), 'model'))
    with pytest.raises(FileNotFoundError, match=f'{src}/hparams.json does not exist'):
        convert_tf.convert_tf_checkpoint(str(src), str(tmp_path / 'dst'))
    # a checkpoint holding two models, in a dir whose name picks neither
    both = tmp_path / 'both'
    write_model_dir_files(str(both))
    write_tf_checkpoint(tf, str(both / 'model.ckpt'), {
        **tf_model_variables(np.random.RandomState(5), 'policy/model', heads=['value']),
        **tf_model_variables(np.random.RandomState(6), 'reward_model/model', heads=['reward'])})
    with pytest.raises(ValueError, match=r"cannot tell which model .* scopes \['policy', 'reward_model'\]"):
        convert_tf.convert_tf_checkpoint(str(both), str(tmp_path / 'dst'))
    convert_tf.convert_tf_checkpoint(str(both), str(tmp_path / 'dst'), scope='policy')


def truncate_tf_data(prefix):
    """Cut the checkpoint's data file in half, as an interrupted copy or download leaves it."""
    data = Path(f'{prefix}.data-00000-of-00001')
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])


def test_truncated_tf_checkpoint(tf, tmp_path, monkeypatch):
    """A reward model whose data file was cut short: one line naming the checkpoint (TF's reader raises
    IndexError, 'Read less bytes than requested'), and nothing converted is left behind."""
    reward_dir = write_original_save_dirs(tf, str(tmp_path / 'truncated'), np.random.RandomState(7))['reward_dir']
    prefix = os.path.join(reward_dir, 'checkpoints', 'model.ckpt')
    truncate_tf_data(prefix)
    match = rf'^{re.escape(prefix)} is not a readable TensorFlow checkpoint \(truncated or corrupt: [^\n]+\)$'
    with pytest.raises(ValueError, match=match):
        convert_tf.convert_tf_checkpoint(reward_dir, str(tmp_path / 'dst'))
    assert not (tmp_path / 'dst').exists()
    monkeypatch.setenv('LMHP_SAVED_MODELS_DIR', str(tmp_path / 'saved_models'))
    with pytest.raises(ValueError, match=match):  # the same error through TrainedModel
        trained_models.TrainedModel(reward_dir).checkpoint()
    assert not list((tmp_path / 'saved_models').rglob('*.safetensors'))


@pytest.mark.slow
def test_conversion_prints_nothing_from_tensorflow(tf, tmp_path):
    """TF's C++ log lines (absl's 'All log messages before absl::InitializeLog()', the oneDNN and CPU
    feature notices) stay off stderr: a conversion prints nothing there, and a failing one only our line.
    Fresh processes: this one has imported TensorFlow already, and conversion set its environment."""
    write_release(tf, str(tmp_path / 'release'), np.random.RandomState(8))
    reward_dir = write_original_save_dirs(tf, str(tmp_path / 'save'), np.random.RandomState(9))['reward_dir']
    truncate_tf_data(os.path.join(reward_dir, 'checkpoints', 'model.ckpt'))
    env = {k: v for k, v in os.environ.items() if k not in ('TF_CPP_MIN_LOG_LEVEL', 'TF_ENABLE_ONEDNN_OPTS')}
    script = (f'from lm_human_preferences.language import convert_tf\n'
              f'convert_tf.convert_tf_checkpoint({str(tmp_path / "release")!r}, {str(tmp_path / "out")!r})\n')
    res = subprocess.run([sys.executable, '-c', script], cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and res.stderr == '', res.stderr
    assert checkpoints.latest_checkpoint(str(tmp_path / 'out')) is not None

    res = subprocess.run([sys.executable, 'launch.py', 'train_policy', 'test', 'x', '--save_dir', str(tmp_path / 'run'),
                          '--rewards.trained_model', reward_dir, '--rewards.train_new_model', 'off'],
                         cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        f'error: {reward_dir}/checkpoints/model.ckpt is not a readable TensorFlow checkpoint (truncated or corrupt: '
        f'Read less bytes than requested)'], res.stderr


# --- our format (no TensorFlow) ------------------------------------------------------------------------

def test_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    policy = Policy(trained_models.TrainedModel('test'))
    with torch.no_grad():
        policy.model.heads.value.b.fill_(0.5)
    d = str(tmp_path / 'policy')
    checkpoints.save_checkpoint(d, 3, policy, hparams=policy.model_hparams, encoding=encodings.Test)
    torch.manual_seed(1)
    checkpoints.save_checkpoint(d, 10, policy, hparams=policy.model_hparams, encoding='test')
    checkpoints.save_checkpoint(d, 9, Policy(trained_models.TrainedModel('test')),
                                   hparams=policy.model_hparams, encoding='test')
    assert checkpoints.latest_checkpoint(d) == os.path.join(d, 'checkpoints', 'model-10.safetensors')
    assert sorted(os.listdir(os.path.join(d, 'checkpoints'))) == [f'model-{s}.safetensors' for s in (10, 3, 9)]
    assert open(os.path.join(d, 'encoding')).read() == '"test"'
    assert_no_pickle(d)

    tm = trained_models.TrainedModel(d)
    assert tm.encoding is encodings.Test and tm.hparams() == policy.model_hparams
    loaded = Policy(tm)
    for k, v in policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    # a bare Model loads the policy's transformer; its missing value head is skipped
    m = model.Model(tm.hparams())
    tm.init_model(m)
    assert torch.equal(m.wte, policy.model.wte)

    # reward models keep reward_norm; a Policy loading a reward model keeps its value head's init
    rm = RewardModelTrainer(trained_models.TrainedModel('test'))
    rm.set_reward_norm(old_mean=1.0, old_std=2.0, new_mean=0.0, new_std=1.0)
    rd = str(tmp_path / 'reward_model')
    checkpoints.save_checkpoint(rd, 0, rm, hparams=rm.hparams, encoding='test')
    rm2 = RewardModelTrainer(trained_models.TrainedModel(rd))
    assert rm2.reward_gain.item() == 0.5 and rm2.reward_bias.item() == -0.5
    p = Policy(trained_models.TrainedModel(rd))
    assert torch.equal(p.model.h[1].mlp.c_fc.w, rm.model.h[1].mlp.c_fc.w)
    assert torch.all(p.model.heads.value.w == 0)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='model directory /nonexistent/dir does not exist'):
        trained_models.TrainedModel('/nonexistent/dir')
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f'no checkpoint in {empty}'):
        trained_models.TrainedModel(str(empty)).checkpoint()
    with pytest.raises(FileNotFoundError, match=rf'^{empty}/hparams.json does not exist: {empty} is not a model '
                                                rf'directory \(one holds hparams.json and checkpoints/; a save dir '
                                                r'holds them in policy/ and reward_model/\)$'):
        trained_models.TrainedModel(str(empty)).hparams()
    with pytest.raises(FileNotFoundError, match='no checkpoint in'):
        checkpoints.load_checkpoint(str(empty))
    a_file = tmp_path / 'labels.json'
    a_file.write_text('[]')
    with pytest.raises(FileNotFoundError, match=f'^model directory {a_file} is a file, not a directory$'):
        trained_models.TrainedModel(str(a_file))

    policy = Policy(trained_models.TrainedModel('test'))
    good = policy.state_dict()

    def write(name, state, hp=policy.model_hparams):
        d = str(tmp_path / name)
        checkpoints.write_checkpoint(d, 0, state, hparams=hp, encoding='test')
        return d

    d = write('hparams_disagree', good, hp=tiny_hparams(n_vocab=27, n_ctx=8, n_embd=14, n_head=1))
    with pytest.raises(ValueError, match=r"'model.wpe' has shape \[8, 7\] .* expects \[8, 14\]"):
        Policy(trained_models.TrainedModel(d))
    d = write('unknown', {**good, 'model.h.0.attn.extra': torch.zeros(2)})
    with pytest.raises(ValueError, match="unknown variable 'model.h.0.attn.extra'"):
        Policy(trained_models.TrainedModel(d))
    d = write('missing', {k: v for k, v in good.items() if k != 'model.ln_f.g'})
    with pytest.raises(ValueError, match="variable 'model.ln_f.g' is missing"):
        Policy(trained_models.TrainedModel(d))


def test_loading_pickles_is_refused(tmp_path):
    d = tmp_path / 'm'
    (d / 'checkpoints').mkdir(parents=True)
    state = {'model.wte': torch.zeros(2, 2)}
    torch.save(state, d / 'checkpoints' / 'model-5.safetensors')
    # Loading a dir skips each bad checkpoint with a warning (newest first), then fails naming the first.
    with pytest.warns(checkpoints.CheckpointWarning, match='skipping checkpoint .*model-5.safetensors: refusing'), \
            pytest.raises(ValueError, match='refusing to load .*model-5.safetensors: it is a pickle'):
        checkpoints.load_checkpoint(str(d))
    with open(d / 'checkpoints' / 'model-6.safetensors', 'wb') as f:
        pickle.dump(state, f)
    with pytest.warns(checkpoints.CheckpointWarning, match='skipping checkpoint .*model-[56].safetensors: refusing'), \
            pytest.raises(ValueError, match='refusing to load .*model-6.safetensors'):
        checkpoints.load_checkpoint(str(d))
    (d / 'checkpoints' / 'model-7.safetensors').write_bytes(b'\x08\x00\x00\x00\x00\x00\x00\x00{bad json')
    with pytest.warns(checkpoints.CheckpointWarning, match='skipping checkpoint .*model-[567].safetensors'), \
            pytest.raises(ValueError, match='not a valid safetensors checkpoint'):
        checkpoints.load_checkpoint(str(d))


def test_safetensors_whose_header_length_starts_like_a_pickle(tmp_path):
    """A safetensors header length whose low byte is 0x80 (the pickle PROTO opcode) still loads."""
    for n in range(1, 64):
        state = {'model.' + 'w' * n: torch.arange(3.0)}
        data = safetensors.torch.save(state)
        if data[0] == 0x80:
            break
    assert data[0] == 0x80
    path = tmp_path / 'model-1.safetensors'
    path.write_bytes(data)
    with pytest.warns(checkpoints.CheckpointWarning, match='has no checksum'):  # written without our metadata
        assert torch.equal(checkpoints.load_checkpoint(str(path))['model.' + 'w' * n], torch.arange(3.0))


@pytest.mark.slow
def test_runs_without_tensorflow(tmp_path):
    """Everything but conversion imports and runs with tensorflow unimportable."""
    # A checkpoint of the GPT-2 release's layout, as far as conversion reads before it imports tensorflow.
    release = tmp_path / 'release'
    release.mkdir()
    (release / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt"\n')
    (release / 'model.ckpt.index').write_bytes(b'')
    (release / 'hparams.json').write_text('{"n_vocab": 50257, "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12}')
    script = textwrap.dedent(f'''
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == 'tensorflow' or name.startswith('tensorflow.'):
                    raise ImportError('tensorflow is blocked')
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(REPO_ROOT)!r})
        import torch
        from lm_human_preferences.language import checkpoints, encodings, model, sample, trained_models, convert_tf
        from lm_human_preferences import policy, rewards
        assert encodings.Main.get_encoder().encode('Hello world') == [15496, 995]
        p = policy.Policy(trained_models.TrainedModel('test'), temperature=0.7)
        q = torch.tensor([[1, 2, 27], [3, 4, 5]])
        r = p.respond(q, 3, generator=torch.Generator().manual_seed(0))
        a = p.analyze_responses(q, r['responses'])
        assert torch.allclose(r['logprobs'], a['logprobs'], atol=1e-5)
        checkpoints.save_checkpoint({str(tmp_path / 'p')!r}, 1, p, hparams=p.model_hparams, encoding='test')
        p2 = policy.Policy(trained_models.TrainedModel({str(tmp_path / 'p')!r}))
        rm = rewards.RewardModelTrainer(trained_models.TrainedModel('test'))
        rm.get_rewards(q, r['responses']).sum().backward()
        try:
            convert_tf.convert_tf_checkpoint({str(release)!r}, {str(tmp_path / 'x')!r})
        except ImportError as e:  # one line naming the extra that installs it
            assert type(e).__name__ == 'MissingExtra' and "pip install -e '.[tf]'" in str(e), e
        else:
            raise AssertionError('conversion ran without tensorflow')
        assert not any(m == 'tensorflow' or m.startswith('tensorflow.') for m in sys.modules)
        print('OK')
    ''')
    res = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith('OK'), res.stderr[-3000:]


def test_released_run_dir_over_https(save_dirs):
    """An original TF run served over https (as OpenAI's released runs/<task>/{reward_model,policy}) is
    downloaded once and converted: the reward model scores with the checkpoint's weights."""
    root = os.path.dirname(save_dirs['reward_dir'])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=root)
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f'http://127.0.0.1:{server.server_port}/reward_model'
        scorer = TrainedRewardModel(url, encodings.Test)
        assert scorer.reward_gain.item() == pytest.approx(1.7)
        assert_state_equal({f'model.{k}': v for k, v in scorer.model.state_dict().items()},
                           {k: v for k, v in expected_state(save_dirs['reward'], 'reward_model').items()
                            if k.startswith('model.')})
        tm = trained_models.TrainedModel(f'http://127.0.0.1:{server.server_port}/policy/')
        assert tm.encoding is encodings.Test and tm.checkpoint().endswith('model-7.safetensors')
    finally:
        server.shutdown()
        server.server_close()
