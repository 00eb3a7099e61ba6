"""Small reference models the demo, tests, benchmarks and planner use (no extra dependency)."""
