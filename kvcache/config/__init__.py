"""The cache config: YAML read safely, validated into a frozen :class:`KVCacheConfig`.

| module | what it holds |
| --- | --- |
| ``schema`` | the pydantic models (``model``, ``cache``, ``attention`` sections) |
| ``rules`` | bounds and the rules that span fields (a backend's block sizes, head dims) |
| ``loading`` | ``load_config`` / ``parse_config``: every problem in one report |
| ``safe_read`` | reading an untrusted file (size, type and depth caps) |
| ``safe_yaml`` | YAML without aliases or duplicate keys, with line numbers |
| ``bundled`` | the configs shipped with the package, usable by bare name |
| ``sizes`` | byte sizes as text (``80GiB``) and back |
| ``planning`` | ``plan_capacity``: blocks, tokens and sequences for a memory budget |

Imports nothing heavier than pydantic and YAML (``kvcache validate`` runs without torch). The
names of :mod:`kvcache.config.schema` are also found here (``from kvcache.config import
KVCacheConfig``), as they were when this was one module.
"""

from typing import TYPE_CHECKING

from kvcache.moved import forwarding_getattr

if TYPE_CHECKING:
    from kvcache.config.schema import (
        AttentionSection as AttentionSection,
    )
    from kvcache.config.schema import (
        CacheSection as CacheSection,
    )
    from kvcache.config.schema import (
        KVCacheConfig as KVCacheConfig,
    )
    from kvcache.config.schema import (
        ModelSection as ModelSection,
    )
    from kvcache.config.schema import (
        config_json_schema as config_json_schema,
    )

__getattr__ = forwarding_getattr(__name__, "kvcache.config.schema")
