"""The chaos campaign's 3-node Kafka: clients reach each broker through its own Toxiproxy.

Each node gets a second listener, ``CLIENT``, which advertises the address of the node's
proxy (Kafka clients reconnect to advertised addresses, so every connection of a service to a
broker crosses the proxy and its faults). Replication between nodes and the campaign's own
checks use the ``PLAINTEXT`` listener directly. Otherwise it is the local 3-node cluster of
:class:`~dsh_dev.localstack.kafka.KafkaLocal` (replication 3, min ISR 2), plus
:meth:`ProxiedKafka.restart` of a killed node on its own storage.
"""

from __future__ import annotations

import re
from pathlib import Path

from dsh_dev.chaos.toxiproxy import Toxiproxy
from dsh_dev.localstack.kafka import KafkaLocal, NodeSpec
from dsh_dev.localstack.process import free_ports


class ProxiedKafka(KafkaLocal):
    """A 3-node KafkaLocal whose client listener of node ``n`` is behind proxy ``kafka-n``."""

    def __init__(self, lib_dir: Path, workdir: Path, proxies: Toxiproxy, *,
                 heap_mb: int = 384) -> None:
        super().__init__(lib_dir, workdir, nodes=3, heap_mb=heap_mb)
        self._toxiproxy = proxies
        self.client_ports = dict(zip((n.node_id for n in self.nodes), free_ports(3),
                                     strict=True))
        self.proxy_ports: dict[int, int] = {}

    @property
    def proxied_bootstrap(self) -> str:
        """What services use: every node through its proxy."""
        return ",".join(f"127.0.0.1:{self.proxy_ports[n.node_id]}" for n in self.nodes)

    @staticmethod
    def proxy_name(node_id: int) -> str:
        return f"kafka-{node_id}"

    def launch(self) -> None:
        for node in self.nodes:
            self.proxy_ports[node.node_id] = self._toxiproxy.proxy(
                self.proxy_name(node.node_id), self.client_ports[node.node_id])
        super().launch()

    def _render(self, node: NodeSpec) -> str:
        text = super()._render(node)
        client, proxy = self.client_ports[node.node_id], self.proxy_ports[node.node_id]
        text = re.sub(r"^(listeners=.*)$", rf"\1,CLIENT://127.0.0.1:{client}", text,
                      count=1, flags=re.M)
        text = re.sub(r"^(advertised\.listeners=.*)$", rf"\1,CLIENT://127.0.0.1:{proxy}", text,
                      count=1, flags=re.M)
        return re.sub(r"^(listener\.security\.protocol\.map=.*)$", r"\1,CLIENT:PLAINTEXT",
                      text, count=1, flags=re.M)
