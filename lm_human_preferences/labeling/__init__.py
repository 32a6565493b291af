"""Ours: labels from people, which the original could not collect (its labels came from a vendor's labelers).

- questions.py: the questions, a query and a policy's responses that pass the task's truncation filter
  (forms: one policy's, or the paper's validation form, initial model against trained policy);
- session.py: the one way a session is made (the question asked, its texts' settings), for both users below;
- store.py: a labeling session on disk, every answer kept as it is given, the labels in the original's format;
  session_log.py: its two logs (questions, answers) and their recovery after a kill;
- schedule.py: who is asked what (the leases, each labeler's next question); errors.py: what a session refuses;
- session_stats.py: a session's statistics (progress, agreement, the trained policy's wins, each labeler's pace);
- online_hparams.py: the online loop's settings (train_policy's `online.*`; the loop: lm_human_preferences/online/);
- server.py and page/: the labeling page in a browser and its JSON API (several labelers at once);
- command.py: `python launch.py label EXPERIMENT NAME`;
- export.py: `python launch.py export_labels DIR --out HF_DIR`, the labels as TRL's preference pairs.

The paper's online loop (the reward model retrained on labels of the policy's samples as PPO goes) uses the
same questions and sessions: lm_human_preferences/online/.
"""
