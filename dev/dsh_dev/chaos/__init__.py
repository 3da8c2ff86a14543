"""The chaos campaign (``dsh-pipeline chaos``; docs/chaos.md).

Its adapters:

- :mod:`.provider_server`: a local server speaking the OpenAI-compatible streaming protocol
  (also the tests' provider server);
- :mod:`.answers`: its generated answers with realistic timing and provider faults;
- :mod:`.toxiproxy`: the Toxiproxy server and its API (network faults);
- :mod:`.cluster`: the 3-node local Kafka with each broker behind its own proxy;
- :mod:`.sender`: a producer that returns where each record landed (load and garbage).

The campaign over them: :mod:`.campaign` (phases), :mod:`.fleet` (the services it runs),
:mod:`.load`, :mod:`.faults`, :mod:`.invariants`, :mod:`.ledger_check`, :mod:`.report` and
:mod:`.bounded`.
"""
