"""What the entry points, the benchmarks and the tests import, with no flags of its own: the
machine's measured limits and FLOP counts (`roofline`), the results JSON and its stamp
(`results_json`), the timed sharded train step (`step_timing`), rollouts a random model can
do (`scripted_rollouts`) and stand-in trainer programs (`standin_trainers`)."""
