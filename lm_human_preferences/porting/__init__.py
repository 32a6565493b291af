"""Ours: the porting review tools, beside the runtime package (nothing that runs imports them): porting_map.py, the
map from the original to the port as data (PORTING.md's tables are printed from it); definition_diff.py, the
original's definitions paired with ours and a line diff in each pair; beside_original.py, the page that sets each
original file beside ours, and the table of their sizes (tests/test_beside_original.py holds its limits)."""
