"""Ours: the run layer, what both trainers share beyond the original's code: a run in its save dir (run.py: locking,
resuming, stats, curves, a stop signal), its training states (train_state.py; their files: state_files.py), whether
a rerun is the same run (run_compatibility.py), how it executes (execution.py: bf16, the CUDA graph, the microbatch
size; memory.py plans the last), the ranks side by side (side_by_side.py), TF1's Adam (adam.py) and the learning
curves (plots.py)."""
