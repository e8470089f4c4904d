"""The simulator and what stands on it: ``pflkit run`` (``experiment``), sweeps of runs over a grid
of config keys (``sweep``, one cell: ``cell``; on a Ray cluster: ``cluster``), reports of results
folders (``report``) and pictures of a finished run (``trajectory``, ``simplex_report``).

Nothing is imported here: each entry point imports the module it needs (Ray, for one, only where
a sweep asks for it)."""
