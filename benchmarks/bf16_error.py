#!/usr/bin/env python3
"""The bf16 mode's error against fp32 mode on the same rollouts: per token |delta logprob| (mean, max) of the
policy, and the KL the adaptive controller sees (the mean over episodes of sum(logprob - ref logprob)).

The rollouts are the policy's own samples (fp32), scored three ways by the same bf16 forward (blocks, attention
in bf16) with three n_vocab projections: fp32 products, this device's fast products (bf16.fast_fp32_matmuls:
TF32 on CUDA, oneDNN's bf16 mode on a CPU with native bf16), and TF32 emulated (inputs rounded to 10 mantissa
bits, fp32 products: what an NVIDIA GPU computes, measured on any machine).

    python benchmarks/bf16_error.py --save_dir RUN_DIR   # a train_policy run: its policy against its initial model
    python benchmarks/bf16_error.py                      # random GPT-2 124M-shaped pair, logits sharpened
    python benchmarks/bf16_error.py --preset tiny --json out.json

No test asserts its numbers; tests/test_bf16.py checks the 1 % KL bound on a small model.
"""
import argparse
import json
import os

import torch

from common import GPT2_124M, device, machine_info, random_trained_model

from lm_human_preferences import lm_tasks, train_policy
from lm_human_preferences.language import bf16, trained_models
from lm_human_preferences.policy import Policy
from lm_human_preferences.utils import passes

TINY = dict(n_vocab=50257, n_ctx=128, n_embd=64, n_head=2, n_layer=2)


def round_to_tf32(x):
    """x (fp32) with its mantissa rounded to TF32's 10 bits, to nearest even."""
    i = x.contiguous().view(torch.int32)
    return ((i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF).view(torch.float32)


def policies_from_run(save_dir):
    hparams = train_policy.HParams()
    hparams.override_from_json_file(os.path.join(save_dir, 'train_policy_hparams.json'))
    trained = trained_models.TrainedModel(name='policy', savedir=os.path.join(save_dir, 'policy'), scope='policy')
    initial = trained_models.TrainedModel(hparams.task.policy.initial_model)
    encoder = initial.encoding.get_encoder()
    make = lambda m: Policy(m, embed_queries=lm_tasks.query_formatter(hparams.task, encoder),
                            temperature=hparams.task.policy.temperature).to(device())
    sampler = lm_tasks.make_query_sampler(hparams=hparams.task, encoder=encoder, batch_size=64, mode='test')
    return make(trained), make(initial), lambda: sampler()['tokens'].to(device()), hparams.task.response_length


def random_policies(shape, query_length, response_length):
    def make(seed):
        torch.manual_seed(seed)
        policy = Policy(random_trained_model(shape)).to(device())
        with torch.no_grad():
            policy.model.wte.mul_(10)  # logits of a few units, as a trained model's
        return policy
    queries = lambda: torch.randint(0, shape['n_vocab'], (64, query_length), device=device())
    return make(0), make(1), queries, response_length


def logprobs(policy, queries, responses, projection):
    """The policy's logprobs of responses under bf16 autocast, with the given n_vocab projection."""
    with torch.no_grad(), passes.autocast(True, device()):
        if projection == 'fp32 mode':
            with passes.autocast(False, device()):
                return policy.analyze_responses(queries, responses)['logprobs']
        if projection == 'this device':
            return policy.analyze_responses(queries, responses)['logprobs']
        original = bf16._fast_fp32_precision
        bf16._fast_fp32_precision = lambda device_type: None  # fp32 products
        try:
            if projection == 'fp32 products':
                return policy.analyze_responses(queries, responses)['logprobs']
            rounded = bf16._LogprobsEntropies.apply
            bf16._LogprobsEntropies.apply = lambda h, w, *rest: rounded(round_to_tf32(h), round_to_tf32(w), *rest)
            try:
                return policy.analyze_responses(queries, responses)['logprobs']
            finally:
                bf16._LogprobsEntropies.apply = rounded
        finally:
            bf16._fast_fp32_precision = original


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--save_dir', help='a train_policy run (its policy against its initial model)')
    p.add_argument('--preset', choices=('gpt2', 'tiny'), default='gpt2', help='without --save_dir: the shape')
    p.add_argument('--batches', type=int, default=4, help='batches of 64 rollouts')
    p.add_argument('--json')
    args = p.parse_args()
    if args.save_dir:
        policy, ref, queries, length = policies_from_run(args.save_dir)
        what = f'{args.save_dir}: its policy against its initial model'
    else:
        policy, ref, queries, length = random_policies(GPT2_124M if args.preset == 'gpt2' else TINY, 64, 24)
        what = f'two random {args.preset} models (logits sharpened), query 64, response 24'
    projections = ('fp32 mode', 'fp32 products', 'this device', 'TF32 emulated')
    got = {name: [] for name in projections}
    ref_logprobs = []
    for _ in range(args.batches):
        q = queries()
        with torch.no_grad():
            responses = policy.respond(q, length=length)['responses']
            ref_logprobs.append(ref.analyze_responses(q, responses)['logprobs'])  # fp32: one reference for all
        for name in projections:
            got[name].append(logprobs(policy, q, responses, name))
    ref_logprobs = torch.cat(ref_logprobs)
    got = {k: torch.cat(v) for k, v in got.items()}
    kl = {k: (v - ref_logprobs).sum(dim=1).mean().item() for k, v in got.items()}
    rows = []
    print(f'{what}; {len(ref_logprobs)} episodes, {machine_info()["cuda"] or machine_info()["cpu"]}')
    print(f'{"bf16 mode, n_vocab products":<30} {"mean |dlogp|":>13} {"max |dlogp|":>12} {"KL":>9} {"KL vs fp32":>11}')
    print(f'{"fp32 mode":<30} {"":>13} {"":>12} {kl["fp32 mode"]:>9.4f}')
    for name in projections[1:]:
        d = (got[name] - got['fp32 mode']).abs()
        row = dict(projection=name, mean_abs_dlogprob=d.mean().item(), max_abs_dlogprob=d.max().item(), kl=kl[name],
                   kl_relative=kl[name] / kl['fp32 mode'] - 1)
        rows.append(row)
        print(f'{name:<30} {row["mean_abs_dlogprob"]:>13.2e} {row["max_abs_dlogprob"]:>12.2e} {kl[name]:>9.4f} '
              f'{100 * row["kl_relative"]:>+10.2f}%')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(what=what, machine=machine_info(), kl_fp32=kl['fp32 mode'], rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
