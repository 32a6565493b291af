"""The offline demo (ours): `python launch.py train_policy demo NAME` runs the paper's pipeline on a CPU in
minutes, with nothing downloaded (see commands.py). Its story, dataset and pretrained model live here, so
that nothing else in the library knows the name 'demo'."""

from lm_human_preferences.demo.commands import train_policy, train_reward  # noqa: F401  (launch.py's entry points)
