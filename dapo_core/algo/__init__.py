"""The algorithm on tensors and arrays: advantage estimators, KL penalties and controllers, policy and value
losses, rollout off-policy correction, and dynamic sampling (group filter, refill sizing).

Imports nothing of ours but `dapo_core.masked`, so every formula can be read and tested on its own.
"""
