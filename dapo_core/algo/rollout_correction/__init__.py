"""Rollout off-policy correction: IS weights, rejection sampling and the presets (`config`), the
correction itself (`core`) and its diagnostics (`metrics`). The public names are `core.__all__`.
"""

from dapo_core.algo.rollout_correction.core import *
