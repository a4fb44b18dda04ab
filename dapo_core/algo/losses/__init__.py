"""Policy and value losses: the registry, `vanilla` with dual clip, `agg_loss`, the value loss and the actor's
micro-batch objective (`core`), and the other registered policy losses (`variants`, registered on import
of this package). The public names are `core.__all__`.
"""

from dapo_core.algo.losses import variants as _variants  # noqa: F401  (registers the other losses)
from dapo_core.algo.losses.core import *
