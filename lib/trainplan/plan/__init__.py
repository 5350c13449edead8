"""The planner: every valid layout searched and priced, and the `trainplan plan` contract."""
