"""Kafka's own performance tools as anchors: ProducerPerformance, ConsumerPerformance,
EndToEndLatency (``org.apache.kafka:kafka-tools``, resolved into its own folder by
:mod:`dsh_dev.localstack.artifacts`, off the broker's classpath).

Each call starts one JVM; its start-up is outside the figure because every tool times itself
from its first record (ProducerPerformance, EndToEndLatency) or reports the fetch rate
(ConsumerPerformance ``fetch.nMsg.sec``, which excludes the group join and start-up).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsh_dev.localstack.artifacts import (
    DEPENDENCY_PLUGIN,
    DEPLOY_DIR,
    MARKER,
    Artifacts,
    ensure_artifacts,
)
from dsh_dev.localstack.process import find_java
from pipeline.core.errors import DshError

TOOL_TIMEOUT_S = 600
# The producer configuration the anchor and our ingest share: acks=all, idempotent, 512 KiB
# batches, 20 ms linger (what BulkProducer uses), no compression on either side.
PRODUCER_PROPS = ("acks=all", "enable.idempotence=true", "batch.size=524288", "linger.ms=20",
                  "compression.type=none")


class ToolError(Exception):
    """A perf tool failed or printed something this module cannot read."""


def tools_lib() -> Path | None:
    """The kafka-tools classpath folder; resolved from Maven Central when missing.

    Returns None (the anchors are then reported as not measured) when it cannot be resolved.
    """
    artifacts = Artifacts.default()
    if artifacts.tools_ready():
        return artifacts.tools_lib
    try:
        ensure_artifacts(artifacts, with_tools=True,
                         progress=lambda line: print(line, flush=True))
    except DshError as exc:
        print(f"kafka-tools: {str(exc)[:300]}", flush=True)
        _resolve_with_clean_pom(artifacts)
    return artifacts.tools_lib if artifacts.tools_ready() else None


def _resolve_with_clean_pom(artifacts: Artifacts) -> None:
    """Work-around: the development package's ``localstack/files/kafka-tools.pom.xml`` has ``--``
    inside an XML comment, which Maven refuses; resolve from a copy without comments, into the
    same folder and marker."""
    pom = DEPLOY_DIR / "kafka-tools.pom.xml"
    with tempfile.TemporaryDirectory() as folder:
        clean = Path(folder) / "pom.xml"
        clean.write_text(re.sub(r"<!--.*?-->", "", pom.read_text(), flags=re.S))
        staging = artifacts.tools_dir.with_name(artifacts.tools_dir.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        done = subprocess.run(["mvn", "-B", "--no-transfer-progress", "-f", str(clean),
                               f"{DEPENDENCY_PLUGIN}:copy-dependencies", "-DincludeScope=runtime",
                               f"-DoutputDirectory={staging / 'lib'}"],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print("kafka-tools unavailable, anchors not measured: "
                  f"{done.stdout[-400:]}", flush=True)
            return
        shutil.rmtree(artifacts.tools_dir, ignore_errors=True)
        staging.rename(artifacts.tools_dir)
        (artifacts.tools_dir / MARKER).write_text("resolved by bench (comment-free pom)\n")


def _run(lib: Path, main_class: str, args: list[str]) -> str:
    argv = [find_java(17), "-Xms256m", "-Xmx512m", "-cp", f"{lib}/*", main_class, *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ToolError(f"{main_class} did not finish in {TOOL_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise ToolError(f"{main_class} exited {done.returncode}: {tail}")
    return done.stdout


def producer_performance(lib: Path, bootstrap: str, topic: str, records: int,
                         record_size: int) -> float:
    """records/s of ProducerPerformance, unthrottled (``--throughput -1``)."""
    out = _run(lib, "org.apache.kafka.tools.ProducerPerformance",
               ["--bootstrap-server", bootstrap, "--topic", topic, "--num-records",
                str(records), "--record-size", str(record_size), "--throughput", "-1",
                "--producer-props", *PRODUCER_PROPS])
    match = re.search(r"(\d+) records sent, ([\d.]+) records/sec", out)
    if match is None:
        raise ToolError(f"ProducerPerformance printed no summary: {out[-300:]}")
    return float(match.group(2))


def consumer_performance(lib: Path, bootstrap: str, topic: str, records: int) -> float:
    """fetch.nMsg.sec of ConsumerPerformance reading ``records`` records from the start.

    Its ``--timeout`` counts from before the group join: on a loaded machine a first group
    (the offsets topic created on a fresh broker) took over 60 s, hence 180 s."""
    out = _run(lib, "org.apache.kafka.tools.ConsumerPerformance",
               ["--bootstrap-server", bootstrap, "--topic", topic, "--num-records",
                str(records), "--hide-header", "--timeout", "180000"])
    rows = [line for line in out.splitlines() if line.count(",") >= 9]
    if not rows:
        raise ToolError(f"ConsumerPerformance printed no result row: {out[-300:]}")
    fields = [f.strip() for f in rows[-1].split(",")]
    consumed = int(float(fields[4]))
    if consumed < records:
        raise ToolError(f"ConsumerPerformance read {consumed} of {records} records")
    return float(fields[9])


def end_to_end_latency(lib: Path, bootstrap: str, topic: str, records: int,
                       record_size: int) -> tuple[float, float]:
    """(p50, p99) in ms of EndToEndLatency (one record at a time, acks=all)."""
    out = _run(lib, "org.apache.kafka.tools.EndToEndLatency",
               ["--bootstrap-server", bootstrap, "--topic", topic, "--num-records",
                str(records), "--producer-acks", "all", "--record-size", str(record_size)])
    match = re.search(r"50th = ([\d.]+), 99th = ([\d.]+)", out)
    if match is None:
        raise ToolError(f"EndToEndLatency printed no percentiles: {out[-300:]}")
    return float(match.group(1)), float(match.group(2))
