"""Capacity planning: what a model costs on this machine (`pdrt profile`), and what a deployment of it would
serve under a workload (`pdrt plan`), by a discrete-event simulation that the controller's balancer runs too."""
