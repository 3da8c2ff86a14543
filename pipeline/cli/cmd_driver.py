"""``dsh-pipeline driver`` (run agent turns from the inbox) and ``dsh-pipeline send``.

``driver`` joins the consumer group ``<DSH_GROUP_ID_PREFIX>driver`` on the inbox topic and runs
turns until SIGTERM or Ctrl-C, then shuts down gracefully (stops claiming, lets turns finish
for ``--grace`` seconds, commits or aborts, closes producers, leaves the group).

``send SESSION`` puts one command on the inbox: ``--followup TEXT``, ``--steer TEXT``,
``--inject TEXT`` (or the text from a file or stdin: ``--followup --text-file F|-``, for texts
longer than a command line may be), ``--cancel [--keep-queue]`` or ``--configure`` with any
of ``--provider``, ``--model``, ``--system``, ``--tools a,b``, ``--reasoning-effort``,
``--max-tokens``, ``--require-approval P``, ``--approval-policy``, or ``--approve CALL_ID`` /
``--deny CALL_ID`` (approval options: :mod:`pipeline.cli.approval_options`). It prints
one JSON line ``{"sessionId", "messageId", "kind", "partition", "offset"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import uuid
from collections.abc import Mapping
from typing import Any

from pipeline.adapters.kafka.admin import SERVICE_START_RETRY_S, ensure_topics
from pipeline.adapters.kafka.plain_producer import inbox_command_record, send_records
from pipeline.adapters.llm.factory import provider_from_settings
from pipeline.adapters.llm.scripted import (
    Script,
    ScriptedReply,
    echo_script,
    named_tool_script,
    tool_loop_script,
)
from pipeline.adapters.mcp import McpServerConnection, load_mcp_config
from pipeline.adapters.metrics.http import Health
from pipeline.adapters.registry.client import (
    BACKWARD_TRANSITIVE,
    RegistryClient,
    event_serde_for_topic,
    value_subject,
)
from pipeline.cli.approval_options import (
    CONFIGURE_APPROVAL_OPTIONS,
    add_driver_approval_options,
    add_send_approval_options,
    approval_rules,
    decision_from_args,
    send_decision_and_wait,
)
from pipeline.cli.common import (
    add_duration,
    add_listen_options,
    add_logging_options,
    add_session_argument,
    configure_logging,
    port_number,
)
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.approvals import ApprovalRules
from pipeline.core.errors import ConfigError, SessionFileError
from pipeline.core.inbox import (
    Approve,
    Cancel,
    Configure,
    FollowUp,
    InboxCommand,
    Inject,
    Steer,
)
from pipeline.core.log import Mode, SessionLog
from pipeline.core.model import ModelRequest
from pipeline.core.turn_effects import SessionConfig
from pipeline.core.turn_history import History
from pipeline.services.driver.checkpointing import CheckpointStore
from pipeline.services.driver.http_status import StatusServer
from pipeline.services.driver.kafka_sink import STEPS_PER_TRANSACTION, PartitionSink
from pipeline.services.driver.mcp_tools import McpTools
from pipeline.services.driver.partition import DriverMetrics, PartitionContext
from pipeline.services.driver.runner import ModelProvider, SessionRunner
from pipeline.services.driver.service import DriverConfig, DriverService
from pipeline.services.driver.spill import kafka_spill_policy
from pipeline.services.driver.tools import ToolRegistry, builtin_registry
from pipeline.settings import Settings

# The scripted provider's answers, by ``--script`` name (other providers ignore it).
SCRIPTS: dict[str, Script] = {
    "echo": echo_script,
    "tool-loop": tool_loop_script("echo", '{"text": "hello"}'),
}


def register(subparsers: Any) -> None:
    _register_driver(subparsers)
    _register_send(subparsers)


def _register_driver(subparsers: Any) -> None:
    driver = subparsers.add_parser(
        "driver", help="run agent turns from the inbox topic",
        description="Join the consumer group <DSH_GROUP_ID_PREFIX>driver on the inbox topic "
                    "and run agent turns until SIGTERM or Ctrl-C, then stop gracefully: stop "
                    "claiming, let running turns finish for --grace, commit or abort, leave "
                    "the group. Serves /health and /metrics on --host:--port.")
    driver.add_argument("--group", help="consumer group (default: <prefix>driver)")
    add_duration(driver, "--linger", default=0.025, ms=True, dest="linger_ms",
                 help="longest time events wait before their transaction commits")
    driver.add_argument("--linger-ms", type=float, dest="linger_ms", help=argparse.SUPPRESS)
    driver.add_argument("--steps-per-transaction", type=_non_negative,
                        default=STEPS_PER_TRANSACTION,
                        help="at most about this many sessions of an inbox partition begin a "
                             "step while its transaction commits; the others wait their turn "
                             "(bounds a transaction under a burst; 0: no bound)")
    driver.add_argument("--max-turns", type=int, default=256,
                        help="pause the inbox when this many sessions run a turn")
    driver.add_argument("--resume-below", type=int,
                        help="resume the inbox when at most this many turns run "
                             "(default: three quarters of --max-turns)")
    add_duration(driver, "--grace", default=10.0,
                 help="how long running turns may take to finish on shutdown")
    driver.add_argument("--enable-host-tools", action="store_true",
                        help="offer tools that touch the host (bash); off by default")
    driver.add_argument("--mcp-config", metavar="FILE",
                        help="offer the tools of the MCP servers in FILE (the mcpServers JSON "
                             "format) as mcp__SERVER__TOOL (default: DSH_MCP_CONFIG; "
                             "docs/mcp.md)")
    driver.add_argument("--instance-id",
                        help="static group membership id (e.g. the pod name): a restarted "
                             "driver with the same id gets its partitions back at once")
    add_duration(driver, "--session-timeout", default=3.0, ms=True,
                 dest="session_timeout_ms",
                 help="group session timeout: how long a dead driver keeps partitions (the "
                      "brokers' group.min.session.timeout.ms must allow it; Kafka's default "
                      "minimum is 6 s, the project's brokers allow 2 s)")
    driver.add_argument("--session-timeout-ms", type=int, dest="session_timeout_ms",
                        help=argparse.SUPPRESS)
    add_driver_approval_options(driver)
    _add_driver_io_options(driver)
    driver.set_defaults(func=run_driver)


def _add_driver_io_options(driver: argparse.ArgumentParser) -> None:
    """The scripted provider's, the status server's, the framing's and the log's options."""
    driver.add_argument("--script", choices=sorted(SCRIPTS), default="echo",
                        help="scripted provider only: 'echo' answers in one step; 'tool-loop' "
                             "calls the echo tool, then answers its result (two steps)")
    driver.add_argument("--script-tool", metavar="NAME",
                        help="scripted provider only: call the tool NAME once (e.g. "
                             "mcp__files__list_directory), then answer with its result "
                             "(instead of --script)")
    driver.add_argument("--script-arguments", metavar="JSON", default="{}",
                        help="with --script-tool: the call's arguments, a JSON object")
    add_duration(driver, "--script-chunk-delay", default=0.0, ms=True,
                 dest="script_chunk_delay_ms",
                 help="scripted provider only: wait this long between stream chunks (to "
                      "watch chunks arrive live)")
    driver.add_argument("--script-chunk-delay-ms", type=int, dest="script_chunk_delay_ms",
                        help=argparse.SUPPRESS)
    driver.add_argument("--pipelined-flush", action="store_true",
                        help="a step boundary does not wait for its transaction to commit "
                             "(more steps/s; a crash may then lose the last step or two)")
    add_listen_options(driver, what="the /health and /metrics server", host_default="0.0.0.0",
                       port_help="port of /health and /metrics (default: "
                                 "DSH_DRIVER_METRICS_PORT; -1: no server, 0: any free port)")
    driver.add_argument("--metrics-host", dest="host", help=argparse.SUPPRESS)
    driver.add_argument("--metrics-port", type=port_number, dest="port",
                        help=argparse.SUPPRESS)
    driver.add_argument("--rebuild-mode", choices=("strict", "ingest"), default="strict",
                        help="validation of logs rebuilt from the session topic: 'ingest' "
                             "also accepts imported logs with simplified message shapes")
    driver.add_argument("--registry", action="store_true",
                        help="register the schemas at DSH_REGISTRY_URL and write the Confluent "
                             "framing (default: Avro single-object encoding, no registry)")
    add_logging_options(driver, default="info")


def _register_send(subparsers: Any) -> None:
    send = subparsers.add_parser(
        "send", help="put one command on a session's inbox",
        description="Put one command on the inbox topic, keyed by SESSION: a follow-up, a "
                    "steer, an inject (text as an argument, or from --text-file FILE or stdin "
                    "with -), a cancel, a configure, or a decision on a tool call waiting for "
                    "approval. Prints one JSON line {sessionId, "
                    "messageId, kind, partition, offset}.")
    add_session_argument(send)
    kind = send.add_mutually_exclusive_group(required=True)
    for flag, what in (("followup", "a follow-up (next turn)"),
                       ("steer", "steering (next step; wakes)"),
                       ("inject", "context (next step; does not wake)")):
        kind.add_argument(f"--{flag}", metavar="TEXT", nargs="?", const=FROM_FILE,
                          help=f"{what}; without TEXT, the text comes from --text-file")
    kind.add_argument("--cancel", action="store_true", help="abort the current turn")
    kind.add_argument("--configure", action="store_true", help="change the configuration")
    send.add_argument("--text-file", metavar="FILE",
                      help="read the text of --followup, --steer or --inject from FILE (- for "
                           "stdin; UTF-8)")
    send.add_argument("--keep-queue", action="store_true", help="with --cancel")
    for name, what in (("provider", "model provider"), ("model", "model name"),
                       ("system", "system prompt"),
                       ("reasoning-effort", "reasoning effort (provider-specific)")):
        send.add_argument(f"--{name}", help=f"with --configure: the {what}")
    send.add_argument("--tools", help="with --configure: comma-separated tool names ('' = none)")
    send.add_argument("--max-tokens", type=int, help="with --configure: the output token limit")
    add_send_approval_options(send, kind)
    send.add_argument("--message-id", help="the command's message id (default: a new UUID)")
    send.add_argument("--registry", action="store_true",
                      help="Confluent framing with the id registered at DSH_REGISTRY_URL")
    send.set_defaults(func=run_send)


# -- send ------------------------------------------------------------------------------


def command_from_args(args: argparse.Namespace) -> InboxCommand:
    """The command ``send``'s arguments describe (ConfigError when they do not fit)."""
    _check_send_options(args)
    common = {"session_id": args.session, "message_id": args.message_id or str(uuid.uuid4())}
    decision = decision_from_args(args, common)
    if decision is not None:
        return decision
    for flag, cls in (("followup", FollowUp), ("steer", Steer), ("inject", Inject)):
        text = getattr(args, flag)
        if text is not None:
            text = _text_of(flag, text, args.text_file)
            return cls(**common, content=({"type": "text", "text": text},))
    if args.cancel:
        return Cancel(**common, keep_queue=args.keep_queue)
    tools = None if args.tools is None else tuple(t for t in args.tools.split(",") if t)
    configure = Configure(**common, provider=args.provider, model=args.model,
                          system=args.system, tools=tools,
                          reasoning_effort=args.reasoning_effort, max_tokens=args.max_tokens,
                          require_approval=(None if args.require_approval is None
                                            else tuple(args.require_approval)),
                          approval_policy=args.approval_policy)
    if all(getattr(configure, f) is None for f in CONFIGURE_OPTIONS):
        raise ConfigError("send --configure needs at least one of --provider, --model, "
                          "--system, --tools, --reasoning-effort, --max-tokens, "
                          "--require-approval, --approval-policy")
    return configure


FROM_FILE = "\0from --text-file"  # --followup/--steer/--inject given without TEXT


def _text_of(flag: str, given: str, text_file: str | None) -> str:
    """The text of a follow-up, steer or inject: the argument, or the file's content."""
    if given != FROM_FILE:
        if text_file is not None:
            raise ConfigError(f"send --{flag} TEXT and --text-file: give the text once")
        return given
    if text_file is None:
        raise ConfigError(f"send --{flag} needs TEXT or --text-file FILE")
    try:
        if text_file == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(text_file, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise SessionFileError(f"{text_file}: cannot read: {exc.strerror or exc}",
                               path=text_file) from None
    except UnicodeDecodeError as exc:
        raise SessionFileError(f"{text_file}: not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start})", path=text_file) from None


CONFIGURE_OPTIONS = ("provider", "model", "system", "tools", "reasoning_effort", "max_tokens",
                     *CONFIGURE_APPROVAL_OPTIONS)


def _check_send_options(args: argparse.Namespace) -> None:
    if args.keep_queue and not args.cancel:
        raise ConfigError("send --keep-queue only goes with --cancel")
    if args.text_file is not None and not (args.followup or args.steer or args.inject):
        raise ConfigError("send --text-file only goes with --followup, --steer or --inject")
    given = [f"--{o.replace('_', '-')}" for o in CONFIGURE_OPTIONS if getattr(args, o) is not None]
    if given and not args.configure:
        raise ConfigError(f"send {' '.join(given)} only go(es) with --configure")


def run_send(args: argparse.Namespace, settings: Settings) -> int:
    try:
        command = command_from_args(args)
    except (ConfigError, SessionFileError):
        raise
    except Exception as exc:  # EventError from the command's own checks
        raise ConfigError(f"send: {exc}") from None
    if args.registry:
        with RegistryClient.from_settings(settings) as client:
            codec = registry_codecs(settings, client)[1]
    else:
        codec = InboxCodec()
    record = inbox_command_record(settings, command, codec.encode)
    if isinstance(command, Approve) and args.wait:
        return send_decision_and_wait(settings, command, record, args.wait_timeout)
    [(partition, offset)] = asyncio.run(send_records(settings, [record]))
    print(json.dumps({"sessionId": command.session_id, "messageId": command.message_id,
                      "kind": command.kind, "partition": partition, "offset": offset}))
    return 0


# -- driver ----------------------------------------------------------------------------


def registry_codecs(settings: Settings, client: RegistryClient) -> tuple[EventSerde, InboxCodec]:
    """Codecs writing the Confluent framing with ids registered under ``<topic>-value``
    (TopicNameStrategy), compatibility BACKWARD_TRANSITIVE set explicitly."""
    topics = settings.topics
    serde = event_serde_for_topic(client, topics.session_events)
    inbox_codec = InboxCodec()
    subject = value_subject(topics.inbox)
    inbox_id = client.register(subject, json.dumps(inbox_codec.schema_json))
    client.set_compatibility(BACKWARD_TRANSITIVE, subject)
    return serde, InboxCodec(confluent_id=inbox_id, lookup=client.get_schema)


def driver_context(settings: Settings, *, group_id: str, tools: ToolRegistry,
                   linger_ms: float = 25.0, script: Script = echo_script,
                   codecs: tuple[EventSerde, InboxCodec] | None = None,
                   pipelined_flush: bool = False,
                   rebuild_mode: Mode = "strict",
                   steps_per_transaction: int = STEPS_PER_TRANSACTION,
                   approvals: ApprovalRules | None = None) -> PartitionContext:
    """The composition of the Kafka driver: codecs, providers, tools, runners.

    ``script`` drives the scripted provider (the default provider of the settings);
    ``codecs`` default to the single-object encoding (no registry needed);
    ``steps_per_transaction``: at most about this many sessions of a partition begin a step
    while its transaction commits (``admission.StepBudget``; 0: no bound);
    ``approvals``: which tool calls wait for a person (None: none).
    """
    serde, inbox_codec = codecs or (EventSerde(), InboxCodec())
    tools = tools.with_post_execute(kafka_spill_policy(settings).bound)
    providers: dict[str, ModelProvider] = {}

    def provider_factory(provider: str, model: str) -> ModelProvider:
        if provider not in providers:
            providers[provider] = provider_from_settings(settings, provider, script=script)
        return providers[provider]

    default_config = SessionConfig(provider=settings.provider, model=settings.model)
    metrics = DriverMetrics()

    def runner_factory(log: SessionLog, sink: PartitionSink, history: History
                       ) -> SessionRunner:
        admit = sink.admit_step if steps_per_transaction > 0 else None
        return SessionRunner(log, provider_factory=provider_factory, tools=tools, sink=sink,
                             config=default_config, metrics=metrics.runner, admit=admit,
                             approvals=approvals, history=history)

    return PartitionContext(settings=settings, group_id=group_id, decode_event=serde.decode,
                            encode_event=serde.encode, decode_command=inbox_codec.decode,
                            runner_factory=runner_factory, metrics=metrics,
                            checkpoints=CheckpointStore(settings, serde.decode,
                                                        mode=rebuild_mode),
                            linger_ms=linger_ms, pipelined_flush=pipelined_flush,
                            rebuild_mode=rebuild_mode,
                            steps_per_transaction=steps_per_transaction)


def run_driver(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(args)
    resume_below = args.resume_below
    if resume_below is None:
        resume_below = args.max_turns * 3 // 4
    config = DriverConfig(linger_ms=args.linger_ms, max_turns_in_flight=args.max_turns,
                          resume_below=resume_below, shutdown_grace_s=args.grace,
                          session_timeout_ms=args.session_timeout_ms,
                          instance_id=args.instance_id)
    group = args.group or f"{settings.group_id_prefix}driver"
    tools = builtin_registry(enable_host_tools=args.enable_host_tools)
    script = script_from_args(args)
    mcp = mcp_tools_from(args.mcp_config or settings.mcp_config, settings)
    if mcp is not None:
        tools.add_source(mcp)
    with contextlib.ExitStack() as stack:
        codecs = None
        if args.registry:
            client = stack.enter_context(RegistryClient.from_settings(settings))
            codecs = registry_codecs(settings, client)
        ctx = driver_context(settings, group_id=group, tools=tools, linger_ms=args.linger_ms,
                             script=_delayed(script, args.script_chunk_delay_ms),
                             codecs=codecs, pipelined_flush=args.pipelined_flush,
                             rebuild_mode=args.rebuild_mode,
                             steps_per_transaction=args.steps_per_transaction,
                             approvals=approval_rules(args))
        service = DriverService(ctx, config)
        port = settings.driver_metrics_port if args.port is None else args.port
        asyncio.run(_serve(settings, service, args.host, port, mcp))
    print(json.dumps({"stopped": True, **service.metrics_snapshot()}), flush=True)
    return 0


def script_from_args(args: argparse.Namespace) -> Script:
    """``--script-tool NAME --script-arguments JSON``, else the ``--script`` named."""
    if args.script_tool is None:
        if args.script_arguments != "{}":
            raise ConfigError("driver --script-arguments only goes with --script-tool")
        return SCRIPTS[args.script]
    try:
        arguments = json.loads(args.script_arguments)
    except ValueError as exc:
        raise ConfigError(f"driver --script-arguments is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ConfigError("driver --script-arguments must be a JSON object")
    return named_tool_script(args.script_tool, json.dumps(arguments))


def mcp_tools_from(path: str, settings: Settings) -> McpTools | None:
    """The MCP servers of the config file at ``path`` (None when no file is given)."""
    if not path:
        return None
    servers = load_mcp_config(path)
    return McpTools([McpServerConnection(server) for server in servers],
                    timeout_s=settings.tool_timeout)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _delayed(script: Script, chunk_delay_ms: int) -> Script:
    if chunk_delay_ms <= 0:
        return script

    def delayed(request: ModelRequest, attempt: int) -> ScriptedReply:
        return dataclasses.replace(script(request, attempt), chunk_delay_ms=chunk_delay_ms)
    return delayed


async def _serve(settings: Settings, service: DriverService, metrics_host: str,
                 metrics_port: int, mcp: McpTools | None = None) -> None:
    await ensure_topics(settings, retry_for_s=SERVICE_START_RETRY_S)
    if mcp is not None:  # listed before the first session is built: its default tool set
        await mcp.start()
    try:
        await _serve_status(service, metrics_host, metrics_port, mcp)
    finally:
        if mcp is not None:
            await mcp.close()


def _health_with(service: DriverService, mcp: McpTools | None) -> Health:
    """The service's /health, with each MCP server's state (no secrets) when there are any."""
    if mcp is None:
        return service.health

    def health() -> tuple[bool, Mapping[str, object]]:
        alive, details = service.health()
        return alive, {**details, "mcp": mcp.status()}
    return health


async def _serve_status(service: DriverService, metrics_host: str, metrics_port: int,
                        mcp: McpTools | None) -> None:
    status = StatusServer(_health_with(service, mcp), service.metrics_snapshot,
                          service.metrics.runner.render)
    if metrics_port >= 0:
        try:
            bound = await status.start(metrics_host, metrics_port)
        except OSError as exc:
            raise ConfigError(f"cannot serve /health and /metrics on {metrics_host}:"
                              f"{metrics_port}: {exc.strerror or exc} (DSH_DRIVER_METRICS_PORT "
                              f"or --port; -1 disables)") from None
        print(f"status http://{metrics_host}:{bound}/health /metrics", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    ready = asyncio.create_task(_announce_ready(service))
    try:
        await service.run(stop)
    finally:
        ready.cancel()
        await status.close()


async def _announce_ready(service: DriverService) -> None:
    await service.ready.wait()
    print(f"ready group={service.ctx.group_id} partitions={sorted(service.owned)}", flush=True)
