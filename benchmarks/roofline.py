"""The roofline account of the offline experiments on a CPU: for each phase of the sentiment miniature and of the
demo, its FLOPs, its time, its achieved GFLOP/s beside the chip's measured fp32 and bf16 matrix-product peak, and
where its time goes (torch.profiler, self CPU time by kind of op, and what is left of the wall time for Python).

    python benchmarks/roofline.py                              # both experiments, this checkout
    python benchmarks/roofline.py --repo OLD_CHECKOUT          # another checkout's code, same script
    python benchmarks/roofline.py --experiments demo --repeats 5 --json out.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/roofline.py

Phases, on random weights of each experiment's model shape (its own pretraining hparams, vocabulary and task
shapes), each with the experiment's CPU threads (the miniature 2, the demo 1; --threads overrides):

- pretrain_step: one step of the initial model's pretraining (offline/pretrain.py's step: forward, the output
  layer's cross-entropy, backward, AdamTF);
- label_batch: a label batch's sampling, 4 x Policy.respond of rollout_batch_size queries (labels.py's: tokens only
  and the chunked vocabulary where the checkout has them, as benchmarks/label_sampling.py);
- reward_step: one train_reward minibatch (best_of_4: 4 responses scored per query, the cross-entropy, backward,
  AdamTF);
- ppo_sampling / ppo_scoring / ppo_update: a PPO batch's rollout (Policy.respond with logprobs and values), its
  scoring (the reference policy's logprobs and the reward model), its update (noptepochs x nminibatches of
  analyze_responses, ppo_loss, backward, AdamTF).

FLOPs: `counted` is what torch.utils.flop_counter.FlopCounterMode counts in one run of the phase (the products,
attention as if not causal: its kernels skip the masked half); `model` is the analytic count from the shapes
(2 x 12 n_layer n_embd^2 per token through the blocks, 2 n_embd n_vocab per position whose logits are made,
4 n_embd n_layer per causal (query, key) pair; x3 with the backward). GFLOP/s is counted / best time. The peaks are
the best rate of a square 4096^3 product and of the miniature's output layer (768 x 128 by 128 x 50,257), fp32 and
bf16, at each thread count used (a bf16 product that this CPU emulates gets one timed rep of a smaller square).
The profile is of one more run of each phase; Python = its wall time minus the ops' summed self time (the
profiler's own overhead included: a profiled run is slower than a timed one).
"""
import argparse
import inspect
import json
import os
import sys
import tempfile
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('--repo', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'),
               help='the checkout to import lm_human_preferences from (default: this one)')
p.add_argument('--experiments', nargs='+', default=['sentiment_mini', 'demo'], choices=['sentiment_mini', 'demo'])
p.add_argument('--phases', nargs='+', default=None,
               help='only these phases (pretrain_step label_batch reward_step ppo_sampling ppo_scoring ppo_update)')
p.add_argument('--repeats', type=int, default=3, help='timed runs of each phase (the best counts)')
p.add_argument('--threads', type=int, default=None, help="every phase's threads (default: the experiment's)")
p.add_argument('--top', type=int, default=6, help='ops listed per phase')
p.add_argument('--no-peak', action='store_true', help='skip the peak products (the account then has no %% of peak)')
p.add_argument('--json', default=None, help='write everything here')
args = p.parse_args()
sys.path.insert(0, os.path.abspath(args.repo))

import torch  # noqa: E402
from torch.utils import flop_counter  # noqa: E402

from lm_human_preferences import label_types, train_policy  # noqa: E402
from lm_human_preferences.language import checkpoints, model, trained_models  # noqa: E402
from lm_human_preferences.offline import pretrain  # noqa: E402
from lm_human_preferences.policy import Policy  # noqa: E402
from lm_human_preferences.rewards import RewardModelTrainer  # noqa: E402
from lm_human_preferences.training.adam import AdamTF  # noqa: E402
from lm_human_preferences.utils import cpu  # noqa: E402

PHASES = ['pretrain_step', 'label_batch', 'reward_step', 'ppo_sampling', 'ppo_scoring', 'ppo_update']


def experiment_shapes(name):
    """What the phases need of an experiment: its OfflineExperiment, pretraining hparams, and its task's,
    train_reward's and PPO's shapes (from its bindings, as the checkout has them)."""
    if name == 'demo':
        from lm_human_preferences import demo as package
        from lm_human_preferences.demo import bindings
        policy_bindings = dict((k, v) for k, v, _ in bindings.train_policy[0])
    else:
        import launch
        from lm_human_preferences import sentiment_mini as package
        policy_bindings = dict((k, v) for k, v, _ in launch.get_experiments()['sentiment_mini'][0])
    exp = package.EXPERIMENT
    b = policy_bindings
    return dict(exp=exp, pretrain=exp.pretrain, n_vocab=exp.encoding.n_vocab,
                threads=exp.cpu_threads,
                query_length=b['task.query_length'],
                response_length=b['task.response_length'], temperature=b.get('task.policy.temperature', 1.0),
                rollout_batch_size=b['rewards.train_new_model.rollout_batch_size'],
                reward_batch_size=b['rewards.train_new_model.batch_size'],
                label_type=b['rewards.train_new_model.labels.type'],
                ppo_batch_size=b['ppo.batch_size'], nminibatches=b.get('ppo.nminibatches', 1),
                noptepochs=b.get('ppo.noptepochs', 4))



def make_model_dir(d, hparams, encoding, seed):
    torch.manual_seed(seed)
    checkpoints.save_checkpoint(d, 0, model.Model(hparams), hparams=hparams, encoding=encoding)
    return trained_models.TrainedModel(d)


def build(name, tmp):
    """Every phase of experiment `name` as a function of no arguments that runs it once, on random weights."""
    s = experiment_shapes(name)
    pre, n_vocab = s['pretrain'], s['n_vocab']
    hparams = model.HParams(n_vocab=n_vocab, n_ctx=pre.n_ctx, n_embd=pre.n_embd, n_head=pre.n_head,
                            n_layer=pre.n_layer)
    encoding = s['exp'].encoding
    trained = make_model_dir(os.path.join(tmp, name), hparams, encoding, 0)
    gen = torch.Generator().manual_seed(1)
    q, r = s['query_length'], s['response_length']

    def tokens(*shape):
        return torch.randint(0, n_vocab, shape, generator=gen)

    # pretraining: the checkout's own step function, given what it asks for by name
    lm = model.Model(hparams)
    optimizer = AdamTF(lm.parameters(), lr=pre.lr)
    corpus = tokens(200_000)
    available = dict(lm=lm, optimizer=optimizer, tokens=corpus, generator=torch.Generator().manual_seed(0),
                     offsets=torch.arange(pre.n_ctx + 1), products_dtype=pretrain.pretraining_products_dtype(pre),
                     hparams=pre, step=0)
    wanted = list(inspect.signature(pretrain._pretraining_step).parameters)
    missing = [k for k in wanted if k not in available]
    if missing:
        raise SystemExit(f'roofline.py: {args.repo}: offline/pretrain.py _pretraining_step asks for {missing}, '
                         f'which this script does not know')

    def pretrain_step():
        pretrain._pretraining_step(**{k: available[k] for k in wanted})

    policy = Policy(trained, temperature=s['temperature'])
    ref_policy = Policy(trained, temperature=s['temperature'])
    ref_policy.requires_grad_(False)
    respond_options = inspect.signature(policy.respond).parameters
    label_queries = tokens(s['rollout_batch_size'], q)

    def label_batch():
        g = torch.Generator().manual_seed(0)
        # as offline/labels.py samples, in each checkout: tokens only, from the chunked vocabulary
        kwargs = dict(logprobs=False) if 'logprobs' in respond_options else {}
        if 'chunked_vocab' in respond_options:
            kwargs['chunked_vocab'] = True
        for _ in range(label_types.get(s['label_type']).num_responses):
            policy.respond(label_queries, r, generator=g, **kwargs)

    reward_model = RewardModelTrainer(trained)
    reward_optimizer = AdamTF(reward_model.parameters(), lr=1e-4, eps=1e-5)
    label_type = label_types.get(s['label_type'])
    labels = dict(query=tokens(s['reward_batch_size'], q),
                  best=torch.randint(0, label_type.num_responses, (s['reward_batch_size'],), generator=gen),
                  **{f'sample{i}': tokens(s['reward_batch_size'], r) for i in range(label_type.num_responses)})

    def reward_step():
        reward_optimizer.zero_grad(set_to_none=True)
        label_type.loss(reward_model=reward_model.get_rewards, labels=labels)['loss'].backward()
        reward_optimizer.step()

    batch = s['ppo_batch_size']
    ppo_queries = tokens(batch, q)
    ppo_optimizer = AdamTF(policy.parameters(), lr=1e-5, eps=1e-5)
    rollout = {}

    def ppo_sampling():
        with torch.no_grad():
            rollout.update(policy.respond(ppo_queries, r, generator=torch.Generator().manual_seed(0)))

    def ppo_scoring():
        with torch.no_grad():
            rollout['ref_logprobs'] = ref_policy.analyze_responses(ppo_queries, rollout['responses'])['logprobs']
            rollout['scores'] = reward_model.get_rewards(ppo_queries, rollout['responses'])

    def ppo_update():
        rewards, _ = train_policy.compute_rewards(scores=rollout['scores'], logprobs=rollout['logprobs'],
                                                  ref_logprobs=rollout['ref_logprobs'], kl_coef=0.15)
        minibatch = batch // s['nminibatches']
        order = torch.Generator().manual_seed(0)
        for _ in range(s['noptepochs']):
            for rows in torch.randperm(batch, generator=order).split(minibatch):
                values, old = rollout['values'][rows], rollout['logprobs'][rows]
                advantages, returns = train_policy.compute_advantages(
                    rewards=rewards[rows], values=values, gamma=1, lam=0.95, whiten_rewards=True)
                ppo_optimizer.zero_grad(set_to_none=True)
                out = policy.analyze_responses(ppo_queries[rows], rollout['responses'][rows])
                loss, _ = train_policy.ppo_loss(
                    logprob=out['logprobs'], vpred=out['values'], entropies=out['entropies'], old_logprob=old,
                    old_values=values, advantages=advantages, returns=returns, cliprange=0.2, cliprange_value=0.2,
                    vf_coef=0.1)
                loss.backward()
                ppo_optimizer.step()

    e, L, V = hparams.n_embd, hparams.n_layer, n_vocab
    blocks = 2 * 12 * L * e * e  # per token through the blocks

    def attention(queries, keys_before):  # causal pairs of `queries` new positions after keys_before cached ones
        return 4 * e * L * (queries * keys_before + queries * (queries + 1) // 2)

    def forward(rows, length, logit_positions):  # one pass over [rows, length] tokens
        return rows * (blocks * length + attention(length, 0) + 2 * e * V * logit_positions)

    def sampling(rows):  # the context's pass (its last position's logits), then r - 1 single-token steps
        return forward(rows, q, 1) + rows * sum(blocks + attention(1, q + i) + 2 * e * V for i in range(r - 1))

    reward_rows = s['reward_batch_size'] * label_type.num_responses
    model_flops = dict(
        pretrain_step=3 * forward(pre.batch_size, pre.n_ctx, pre.n_ctx),
        label_batch=label_type.num_responses * sampling(s['rollout_batch_size']),
        reward_step=3 * forward(reward_rows, q + r, 0),
        ppo_sampling=sampling(batch),
        ppo_scoring=forward(batch, q + r, r) + forward(batch, q + r, 0),
        ppo_update=s['noptepochs'] * 3 * forward(batch, q + r, r))
    functions = dict(pretrain_step=pretrain_step, label_batch=label_batch, reward_step=reward_step,
                     ppo_sampling=ppo_sampling, ppo_scoring=ppo_scoring, ppo_update=ppo_update)
    shapes = {k: v for k, v in s.items() if k not in ('exp', 'pretrain')}
    shapes.update(n_layer=L, n_embd=e, n_ctx=pre.n_ctx, pretrain_batch=pre.batch_size,
                  pretrain_products=str(available['products_dtype']).removeprefix('torch.'))
    return functions, model_flops, shapes


def _addmm(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode knows CUDA's attention kernels, not the CPU's, and addmm, not its in-place addmm_ (the
# pretraining's output-layer gradient).
UNCOUNTED = {torch.ops.aten.addmm_: _addmm}
if hasattr(torch.ops.aten, '_scaled_dot_product_flash_attention_for_cpu'):
    UNCOUNTED[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu
    UNCOUNTED[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward


def counted_flops(fn):
    with flop_counter.FlopCounterMode(display=False, custom_mapping=UNCOUNTED) as counter:
        fn()
    return counter.get_total_flops()


def best_time(fn, repeats):
    fn()  # warm-up: first-call allocations, oneDNN's kernel choices
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), times


PRODUCTS = ('addmm', 'mm', 'bmm', 'baddbmm', 'addmv', 'mv', 'matmul', 'linear', 'dot')
COPIES = ('copy_', 'index_copy_', 'cat', 'clone', 'contiguous', '_to_copy', 'to', 'fill_', 'zero_', 'zeros',
          'zeros_like', 'empty', 'empty_like', 'index_select', 'index', 'gather', 'new_empty', 'new_zeros',
          'new_full', 'masked_fill_', 'stack', 'index_put_', '_index_put_impl_', 'scatter_', 'narrow', 'slice',
          'expand', 'view', 'reshape', 'permute', 'transpose', 't', 'unbind', 'select', 'as_strided',
          '_unsafe_view', 'split', 'resize_', 'detach', 'alias', 'unsqueeze', 'squeeze', 'lift_fresh',
          'set_')


def kind_of(name, input_shapes, n_vocab):
    """A profiled op's kind: a product (with the output layer apart), attention, an op over the vocabulary
    (softmax, sampling, the cross-entropy), a copy or view, or other."""
    op = name.removeprefix('aten::')
    # logits and their softmax, sampling and cross-entropy: [..., n_vocab] (the optimizer's passes over the embedding,
    # [n_vocab, n_embd] or flattened, are other ops)
    vocab = n_vocab > 1000 and any(shape and shape[-1] == n_vocab for shape in input_shapes)
    if op in PRODUCTS:
        return 'output-layer products' if any(n_vocab in shape for shape in input_shapes if shape) and n_vocab > 64 \
            else 'block products'
    if 'scaled_dot_product' in op or 'attention' in op:
        return 'attention'
    if vocab:
        return 'ops over the vocabulary'
    if op in COPIES:
        return 'copies, views, fills'
    return 'other ops'


def profile(fn, n_vocab, top):
    """One run under torch.profiler: wall, the ops' self time by kind and the top ops, Python = wall - ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    kinds, ops = {}, {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith('aten::'):
            continue
        seconds = event.self_cpu_time_total / 1e6
        kind = kind_of(event.name, [tuple(s) for s in (event.input_shapes or []) if isinstance(s, (list, tuple))],
                       n_vocab)
        kinds[kind] = kinds.get(kind, 0) + seconds
        key = (event.name.removeprefix('aten::'), kind)
        count, total = ops.get(key, (0, 0.0))
        ops[key] = (count + 1, total + seconds)
    op_time = sum(kinds.values())
    kinds['Python, dispatch (wall - ops)'] = max(wall - op_time, 0.0)
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(wall_s=wall, ops_count=sum(c for c, _ in ops.values()),
                kinds_s=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
                top_ops=[dict(op=name, kind=kind, calls=c, self_s=t) for (name, kind), (c, t) in top_ops])


def product_rate(m, k, n, dtype, threads, budget_s=2.0):
    """GFLOP/s of [m, k] @ [k, n] in dtype at `threads` threads: the best of reps for about budget_s."""
    torch.set_num_threads(threads)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    start = time.perf_counter()
    a @ b
    first = time.perf_counter() - start
    best, spent = first, first
    while spent < budget_s and first < budget_s / 2:
        start = time.perf_counter()
        a @ b
        t = time.perf_counter() - start
        best, spent = min(best, t), spent + t
    return 2 * m * k * n / best / 1e9


def peaks(threads_used):
    """The peak products at each thread count: fp32 and bf16, a square 4096^3 and the miniature's output layer."""
    native = cpu.native_bf16()
    out = {}
    for threads in sorted(threads_used):
        row = {}
        for dtype in (torch.float32, torch.bfloat16):
            label = 'fp32' if dtype == torch.float32 else 'bf16'
            # An emulated bf16 product runs at ~1 GFLOP/s: one rep of 1024^3 says as much as 4096^3 would.
            square = 4096 if dtype == torch.float32 or native else 1024
            row[f'{label} {square}^3'] = product_rate(square, square, square, dtype, threads)
            row[f'{label} 768x128x50257'] = product_rate(768, 128, 50257, dtype, threads)
        out[threads] = row
    return out


def measure(functions, model_flops, shapes, threads):
    """Each phase asked for: counted, timed (best of --repeats), profiled; printed as it goes."""
    rows = {}
    for phase in args.phases or PHASES:
        fn = functions[phase]
        flops = counted_flops(fn)
        best, times = best_time(fn, args.repeats)
        prof = profile(fn, shapes['n_vocab'], args.top)
        rows[phase] = dict(threads=threads, counted_flops=flops, model_flops=model_flops[phase],
                           best_s=best, times_s=times, gflops=flops / best / 1e9, profile=prof,
                           load=os.getloadavg()[0])
        kinds = ', '.join(f'{k} {100 * v / prof["wall_s"]:.0f}%' for k, v in prof['kinds_s'].items())
        tops = ', '.join(f'{o["op"]} {100 * o["self_s"] / prof["wall_s"]:.0f}%' for o in prof['top_ops'])
        print(f'  {phase:13s} {flops / 1e9:9.2f} GFLOP counted ({model_flops[phase] / 1e9:.2f} model) '
              f'{best:8.4f} s  {flops / best / 1e9:7.1f} GFLOP/s  (load {rows[phase]["load"]:.1f})\n'
              f'      profiled {prof["wall_s"]:.4f} s, {prof["ops_count"]} ops: {kinds}\n'
              f'      top ops: {tops}', flush=True)
    return rows


def main():
    torch.manual_seed(0)
    kind = dict(kernels=torch.backends.cpu.get_cpu_capability(), describe=cpu.describe('cpu'),
                native_bf16=cpu.native_bf16(), bf16_off_reason=cpu.bf16_off_reason(),
                limits={k: os.environ[k] for k in ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA',
                                                    'MKL_ENABLE_INSTRUCTIONS', 'LMHP_CPU_BF16')
                        if k in os.environ},
                torch=torch.__version__, repo=os.path.abspath(args.repo), load_before=os.getloadavg())
    print(f'roofline: {kind["describe"]}; ATen kernels {kind["kernels"]}, bf16 '
          f'{"native" if kind["native_bf16"] else "not native: " + kind["bf16_off_reason"]}; '
          f'limits {kind["limits"] or "none"}; torch {kind["torch"]}; repo {kind["repo"]}; '
          f'load {kind["load_before"][0]:.2f}', flush=True)
    results = dict(kind=kind, experiments={})
    threads_used = set()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.experiments:
            functions, model_flops, shapes = build(name, tmp)
            threads = args.threads or shapes['threads']
            threads_used.add(threads)
            torch.set_num_threads(threads)
            print(f'\n{name}: {threads} thread(s); {shapes}', flush=True)
            rows = measure(functions, model_flops, shapes, threads)
            results['experiments'][name] = dict(shapes=shapes, phases=rows)
            if args.json:
                json.dump(dict(results, partial=True), open(args.json, 'w'), indent=1)
    if not args.no_peak:
        results['peaks_gflops'] = peaks(threads_used)
        print('\npeak products, GFLOP/s:')
        for threads, row in results['peaks_gflops'].items():
            print(f'  {threads} thread(s): ' + ', '.join(f'{k} {v:.1f}' for k, v in row.items()))
    print('\n| experiment | phase | threads | GFLOP (counted) | s (best) | GFLOP/s | % of fp32 peak | '
          '% of bf16 peak | what its time goes to (profile) |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---|')
    for name, e in results['experiments'].items():
        for phase, row in e['phases'].items():
            peak = results.get('peaks_gflops', {}).get(row['threads'], {})
            fp32 = max((v for k, v in peak.items() if k.startswith('fp32')), default=None)
            bf16 = max((v for k, v in peak.items() if k.startswith('bf16')), default=None)
            kinds = ', '.join(f'{k} {100 * v / row["profile"]["wall_s"]:.0f}%'
                              for k, v in list(row['profile']['kinds_s'].items())[:4])
            of_peak = ['' if top is None else f'{100 * row["gflops"] / top:.0f}' for top in (fp32, bf16)]
            if not kind['native_bf16']:
                of_peak[1] = 'emulated'  # a bf16 product here is no ceiling: fp32's is the faster
            print(f'| {name} | {phase} | {row["threads"]} | {row["counted_flops"] / 1e9:.2f} | {row["best_s"]:.4f} | '
                  f'{row["gflops"]:.1f} | {of_peak[0]} | {of_peak[1]} | {kinds} |')
    results['load_after'] = os.getloadavg()
    if args.json:
        json.dump(results, open(args.json, 'w'), indent=1)
        print(f'\nroofline: {args.json}')


main()
