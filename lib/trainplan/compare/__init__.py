"""Predicted against measured: the planner's accuracy from the committed records."""
