"""The run configuration: dataclass schema with a docstring per field (`schema`), cross-field checks
(`checks`), loading with dotted overrides and the typed view (`loading`), and the keys accepted but not
read (`unused`). The public names are `schema.__all__` and `loading.__all__`.
"""

from dapo_core.config.loading import *
from dapo_core.config.schema import *
