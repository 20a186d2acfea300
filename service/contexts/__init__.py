"""Resident KV contexts (docs/CONTEXTS.md).

* ``service``: ``ContextService``, create / append / describe / list / delete, and resolving a
  query's contexts;
* ``resolved``: ``Resolved``, a query's contexts (their shapes, positions and the jobs they make);
* ``sharding``: how a context is cut into shards (the plan of a new one, the shards an append fills);
* ``directory``: the directory actor holding every committed record, and its typed handle;
* ``records``: the record type and the public description;
* ``placement``: where shards and replicas go (pure);
"""
