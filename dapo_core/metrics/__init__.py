"""Metrics under verl's names: per-step data, timing and throughput metrics (`step`), validation metrics
mean@k / pass@k / maj@k (`validation`), and the JSONL / TensorBoard / console trackers and curves
(`tracking`). The replay buffer's staleness metrics are computed where that data is, in
`dapo_core.store.replay`.
"""
