"""Ours: DPO on an offline experiment's labels through TRL's DPOTrainer (Rafailov et al. 2023; TRL, a well-kept
implementation that is not ours), for the frontier's `dpo` arm. The round trip a TRL user makes:

1. the seed's initial model exported as a Hugging Face GPT-2 folder (language/hf_export.py, `sample.py export`);
2. the labels in TRL's preference format (prompt, chosen, rejected), as `launch.py export_labels` writes a labeling
   session's (labeling/export.py's label_pairs: a best-of-4 label is three pairs);
3. DPOTrainer, its reference model the initial one (TRL's copy), resumed from its last checkpoint after a stop;
4. the trained folder read back as any Hugging Face GPT-2 (language/hf_import.py: `--task.policy.initial_model
   HF_DIR`), and scored as PPO's policies are (evaluate.py).

TRL and transformers are imported here only: `pip install -e .[baselines]`."""

import contextlib
import dataclasses
import json
import math
import os

import torch

from lm_human_preferences import lm_tasks
from lm_human_preferences.labeling import export, store
from lm_human_preferences.language import encodings
from lm_human_preferences.utils import core as utils
from lm_human_preferences.utils import files, optional_deps

# DPO's optimizer settings: one pass over the pairs, as the reward model makes one over the labels. The rate is the
# reward model's and PPO's order for a model this small (GPT-2 124M's DPO rates are ~5e-7).
LEARNING_RATE = 1e-4
BATCH_SIZE = 64  # pairs a step
EPOCHS = 1
SAVE_STEPS = 100  # a stopped run resumes from its last checkpoint
LOG_STEPS = 1  # every step's loss and pair accuracy: the last tenth of a run's (training_summary)
TRAINED = 'trained.json'  # written once the trained model is saved: the folder is whole
# TRL's fused LM head, on a device without Triton (a CPU), scores the vocabulary in tiles of 4096 tokens x 32768
# entries: ~0.4 GB of fp32 on the miniature that each of its dozen elementwise passes reads from memory. Tiles of a
# core's L2 (256 x 512, 0.5 MB) do the same sums 3.3x faster there (a DPO step 13.8 -> 4.2 s, one thread of a Zen 4):
# TRL's arithmetic, only the vocabulary's chunks folded into its running logsumexp in another grouping (~1e-7).
CPU_TILE = (256, 512)  # (tokens, vocabulary entries)


def preference_rows(records, task, encoding, label_type):
    """{prompt, chosen, rejected} lists of best_of_N / scalar_compare label records (the original's JSON format,
    token ids) as texts, the prompt with the task's query prefix and suffix, as labeling/export.py writes them; and
    {pairs kept as labelled, flipped, dropped} under the objective PPO maximizes (objective_pair)."""
    encoder = encodings.get(encoding).get_encoder()
    sample_keys, label_key = store.sample_keys(label_type), store.label_key(label_type)
    passes = lm_tasks.filter_fn_from_hparams(task)
    rows, counts = dict(prompt=[], chosen=[], rejected=[]), dict(kept=0, flipped=0, dropped=0)
    for record in records:
        prompt = task.query_prefix + encoder.decode(record['query']) + task.query_suffix
        for better, worse in export.label_pairs(label_key, sample_keys, record):
            pair, outcome = objective_pair(better, worse, passes=lambda key: bool(passes(torch.tensor([record[key]]))))
            counts[outcome] += 1
            if pair is None:
                continue
            rows['prompt'].append(prompt)
            rows['chosen'].append(encoder.decode(record[pair[0]]))
            rows['rejected'].append(encoder.decode(record[pair[1]]))
    return rows, counts


def objective_pair(better, worse, *, passes):
    """The labelled pair (better, worse) under PPO's score (train_policy.make_score_fn: the reward model's score, or
    penalty_reward_value for a response that fails the task's filter), as best-of-n picks (evaluate.py): a response
    that fails the filter loses to one that passes whatever the label says ('flipped'); two that fail score the same
    penalty, no preference ('dropped'); two that pass keep the label's order ('kept'). passes(key): the sample's
    verdict (the records hold postprocessed samples, which the filter judges as PPO's score does). Returns ((chosen,
    rejected) or None, outcome)."""
    better_passes, worse_passes = passes(better), passes(worse)
    if better_passes:
        return (better, worse), 'kept'
    if worse_passes:
        return (worse, better), 'flipped'
    return None, 'dropped'


def check_installed():
    """One line, before any work, when TRL (the `baselines` extra) is missing."""
    optional_deps.require('trl', extra='baselines',
                          needed_for="the frontier's dpo arm (TRL's DPOTrainer; or leave it out: --arms ppo,online,best_of_n)")


def dpo_config(**wanted):
    """TRL's DPOConfig with the fields of `wanted` that this TRL version has (its fields come and go between
    versions: max_prompt_length, for one, is gone from TRL 1.x); beta and the optimizer's must be there."""
    from trl import DPOConfig
    fields = {f.name for f in dataclasses.fields(DPOConfig)}
    missing = [name for name in ('beta', 'learning_rate', 'per_device_train_batch_size', 'output_dir')
               if name not in fields]
    if missing:
        import trl
        raise ValueError(f"TRL {trl.__version__}'s DPOConfig has no {', '.join(missing)}: the frontier's dpo arm "
                         f"needs a TRL whose DPOConfig does (pyproject.toml's baselines extra names the one tested)")
    if 'activation_checkpointing' in fields and 'gradient_checkpointing' in wanted:  # transformers 5's new name
        wanted['activation_checkpointing'] = wanted.pop('gradient_checkpointing')
    return DPOConfig(**{k: v for k, v in wanted.items() if k in fields})


@contextlib.contextmanager
def cpu_tiles(tile=CPU_TILE):
    """TRL's fused LM head scoring in `tile`-sized tiles (its module settings, read at each call), restored after; a
    TRL without them (another version) is left as it is, as is CUDA (TRL's Triton kernels there)."""
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as trl_utils
    names = ((kernel, 'TOKEN_CHUNK_SIZE'), (trl_utils, '_CHUNKED_LOGPROB_CHUNK_SIZE'))
    if utils.get_device().type == 'cuda' or not all(hasattr(module, name) for module, name in names):
        yield
        return
    saved = [getattr(module, name) for module, name in names]
    try:
        for (module, name), size in zip(names, tile):
            setattr(module, name, size)
        yield
    finally:
        for (module, name), size in zip(names, saved):
            setattr(module, name, size)


def optimizer_steps(pairs, batch_size=BATCH_SIZE, epochs=EPOCHS):
    """The optimizer steps of `epochs` passes over `pairs` pairs, as the Trainer counts them (a last short batch is a
    step)."""
    return math.ceil(pairs / batch_size) * epochs


def train(initial_hf, rows, out_dir, work_dir, *, beta, seed, learning_rate=LEARNING_RATE, batch_size=BATCH_SIZE,
          epochs=EPOCHS, steps=None):
    """DPO from the Hugging Face folder initial_hf on rows (preference_rows) at beta, its checkpoints in work_dir, the
    trained model and tokenizer saved into out_dir (a Hugging Face folder); `epochs` passes over the rows, or `steps`
    optimizer steps where given (as many passes as they take). Done already (out_dir/trained.json): nothing to do."""
    if os.path.isfile(os.path.join(out_dir, TRAINED)):
        return
    import datasets
    import transformers
    from transformers.trainer_utils import get_last_checkpoint
    from trl import DPOTrainer
    model = transformers.AutoModelForCausalLM.from_pretrained(initial_hf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(initial_hf)
    if tokenizer.eos_token is None:
        # The `test` encoding's export has no end-of-text token, which DPOTrainer appends to every response: its
        # padding character ('.', the demo's word break) ends them instead.
        tokenizer.eos_token = tokenizer.pad_token
    config = dpo_config(output_dir=work_dir, beta=beta, learning_rate=learning_rate,
                        per_device_train_batch_size=batch_size, num_train_epochs=epochs, seed=seed,
                        max_steps=-1 if steps is None else steps,  # the Trainer's own: it overrides the epochs
                        lr_scheduler_type='linear',  # decayed to 0, as our trainers' rates
                        save_strategy='steps', save_steps=SAVE_STEPS, save_total_limit=1, logging_steps=LOG_STEPS,
                        report_to='none', disable_dropout=True, max_length=model.config.n_positions,
                        gradient_checkpointing=False,  # TRL's default recomputes every forward: memory a small model
                                                       # does not need, for a third more time
                        # fp32 on a CPU, as our runs there (TRL defaults to bf16); bf16 autocast on CUDA, as ours
                        bf16=utils.get_device().type == 'cuda', dataset_num_proc=None,
                        dataloader_pin_memory=utils.get_device().type == 'cuda')
    trainer = DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict(rows),
                         processing_class=tokenizer)
    with cpu_tiles():
        trainer.train(resume_from_checkpoint=get_last_checkpoint(work_dir) if os.path.isdir(work_dir) else None)
    trainer.save_model(out_dir)
    files.atomic_write(os.path.join(out_dir, TRAINED), json.dumps(dict(
        beta=beta, pairs=len(rows['prompt']), steps=trainer.state.global_step,
        **training_summary(trainer.state.log_history))).encode())


def training_summary(log_history):
    """DPO's loss and pair accuracy (TRL's rewards/accuracies: the share of a batch's pairs whose chosen response the
    policy's implicit reward puts above the rejected) over the last tenth of its logged steps, and the last row."""
    logged = [row for row in log_history if 'loss' in row]
    tail = logged[-max(1, len(logged) // 10):]
    def mean(key):
        values = [row[key] for row in tail if key in row]
        return sum(values) / len(values) if values else None
    return dict(final_loss=mean('loss'), final_pair_accuracy=mean('rewards/accuracies'),
                last_logged=logged[-1] if logged else None)
