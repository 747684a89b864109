"""Decision Mixer demo: run a shipped offline-RL policy in MuJoCo and watch it, its return and its routing."""
