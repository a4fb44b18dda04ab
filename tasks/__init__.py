"""Prefect tasks, one per RL step stage. Each is thin: read inputs by URI → call a worker → validate the
output schema → commit it to the run store → return (URI, metrics). Tasks receive only small values (run id,
step, URIs); the models live in workers found through the run's `Runtime`."""
