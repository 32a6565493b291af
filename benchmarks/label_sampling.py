"""The sentiment miniature's label-making batch on a CPU: 4 x Policy.respond of 128 queries of 8 tokens, 16 new
tokens each, at temperature 0.7, on its model's shape (2 layers, width 128, GPT-2's 50,257-token vocabulary; random
weights), the way offline/labels.py samples them (responses only, logprobs=False, and the chunked vocabulary of
language/vocab_sampling.py, where the checkout has them), with the miniature's 2 threads. Prints the seconds a batch
(the best of --repeats) and a sha256 of the tokens, which must be the same for every run of one checkout on one CPU
(the chunked sampler draws the same distribution as the plain one, with other rounding: other tokens).

    python benchmarks/label_sampling.py [--repo DIR] [--repeats 3]
    # before / after, alternating in one slot: run it with --repo OLD_CHECKOUT and without, in turns
"""
import argparse
import hashlib
import os
import sys
import tempfile
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('--repo', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'),
               help='the checkout to import lm_human_preferences from (default: this one)')
p.add_argument('--repeats', type=int, default=3)
p.add_argument('--threads', type=int, default=2)
args = p.parse_args()
sys.path.insert(0, os.path.abspath(args.repo))

import inspect  # noqa: E402

import torch  # noqa: E402

from lm_human_preferences.language import checkpoints, encodings, model, trained_models  # noqa: E402
from lm_human_preferences.policy import Policy  # noqa: E402

torch.set_num_threads(args.threads)
torch.manual_seed(0)
hparams = model.HParams(n_vocab=encodings.Main.n_vocab, n_ctx=96, n_embd=128, n_head=4, n_layer=2)
with tempfile.TemporaryDirectory() as d:
    checkpoints.save_checkpoint(d, 0, model.Model(hparams), hparams=hparams, encoding=encodings.Main)
    policy = Policy(trained_models.TrainedModel(d), embed_queries=lambda q: q, temperature=0.7)
policy.requires_grad_(False)
tokens_only = 'logprobs' in inspect.signature(policy.respond).parameters
chunked = 'chunked_vocab' in inspect.signature(policy.respond).parameters
queries = torch.randint(0, encodings.Main.n_vocab, (128, 8), generator=torch.Generator().manual_seed(1))


def batch():
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(logprobs=False) if tokens_only else {}
    if chunked:
        kwargs['chunked_vocab'] = True
    return torch.cat([policy.respond(queries, 16, generator=generator, **kwargs)['responses'] for _ in range(4)])


batch()  # warm-up
times = []
for _ in range(args.repeats):
    start = time.perf_counter()
    out = batch()
    times.append(time.perf_counter() - start)
digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]
print(f'label batch: {min(times):.3f} s (best of {args.repeats}; {args.threads} threads; '
      f'{"tokens only" if tokens_only else "with logprobs"}{", chunked vocabulary" if chunked else ""}; kernels {torch.backends.cpu.get_cpu_capability()}); '
      f'tokens sha256 {digest}; repo {os.path.abspath(args.repo)}')
