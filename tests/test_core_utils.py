"""Tests for utils/core.py.

The framework-independent cases of the original utils/test_core_utils.py come first (exact_div,
ceil_div, expand_tile, sample_buffer, map_flat, cumulative_max, index_each, top_k, top_p, safe_zip).
Not ported: test_where / test_map_flat_bits / test_graph_function, whose functions have no torch
counterpart (torch.where broadcasts scalars itself; no graphs or placeholders).
Multi-process behaviour of the distributed helpers is tested through launch in tests/test_launch.py.
"""
import math

import numpy as np
import pytest
import torch

from lm_human_preferences.utils import categorical, passes, ranks
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import finite
from lm_human_preferences.training import adam


def test_exact_div():
    assert utils.exact_div(12, 4) == 3
    assert utils.exact_div(12, 3) == 4
    with pytest.raises(ValueError):
        utils.exact_div(7, 3)


def test_ceil_div():
    for b in range(1, 10 + 1):
        for a in range(-10, 10 + 1):
            assert utils.ceil_div(a, b) == int(np.ceil(a / b))


def test_expand_tile():
    np.random.seed(7)
    size = 11
    for shape in (), (7,), (3, 5):
        data = np.asarray(np.random.randn(*shape), dtype=np.float32)
        x = torch.tensor(data)
        for axis in range(-len(shape) - 1, len(shape) + 1):
            y = utils.expand_tile(x, size, axis=axis).numpy()
            assert y.shape[axis] == size
            assert np.all(np.expand_dims(data, axis=axis) == y)


def test_sample_buffer():
    capacity = 100
    batch = 17
    lots = 100
    buffer = utils.SampleBuffer(capacity=capacity, schemas=dict(x=utils.Schema(torch.int32, ())))
    for i in range(20):
        buffer.add(x=batch * i + torch.arange(batch, dtype=torch.int32))
        samples = buffer.sample(lots, seed=7)['x'].numpy()
        hi = batch * (i + 1)
        lo = max(0, hi - capacity)
        assert lo <= samples.min() <= lo + 3
        assert hi - 5 <= samples.max() < hi
        all_data_1 = buffer.data()['x']
        all_data_2 = buffer.read(torch.arange(buffer.size()))['x']
        np.testing.assert_equal(all_data_1.numpy(), all_data_2.numpy())
        # Our addition: the buffer holds exactly the last `capacity` values ever added.
        assert buffer.total() == hi
        assert sorted(all_data_1.tolist()) == list(range(lo, hi))


def test_sample_buffer_errors():
    buffer = utils.SampleBuffer(capacity=4, schemas=dict(x=utils.Schema(torch.int32, (2,)),
                                                         y=utils.Schema(torch.float32, ())))
    with pytest.raises(ValueError, match='keys'):
        buffer.add(x=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r'key x has shape \(1, 3\)'):
        buffer.add(x=torch.zeros(1, 3, dtype=torch.int32), y=torch.zeros(1))
    with pytest.raises(ValueError, match='key x has dtype'):
        buffer.add(x=torch.zeros(1, 2), y=torch.zeros(1))
    with pytest.raises(ValueError, match='capacity 4'):
        buffer.add(x=torch.zeros(5, 2, dtype=torch.int32), y=torch.zeros(5))


def test_map_flat():
    inputs = [torch.tensor(x) for x in ([2], [3, 5], [[7, 11], [13, 17]])]
    outputs = utils.map_flat(torch.square, inputs)
    for i, o in zip(inputs, outputs):
        assert o.shape == i.shape
        assert torch.equal(i * i, o)


def test_cumulative_max():
    np.random.seed(7)
    for x in [
            np.random.randn(10),
            np.random.randn(11, 7),
            np.random.randint(-10, 10, size=10),
            np.random.randint(-10, 10, size=(12, 8)),
            np.random.randint(-10, 10, size=(3, 3, 4)),
    ]:
        assert np.all(utils.cumulative_max(torch.tensor(x)).numpy() == np.maximum.accumulate(x, axis=-1))


def test_index_each():
    np.random.seed(7)
    x = np.random.randn(7, 11)
    i = np.random.randint(x.shape[1], size=x.shape[0])
    y = utils.index_each(torch.tensor(x), torch.tensor(i))

    x2 = np.random.randn(3, 2, 4)
    i2 = np.random.randint(x2.shape[1], size=x2.shape[0])
    y2 = utils.index_each(torch.tensor(x2), torch.tensor(i2))

    x3 = np.random.randn(5, 9)
    i3 = np.random.randint(x3.shape[1], size=(x3.shape[0], 2))
    y3 = utils.index_each(torch.tensor(x3), torch.tensor(i3)).numpy()
    assert np.all(y.numpy() == x[np.arange(7), i])
    assert np.all(y2.numpy() == x2[np.arange(3), i2])
    assert np.all(y3[:, 0] == x3[np.arange(5), i3[:, 0]])
    assert np.all(y3[:, 1] == x3[np.arange(5), i3[:, 1]])
    with pytest.raises(ValueError, match='batch sizes differ'):
        utils.index_each(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))


def test_index_each_many():
    np.random.seed(7)
    x = np.random.randn(7, 11)
    i = np.random.randint(x.shape[1], size=[x.shape[0], 3])
    y = utils.index_each(torch.tensor(x), torch.tensor(i))
    assert np.all(y.numpy() == x[np.arange(7)[:, None], i])


def test_top_k():
    logits = torch.tensor([[[1, 1.01, 1.001, 0, 0, 0, 2]]], dtype=torch.float32)
    for k, want in [
        (1, [[[-1e10, -1e10, -1e10, -1e10, -1e10, -1e10, 2]]]),
        (2, [[[-1e10, 1.01, -1e10, -1e10, -1e10, -1e10, 2]]]),
        (3, [[[-1e10, 1.01, 1.001, -1e10, -1e10, -1e10, 2]]]),
        (4, [[[1, 1.01, 1.001, -1e10, -1e10, -1e10, 2]]]),
        (5, [[[1, 1.01, 1.001, 0, 0, 0, 2]]]),
    ]:
        np.testing.assert_allclose(utils.take_top_k_logits(logits, k).numpy(), want)


def test_top_p():
    logits = torch.tensor([[[1, 1.01, 1.001, 0, 0, 0, 2]]], dtype=torch.float32)
    np.testing.assert_allclose(utils.take_top_p_logits(logits, 1).numpy(), logits.numpy())
    for p, want in [
        (0, [[[-1e10, -1e10, -1e10, -1e10, -1e10, -1e10, 2]]]),
        (0.7, [[[-1e10, 1.01, 1.001, -1e10, -1e10, -1e10, 2]]]),
        (0.6, [[[-1e10, 1.01, -1e10, -1e10, -1e10, -1e10, 2]]]),
        (0.5, [[[-1e10, -1e10, -1e10, -1e10, -1e10, -1e10, 2]]]),
    ]:
        np.testing.assert_allclose(utils.take_top_p_logits(logits, p).numpy(), want)


def test_safe_zip():
    assert list(utils.safe_zip([1, 2], [3, 4])) == [(1, 3), (2, 4)]
    with pytest.raises(ValueError):
        utils.safe_zip([1, 2], [3, 4, 5])


# ---- additions ----

def test_flatten_dict():
    from collections import OrderedDict
    nested = dict(loss=dict(policy=1, value=2), val=OrderedDict(mean=3), top=4)
    assert utils.flatten_dict(nested, sep='/') == {'loss/policy': 1, 'loss/value': 2, 'val/mean': 3, 'top': 4}
    assert utils.flatten_dict({'a': {'b': {'c': 5}}}) == {'a.b.c': 5}
    with pytest.raises(ValueError, match="'a.b'"):
        utils.flatten_dict({'a.b': 1})


def test_whiten():
    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64) * 3 + 2
    xn = x.numpy()
    mean, var = xn.mean(), xn.var()  # numpy's var is the population variance, like tf.nn.moments
    np.testing.assert_allclose(utils.whiten(x).numpy(), (xn - mean) / np.sqrt(var + 1e-8), rtol=1e-12)
    np.testing.assert_allclose(utils.whiten(x, shift_mean=False).numpy(),
                               (xn - mean) / np.sqrt(var + 1e-8) + mean, rtol=1e-12)
    # +1e-8 is inside the rsqrt: a constant input stays finite (all zeros, or the mean back).
    c = torch.full((4,), 3.0)
    assert torch.equal(utils.whiten(c), torch.zeros(4))
    assert torch.equal(utils.whiten(c, shift_mean=False), c)


def test_entropy_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 7, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    np.testing.assert_allclose(utils.entropy_from_logits(logits).numpy(), (-(p * p.log()).sum(-1)).numpy(), rtol=1e-10)
    labels = torch.randint(0, 7, (3, 4))
    want = np.log(np.take_along_axis(p.numpy(), labels.numpy()[..., None], -1)[..., 0])
    np.testing.assert_allclose(utils.logprobs_from_logits(logits=logits, labels=labels).numpy(), want, rtol=1e-10)
    # Both from one log-softmax (policy.analyze_responses): the same values, the entropy outside autograd.
    logits.requires_grad_(True)
    logprobs, entropies = categorical.logprobs_and_entropies_from_logits(logits=logits, labels=labels)
    np.testing.assert_allclose(logprobs.detach().numpy(), want, rtol=1e-10)
    np.testing.assert_allclose(entropies.numpy(), (-(p * p.log()).sum(-1)).numpy(), rtol=1e-10)
    assert logprobs.requires_grad and not entropies.requires_grad


def test_sample_from_logits():
    logits = torch.tensor([[0.0, -1e10, -1e10], [-1e10, -1e10, 0.0]]).expand(50, 2, 3)
    g = torch.Generator().manual_seed(1)
    s = utils.sample_from_logits(logits, generator=g)
    assert s.shape == (50, 2) and s.dtype == torch.long
    assert torch.all(s[:, 0] == 0) and torch.all(s[:, 1] == 2)
    # Frequencies follow the softmax; the generator makes it reproducible.
    logits = torch.log(torch.tensor([0.2, 0.8])).expand(20000, 2)
    s1 = utils.sample_from_logits(logits, generator=torch.Generator().manual_seed(3))
    s2 = utils.sample_from_logits(logits, generator=torch.Generator().manual_seed(3))
    assert torch.equal(s1, s2)
    assert abs(s1.float().mean().item() - 0.8) < 0.02


def test_sample_from_logits_follows_the_softmax():
    # Pearson's chi-square over 8 classes spanning 4 orders of magnitude of probability: the 0.999
    # quantile of chi2(7) is 24.3, so a correct sampler fails this 1 time in 1000 (the seed is fixed).
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -4.0, -6.0])
    n = 200_000
    s = utils.sample_from_logits(logits.expand(n, 8), generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(s, minlength=8).double()
    expected = n * torch.softmax(logits.double(), -1)
    assert ((counts - expected) ** 2 / expected).sum().item() < 24.3, counts
    assert counts[-1] > 0  # the rarest class (p = 2.4e-4) does get sampled


def test_sample_from_logits_non_finite():
    # As TF's kernel: non-finite logits have weight 0 and are never sampled...
    logits = torch.tensor([[math.nan, 0.0, math.inf, -math.inf, 0.0]]).expand(1000, 5)
    s = utils.sample_from_logits(logits, generator=torch.Generator().manual_seed(0))
    assert set(s.tolist()) == {1, 4}
    # ... and a row with no finite logit (a diverged model) is an error naming the row.
    logits = torch.tensor([[0.0, 1.0], [math.nan, math.nan], [1.0, 2.0], [-math.inf, math.inf]])
    with pytest.raises(FloatingPointError, match=r'rows \[1, 3\] have no finite logits'):
        utils.sample_from_logits(logits)


def _running_sum_sample(logits, uniform):
    """TF's Multinomial kernel in one level: the first index whose float64 running sum of exp(logit - max)
    (finite logits only) exceeds uniform * total."""
    finite = torch.isfinite(logits)
    weights = torch.where(finite, torch.exp(logits - torch.where(finite, logits, -math.inf).amax(-1, keepdim=True)), 0)
    cdf = weights.double().cumsum(-1)
    return torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)[:, 0]


def test_sample_from_logits_two_levels_is_the_running_sums_sample():
    """The running sum in blocks (categorical.SAMPLE_BLOCK) samples what the one running sum samples from the same
    uniforms, over a vocabulary of many blocks and a partial one, with non-finite logits among them."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 5 * categorical.SAMPLE_BLOCK + 17, generator=g)
    logits[:, ::7] = -math.inf
    logits[:5, 100:] = -math.inf  # rows whose mass is all in the first block
    uniform = torch.rand(64, dtype=torch.float64, generator=g)
    samples, has_finite = categorical.sample_from_logits_unchecked(logits, uniform=uniform)
    assert has_finite.all()
    assert torch.equal(samples, _running_sum_sample(logits, uniform))
    # At the ends of [0, 1): the first and the last token of positive weight, never one of weight 0 (the
    # blocks' float32 sums and the float64 running sums within a block may round apart at the end).
    ends = torch.full((2, categorical.SAMPLE_BLOCK + 3), -math.inf)
    ends[:, 2:categorical.SAMPLE_BLOCK] = 0.0
    samples, _ = categorical.sample_from_logits_unchecked(ends, uniform=torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64))
    assert samples.tolist() == [2, categorical.SAMPLE_BLOCK - 1]
    # A target the block's running sums do not reach (its float32 sum rounded above them): its last token of
    # positive weight (index 1: index 2 adds 0), not the one past the end nor one of weight 0.
    cdf = torch.tensor([[1.0, 2.0, 2.0]], dtype=torch.float64)
    assert categorical.search_running_sum(cdf, torch.tensor([[2.0 + 1e-12]], dtype=torch.float64)).item() == 1
    assert categorical.search_running_sum(cdf, torch.tensor([[1.0]], dtype=torch.float64)).item() == 1  # upper bound


def test_pearson_r():
    rng = np.random.default_rng(0)
    x = rng.normal(size=50)
    y = 0.5 * x + rng.normal(size=50)
    r = utils.pearson_r(torch.tensor(x), torch.tensor(y)).item()
    assert abs(r - np.corrcoef(x, y)[0, 1]) < 1e-12


def test_flat_stats():
    stats = {'b': torch.tensor(2.0), 'a': torch.tensor(1.0)}
    fs = utils.FlatStats.from_dict(stats)
    assert fs.keys == ('a', 'b') and fs.flat.tolist() == [1.0, 2.0]
    assert {k: v.item() for k, v in fs.map_flat(lambda f: f * 10).as_dict().items()} == {'a': 10.0, 'b': 20.0}
    both = fs.concat(utils.FlatStats.from_dict({'c': torch.tensor(3.0)}))
    assert both.keys == ('a', 'b', 'c')
    assert both.with_values(torch.zeros(3)).as_dict()['c'].item() == 0.0
    with pytest.raises(ValueError, match='Duplicate statistics: a'):
        fs.concat(fs)
    with pytest.raises(ValueError, match='Statistic x has dtype'):
        utils.FlatStats.from_dict({'x': torch.tensor(1, dtype=torch.int32)})


def test_single_process_distributed_helpers():
    # Without a process group everything behaves as one MPI rank.
    assert ranks.get_rank() == 0 and ranks.get_world_size() == 1 and ranks.is_root()
    assert list(ranks.local_ranks()) == [0]
    x = torch.tensor([1.0, 2.0])
    assert utils.mpi_allreduce_sum([x]) is x
    assert utils.mpi_allreduce_mean([3.5]) == 3.5
    assert utils.mpi_bcast({'a': 1}) == {'a': 1}
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 4.0)
    utils.sync_params([p])
    grad = p.grad
    utils.mpi_allreduce_mean_grads([p])
    assert p.grad is grad and p.grad.tolist() == [4.0, 4.0]  # one process: nothing to average, nothing copied
    assert utils.get_device() == (torch.device('cuda', 0) if torch.cuda.is_available() else torch.device('cpu'))


def test_set_mpi_seed():
    import random
    utils.set_mpi_seed(5)
    a = (torch.rand(3), np.random.rand(3), random.random())
    utils.set_mpi_seed(5)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    utils.set_mpi_seed(6)
    assert not torch.equal(torch.rand(3), a[0])


def test_ranks_carried_by_one_process():
    """Three ranks in this process: each has its own section, streams (seed + 100003 * rank, continued
    from section to section) and share in the reductions; the process's own stream is apart."""
    import random
    with ranks.carry(3):
        assert ranks.get_world_size() == 3 and list(ranks.local_ranks()) == [0, 1, 2]
        assert ranks.get_rank() == 0 and ranks.is_root()  # outside the sections: the first rank carried
        utils.set_mpi_seed(5)
        first = ranks.for_each_rank(lambda: (ranks.get_rank(), ranks.is_root(), torch.rand(2).tolist(),
                                             np.random.rand(), random.random()))
        assert [f[:2] for f in first] == [(0, True), (1, False), (2, False)]
        second = ranks.for_each_rank(lambda: torch.rand(2).tolist())
        process_draw = torch.rand(2).tolist()
        # Each rank's stream is the one a process of its own would have: seeded seed + 100003 * rank.
        for rank, (f, s) in enumerate(zip(first, second)):
            torch.manual_seed(5 + 100003 * rank)
            np.random.seed(5 + 100003 * rank)
            random.seed(5 + 100003 * rank)
            assert f[2:] == (torch.rand(2).tolist(), np.random.rand(), random.random())
            assert s == torch.rand(2).tolist()
        torch.manual_seed(5)
        assert process_draw == torch.rand(2).tolist()

        assert utils.mpi_allreduce_sum([1, 2, 3]) == 6
        assert utils.mpi_allreduce_mean([torch.tensor(3.0), torch.tensor(6.0), torch.tensor(0.0)]).item() == 3.0
        p = torch.nn.Parameter(torch.ones(2))
        with pytest.raises(TypeError, match="the list of the values of this process's 3 ranks, got list of 2"):
            utils.mpi_allreduce_sum([1, 2])
        with pytest.raises(RuntimeError, match="collective over processes: call it outside the rank sections"):
            ranks.for_each_rank(lambda: utils.sync_params([p]))
        with pytest.raises(RuntimeError, match='rank sections do not nest'):
            ranks.for_each_rank(lambda: ranks.for_each_rank(lambda: None))
    assert ranks.get_world_size() == 1  # the layout ends with the block


def test_chunk_tensors():
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30)]
    chunks = utils.chunk_tensors(ts, limit=80)
    assert [len(c) for c in chunks] == [2, 1, 1]  # 40+40 bytes fit, a new dtype starts a chunk


def _tf_adam_trajectory(init, grads_per_step, lrs):
    tf = pytest.importorskip('tensorflow', reason='needs tensorflow, the [tf] extra (pip install -e ".[tf]")')
    var = tf.Variable(init)
    lr = tf.Variable(lrs[0], dtype=tf.float32)
    opt = tf.compat.v1.train.AdamOptimizer(learning_rate=lr, epsilon=1e-5)
    out = []
    for g, step_lr in zip(grads_per_step, lrs):
        lr.assign(step_lr)
        opt.apply_gradients([(tf.constant(g), var)])
        out.append(var.numpy().copy())
    return out


def _torch_trajectory(opt_cls, init, grads_per_step, lrs, **kw):
    p = torch.nn.Parameter(torch.tensor(init))
    opt = opt_cls([p], lr=lrs[0], **kw)
    out = []
    for g, step_lr in zip(grads_per_step, lrs):
        for group in opt.param_groups:
            group['lr'] = step_lr
        p.grad = torch.tensor(g)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


def _adam_problem():
    rng = np.random.default_rng(0)
    init = rng.normal(size=(64,)).astype(np.float32)
    # Gradients of mixed scales (some tiny, where epsilon matters most) and a decaying lr, as in PPO.
    grads = [(rng.normal(size=(64,)) * np.logspace(-6, 0, 64)).astype(np.float32) for _ in range(8)]
    lrs = [1e-3 * (1 - i / 8) for i in range(8)]
    return init, grads, lrs


def test_adam_tf_matches_tf1_adam():
    init, grads, lrs = _adam_problem()
    want = _tf_adam_trajectory(init, grads, lrs)
    got = _torch_trajectory(adam.AdamTF, init, grads, lrs, eps=1e-5)
    for step, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=f'step {step}')
        assert np.max(np.abs(g - init)) > 1e-4  # the weights did move


def test_adam_tf_in_chunks_is_the_same_update(monkeypatch):
    # On CPU the update runs in chunks of _ADAM_CHUNK values with reused scratch buffers: the same ops per
    # value, so the trajectory must equal TF's and, bit for bit, the unchunked one.
    init, grads, lrs = _adam_problem()
    whole = _torch_trajectory(adam.AdamTF, init, grads, lrs)
    monkeypatch.setattr(adam, '_ADAM_CHUNK', 10)  # 64 values: 6 full chunks and a partial one
    chunked = _torch_trajectory(adam.AdamTF, init, grads, lrs)
    want = _tf_adam_trajectory(init, grads, lrs)
    for step, (c, w, t) in enumerate(zip(chunked, whole, want)):
        np.testing.assert_array_equal(c, w, err_msg=f'step {step}')
        np.testing.assert_allclose(c, t, rtol=0, atol=1e-6, err_msg=f'step {step}')


def test_adam_tf_foreach_is_the_same_update():
    """The multi-tensor path (the default on CUDA) runs TF's kernel on all parameters at once: bit for bit the
    chunked path's trajectory (and so TF's), a parameter without a gradient left alone by both."""
    init, grads, lrs = _adam_problem()

    def trajectory(foreach):
        params = [torch.nn.Parameter(torch.tensor(init[:40])), torch.nn.Parameter(torch.tensor(init[40:]).view(4, 6)),
                  torch.nn.Parameter(torch.ones(3))]
        opt = adam.AdamTF(params, lr=lrs[0], foreach=foreach)
        out = []
        for g, lr in zip(grads, lrs):
            opt.param_groups[0]['lr'] = lr
            params[0].grad, params[1].grad = torch.tensor(g[:40]), torch.tensor(g[40:]).view(4, 6)
            opt.step()
            out.append(torch.cat([p.detach().flatten() for p in params]).numpy().copy())
        return out
    want = _tf_adam_trajectory(init, grads, lrs)
    for step, (f, c, w) in enumerate(zip(trajectory(True), trajectory(False), want)):
        np.testing.assert_array_equal(f, c, err_msg=f'step {step}')
        np.testing.assert_allclose(f[:64], w, rtol=0, atol=1e-6, err_msg=f'step {step}')
        assert np.all(f[64:] == 1)


def test_torch_adam_does_not_match_tf1_adam():
    # torch's eps is added to the bias-corrected sqrt(v): the same comparison must fail for it.
    init, grads, lrs = _adam_problem()
    want = _tf_adam_trajectory(init, grads, lrs)
    got = _torch_trajectory(torch.optim.Adam, init, grads, lrs, eps=1e-5)
    assert max(np.max(np.abs(g - w)) for g, w in zip(got, want)) > 1e-5


def test_adam_tf_state_dict_round_trip():
    init, grads, lrs = _adam_problem()
    full = _torch_trajectory(adam.AdamTF, init, grads, lrs)
    p = torch.nn.Parameter(torch.tensor(init))
    opt = adam.AdamTF([p], lr=lrs[0])
    for g, lr in zip(grads[:4], lrs[:4]):
        opt.param_groups[0]['lr'] = lr
        p.grad = torch.tensor(g)
        opt.step()
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = adam.AdamTF([p2], lr=0.0)
    opt2.load_state_dict(opt.state_dict())  # the beta powers travel with the param groups
    for g, lr in zip(grads[4:], lrs[4:]):
        opt2.param_groups[0]['lr'] = lr
        p2.grad = torch.tensor(g)
        opt2.step()
    np.testing.assert_array_equal(p2.detach().numpy(), full[-1])


def test_record_stats(tmp_path, capsys):
    writer = utils.get_summary_writer(str(tmp_path), subdir='ppo')
    assert writer is not None
    for step in range(3):
        out = utils.record_stats(stats={'objective/kl': torch.tensor(0.5 * step), 'ppo/lr': 1e-5},
                                 summary_writer=writer, step=step, log_interval=2)
        assert out['objective/kl'] == 0.5 * step
    writer.close()
    printed = capsys.readouterr().out
    assert '| objective/kl' in printed and '| step' in printed
    assert printed.count('| step') == 2  # steps 0 and 2

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / 'tb' / 'ppo'))
    acc.Reload()
    assert [e.value for e in acc.Scalars('objective/kl')] == [0.0, 0.5, 1.0]
    assert utils.get_summary_writer(None) is None


def test_autocast():
    with passes.autocast(True):
        y = torch.nn.functional.linear(torch.randn(2, 3, device=utils.get_device()), torch.randn(4, 3, device=utils.get_device()))
    assert y.dtype == torch.bfloat16
    with passes.autocast(False):
        y = torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert y.dtype == torch.float32


def test_check_finite():
    finite.check_finite(3, loss=torch.tensor(1.0), rewards=torch.randn(5), grad_norm=2.0)
    with pytest.raises(finite.NonFiniteError, match=r'^non-finite loss at step 7: nan;'):
        finite.check_finite(7, loss=torch.tensor(float('nan')))
    with pytest.raises(finite.NonFiniteError, match=r'non-finite rewards at step 2: non-finite \(1 of 3 values, e.g. -inf\)'):
        finite.check_finite(2, loss=1.0, rewards=torch.tensor([0.0, -float('inf'), 1.0]))
    net = torch.nn.Linear(2, 1)
    net(torch.tensor([[1.0, float('inf')]])).sum().backward()
    with pytest.raises(finite.NonFiniteError, match='non-finite grad_norm at step 0'):
        finite.check_finite(0, grad_norm=finite.grad_norm(net.parameters()))
    net.zero_grad()
    net(torch.tensor([[3.0, 4.0]])).sum().backward()
    assert finite.grad_norm(net.parameters()).item() == pytest.approx((9 + 16 + 1) ** 0.5)
