"""Parity with the original: checkpoints written with TensorFlow in the original's three layouts (GPT-2
release, train_reward save dir, train_policy save dir), converted and loaded by our code, must give the
outputs of an independent float64 numpy implementation of the original's equations (written below
from the original's TF code, not from our model.py): LM logits, policy logprobs / entropies / values at
temperature 0.7, sampled-token logprobs and values through the KV cache, and rewards, on batches with
padding inside and at the end of queries and trailing padding in responses. Max abs error <= 1e-5, with
the models on the CPU and, where there is one, on a CUDA device in float32 (TF32 off).

Without TensorFlow (a GPU machine that lacks it): `python tests/test_parity.py --write DIR` on a machine
with it writes the checkpoints, the models converted from them by our converter, and the variables the
reference reads; where tensorflow is not importable, LMHP_TEST_PARITY_ORIGINALS=DIR runs the tests from
those. There the conversion has run on the machine with TensorFlow, and the device part checks the model's
numerics.
"""

import os

import numpy as np
import pytest
import torch

from lm_human_preferences.language import convert_tf, encodings, model, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.rewards import RewardModelTrainer, TrainedRewardModel

from conftest import TINY, write_original_save_dirs, write_release

PAD = 27  # the test encoding's padding token
TEMPERATURE = 0.7
ATOL = 1e-5


# --- reference: the original's language/model.py equations in float64 numpy ---------------------------

def ref_norm(x, g, b, epsilon=1e-5):
    u = x.mean(-1, keepdims=True)
    s = np.square(x).mean(-1, keepdims=True) - np.square(u)
    return (x - u) / np.sqrt(s + epsilon) * g + b


def ref_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * np.power(x, 3))))


def ref_softmax(x):
    x = x - x.max(-1, keepdims=True)
    ex = np.exp(x)
    return ex / ex.sum(-1, keepdims=True)


def ref_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def ref_model(variables, scope, X, heads=()):
    """The original Model(...)(X=X, padding_token=PAD) for the TF variables of one scope (no past)."""
    p = {k[len(scope) + 1:]: np.asarray(v, dtype=np.float64) for k, v in variables.items() if k.startswith(scope + '/')}
    n_head, n_layer = TINY['n_head'], TINY['n_layer']
    X = np.asarray(X)
    batch, seq = X.shape
    mask = X != PAD
    X = np.where(mask, X, 0)
    positions = np.cumsum(mask, axis=-1) - mask  # exclusive cumsum
    h = p['wte'][X] + p['wpe'][positions]
    for layer in range(n_layer):
        w = lambda name: p[f'h{layer}/{name}']
        conv1x1 = lambda x, name: x @ w(f'{name}/w')[0] + w(f'{name}/b')
        x = ref_norm(h, w('ln_1/g'), w('ln_1/b'))
        q, k, v = np.split(conv1x1(x, 'attn/c_attn'), 3, axis=-1)
        split_heads = lambda t: t.reshape(batch, seq, n_head, -1).transpose(0, 2, 1, 3)
        q, k, v = map(split_heads, (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(v.shape[-1])
        nd = ns = seq
        i, j = np.arange(nd)[:, None], np.arange(ns)
        b = (i >= j - ns + nd).astype(np.float64)[None, None] * mask[:, None, None, :]
        att = ref_softmax(att * b - 1e10 * (1 - b))
        a = (att @ v).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        h = h + conv1x1(a, 'attn/c_proj')
        x = ref_norm(h, w('ln_2/g'), w('ln_2/b'))
        h = h + conv1x1(ref_gelu(conv1x1(x, 'mlp/c_fc')), 'mlp/c_proj')
    h = ref_norm(h, p['ln_f/g'], p['ln_f/b'])
    # pads take the hidden state of the last real token before them
    use = np.maximum.accumulate(np.where(mask, np.arange(seq)[None], -1), axis=-1)
    assert (use >= 0).all()
    h = h[np.arange(batch)[:, None], use]
    out = {'lm_logits': h @ p['wte'].T}
    for head in heads:
        out[head] = h @ p[f'heads/{head}/w'] + p[f'heads/{head}/b']
    return out


def ref_policy_analysis(variables, scope, queries, responses):
    """The original Policy.analyze_responses at TEMPERATURE (embed_queries = identity)."""
    out = ref_model(variables, scope, np.concatenate([queries, responses], 1), heads=['value'])
    lq = queries.shape[1]
    logits = out['lm_logits'][:, lq - 1:-1, :TINY['n_vocab']] / TEMPERATURE
    logp = ref_log_softmax(logits)
    pd = np.exp(logp)
    return dict(
        logprobs=np.take_along_axis(logp, responses[..., None], -1)[..., 0],
        entropies=-(pd * logp).sum(-1),
        values=out['value'][:, lq - 1:-1],
    )


def ref_reward(variables, scope, queries, responses):
    out = ref_model(variables, f'{scope}/model', np.concatenate([queries, responses], 1), heads=['reward'])
    gain, bias = variables[f'{scope}/reward_norm/gain'], variables[f'{scope}/reward_norm/bias']
    return np.float64(gain) * out['reward'][:, -1] + np.float64(bias)


# --- data ---------------------------------------------------------------------------------------------

QUERIES = np.array([
    [3, 4, PAD, PAD, 9, 10],     # padding inside
    [5, 6, 7, 8, PAD, PAD],      # padding at the end
    [1, PAD, 2, PAD, 3, PAD],    # both
    [11, 12, 13, 14, 15, 16],    # none
])
RESPONSES = np.array([
    [1, 2, 3, 4, 5],
    [6, 7, 8, 9, 10],
    [20, 21, 22, 23, 24],
    [25, 26, 0, 1, 2],
])
RESPONSES_PADDED = np.array([  # postprocessed responses: trailing padding
    [1, 2, 3, PAD, PAD],
    [6, 7, 8, 9, 10],
    [20, PAD, PAD, PAD, PAD],
    [25, 26, 0, 1, PAD],
])


ORIGINALS_ENV = 'LMHP_TEST_PARITY_ORIGINALS'

# The models the tests load: name -> (the original's dir, the scope our loaders convert it with; None:
# inferred from the dir's name). The reference's variables go by the same names.
LOADS = {
    'release': ('release_dir', None),
    'policy': ('policy_dir', None),            # inferred: policy/...
    'reward': ('reward_dir', 'reward_model'),  # TrainedRewardModel's default scope; the trainer's below
    'score': ('policy_dir', 'reward_model'),   # the score model inside a policy save
}


def write_originals(tf, root):
    """The original's three layouts under root: their dirs and the variables written in them."""
    rng = np.random.RandomState(1234)
    release_dir = os.path.join(root, 'release')
    release = write_release(tf, release_dir, rng)
    with open(os.path.join(release_dir, 'encoding'), 'w') as f:
        f.write('"test"')  # the tiny release uses the test vocabulary
    dirs = write_original_save_dirs(tf, os.path.join(root, 'save'), rng)
    return dict(release_dir=release_dir, release=release, **dirs)


def write_prepared(root):
    """--write: the originals in root, each model of LOADS converted by our converter as our loaders
    convert it, into root/converted/<name>, and the reference's variables, root/variables/<name>.npz."""
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # as tests/conftest.py: quiet, no oneDNN rewrites
    os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
    import tensorflow as tf
    written = write_originals(tf, root)
    os.makedirs(os.path.join(root, 'variables'), exist_ok=True)
    for name, (tf_dir, scope) in LOADS.items():
        convert_tf.convert_tf_checkpoint(written[tf_dir], os.path.join(root, 'converted', name), scope=scope)
        np.savez(os.path.join(root, 'variables', f'{name}.npz'), **written[name])


def _read_npz(path):
    with np.load(path) as f:
        return dict(f)


def _tensorflow_importable():
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope='module')
def original(tmp_path_factory):
    """{'dirs': {name: (model dir, scope)}, 'variables': {name: {TF name: value}}} for the names of LOADS."""
    prepared = os.environ.get(ORIGINALS_ENV)
    if prepared and not _tensorflow_importable():
        # Our converted dirs hold one model each: the scope was chosen when --write converted them.
        return dict(dirs={name: (os.path.join(prepared, 'converted', name), None) for name in LOADS},
                    variables={name: _read_npz(os.path.join(prepared, 'variables', f'{name}.npz')) for name in LOADS})
    tf = pytest.importorskip('tensorflow', reason=f'needs tensorflow, or {ORIGINALS_ENV}=DIR written by '
                                                  f'`python tests/test_parity.py --write DIR` where it is installed')
    written = write_originals(tf, str(tmp_path_factory.mktemp('original')))
    return dict(dirs={name: (written[tf_dir], scope) for name, (tf_dir, scope) in LOADS.items()},
                variables={name: written[name] for name in LOADS})


@pytest.fixture(params=['cpu', 'cuda'])
def device(request):
    if request.param == 'cpu':
        yield torch.device('cpu')
        return
    if not torch.cuda.is_available():
        pytest.skip('needs a CUDA device (torch.cuda.is_available() is false)')
    # float32 proper: TF32 (PyTorch's default: off for matmuls, on for cuDNN) rounds the inputs of a product
    # to 10 mantissa bits: relative errors of ~1e-3, far beyond ATOL.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield torch.device('cuda')
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def trained_model(original, name):
    path, scope = original['dirs'][name]
    return trained_models.TrainedModel(path, scope=scope)


def _assert_close(ours, ref, what):
    ours = ours.detach().cpu().double().numpy()
    err = np.abs(ours - ref).max()
    assert err <= ATOL, f'{what}: max abs error {err:.3g} > {ATOL}'


def test_lm_logits_release_layout(original, device):
    tm = trained_model(original, 'release')
    m = model.Model(tm.hparams())
    tm.init_model(m)
    m.to(device)
    X = np.concatenate([QUERIES, RESPONSES_PADDED], 1)
    with torch.no_grad():
        ours = m(torch.from_numpy(X).to(device), padding_token=PAD)['lm_logits']
    ref = ref_model(original['variables']['release'], 'model', X)['lm_logits']
    assert np.abs(ref).max() > 1  # non-trivial logits
    _assert_close(ours, ref, 'lm_logits')


def test_policy_analysis_and_sampling(original, device):
    variables = original['variables']['policy']
    policy = Policy(trained_model(original, 'policy'), temperature=TEMPERATURE).to(device)
    q, r = torch.from_numpy(QUERIES).to(device), torch.from_numpy(RESPONSES).to(device)
    ref = ref_policy_analysis(variables, 'policy/model', QUERIES, RESPONSES)
    with torch.no_grad():
        ours = policy.analyze_responses(q, r)
    for key in ('logprobs', 'entropies', 'values'):
        _assert_close(ours[key], ref[key], key)
    assert np.abs(ref['values']).max() > 0.1

    # sampling: first step on the whole (padded) query, then one token at a time from the KV cache. The
    # tokens drawn differ between devices; the reference is computed from those drawn.
    rollout = policy.respond(q, length=5, generator=torch.Generator(device).manual_seed(0))
    sampled = rollout['responses'].cpu().numpy()
    ref = ref_policy_analysis(variables, 'policy/model', QUERIES, sampled)
    _assert_close(rollout['logprobs'], ref['logprobs'], 'sampled logprobs')
    _assert_close(rollout['values'], ref['values'], 'sampled values')


def test_rewards(original, device):
    q, r = torch.from_numpy(QUERIES).to(device), torch.from_numpy(RESPONSES_PADDED).to(device)
    reward_dir = original['dirs']['reward'][0]
    score_model = TrainedRewardModel(reward_dir, encodings.Test).to(device)  # its default scope: LOADS['reward']
    ref = ref_reward(original['variables']['reward'], 'reward_model', QUERIES, RESPONSES_PADDED)
    _assert_close(score_model.score_fn(q, r), ref, 'rewards')
    assert score_model.reward_gain.item() == pytest.approx(1.7)

    # the reward model trainer starting from the same save dir, under the original's scope name
    trainer = RewardModelTrainer(trained_model(original, 'reward')).to(device)
    _assert_close(trainer.get_rewards(q, r), ref, 'trainer rewards')

    # the score model stored inside a policy save dir
    score = RewardModelTrainer(trained_model(original, 'score')).to(device)
    _assert_close(score.get_rewards(q, r),
                  ref_reward(original['variables']['score'], 'reward_model', QUERIES, RESPONSES_PADDED),
                  'score model rewards')

    with pytest.raises(ValueError, match="n_vocab 27, but encoding 'main' has 50257"):
        TrainedRewardModel(reward_dir, encodings.Main)


if __name__ == '__main__':
    import argparse
    parser = argparse.ArgumentParser(description=f'Prepare the tests for a machine without tensorflow: run them '
                                                 f'there with {ORIGINALS_ENV}=DIR.')
    parser.add_argument('--write', metavar='DIR', required=True,
                        help='write the originals, the models converted from them and the variables into DIR')
    args = parser.parse_args()
    write_prepared(args.write)
    print(f'wrote {args.write}; without tensorflow: {ORIGINALS_ENV}={args.write} pytest tests/test_parity.py')
