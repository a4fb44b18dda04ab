"""Data between and into stages: the batch contract (`batch`: Arrow rows ⇄ padded tensors, row operations,
Karmarkar–Karp balancing), pandera stage schemas (`schemas`), the checks of a user's dataset file
(`dataset_checks`), and datasets with the prompt sampler (`datasets`).
"""
