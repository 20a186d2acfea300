"""The Ray side of the front end (docs/SERVICE.md, "Request flow").

* ``connect``: embedded Ray or a joined cluster;
* ``pool``: the shard workers, and the only calls of their methods;
* ``orchestrator``: scatter jobs, retry on replicas, merge the states over the fixed tree.
"""
