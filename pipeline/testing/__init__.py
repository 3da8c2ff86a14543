"""Generators of test load, shipped because a product command uses them (``dsh-pipeline
chaos`` ships synthetic sessions); also used by the tests and the benchmarks.

Pure like core (it imports only core); no layer below the CLI may import it
(import-linter contracts in pyproject.toml).

- :mod:`.synth`: seeded synthetic dsh sessions, the recorded fixtures' event mix.
"""
