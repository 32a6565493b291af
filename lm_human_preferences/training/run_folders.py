"""Ours: a run's folders: what a save dir holds (its lock, held by the process that carries rank 0, so that two runs
never write one save dir: utils/folder_lock.py); the run folder a path is in.

What a save dir holds for a trainer (<scope> is `reward_model` or `policy`):

    <save_dir>/.lock                         held (flock) by the process that carries rank 0
    <save_dir>/<kind>_hparams.json           the run's hparams (a rerun with other values is refused)
    <save_dir>/<kind>_data.json              which labels and queries it used (a rerun on others: refused)
    <save_dir>/<kind>_stats.jsonl            one JSON line per logged step
    <save_dir>/tb/<scope or ppo>/            TensorBoard events
    <save_dir>/<kind>_curves.png             learning curves, at the end
    <save_dir>/<scope>/checkpoints/          model checkpoints, the last run.keep_checkpoints kept
    <save_dir>/<scope>/train_state/          training states for resuming (training/state_files.py)
"""

import os

from lm_human_preferences.training import state_files


# Each trainer's folder in the save dir, its model dir.
SCOPES = dict(train_reward='reward_model', train_policy='policy')


def run_folder_of(path):
    """The run's folder that holds path (path itself or a folder above it: a save dir, holding a trainer's
    <kind>_hparams.json, or a model dir, holding train_state/) and what shows it, or None."""
    path = os.path.realpath(path)
    while True:
        for mark in [f'{kind}_hparams.json' for kind in SCOPES] + [state_files.TRAIN_STATE_SUBDIR]:
            if os.path.exists(os.path.join(path, mark)):
                return path, mark
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)
