"""Training: anchors and blocks (anchors.py), the weighted block loss (loss.py), acceptance metrics
(metrics.py) and crash-safe training state (state.py)."""
