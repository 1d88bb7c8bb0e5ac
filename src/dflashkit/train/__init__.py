"""Training: `trainer.train()` reads top to bottom as a loop over this package's components: the run
(setup.py), where features come from (sources.py), one step (step.py: anchors.py, loss.py), held-out
acceptance (validation.py), the optimizer (optimizer.py), checkpoints and best/ (checkpoints.py,
state.py, rundir.py) and the metrics log (metrics.py). Around it: several processes (distributed.py), a
fan-out of K drafters fed by one target (fanout.py), and the dry run (plan.py)."""
