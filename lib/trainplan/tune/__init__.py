"""The knob study (Optuna), its effects with intervals, and `suggest`."""
