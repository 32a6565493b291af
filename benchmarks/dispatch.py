#!/usr/bin/env python3
"""Ops dispatched per PPO update at the paper's configurations: the floor a GPU's launch overhead sets.

An eager PyTorch op costs a launch and dispatch overhead of roughly 5-10 us on a GPU whatever its size, so
a PPO update that dispatches hundreds of thousands of tiny ops is bound by dispatch, not arithmetic. This
counts every aten op dispatched during one `PPOTrainer.step()` (a TorchDispatchMode that counts calls,
views included) with the real trainer code, by phase, at the paper's shapes with their 8 ranks carried by
one process, and prints the floor at 5 us/op for one update and for a whole run:

    books  (sentiment, descriptiveness): query 64, response 24, 512 episodes a batch (64 per rank),
           1 minibatch, 4 PPO epochs, 1,954 updates a run
    tldr   (tldr, cnndm): query 500, response 75, 32 episodes a batch (4 per rank), 1 minibatch,
           4 PPO epochs, 31,250 updates a run

The model has GPT-2 124M's depth and heads (12 layers, 12 heads) but a narrow width and a small
vocabulary: the op count depends on neither, and the count then takes a minute on a CPU. The count is
taken on the CPU; the code paths are the ones a CUDA device runs where they differ (the multi-tensor
optimizer: --adam foreach), which the script selects. bf16 adds the autocast casts and, in the rollout, the
old logprobs' forward (--bf16).

    python benchmarks/dispatch.py                          # books and tldr, no split and what 'auto' plans on 24 GB
    python benchmarks/dispatch.py --microbatch none 64     # chosen run.microbatch_size values
    python benchmarks/dispatch.py --json out.json          # {"books": {"ops_per_update": N, "phases": {...}}, ...}

Phases: sampling (Policy.respond), old logprobs (bf16: the policy's forward in the rollout), ref logprobs,
scoring (the reward model and the response filter), rollout other (rewards, KL, queries, random draws), loss
forward+backward (PPOTrainer.loss), optimizer (AdamTF.step), rank reductions (averaging the ranks'
gradients), stats (PPOTrainer.record_step_stats), other (the rest of step(): the minibatch gather, checks).
"""
import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import time

# Counted on the CPU on a GPU machine too: the trainers would place themselves on CUDA (utils.get_device),
# and the count is the same on either (the CUDA code paths are selected below).
os.environ['CUDA_VISIBLE_DEVICES'] = ''
import torch  # noqa: E402 (after hiding the GPUs)
from torch.utils._python_dispatch import TorchDispatchMode

from common import GPT2_124M, REPO_ROOT, machine_info, random_trained_model

US_PER_OP = 5.0
NARROW = dict(n_vocab=1024, n_ctx=1024, n_embd=48, n_head=12, n_layer=12)  # GPT-2 124M's depth and heads


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, under the innermost phase entered."""

    def __init__(self):
        super().__init__()
        self.phases = collections.Counter()
        self.ops = collections.Counter()
        self.stack = ['other']

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.phases[self.stack[-1]] += 1
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def phase(self, name):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()


class DecodeSteps:
    """Counts the ops of the decoding loop's steps (language/sample.py's _run_eagerly), which a CUDA device
    captures as a graph and replays: the ops a step dispatches are then one graph launch."""

    def __init__(self, counter):
        self.counter = counter
        self.runs = []  # (steps, ops) of every decoding loop

    def __call__(self, body, steps):
        before = sum(self.counter.phases.values())
        for _ in range(steps):
            body()
        self.runs.append((steps, sum(self.counter.phases.values()) - before))

    def cuda_graph_ops(self):
        """What the loops dispatch with the CUDA graph (sample._replay_as_cuda_graph): the warm-up steps and
        the captured one as eager ops, each later step one launch."""
        from lm_human_preferences.language import sample
        total = 0
        for steps, ops in self.runs:
            per_step, warmup = ops / steps, min(sample._CUDA_GRAPH_WARMUP_STEPS, steps)
            total += warmup * per_step + (per_step + steps - warmup if steps > warmup else 0)
        return round(total)


def instrument(stack, obj, method, counter, name, *, unless_in=()):
    """Count the ops of obj.method under phase `name` (inside a phase of unless_in, under that one) until
    the ExitStack `stack` closes; nothing where obj has no such method (code before or after a change)."""
    if obj is None or not hasattr(obj, method):
        return
    original = getattr(obj, method)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if counter.stack[-1] in unless_in:
            return original(*args, **kwargs)
        with counter.phase(name):
            return original(*args, **kwargs)
    stack.enter_context(_replacing(obj, method, wrapper))


def paper_config(name):
    """The train_policy hparams of the paper's experiment (launch.py), without its reward-model phase."""
    sys.path.insert(0, str(REPO_ROOT))
    import launch as top_launch
    from lm_human_preferences import launch_commands
    from lm_human_preferences import train_policy
    exp = dict(books='sentiment', tldr='tldr')[name]
    trial = top_launch.get_experiments()[exp][0]
    hp = train_policy.HParams()
    hp.override_from_dict({k: v for k, v, _ in trial if k is not None and not k.startswith('rewards.train_new_model')})
    return hp, launch_commands.PAPER_RANKS


def count_update(name, *, microbatch_size, bf16, adam, seed=1):
    """Ops of one PPOTrainer.step() (the second one: the first allocates the optimizer state)."""
    from lm_human_preferences import train_policy
    from lm_human_preferences.language import sample
    from lm_human_preferences.policy import Policy
    from lm_human_preferences.rewards import RewardModelTrainer
    from lm_human_preferences.training.run import Run
    from lm_human_preferences.utils import core as utils, ranks

    try:  # the GPU's path under bf16: attention in bf16, as on CUDA (a CPU runs it in fp32, faster there)
        from lm_human_preferences.language import bf16 as bf16_mode
        bf16_mode.ATTENTION_DTYPES['cpu'] = bf16_mode.ATTENTION_DTYPES['cuda']
    except ImportError:  # an older checkout
        pass
    hp, num_ranks = paper_config(name)
    hp.rewards.train_new_model = None
    hp.rewards.trained_model = 'random'
    hp.run.bf16 = bf16
    hp.run.microbatch_size = microbatch_size
    hp.run.log_interval = 10 ** 9
    tm = random_trained_model(NARROW)
    # The trainer's own lines (its run summary, the stats table, samples) are not this script's output.
    with open(os.devnull, 'w') as quiet, contextlib.redirect_stdout(quiet):
        with ranks.carry(num_ranks):
            utils.set_mpi_seed(seed)
            policy = Policy(tm, scope='policy')
            ref_policy = Policy(tm, scope='ref_policy').requires_grad_(False)
            reward_model = RewardModelTrainer(tm).requires_grad_(False)
            padding_token = policy.padding_token
            per_rank = hp.ppo.batch_size // num_ranks

            def query_sampler():
                # Random queries of the rank whose section calls it, the last tokens of every other row padded
                # (real queries are right-padded).
                tokens = torch.randint(0, NARROW['n_vocab'], (per_rank, hp.task.query_length))
                tokens[::2, -3:] = padding_token
                return dict(tokens=tokens)

            class ScoreModel:  # what make_score_fn needs of a TrainedRewardModel
                padding_token = reward_model.padding_token
                score_fn = staticmethod(reward_model.get_rewards)

            trainer = train_policy.PPOTrainer(
                policy=policy, ref_policy=ref_policy, query_sampler=query_sampler,
                score_fn=train_policy.make_score_fn(hp.task, score_model=ScoreModel(), microbatch_size=microbatch_size),
                hparams=hp, run=Run(hp, 'train_policy'))
            if adam == 'foreach':
                if not hasattr(trainer.optimizer, 'foreach'):
                    raise SystemExit('this AdamTF has no multi-tensor path (--adam foreach): use --adam default')
                trainer.optimizer.foreach = True
            counter = OpCounter()
            phases = contextlib.ExitStack()
            instrument(phases, policy, 'respond', counter, 'sampling')
            instrument(phases, policy, 'analyze_responses', counter, 'old logprobs', unless_in=('loss forward+backward',))
            instrument(phases, ref_policy, 'analyze_responses', counter, 'ref logprobs')
            instrument(phases, trainer, 'score_fn', counter, 'scoring')
            instrument(phases, trainer, 'rollout', counter, 'rollout other')
            instrument(phases, trainer, 'loss', counter, 'loss forward+backward')
            instrument(phases, trainer.optimizer, 'step', counter, 'optimizer')
            instrument(phases, utils, 'mpi_allreduce_mean_grads', counter, 'rank reductions')
            # the ranks' gradients of a process that ran them one after another (before they were side by side)
            instrument(phases, getattr(trainer, 'rank_gradients', None), 'add_rank', counter, 'rank reductions')
            instrument(phases, getattr(trainer, 'rank_gradients', None), 'average', counter, 'rank reductions')
            instrument(phases, trainer, 'record_step_stats', counter, 'stats')
            decode = DecodeSteps(counter)
            trainer.step()  # warm-up: Adam's state, lazily built buffers
            trainer.global_step += 1
            started = time.perf_counter()
            with phases, counter, _replacing(sample, '_run_eagerly', decode):
                trainer.step()
            seconds = time.perf_counter() - started
    total = sum(counter.phases.values())
    updates = train_policy.nupdates(hp)
    decode_ops = sum(ops for _, ops in decode.runs)
    cuda_graph_total = total - decode_ops + decode.cuda_graph_ops()
    return dict(ops_per_update=total, phases=dict(counter.phases.most_common()),
                decode_steps=dict(ops=decode_ops, steps=sum(steps for steps, _ in decode.runs), loops=len(decode.runs)),
                cuda_graph_ops_per_update=cuda_graph_total,
                cuda_graph_floor_h_per_run=cuda_graph_total * US_PER_OP * 1e-6 * updates / 3600,
                top_ops=dict(counter.ops.most_common(15)), updates_per_run=updates,
                floor_s_per_update=total * US_PER_OP * 1e-6, floor_h_per_run=total * US_PER_OP * 1e-6 * updates / 3600,
                microbatch_size=microbatch_size, bf16=bf16, adam=adam, cpu_seconds=seconds,
                episodes=hp.ppo.batch_size, ranks=num_ranks, query_length=hp.task.query_length,
                response_length=hp.task.response_length, noptepochs=hp.ppo.noptepochs,
                nminibatches=hp.ppo.nminibatches)


@contextlib.contextmanager
def _replacing(module, name, value):
    """module.name = value while the block runs (nothing where module has no such name: older code)."""
    if not hasattr(module, name):
        yield
        return
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def parse_microbatch(value):
    return None if value in ('none', 'None') else int(value)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--shapes', nargs='+', default=['books', 'tldr'], choices=['books', 'tldr'])
    p.add_argument('--microbatch', nargs='+', type=parse_microbatch, default=None,
                   help="run.microbatch_size values ('none': no split); default: none and what 'auto' (the paper's "
                        "experiments' default) plans on a 24 GB GPU")
    p.add_argument('--bf16', action='store_true', help='count under bf16 autocast (the CUDA default)')
    p.add_argument('--adam', choices=['foreach', 'default'], default='foreach',
                   help="foreach: AdamTF's multi-tensor path, as on CUDA (default); default: the CPU's path")
    p.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument('--json', help='write the results to this file')
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    results = dict(machine=machine_info(), us_per_op=US_PER_OP, model=NARROW)
    for shape in args.shapes:
        sizes = args.microbatch
        if sizes is None:
            sizes = [None]
            advice = advised_microbatch_size(shape)
            if advice is not None:
                sizes.append(advice)
        for size in sizes:
            r = count_update(shape, microbatch_size=size, bf16=args.bf16, adam=args.adam)
            key = shape if size is None else f'{shape}@{size}'
            results[key] = r
            print(f"{key}: {r['ops_per_update']:,} ops per update ({r['ranks']} ranks x {r['episodes'] // r['ranks']} "
                  f"episodes, q{r['query_length']}+r{r['response_length']}, run.microbatch_size {size}, "
                  f"{'bf16' if args.bf16 else 'fp32'}, adam {args.adam}); floor at {US_PER_OP:g} us/op: "
                  f"{r['floor_s_per_update']:.3f} s per update, {r['floor_h_per_run']:.2f} h for the "
                  f"{r['updates_per_run']:,} updates of a run", flush=True)
            for phase, n in r['phases'].items():
                print(f'    {phase:24s} {n:>9,}  ({100 * n / r["ops_per_update"]:4.1f}%)')
            d = r['decode_steps']
            if d['loops']:  # code whose decoding loop a CUDA graph replays
                print(f"    of which decoding steps  {d['ops']:>9,}  ({d['steps']} steps in {d['loops']} loops, "
                      f"{d['ops'] / d['steps']:.0f} ops a step)\n    with CUDA graphs (each loop's steps after the "
                      f"first {_warmup()} eager ones: one captured, then replayed): {r['cuda_graph_ops_per_update']:,} "
                      f"per update, {r['cuda_graph_floor_h_per_run']:.2f} h a run at {US_PER_OP:g} us/op")
            print('    most dispatched: ' + ', '.join(f'{k} {v:,}' for k, v in list(r['top_ops'].items())[:8]))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)


def _warmup():
    from lm_human_preferences.language import sample
    return sample._CUDA_GRAPH_WARMUP_STEPS


def advised_microbatch_size(shape, gib=24):
    """What `run.microbatch_size auto` (the paper's experiments' default) plans on a GPU of `gib` GB for GPT-2
    124M at this shape in bf16 (the CUDA default), with half a GB of it taken by the CUDA context (None: no
    split); None where the code predates the memory model."""
    try:
        from lm_human_preferences.training import memory
    except ImportError:
        return None
    from lm_human_preferences.language import model
    hp, _ = paper_config(shape)
    budget = int((gib - 0.5) * 2 ** 30 * memory.USABLE_FRACTION)
    return memory.plan(memory.policy_passes(hp), model.HParams(**GPT2_124M), **memory.POLICY_MODELS,
                       bf16=True, budget=budget).microbatch_size


if __name__ == '__main__':
    main()
