"""Ours: the memory a run's model passes need, for `run.microbatch_size auto`.

A process carries its ranks side by side (utils/ranks.py), so a pass holds all its ranks' sequences: on one
GPU the paper's sentiment PPO loss holds 8 x 64 episodes, some 40 GB in fp32. `run.microbatch_size K` bounds
every pass to K sequences; `auto` picks the largest K whose passes fit the device's free memory, by this
model: a fixed part (the resident models, and the trained one's gradients and Adam moments) plus, for each
kind of pass, bytes per sequence that grow with its tokens. The constants are what benchmarks/memory.py
measured, rounded up (benchmarks/README.md).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from lm_human_preferences.training import run_checks
from lm_human_preferences.utils import core, distributed, ranks

# Activations a training pass keeps for its backward pass, in bytes per token, layer and unit of width (the
# residual stream, the layer norms' inputs, q/k/v and the attention output in fp32, the MLP's 4x wide input
# and output; under bf16 autocast the matmul inputs and outputs are bf16, the attention too on CUDA).
TRAIN_BYTES_PER_TOKEN_LAYER_WIDTH = dict(fp32=66, bf16=45)
# A forward pass without gradients keeps one layer's temporaries at a time: q/k/v, the attention output and
# the MLP's hidden layer, fp32 (a little more than needed under bf16).
FORWARD_BYTES_PER_TOKEN_WIDTH = 48
# Per position whose logits are read: the fp32 logits and what the losses derive from them (log-softmax,
# softmax for the entropy, their gradient) in a training pass; the logits and the sampler's float64
# cumulative sum when sampling.
TRAIN_BYTES_PER_LOGIT = 24
FORWARD_BYTES_PER_LOGIT = 12
SAMPLE_BYTES_PER_LOGIT = 24
# What of the free memory `auto` plans for: the rest absorbs the allocator's fragmentation and small tensors.
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Pass:
    """A kind of model pass of a run: 'train' (forward and backward), 'forward' (no gradients) or 'sample'
    (decoding with a KV cache); the sequences it would hold unsplit, their tokens through the model, and the
    positions whose logits are read (0 for a reward model)."""
    kind: str
    sequences: int
    tokens: int
    logits: int


def bytes_per_sequence(p: Pass, model_hparams, *, bf16):
    e, layers, vocab = model_hparams.n_embd, model_hparams.n_layer, model_hparams.n_vocab
    if p.kind == 'train':
        return p.tokens * layers * e * TRAIN_BYTES_PER_TOKEN_LAYER_WIDTH['bf16' if bf16 else 'fp32'] + \
            p.logits * vocab * TRAIN_BYTES_PER_LOGIT
    if p.kind == 'forward':
        return p.tokens * e * FORWARD_BYTES_PER_TOKEN_WIDTH + p.logits * vocab * FORWARD_BYTES_PER_LOGIT
    if p.kind == 'sample':  # its KV cache (fp32: bf16 only on CUDA), the prefill's temporaries, the sampler's rows
        return p.tokens * layers * 2 * e * 4 + p.tokens * e * FORWARD_BYTES_PER_TOKEN_WIDTH + \
            vocab * SAMPLE_BYTES_PER_LOGIT
    raise ValueError(f'unknown pass kind {p.kind!r}')


def fixed_bytes(model_hparams, *, resident, trained, bf16):
    """The resident models' weights (fp32, and in bf16 mode their bf16 copies: language/bf16.py's cast_once),
    and the trained one's gradients and Adam's two moments."""
    params = parameter_count(model_hparams)
    return params * (4 + (2 if bf16 else 0)) * resident + trained * params * (4 + 8)


def parameter_count(h):
    return h.n_vocab * h.n_embd + h.n_ctx * h.n_embd + h.n_layer * (12 * h.n_embd ** 2 + 13 * h.n_embd) + 2 * h.n_embd


def free_bytes(device):
    """Memory a run may still allocate: on CUDA the device's free memory plus what torch's caching allocator
    holds unused; on a CPU the kernel's MemAvailable."""
    if device.type == 'cuda':
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    with open('/proc/meminfo') as f:
        available = next(line for line in f if line.startswith('MemAvailable:'))
    return int(available.split()[1]) * 1024


@dataclass(frozen=True)
class Plan:
    microbatch_size: Optional[int]  # None: every pass fits unsplit
    budget: int
    fixed: int
    binding: Pass  # the pass whose bytes per sequence set the size
    per_sequence: int


def plan(passes, model_hparams, *, resident, trained, bf16, budget, smallest=1):
    """The largest number of sequences per pass that fits budget bytes (None: every pass whole), at least
    `smallest` (the sequences a pass cannot split: a label's samples for the reward model's loss)."""
    fixed = fixed_bytes(model_hparams, resident=resident, trained=trained, bf16=bf16)
    sizes = []
    for p in passes:
        per_sequence = bytes_per_sequence(p, model_hparams, bf16=bf16)
        sizes.append((max(int((budget - fixed) // per_sequence), smallest), p, per_sequence))
    k, binding, per_sequence = min(sizes, key=lambda s: s[0])
    whole = k >= max(p.sequences for p in passes)
    return Plan(microbatch_size=None if whole else k, budget=budget, fixed=fixed, binding=binding,
                per_sequence=per_sequence)


def resolve(run_hparams, passes, model_hparams, *, resident, trained, device, what, smallest=1):
    """run.microbatch_size as a number: itself, or for 'auto' the plan for the device's free memory now
    (printed by the process that carries rank 0, with what it was planned from). `what` names the run;
    `smallest` as plan's. Collective: every process plans for the smallest free memory among them, so
    that all split their passes alike."""
    if run_hparams.microbatch_size != 'auto':
        return run_hparams.microbatch_size
    bf16 = run_hparams.use_bf16()
    budget = distributed.processes_min(int(free_bytes(device) * USABLE_FRACTION))
    p = plan(passes, model_hparams, resident=resident, trained=trained, bf16=bf16, budget=budget, smallest=smallest)
    if ranks.is_root():
        gb = 2 ** 30
        size = 'no split' if p.microbatch_size is None else f'{p.microbatch_size} sequences a pass'
        print(f'{what}: run.microbatch_size auto = {size} ({p.budget / gb:.1f} GB of {device.type} memory to '
              f'use: {p.fixed / gb:.1f} GB for the models and the optimizer, {p.per_sequence / 2 ** 20:.0f} MB a '
              f'sequence in the {p.binding.kind} pass of {p.binding.tokens} tokens)')
    return p.microbatch_size


def reward_passes(hparams):
    """train_reward's model passes in this process: the loss (one pass per sample of each of
    its labels, kept until the backward pass), the held-out evaluation, and the normalization's sampling and
    scoring; the ranks side by side, the batches shared by the processes."""
    processes = ranks.num_processes()
    samples = run_checks.samples_per_label(hparams.labels.type)
    tokens = hparams.task.query_length + hparams.task.response_length
    labels = core.ceil_div(hparams.batch_size, processes)
    passes = [Pass('train', samples * labels, tokens, 0), Pass('forward', samples * labels, tokens, 0)]
    if hparams.normalize_before or hparams.normalize_after:
        rollout = core.ceil_div(hparams.rollout_batch_size, processes)
        passes += [Pass('sample', rollout, tokens, 1), Pass('forward', rollout, tokens, 0)]
    return passes


# The models a policy run holds: the policy, its reference and the reward model
# resident; the policy trained (its gradients and Adam's moments).
POLICY_MODELS = dict(resident=3, trained=1)


def policy_passes(hparams):
    """train_policy's model passes in this process: sampling, the forwards that score and take
    logprobs, and the PPO loss; the ranks side by side, the batch shared by the processes."""
    rollout = core.ceil_div(hparams.ppo.batch_size, ranks.num_processes())
    tokens, responses = hparams.task.query_length + hparams.task.response_length, hparams.task.response_length
    return [Pass('sample', rollout, tokens, 1), Pass('forward', rollout, tokens, responses),
            Pass('train', core.ceil_div(rollout, hparams.ppo.nminibatches), tokens, responses)]
