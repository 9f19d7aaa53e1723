"""GPU health checks: NVML readings, kernel-log XIDs and active tests, judged per GPU model.

Plain Python without Django, so the node agent runs on GPU nodes:

- ``agent.run_checks(level, nvml=None, peers=(), ...) -> dict`` and the CLI
  ``python -m provisioning.health.agent --level quick --json``;
- ``fake_nvml.FakeNvml`` / ``Fault`` / ``fake_for_host`` for nodes without hardware;
- ``thresholds`` (per-model limits), ``results`` (statuses and actions), ``report.schema.json``.

The package deliberately imports nothing here: ``python -m provisioning.health.agent`` must not
find the agent module already imported.
"""
