"""Code the benchmark scripts share, imported as ``benchmarks.lib.<module>``.

- ``costmodel_measure``: bench_costmodel's measuring (worker processes, rounds over the
  grid of plans, repetitions with their CPU, steal and load counters).
- ``costmodel_figures``: a plan's CPU figure from its repetitions, and the host-speed probe.
- ``costmodel_scoring``: the fit/held-out split, the model's errors, and the noise floor
  beside them.
- ``e2e_plans``: bench_e2e's length trace, startup configurations, budget rule and the
  enumeration of every feasible fixed plan.
- ``e2e_verdict``: paired ratios to adaptive, their confidence ranges, and per goal
  met, missed or within noise.
- ``e2e_confirm``: bench_e2e's rows from runs, and the confirmation rounds of the
  selected best fixed plan.
- ``e2e_model_error``: the cost model's predicted step latency of each fixed plan beside
  the measured one, per phase.
- ``e2e_breakdown``: where adaptive's time goes against the best fixed plan, step by step.
- ``extend_baselines``: bench_extend's storage-based ways (DCP, UCP-style files,
  Tenplex-style tensor store, checkpoint/restart) as worker commands, and the tensor store.
"""
