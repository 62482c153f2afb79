"""The job config: one OmegaConf structured tree, loaded from YAML + dotlist overrides, validated once.

Every check raises ``ConfigError(key, reason)`` naming the dotted key a user has to change,
so the CLI can print one line and exit 2. The package's parts: ``schema`` (sections, keys,
defaults and the name lists values come from), ``checks`` (validation, pure), ``loading``
(YAML and overrides through OmegaConf), ``yamlfile`` (a config file read within bounds),
``overrides`` (``key=value`` applied to the tree) and ``keys`` (the schema's dotted keys, for
"did you mean"); callers import from ``ringtrain.config``, which shows the schema's public names
(``schema.__all__``) and the checks and loading functions imported below.
"""

from __future__ import annotations

from ringtrain.config.checks import (
    validate,
    validate_data_sources,
    validate_eval,
    validate_gpus_per_worker,
    validate_memory_savers,
    validate_model,
    validate_rope_scaling,
)
from ringtrain.config.loading import (
    RUN_CONFIG,
    fill_model_defaults,
    from_mapping,
    load,
    load_saved,
    merge,
    replace,
    to_yaml,
)
from ringtrain.config.schema import *  # noqa: F403  (schema.__all__: its sections, keys and name lists)
