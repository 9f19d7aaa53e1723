"""GPU health checks: NVML readings, kernel-log XIDs and active tests, judged per GPU model.

The checking library is plain Python without Django, so the node agent runs on GPU nodes:

- ``agent.run_checks(level, nvml=None, peers=(), ...) -> dict`` and the CLI
  ``python -m provisioning.health.agent --level quick --json``;
- ``fake_nvml.FakeNvml`` / ``Fault`` / ``fake_for_host`` for nodes without hardware;
- ``thresholds`` (per-model limits), ``results`` (statuses and actions), ``report.schema.json``;
- ``runner`` (run one queued job, compact its report; the simulated fleet with canned tools).

The Django app (label ``health``) keeps the records and acts on them: ``models`` (HealthCheck,
Repair), ``services`` (queue, dispatch, record, drain and repair, the acceptance gate),
``selectors``, ``tasks`` (agents on ``node.<hostname>``, the simulated ``fleet`` queue),
``api``, ``views``, ``admin``, ``schedule`` (beat entries), ``worker`` (start an agent or the
fleet simulator).

The package deliberately imports nothing here: ``python -m provisioning.health.agent`` must not
find the agent module already imported.
"""
