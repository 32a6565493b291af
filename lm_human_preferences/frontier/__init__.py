"""Ours: the reward-KL frontier of an offline experiment (`python launch.py frontier sentiment_mini`), the comparison
the paper draws in its Figure 3: each way of using the same labels, run at several KL budgets on several seeds,
scored by the labeler (VADER's gain in standard deviations of the initial policy's scores) against the KL from
the initial policy.

The arms, each on a seed's initial model, labels and labels budget (labels.num_train: sweep.NUM_TRAIN's
for the miniature, 16,384, else the experiment's):
    ppo        offline PPO: the seed's reward model, trained once (seed<S>/reward), a fixed kl_coef the knob
    online     the paper's online loop (--online.retrains 3): a quarter of the labels first, the rest over 3 rounds
               asked of the labeler about the policy's samples; its own reward model; a fixed kl_coef the knob
    best_of_n  the best of n samples of the initial policy by the seed's reward model; KL: the bound log n - (n-1)/n
    dpo        TRL's DPOTrainer on the seed's labels (a best-of-4 label: 3 pairs), from the initial model exported
               as a Hugging Face folder, imported back and scored as PPO's policies are; beta the knob

sweep.py runs them (resumable, one progress line a run), dpo.py is the TRL round trip, evaluate.py scores a policy,
table.py writes the table, the plot and the gains at a KL budget from the runs' results.
"""
