"""Benchmarks: each times one part of the project on this machine and writes its figures as
JSON (with the date, commit, CPU model, core count and load), run as
`python -m experiments.benchmarks.<name>`; docs/results.md records what they measured."""
