"""Data between and into stages: the batch contract (`batch`: Arrow rows ⇄ padded tensors, row operations,
Karmarkar–Karp balancing), pandera stage and dataset schemas (`schemas`), and datasets with the prompt
sampler (`datasets`).
"""
