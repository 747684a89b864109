"""TabICL demo: in-context classification of a bundled or uploaded table against classical baselines."""
