"""Nereus's benchmarks: one ``bench_*.py`` script per claim, their shared code in ``lib``.

Run a benchmark from the repository root::

    python benchmarks/bench_NAME.py [--quick] [--json PATH]

``--json PATH`` writes ``{"benchmark": NAME, "rows": [...]}``, one object per printed
table row. A script run by path has its own folder on ``sys.path``, not the repository
root, so each script that imports ``benchmarks.lib`` first puts the root there with the
same two lines; nothing else is needed (no ``PYTHONPATH``). Worker processes started by
the local runtime run from the same folder and import ``benchmarks.*`` by that name too.
"""
