"""Ours: the map from the original (openai/lm-human-preferences) to the port, as data.

beside_original.py reads it to pair each original definition with ours; PORTING.md's module map, table of
renamed names and list of what was not ported are generated from it (`python -m
lm_human_preferences.porting.porting_map` prints them; tests/test_beside_original.py checks PORTING.md holds them
as printed).
"""

# The mirrored files: (the original's path, ours, what ours adds or changes).
MIRRORED = [
    ('launch.py', 'launch.py',
     "the same experiments and values (+ `test`, `demo`, `sentiment_mini`); `rewards.whiten` bug fixed; what its "
     "commands add (the run name's check, default ranks, one seed, `--help`, `label`, `export_labels`) is "
     "`lm_human_preferences/launch_commands.py`'s"),
    ('sample.py', 'sample.py',
     "the same `sample` command (+ `export` to Hugging Face, `plot`, `best_of_n`; `sample`'s checks: "
     "`lm_human_preferences/sample_commands.py`)"),
    ('lm_human_preferences/train_reward.py', 'lm_human_preferences/train_reward.py',
     "+ held-out accuracy (`training/reward_evaluation.py`), resume; the label files' checks and tensors "
     "(`training/label_files.py`), the loss over the ranks side by side (`training/reward_loss.py`)"),
    ('lm_human_preferences/train_policy.py', 'lm_human_preferences/train_policy.py',
     'PPO math factored into `compute_rewards`, `compute_advantages`, `ppo_loss` so it is unit-testable; + resume'),
    ('lm_human_preferences/rewards.py', 'lm_human_preferences/rewards.py',
     "`TrainedRewardModel` subclasses `RewardModelTrainer` (the original's TODO)"),
    ('lm_human_preferences/policy.py', 'lm_human_preferences/policy.py',
     "+ `Policy.for_task`, the one constructor of a task's policy (the original wrote it out four times)"),
    ('lm_human_preferences/lm_tasks.py', 'lm_human_preferences/lm_tasks.py', ''),
    ('lm_human_preferences/label_types.py', 'lm_human_preferences/label_types.py', '+ `validate_labels`'),
    ('lm_human_preferences/language/model.py', 'lm_human_preferences/language/model.py',
     'nn.Module; parameter names are the TF variable names'),
    ('lm_human_preferences/language/sample.py', 'lm_human_preferences/language/sample.py',
     'KV cache written in place'),
    ('lm_human_preferences/language/encodings.py', 'lm_human_preferences/language/encodings.py',
     "GPT-2 BPE through tiktoken (same ids), from GPT-2's two files shipped in `language/gpt2_bpe/`"),
    ('lm_human_preferences/language/trained_models.py', 'lm_human_preferences/language/trained_models.py',
     '+ our safetensors checkpoints, converted on first use; the other model names (Hugging Face, offline '
     'experiments, URLs): `language/model_sources.py`'),
    ('lm_human_preferences/language/datasets.py', 'lm_human_preferences/language/datasets.py',
     '+ `local:<dir>` datasets; the prepared queries, cached (`language/query_cache.py`), and the per-rank query '
     'streams (`language/query_streams.py`)'),
    ('lm_human_preferences/datasets/books.py', 'lm_human_preferences/datasets/books.py',
     'public sources (PORTING.md: datasets); + `local.py`'),
    ('lm_human_preferences/datasets/cnndm.py', 'lm_human_preferences/datasets/cnndm.py', 'public sources'),
    ('lm_human_preferences/datasets/tldr.py', 'lm_human_preferences/datasets/tldr.py', 'public sources'),
    ('lm_human_preferences/utils/core.py', 'lm_human_preferences/utils/core.py',
     "graph/MPI machinery replaced by torch; the original's functions in its order, ours after them"),
    ('lm_human_preferences/utils/hyperparams.py', 'lm_human_preferences/utils/hyperparams.py', ''),
    ('lm_human_preferences/utils/combos.py', 'lm_human_preferences/utils/combos.py', ''),
    ('lm_human_preferences/utils/launch.py', 'lm_human_preferences/utils/launch.py',
     '`torch.distributed` workers instead of `mpiexec` (`utils/workers.py`); our command line instead of `fire` '
     '(`utils/command_line.py`)'),
    ('lm_human_preferences/utils/gcs.py', 'lm_human_preferences/utils/gcs.py',
     'https downloads with `requests` (file writing: `utils/files.py`)'),
]

# The module map's other rows: (the original's, ours, what), as PORTING.md shows them.
OTHER_MODULES = [
    ('`lm_human_preferences/{language,utils}/test_*.py`, `test_train_*.py`', '`tests/test_*.py`',
     'every original case ported, plus parity, DDP, resume and bad-input tests'),
    ('—', '`lm_human_preferences/language/convert_tf.py`, `saved_models/prepare_pytorch_checkpoint.py`',
     'new: TF checkpoint converter'),
    ('—', '`lm_human_preferences/training/run.py`',
     "new: a trainer's run in its save dir (hparams, data record, resume and save, a stop signal's save, "
     "summary); `training/` is the run layer both trainers share, above `language/`"),
    ('—', '`lm_human_preferences/training/run_folders.py`, `stats_log.py`, `progress.py`',
     "new: what a save dir holds and the run folder a path is in; the stats sinks (table, TensorBoard, JSONL, "
     "wandb) and their rewind rule; the progress lines"),
    ('—', '`lm_human_preferences/training/train_state.py`, `state_files.py`',
     'new: resumable training states (what a state holds, saved and restored); their files (the format, atomic '
     'writes, checksums, the newest valid state)'),
    ('—', '`lm_human_preferences/training/run_compatibility.py`',
     "new: whether a rerun is the same run as the save dir's (its hparams but those a rerun may change)"),
    ('—', '`lm_human_preferences/training/execution.py`',
     "new: the port's own `run.*` fields (`PortRunHParams`) and `Execution.prepare`: bf16, the CUDA graph and the "
     "microbatch size resolved once"),
    ('—', '`lm_human_preferences/training/memory.py`',
     "new: the memory a run's passes need (calibrated on `benchmarks/memory.py`), for `run.microbatch_size auto`"),
    ('—', '`lm_human_preferences/training/run_checks.py`',
     "new: the checks across hparams objects or ranks (each class checks its own fields), one line each at launch"),
    ('—', '`lm_human_preferences/training/label_files.py`',
     "new: train_reward's label files read, checked, fingerprinted, stacked"),
    ('—', '`lm_human_preferences/training/reward_loss.py`, `reward_evaluation.py`',
     "new: the reward model's loss over the ranks side by side, in microbatches; its held-out loss and accuracy"),
    ('—', '`lm_human_preferences/training/side_by_side.py`',
     'new: the ranks a process carries as the trainers see them (views by rank, per-rank shuffles, float64 means '
     'over ranks, per-rank gradients)'),
    ('—', '`lm_human_preferences/training/adam.py`, `plots.py`', 'new: `AdamTF`; learning curves'),
    ('—', '`lm_human_preferences/utils/ranks.py`',
     'new: ranks carried by processes (`--mpi N --procs P`: per-rank sections and random streams); the one '
     'spelling of ranks (`get_rank`, `get_world_size`, `is_root`, `local_ranks`, `for_each_rank`, `concat_ranks`)'),
    ('—', '`lm_human_preferences/utils/distributed.py`',
     "new: torch.distributed's collectives over processes, which `core`'s MPI functions are written with"),
    ('—', '`lm_human_preferences/utils/stopping.py`, `files.py`, `folder_lock.py`, `optional_deps.py`',
     "new: stop signals (the launcher's and the run's); atomic writes and their killed writers' temporaries removed, "
     "the pickle guard; a folder's lock (a save dir's, a labeling session's); optional dependencies"),
    ('—', '`lm_human_preferences/utils/categorical.py`',
     "new: TF's Multinomial algorithm for `core.sample_from_logits`; logprobs and entropies in one pass"),
    ('—', '`lm_human_preferences/utils/passes.py`',
     'new: how a model pass runs: in microbatches of at most `run.microbatch_size` rows, under bf16 autocast'),
    ('—', '`lm_human_preferences/utils/stats_table.py`', 'new: the table of stats `core.record_stats` prints'),
    ('—', '`lm_human_preferences/utils/finite.py`',
     'new: the non-finite guards (`check_finite`): a NaN loss, gradient or reward stops a run before it is applied'),
    ('—', '`lm_human_preferences/language/checkpoints.py`',
     'new: our model checkpoint format (checksummed safetensors), split from `trained_models.py`'),
    ('—', '`lm_human_preferences/language/bf16.py`',
     'new: what the bf16 mode runs differently, for speed; fp32 mode never reaches it'),
    ('—', '`lm_human_preferences/language/hf_gpt2.py`, `hf_export.py`, `hf_import.py`',
     "new: our GPT-2 beside transformers' (`hf_gpt2`: the name table, config and state conversion both use), the "
     'Hugging Face export, a Hugging Face GPT-2 as a starting model'),
    ('—', '`lm_human_preferences/demo/`',
     'new: the offline demo in its own package (its engine is `offline/`)'),
    ('—', '`lm_human_preferences/offline_experiments.py`',
     "new: the launcher's table of the offline experiments, which `launch.py`, `sample.py` and their commands read; "
     'each experiment declares its model and labeler by name to the layers below (`OfflineExperiment.declare`)'),
    ('—', '`lm_human_preferences/sentiment_mini/`',
     'new: the sentiment task in miniature (two public-domain books, VADER as the labeler)'),
    ('—', '`lm_human_preferences/labeling/`',
     'new: labels from people, which the original could not collect (docs/labeling.md)'),
    ('—', '`lm_human_preferences/online/loop.py`, `labeling/online_hparams.py`',
     "new: the paper's online loop (`train_policy --online.retrains K`), which the original did not ship: above "
     "both trainers, a callback on train_policy's loop (`training/callbacks.py`); its settings, train_policy's "
     "`online.*`"),
    ('—', '`lm_human_preferences/porting/beside_original.py`, `definition_diff.py`, `porting_map.py`',
     "new, the porting review tools (no runtime module imports them): the page that sets the original beside ours, "
     "the pairs of definitions and their diffs, and this map"),
    ('—', '`benchmarks/`', 'new: throughput, ops dispatched, memory by phase, AdamTF'),
    ('—', '`pyproject.toml`, `lm_human_preferences/utils/optional_deps.py`',
     'new: `pip install -e .`; TensorFlow (`[tf]`, the converter only) and wandb (`[wandb]`) are extras'),
]

# The original's definitions that took another name in our file of them, or moved to another file
# ('path:Name'). A closure that keeps its name as a method of its class, or as a function of our file, needs no
# row (beside_original.PortingMap.target).
RENAMES = {
    ('lm_human_preferences/datasets/books.py', 'books_generator'): 'books_texts',
    ('lm_human_preferences/datasets/cnndm.py', 'cnndm_generator'): 'cnndm_texts',
    ('lm_human_preferences/datasets/tldr.py', 'tldr_generator'): 'tldr_texts',
    ('lm_human_preferences/language/datasets.py', 'Dataset.tf_dataset'): 'Dataset.torch_dataset',
    ('lm_human_preferences/language/encodings.py', 'ReversibleEncoder'): 'MainEncoder',
    ('lm_human_preferences/language/encodings.py', 'ReversibleEncoder.__init__'): 'MainEncoder.__init__',
    ('lm_human_preferences/language/encodings.py', 'ReversibleEncoder.encode'): 'MainEncoder.encode',
    ('lm_human_preferences/language/encodings.py', 'ReversibleEncoder.decode'): 'MainEncoder.decode',
    ('lm_human_preferences/language/model.py', 'conv1x1'): 'Conv1x1.forward',
    ('lm_human_preferences/language/model.py', 'attn'): 'Attention.forward',
    ('lm_human_preferences/language/model.py', 'mlp'): 'MLP.forward',
    ('lm_human_preferences/language/model.py', 'block'): 'Block.forward',
    ('lm_human_preferences/language/model.py', 'Model.__call__'): 'Model.forward',
    ('lm_human_preferences/language/trained_models.py', 'TrainedModel.init_op'): 'TrainedModel.init_model',
    ('lm_human_preferences/language/trained_models.py', 'load_hparams'):
        'lm_human_preferences/language/checkpoints.py:load_hparams',
    ('lm_human_preferences/policy.py', 'Policy.respond_op'): 'Policy.respond',
    ('lm_human_preferences/policy.py', 'Policy.analyze_responses_op'): 'Policy.analyze_responses',
    ('lm_human_preferences/rewards.py', 'RewardModelTrainer.get_rewards_op'): 'RewardModelTrainer.get_rewards',
    ('lm_human_preferences/utils/core.py', '_our_gpu'): 'get_device',
    ('lm_human_preferences/utils/core.py', 'variable_synchronizer'): 'sync_params',
    ('lm_human_preferences/utils/core.py', 'minimize'): 'mpi_allreduce_mean_grads',
    ('lm_human_preferences/utils/gcs.py', 'exponential_backoff'): '_fetch',
}

# The original's definitions with no counterpart in ours: {original path: {why: [names]}}.
NOT_PORTED = {
    'lm_human_preferences/train_reward.py': {
        'unused by the original': ['round_down_to_multiple'],
        "TF graph plumbing: `core.sync_params` is called in `train` itself": ['train.<locals>.sync_models'],
    },
    'lm_human_preferences/train_policy.py': {
        "TF timer variables: `elapsed/*` from `time.time()`, kept in `PPOTrainer.__init__` and `step`":
            ['tf_times', 'tf_times.<locals>.make'],
        'a lambda in `PPOTrainer.__init__`, over the counted sampler that a resumed run continues':
            ['PPOTrainer.__init__.<locals>.sample_queries'],
        "graph_function wrappers: ours calls `postprocess` and `score_model.score_fn` in `score_fn` itself":
            ['make_score_fn.<locals>.postprocess', 'make_score_fn.<locals>.unpenalized_score_fn'],
        "TF graph plumbing: `core.sync_params` is called in `train` itself": ['train.<locals>.sync_models'],
    },
    'lm_human_preferences/rewards.py': {
        "TF's lazy graph building and variable scopes: an nn.Module is built in `__init__`, its parameters are "
        "`.parameters()`":
            ['RewardModelTrainer._build', 'RewardModelTrainer.ensure_built', 'RewardModelTrainer.get_params',
             'RewardModelTrainer._set_initializers'],
        "the same, and the trained one is loaded by `TrainedModel.init_model`":
            ['TrainedRewardModel._build', 'TrainedRewardModel.ensure_built', 'TrainedRewardModel._set_initializers',
             'TrainedRewardModel.get_params'],
    },
    'lm_human_preferences/policy.py': {
        "TF's lazy graph building and variable scopes: an nn.Module is built in `__init__`, its parameters are "
        "`.parameters()`": ['Policy.ensure_built', 'Policy.get_params', 'Policy._set_initializers'],
    },
    'lm_human_preferences/language/model.py': {
        'unused by the original': ['parse_comma_separated_int_list'],
        'dropout plumbing: the original trained and sampled without dropout (`do_dropout` False everywhere)':
            ['dropout', 'dropout.<locals>._dropout'],
        "attention by `F.scaled_dot_product_attention` with an additive mask built once per call (PORTING.md: "
        "`multihead_attn`)": ['softmax', 'attn.<locals>.mask_attn_weights', 'attn.<locals>.multihead_attn'],
        'the heads split and merged by `view`/`transpose` in `Attention.forward`':
            ['split_states', 'merge_states', 'attn.<locals>.split_heads', 'attn.<locals>.merge_heads'],
        'graph plumbing: torch has no gradient-to-tensor conversion, and `nn.Embedding` / `F.linear` do the rest; '
        'heads are a `ScalarHead`':
            ['convert_gradient_to_tensor', 'embed', 'tensordot', 'fc_layer'],
        'the KV cache (`KVCache`) keeps its shape and the positions of its tokens (`Model.forward`)':
            ['past_shape', 'positions_for'],
        "TF's stateless seeds: torch draws from a generator": ['split_seed'],
        '`.parameters()` of the nn.Module': ['Model.get_params'],
    },
    'lm_human_preferences/language/sample.py': {
        "the default `cond` of TF's while loop: ours loops `length` steps": ['sample_sequence.<locals>.always_true'],
    },
    'lm_human_preferences/language/encodings.py': {
        "GPT-2's BPE through tiktoken (the same ids, tested against a reimplementation of the original's)":
            ['bytes_to_unicode', 'get_pairs', 'ReversibleEncoder.bpe'],
        "GPT-2's two encoding files are shipped in `language/gpt2_bpe/`, read with `open`": ['read_file'],
    },
    'lm_human_preferences/language/datasets.py': {
        '`tf.data.Dataset.from_generator` plumbing: `Dataset.torch_dataset` reads the prepared queries':
            ['Dataset.tf_dataset.<locals>._generator'],
    },
    'lm_human_preferences/datasets/cnndm.py': {
        "unused by the original's generator": ['read_text_file', 'fix_missing_period', 'get_art_abs'],
    },
    'lm_human_preferences/utils/core.py': {
        'one GPU per rank chosen by LOCAL_RANK (`get_device`); no TF session':
            ['nvidia_gpu_count', 'get_local_rank_size', 'gpu_devices', 'gpu_count', 'mpi_session_config',
             'mpi_session', 'variables_on_gpu', 'variables_on_gpu.<locals>.device'],
        'torch does these natively, or the original never used them':
            ['add_batch_dim', 'add_batch_dim.<locals>.add_dim', 'SampleBuffer.write', 'SampleBuffer.write_add',
             'where', 'map_flat_chunked', 'map_flat_bits', 'map_flat_bits.<locals>.maybe_bitcast',
             'mpi_bcast_tensor_dict', 'mpi_read_file', 'shape_list'],
        "the collective itself: torch.distributed's all_reduce": ['mpi_allreduce_sum.<locals>._allreduce'],
        "TF graphs and placeholders: ours are eager functions on tensors, their parameters a module's":
            ['find_trainable_variables', 'graph_function', 'graph_function.<locals>.decorate',
             'graph_function.<locals>.decorate.<locals>.make_ph', 'graph_function.<locals>.decorate.<locals>.run'],
        "the stats' table and TensorBoard are written in `record_stats` itself": ['record_stats.<locals>.log_stats'],
    },
    'lm_human_preferences/utils/gcs.py': {
        'retries by `_fetch` (timeouts, connection errors, 5xx/408/429), not by a decorator':
            ['exponential_backoff.<locals>.decorate', 'exponential_backoff.<locals>.decorate.<locals>.f_retry',
             '_gcs_should_retry_on'],
        'GCS only: ours downloads over https': ['parse_url', 'get_blob', 'download_contents', 'upload_contents',
                                                'download_directory_cached'],
    },
    'lm_human_preferences/utils/hyperparams.py': {
        "a field's type is looked up in `HParams._get_path`": ['_get_field'],
    },
    'lm_human_preferences/utils/launch.py': {
        'trials run one after another (only local mode existed)': ['parallel'],
        "`fire`'s command class: our parser (`utils/command_line.py`) takes the commands' dict":
            ['main.<locals>._Commands'],
    },
    'sample.py': {
        "graph_function wrapper: `Policy.respond` is called on the sampler's queries": ['sample_policy.<locals>.sample_queries'],
    },
}


def _code(path):
    return f'`{path}`'


def markdown():
    """PORTING.md's module map, renamed names and not-ported tables, as this map holds them."""
    out = ['| original | ours | notes |', '| --- | --- | --- |']
    for original, ours, notes in MIRRORED:
        out.append(f'| {_code(original)} | {"same" if ours == original else _code(ours)} | {notes} |')
    out += [f'| {original} | {ours} | {notes} |' for original, ours, notes in OTHER_MODULES]
    out += ['', '| original file | original name | ours |', '| --- | --- | --- |']
    out += [f'| {_code(path)} | {_code(name)} | {_code(ours)} |' for (path, name), ours in RENAMES.items()]
    out += ['', '| original file | not ported | why |', '| --- | --- | --- |']
    for path, by_reason in NOT_PORTED.items():
        for why, names in by_reason.items():
            out.append(f'| {_code(path)} | {", ".join(_code(n) for n in names)} | {why} |')
    return '\n'.join(out)


if __name__ == '__main__':
    print(markdown())
