"""The device check: `python -m experiments.device_check --out DIR` (its docstring and
flags are in `__main__.py`). Modules: `checks` (TARGETS and the pure pass/fail checks),
`workload` (the slice, its sizes, the mesh, the scratch directory), the sections in
`sections_env_numerics`, `sections_train`, `sections_rollouts` and `sections_hf_recipe`,
`runner` (each section in a process of its own) and `report` (JSON and markdown)."""
