"""The modes of `bench/bench_rollout.py`, one module each, and what they share (`common`).

`bench_rollout.py` puts bench/ on the import path (it is the script's folder), so these import as `rollout.*`.
"""
