"""faust-streaming adapter: the processors' batching transport and its stated contract.

faust stays the processors' framework (group membership, changelog tables, standbys,
agents, web routing); this package replaces only how the batched topics are fetched,
handed over and committed. :mod:`.transport` states the rules, :mod:`.commit_rule` holds
the one rule for commits, and :mod:`.private_api` lists every private name of faust and
aiokafka the transport relies on (checked at start and by a test).
"""
