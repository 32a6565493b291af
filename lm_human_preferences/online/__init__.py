"""Ours: the paper's online loop (loop.py): train_policy retrains the reward model on labels of the policy's
samples, from a program or from people on the labeling page (lm_human_preferences/labeling/), as PPO goes."""
