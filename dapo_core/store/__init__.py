"""The run store: atomic files (`files`), the prompt/trajectory ledger and stage files (`run_store`),
checkpoints (`checkpoint`) and the replay buffer over the store (`replay`). The public names are
`run_store.__all__`.
"""

from dapo_core.store.run_store import *
