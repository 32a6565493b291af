#!/usr/bin/env python3
"""PPO throughput: our PyTorch port vs Hugging Face transformers doing the same work.

Every line times our code and an equivalent built from `transformers.GPT2LMHeadModel` pieces in the
same process, interleaved rep by rep (ours, HF, HF, ours, ...), so the ratio ours/HF stays meaningful
on a loaded machine. Weights are random (the speed of a matmul does not depend on the values).

    python benchmarks/ppo_throughput.py                  # GPT-2 124M, books shapes, batch 16, fp32+bf16
    python benchmarks/ppo_throughput.py --preset tiny    # smoke run, well under a minute
    python benchmarks/ppo_throughput.py --batch 16 64 --tldr --json out.json

See benchmarks/README.md for what each line measures and how FLOPs are counted.
"""
import argparse
import contextlib
import ctypes
import dataclasses
import gc
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from common import GPT2_124M, device, machine_info, proc_status_mb, random_trained_model, reset_peak_rss, sync

PRESETS = {
    # GPT-2 124M, the original's policy and reward model.
    'gpt2': dict(model=GPT2_124M,
                 books=(64, 24), tldr=(500, 75), ctx=(64, 500), ctx_lengths=(8, 40), ctx_batch=4,
                 repeats=2, warmup=1),
    # Same vocabulary (so the real padding token and encoding apply), a toy body and short shapes.
    'tiny': dict(model=dict(n_vocab=50257, n_ctx=128, n_embd=64, n_head=2, n_layer=2),
                 books=(16, 8), tldr=(64, 16), ctx=(8, 64), ctx_lengths=(4, 20), ctx_batch=4,
                 repeats=2, warmup=1),
}
LINES = ('sample', 'logprobs', 'reward', 'train', 'ppo_update')
LINE_TITLES = {
    'sample': '(a) rollout sampling',
    'logprobs': '(b) policy+ref logprobs fwd',
    'reward': '(c) reward model fwd',
    'train': '(d) PPO train step',
    'ppo_update': '(e) full PPO update',
}
LINE_UNITS = {'sample': 'new tok/s', 'logprobs': 'tok/s', 'reward': 'tok/s', 'train': 'tok/s',
              'ppo_update': 'episodes/s'}
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}  # --dtypes names; bf16 runs under autocast
TEMPERATURE = 1.0
KL_COEF = 0.15
LR = 1e-5
PADDING_TOKEN = 50259  # encodings.Main's padding token (len(encoder) + 2), outside the vocabulary


# ----------------------------------------------------------------------------------------------
# Workload description, FLOP counts, machine peak
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Workload:
    name: str            # 'books' / 'tldr'
    query_length: int
    response_length: int
    batch: int           # per-rank rollout batch
    nminibatches: int
    noptepochs: int

    @property
    def seq(self):
        return self.query_length + self.response_length

    @property
    def label(self):
        return f'{self.name} q{self.query_length}+r{self.response_length} b{self.batch}'


def layer_params(m):
    """Matmul weights of the transformer blocks: c_attn 3d^2 + c_proj d^2 + mlp 8d^2 per layer."""
    return 12 * m['n_layer'] * m['n_embd'] ** 2


def forward_flops(m, *, batch, seq, lm_positions, past=0):
    """FLOPs of one forward over `seq` new tokens (after `past` cached ones), causal attention counted
    only where it is needed (QK^T and AV: 4*d per (query, key) pair per layer), the LM head only on the
    `lm_positions` positions per row whose logits the line needs. Embeddings, norms, heads: ignored."""
    d, nl = m['n_embd'], m['n_layer']
    keys = sum(past + i + 1 for i in range(seq))  # keys attended by each new token, summed
    return batch * (2 * layer_params(m) * seq + 2 * m['n_vocab'] * d * lm_positions + 4 * nl * d * keys)


def sample_flops(m, w, length=None, query_length=None):
    length = w.response_length if length is None else length
    lq = w.query_length if query_length is None else query_length
    # Prefill: logits needed only for the last context position; then length-1 single-token steps.
    f = forward_flops(m, batch=w.batch, seq=lq, lm_positions=1)
    for i in range(length - 1):
        f += forward_flops(m, batch=w.batch, seq=1, lm_positions=1, past=lq + i)
    return f


def line_flops(m, w, line):
    # Logits are needed only at the positions that predict a response token (the original computes
    # them everywhere; counting only the needed ones keeps MFU comparable across implementations).
    logprobs = forward_flops(m, batch=w.batch, seq=w.seq, lm_positions=w.response_length)
    reward = forward_flops(m, batch=w.batch, seq=w.seq, lm_positions=0)  # a reward model needs no LM head
    train = 3 * logprobs                                                 # forward + 2x backward
    return {
        'sample': sample_flops(m, w),
        'logprobs': 2 * logprobs,
        'reward': reward,
        'train': train,
        'ppo_update': sample_flops(m, w) + logprobs + reward + train * w.noptepochs,
    }[line]


def line_work(w, line):
    """The throughput numerator of each line (see LINE_UNITS)."""
    return {
        'sample': w.batch * w.response_length,
        'logprobs': 2 * w.batch * w.seq,
        'reward': w.batch * w.seq,
        'train': w.batch * w.seq,
        'ppo_update': w.batch,
    }[line]


def measure_matmul_peak(dtype, *, sizes=(1024, 2048), seconds=2.0):
    """Best FLOP/s of large square matmuls: the machine's practical peak for `dtype` (the best of a few
    sizes and many reps, as a shared VM's speed varies by +-20% from second to second)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype, device=device()), torch.randn(n, n, dtype=dtype, device=device())
        c = torch.empty(n, n, dtype=dtype, device=device())
        torch.matmul(a, b, out=c)
        end = time.perf_counter() + seconds / len(sizes)
        while time.perf_counter() < end:
            sync()
            t = time.perf_counter()
            for _ in range(3):
                torch.matmul(a, b, out=c)
            sync()
            best = max(best, 3 * 2 * n ** 3 / (time.perf_counter() - t))
    return best


# ----------------------------------------------------------------------------------------------
# Shared pieces: synthetic rollouts and the PPO loss for the HF side (the original's loss)
# ----------------------------------------------------------------------------------------------

def amp(enabled):
    from lm_human_preferences.utils import passes  # the port's autocast, for both sides
    return passes.autocast(enabled, device())


def random_tokens(m, batch, length, generator):
    return torch.randint(0, m['n_vocab'], (batch, length), generator=generator).to(device())


def synthetic_rollouts(m, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, r = w.batch, w.response_length
    return dict(
        queries=random_tokens(m, b, w.query_length, g),
        responses=random_tokens(m, b, r, g),
        values=torch.randn(b, r, generator=g).to(device()),
        logprobs=(-11 + torch.randn(b, r, generator=g)).to(device()),
        rewards=(0.1 * torch.randn(b, r, generator=g)).to(device()),
    )


def hf_ppo_loss(outputs, rollouts, *, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95):
    """PPOTrainer.loss for the HF side: train_policy's own PPO math on HF's outputs, so that the line
    compares the models, not two copies of the loss."""
    from lm_human_preferences import train_policy
    advantages, returns = train_policy.compute_advantages(
        rewards=rollouts['rewards'], values=rollouts['values'], gamma=gamma, lam=lam, whiten_rewards=True)
    return train_policy.ppo_loss(
        logprob=outputs['logprobs'], vpred=outputs['values'], entropies=outputs['entropies'],
        old_logprob=rollouts['logprobs'], old_values=rollouts['values'], advantages=advantages,
        returns=returns, cliprange=cliprange, cliprange_value=cliprange_value, vf_coef=vf_coef)


# ----------------------------------------------------------------------------------------------
# Hugging Face side
# ----------------------------------------------------------------------------------------------

class HFImpl:
    """The same PPO work from transformers pieces: GPT2LMHeadModel (+ a linear value head on the final
    hidden state, as TRL's AutoModelForCausalLMWithValueHead), GPT2Model + linear reward head,
    `generate` for rollouts, torch.optim.Adam."""
    name = 'hf'

    def __init__(self, m, w, *, roles=('policy', 'ref_policy', 'reward_model')):
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model
        transformers.logging.set_verbosity_error()
        self.m, self.w = m, w
        cfg = GPT2Config(vocab_size=m['n_vocab'], n_positions=m['n_ctx'], n_embd=m['n_embd'],
                         n_layer=m['n_layer'], n_head=m['n_head'], activation_function='gelu_new',
                         layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=m['n_vocab'] - 1, eos_token_id=m['n_vocab'] - 1,
                         pad_token_id=m['n_vocab'] - 1)
        dev = device()
        self.policy = self.ref_policy = self.reward_model = None
        if 'policy' in roles:
            self.policy = nn.ModuleDict(dict(lm=GPT2LMHeadModel(cfg), v_head=nn.Linear(m['n_embd'], 1))).to(dev).eval()
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=LR, eps=1e-5)
        if 'ref_policy' in roles:
            self.ref_policy = nn.ModuleDict(dict(lm=GPT2LMHeadModel(cfg), v_head=nn.Linear(m['n_embd'], 1))).to(dev).eval()
            self.ref_policy.requires_grad_(False)
        if 'reward_model' in roles:
            self.reward_model = nn.ModuleDict(dict(transformer=GPT2Model(cfg), head=nn.Linear(m['n_embd'], 1))).to(dev).eval()
            self.reward_model.requires_grad_(False)
            self.reward_gain, self.reward_bias = 1.0, 0.0

    # -- pieces --
    def respond(self, queries, length):
        lm = self.policy['lm']
        out = lm.generate(
            input_ids=queries, attention_mask=torch.ones_like(queries), do_sample=True,
            temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=length, min_new_tokens=length,
            use_cache=True, pad_token_id=lm.config.pad_token_id, eos_token_id=lm.config.eos_token_id,
            return_dict_in_generate=True, output_scores=True, output_hidden_states=True)
        responses = out.sequences[:, queries.shape[1]:]
        scores = torch.stack(out.scores, dim=1).float()  # logits / temperature, as sampled
        logprobs = torch.log_softmax(scores, -1).gather(-1, responses[..., None]).squeeze(-1)
        # Final hidden state at the position that produced each token -> value head (ours returns values too).
        h = torch.cat([hs[-1][:, -1:] for hs in out.hidden_states], dim=1)
        values = self.policy['v_head'](h).squeeze(-1).float()
        return dict(responses=responses, logprobs=logprobs, values=values)

    @staticmethod
    def analyze_responses(model, queries, responses, *, need_entropy=True, need_values=True):
        tokens = torch.cat([queries, responses], dim=1)
        out = model['lm'](input_ids=tokens, attention_mask=torch.ones_like(tokens),
                          output_hidden_states=need_values, use_cache=False)
        lq = queries.shape[1]
        logits = out.logits[:, lq - 1:-1].float() / TEMPERATURE
        logp_all = torch.log_softmax(logits, -1)
        result = dict(logprobs=logp_all.gather(-1, responses[..., None]).squeeze(-1))
        if need_entropy:
            result['entropies'] = -(logp_all.exp() * logp_all).sum(-1)
        if need_values:
            result['values'] = model['v_head'](out.hidden_states[-1][:, lq - 1:-1]).squeeze(-1).float()
        return result

    def get_rewards(self, queries, responses, padding_token=PADDING_TOKEN):
        tokens = torch.cat([queries, responses], dim=1)
        mask = tokens != padding_token
        ids = torch.where(mask, tokens, torch.zeros_like(tokens))
        position_ids = torch.cumsum(mask.long(), -1) - mask.long()
        h = self.reward_model['transformer'](input_ids=ids, attention_mask=mask.long(),
                                             position_ids=position_ids, use_cache=False).last_hidden_state
        last = (torch.arange(tokens.shape[1], device=tokens.device) * mask).argmax(-1)
        h_last = h[torch.arange(tokens.shape[0], device=tokens.device), last]
        return self.reward_gain * self.reward_model['head'](h_last).squeeze(-1).float() + self.reward_bias

    def train_minibatch(self, mb):
        self.policy.train()
        outputs = self.analyze_responses(self.policy, mb['queries'], mb['responses'])
        loss, stats = hf_ppo_loss(outputs, mb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.policy.eval()
        return stats

    # -- lines --
    def line_sample(self, rollouts, bf16):
        with torch.no_grad(), amp(bf16):
            return self.respond(rollouts['queries'], self.w.response_length)

    def line_logprobs(self, rollouts, bf16):
        with torch.no_grad(), amp(bf16):
            a = self.analyze_responses(self.policy, rollouts['queries'], rollouts['responses'])
            b = self.analyze_responses(self.ref_policy, rollouts['queries'], rollouts['responses'])
        return a, b

    def line_reward(self, rollouts, bf16):
        with torch.no_grad(), amp(bf16):
            return self.get_rewards(rollouts['queries'], rollouts['responses'])

    def line_train(self, rollouts, bf16):
        with amp(bf16):
            return self.train_minibatch(rollouts)

    def line_ppo_update(self, rollouts, bf16, generator=None):
        w = self.w
        queries = rollouts['queries']
        with torch.no_grad(), amp(bf16):
            ro = self.respond(queries, w.response_length)
            ref_logprobs = self.analyze_responses(self.ref_policy, queries, ro['responses'],
                                                  need_entropy=False, need_values=False)['logprobs']
            scores = self.get_rewards(queries, ro['responses'])
        kl = ro['logprobs'] - ref_logprobs
        non_score_reward = -KL_COEF * kl
        rewards = non_score_reward.clone()
        rewards[:, -1] += scores
        data = dict(queries=queries, responses=ro['responses'], values=ro['values'],
                    logprobs=ro['logprobs'], rewards=rewards)
        mb_size = w.batch // w.nminibatches
        stats = []
        for _ in range(w.noptepochs):
            order = torch.randperm(w.batch, generator=generator)
            for start in range(0, w.batch, mb_size):
                idx = order[start:start + mb_size].to(queries.device)
                with amp(bf16):
                    stats.append(self.train_minibatch({k: v[idx] for k, v in data.items()}))
        return kl.sum(1).mean().item(), stats


# ----------------------------------------------------------------------------------------------
# Our side
# ----------------------------------------------------------------------------------------------

class OursImpl:
    """Our port: Policy.respond / analyze_responses, RewardModelTrainer.get_rewards, and the real
    train_policy.PPOTrainer: its train_minibatch (loss, backward, AdamTF) for the train step and its
    whole `step` (rollout, ref logprobs, score_fn, rewards, minibatch updates, stats) for the update."""
    name = 'ours'

    def __init__(self, m, w, *, roles=('policy', 'ref_policy', 'reward_model')):
        from lm_human_preferences import train_policy
        from lm_human_preferences.policy import Policy
        from lm_human_preferences.rewards import RewardModelTrainer
        from lm_human_preferences.training.run import Run
        from lm_human_preferences.utils import passes
        self.passes, self.m, self.w = passes, m, w
        tm = random_trained_model(m)
        dev = device()
        self.policy = self.ref_policy = self.reward_model = self.trainer = None
        if 'policy' in roles:
            self.policy = Policy(tm, scope='policy', temperature=TEMPERATURE).to(dev)
        if 'ref_policy' in roles:
            self.ref_policy = Policy(tm, scope='ref_policy', temperature=TEMPERATURE).to(dev).requires_grad_(False)
        if 'reward_model' in roles:
            self.reward_model = RewardModelTrainer(tm, scope='reward_model').to(dev).requires_grad_(False)
        if self.policy is not None and self.ref_policy is not None and self.reward_model is not None:
            hp = train_policy.HParams()
            hp.override_from_dict({
                'task.query_length': w.query_length, 'task.response_length': w.response_length,
                'task.policy.temperature': TEMPERATURE, 'rewards.kl_coef': KL_COEF,
                'rewards.trained_model': 'random', 'ppo.batch_size': w.batch,
                'ppo.nminibatches': w.nminibatches, 'ppo.noptepochs': w.noptepochs, 'ppo.lr': LR,
                'ppo.total_episodes': 10 ** 9, 'run.log_interval': 10 ** 9,
            })
            rm = self.reward_model
            score_model = _ScoreModel(rm)
            self._queries = None
            self.trainer = train_policy.PPOTrainer(
                policy=self.policy, ref_policy=self.ref_policy,
                query_sampler=lambda: {'tokens': self._queries},
                score_fn=train_policy.make_score_fn(hp.task, score_model=score_model), hparams=hp,
                run=Run(hp, 'train_policy'))

    def line_sample(self, rollouts, bf16):
        with torch.no_grad(), self.passes.autocast(bf16):
            return self.policy.respond(rollouts['queries'], self.w.response_length)

    def line_logprobs(self, rollouts, bf16):
        with torch.no_grad(), self.passes.autocast(bf16):
            a = self.policy.analyze_responses(rollouts['queries'], rollouts['responses'])
            b = self.ref_policy.analyze_responses(rollouts['queries'], rollouts['responses'])
        return a, b

    def line_reward(self, rollouts, bf16):
        with torch.no_grad(), self.passes.autocast(bf16):
            return self.reward_model.get_rewards(rollouts['queries'], rollouts['responses'])

    def line_train(self, rollouts, bf16):
        self.trainer.execution = dataclasses.replace(self.trainer.execution, bf16=bf16)
        return self.trainer.train_minibatch(rollouts)  # one rank: this process carries one

    def line_ppo_update(self, rollouts, bf16):
        self.trainer.execution = dataclasses.replace(self.trainer.execution, bf16=bf16)
        self._queries = rollouts['queries']
        return self.trainer.step()


class _ScoreModel:
    """What make_score_fn needs of a reward model (TrainedRewardModel's score_fn, without a save dir)."""

    def __init__(self, reward_model):
        self.reward_model = reward_model
        self.padding_token = reward_model.padding_token

    @torch.no_grad()
    def score_fn(self, queries, responses):
        return self.reward_model.get_rewards(queries, responses)


IMPLS = {'ours': OursImpl, 'hf': HFImpl}


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def run_once(fn):
    sync()
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # PPOTrainer.step prints its stats table
        fn()
    sync()
    return time.perf_counter() - t


def time_interleaved(fns, *, warmup, repeats):
    """fns: {name: callable}. Runs them alternately (order reversed every rep) and returns
    {name: [seconds per timed rep]}: load that drifts during the run hits both sides alike."""
    names = list(fns)
    times = {n: [] for n in names}
    for rep in range(warmup + repeats):
        for n in (names if rep % 2 == 0 else names[::-1]):
            t = run_once(fns[n])
            if rep >= warmup:
                times[n].append(t)
    return times


def bench_lines(m, w, impls, *, dtypes, lines, warmup, repeats, peaks, log):
    rows = []
    rollouts = synthetic_rollouts(m, w)
    for dt in dtypes:
        bf16 = dt == 'bf16'
        for line in lines:
            fns = {}
            for name, impl in impls.items():
                fn = getattr(impl, f'line_{line}')
                fns[name] = (lambda fn=fn: fn(rollouts, bf16))
            times = time_interleaved(fns, warmup=warmup, repeats=repeats)
            flops, work = line_flops(m, w, line), line_work(w, line)
            row = dict(workload=w.label, line=line, dtype=dt, unit=LINE_UNITS[line], flops=flops,
                       times_s={k: v for k, v in times.items()})
            for name in impls:
                t = min(times[name])  # best of the reps: load only ever slows a rep down
                row[name] = work / t
                row[f'{name}_mfu'] = flops / t / peaks[dt]
            add_ratios(row, impls)
            rows.append(row)
            log(format_row(row))
    return rows


def bench_ctx(m, impls, *, contexts, lengths, batch, warmup, repeats, log):
    """Per-new-token sampling cost at two context lengths: (T(L2) - T(L1)) / (L2 - L1) cancels the
    prefill, leaving the cost of one decode step with a KV cache of that length."""
    rows = []
    l1, l2 = lengths
    for ctx in contexts:
        w = Workload('ctx', ctx, l2, batch, 1, 1)
        rollouts = synthetic_rollouts(m, w, seed=1)
        fns = {}
        for name, impl in impls.items():
            for length in (l1, l2):
                fns[(name, length)] = (lambda impl=impl, length=length:
                                       _respond(impl, rollouts['queries'], length))
        times = time_interleaved(fns, warmup=warmup, repeats=repeats)
        row = dict(workload=f'ctx{ctx} b{batch}', line='per_token', dtype='fp32', unit='ms/new token',
                   context=ctx, batch=batch, lengths=[l1, l2],
                   times_s={f'{k[0]}_L{k[1]}': v for k, v in times.items()})
        for name in impls:
            dt = min(times[(name, l2)]) - min(times[(name, l1)])
            row[name] = 1e3 * dt / (l2 - l1)
        add_ratios(row, impls, lower_is_better=True)
        rows.append(row)
        log(format_row(row))
    return rows


def add_ratios(row, impls, lower_is_better=False):
    """row['ratio'] (and row['ratio_<impl>'] for extra implementations): speed relative to HF, >1 = faster."""
    if 'hf' not in impls:
        return
    for name in impls:
        if name != 'hf':
            r = row['hf'] / row[name] if lower_is_better else row[name] / row['hf']
            row['ratio' if name == 'ours' else f'ratio_{name}'] = r


def _respond(impl, queries, length):
    with torch.no_grad():
        if impl.name == 'hf':
            return impl.respond(queries, length)
        return impl.policy.respond(queries, length)


# ----------------------------------------------------------------------------------------------
# Peak memory, one subprocess per (implementation, dtype, workload)
# ----------------------------------------------------------------------------------------------

def memory_probe(spec):
    """Runs in a fresh process: build one implementation, run each line once, report
    peak-RSS growth over the RSS at the start of the line (and the models' resident size)."""
    m, w = spec['model'], Workload(**spec['workload'])
    bf16 = spec['dtype'] == 'bf16'
    torch.set_num_threads(spec['threads'])
    result = dict(impl=spec['impl'], dtype=spec['dtype'], workload=w.label, lines={})
    if device().type == 'cuda':
        before = torch.cuda.memory_allocated()
        impl = IMPLS[spec['impl']](m, w)
        result['models_mb'] = (torch.cuda.memory_allocated() - before) / 2 ** 20
    else:
        gc.collect()
        before = proc_status_mb('VmRSS')
        impl = IMPLS[spec['impl']](m, w)
        gc.collect()
        result['models_mb'] = proc_status_mb('VmRSS') - before
    rollouts = synthetic_rollouts(m, w)
    for line in spec['lines']:
        gc.collect()
        if device().type == 'cuda':
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run_once(lambda: getattr(impl, f'line_{line}')(rollouts, bf16))
            result['lines'][line] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        else:
            base = proc_status_mb('VmRSS')
            reset_peak_rss()
            run_once(lambda: getattr(impl, f'line_{line}')(rollouts, bf16))
            result['lines'][line] = proc_status_mb('VmHWM') - base
    print('MEMORY_PROBE ' + json.dumps(result))


def run_memory_probes(m, w, *, impls, dtypes, lines, threads, log):
    out = {}
    env = dict(os.environ)
    # Hand every tensor of >= 1 MiB straight back to the OS when freed, so that the peak RSS of one
    # line is not hidden by memory glibc kept cached from an earlier one.
    env.setdefault('MALLOC_MMAP_THRESHOLD_', str(1 << 20))
    for dt in dtypes:
        for name in impls:
            spec = dict(impl=name, dtype=dt, model=m, workload=dataclasses.asdict(w), lines=list(lines),
                        threads=threads)
            proc = subprocess.run([sys.executable, __file__, '--_memory-probe', json.dumps(spec)],
                                  capture_output=True, text=True, env=env)
            lines_out = [ln for ln in proc.stdout.splitlines() if ln.startswith('MEMORY_PROBE ')]
            if proc.returncode != 0 or not lines_out:
                raise RuntimeError(f'memory probe {name}/{dt}/{w.label} failed (exit {proc.returncode}):\n'
                                   f'{proc.stderr[-3000:]}')
            res = json.loads(lines_out[-1][len('MEMORY_PROBE '):])
            out[(name, dt)] = res
            log(f'  memory {name:4s} {dt:4s} models {res["models_mb"]:7.0f} MB; peak extra per line: ' +
                ', '.join(f'{k} {v:.0f}' for k, v in res['lines'].items()) + ' MB')
    return out


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------

def _fmt(v):
    if v is None:
        return '-'
    return f'{v:.3f}' if v < 1 else f'{v:,.1f}' if v < 1000 else f'{v:,.0f}'


def format_row(r):
    title = LINE_TITLES.get(r['line'], 'sampling cost per new token')
    names = [k for k in r if k in IMPLS]
    s = f'{r["workload"]:<24s} {title:<30s} {r["dtype"]:<4s} ' + ' '.join(
        f'{n} {_fmt(r[n]):>9s}' for n in names) + f' {r["unit"]}'
    if 'ratio' in r:
        s += f' | ours/hf {r["ratio"]:.2f}x'
    s += ''.join(f' | {k[6:]}/hf {v:.2f}x' for k, v in r.items() if k.startswith('ratio_'))
    if 'ours_mfu' in r or 'hf_mfu' in r:
        s += ' | MFU ' + ' '.join(f'{n} {100 * r[n + "_mfu"]:.1f}%' for n in names if n + '_mfu' in r)
    return s


def markdown_table(rows, mem):
    out = ['| workload | line | dtype | ours | HF | unit | ours/HF | MFU ours | MFU HF | peak extra MB ours | peak extra MB HF |',
           '|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|']
    for r in rows:
        mo = mem.get((r['workload'], 'ours', r['dtype']), {}).get(r['line'])
        mh = mem.get((r['workload'], 'hf', r['dtype']), {}).get(r['line'])
        mfu = lambda k: f'{100 * r[k]:.1f}%' if k in r else '-'
        ratio = f'{r["ratio"]:.2f}x' if 'ratio' in r else '-'
        out.append(f'| {r["workload"]} | {LINE_TITLES.get(r["line"], "cost per new token")} | {r["dtype"]} | '
                   f'{_fmt(r.get("ours"))} | {_fmt(r.get("hf"))} | {r["unit"]} | {ratio} | {mfu("ours_mfu")} | '
                   f'{mfu("hf_mfu")} | {_fmt(mo)} | {_fmt(mh)} |')
    return '\n'.join(out)


# ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--preset', choices=sorted(PRESETS), default='gpt2')
    for k in ('n_layer', 'n_embd', 'n_head', 'n_vocab', 'n_ctx'):
        p.add_argument(f'--{k.replace("_", "-")}', type=int, help=f'override the preset model {k}')
    p.add_argument('--batch', type=int, nargs='*', default=[16],
                   help='per-rank books batch sizes (e.g. 16 64; none: skip books, e.g. with --tldr)')
    p.add_argument('--tldr', action='store_true', help='also run the tldr shapes (query 500, response 75)')
    p.add_argument('--tldr-batch', type=int, default=8)
    p.add_argument('--nminibatches', type=int, default=1, help='PPO minibatches per batch (original default 1)')
    p.add_argument('--noptepochs', type=int, default=1, help='PPO epochs in the full-update line')
    p.add_argument('--dtypes', nargs='+', choices=('fp32', 'bf16'), default=['fp32', 'bf16'])
    p.add_argument('--lines', nargs='+', choices=LINES, default=list(LINES))
    p.add_argument('--impls', nargs='+', choices=sorted(IMPLS), default=['ours', 'hf'])
    p.add_argument('--no-ctx', action='store_true', help='skip the cost-per-new-token vs context line')
    p.add_argument('--memory', choices=('off', 'fp32', 'all'), default='fp32',
                   help='peak-memory probes (one subprocess per implementation and dtype)')
    p.add_argument('--repeats', type=int, help='timed reps per line (default: preset)')
    p.add_argument('--warmup', type=int, help='untimed reps per line (default: preset)')
    p.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument('--json', type=str, help='write all results here')
    p.add_argument('--_memory-probe', dest='memory_probe', help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.memory_probe:
        memory_probe(json.loads(args.memory_probe))
        return
    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    m = dict(preset['model'])
    for k in m:
        if getattr(args, k) is not None:
            m[k] = getattr(args, k)
    warmup = preset['warmup'] if args.warmup is None else args.warmup
    repeats = preset['repeats'] if args.repeats is None else args.repeats
    started = time.time()

    def log(s):
        print(s, flush=True)

    # The process setting launch.py applies (glibc keeps freed memory for reuse). Both implementations
    # run in this process, so both get it.
    from lm_human_preferences.utils import workers
    malloc_tuned = workers.reuse_freed_memory()
    info = machine_info()
    info['reuse_freed_memory'] = malloc_tuned
    log(f'machine: {info["cpu"]}, {info["cores"]} cores, torch {info["torch"]}, transformers '
        f'{info["transformers"]}, {info["threads"]} threads, reuse_freed_memory {malloc_tuned}'
        + (f', {info["cuda"]}' if info['cuda'] else ''))
    log(f'model: {m} ({(layer_params(m) + m["n_vocab"] * m["n_embd"]) / 1e6:.1f}M matmul params)')
    peaks = {k: measure_matmul_peak(DTYPES[k]) for k in ('fp32', 'bf16') if k == 'fp32' or k in args.dtypes}
    log('matmul peak: ' + ', '.join(f'{k} {v / 1e9:.0f} GFLOP/s' for k, v in peaks.items()))
    peaks_seen = {k: [v] for k, v in peaks.items()}

    workloads = [Workload('books', *preset['books'], b, args.nminibatches, args.noptepochs) for b in args.batch]
    if args.tldr:
        workloads.append(Workload('tldr', *preset['tldr'], args.tldr_batch, args.nminibatches, args.noptepochs))
    for w in workloads:
        if w.batch // w.nminibatches < 8:
            raise SystemExit(f'--batch {w.batch} / --nminibatches {w.nminibatches} < 8: the original '
                             f'asserts a minibatch of >= 8 for reward whitening')

    rows, ctx_rows, mem = [], [], {}

    def write_json(partial):
        """Everything so far (after each workload too: a run cut short keeps what it measured)."""
        if not args.json:
            return
        result = dict(machine=info, model=m, peaks_flops=peaks, peaks_seen_flops=peaks_seen, argv=sys.argv[1:],
                      workloads=[dataclasses.asdict(w) for w in workloads], rows=rows, ctx_rows=ctx_rows,
                      memory=[dict(workload=k[0], impl=k[1], dtype=k[2], **({'models_mb': v} if len(k) == 4 else {'lines_mb': v}))
                              for k, v in mem.items()],
                      wall_s=time.time() - started, partial=partial)
        Path(args.json).write_text(json.dumps(result, indent=1))

    header = f'{"workload":<24s} {"line":<30s} dtype'
    for i, w in enumerate(workloads):
        log(f'\n== {w.label} (nminibatches {w.nminibatches}, noptepochs {w.noptepochs}) ==\n{header}')
        if args.memory != 'off':
            # First, while this process holds no models: the probes' processes then have the memory
            # that the timing below needs for the six models side by side.
            mdt = args.dtypes if args.memory == 'all' else [d for d in args.dtypes if d == 'fp32']
            log(f'-- peak memory ({", ".join(mdt)}) --')
            for (name, dt), res in run_memory_probes(m, w, impls=args.impls, dtypes=mdt, lines=args.lines,
                                                     threads=args.threads, log=log).items():
                mem[(w.label, name, dt)] = res['lines']
                mem[(w.label, name, dt, 'models')] = res['models_mb']
        torch.manual_seed(0)
        impls = {name: IMPLS[name](m, w) for name in args.impls}
        rows += bench_lines(m, w, impls, dtypes=args.dtypes, lines=args.lines, warmup=warmup,
                            repeats=repeats, peaks=peaks, log=log)
        if i == 0 and not args.no_ctx:
            log(f'\n== sampling cost per new token vs context (fp32, batch {preset["ctx_batch"]}) ==')
            ctx_rows = bench_ctx(m, impls, contexts=preset['ctx'], lengths=preset['ctx_lengths'],
                                 batch=preset['ctx_batch'], warmup=warmup, repeats=repeats, log=log)
            for name in impls:
                if len(ctx_rows) >= 2:
                    log(f'  {name}: cost per token at ctx {ctx_rows[-1]["context"]} / ctx {ctx_rows[0]["context"]}'
                        f' = {ctx_rows[-1][name] / ctx_rows[0][name]:.2f}x')
        del impls
        gc.collect()
        if malloc_tuned:  # hand the freed heap back to the OS before the next workload's probes
            ctypes.CDLL('libc.so.6').malloc_trim(0)
        # The peak again (the machine's load may have changed): MFU uses the best seen in the run.
        for k in peaks:
            peaks_seen[k].append(measure_matmul_peak(DTYPES[k], seconds=1.0))
        write_json(partial=i + 1 < len(workloads))

    # Re-measure the peak at the end too; MFU is against the best peak seen during the run.
    for k in peaks:
        peaks_seen[k].append(measure_matmul_peak(DTYPES[k]))
    log('\nmatmul peak seen: ' + ', '.join(f'{k} ' + ' / '.join(f'{v / 1e9:.0f}' for v in vs) + ' GFLOP/s'
                                         for k, vs in peaks_seen.items()))
    best = {k: max(vs) for k, vs in peaks_seen.items()}
    for r in rows:
        for name in IMPLS:
            if f'{name}_mfu' in r:
                r[f'{name}_mfu'] *= peaks[r['dtype']] / best[r['dtype']]
    peaks = best

    log('\n' + markdown_table(rows + ctx_rows, mem))
    log(f'\ntotal wall time {time.time() - started:.0f} s')
    write_json(partial=False)
    if args.json:
        log(f'wrote {args.json}')


if __name__ == '__main__':
    main()
