"""The bf16 mode's own kernels (language/bf16.py), seen op by op: a TorchDispatchMode records every aten op with
its dtypes and shapes, so what runs in which precision is checked on a CPU as it would run on a GPU.

- fp32 mode reaches none of them (bit-identical outputs);
- a weight is cast to bf16 once per update, however many forwards and microbatches use it, and its gradient
  is autocast's; a weight given new storage (Module.to(), `.data =`, which keep its version) is cast again;
- attention and the KV cache run in attention's dtype (bf16 on CUDA, fp32 on a CPU, where bf16 is slower);
- the n_vocab projection and its backward run at the fast fp32 precision, with fp32 logits, in sampling (the
  context step and each decoding step, through the model) as in the loss;
- the policy's logprobs and entropies equal the reference's, and no [tokens, n_vocab] tensor is written but the
  logits (the reference path writes several);
- the KL the controller sees differs from fp32 mode's by under 1 % on the same rollouts.

PPO's first ratio in bf16 mode (tests/test_train_policy.py, test_first_minibatch_ratio_is_one): exactly 1 where the
first minibatch is the whole batch in one pass (nminibatches 1, no microbatch split: the rollout's forward is that
minibatch's own); with more minibatches or a microbatch split the rows are recomputed in passes of another shape,
the same bits on a CPU, on CUDA 1 only to rounding (cuBLAS picks its kernels by shape).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lm_human_preferences.language import bf16, encodings, model, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import core


class Ops(TorchDispatchMode):
    """Every aten op dispatched: (name, output dtypes and shapes, input dtypes and shapes, fp32 precision)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = lambda xs: [(x.dtype, tuple(x.shape)) for x in xs if isinstance(x, torch.Tensor)]
        precision = getattr(getattr(torch.backends.mkldnn, 'matmul', None), 'fp32_precision', None)
        self.ops.append((func.overloadpacket.__name__, tensors(outs), tensors(args), precision))
        return out

    def named(self, name):
        return [op for op in self.ops if op[0] == name]


# oneDNN's fp32 matmul precision when a product runs at fp32's own: 'none' until something sets it (torch's default),
# 'ieee' once set back to 'highest', None where torch has no such flag
FULL_FP32 = ('ieee', 'none', None)


def small_model(n_vocab=300, **kw):
    torch.manual_seed(0)
    hp = model.HParams(n_vocab=n_vocab, n_ctx=32, n_embd=32, n_head=4, n_layer=2, **kw)
    return hp, model.Model(hp, scalar_heads=['value'])


def bf16_autocast():
    return torch.autocast('cpu', dtype=torch.bfloat16)


def test_fp32_mode_reaches_none_of_it():
    hp, m = small_model()
    w = m.h[0].mlp.c_fc.w
    assert bf16.cast_once(w) is w and bf16.autocast_dtype('cpu') is None
    h = torch.randn(5, hp.n_embd)
    assert torch.equal(bf16.vocab_logits(h, m.wte), F.linear(h, m.wte))
    X = torch.randint(0, hp.n_vocab, (3, 7))
    with Ops() as ops:
        out = m(X)
    assert all(dtype == torch.float32 for _, outs, _, _ in ops.ops for dtype, _ in outs if dtype.is_floating_point)
    assert out['present'].keys[0].dtype == torch.float32


def test_a_weight_is_cast_once_per_update_and_gets_autocasts_gradient():
    hp, m = small_model()
    ref = model.Model(hp, scalar_heads=['value'])
    ref.load_state_dict(m.state_dict())
    X = torch.randint(0, hp.n_vocab, (4, 6))
    weights = sum(1 for name, _ in m.named_parameters() if '.c_' in name)  # the blocks' projections, w and b

    def casts(ops):  # fp32 -> bf16 copies of a parameter-sized tensor
        sizes = {tuple(p.shape) for name, p in m.named_parameters() if '.c_' in name}
        return [op for op in ops.named('_to_copy') if op[1][0][0] == torch.bfloat16 and op[2][0][1] in sizes
                and op[2][0][0] == torch.float32]
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    with Ops() as ops, bf16_autocast():
        for _ in range(3):  # three microbatches, one update
            m(X)['value'].float().sum().backward()
    assert len(casts(ops)) == weights
    optimizer.step()  # changes every weight: the next forward casts each again, once
    with Ops() as ops, bf16_autocast():
        m(X)['value'].float().sum().backward()
        m(X)
    assert len(casts(ops)) == weights
    # The gradients are those of plain autocast (which casts in every forward), bit for bit.
    m.zero_grad(), ref.load_state_dict(m.state_dict())
    with bf16_autocast():
        m(X)['value'].float().sum().backward()
    with bf16_autocast(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(bf16, 'cast_once', lambda w: w)
        ref(X)['value'].float().sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize('attention', [torch.float32, torch.bfloat16])
def test_attention_and_its_cache_in_attentions_dtype(monkeypatch, attention):
    """bf16 mode's attention runs in bf16.attention_dtype: bf16 on CUDA (faster there), fp32 on a CPU (where
    torch's bf16 attention is slower). Both, seen on this CPU: q, k, v, the mask and the KV cache in that dtype,
    whatever autocast would pick, and the logits fp32 and close to fp32 mode's."""
    monkeypatch.setitem(bf16.ATTENTION_DTYPES, 'cpu', attention)
    hp, m = small_model()
    X = torch.tensor([[5, 6, 7, 299, 8], [9, 299, 299, 10, 11]])  # 299: padding inside the rows
    with Ops() as ops, bf16_autocast():
        out = m(X, padding_token=299)
    sdpa = [op for op in ops.ops if 'scaled_dot_product' in op[0] and 'attention' in op[0]]
    assert sdpa and all(dtype == attention for op in sdpa for dtype, _ in op[2])  # q, k, v, mask
    assert any(op[0] == 'addmm' and op[1][0][0] == torch.bfloat16 for op in ops.ops)  # the projections: bf16
    assert out['present'].keys[0].dtype == attention and out['lm_logits'].dtype == torch.float32
    with torch.no_grad():
        fp32 = m(X, padding_token=299)['lm_logits']
    torch.testing.assert_close(out['lm_logits'], fp32, atol=0.05, rtol=0.05)


def test_attention_is_bf16_on_cuda_and_fp32_on_a_cpu():
    assert bf16.ATTENTION_DTYPES == {'cuda': torch.bfloat16}
    with bf16_autocast():
        assert bf16.attention_dtype('cpu') == torch.float32
    assert bf16.attention_dtype('cpu') == bf16.attention_dtype('cuda') == torch.float32  # fp32 mode
    if torch.cuda.is_available():
        with torch.autocast('cuda', dtype=torch.bfloat16):
            assert bf16.attention_dtype('cuda') == torch.bfloat16


@pytest.mark.skipif(bf16._fast_fp32_precision('cpu') is None,
                    reason="this CPU has no native bf16 (AVX512-BF16 or AMX), so its fp32 matmuls have no faster mode")
def test_the_vocab_projection_and_its_backward_run_at_the_fast_precision():
    hp, m = small_model()
    h = torch.randn(6, hp.n_embd, requires_grad=True)
    with Ops() as ops, bf16_autocast():
        logits = bf16.vocab_logits(h, m.wte)
        logits.square().sum().backward()
    products = [op for op in ops.ops if op[0] in ('mm', 'addmm') and hp.n_vocab in sum((s for _, s in op[2]), ())]
    assert len(products) == 3  # the logits, and d h and d wte
    assert all(op[3] == 'bf16' and {d for d, _ in op[2]} == {torch.float32} for op in products), products
    assert logits.dtype == torch.float32
    assert torch.backends.mkldnn.matmul.fp32_precision != 'bf16'  # restored


def test_sampling_projects_its_logits_at_the_fast_precision(monkeypatch):
    """bf16 mode's sampling on a CPU draws from the hidden states by the chunked sampler (language/vocab_sampling.py),
    whose n_vocab products run at the fast fp32 precision with autocast off (fp32 in and out): the context step
    (its last position) and each decoding step are one such product, and no _FastLinear (the loss's projection)
    runs. fp32 mode's sampling reaches neither: its logits are the model's, at fp32's own precision."""
    fast_linear, calls = bf16._FastLinear, []

    class CountedFastLinear(fast_linear):
        @staticmethod
        def forward(ctx, h, w):
            calls.append(tuple(h.shape))
            return fast_linear.forward(ctx, h, w)
    monkeypatch.setattr(bf16, '_FastLinear', CountedFastLinear)
    policy, queries, _ = policy_and_tokens(rows=6, context=5)
    with Ops() as ops, bf16_autocast():
        rollout = policy.respond(queries, length=4)
    assert calls == [] and rollout['logprobs'].dtype == torch.float32
    # the context step and 3 decoding steps: the 4th token is sampled, never fed back
    products = [op for op in ops.named('mm') if op[1][0][1] == (6, 300)]
    assert len(products) == 4 and all(op[2] == [(torch.float32, (6, 32)), (torch.float32, (32, 300))]
                                      for op in products), products
    # without native bf16 the products keep fp32's own precision
    fast = ('bf16',) if bf16._fast_fp32_precision('cpu') is not None else FULL_FP32
    assert all(op[3] in fast for op in products), products
    with Ops() as ops:
        policy.respond(queries, length=4)
    fp32_products = [op for op in ops.named('mm') if op[1][0][1] == (6, 300)]
    assert calls == [] and len(fp32_products) == 4 and all(op[3] in FULL_FP32 for op in fp32_products)


def test_a_weight_given_new_storage_is_cast_again():
    """Module.to() / .cuda() and `param.data = ...` give a parameter new storage without bumping its version:
    the cast cache keys on the storage too (its device and data_ptr), so the next forward reads the new weights,
    not the copy of the old ones."""
    hp, m = small_model()
    new = model.Model(hp, scalar_heads=['value'])  # other weights
    X = torch.randint(0, hp.n_vocab, (3, 7))
    with torch.no_grad(), bf16_autocast():
        before = m(X)['lm_logits']  # casts every weight
        for p, q in zip(m.parameters(), new.parameters()):
            version = p._version
            p.data = q.detach().clone()
            assert p._version == version  # what the version alone would miss
        after, expected = m(X)['lm_logits'], new(X)['lm_logits']
    assert not torch.equal(before, expected)
    assert torch.equal(after, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA only: a device move of a model cast on the CPU')
def test_a_model_moved_to_cuda_is_cast_again():
    hp, m = small_model()
    X = torch.randint(0, hp.n_vocab, (3, 7))
    with torch.no_grad(), bf16_autocast():
        m(X)
    m.cuda()
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        out = m(X.cuda())['lm_logits']
    assert out.device.type == 'cuda'
    assert all(copy.device.type == 'cuda' for weight, (*_, copy) in bf16._casts.items() if weight.is_cuda)


def policy_and_tokens(n_vocab=300, rows=6, context=5, length=4, seed=0):
    hp = model.HParams(n_vocab=n_vocab, n_ctx=32, n_embd=32, n_head=4, n_layer=2)
    tm = trained_models.TrainedModel('test')
    tm.hparams = lambda: hp
    tm.encoding = encodings.Test
    tm.init_model = lambda module: None
    torch.manual_seed(seed)
    policy = Policy(tm, temperature=0.7)
    with torch.no_grad():
        policy.model.wte.mul_(20)  # logits of a few units, as a trained model's
        policy.model.heads.value.w.normal_()
    queries = torch.randint(0, n_vocab, (rows, context))
    responses = torch.randint(0, n_vocab, (rows, length))
    return policy, queries, responses


@pytest.mark.parametrize('fast', [False, True])
def test_logprobs_and_entropies_match_the_reference(monkeypatch, fast):
    """The one-pass kernel against the original's formulas (core.logprobs_from_logits, entropy_from_logits) on
    the same hidden states, in products of 7 rows and passes of 3; with fp32 products the same to fp32 rounding, with the fast
    products (where this CPU has them) to their rounding."""
    if fast and bf16._fast_fp32_precision('cpu') is None:
        pytest.skip('this CPU has no native bf16 (AVX512-BF16 or AMX)')
    if not fast:
        monkeypatch.setattr(bf16, '_fast_fp32_precision', lambda device_type: None)
    monkeypatch.setitem(bf16.PRODUCT_BYTES, 'cpu', 7 * 4 * 300)
    monkeypatch.setitem(bf16.PASS_BYTES, 'cpu', 3 * 4 * 300)
    torch.manual_seed(0)
    h = torch.randn(20, 32, dtype=torch.float64)
    w = torch.randn(300, 32, dtype=torch.float64)
    labels = torch.randint(0, 300, (20,))
    logits = (h @ w.T).requires_grad_()
    ref_logprobs = core.logprobs_from_logits(logits=logits / 0.7, labels=labels)
    d_logits = torch.autograd.grad(ref_logprobs.sum(), logits)[0]
    ref_grads = d_logits @ w, d_logits.T @ h
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    with bf16_autocast():
        logprobs, entropies = bf16.logprobs_and_entropies(hf, wf, labels, 0.7)
    logprobs.sum().backward()
    tol = dict(rtol=2e-2, atol=5e-2) if fast else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs.double(), ref_logprobs, **tol)
    torch.testing.assert_close(entropies.double(), core.entropy_from_logits(logits.detach() / 0.7), **tol)
    torch.testing.assert_close(hf.grad.double(), ref_grads[0], **tol)
    torch.testing.assert_close(wf.grad.double(), ref_grads[1], **tol)
    assert not entropies.requires_grad


def test_the_policys_logits_are_written_once():
    """bf16 mode's analyze_responses and its backward write no [tokens, n_vocab] tensor but the logits (its
    chunks' temporaries are a few rows each); fp32 mode's, the original's formulas, write several."""
    policy, queries, responses = policy_and_tokens(rows=8, length=6)
    tokens, n_vocab = responses.numel(), 300

    def full_size_writes(ops):
        return [op for op in ops.ops if op[0] not in ('empty', 'empty_strided', 'zeros', 'new_empty')
                and any(len(s) and s[-1] == n_vocab and torch.Size(s).numel() >= tokens * n_vocab for _, s in op[1])]
    with Ops() as ops, bf16_autocast(), pytest.MonkeyPatch.context() as mp:
        mp.setitem(bf16.PRODUCT_BYTES, 'cpu', 20 * 4 * n_vocab)
        mp.setitem(bf16.PASS_BYTES, 'cpu', 5 * 4 * n_vocab)
        out = policy.analyze_responses(queries, responses)
        out['logprobs'].sum().backward()
    assert full_size_writes(ops) == []
    assert len([op for op in ops.ops if op[0] == 'mm' and op[1][0][1] == (20, n_vocab)]) >= tokens // 20  # chunked
    assert len([op for op in ops.ops if op[0] == 'amax' and op[2][0][1] == (5, n_vocab)]) >= tokens // 5
    with Ops() as ops:
        out = policy.analyze_responses(queries, responses)
        out['logprobs'].sum().backward()
    assert len(full_size_writes(ops)) >= 3


def test_bf16_kl_within_one_percent_of_fp32():
    """On the same rollouts, the KL the controller sees (mean over episodes of the summed logprob - ref logprob)
    in bf16 mode is within 1 % of fp32 mode's, and per token the logprobs agree to bf16's rounding."""
    policy, queries, _ = policy_and_tokens(rows=64, context=8)
    ref_policy, _, _ = policy_and_tokens(seed=1)  # another model: some nats from the policy
    responses = policy.respond(queries, length=12)['responses']  # the rollouts, as sampled in fp32
    kl, logprobs = {}, {}
    for mode in ('fp32', 'bf16'):
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=mode == 'bf16'):
            logprobs[mode] = policy.analyze_responses(queries, responses)['logprobs']
            ref = ref_policy.analyze_responses(queries, responses)['logprobs']
        kl[mode] = (logprobs[mode] - ref).sum(dim=1).mean().item()
    assert kl['fp32'] > 1
    assert abs(kl['bf16'] - kl['fp32']) <= 0.01 * kl['fp32'], kl
    assert (logprobs['bf16'] - logprobs['fp32']).abs().mean() < 0.05


def test_the_fast_precision_keeps_torchs_flags_in_step():
    """On CUDA the block turns TF32 on through the API that keeps torch's old and new flags in step: cuBLAS reads
    the old one and refuses every matmul when they disagree (checked here on the flags, which a CPU build has)."""
    before = torch.get_float32_matmul_precision()
    with bf16.fast_fp32_matmuls('cuda'):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cuda.matmul.fp32_precision == 'tf32'
    assert torch.get_float32_matmul_precision() == before and not torch.backends.cuda.matmul.allow_tf32
