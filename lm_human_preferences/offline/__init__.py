"""Ours: the offline experiments' engine (experiment.py): the paper's pipeline on a CPU in minutes, nothing
downloaded. The experiments themselves are demo/ and sentiment_mini/."""
