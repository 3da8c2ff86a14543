"""The file commands as a user runs them: torn tails refused unless accepted, ``-`` for stdin
and stdout, the overwrite guard, a clean exit when the reader of stdout goes away, the exit
code table, ``send --text-file``, and the broker's port check after a stop."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard
from aiokafka import AIOKafkaConsumer, TopicPartition

from dsh_dev.localstack.process import port_is_free
from pipeline.codec.inbox import InboxCodec
from pipeline.core.inbox import FollowUp

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "sessions" / "tool-calls.jsonl"


def run(*args: str, stdin: bytes | None = None, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", *args], input=stdin,
                          capture_output=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def torn_jsonl(tmp_path: Path) -> tuple[Path, int]:
    """The sample with half of one more event line appended, unterminated."""
    torn = tmp_path / "torn.jsonl"
    tail = b'{"type":"turn/start","seq":68,"time":1,"data":{"tu'
    torn.write_bytes(SAMPLE.read_bytes() + tail)
    return torn, len(tail)


def cut_zstd(tmp_path: Path) -> tuple[Path, int]:
    """Two zstd frames, the second cut short: its events are gone."""
    lines = SAMPLE.read_bytes().splitlines(keepends=True)
    compressor = zstandard.ZstdCompressor()
    first = compressor.compress(b"".join(lines[:20]))
    second = compressor.compress(b"".join(lines[20:]))[:-9]
    path = tmp_path / "cut.jsonl.zstd"
    path.write_bytes(first + second)
    return path, len(second)


@pytest.mark.parametrize("make", [torn_jsonl, cut_zstd], ids=["torn-line", "cut-zstd-frame"])
def test_validate_refuses_a_dropped_torn_tail_unless_allowed(tmp_path: Path, make: object
                                                             ) -> None:
    path, dropped = make(tmp_path)  # type: ignore[operator]
    refused = run("validate", str(path))
    assert refused.returncode == 1
    out = refused.stdout.decode()
    assert f"torn tail of {dropped} bytes dropped" in out and ": valid (" not in out
    accepted = run("validate", "--allow-torn-tail", str(path))
    assert accepted.returncode == 0, accepted.stdout
    assert ": valid (" in accepted.stdout.decode()
    assert f"torn tail of {dropped} bytes dropped, accepted" in accepted.stdout.decode()
    assert run("validate", str(SAMPLE)).returncode == 0  # a whole file is still just valid


def test_dash_reads_stdin_and_writes_stdout() -> None:
    data = SAMPLE.read_bytes()
    validated = run("validate", "-", stdin=data)
    assert validated.returncode == 0
    assert validated.stdout.decode().startswith("<stdin>: valid (68 events)")
    derived = run("derive", "--json", "-", stdin=data)
    assert derived.returncode == 0
    assert json.loads(derived.stdout) == json.loads(run("derive", "--json", str(SAMPLE)).stdout)
    avro = run("encode", "-", "-o", "-", stdin=data)
    assert avro.returncode == 0 and avro.stdout.startswith(b"Obj\x01")
    back = run("decode", "-", "-o", "-", stdin=avro.stdout)
    assert back.returncode == 0
    assert back.stdout == data  # the same lines, header included


def test_an_output_that_is_the_input_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "s.jsonl"
    source.write_bytes(SAMPLE.read_bytes())
    refused = run("encode", str(source), "-o", str(tmp_path / "." / "s.jsonl"))
    assert refused.returncode == 2
    assert b"refusing to overwrite the input file" in refused.stderr
    assert source.read_bytes() == SAMPLE.read_bytes()
    avro = tmp_path / "s.avro"
    assert run("encode", str(source), "-o", str(avro)).returncode == 0
    before = avro.read_bytes()
    assert run("decode", str(avro), "-o", str(avro)).returncode == 2
    assert avro.read_bytes() == before
    controller, terminal = pty.openpty()  # binary Avro is not written to a terminal
    on_tty = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "encode", str(source),
                             "-o", "-"], stdout=terminal, stderr=subprocess.PIPE, cwd=ROOT,
                            timeout=60)
    os.close(terminal)
    os.close(controller)
    assert on_tty.returncode == 2 and b"to a terminal" in on_tty.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """``derive ... | head -1``: no BrokenPipeError traceback, the SIGPIPE exit code."""
    files = [str(SAMPLE)] * 4000  # ~300 KB of output, far more than a pipe buffer
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "validate", *files],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    code = proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    assert first.endswith(b"valid (68 events)\n")
    assert code == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_exit_codes_follow_the_table(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type":"turn/start","seq":1,"time":1,"data":{"turn":1}}\n')
    assert run("validate", str(bad)).returncode == 1  # invalid input
    assert run("derive", str(tmp_path / "missing.jsonl")).returncode == 1
    assert run("validate", "--no-such-option", str(bad)).returncode == 2  # usage
    assert run("export").returncode == 2
    # a bad DSH_* setting is a usage error of the commands that read settings only
    env = {"DSH_DASHBOARD_PORT": "eighty"}
    assert run("validate", str(SAMPLE), env=env).returncode == 0
    assert run("derive", "--help", env=env).returncode == 0
    broken = run("send", "s1", "--cancel", env=env)
    assert broken.returncode == 2 and b"DSH_DASHBOARD_PORT must be an integer" in broken.stderr
    # Ctrl-C while the command waits (for stdin here): 130, no traceback
    # A job started in the background without job control (`cmd &` in a script, as a CI
    # runner may) inherits SIGINT ignored, and Python then leaves it ignored: the command is
    # started with the default disposition, as a terminal's Ctrl-C would find it.
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "send", "s1",
                             "--followup", "--text-file", "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            preexec_fn=_default_sigint)
    _wait_until_reading_stdin(proc.pid)
    proc.send_signal(signal.SIGINT)
    # stdin stays open until it has exited: closing it first (communicate) could hand the
    # read an end of file before the signal is handled, and the command would go on to send
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.wait(timeout=30)
    finally:
        proc.stdin.close()
    err = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_until_reading_stdin(pid: int, timeout_s: float = 60.0) -> None:
    """Until the process blocks in read(0, ...) (x86-64: syscall 0 on fd 0): started, not
    still importing, whatever the load of the machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/syscall") as handle:
            if handle.read().startswith("0 0x0 "):
                return
        time.sleep(0.05)
    raise AssertionError("the command never waited for stdin")


def test_send_text_file_usage_errors(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello")
    both = run("send", "s1", "--followup", "inline", "--text-file", str(text))
    assert both.returncode == 2 and b"give the text once" in both.stderr
    neither = run("send", "s1", "--steer")
    assert neither.returncode == 2 and b"needs TEXT or --text-file" in neither.stderr
    stray = run("send", "s1", "--cancel", "--text-file", str(text))
    assert stray.returncode == 2
    missing = run("send", "s1", "--inject", "--text-file", str(tmp_path / "none.txt"))
    assert missing.returncode == 1 and b"cannot read" in missing.stderr


def test_send_reads_a_600_kb_follow_up_from_stdin(kafka_bootstrap: str,
                                                  topic_prefix: str) -> None:
    """Longer than a command line may be: it goes through stdin and arrives whole."""
    text = ("word " * 120_000)[:600_000]
    env = {"DSH_BOOTSTRAP_SERVERS": kafka_bootstrap, "DSH_TOPIC_PREFIX": topic_prefix,
           "DSH_PARTITIONS": "3"}
    done = run("send", "big", "--followup", "--text-file", "-", stdin=text.encode(), env=env,
               timeout=120)
    assert done.returncode == 0, done.stderr
    sent = json.loads(done.stdout)
    command = asyncio.run(_read_command(kafka_bootstrap, f"{topic_prefix}inbox",
                                        sent["partition"], sent["offset"]))
    assert isinstance(command, FollowUp) and command.session_id == "big"
    assert command.content == ({"type": "text", "text": text},)


async def _read_command(bootstrap: str, topic: str, partition: int, offset: int) -> object:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, offset)
        record = await asyncio.wait_for(consumer.getone(), 30)
        return InboxCodec().decode(record.value)
    finally:
        await consumer.stop()


def test_the_port_check_allows_time_wait_but_not_a_listener() -> None:
    """A broker started again right after a stop: its old connections in TIME_WAIT do not
    make the port look taken (Kafka listens with SO_REUSEADDR); a live listener does."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    assert not port_is_free(port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end stays in TIME_WAIT
    time.sleep(0.2)
    client.close()
    server.close()
    states = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True,
                            text=True).stdout
    assert "TIME-WAIT" in states
    assert port_is_free(port)
