"""Training-health alarms over the per-step metrics (`alarms.py`: the six pure checks; `watch.py`:
`HealthWatch`, fed by the trainer each step, and `health_inputs`, what the orchestrator ships with a batch).
Thresholds: `config/health.py` (`[trainer.health]`)."""
