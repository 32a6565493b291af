"""Ours: the run layer, what both trainers share beyond the original's code. A run in its save dir (run.py:
locking, resuming, stats, curves, Ctrl-C), its training states (checkpointing.py), its memory plan (memory.py),
its execution settings (execution.py), its learning curves (plots.py) and the ranks side by side (ranks.py)."""
