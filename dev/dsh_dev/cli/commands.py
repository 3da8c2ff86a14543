"""The commands of the development package, as ``dsh-pipeline`` finds them: the entry point
``dev`` of the group ``dsh_pipeline.commands`` (dev/pyproject.toml) is :data:`COMMANDS`.

Like the product's table (``pipeline.cli.main``): command -> (its module, its summary in the
top-level ``--help``). Loading it imports nothing else: ``dsh-pipeline --help`` stays fast.
"""

from __future__ import annotations

from typing import Final

COMMANDS: Final[dict[str, tuple[str, str]]] = {
    "broker": ("dsh_dev.cli.cmd_broker", "run a local Kafka and schema registry in the "
                                         "foreground"),
    "demo": ("dsh_dev.cli.cmd_demo", "run the whole pipeline on a local stack and check it"),
    "chaos": ("dsh_dev.cli.cmd_chaos", "run the pipeline under randomized faults and check "
                                       "nothing was lost"),
    "bench": ("dsh_dev.cli.cmd_bench", "run the benchmarks against their anchors and write "
                                       "BENCHMARKS.md"),
}
