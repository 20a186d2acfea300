"""Resident KV contexts (docs/CONTEXTS.md).

* ``service``: ``ContextService``, create / append / describe / list / delete, and resolving a
  query's contexts into ``Resolved`` (their shapes, positions and the jobs they make);
* ``directory``: the directory actor holding every committed record, and its typed handle;
* ``records``: the record type and the public description;
* ``placement``: where shards and replicas go (pure);
"""
