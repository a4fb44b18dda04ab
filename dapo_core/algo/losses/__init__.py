"""Policy and value losses: the registry, `vanilla` with dual clip, `agg_loss` and the value loss
(`core`), and the other registered policy losses (`variants`, registered on import of this package).
"""

from dapo_core.algo.losses import variants as _variants  # noqa: F401  (registers on import)
from dapo_core.algo.losses.core import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    PolicyLossParams,
    actor_objective,
    agg_loss,
    compute_value_loss,
    get_policy_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    register_policy_loss,
)

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "PolicyLossParams",
    "actor_objective",
    "agg_loss",
    "compute_value_loss",
    "get_policy_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_policy_loss",
]
