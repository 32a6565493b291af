"""sample_sequence() tests: the original's test_sample.py case, plus temperature, top-k/p, extras and
the policy's sampling against its own analysis."""

import numpy as np
import pytest
import torch

from lm_human_preferences.training.execution import Execution
from lm_human_preferences.language import checkpoints, sample, trained_models
from lm_human_preferences.policy import Policy

n_vocab = 10
batch_size = 2
hparams = None  # the step functions below ignore the model hparams


# Returns a policy that deterministically chooses previous token + 1.
def step(hparams, tokens, past=None):
    logits = torch.full(tokens.shape + (n_vocab,), -np.inf)
    logits.scatter_(-1, (tokens + 1)[..., None], 0.0)
    seen = tokens if past is None else torch.cat([past['tokens'], tokens], dim=1)
    return {'logits': logits, 'presents': {'tokens': seen}, 'position': torch.full(tokens.shape, float(seen.shape[1]))}


def test_sample_sequence():
    output = sample.sample_sequence(step=step, model_hparams=hparams, length=4,
                                    context=torch.tensor([[5, 0], [4, 3]]))
    expected = np.array([[5, 0, 1, 2, 3, 4], [4, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(output['tokens'].numpy(), expected)
    np.testing.assert_array_equal(output['logprobs'].numpy(), np.zeros([2, 4]))


def test_length_and_extras():
    """Exactly `length` tokens; extra output i comes from the position that predicted token i."""
    out = sample.sample_sequence(step=step, model_hparams=hparams, length=3,
                                 context=torch.tensor([[1, 2, 3], [4, 5, 6]]), extra_outputs=('position',))
    assert out['tokens'].shape == (2, 6) and out['logprobs'].shape == (2, 3)
    np.testing.assert_array_equal(out['position'].numpy(), [[3, 4, 5], [3, 4, 5]])
    with pytest.raises(ValueError, match='length must be >= 1'):
        sample.sample_sequence(step=step, model_hparams=hparams, length=0, context=torch.tensor([[1]]))


def _fixed_step(logits_row):
    """A step whose logits are the same at every position."""
    def f(hparams, tokens, past=None):
        return {'logits': logits_row.expand(tokens.shape + logits_row.shape), 'presents': None}
    return f


def test_temperature_top_k_top_p_logprobs():
    """logprobs are those of the tempered logits (1/T scaling), filtered by top_k / top_p on every step
    but the first (as the original); top_k=1 samples the argmax."""
    logits_row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0, 0.1, 0.2, 0.3])
    T = 0.7
    ctx = torch.zeros(64, 1, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=4, context=ctx,
                                 temperature=T, top_k=1, generator=g)
    first = out['tokens'][:, 1]
    expected_first = torch.log_softmax(logits_row * (1 / T), -1)[first]
    torch.testing.assert_close(out['logprobs'][:, 0], expected_first)
    assert len(set(first.tolist())) > 1  # the first token is not top-k filtered
    assert torch.all(out['tokens'][:, 2:] == 5)
    torch.testing.assert_close(out['logprobs'][:, 1:], torch.zeros(64, 3))

    # top_p = 0.75 keeps the tokens whose cumulative probability (sorted) is <= 0.75: 0.54, 0.74 -> two
    out = sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=3, context=ctx,
                                 temperature=1.0, top_p=0.75, generator=g)
    later = out['tokens'][:, 2:]
    assert set(later.flatten().tolist()) <= {0, 5} and len(set(later.flatten().tolist())) == 2
    kept = torch.log_softmax(logits_row[[0, 5]], -1)
    for tok, lp in zip(later.flatten().tolist(), out['logprobs'][:, 1:].flatten().tolist()):
        assert abs(lp - kept[0 if tok == 0 else 1].item()) < 1e-5

    # temperature 0 -> 1/1e-10: greedy
    out = sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=2, context=ctx,
                                 temperature=0.0)
    assert torch.all(out['tokens'][:, 1:] == 5)


def test_generator_reproducible():
    logits_row = torch.zeros(n_vocab)
    ctx = torch.zeros(8, 1, dtype=torch.long)
    runs = [sample.sample_sequence(step=_fixed_step(logits_row), model_hparams=hparams, length=6, context=ctx,
                                   generator=torch.Generator().manual_seed(seed))['tokens'] for seed in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_policy_respond_matches_analyze_responses():
    """Sampling with the KV cache (queries padded inside and at the end) gives the logprobs and values
    that a full forward of query + response gives, at temperature 0.7."""
    torch.manual_seed(0)
    policy = Policy(trained_models.TrainedModel('test'), temperature=0.7)
    with torch.no_grad():
        policy.model.heads.value.w.normal_()  # the value head starts at zero
    pad = policy.padding_token
    queries = torch.tensor([[3, 4, pad, pad], [5, pad, 6, 7], [8, 9, 10, pad], [1, 2, 3, 4]])
    r = policy.respond(queries, length=4, generator=torch.Generator().manual_seed(3))
    assert r['responses'].shape == (4, 4) and torch.all(r['responses'] < 27)
    a = policy.analyze_responses(queries, r['responses'])
    torch.testing.assert_close(r['logprobs'], a['logprobs'], atol=1e-5, rtol=0)
    torch.testing.assert_close(r['values'], a['values'], atol=1e-5, rtol=0)
    assert torch.all(a['entropies'] > 0)


@pytest.fixture
def demo_shaped_policy(tmp_path):
    """A random policy of the demo's shape (2 layers, width 128, its character encoding), large enough
    that split matmuls round differently, loaded from a checkpoint as any model dir."""
    from lm_human_preferences.language import encodings, model
    torch.manual_seed(0)
    hp = model.HParams(n_vocab=27, n_ctx=64, n_embd=128, n_head=4, n_layer=2)
    checkpoints.save_checkpoint(str(tmp_path / 'model'), 0, model.Model(hp), hparams=hp, encoding=encodings.Test)
    policy = Policy(trained_models.TrainedModel(str(tmp_path / 'model')))
    with torch.no_grad():
        policy.model.heads.value.w.normal_()  # the value head starts at zero
    return policy


@pytest.mark.parametrize('microbatch_size', [1, 3, 8])
def test_microbatched_sampling_draws_the_same_tokens(demo_shaped_policy, microbatch_size):
    """Policy.respond with microbatches of at most K rows (each with its own KV cache) samples the same
    tokens as one batch, from the same random numbers; logprobs and values agree to fp32 rounding."""
    policy = demo_shaped_policy
    pad = policy.padding_token
    queries = torch.randint(0, 27, (7, 12))
    queries[1, 5:] = pad
    queries[4, 3:8] = pad
    whole = policy.respond(queries, length=20, generator=torch.Generator().manual_seed(5))
    split = policy.respond(queries, length=20, generator=torch.Generator().manual_seed(5),
                           execution=Execution(queries.device, microbatch_size=microbatch_size))
    assert torch.equal(whole['responses'], split['responses'])
    torch.testing.assert_close(split['logprobs'], whole['logprobs'], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(split['values'], whole['values'], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_tokens_only_sampling_draws_the_same_tokens(demo_shaped_policy, temperature):
    """respond(logprobs=False), for callers that use only the tokens (the labels, the normalization, the report):
    no 'logprobs', the same responses and values bit for bit, with two microbatches too."""
    policy = demo_shaped_policy
    policy.temperature = temperature
    queries = torch.randint(0, 27, (6, 10))
    queries[2, 4:] = policy.padding_token
    for execution in (None, Execution(queries.device, microbatch_size=3)):
        full = policy.respond(queries, length=12, generator=torch.Generator().manual_seed(7), execution=execution)
        tokens = policy.respond(queries, length=12, generator=torch.Generator().manual_seed(7), execution=execution,
                                logprobs=False)
        assert sorted(full) == ['logprobs', 'responses', 'values'] and sorted(tokens) == ['responses', 'values']
        assert torch.equal(full['responses'], tokens['responses']) and torch.equal(full['values'], tokens['values'])


def test_respond_chunked_vocab_draws_the_plain_responses_with_fp32_products(demo_shaped_policy, monkeypatch):
    """Policy.respond(chunked_vocab=True) with fp32 products: the plain sampler's responses and values (27 tokens:
    one chunk, one partial block), and its logprobs to float rounding."""
    monkeypatch.setenv('LMHP_CPU_BF16', 'off')
    policy = demo_shaped_policy
    policy.temperature = 0.7
    queries = torch.randint(0, 27, (6, 10), generator=torch.Generator().manual_seed(5))
    queries[2, 4:] = policy.padding_token
    plain = policy.respond(queries, length=12, generator=torch.Generator().manual_seed(7))
    chunked = policy.respond(queries, length=12, generator=torch.Generator().manual_seed(7), chunked_vocab=True)
    assert torch.equal(plain['responses'], chunked['responses'])
    torch.testing.assert_close(chunked['values'], plain['values'])
    torch.testing.assert_close(chunked['logprobs'], plain['logprobs'], atol=1e-5, rtol=1e-5)


def _count_host_reads(monkeypatch):
    """Counts the Python-level ways a tensor's value reaches the host (each one waits for the device)."""
    counts = {'n': 0}
    for name in ('item', 'tolist', '__bool__', '__int__', '__float__', '__index__', 'numpy', 'nonzero'):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            counts['n'] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    original_nonzero = torch.nonzero

    def counting_nonzero(*args, **kwargs):
        counts['n'] += 1
        return original_nonzero(*args, **kwargs)
    monkeypatch.setattr(torch, 'nonzero', counting_nonzero)
    return counts


def test_decoding_reads_nothing_on_the_host_per_token(demo_shaped_policy, monkeypatch):
    """No step of the decoding loop moves a value to the host or branches on one (on a GPU each would
    stall the launch queue): the host reads of respond() do not grow with the response length."""
    policy = demo_shaped_policy
    pad = policy.padding_token
    queries = torch.randint(0, 27, (4, 12))
    queries[2, 6:] = pad
    counts = _count_host_reads(monkeypatch)
    reads = []
    for length in (2, 12, 40):  # 12 + 40 > n_ctx 64 only through pads: the position check runs once
        counts['n'] = 0
        with torch.no_grad():
            policy.respond(queries[:3, :] if length == 40 else queries, length=length,
                           execution=Execution(queries.device, microbatch_size=2))
        reads.append(counts['n'])
    assert reads[0] == reads[1], reads
    assert reads[2] <= reads[0] + 1, reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA only: the CPU test above counts the host reads')
def test_decoding_does_not_synchronize_on_cuda(demo_shaped_policy):
    """torch's own detector: the synchronizations of respond() do not grow with the response length."""
    import warnings
    policy = demo_shaped_policy.cuda()
    queries = torch.randint(0, 27, (4, 12), device='cuda')
    syncs = []
    for length in (2, 2, 12):  # the first call warms up
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter('always')
            torch.cuda.set_sync_debug_mode('warn')
            try:
                policy.respond(queries, length=length, execution=Execution(queries.device, microbatch_size=2))
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs.append(sum('synchroniz' in str(w.message) for w in caught))
    assert syncs[1] == syncs[2], syncs


@pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA only: CUDA graphs need a GPU (on a CPU the steps run '
                                                         'eagerly whatever cuda_graph says)')
@pytest.mark.parametrize('bf16', [False, True])
def test_cuda_graph_decoding_draws_the_tokens_of_the_eager_loop(demo_shaped_policy, bf16):
    """The decoding step captured once as a CUDA graph and replayed per token samples exactly the tokens of
    the eager loop from the same draws, with the same logprobs and values up to rounding, padded queries and
    microbatches included; and the replayed steps dispatch no op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))
    policy = demo_shaped_policy.cuda()
    pad = policy.padding_token
    queries = torch.randint(0, 27, (6, 12), device='cuda')
    queries[1, 5:] = pad
    uniforms = torch.rand(6, 30, dtype=torch.float64, device='cuda')
    ops, outs = {}, {}
    for cuda_graph in (False, True):
        with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16, enabled=bf16), CountOps() as counted:
            out = policy.respond(queries, length=30, uniforms=uniforms,
                                 execution=Execution(queries.device, bf16=bf16, cuda_graph=cuda_graph, microbatch_size=4))
        ops[cuda_graph], outs[cuda_graph] = counted.n, out
    eager, graphed = outs[False], outs[True]
    assert ops[True] < ops[False] / 3, ops  # 2 warm-up steps and the captured one of 29, in each of 2 loops
    assert torch.equal(eager['responses'], graphed['responses'])
    # The capture runs on a stream of its own, whose cuBLAS workspace may pick other kernels than the eager
    # loop's: the same math, rounded alike only up to the dtype's precision.
    tol = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(graphed['logprobs'], eager['logprobs'], atol=tol, rtol=tol)
    torch.testing.assert_close(graphed['values'], eager['values'], atol=tol, rtol=tol)


def test_positions_beyond_n_ctx_are_refused_before_decoding(demo_shaped_policy):
    policy = demo_shaped_policy
    queries = torch.randint(0, 27, (2, 40))  # no pads: 40 + 30 - 1 tokens need positions up to 68 > 63
    with pytest.raises(ValueError, match='69 tokens need positions beyond n_ctx = 64'):
        policy.respond(queries, length=30)


def test_a_row_without_finite_logits_is_reported_after_the_loop():
    logits_row = torch.zeros(n_vocab)

    def step_with_nan_row(hparams, tokens, past=None):
        logits = logits_row.expand(tokens.shape + logits_row.shape).clone()
        if past is not None:  # a decoding step: row 1 has no finite logit
            logits[1] = float('nan')
        return {'logits': logits, 'presents': 'cache'}
    with pytest.raises(FloatingPointError, match=r'rows \[1\] have no finite logits'):
        sample.sample_sequence(step=step_with_nan_row, model_hparams=hparams, length=3,
                               context=torch.zeros(3, 1, dtype=torch.long))


def test_a_rollouts_uniforms_come_from_the_cpu_stream_on_any_device():
    """Whatever device holds the queries, their uniforms are the CPU stream's numbers (CUDA's generator is
    another stream: a GPU would sample other tokens than the same run on a CPU). 'meta' stands in for a
    device that is not the CPU."""
    queries = torch.zeros(5, 3, dtype=torch.long)
    torch.manual_seed(7)
    _, on_cpu = sample.queries_and_draws(queries, 4)
    after_cpu = torch.rand(3)
    torch.manual_seed(7)
    _, on_meta = sample.queries_and_draws(queries.to('meta'), 4)
    assert on_meta.device.type == 'meta' and on_meta.shape == on_cpu.shape == (5, 4)
    assert torch.equal(torch.rand(3), after_cpu)  # the meta draws took the CPU stream's numbers
    assert torch.equal(on_cpu, sample.draw_uniforms(5, 4, generator=torch.Generator().manual_seed(7)))
