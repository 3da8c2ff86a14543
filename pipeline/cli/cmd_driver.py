"""``dsh-pipeline driver``: run agent turns from the inbox.

``driver`` joins the consumer group ``<DSH_GROUP_ID_PREFIX>driver`` on the inbox topic and runs
turns until SIGTERM or Ctrl-C, then shuts down gracefully (stops claiming, lets turns finish
for ``--grace`` seconds, commits or aborts, closes producers, leaves the group).

Commands reach the inbox with ``send`` (:mod:`pipeline.cli.cmd_send`); the approval options:
:mod:`pipeline.cli.approval_options`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.adapters.kafka.admin import SERVICE_START_RETRY_S, ensure_topics
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
from pipeline.adapters.registry.client import RegistryClient
from pipeline.cli.approval_options import add_driver_approval_options, approval_rules
from pipeline.cli.common import (
    add_duration,
    add_listen_options,
    add_logging_options,
    configure_logging,
    port_number,
)
from pipeline.cli.provider_config import (
    fallbacks_of,
    provider_endpoints_of,
    provider_limits_of,
)
from pipeline.cli.registry_codecs import registry_codecs
from pipeline.codec.avro import EventSerde
from pipeline.codec.inbox import InboxCodec
from pipeline.core.approvals import ApprovalRules
from pipeline.core.errors import ConfigError
from pipeline.core.log import Mode, SessionLog
from pipeline.core.model import ModelRequest
from pipeline.core.turn_effects import SessionConfig
from pipeline.core.turn_history import History
from pipeline.services.driver.checkpointing import CheckpointStore
from pipeline.services.driver.http_status import StatusServer
from pipeline.services.driver.kafka_sink import STEPS_PER_TRANSACTION, PartitionSink
from pipeline.services.driver.mcp_tools import McpTools
from pipeline.services.driver.partition import DriverMetrics, PartitionContext
from pipeline.services.driver.provider_gate import ProviderGate
from pipeline.services.driver.provider_router import ProviderRouter
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


def driver_context(settings: Settings, *, group_id: str, tools: ToolRegistry,
                   linger_ms: float = 25.0, script: Script = echo_script,
                   codecs: tuple[EventSerde, InboxCodec] | None = None,
                   pipelined_flush: bool = False,
                   rebuild_mode: Mode = "strict",
                   steps_per_transaction: int = STEPS_PER_TRANSACTION,
                   approvals: ApprovalRules | None = None,
                   env: Mapping[str, str] | None = None) -> PartitionContext:
    """The composition of the Kafka driver: codecs, providers, tools, runners.

    ``script`` drives the scripted provider (the default provider of the settings);
    ``codecs`` default to the single-object encoding (no registry needed);
    ``steps_per_transaction``: at most about this many sessions of a partition begin a step
    while its transaction commits (``admission.StepBudget``; 0: no bound);
    ``approvals``: which tool calls wait for a person (None: none);
    ``env``: where ``DSH_PROVIDERS``' ``apiKeyEnv`` variables are read (default: the
    process environment).
    """
    serde, inbox_codec = codecs or (EventSerde(), InboxCodec())
    tools = tools.with_post_execute(kafka_spill_policy(settings).bound)
    provider_factory, gate, router = provider_wiring(settings, script, env)
    default_config = SessionConfig(provider=settings.provider, model=settings.model)
    metrics = DriverMetrics()

    def runner_factory(log: SessionLog, sink: PartitionSink, history: History
                       ) -> SessionRunner:
        admit = sink.admit_step if steps_per_transaction > 0 else None
        return SessionRunner(log, provider_factory=provider_factory, tools=tools, sink=sink,
                             config=default_config, metrics=metrics.runner, admit=admit,
                             approvals=approvals, history=history, gate=gate,
                             router=router)

    return PartitionContext(settings=settings, group_id=group_id, decode_event=serde.decode,
                            encode_event=serde.encode, decode_command=inbox_codec.decode,
                            runner_factory=runner_factory, metrics=metrics, gate=gate,
                            router=router,
                            checkpoints=CheckpointStore(settings, serde.decode,
                                                        mode=rebuild_mode),
                            linger_ms=linger_ms, pipelined_flush=pipelined_flush,
                            rebuild_mode=rebuild_mode,
                            steps_per_transaction=steps_per_transaction)


ProviderFactory = Callable[[str, str], ModelProvider]


def provider_wiring(settings: Settings, script: Script, env: Mapping[str, str] | None
                    ) -> tuple[ProviderFactory, ProviderGate | None, ProviderRouter | None]:
    """The providers (made on first use, one per name), their rate budgets
    (``DSH_PROVIDER_LIMITS``, told every answer's rate headers) and the fallback router
    (``DSH_PROVIDERS``, ``DSH_PROVIDER_FALLBACKS``); None where not configured."""
    providers: dict[str, ModelProvider] = {}
    limits = provider_limits_of(settings)
    gate = ProviderGate(limits) if limits is not None else None
    endpoints = provider_endpoints_of(settings, os.environ if env is None else env)
    fallbacks = fallbacks_of(settings, endpoints)
    router = ProviderRouter(fallbacks, gate=gate) if fallbacks is not None else None

    def provider_factory(provider: str, model: str) -> ModelProvider:
        if provider not in providers:
            made = providers[provider] = provider_from_settings(
                settings, provider, script=script, endpoints=endpoints)
            if gate is not None and hasattr(made, "on_rate_signal"):  # HTTP providers
                made.on_rate_signal = functools.partial(gate.observe, provider)
        return providers[provider]

    return provider_factory, gate, router


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
