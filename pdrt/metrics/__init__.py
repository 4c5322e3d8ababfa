"""Prometheus metrics: each process measures what it sees, the controller merges them, the gateway serves the view.

* `process_metrics`: the one registry of a process (never prometheus_client's
  global default), which its controller link reports every second;
* `gateway_metrics`, `worker_metrics`: what the roles measure (request life
  cycle at the gateway; steps, prefills, KV and transfers in workers);
* `health`: the health indices (PSI, DS, KE, ETOP) as plain functions;
* `exposition`: Prometheus text in and out: parse, relabel, merge, render;
* `aggregator`, `metrics_server`: the controller's merged view and its HTTP port;
* `gateway_view`: what the gateway's `/metrics` serves (its live metrics and the merged view);
* `status_table`: the table `pdrt status` prints.

Every name starts with `pdrt_`. Reported metrics carry no `process` or `role`
label: the controller adds both when it merges, from the report's sender.
"""
