"""The workers' side of the front end (docs/SERVICE.md, "Request flow").

* ``connect``: embedded Ray or a joined cluster;
* ``surface``: what the code above uses of a pool of workers (``WorkerSurface``, no Ray);
* ``pool``: the shard workers as Ray actors, and the only calls of their methods over Ray;
* ``local``: the same surface over workers in this process (no Ray: the unit tests);
* ``orchestrator``: scatter jobs, retry on replicas, merge the states over the fixed tree.
"""
