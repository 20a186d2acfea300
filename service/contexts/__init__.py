"""Resident KV contexts (docs/CONTEXTS.md).

* ``service``: ``ContextService``, create / append / describe / list / delete, and resolving a query's contexts;
* ``directory``: the directory actor holding every committed record, and its typed handle;
* ``records``: the record type and the public description;
* ``placement``: where shards and replicas go (pure);
* ``resolved``: the contexts of one query and the jobs they make.
"""
